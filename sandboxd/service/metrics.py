"""Prometheus metrics of the daemon (prometheus-client), served on an opt-in HTTP listener
(``--metrics HOST:PORT``, ``metrics.listen`` in the configuration file).

What is counted where: decisions and call outcomes (with timeouts and OOM kills) in the approval
gate, Exec latency, queue time and streamed bytes in the Exec handler, refusals of the egress proxy
and the sessions' churn and build time in the session registry, quota refusals where the servicer
turns an error into a status, fork server restarts in the daemon; live sessions, running calls
and the event store's size are read when scraped.

Every label value is one of a fixed set the daemon chose, never a caller's string: a tool named by
a caller (Authorize) is ``external``, a quota is a configuration key's name or ``other``. (A
caller's string as a label would make a new series, held for the daemon's life, per string.)

The listener (network.scrape_listener) runs on an event loop of its own: idle connections cost a
descriptor, not the listener; it is bound at start-up before anything else is built (``bind``), so
a busy port stops the start at once with one line (network.tcp_listeners).
"""

from __future__ import annotations

import platform
import re
from typing import TYPE_CHECKING, Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import choose_encoder

from sandboxd import __version__
from sandboxd.network.scrape_listener import Answer, Request, ScrapeListener
from sandboxd.network.tcp_listeners import bind_listener
from sandboxd.policy.tools import BUILTIN_TOOLS

if TYPE_CHECKING:
    import socket

LATENCY_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 15, 60, 300)
BUILD_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
EXTERNAL_TOOL = "external"          # every tool a caller names (Authorize): one label value
OTHER_QUOTA = "other"
NETWORK_TOOL = "network"            # network_questions.TOOL: the egress proxy's questions
# Why a session closed, as a label: the daemon's own reasons, by their start; a close without one
# is its client's (CloseSession).
CLOSE_REASONS = (("the process that created it exited", "caller_exited"), ("its policy is refused now", "policy_refused"))
_KEY_NAME = re.compile(r"\b([a-z_]+\.[a-z_]+)\b")


def tool_label(tool: str) -> str:
    return tool if tool in BUILTIN_TOOLS or tool == NETWORK_TOOL else EXTERNAL_TOOL


def close_reason_label(reason: str) -> str:
    if not reason:
        return "client"
    return next((label for start, label in CLOSE_REASONS if reason.startswith(start)), "daemon")


def quota_label(message: str) -> str:
    """The configuration key a RESOURCE_EXHAUSTED message names (each names its limit), or ``other``."""
    from sandboxd.config import KEYS

    known = {key.dotted for key in KEYS}
    return next((name for name in _KEY_NAME.findall(message) if name in known), OTHER_QUOTA)


