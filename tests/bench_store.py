"""The event store part of tests/benchmark.py (not a test module: pytest does not collect it).

- What the audit log adds to a warm Exec: the appends an Exec makes (PermissionGranted and
  ToolInvocationStarted in one transaction before the command, ToolInvocationCompleted after),
  timed on their own against a store on the same disk as the daemon's. Target: at most 1 ms
  at the median.
- A store holding a million events (1,000 sessions of 1,000 events): QueryEvents for one
  session, in-process and over gRPC through a real daemon opened on that store. Target: under
  50 ms.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import statistics
import subprocess
import tempfile
import time
from typing import Any, Callable

from sandboxd.audit.store import EventStore, EventType, SessionRow

EXEC_TARGET_MS = 1.0
QUERY_TARGET_MS = 50.0


def _ms(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {"median_ms": statistics.median(ordered) * 1000,
            "p95_ms": ordered[min(len(ordered) - 1, int(len(ordered) * 0.95))] * 1000, "n": len(ordered)}


def _timed(fn: Callable[[], Any], runs: int) -> list[float]:
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return samples


def exec_append_cost(directory: str, runs: int) -> dict[str, float]:
    store = EventStore(os.path.join(directory, "exec-cost.db"))
    try:
        session = "bench-exec"

        def one_exec() -> None:
            store.append_many(session, [
                (EventType.PERMISSION_GRANTED, "call_x", "shell.exec", {"by": "policy", "effect": "read-only"}),
                (EventType.TOOL_STARTED, "call_x", "shell.exec", {"arguments": {"argv": ["true"], "cwd": "/ws"}}),
            ])
            store.append(session, EventType.TOOL_COMPLETED, call_id="call_x", tool="shell.exec",
                         data={"exit_code": 0, "signal": 0, "timed_out": False, "wall_seconds": 0.005})
        _timed(one_exec, 20)
        return _ms(_timed(one_exec, runs))
    finally:
        store.close()


def populate(path: str, sessions: int, per_session: int) -> list[str]:
    """A store with sessions x per_session events (bulk-loaded: the load is not what is measured)."""
    store = EventStore(path)
    ids = [f"bench{n:05d}" for n in range(sessions)]
    now = time.time()
    for session_id in ids:
        store.save_session(SessionRow(session_id, 0, 0, "", "/ws", {"name": "workspace-write"}, "never", {}, {}, {},
                                      now, now))
    kinds = [EventType.PERMISSION_GRANTED, EventType.TOOL_STARTED, EventType.TOOL_COMPLETED]
    data = json.dumps({"by": "policy", "summary": "Execute: pytest -q", "exit_code": 0})
    db = store._db                                   # bulk load, bypassing the per-event API on purpose
    batch = []
    for seq in range(1, per_session + 1):            # interleaved, as concurrent sessions would write
        for session_id in ids:
            batch.append((session_id, seq, kinds[seq % 3], now + seq, f"call_{seq // 3}", "shell.exec", data))
        if len(batch) >= 200_000:
            db.execute("BEGIN")
            db.executemany("INSERT INTO events (session_id, seq, type, time, call_id, tool, data) "
                           "VALUES (?, ?, ?, ?, ?, ?, ?)", batch)
            db.execute("COMMIT")
            batch = []
    if batch:
        db.execute("BEGIN")
        db.executemany("INSERT INTO events (session_id, seq, type, time, call_id, tool, data) "
                       "VALUES (?, ?, ?, ?, ?, ?, ?)", batch)
        db.execute("COMMIT")
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    store.close()
    return ids


def grpc_query_times(state_dir: str, ids: list[str], runs: int, page_size: int, sandboxd: str) -> list[float]:
    """QueryEvents through a real daemon opened on the populated store."""
    import grpc

    from sandboxd.v1 import sandboxd_pb2 as pb
    from sandboxd.v1 import sandboxd_pb2_grpc as pb_grpc

    socket_path = os.path.join(state_dir, "sandboxd.sock")
    daemon = subprocess.Popen([sandboxd, "serve", "--socket", socket_path, "--state-dir", state_dir],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        channel = grpc.insecure_channel("unix:" + socket_path)
        grpc.channel_ready_future(channel).result(timeout=60)
        stub = pb_grpc.SandboxStub(channel)
        rng = random.Random(7)
        stub.QueryEvents(pb.QueryEventsRequest(session_id=ids[0], page_size=page_size), timeout=60)
        samples = _timed(lambda: stub.QueryEvents(pb.QueryEventsRequest(
            session_id=rng.choice(ids), page_size=page_size), timeout=60), runs)
        channel.close()
        return samples
    finally:
        daemon.terminate()
        daemon.wait(timeout=60)


def run_store_section(*, exec_median_ms: float | None, runs: int, sessions: int, per_session: int,
                      sandboxd: str) -> dict[str, Any]:
    directory = tempfile.mkdtemp(prefix="sandboxd-bench-store-", dir="/var/tmp")
    try:
        cost = exec_append_cost(directory, max(runs, 200))
        share = "" if exec_median_ms is None else f" of a {exec_median_ms:.2f} ms warm Exec"
        verdict = "OK" if cost["median_ms"] <= EXEC_TARGET_MS else "MISSED"
        print(f"audit appends per Exec (granted+started, then completed; two commits, WAL, synchronous=NORMAL): "
              f"median {cost['median_ms']:.3f} ms, p95 {cost['p95_ms']:.3f} ms{share} "
              f"(target <= {EXEC_TARGET_MS:g} ms)  {verdict}")
        state = os.path.join(directory, "state")
        path = os.path.join(state, "events.db")
        started = time.monotonic()
        ids = populate(path, sessions, per_session)
        load_s = time.monotonic() - started
        size_mb = sum(os.path.getsize(os.path.join(state, n)) for n in os.listdir(state)) / 2**20
        store = EventStore(path)
        rng = random.Random(11)
        try:
            first_page = _ms(_timed(lambda: store.query(session_ids=[rng.choice(ids)], limit=100), runs))
            whole = _ms(_timed(lambda: store.session_events(rng.choice(ids)), runs))
        finally:
            store.close()
        over_grpc = _ms(grpc_query_times(state, ids, runs, 100, sandboxd))
        over_grpc_full = _ms(grpc_query_times(state, ids, runs, 1000, sandboxd))
        total = sessions * per_session
        print(f"event store with {total:,} events ({sessions} sessions x {per_session}; {size_mb:.0f} MiB on disk, "
              f"bulk-loaded in {load_s:.1f} s):")
        print(f"  QueryEvents(session), first page of 100, in-process: median {first_page['median_ms']:.2f} ms, "
              f"p95 {first_page['p95_ms']:.2f} ms")
        print(f"  a whole session ({per_session} events) in-process: median {whole['median_ms']:.2f} ms")
        print(f"  over gRPC through the daemon, page of 100: median {over_grpc['median_ms']:.2f} ms, "
              f"p95 {over_grpc['p95_ms']:.2f} ms; page of 1000: median {over_grpc_full['median_ms']:.2f} ms")
        worst = max(over_grpc["median_ms"], first_page["median_ms"])
        print(f"QueryEvents for one session in a million-event store: {worst:.2f} ms "
              f"(target < {QUERY_TARGET_MS:g} ms)  {'OK' if worst < QUERY_TARGET_MS else 'MISSED'}")
        return {"exec_append": cost, "events": total, "size_mib": size_mb, "load_s": load_s,
                "query_first_page": first_page, "query_whole_session": whole, "grpc_page_100": over_grpc,
                "grpc_page_1000": over_grpc_full,
                "targets": {"audit_per_exec_ms": cost["median_ms"], "query_one_session_ms": worst}}
    finally:
        shutil.rmtree(directory, ignore_errors=True)
