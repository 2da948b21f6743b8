"""The adoption benchmark (``tests/bench_adopt.py --sessions N``): how long a new daemon takes from
its start to serving when a surviving supervisor holds N sessions (each with a call running).

Not a test: it prints numbers. It starts one ``sandboxd serve`` with ``supervisor.survive_restart``,
opens N READ_ONLY sessions as root (each in a workspace of its own; READ_ONLY: no git guard, whose
inotify instances root has few of) and starts ``sleep`` in each, SIGKILLs the daemon and starts a
new one on the same socket and state: the time from its start to its "serving" line and to a
health check that says SERVING (what a client waits for), and its first call in an adopted session.
``--control`` runs the same with ``survive_restart = false``: the sessions are restored from the
store and each rebuilt by its first call instead.

    .venv/bin/python tests/bench_adopt.py --sessions 50
    .venv/bin/python tests/bench_adopt.py --sessions 50 --control
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from daemon_helpers import (Daemon, ExecCall, create_session, exec_start, make_base_dir, read_only,  # noqa: E402
                            remove_tree, run_exec)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=20)
    parser.add_argument("--control", action="store_true", help="survive_restart = false")
    args = parser.parse_args()
    env = {"SANDBOXD_SUPERVISOR_SURVIVE_RESTART": "false" if args.control else "true"}
    base = make_base_dir("sbxbench-adopt-")
    first = second = None
    calls: list[ExecCall] = []
    try:
        first = Daemon(base, env=env).start()
        sessions = []
        for index in range(args.sessions):
            workspace = base / f"ws-{index}"
            workspace.mkdir()
            session = create_session(first.stub, workspace, read_only())
            calls.append(ExecCall(first.stub, exec_start(session.id, shell="echo up; exec sleep 120")))
            sessions.append(session)
        for call in calls:
            call.wait_stdout(b"up")
        first.kill()
        for call in calls:
            threading.Thread(target=call.close, daemon=True).start()
        started = time.monotonic()
        second = Daemon(base, env=env)
        second.start()
        healthy = time.monotonic() - started
        lines = second.log_lines()
        serving = next(line for line in lines if line.get("msg") == "serving")
        first_call = time.monotonic()
        outcome = run_exec(second.stub, sessions[0].id, shell="true")
        first_call = time.monotonic() - first_call
        assert outcome.result is not None and outcome.result.exit_code == 0, outcome.describe()
        print(f"sessions={args.sessions} survive={not args.control} supervisor={serving.get('supervisor')} "
              f"adopted_sessions={serving.get('adopted_sessions')} adopted_calls={serving.get('adopted_calls')} "
              f"start_to_healthy={healthy:.3f}s first_call={first_call * 1000:.1f}ms")
        return 0
    finally:
        if second is not None:
            second.close()
        if first is not None:
            first.close()
        remove_tree(base)


if __name__ == "__main__":
    sys.exit(main())
