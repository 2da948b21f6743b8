"""How fast one plain user grows the audit log (not a test: pytest does not collect it).

The attack of issue 24, item 7: a plain user made here floods its own session with Exec calls
whose argv is as large as the kernel takes (ARGS arguments of ARG_BYTES each, the last of them
131,071 bytes: MAX_ARG_STRLEN), THREADS at once, for FLOOD_SECONDS; the store's file is measured
before and after the daemon stopped (its WAL checkpointed into events.db; the WAL alone is up to
40 MiB of reused space), and how many calls ran, were refused and why.

    FLOOD_SECONDS=10 THREADS=16 .venv/bin/python tests/bench_audit_flood.py [CONFIG_TEXT]

CONFIG_TEXT (optional) is the daemon's config file, e.g. '[audit]\\nowner_budget = "1G"' to see
the growth without the budget. Run from a checkout whose .venv has been set up
(packaging/setup.sh test); it starts that checkout's daemon in a fresh directory under /var/tmp.
"""
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from daemon_helpers import daemon_factory, plain_users, run_client_as  # noqa: E402

SECONDS = float(os.environ.get("FLOOD_SECONDS", "10"))
THREADS = int(os.environ.get("THREADS", "16"))
ARGS = int(os.environ.get("ARGS", "14"))
ARG_BYTES = int(os.environ.get("ARG_BYTES", "131071"))

FLOOD = r'''
import threading, time
session = stub.CreateSession(pb.CreateSessionRequest(workspace=ARGS["ws"], approval_policy=pb.NEVER,
    sandbox_policy=pb.SandboxPolicy(mode=pb.SandboxPolicy.WORKSPACE_WRITE))).id
argv = ["true"] + ["A" * ARGS["arg_bytes"]] * ARGS["args"]
counts, lock = {}, threading.Lock()
deadline = time.monotonic() + ARGS["seconds"]
def flood():
    while time.monotonic() < deadline:
        try:
            for _ in stub.Exec(iter([pb.ExecRequest(start=pb.ExecStart(session_id=session, argv=argv))]), timeout=60):
                pass
            what = "OK"
        except grpc.RpcError as error:
            what = error.code().name + ": " + (error.details() or "")[:160]
        with lock:
            counts[what] = counts.get(what, 0) + 1
threads = [threading.Thread(target=flood) for _ in range(ARGS["threads"])]
for t in threads: t.start()
for t in threads: t.join()
stub.CloseSession(pb.CloseSessionRequest(session_id=session))
print(json.dumps(counts))
'''


def store_bytes(state: Path) -> int:
    return sum((state / name).stat().st_size for name in ("events.db", "events.db-wal")
               if (state / name).exists())


def events_in(state: Path) -> dict[str, int]:
    """How many events, and the bytes of their data, the store holds (read after the daemon stopped)."""
    import sqlite3

    with sqlite3.connect(state / "events.db") as db:
        count, data = db.execute("SELECT COUNT(*), SUM(LENGTH(data)) FROM events").fetchone()
    return {"count": count, "data_bytes": data or 0}


def main() -> None:
    config = sys.argv[1].replace("\\n", "\n") if len(sys.argv) > 1 else None
    with daemon_factory("sbxd-flood-") as factory, plain_users(1) as (user,):
        daemon = factory(config=config) if config else factory()
        ws = factory.workspace()
        os.chown(ws, user.uid, user.gid)
        state = factory.base / "state"
        before = store_bytes(state)
        began = time.monotonic()
        counts = run_client_as(user.uid, user.gid, daemon.socket, FLOOD, {
            "ws": str(ws), "seconds": SECONDS, "threads": THREADS, "args": ARGS, "arg_bytes": ARG_BYTES},
            timeout=SECONDS + 300)
        took = time.monotonic() - began
        with_wal = store_bytes(state) - before
        daemon.stop()                       # its last connection checkpoints the WAL into events.db
        grown = store_bytes(state) - before
        print(json.dumps({"seconds": round(took, 1), "store_growth_bytes": grown,
                          "bytes_per_second": round(grown / took), "growth_with_wal_before_stop": with_wal,
                          "calls": counts, "events": events_in(state), "argv_bytes": ARGS * (ARG_BYTES + 1) + 5,
                          "threads": THREADS, "loadavg": os.getloadavg()}))


if __name__ == "__main__":
    main()