class Metrics:
    def __init__(self) -> None:
        self._listener: ScrapeListener | None = None
        self._bound: "socket.socket | None" = None
        self.registry = CollectorRegistry()
        r = self.registry
        self.calls = Counter("sandboxd_tool_calls", "Tool calls by tool (a caller-named tool: external) and "
                             "outcome (completed, failed, denied_by_sandbox, denied_by_user, denied_by_timeout, "
                             "denied_by_cancelled)", ["tool", "outcome"], registry=r)
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
        self.quota_refusals = Counter("sandboxd_quota_refusals", "Calls refused with RESOURCE_EXHAUSTED, by the "
                                      "configuration key of the quota or bound that refused them (other: none named)",
                                      ["quota"], registry=r)
        self.fork_server_restarts = Counter("sandboxd_fork_server_restarts", "Times the fork server died (or the "
                                            "watchdog killed it) and was restarted in place", registry=r)
        self.session_build_seconds = Histogram("sandboxd_session_build_seconds", "Building a session's sandbox in "
                                               "the fork server (its first build, and each rebuild after a policy "
                                               "change or a restart)", buckets=BUILD_BUCKETS, registry=r)
        self.sessions_created = Counter("sandboxd_sessions_created", "Sessions created", registry=r)
        self.sessions_closed = Counter("sandboxd_sessions_closed", "Sessions closed, by reason (client: "
                                       "CloseSession; caller_exited: close_with_caller; policy_refused: at restore; "
                                       "daemon: another reason of the daemon's)", ["reason"], registry=r)
        self.oom_kills = Counter("sandboxd_oom_kills", "Calls during which the kernel's OOM killer killed a process "
                                 "of the session (its memory group's oom_kill count went up)", registry=r)
        self.call_timeouts = Counter("sandboxd_call_timeouts", "Calls killed at their timeout", ["tool"], registry=r)
        self._build_info = Gauge("sandboxd_build_info", "1, labelled with the daemon's version, Python and kernel",
                                 ["version", "python", "kernel"], registry=r)
        self._build_info.labels(__version__, platform.python_version(), platform.release()).set(1)
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

    # -- what the daemon's parts report ------------------------------------------------------------

    def call_ended(self, tool: str, outcome: str, result: "dict[str, object] | None" = None) -> None:
        """A tool call's end; ``result`` its recorded result (an Exec's: timed_out, oom_killed)."""
        label = tool_label(tool)
        self.calls.labels(label, outcome).inc()
        if result:
            if result.get("timed_out"):
                self.call_timeouts.labels(label).inc()
            if result.get("oom_killed"):
                self.oom_kills.inc()

    def refused(self, code_name: str, message: str) -> None:
        """A call ended with a status: RESOURCE_EXHAUSTED is counted by the quota it names."""
        if code_name == "RESOURCE_EXHAUSTED":
            self.quota_refusals.labels(quota_label(message)).inc()

    def session_created(self) -> None:
        self.sessions_created.inc()

    def session_closed(self, reason: str) -> None:
        self.sessions_closed.labels(close_reason_label(reason)).inc()

    def session_built(self, seconds: float) -> None:
        self.session_build_seconds.observe(seconds)

    # -- the listener ------------------------------------------------------------------------------

    def bind(self, address: str) -> None:
        """Bind the listener's socket on HOST:PORT (no thread yet: before the fork server starts).
        ListenerUnavailable naming metrics.listen, the address and the cause."""
        self._bound = bind_listener("metrics.listen", address)

    def serve(self, address: str | None = None, refuse: "Callable[[str, int, int], str] | None" = None) -> None:
        """Serve /metrics on the bound socket (``bind``; or bind ``address`` now) on a loop of its
        own. ``refuse(peer_host, peer_port, our_port)``: a reason to answer 403 instead (a client
        inside a sandbox: service.sandboxed_peers)."""
        if self._bound is None:
            if address is None:
                raise RuntimeError("Metrics.serve: nothing bound (Metrics.bind)")
            self.bind(address)
        assert self._bound is not None
        registry = self.registry

        def answer(request: Request) -> Answer:
            reason = refuse(request.peer_host, request.peer_port, request.our_port) if refuse else ""
            if reason:
                return Answer(403, "text/plain; charset=utf-8", (reason + "\n").encode())
            if request.path not in ("/metrics", "/"):
                return Answer(404, "text/plain; charset=utf-8", b"not found: the metrics are at /metrics\n")
            encoder, content_type = choose_encoder(request.accept)
            return Answer(200, content_type, encoder(registry))

        self._listener = ScrapeListener(self._bound, answer, name="sandboxd-metrics")
        self._bound = None
        self._listener.start()

    def held_connections(self) -> int:
        return self._listener.held() if self._listener is not None else 0

    def close(self) -> None:
        """Stop the listener, if it was started (its loop ends, every connection and its socket
        are closed), or close the socket bound for it."""
        if self._listener is not None:
            listener, self._listener = self._listener, None
            listener.close()
        if self._bound is not None:
            self._bound.close()
            self._bound = None

