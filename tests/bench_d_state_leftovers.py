"""The D-state leftovers benchmark (issue 24, items 2 and 3): what a user's slowly dying calls cost
everyone else (``tests/bench_d_state_leftovers.py``, as root, where /dev/fuse exists).

Not a test: it prints one JSON object. With two plain users made for the run (removed after) and
one daemon in a fresh base, it measures, as tests/test_d_state_leftovers.py's attack does it:

* ``quiet``: the victim's CreateSession + Exec + CloseSession rounds for 5 s;
* ``during``: the same rounds for 15 s from the moment the attacker's four danger-full-access calls
  (each leaving ``stat`` in D state on the attacker's own stuck FUSE mount when it times out after
  1 s) have reached the mount; ``attacker_calls_s``: when each of those calls ended;
* ``crash_served_after_s``: the fork server SIGKILLed with those leftovers: how long until the
  victim's next round succeeds (None, and ``crash_daemon_exited``, if the daemon exits instead);
* ``fresh_daemon_serving_after_s``: the daemon SIGKILLed with the leftovers still there: how long
  a new daemon on the same base takes to serve.

``--wait-seconds N`` sets ``fork_server.wait_seconds`` (a victim's request that waits on the loop
longer than that fails; main blamed the victim's own path then). Run it on a branch, then with
main's ``sandboxd/`` checked out in the same worktree, for the before and after.

    .venv/bin/python tests/bench_d_state_leftovers.py
    .venv/bin/python tests/bench_d_state_leftovers.py --wait-seconds 2
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import stat
import time
from typing import Any

import test_d_state_leftovers as attack_test
from daemon_helpers import Daemon, daemon_factory, plain_users


def load() -> list[str]:
    with open("/proc/loadavg") as f:
        return f.read().split()[:3]


def measure(wait_seconds: float | None) -> dict[str, Any]:
    out: dict[str, Any] = {"load_before": load()}
    try:
        run(out, wait_seconds)
    except AssertionError as exc:                       # the factory's leak check: what was left behind
        out["left_behind"] = str(exc)[-800:]
    out["load_after"] = load()
    return out


def run(out: dict[str, Any], wait_seconds: float | None) -> None:
    with plain_users(2) as (attacker, victim), daemon_factory("sbxbench-") as factory:
        config = None if wait_seconds is None else f"[fork_server]\nwait_seconds = {wait_seconds}\n"
        daemon = factory(config=config)
        workspace = attack_test.owned_dir(factory.base / "ws-victim", victim)
        out["quiet"] = attack_test.summary(attack_test.victim_rounds(daemon, victim, workspace, 5.0))
        attack = attack_test.Attack(daemon, attacker, factory.base)
        try:
            attack.start()
            out["during"] = attack_test.summary(attack_test.victim_rounds(daemon, victim, workspace, 15.0))
            attack.join()
            out["attacker_calls_s"] = [round(call.get("seconds", -1), 2) for call in attack.result["calls"]]
            out["leftovers"] = len(attack.leftovers())
            out["watchdog_fired"] = "did not answer a ping" in daemon.log()

            dead = daemon.fork_server_pid()
            assert dead is not None and daemon.proc is not None
            os.kill(dead, signal.SIGKILL)
            killed = time.monotonic()
            served = None
            while time.monotonic() - killed < 120 and daemon.proc.poll() is None:
                rounds = attack_test.victim_rounds(daemon, victim, workspace, 0.0)
                if rounds[0].get("ok"):
                    served = round(rounds[0]["ended"] - killed, 2)
                    break
                time.sleep(0.05)
            out["crash_served_after_s"] = served
            out["crash_daemon_exited"] = daemon.proc.poll()

            if daemon.proc.poll() is None:
                daemon.kill()
            out["leftovers_at_fresh_start"] = len(attack.leftovers())
            began = time.monotonic()
            fresh = Daemon(factory.base).start()
            out["fresh_daemon_serving_after_s"] = round(time.monotonic() - began, 2)
            out["fresh_victim_ok"] = bool(attack_test.victim_rounds(fresh, victim, workspace, 0.0)[0].get("ok"))
        finally:
            attack.release()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wait-seconds", type=float, default=None, help="fork_server.wait_seconds")
    args = parser.parse_args()
    mode = stat.S_IMODE(os.stat("/dev/fuse").st_mode)
    os.chmod("/dev/fuse", mode | 0o666)                 # what a plain user needs to mount FUSE
    try:
        print(json.dumps(measure(args.wait_seconds)))
    finally:
        os.chmod("/dev/fuse", mode)


if __name__ == "__main__":
    main()
