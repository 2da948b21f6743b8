"""The daemon, built from its settings (config.DaemonSettings) in one place.

``Daemon(settings).run()`` is ``sandboxd serve``: ``start`` builds every part, each handed what
it needs through its constructor (the fork server first, as a fresh process before gRPC's
threads; then the event store, the registry, metrics, the approval gate, the front door, the
gRPC server and the optional TLS and metrics listeners); ``serve`` waits for a stop signal or the
fork server's death (restarting it in place); ``stop`` takes it all down in order. Listeners: the
public Unix socket (mode 0666 by default: every local user may talk to it; what each may do is
decided per call from SO_PEERCRED) relayed by the front door to the gRPC server on a socket in a
0700 directory. SIGTERM/SIGINT stop it gracefully: no new connections, every session killed,
sockets removed. SIGTERM first drains (drain.shutdown = "drain", the default; ``drain``): no new
sessions or calls (UNAVAILABLE with a retry hint), the running calls finish up to
drain.timeout_seconds; the Drain RPC (`sandboxd drain`) does the same. With
``supervisor.survive_restart`` (the default) the fork server is a surviving supervisor: after a
drain the daemon hands over (calls still running go on in their sandboxes), and a daemon
SIGKILLed (or crashed) leaves every session and running call to it; the next daemon on the same
socket attaches to it (``start``: ForkServer.attach before ForkServer.start) and adopts them
(handover.adopt). Otherwise the fork server (parent-death signal) and with it every sandbox die
with the daemon; SIGINT always stops everything.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from concurrent import futures
from contextlib import ExitStack
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc

from sandboxd import defaults
from sandboxd.audit.export.exporter import Exporter
from sandboxd.audit.store import EventStore, open_in_state_dir
from sandboxd.config.settings import DaemonSettings
from sandboxd.service import memtrace, systemd
from sandboxd.service.approval_channels import ApprovalChannels
from sandboxd.service.approvals import ApprovalGate
from sandboxd.service.call_results import DAEMON_STOPPED, DRAIN_TIMEOUT, CallResults
from sandboxd.service.drain import DrainGate, running_calls_but_jobs, stop_background, stop_running
from sandboxd.service.idle_expiry import IdleExpiry
from sandboxd.service.handover.adopt import Adopted, Adopter
from sandboxd.service.network_questions import NetworkQuestions
from sandboxd.service.callers import Callers, TlsIdentity
from sandboxd.service.metrics import Metrics
from sandboxd.service.principals import PodReader, Tenancy
from sandboxd.service.pod_sessions import PodSessions
from sandboxd.service.sessions.placement import LABEL as PLACEMENT
from sandboxd.service.process_ties import ProcessTies
from sandboxd.network.front_door import FrontDoor
from sandboxd.network.tcp_listeners import check_bindable, why_unbindable
from sandboxd.printable import printable
from sandboxd.service.quotas import Quotas
from sandboxd.service.request_decoding import DecodingInterceptor
from sandboxd.service.sandboxed_peers import SandboxedPeers
from sandboxd.service.server import (MAX_FORK_RESTARTS, RESTART_WINDOW, SELF_TEST_DIR, ForkWatch, JsonLogFormatter,
                                     TextLogFormatter, make_own_directories, own_places, self_test,
                                     sweep_private_dir)
from sandboxd.service.servicer import Reflection, SandboxServicer
from sandboxd.service.sessions.registry import SessionRegistry
from sandboxd.service.sessions.tied import TiedSessions
from sandboxd.service.review_expiry import ChangeSetExpiry
from sandboxd.service.watchdog import Watchdog
from sandboxd.supervisor import attach_point
from sandboxd.supervisor.fork_client import Adoption, ForkServer
from sandboxd.v1 import sandboxd_pb2, sandboxd_pb2_grpc

log = logging.getLogger("sandboxd")
SERVICES = ("", "sandboxd.v1.Sandbox")          # what health reports on
STOP_GRACE_SECONDS = 2                           # calls still running at stop get this long
EXPORT_DRAIN_SECONDS = 2.0                       # at stop, the export sends what is left for up to this
DRAIN_POLL_SECONDS = 0.25                        # a drain looks at the running calls this often


@dataclass(frozen=True, slots=True)
class _Parts:
    """Everything ``start`` built, for ``serve`` and ``stop``."""
    fork: ForkServer
    store: EventStore
    registry: SessionRegistry
    metrics: Metrics
    door: FrontDoor
    server: grpc.Server
    workers: futures.ThreadPoolExecutor
    health: health.HealthServicer
    backend: str                                 # the gRPC server's private socket
    ties: ProcessTies                            # what ends with a client's process
    log_handler: logging.Handler
    tracer: memtrace.MemoryTracer | None
    results: CallResults                         # calls' outcomes by id (WaitCall)
    drain: DrainGate                             # refuses new work while draining
    adopter: Adopter                             # the calls a surviving supervisor kept, followed
    pods: PodSessions | None = None              # limits.charge_pods: closes the sessions of ended pods
    exporter: Exporter | None = None             # [audit.export]: the audit log sent off the node


class Daemon:
    def __init__(self, settings: DaemonSettings) -> None:
        self.settings = settings
        self._parts: _Parts | None = None
        self._stop_requested: list[int] = []     # a flag a signal handler may set: no lock taken
        self._drain_requested: list[float] = []  # the Drain RPC's timeouts (request_drain)
        # Written to by a stop signal (signal.set_wakeup_fd) or request_stop: wakes serve at once.
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    # -- the whole life, as `sandboxd serve` runs it ---------------------------------------------

    def run(self) -> int:
        """Start, serve until SIGTERM or SIGINT (or a fork server that cannot be restarted), stop.
        The exit status: 0 after a stop signal, 1 when the daemon could not start or run on.
        OSError (EADDRINUSE: another daemon on the socket) if the socket cannot be set up;
        tcp_listeners.ListenerUnavailable if the TLS or metrics listener cannot."""
        # The handler only sets a flag: anything that takes a lock (Event.set, logging) can
        # deadlock when the signal lands while the main thread holds that same lock. Set before
        # the start: a stop asked for while starting is honoured as soon as the daemon serves.
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda received, _frame: self._stop_requested.append(received))
        signal.set_wakeup_fd(self._wake_w)
        hand_over = False
        try:
            problem = self.start()
            if problem is not None:
                # Refuse to start rather than serve sessions the kernel cannot enforce.
                sys.stderr.write(f"sandboxd serve: this machine cannot build a sandbox: {printable(problem)}\n"
                                 "  (sandboxd doctor says what is missing and how to fix it)\n")
                return 1
            status = self.serve()
            if status == 0 and self._drains():
                self.drain(self._drain_requested[0] if self._drain_requested else None)
                # After a drain a surviving supervisor keeps what still runs, for the next daemon.
                hand_over = True
            return status
        finally:
            signal.set_wakeup_fd(-1)
            for signum in (signal.SIGTERM, signal.SIGINT):
                # Stopping already: more of these must not cut the cleanup short (nor, at interpreter
                # exit, turn exit status 0 into death by signal). A stuck stop still yields to SIGKILL.
                signal.signal(signum, signal.SIG_IGN)
            self.stop(hand_over=hand_over)
            self.close()

    # -- its steps --------------------------------------------------------------------------------

    def start(self) -> str | None:
        """Build and start every part. Why this machine cannot build a sandbox (nothing left
        running then), or None once the daemon serves."""
        from sandboxd.kernel.malloc_arenas import limit_arenas
        from sandboxd.kernel.rlimits import raise_nofile_limit

        s = self.settings
        limit_arenas()              # before any thread: the daemon's C heaps stay flat under load
        # First: the fork server inherits it (it holds descriptors for every session; at 1024 it failed
        # past ~500 sessions). Sandboxes inherit it from the fork server in turn, unless the session
        # sets open_files.
        raise_nofile_limit()
        with ExitStack() as undo:                 # what is built so far, undone if a later step fails
            # The metrics' port first: a busy one stops the start at once (ListenerUnavailable:
            # one line), before the fork server and its self-test. A socket, no thread yet.
            metrics = Metrics()
            undo.callback(metrics.close)
            if s.metrics_listen:
                metrics.bind(s.metrics_listen)
            if s.tls is not None:                 # gRPC binds it later, and says only that it failed
                check_bindable("tls.address", s.tls.address)
            # Before the fork server: its attach socket is in the private directory.
            activated = systemd.activated_socket()
            socket_path = s.socket if activated is None else activated.getsockname() or s.socket  # systemd wins
            private = make_own_directories(socket_path, undo)    # PlaceTaken: another user's name, beside it
            fork, adoption = self._fork_server(private)
            # A start that fails leaves a surviving supervisor (and everything it holds) to the next.
            undo.callback(fork.detach)
            # An attached supervisor may be a replaced pod's, in that pod's mount namespace: the
            # self-test's workspace goes where both see it (server.self_test).
            problem = self_test(fork, s.session_defaults, private if adoption is not None else SELF_TEST_DIR)
            if problem is not None:
                return problem
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(JsonLogFormatter() if s.log_format == "json" else TextLogFormatter())
            log.addHandler(handler)
            undo.callback(log.removeHandler, handler)
            log.setLevel({"debug": logging.DEBUG, "warning": logging.WARNING}.get(s.log_level, logging.INFO))
            tracer = memtrace.start_from_environment()      # None unless $SANDBOXD_TRACEMALLOC names a file
            if tracer is not None:
                undo.callback(tracer.stop)

            backend = os.path.join(private, f"grpc-{os.getpid()}.sock")
            stale_sockets = sweep_private_dir(private)           # ours included, from a reused pid

            # The audit log and session metadata: opened (and migrated) before anything is served.
            store = open_in_state_dir(s.state_dir, limits=s.audit)
            undo.callback(store.close)
            tls = s.tls
            own = own_places(socket_path, backend, s.state_dir, tls.address if tls else "", s.metrics_listen)
            counters = Quotas(s.quotas)
            results, drain_gate = CallResults(store), DrainGate()
            registry = SessionRegistry(fork, store, dns=s.dns, network_pool=s.network_pool, own=own,
                                       proxy_connections=s.proxy_connections,
                                       published_connections=s.published_connections,
                                       published_per_peer=s.published_per_peer, quotas=counters,
                                       allow_user_full_access=s.allow_user_full_access,
                                       count_network_denial=metrics.network_denials.inc,
                                       review_dir=os.path.join(os.path.abspath(s.state_dir), "review"),
                                       review_bytes=(s.review_session_bytes, s.review_owner_bytes),
                                       review_stores=s.review_owner_stores, secrets=s.secrets,
                                       upstream_ca_pem=s.upstream_ca_pem, allowed_ranges=s.allowed_ranges,
                                       upstream_proxy=s.upstream_proxy,
                                       intercepted_connections=s.intercepted_connections)
            undo.callback(registry.close_all)
            registry.count_with(metrics)
            resumed = registry.restore()
            # What a surviving supervisor kept: the restored sessions' sandboxes and running calls,
            # taken over before anything else may close or use them.
            adopter = Adopter(registry, fork, store, results)
            adopted = adopter.adopt(adoption) if adoption is not None else Adopted()
            # What ends with a client's process: sessions asked for with close_with_caller, approval
            # channels. Those whose process exited while no daemon ran end now.
            ties = ProcessTies()
            undo.callback(ties.close)
            tied = TiedSessions(registry, ties)
            resumed -= tied.restore()
            pod_sessions = None
            # Sessions in pods (also those a daemon with the switch on left): closed when their pod ends.
            if s.session_defaults.charge_pods or any(PLACEMENT in x.labels for x in registry.open_sessions()):
                pod_sessions = PodSessions(registry)
                undo.callback(pod_sessions.close)
                resumed -= pod_sessions.sweep()                 # those whose pod ended while no daemon ran
            channels = ApprovalChannels(defaults.channels_dir(socket_path), ties)
            undo.callback(channels.withdraw)
            exporter = None
            if s.audit_export.enabled:              # after restore: what it closed is exported too
                exporter = Exporter(store.path, s.state_dir, s.audit_export, on_exported=metrics.exported_events.inc,
                                    on_failure=metrics.export_failures.inc)
                exporter.start()
                undo.callback(exporter.stop, 0.0)
                store.subscribe(exporter.noticed)   # woken by each commit; store.close ends it
            metrics.watch(sessions=registry.count_open,
                          running=lambda: sum(session.running_calls for session in registry.open_sessions()),
                          events=store.last_id)
            gate = ApprovalGate(store, timeout=s.approval_timeout, metrics=metrics)
            questions = NetworkQuestions(gate, store, per_session=s.network_questions, timeout=s.approval_timeout)
            undo.callback(questions.close)
            registry.answer_network_with(questions)
            sandboxed = SandboxedPeers(registry.sandbox_namespaces)
            pods = None if s.tenancy_mode != "pod" else PodReader(Tenancy(admin_pods=s.admin_pods,
                                                                             cgroup_root=s.cgroup_root))
            door = FrontDoor(socket_path, backend, mode=s.socket_mode, relay_dir=os.path.join(private, "relay"),
                             listener=activated, connections_per_uid=s.connections_per_uid,
                             peer_check=lambda who, _pidfd: sandboxed.reason_for_pid(who.pid),
                             read_cgroups=pods is not None,
                             connection_owner=pods.connection_owner if pods is not None else None,
                             on_start=pods.enter_node_view if pods is not None else None)
            undo.callback(door.close)
            workers = futures.ThreadPoolExecutor(max_workers=s.workers, thread_name_prefix="sandboxd-rpc")
            undo.callback(workers.shutdown)
            # Not SO_REUSEPORT (gRPC's default): a TLS port another process holds is busy, not shared.
            # A request that does not decode (a string that is not UTF-8): INVALID_ARGUMENT, not INTERNAL.
            server = grpc.server(workers, options=[("grpc.so_reuseport", 0)], interceptors=[DecodingInterceptor()])
            undo.callback(lambda: server.stop(None).wait())
            undo.callback(_unlink, backend)
            tls_identity = None if tls is None else TlsIdentity(
                identity=tls.identity, default_user=(tls.uid, tls.gid), users=dict(tls.users), port=tls.port)
            callers = Callers(door, tls_identity, sandboxed, s.admin_gid, pods)
            sandboxd_pb2_grpc.add_SandboxServicer_to_server(
                SandboxServicer(registry, fork, callers, gate, metrics, s.session_defaults, counters,
                                connections=door, tied=tied, channels=channels, results=results, drain=drain_gate,
                                on_drain=self.request_drain), server)
            health_servicer = health.HealthServicer()
            health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
            reflection_pb2_grpc.add_ServerReflectionServicer_to_server(Reflection(
                (sandboxd_pb2.DESCRIPTOR.services_by_name["Sandbox"].full_name, reflection.SERVICE_NAME,
                 health.SERVICE_NAME), callers, counters, metrics), server)
            server.add_insecure_port(f"unix:{backend}")
            if tls is not None:
                credentials = grpc.ssl_server_credentials([(tls.key, tls.cert)], root_certificates=tls.client_ca,
                                                          require_client_auth=True)
                try:
                    bound = server.add_secure_port(tls.address, credentials)
                except RuntimeError:              # taken since check_bindable: gRPC's words say no more
                    bound = 0
                if not bound:
                    raise why_unbindable("tls.address", tls.address)
            server.start()
            door.start()
            if s.metrics_listen:
                metrics.serve(refuse=sandboxed.reason_for_tcp)
            self._set_health(health_servicer, health_pb2.HealthCheckResponse.SERVING)
            self._parts = _Parts(fork=fork, store=store, registry=registry, metrics=metrics, door=door,
                                 server=server, workers=workers, health=health_servicer, backend=backend,
                                 ties=ties, log_handler=handler, tracer=tracer, results=results, drain=drain_gate,
                                 adopter=adopter, pods=pod_sessions, exporter=exporter)
            undo.pop_all()                        # started: stop() takes it down from here on
        log.info("serving", extra={"fields": {"socket": socket_path, "pid": os.getpid(),
                                              "tls": tls.address if tls else None, "event_store": store.path,
                                              "config": s.config_path, "metrics": s.metrics_listen or None,
                                              "sessions_resumed": resumed, "stale_sockets_removed": len(stale_sockets),
                                              "fork_server_pid": fork.pid,
                                              "supervisor": ("attached" if adoption is not None else "started")
                                              if fork.survives else "dies with the daemon",
                                              "adopted_sessions": adopted.sessions,
                                              "adopted_calls": adopted.calls_running,
                                              "ended_calls_recorded": adopted.calls_ended}})
        systemd.notify(f"READY=1\nSTATUS=serving on {socket_path}\nMAINPID={os.getpid()}")
        return None

    def serve(self) -> int:
        """Until a stop is asked for (a signal, request_stop): 0; or 1 when the fork server died and
        cannot be restarted. A dead fork server took every sandbox with it; it is restarted in place
        and sessions resume on their next call, as after a daemon restart. Meanwhile health says
        NOT_SERVING, and calls fail with FAILED_PRECONDITION ("the fork server exited"), never hang."""
        parts = self._started()
        fork = parts.fork
        watch = ForkWatch(fork, self._wake_r)      # sleeps until something happens: an idle daemon's CPU
        watchdog = Watchdog(fork, self.settings.ping_timeout,
                            lambda: self._set_health(parts.health, health_pb2.HealthCheckResponse.NOT_SERVING))
        watchdog.start()
        expiry = ChangeSetExpiry(parts.store, parts.registry.review_dir_of, self.settings.review_keep_days)
        expiry.start()
        idle = IdleExpiry(parts.registry, self.settings.idle_expiry)
        idle.start()
        status = 0
        try:
            while not self._stop_requested and not self._drain_requested:
                how = watch.died(None)
                if how is None:
                    continue
                self._set_health(parts.health, health_pb2.HealthCheckResponse.NOT_SERVING)
                log.error("fork server died: every sandbox died with it; restarting it",
                          extra={"fields": {"fork_server_pid": fork.pid, "how": how}})
                parts.registry.sandboxes_lost()
                problem = None if watch.may_restart() else \
                    f"it died more than {MAX_FORK_RESTARTS} times in {RESTART_WINDOW:.0f} s"
                if problem is None:
                    try:
                        fork.restart()
                        watch.rearm()
                        problem = self_test(fork)
                    except Exception as exc:  # noqa: BLE001 - any failure here ends the daemon, non-zero
                        problem = f"{type(exc).__name__}: {exc}"
                if problem is not None:
                    log.error("cannot restart the fork server: exiting non-zero (the service manager restarts "
                              "the daemon)", extra={"fields": {"problem": problem}})
                    status = 1
                    break
                parts.metrics.fork_server_restarts.inc()
                log.info("fork server restarted", extra={"fields": {"fork_server_pid": fork.pid}})
                self._set_health(parts.health, health_pb2.HealthCheckResponse.SERVING)
        finally:
            watchdog.stop()
            expiry.stop()
            idle.stop()
            watch.close()
        return status

    def _drains(self) -> bool:
        """Whether the stop asked for drains first: the Drain RPC, or SIGTERM with drain.shutdown = drain."""
        return bool(self._drain_requested) or (self.settings.shutdown == "drain"
                                               and signal.SIGTERM in self._stop_requested)

    def request_drain(self, timeout: float | None = None) -> tuple[int, float]:
        """Begin a drain (from any thread: the Drain RPC): new work is refused from now on, and
        ``serve`` returns for ``run`` to drain. (Calls running now, the timeout it drains with.)"""
        parts = self._started()
        timeout = self.settings.drain_timeout if timeout is None else timeout
        parts.drain.begin(timeout)
        self._set_health(parts.health, health_pb2.HealthCheckResponse.NOT_SERVING)
        self._drain_requested.append(timeout)
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:
            pass
        return self._running_calls(parts), timeout

    def drain(self, timeout: float | None = None) -> int:
        """Stop starting work and wait for the running calls to end, up to ``timeout`` seconds (None:
        drain.timeout_seconds) or another stop signal; then mark those left as ended by the drain
        (each gets a CallStopped event, reason drain_timeout), for ``stop`` to kill. Health says
        NOT_SERVING meanwhile (a readiness probe takes the node's daemon out). How many were left."""
        import select

        parts = self._started()
        timeout = self.settings.drain_timeout if timeout is None else timeout
        parts.drain.begin(timeout)
        self._set_health(parts.health, health_pb2.HealthCheckResponse.NOT_SERVING)
        systemd.notify("STOPPING=1\nSTATUS=draining")          # it ends in the exit
        started, signals = time.monotonic(), len(self._stop_requested)
        log.info("draining", extra={"fields": {"running_calls": self._running_calls(parts), "timeout_seconds": timeout}})
        poller = select.poll()                          # the wake pipe: another stop signal cuts it short
        poller.register(self._wake_r, select.POLLIN)
        while True:
            running = self._running_calls(parts)
            left = started + timeout - time.monotonic()
            if not running or left <= 0 or len(self._stop_requested) > signals:
                break
            if poller.poll(int(min(left, DRAIN_POLL_SECONDS) * 1000)):
                try:
                    while os.read(self._wake_r, 64):
                        pass
                except BlockingIOError:
                    pass
        seconds = round(time.monotonic() - started, 3)
        if not running:
            log.info("drained", extra={"fields": {"seconds": seconds}})
            return 0
        if parts.fork.survives and len(self._stop_requested) == signals:
            # A surviving supervisor keeps them: they run on, and the next daemon adopts them and
            # records their ends (handover.adopt). A second stop signal still kills them.
            log.info("drain ended with calls still running: handed over to the supervisor", extra={"fields": {
                "running_calls": running, "seconds": seconds}})
            return running
        stopped = stop_running(parts.results, parts.store, DRAIN_TIMEOUT, timeout_seconds=timeout)
        log.warning("drain ended with calls still running: they are killed", extra={"fields": {
            "running_calls": running, "seconds": seconds, "audited": stopped,
            "why": "drain_timeout" if len(self._stop_requested) == signals else "stop signal"}})
        return running

    @staticmethod
    def _running_calls(parts: _Parts) -> int:
        """Calls running now, what a drain waits for: not background processes (counted as running
        in their session too), which run until stopped; they end with the daemon (stop_background)."""
        return sum(running_calls_but_jobs(session) for session in parts.registry.open_sessions())

    def request_stop(self) -> None:
        """Make ``serve`` return (from any thread; what a stop signal does)."""
        self._stop_requested.append(0)
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:                  # the pipe is full: serve is woken already
            pass

    def _fork_server(self, private: str) -> "tuple[ForkServer, Adoption | None]":
        """The surviving supervisor a previous daemon left, attached (with what it holds), or a
        fresh fork server (a surviving one with ``supervisor.survive_restart``)."""
        s = self.settings
        path = attach_point.path_in(private) if s.survive_restart else None
        if path is not None:
            attached = ForkServer.attach(path, wait_seconds=s.wait_seconds, stuck_openers=s.stuck_openers,
                                         orphan_seconds=s.orphan_seconds, cgroup=s.supervisor_cgroup)
            if attached is not None:
                return attached
        # Before gRPC's threads, as a fresh process.
        return ForkServer.start(wait_seconds=s.wait_seconds, stuck_openers=s.stuck_openers, survive=path,
                                orphan_seconds=s.orphan_seconds, cgroup=s.supervisor_cgroup), None

    def stop(self, hand_over: bool = False) -> None:
        """Take the started daemon down, in this order: no new calls, no new connections, every
        session closed (its sandbox killed), running calls given STOP_GRACE_SECONDS, then the fork
        server, the store and the sockets. Idempotent. ``hand_over`` (with a surviving supervisor,
        after a drain): sandboxes and calls are left running to
        the supervisor (ForkServer.detach) for the next daemon, only this daemon's own services stop."""
        parts, self._parts = self._parts, None
        if parts is None:
            return
        hand_over = hand_over and parts.fork.survives
        started = time.monotonic()
        systemd.notify("STOPPING=1")
        log.info("stopping", extra={"fields": {"sessions": parts.registry.count_open(), "hand_over": hand_over}})
        parts.adopter.stopping("handover" if hand_over else "stop")
        if hand_over:
            # First: from here on nothing this daemon still has in flight (a call's cancel when the
            # door below cuts its stream, its end event) reaches the sandboxes or the audit log
            # (fork_client.HandedOver): the calls run on, and the next daemon records their ends.
            parts.fork.detach()
        parts.health.enter_graceful_shutdown()
        if not hand_over:                        # each running call: why it ends, before its client is cut
            stop_running(parts.results, parts.store, DAEMON_STOPPED)
            stop_background(parts.registry.open_sessions(), parts.store, DAEMON_STOPPED)
        parts.door.close()
        parts.ties.close()                       # what is tied stays so, for the next daemon
        if parts.pods is not None:
            parts.pods.close()
        parts.registry.close_all(keep_sandboxes=hand_over)
        parts.server.stop(grace=STOP_GRACE_SECONDS).wait()
        parts.workers.shutdown()
        parts.metrics.close()
        if not hand_over:
            parts.fork.close()
        if parts.exporter is not None:           # the last events (the sessions' closes) sent, then the store
            parts.exporter.stop(EXPORT_DRAIN_SECONDS)
        parts.store.close()
        _unlink(parts.backend)
        if parts.tracer is not None:
            parts.tracer.stop()
        log.info("stopped", extra={"fields": {"seconds": round(time.monotonic() - started, 3)}})
        log.removeHandler(parts.log_handler)

    def close(self) -> None:
        """Release the wake pipe (after stop; the daemon cannot be started again)."""
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                os.close(fd)
        self._wake_r = self._wake_w = -1

    def _started(self) -> _Parts:
        if self._parts is None:
            raise RuntimeError("the daemon is not started (Daemon.start)")
        return self._parts

    @staticmethod
    def _set_health(servicer: health.HealthServicer, status: int) -> None:
        for service in SERVICES:
            servicer.set(service, status)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass

