"""The audit chain's costs (not a test: pytest does not collect it). Prints:

- per-event append CPU with the chain and a signed checkpoint every audit.checkpoint_events (the
  daemon's store, open_in_state_dir) — compare the store without the chain with
  `tests/bench_audit_appends.py /work/main` (an Exec's three appends) against this checkout;
- one checkpoint's cost (an Ed25519 signature and its row);
- verify speed (events/s) over N events, offline through `open_read_only`;
- a prune under audit.max_bytes: used bytes, file and WAL sizes before and after.

    N=100000 .venv/bin/python tests/bench_audit_chain.py [CHECKOUT]

CHECKOUT (default: this one) is put first on sys.path; one without the chain (main before it)
gets the appends line only, the same workload: the before/after.
"""
import os
import resource
import shutil
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, sys.argv[1] if len(sys.argv) > 1 else str(Path(__file__).resolve().parents[1]))
from sandboxd.audit.store import EventType, open_in_state_dir  # noqa: E402
from sandboxd.policy.audit_limits import AuditLimits  # noqa: E402

CHAINED = hasattr(AuditLimits(), "checkpoint_events")

N = int(os.environ.get("N", "100000"))


def cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    directory = tempfile.mkdtemp(dir="/var/tmp", prefix="sbxd-chain-")
    try:
        store = open_in_state_dir(directory, limits=AuditLimits(**({"checkpoint_events": 1000} if CHAINED else {})))
        data = {"arguments": {"argv": ["sh", "-c", "make test"], "cwd": "/ws"}, "by": "policy"}
        began, wall = cpu(), time.perf_counter()
        for index in range(N):
            store.append(f"s{index % 50}", EventType.TOOL_STARTED, call_id=f"call_{index}", tool="shell.exec",
                         data=data)
        spent, wall = cpu() - began, time.perf_counter() - wall
        print(f"{sys.path[0]}: appends: {N} events, CPU {spent / N * 1e6:.1f} us/event, wall {wall / N * 1e6:.1f} "
              f"us/event ({'chain + a signed checkpoint every 1000' if CHAINED else 'no chain'}); "
              f"loadavg {os.getloadavg()[0]:.1f}")
        if not CHAINED:
            store.close()
            return
        from sandboxd.audit.integrity.keys import read_public_of_state
        from sandboxd.audit.integrity.retention import used_bytes
        from sandboxd.audit.integrity.verify import Verifier, open_read_only

        chain = store._chain
        began = time.perf_counter()
        for _ in range(200):
            with store._lock:
                chain.checkpoint("periodic")
        print(f"checkpoint: {(time.perf_counter() - began) / 200 * 1e3:.3f} ms each (sign + insert + commit)")
        store.close()
        path = os.path.join(directory, "events.db")
        db = open_read_only(path)
        report = Verifier(db, read_public_of_state(directory), pinned=True).verify()
        db.close()
        print(f"verify: {report.events} events in {report.seconds:.2f} s = {report.events / report.seconds:,.0f} "
              f"events/s; {report.text()[:120]}")
        size_before = os.path.getsize(path)
        db = sqlite3.connect(path)
        limit = max(16 << 20, used_bytes(db) // 2)
        db.close()
        began = time.perf_counter()
        store = open_in_state_dir(directory, limits=AuditLimits(max_bytes=limit))
        assert store._pruner is not None
        store._pruner.stop()                      # after its first run, at open
        seconds, pruned = time.perf_counter() - began, store._pruner.last
        assert pruned is not None
        print(f"prune to {limit >> 10} KiB (at open, on the store's thread): {pruned.events} events in {seconds:.2f} s; "
              f"used {pruned.used_before >> 10} -> {pruned.used_after >> 10} KiB; file {size_before >> 10} -> "
              f"{os.path.getsize(path) >> 10} KiB; WAL after {os.path.getsize(path + '-wal')} bytes")
        store.close()
        db = open_read_only(path)
        report = Verifier(db, read_public_of_state(directory), pinned=True).verify()
        db.close()
        print(f"verify after the prune: {report.text()[:160]}")
    finally:
        shutil.rmtree(directory)


if __name__ == "__main__":
    main()
