"""The audit appends of one Exec, timed one by one (not a test: pytest does not collect it).

`EventStore.append_many` (PermissionGranted + ToolInvocationStarted) then `append`
(ToolInvocationCompleted), as the daemon does them for every Exec, N times after WARM rounds, PACE
seconds apart, on a store in a fresh directory under /var/tmp (the daemon's disk). Prints the CPU
per Exec's appends (this process, the store's own thread included) and the latency percentiles,
where the WAL checkpoints show up (tests/bench_store.py reports only the median and p95).

    N=3000 WARM=200 PACE=0.002 .venv/bin/python tests/bench_audit_appends.py [CHECKOUT]

CHECKOUT (default: this one) is put first on sys.path, so another checkout's store can be timed
with the same script, interleaved (the before/after in docs/perf-notes/18-rpc.md).
"""
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, sys.argv[1] if len(sys.argv) > 1 else str(Path(__file__).resolve().parents[1]))
from sandboxd.audit.store import EventStore, EventType  # noqa: E402

N = int(os.environ.get("N", "3000"))
WARM = int(os.environ.get("WARM", "200"))
PACE = float(os.environ.get("PACE", "0"))


def main() -> None:
    directory = tempfile.mkdtemp(dir="/var/tmp", prefix="sbxd-appends-")
    store = EventStore(os.path.join(directory, "events.db"))
    try:
        def one() -> None:
            store.append_many("s", [
                (EventType.PERMISSION_GRANTED, "call_x", "shell.exec", {"by": "policy", "effect": "read-only"}),
                (EventType.TOOL_STARTED, "call_x", "shell.exec", {"arguments": {"argv": ["true"], "cwd": "/ws"}})])
            store.append("s", EventType.TOOL_COMPLETED, call_id="call_x", tool="shell.exec",
                         data={"exit_code": 0, "wall_seconds": 0.005})
        for _ in range(WARM):
            one()
        latencies = []
        before = resource.getrusage(resource.RUSAGE_SELF)
        for _ in range(N):
            began = time.perf_counter()
            one()
            latencies.append(time.perf_counter() - began)
            if PACE:
                time.sleep(PACE)
        after = resource.getrusage(resource.RUSAGE_SELF)
        cpu_ms = (after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime) / N * 1000
        latencies.sort()
        pick = lambda q: latencies[min(N - 1, int(N * q))] * 1000  # noqa: E731
        thread = getattr(store, "_checkpoints", None)
        print(f"{sys.path[0]}: {N} Execs' appends, {PACE * 1000:g} ms apart; CPU {cpu_ms:.3f} ms per Exec; "
              f"p50 {pick(0.5):.3f} p99 {pick(0.99):.3f} p99.9 {pick(0.999):.3f} max {latencies[-1] * 1000:.2f} ms; "
              f"syncs/checkpoints by the store's thread: "
              f"{f'{thread.syncs}/{thread.checkpoints}' if thread is not None else 'none (sqlite checkpoints in the writer)'}; "
              f"loadavg {os.getloadavg()}")
    finally:
        store.close()
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
