"""The idle-sessions benchmark (``tests/bench_idle.py --sessions N``): what N open, idle sessions cost.

Not a test: it prints numbers. It starts one ``sandboxd serve`` (tests/benchmark.py's
DaemonProcess), opens ``--sessions`` sessions as root (its quota, ``quotas.root_sessions``, raised for it;
each in a workspace of its own, READ_ONLY by default: a WORKSPACE_WRITE session's git guard holds an
inotify instance, and root has 128 on the whole machine, shared with every other root process)
and runs one ``true`` in each (a warm sandbox, as an agent leaves it). Then, after ``--settle``
seconds, it holds them idle for ``--seconds`` and measures, from /proc:

* CPU: utime + stime deltas (clock ticks) of the daemon, the fork server and every sandbox
  process (the descendants of the fork server), and voluntary + involuntary context switches
  (the wakeups: a timer or a poll shows here first, before it adds up to a tick), per thread of
  the daemon and the fork server, and summed over the sandboxes;
* memory: VmRSS and PSS (smaps_rollup) of the daemon and the fork server, before the first
  session and with all of them open; the PSS of every sandbox process, summed and per session;
* what limits the count: open fds of both, inotify instances held, sandbox processes;
* a warm ``true`` in a session of root's own, with that session alone and again with all the
  others open (issue 18: at most 2x), through both RPCs as a gRPC runtime drives them
  (bench_rpcs: the generated stubs, a channel each; ``Exec``, the stream, and ``Run``), back to
  back and after an idle pause, interleaved round-robin with a one-shot bwrap and a bare spawn.

``--users U`` splits the sessions over U plain users made for the run (removed after), each
creating its share in a client of its own as that user (16 users x 64 sessions: the default
``quotas.sessions_per_uid``).

    .venv/bin/python tests/bench_idle.py --sessions 200 --seconds 60
    .venv/bin/python tests/bench_idle.py --sessions 1024 --users 16 --seconds 60
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from plain_users import plain_user  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def cpu_and_switches(proc_dir: str) -> tuple[int, int] | None:
    """(utime + stime ticks, voluntary + involuntary context switches) of /proc/PID or /proc/PID/task/TID."""
    try:
        with open(f"{proc_dir}/stat", encoding="utf-8") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
        switches = 0
        with open(f"{proc_dir}/status", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith(("voluntary_ctxt_switches:", "nonvoluntary_ctxt_switches:")):
                    switches += int(line.split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return int(fields[11]) + int(fields[12]), switches


def threads(pid: int) -> dict[str, tuple[int, int]]:
    """{"tid name": (ticks, switches)} of every thread of ``pid``."""
    out: dict[str, tuple[int, int]] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        sample = cpu_and_switches(f"/proc/{pid}/task/{tid}")
        try:
            with open(f"/proc/{pid}/task/{tid}/comm", encoding="utf-8") as handle:
                name = handle.read().strip()
        except OSError:
            continue
        if sample is not None:
            out[f"{tid} {name}"] = sample
    return out


def inotify_instances(pid: int) -> int:
    count = 0
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") == "anon_inode:inotify":
                    count += 1
            except OSError:
                pass
    except OSError:
        pass
    return count


def snapshot(daemon: Any) -> dict[str, Any]:
    from benchmark import descendants

    fork = daemon.fork_server_pid()
    boxes = descendants(fork) if fork else {}
    return {"serve": threads(daemon.pid), "fork": threads(fork) if fork else {},
            "boxes": {pid: cpu_and_switches(f"/proc/{pid}") for pid in boxes}}


def deltas(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
    return {name: (after[name][0] - before[name][0], after[name][1] - before[name][1])
            for name in after if name in before}


def memory(daemon: Any) -> dict[str, Any]:
    mem = daemon.memory()
    fork = mem.get("fork_server_pid")
    mem["serve_fds"] = len(os.listdir(f"/proc/{daemon.pid}/fd"))
    mem["fork_fds"] = len(os.listdir(f"/proc/{fork}/fd")) if fork else None
    mem["inotify_instances"] = inotify_instances(daemon.pid) + (inotify_instances(fork) if fork else 0)
    return mem


# One user's share of the sessions, created by that user (the daemon checks the workspace as the caller).
_USER_FILL = r'''
import time
from sandboxd.client import SandboxClient, sandbox_policy
client = SandboxClient(ARGS["socket"])
created_ms, ids = [], []
for workspace in ARGS["workspaces"]:
    began = time.monotonic()
    session_id = client.create_session(workspace, policy=sandbox_policy(ARGS["policy"]), approval="never").id
    created_ms.append((time.monotonic() - began) * 1e3)
    ids.append(session_id)
    if ARGS["exec_each"]:
        assert client.exec(session_id, ["true"]).result.shell_status == 0
print(json.dumps({"created_ms": created_ms, "ids": ids}))
'''


def warm_calls(socket_path: str, session_id: str, rounds: int, pause_ms: float) -> list[dict[str, Any]]:
    """``rounds`` interleaved rounds of bench_rpcs.variants in one session (after 3 warm-up
    rounds): a row (benchmark.build_daemon_rows: median, p95, x bwrap, failures) per variant."""
    import bench_rpcs
    from benchmark import SHUFFLE_SEED, build_daemon_rows

    calls = bench_rpcs.RawCalls(socket_path)
    devnull = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    try:
        variants = bench_rpcs.variants(calls, session_id, devnull, pause_ms)
        bench_rpcs.measure(variants, rounds, 3, SHUFFLE_SEED + 2, pause_ms)
    finally:
        os.close(devnull)
        calls.close()
    return build_daemon_rows(variants)


def fill_as_users(daemon: Any, base: str, users: list[tuple[int, int]], count: int, exec_each: bool,
                  policy: str, sessions: Any) -> list[float]:
    """``count`` sessions split evenly over ``users``, each user creating its own in a client of its
    own (one after another, so every fill level is measured); CreateSession times in order. The
    sessions go into ``sessions``, which root closes at the end (root may close any session)."""
    from daemon_helpers import run_client_as

    created: list[float] = []
    per_user = count // len(users)
    for n, (uid, gid) in enumerate(users):
        workspaces = []
        for i in range(per_user):
            workspace = os.path.join(base, f"ws-{n}-{i}")
            os.mkdir(workspace)
            os.chown(workspace, uid, gid)
            workspaces.append(workspace)
        out = run_client_as(uid, gid, daemon.socket, _USER_FILL, {"workspaces": workspaces, "policy": policy,
                                                                  "exec_each": exec_each}, timeout=600)
        created.extend(out["created_ms"])
        for session_id in out["ids"]:
            sessions.add(session_id)
    return created


def run(count: int, seconds: float, settle: float, exec_each: bool, policy: str,
        users: list[tuple[int, int]] | None = None, rounds: int = 200,
        pause_ms: float = 60.0, tree: str | None = None) -> dict[str, Any]:
    """N idle sessions: fill, memory, CPU while idle, and a warm Exec in a session of root's own
    with one session open and with all N open. ``users``: the N sessions are theirs, split evenly."""
    from benchmark import DaemonProcess, Sessions, exec_true
    from sandboxd.client import SandboxClient, sandbox_policy

    base = tempfile.mkdtemp(prefix="sandboxd-idle-", dir="/var/tmp")
    os.chmod(base, 0o755)
    daemon = DaemonProcess(base, tree)
    sessions = Sessions()
    report: dict[str, Any] = {"sessions": count, "seconds": seconds, "policy": policy, "rounds": rounds,
                              "pause_ms": pause_ms, "uptime_start": open("/proc/loadavg").read()}
    try:
        report["ready_s"] = daemon.start()
        time.sleep(settle)
        report["memory_empty"] = memory(daemon)
        with SandboxClient(daemon.socket) as client:
            probe_ws = os.path.join(base, "probe")
            os.mkdir(probe_ws)
            probe = client.create_session(probe_ws, policy=sandbox_policy(policy), approval="never").id
            sessions.add(probe)
            exec_true(client, probe)
            report["calls_alone"] = warm_calls(daemon.socket, probe, rounds, pause_ms)
            started = time.monotonic()
            create_ms: list[float] = []
            for i in range(count if not users else 0):
                workspace = os.path.join(base, f"ws-{i}")
                os.mkdir(workspace)
                began = time.monotonic()
                session_id = client.create_session(workspace, policy=sandbox_policy(policy), approval="never").id
                sessions.add(session_id)
                create_ms.append((time.monotonic() - began) * 1e3)
                if exec_each:
                    exec_true(client, session_id)
            if users:
                create_ms = fill_as_users(daemon, base, users, count, exec_each, policy, sessions)
            report["fill_s"] = time.monotonic() - started
            create_ms.sort()
            report["create_ms"] = {"p50": create_ms[len(create_ms) // 2], "first": create_ms[0],
                                   "last_tenth_p50": sorted(create_ms[-max(1, count // 10):])[max(1, count // 10) // 2],
                                   "max": create_ms[-1]}
            time.sleep(settle)
            report["memory_full"] = memory(daemon)
            before, began = snapshot(daemon), time.monotonic()
            time.sleep(seconds)
            after, elapsed = snapshot(daemon), time.monotonic() - began
            report["idle_elapsed_s"] = elapsed
            serve, fork = deltas(before["serve"], after["serve"]), deltas(before["fork"], after["fork"])
            boxes = {pid: (a[0] - b[0], a[1] - b[1]) for pid, a in after["boxes"].items()
                     if a is not None and (b := before["boxes"].get(pid)) is not None}
            report["idle"] = {
                "serve_ticks": sum(t for t, _ in serve.values()), "serve_switches": sum(s for _, s in serve.values()),
                "serve_threads_waking": {n: d for n, d in serve.items() if d != (0, 0)},
                "fork_ticks": sum(t for t, _ in fork.values()), "fork_switches": sum(s for _, s in fork.values()),
                "fork_threads_waking": {n: d for n, d in fork.items() if d != (0, 0)},
                "box_processes": len(boxes), "box_ticks": sum(t for t, _ in boxes.values()),
                "box_switches": sum(s for _, s in boxes.values()),
                "boxes_waking": sum(1 for d in boxes.values() if d != (0, 0)),
                "tick_hz": TICK,
            }
            ticks = report["idle"]["serve_ticks"] + report["idle"]["fork_ticks"] + report["idle"]["box_ticks"]
            report["idle"]["cpu_percent_of_one_core"] = 100.0 * ticks / TICK / elapsed
            report["calls_among"] = warm_calls(daemon.socket, probe, rounds, pause_ms)
        report["uptime_end"] = open("/proc/loadavg").read()
    finally:
        began = time.monotonic()
        report["left_open"] = sessions.close_all(daemon.socket)[0] if daemon.running() else None
        report["close_all_s"] = time.monotonic() - began
        daemon.stop()
        report["exit_code"] = daemon.exit_code
        report["log_problems"] = daemon.log_problems()[:5]
        shutil.rmtree(base, ignore_errors=True)
    return report


def print_report(report: dict[str, Any]) -> None:
    def mib(kib: int | None) -> str:
        return "-" if kib is None else f"{kib / 1024:.1f}"

    n = report["sessions"]
    if report.get("users"):
        print(f"owners: {report['users']} plain users, {n // report['users']} sessions each")
    print(f"{n} {report['policy']} sessions opened in {report['fill_s']:.1f} s; CreateSession ms {report['create_ms']}")
    for label in ("memory_empty", "memory_full"):
        mem = report[label]
        print(f"{label}: serve RSS {mib(mem['serve'].get('rss_kib'))} MiB PSS {mib(mem['serve'].get('pss_kib'))}, "
              f"fork RSS {mib(mem['fork_server'].get('rss_kib'))} PSS {mib(mem['fork_server'].get('pss_kib'))}, "
              f"sum RSS {mib(mem['sum_rss_kib'])} MiB; sandbox processes {mem['sandbox_processes']} "
              f"PSS {mib(mem['sandbox_pss_kib'])} MiB; fds serve {mem['serve_fds']} fork {mem['fork_fds']}; "
              f"inotify {mem['inotify_instances']}")
    full, empty = report["memory_full"], report["memory_empty"]
    print(f"per session: sandbox PSS {full['sandbox_pss_kib'] / n:.0f} KiB, daemon+fork RSS "
          f"+{(full['sum_rss_kib'] - empty['sum_rss_kib']) / n:.0f} KiB, PSS "
          f"+{(full['sum_pss_kib'] - empty['sum_pss_kib']) / n:.0f} KiB")
    idle = report["idle"]
    print(f"idle {report['idle_elapsed_s']:.1f} s: ticks serve {idle['serve_ticks']} fork {idle['fork_ticks']} "
          f"sandboxes {idle['box_ticks']} ({idle['box_processes']} processes, {idle['boxes_waking']} woke) -> "
          f"{idle['cpu_percent_of_one_core']:.3f}% of a core; switches serve {idle['serve_switches']} "
          f"fork {idle['fork_switches']} sandboxes {idle['box_switches']}")
    for side in ("serve_threads_waking", "fork_threads_waking"):
        for name, (ticks, switches) in sorted(idle[side].items(), key=lambda kv: -kv[1][1]):
            print(f"  {side[:5]} thread {name}: {ticks} ticks, {switches} switches")
    print_calls(report["calls_alone"], report["calls_among"], n, report["rounds"], report["pause_ms"])
    print(f"loadavg start {report['uptime_start'].strip()}  end {report['uptime_end'].strip()}; "
          f"closing them took {report['close_all_s']:.1f} s, {report['left_open']} left open; "
          f"exit {report['exit_code']}, log problems {len(report['log_problems'])}: {report['log_problems'][:2]}")


def print_calls(alone: list[dict[str, Any]], among: list[dict[str, Any]], n: int, rounds: int,
                pause_ms: float) -> None:
    """The warm calls in the probe session, alone and among the ``n`` others: each row's medians,
    among / alone, and both against the bwrap of the same phase."""
    from benchmark import fmt, ratio

    print(f"warm `true` in one session of root's, {rounds} rounds per phase, interleaved (bench_rpcs; "
          f"'after a pause': {pause_ms:g} ms idle first): median ms")
    header = (f"{'call':<24} | {'alone':>7} | {'x bwrap':>7} | {f'among {n}':>10} | {'x bwrap':>7} | "
              f"{'among/alone':>11} | fail")
    print(header)
    print("-" * len(header))
    after = {row["name"]: row for row in among}
    for row in alone:
        other = after.get(row["name"], {})
        print(f"{row['name']:<24} | {fmt(row['median_ms'], '7.2f')} | {fmt(row['x_bwrap'], '7.2f')} | "
              f"{fmt(other.get('median_ms'), '10.2f')} | {fmt(other.get('x_bwrap'), '7.2f')} | "
              f"{fmt(ratio(other.get('median_ms'), row['median_ms']), '11.2f')} | "
              f"{row['failures'] + other.get('failures', 0)}")
        for failed in (row, other):
            if failed.get("failures"):
                print(f"  FAILURES {row['name']}: {failed['first_error']}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sessions", type=int, default=200)
    p.add_argument("--seconds", type=float, default=60.0, help="idle window measured (default 60)")
    p.add_argument("--settle", type=float, default=5.0, help="seconds before each measurement (default 5)")
    p.add_argument("--policy", default="read-only", choices=["read-only", "workspace-write"],
                   help="the sessions' sandbox policy (default read-only: a workspace-write session's git guard "
                        "holds an inotify instance, and root has 128 on the whole machine)")
    p.add_argument("--no-exec", action="store_true", help="do not run `true` once in each session")
    p.add_argument("--users", type=int, default=0,
                   help="split the sessions over this many plain users made for the run (each at most "
                        "quotas.sessions_per_uid, 64 by default); 0: all root's")
    p.add_argument("--rounds", type=int, default=200,
                   help="interleaved rounds of the warm calls (bench_rpcs), alone and among the sessions (default 200)")
    p.add_argument("--pause-ms", type=float, default=60.0,
                   help="idle time before the 'after a pause' calls (default 60; 0: leave them out)")
    p.add_argument("--tree", metavar="DIR",
                   help="run the daemon from this source tree instead of this checkout, for before/after figures: "
                        "another revision's sandboxd package with its call helper built (`git archive REV sandboxd "
                        "| tar -x -C DIR`, then from outside any checkout `PYTHONPATH=DIR .venv/bin/python -m "
                        "sandboxd.launcher.native_call build`)")
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args()
    with contextlib.ExitStack() as stack:
        users = [stack.enter_context(plain_user()) for _ in range(args.users)]
        report = run(args.sessions, args.seconds, args.settle, not args.no_exec, args.policy, users or None,
                     args.rounds, args.pause_ms, args.tree)
        report["users"] = args.users
    print_report(report)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(report, handle, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
