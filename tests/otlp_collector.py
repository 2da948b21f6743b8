"""A tiny OTLP/HTTP logs collector for the audit export's otlp sink (tests/test_audit_export.py,
and the installed Debian package's daemon in tests/test_debian_package.py): it decodes each request
with the OpenTelemetry SDK's proto package (the test venv has it: pyproject's test extra)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Collector:
    """A tiny OTLP/HTTP logs collector: decodes each request with the SDK's proto package; while
    ``hang`` is set it reads a request and never answers."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.logs.v1 import logs_service_pb2

        self.bodies: list[str] = []
        self.hang = threading.Event()
        self.release = threading.Event()
        self.hung = 0
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                data = self.rfile.read(int(self.headers["Content-Length"]))
                if collector.hang.is_set():
                    collector.hung += 1
                    collector.release.wait(60)
                    return
                request = logs_service_pb2.ExportLogsServiceRequest.FromString(data)
                for resource in request.resource_logs:
                    for scope in resource.scope_logs:
                        collector.bodies += [record.body.string_value for record in scope.log_records]
                answer = logs_service_pb2.ExportLogsServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1/logs"

    def ids(self) -> set[int]:
        return {int(json.loads(body)["metadata"]["uid"]) for body in self.bodies}

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()
