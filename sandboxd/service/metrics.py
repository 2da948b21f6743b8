"""Prometheus metrics of the daemon (prometheus-client), served on an opt-in HTTP listener
(``--metrics HOST:PORT``, ``metrics.listen`` in the configuration file).

What is counted where: decisions and call outcomes in the approval gate, Exec latency, queue
time and streamed bytes in the Exec handler, refusals of the egress proxy in the session
registry; live sessions, running calls and the event store's size are read when scraped.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import MetricsHandler

# A client that sends nothing for this long is dropped: the listener serves one connection at a
# time (no thread per connection), so a slow one must not hold it.
CLIENT_TIMEOUT = 5.0

if TYPE_CHECKING:
    import threading
    from http.server import HTTPServer

LATENCY_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 15, 60, 300)


class Metrics:
    def __init__(self) -> None:
        self._listener: "tuple[HTTPServer, threading.Thread] | None" = None
        self.registry = CollectorRegistry()
        r = self.registry
        self.calls = Counter("sandboxd_tool_calls", "Tool calls by tool and outcome (completed, failed, "
                             "denied_by_sandbox, denied_by_user, denied_by_timeout, denied_by_cancelled)",
                             ["tool", "outcome"], registry=r)
        self.decisions = Counter("sandboxd_decisions", "Policy decisions by verdict and reason",
                                 ["verdict", "reason"], registry=r)
        self.exec_seconds = Histogram("sandboxd_exec_duration_seconds", "Exec, from the request to the result",
                                      buckets=LATENCY_BUCKETS, registry=r)
        self.queue_seconds = Histogram("sandboxd_exec_queue_seconds", "Exec, from the request to the command "
                                       "running (decision, any approval wait, spawn)", buckets=LATENCY_BUCKETS,
                                       registry=r)
        self.output_bytes = Counter("sandboxd_output_bytes", "Bytes of stdout and stderr streamed to clients",
                                    registry=r)
        self.network_denials = Counter("sandboxd_network_denials", "Connections the egress proxy refused",
                                       registry=r)
        self.exported_events = Counter("sandboxd_audit_exported_events", "Audit events the export's sink "
                                       "acknowledged ([audit.export])", registry=r)
        self.export_failures = Counter("sandboxd_audit_export_failures", "Export batches the sink refused or "
                                       "that failed (each retried from the cursor, with back-off)", registry=r)
        self._sessions = Gauge("sandboxd_sessions", "Open sessions", registry=r)
        self._running = Gauge("sandboxd_running_calls", "Calls running now (commands and file tools)", registry=r)
        self._events = Gauge("sandboxd_event_store_events", "Events in the event store", registry=r)

    def watch(self, *, sessions: Callable[[], float], running: Callable[[], float], events: Callable[[], float]) -> None:
        """Gauges read when scraped."""
        self._sessions.set_function(sessions)
        self._running.set_function(running)
        self._events.set_function(events)

    def serve(self, address: str, refuse: "Callable[[str, int, int], str] | None" = None) -> None:
        """Start the HTTP listener on HOST:PORT: one thread, one connection at a time (a scrape is
        a few KiB). ``refuse(peer_host, peer_port, our_port)``: a reason to answer 403 instead
        (a client inside a sandbox: service.sandboxed_peers)."""
        import threading
        from http.server import HTTPServer

        host, _, port = address.rpartition(":")
        registry = self.registry

        class Handler(MetricsHandler):
            timeout = CLIENT_TIMEOUT

            def do_GET(self) -> None:
                reason = refuse(self.client_address[0], self.client_address[1], server.server_port) if refuse else ""
                if reason:
                    body = (reason + "\n").encode()
                    self.send_response(403)
                    self.send_header("Content-Type", "text/plain; charset=utf-8")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                super().do_GET()

        Handler.registry = registry
        server = HTTPServer((host.strip("[]") or "127.0.0.1", int(port)), Handler)
        thread = threading.Thread(target=server.serve_forever, name="sandboxd-metrics", daemon=True)
        thread.start()
        self._listener = (server, thread)

    def close(self) -> None:
        """Stop the HTTP listener, if it was started: its thread ends and its socket is closed."""
        if self._listener is not None:
            server, thread = self._listener
            self._listener = None
            server.shutdown()
            server.server_close()
            thread.join()
