"""What a VerifyAudit of a big log costs the daemon's other callers (not a test: pytest does not
collect it). A store of N events is made in a fresh state directory, a daemon serves it, and the
latency of GetStatus and of an Exec of `true` is measured before and while an administrator's
VerifyAudit walks the whole chain.

    N=300000 .venv/bin/python tests/bench_audit_verify_load.py
"""
from __future__ import annotations

import os
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from daemon_helpers import Daemon, make_base_dir, remove_tree  # noqa: E402
from sandboxd.audit.store import EventType, open_in_state_dir  # noqa: E402
from sandboxd.v1 import sandboxd_pb2 as pb  # noqa: E402

N = int(os.environ.get("N", "300000"))


def main() -> None:
    base = make_base_dir("sbxverify-")
    try:
        store = open_in_state_dir(str(base / "state"))
        data = {"arguments": {"argv": ["sh", "-c", "make test"], "cwd": "/ws"}, "by": "policy"}
        for index in range(N):
            store.append(f"s{index % 50}", EventType.TOOL_STARTED, call_id=f"call_{index}", tool="shell.exec", data=data)
        store.close()
        daemon = Daemon(base).start()
        try:
            ws = base / "ws-bench"
            ws.mkdir()
            session = daemon.stub.CreateSession(pb.CreateSessionRequest(workspace=str(ws), approval_policy=pb.NEVER))

            def status() -> float:
                began = time.perf_counter()
                daemon.stub.GetStatus(pb.GetStatusRequest(), timeout=60)
                return time.perf_counter() - began

            def exec_true() -> float:
                began = time.perf_counter()
                list(daemon.stub.Run(pb.ExecStart(session_id=session.id, argv=["true"]), timeout=60))
                return time.perf_counter() - began

            before = [(status(), exec_true()) for _ in range(40)]
            answer: dict[str, pb.VerifyAuditResponse] = {}
            walker = threading.Thread(target=lambda: answer.update(
                r=daemon.stub.VerifyAudit(pb.VerifyAuditRequest(), timeout=900)))
            walker.start()
            during = []
            while walker.is_alive():
                during.append((status(), exec_true()))
            walker.join()
            daemon.stub.CloseSession(pb.CloseSessionRequest(session_id=session.id))

            def line(samples: list[tuple[float, float]]) -> str:
                statuses, execs = [s for s, _ in samples], [e for _, e in samples]
                return (f"GetStatus p50 {statistics.median(statuses) * 1e3:.1f} max {max(statuses) * 1e3:.1f} ms, "
                        f"Exec true p50 {statistics.median(execs) * 1e3:.1f} max {max(execs) * 1e3:.1f} ms "
                        f"({len(samples)} pairs)")
            result = answer["r"]
            print(f"VerifyAudit of {N} events: {result.seconds:.2f} s ({result.events / result.seconds:,.0f} events/s), "
                  f"whole={result.whole}; loadavg {os.getloadavg()[0]:.1f}")
            print(f"  before: {line(before)}")
            print(f"  during: {line(during)}")
        finally:
            daemon.close()
    finally:
        remove_tree(base)


if __name__ == "__main__":
    main()
