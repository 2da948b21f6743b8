"""The audit export's throughput (not a test module: pytest does not collect it).

A store of EVENTS events shaped like a call's (PermissionGranted, ToolInvocationStarted with an
argv and cwd, ToolInvocationCompleted with the exit information), in a temporary directory; the
exporter (sandboxd/audit/export) sends them all from cursor 0, on its thread, to:
- the file sink (JSON lines, fsync per batch, rotation at 64 MiB),
- the stdout sink pointed at /dev/null (the mapping and encoding alone, no disk),
- the otlp sink, to a local collector that decodes every request (the SDK's proto package),
and reports events per second for each, at batch sizes 100 and 500.

    .venv/bin/python tests/bench_export.py [EVENTS]
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from sandboxd.audit.export.exporter import Exporter
from sandboxd.audit.export.sinks import OtlpSink, Sink, StdoutSink
from sandboxd.audit.store import EventStore, EventType, SessionRow
from sandboxd.policy.audit_export import AuditExport


def fill(store: EventStore, events: int) -> None:
    store.save_session(SessionRow("sess_bench", 1000, 1000, "", "/w", {}, "never", {}, {}, {}, time.time(), None))
    rows = []
    for n in range(events // 3):
        call = f"call_{n:012x}"
        rows += [(EventType.PERMISSION_GRANTED, call, "shell.exec", {"effect": "read-only", "risk": "high",
                                                                     "summary": f"Execute: make test {n}",
                                                                     "by": "policy", "reason": None}),
                 (EventType.TOOL_STARTED, call, "shell.exec", {"arguments": {"argv": ["make", "-C", "/w", "test"],
                                                                             "cwd": "/w"}}),
                 (EventType.TOOL_COMPLETED, call, "shell.exec", {"exit_code": 0, "signal": 0, "timed_out": False,
                                                                 "wall_seconds": 0.01})]
        if len(rows) >= 900:
            store.append_many("sess_bench", rows)
            rows = []
    if rows:
        store.append_many("sess_bench", rows)


def timed(directory: str, db: str, settings: AuditExport, sink: Sink | None, total: int) -> float:
    for name in os.listdir(directory):
        if name.endswith(".cursor"):
            os.unlink(os.path.join(directory, name))
    exporter = Exporter(db, directory, settings, sink=sink)
    started = time.perf_counter()
    exporter.start()
    while exporter.exported < total:
        time.sleep(0.01)
    seconds = time.perf_counter() - started
    exporter.stop(0)
    return total / seconds


class Collector:
    def __init__(self) -> None:
        from opentelemetry.proto.collector.logs.v1 import logs_service_pb2

        self.records = 0
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                request = logs_service_pb2.ExportLogsServiceRequest.FromString(
                    self.rfile.read(int(self.headers["Content-Length"])))
                owner.records += sum(len(s.log_records) for r in request.resource_logs for s in r.scope_logs)
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def main() -> None:
    total = int(sys.argv[1]) if len(sys.argv) > 1 else 30000
    total -= total % 3
    results: dict[str, float] = {}
    with tempfile.TemporaryDirectory(dir="/var/tmp", prefix="sbxd-bench-export-") as directory:
        store = EventStore(os.path.join(directory, "events.db"))
        fill(store, total)
        collector = Collector()
        endpoint = f"http://127.0.0.1:{collector.server.server_address[1]}/v1/logs"
        devnull = os.open(os.devnull, os.O_WRONLY)
        for batch in (100, 500):
            out = os.path.join(directory, f"out-{batch}.jsonl")
            file_settings = AuditExport(sink="file", path=out, batch=batch)
            results[f"file_batch{batch}_events_per_s"] = timed(directory, store.path, file_settings, None, total)
            results[f"stdout_devnull_batch{batch}_events_per_s"] = timed(
                directory, store.path, AuditExport(sink="stdout", batch=batch), StdoutSink(devnull), total)
            results[f"otlp_batch{batch}_events_per_s"] = timed(
                directory, store.path, AuditExport(sink="otlp", endpoint=endpoint, batch=batch),
                OtlpSink(endpoint), total)
        os.close(devnull)
        results["file_bytes_per_event"] = os.path.getsize(os.path.join(directory, "out-500.jsonl")) / total
        store.close()
    print(json.dumps({"events": total, **{k: round(v, 1) for k, v in results.items()}}, indent=1))


if __name__ == "__main__":
    main()
