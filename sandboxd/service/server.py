"""`sandboxd serve`: the daemon. Fork server first, then the gRPC server behind the front door.

Listeners: the public Unix socket (default /run/sandboxd/sandboxd.sock, mode
0666 - every local user may talk to it; what each may do is decided per call
from SO_PEERCRED) relayed by the front door to a gRPC server on a socket in a
0700 directory. SIGTERM/SIGINT stop it gracefully: no new connections, every
session killed, sockets removed. If the daemon is SIGKILLed, the fork server
(parent-death signal) and with it every sandbox die too.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from concurrent import futures
from typing import TYPE_CHECKING, Any

from sandboxd import defaults

if TYPE_CHECKING:
    from sandboxd.service.convert import SessionDefaults
    from sandboxd.service.quotas import QuotaLimits

DEFAULT_SOCKET = defaults.SOCKET


class JsonLogFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = {"ts": round(record.created, 3), "level": record.levelname.lower(), "msg": record.getMessage(),
                "logger": record.name}
        line.update(getattr(record, "fields", {}))
        return json.dumps(line)


class TextLogFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        fields = " ".join(f"{key}={value}" for key, value in getattr(record, "fields", {}).items())
        return f"sandboxd {record.levelname.lower()}: {record.getMessage()}" + (f" ({fields})" if fields else "")


class TlsListener:
    """The optional TCP listener: TLS, and a client certificate signed by ``client_ca`` required.
    Its callers are named by ``identity`` (service.callers: the common name, or a URI or DNS
    subject alternative name) and act as the local user ``users`` maps them to, else ``uid:gid``."""

    def __init__(self, address: str, cert: str, key: str, client_ca: str, uid: int, gid: int,
                 identity: str = "common-name", users: "dict[str, tuple[int, int]] | None" = None) -> None:
        self.address, self.uid, self.gid = address, uid, gid
        self.identity, self.users = identity, dict(users or {})
        with open(cert, "rb") as f:
            self.cert = f.read()
        with open(key, "rb") as f:
            self.key = f.read()
        with open(client_ca, "rb") as f:
            self.client_ca = f.read()


DEFAULT_STATE_DIR = defaults.STATE_DIR
# Directories a socket may sit in that are not sandboxd's own: hiding one of them would hide far
# more than sandboxd (resolv.conf's stub, other services' sockets), so only sandboxd's own
# entries in it are hidden then.
SHARED_DIRECTORIES = frozenset({"/", "/run", "/var/run", "/tmp", "/var/tmp", "/dev/shm", "/var", "/var/lib", "/home",
                                "/root", "/srv", "/opt", "/etc", "/usr", "/mnt", "/media"})


def own_places(socket_path: str, private: str, backend: str, state_dir: str, tls_address: str,
               metrics_listen: str) -> "Any":
    """What of this daemon every sandbox must not see or reach (sessions.OwnPlaces)."""
    from sandboxd.service.sessions import OwnPlaces

    socket_dir = os.path.dirname(os.path.abspath(socket_path))
    hidden = ([socket_path, private] if socket_dir in SHARED_DIRECTORIES else [socket_dir]) + [state_dir]
    listeners = tuple(address for address in (tls_address, metrics_listen) if address)
    return OwnPlaces(hidden=tuple(os.path.abspath(p) for p in hidden),
                     sockets=(os.path.abspath(socket_path), backend), listeners=listeners)


SELF_TEST_DIR = "/var/tmp"
SELF_TEST_PREFIX = "sandboxd-selftest-"


def _sweep_self_test_workspaces() -> None:
    """The empty workspaces of self-tests whose daemon was killed mid-test (SIGKILL skips the
    ``finally``): named after that daemon's pid, removed once it is dead."""
    for name in os.listdir(SELF_TEST_DIR):
        owner = name[len(SELF_TEST_PREFIX):].split("-", 1)[0]
        if name.startswith(SELF_TEST_PREFIX) and owner.isdigit() and not os.path.exists(f"/proc/{owner}"):
            try:
                os.rmdir(os.path.join(SELF_TEST_DIR, name))   # only an empty directory; never follows a link
            except OSError:
                pass


def _self_test(fork: "Any", session_defaults: "SessionDefaults | None" = None) -> str | None:
    """Launch `true` in a read-only sandbox with a memory and a pids limit through the fork server:
    the whole set-up sequence (cgroups, namespaces, mounts, pivot_root, privileges, Landlock,
    seccomp). A machine where limits cannot be applied fails here, at start-up, with the fix,
    not at a user's first limited call. The problem, or None."""
    import tempfile

    from sandboxd.errors import SandboxdError
    from sandboxd.policy import LaunchSpec, Limits, ReadOnly

    _sweep_self_test_workspaces()
    limits = Limits(memory_bytes=64 << 20, pids=16)
    if session_defaults is not None:          # the caps of all sandboxes together: in place from start-up
        limits = limits.replace(total_pids=session_defaults.total_pids,
                                total_memory_bytes=session_defaults.total_memory_bytes)
    workspace = tempfile.mkdtemp(prefix=f"{SELF_TEST_PREFIX}{os.getpid()}-", dir=SELF_TEST_DIR)
    null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    try:
        call = fork.launch(LaunchSpec(argv=("true",), workspace=workspace, policy=ReadOnly(),
                                      limits=limits, env={"PATH": "/usr/bin:/bin"}), (null, null, null))
        info = fork.wait(call)
        return None if info.exit_code == 0 else f"`true` in a sandbox ended with status {info.shell_status}"
    except SandboxdError as exc:
        return str(exc)
    finally:
        os.close(null)
        os.rmdir(workspace)


def nofile_target() -> tuple[int, int, int]:
    """RLIMIT_NOFILE as (soft, hard, what ``serve`` raises the soft limit to: the hard limit).
    Every session holds descriptors in the daemon and the fork server, so 1024 caps a daemon
    at about 500 sessions; the hard limit is what the service manager allows (LimitNOFILE=)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if hard == resource.RLIM_INFINITY:                # Linux caps descriptors at fs.nr_open anyway
        try:
            with open("/proc/sys/fs/nr_open") as f:
                target = int(f.read())
        except (OSError, ValueError):
            target = 1 << 20
    return soft, hard, max(soft, target) if soft != resource.RLIM_INFINITY else soft


def raise_nofile_limit() -> int:
    """Raise our soft RLIMIT_NOFILE to the hard limit (before the fork server starts: it
    inherits it); returns the soft limit in force."""
    import resource

    soft, hard, target = nofile_target()
    if target != soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (OSError, ValueError):
            return soft
    return target


def sweep_private_dir(private: str) -> list[str]:
    """Remove the gRPC sockets (``grpc-<pid>.sock``) that daemons SIGKILLed earlier left in
    ``private``: those whose pid is dead. Returns the names removed."""
    removed: list[str] = []
    try:
        names = os.listdir(private)
    except OSError:
        return removed
    for name in names:
        pid = name[len("grpc-"):-len(".sock")] if name.startswith("grpc-") and name.endswith(".sock") else ""
        if not pid.isdigit() or (int(pid) != os.getpid() and os.path.exists(f"/proc/{pid}")):
            continue
        try:
            os.unlink(os.path.join(private, name))
            removed.append(name)
        except FileNotFoundError:
            pass
    return removed


# A fork server that keeps dying is not fixed by restarting it: past this many deaths in
# RESTART_WINDOW seconds the daemon exits non-zero and leaves it to the service manager.
MAX_FORK_RESTARTS = 5
RESTART_WINDOW = 60.0


class ForkWatch:
    """The daemon's watch on its fork server, by pidfd: ``died`` wakes the moment it exits."""

    def __init__(self, fork: "Any", wake_fd: int = -1) -> None:
        self._fork = fork
        self._restarts: list[float] = []
        self._pidfd = -1
        self._wake_fd = wake_fd            # signal.set_wakeup_fd's pipe: a stop signal wakes died()
        self.rearm()

    def rearm(self) -> None:
        """Watch the fork server now running (after a start or restart)."""
        import select

        self.close()
        self._pidfd = os.pidfd_open(self._fork.pid)
        self._poller = select.poll()
        self._poller.register(self._pidfd, select.POLLIN)
        if self._wake_fd >= 0:
            self._poller.register(self._wake_fd, select.POLLIN)

    def died(self, timeout: float | None) -> str | None:
        """Wait up to ``timeout`` seconds (None: until the fork server dies or a signal comes);
        how the fork server ended if it did, else None."""
        events = self._poller.poll(None if timeout is None else int(timeout * 1000))
        if any(fd == self._wake_fd for fd, _ in events):
            try:
                while os.read(self._wake_fd, 64):
                    pass
            except BlockingIOError:
                pass
        if not any(fd == self._pidfd for fd, _ in events):
            return None
        try:                                              # WNOWAIT: the client's Popen reaps it
            result = os.waitid(os.P_PIDFD, self._pidfd, os.WEXITED | os.WNOWAIT)
        except ChildProcessError:
            return "ended"
        if result is None:
            return "ended"
        if result.si_code == os.CLD_EXITED:
            return f"exited with status {result.si_status}"
        return f"killed by signal {result.si_status}"

    def may_restart(self) -> bool:
        now = time.monotonic()
        self._restarts = [t for t in self._restarts if now - t < RESTART_WINDOW] + [now]
        return len(self._restarts) <= MAX_FORK_RESTARTS

    def close(self) -> None:
        if self._pidfd >= 0:
            os.close(self._pidfd)
            self._pidfd = -1


def serve(socket_path: str = DEFAULT_SOCKET, *, socket_mode: int = 0o666, admin_gid: int | None = None,
          workers: int = 128,
          ready: "threading.Event | None" = None, tls: "TlsListener | None" = None,
          state_dir: str = DEFAULT_STATE_DIR, approval_timeout: float = 300.0, dns: tuple[str, ...] = (),
          log_format: str = "json", log_level: str = "info", config_path: str | None = None,
          metrics_listen: str = "",
          session_defaults: "SessionDefaults | None" = None, network_pool: str = "", connections_per_uid: int = 64,
          proxy_connections: int = 256, published_connections: int = 256, published_per_peer: int = 32,
          quotas: "QuotaLimits | None" = None, ping_timeout: float = 10.0, wait_seconds: float = 10.0,
          allow_user_full_access: bool = True) -> int:
    from sandboxd.kernel.malloc_arenas import limit_arenas
    from sandboxd.supervisor.forkserver import ForkServer
    limit_arenas()              # before any thread: the daemon's C heaps stay flat under load
    # First: the fork server inherits it (it holds descriptors for every session; at 1024 it failed
    # past ~500 sessions). Sandboxes inherit it from the fork server in turn, unless the session
    # sets open_files.
    raise_nofile_limit()
    fork = ForkServer.start(wait_seconds=wait_seconds)    # before gRPC's threads, and as a fresh process
    problem = _self_test(fork, session_defaults)
    if problem is not None:
        # Refuse to start rather than serve sessions the kernel cannot enforce.
        sys.stderr.write(f"sandboxd serve: this machine cannot build a sandbox: {problem}\n"
                         "  (sandboxd doctor says what is missing and how to fix it)\n")
        fork.close()
        return 1

    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection

    from sandboxd.audit.store import open_in_state_dir
    from sandboxd.service.approvals import ApprovalGate
    from sandboxd.network.front_door import FrontDoor
    from sandboxd.service.callers import Callers, TlsIdentity
    from sandboxd.service.sandboxed_peers import SandboxedPeers
    from sandboxd.service.servicer import SandboxServicer
    from sandboxd.service.sessions import SessionRegistry
    from sandboxd.v1 import sandboxd_pb2, sandboxd_pb2_grpc

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonLogFormatter() if log_format == "json" else TextLogFormatter())
    log = logging.getLogger("sandboxd")
    log.addHandler(handler)
    log.setLevel({"debug": logging.DEBUG, "warning": logging.WARNING}.get(log_level, logging.INFO))
    from sandboxd.service import memtrace
    tracer = memtrace.start_from_environment()          # None unless $SANDBOXD_TRACEMALLOC names a file

    from sandboxd.service import systemd
    activated = systemd.activated_socket()
    if activated is not None:
        socket_path = activated.getsockname() or socket_path   # systemd's ListenStream= wins
    base = os.path.dirname(os.path.abspath(socket_path))
    private = os.path.join(base, ".sandboxd-private")
    os.makedirs(base, mode=0o755, exist_ok=True)
    os.makedirs(private, mode=0o700, exist_ok=True)
    os.chmod(private, 0o700)
    backend = os.path.join(private, f"grpc-{os.getpid()}.sock")
    stale_sockets = sweep_private_dir(private)           # ours included, from a reused pid

    # The audit log and session metadata: opened (and migrated) before anything is served.
    store = open_in_state_dir(state_dir)
    own = own_places(socket_path, private, backend, state_dir, tls.address if tls else "", metrics_listen)
    from sandboxd.service.quotas import QuotaLimits, Quotas
    counters = Quotas(quotas or QuotaLimits(workers=workers))
    registry = SessionRegistry(fork, store, dns=dns, network_pool=network_pool, own=own,
                               proxy_connections=proxy_connections, published_connections=published_connections,
                               published_per_peer=published_per_peer,
                               quotas=counters)
    registry.allow_user_full_access = allow_user_full_access
    resumed = registry.restore()
    from sandboxd.service.metrics import Metrics
    metrics = Metrics()
    registry.metrics = metrics
    metrics.watch(sessions=lambda: len(registry.open_sessions()),
                  running=lambda: sum(s.running_calls for s in registry.open_sessions()),
                  events=store.last_id)
    gate = ApprovalGate(store, timeout=approval_timeout, metrics=metrics)
    sandboxed = SandboxedPeers(registry.sandbox_namespaces)
    door = FrontDoor(socket_path, backend, mode=socket_mode, relay_dir=os.path.join(private, "relay"),
                     listener=activated, connections_per_uid=connections_per_uid,
                     peer_check=lambda who, _pidfd: sandboxed.reason_for_pid(who.pid))
    registry.front_door = door
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sandboxd-rpc"))
    tls_identity = None
    if tls is not None:
        tls_identity = TlsIdentity(identity=tls.identity, default_user=(tls.uid, tls.gid), users=tls.users,
                                   port=int(tls.address.rpartition(":")[2]))
    callers = Callers(door, tls_identity, sandboxed, admin_gid)
    sandboxd_pb2_grpc.add_SandboxServicer_to_server(
        SandboxServicer(registry, fork, callers, gate, metrics, session_defaults, counters), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (sandboxd_pb2.DESCRIPTOR.services_by_name["Sandbox"].full_name, reflection.SERVICE_NAME,
         health.SERVICE_NAME), server)
    server.add_insecure_port(f"unix:{backend}")
    if tls is not None:
        credentials = grpc.ssl_server_credentials([(tls.key, tls.cert)], root_certificates=tls.client_ca,
                                                  require_client_auth=True)
        if not server.add_secure_port(tls.address, credentials):
            raise OSError(f"cannot listen on {tls.address}")
    server.start()
    door.start()
    if metrics_listen:
        metrics.serve(metrics_listen, refuse=sandboxed.reason_for_tcp)
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_servicer.set("sandboxd.v1.Sandbox", health_pb2.HealthCheckResponse.SERVING)

    # The handler only sets a flag: anything that takes a lock (Event.set, logging) can
    # deadlock when the signal lands while the main thread holds that same lock.
    stopping: list[int] = []
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda received, _frame: stopping.append(received))
    log.info("serving", extra={"fields": {"socket": socket_path, "pid": os.getpid(),
                                          "tls": tls.address if tls else None, "event_store": store.path,
                                          "config": config_path, "metrics": metrics_listen or None,
                                          "sessions_resumed": resumed, "stale_sockets_removed": len(stale_sockets),
                                          "fork_server_pid": fork.pid}})
    if ready is not None:
        ready.set()
    systemd.notify(f"READY=1\nSTATUS=serving on {socket_path}\nMAINPID={os.getpid()}")
    # The main thread's loop: a stop signal (the flag, looked at every 0.2 s) or the fork
    # server's death (its pidfd wakes the poll at once). A dead fork server took every sandbox
    # with it; it is restarted in place and sessions resume on their next call, as after a
    # daemon restart. Meanwhile health says NOT_SERVING, and calls fail with FAILED_PRECONDITION
    # ("the fork server exited"), never hang.
    status = 0
    # A signal writes to this pipe, which wakes the loop below: it sleeps until something
    # happens, instead of waking five times a second to look at the flag (an idle daemon's CPU).
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        signal.set_wakeup_fd(wake_w)
        wait: float | None = None
    except ValueError:                       # not the main thread (serve() run in a thread): poll
        wait = 0.2
    watch = ForkWatch(fork, wake_r)
    from sandboxd.service.watchdog import Watchdog
    def not_serving() -> None:
        for service in ("", "sandboxd.v1.Sandbox"):
            health_servicer.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
    watchdog = Watchdog(fork, ping_timeout, not_serving)
    watchdog.start()
    while not stopping:
        how = watch.died(wait)
        if how is None:
            continue
        for service in ("", "sandboxd.v1.Sandbox"):
            health_servicer.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        log.error("fork server died: every sandbox died with it; restarting it",
                  extra={"fields": {"fork_server_pid": fork.pid, "how": how}})
        registry.sandboxes_lost()
        problem = None if watch.may_restart() else \
            f"it died more than {MAX_FORK_RESTARTS} times in {RESTART_WINDOW:.0f} s"
        if problem is None:
            try:
                fork.restart()
                watch.rearm()
                problem = _self_test(fork)
            except Exception as exc:  # noqa: BLE001 - any failure here ends the daemon, non-zero
                problem = f"{type(exc).__name__}: {exc}"
        if problem is not None:
            log.error("cannot restart the fork server: exiting non-zero (the service manager restarts "
                      "the daemon)", extra={"fields": {"problem": problem}})
            status = 1
            break
        log.info("fork server restarted", extra={"fields": {"fork_server_pid": fork.pid}})
        for service in ("", "sandboxd.v1.Sandbox"):
            health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    watchdog.stop()
    watch.close()
    if wait is None:
        signal.set_wakeup_fd(-1)
    os.close(wake_r)
    os.close(wake_w)
    for signum in (signal.SIGTERM, signal.SIGINT):
        # Stopping already: more of these must not cut the cleanup short (nor, at interpreter
        # exit, turn exit status 0 into death by signal). A stuck stop still yields to SIGKILL.
        signal.signal(signum, signal.SIG_IGN)
    started = time.monotonic()
    systemd.notify("STOPPING=1")
    log.info("stopping", extra={"fields": {"sessions": len(registry.open_sessions())}})
    health_servicer.enter_graceful_shutdown()
    door.close()
    registry.close_all()
    server.stop(grace=2).wait()
    fork.close()
    store.close()
    for path in (backend,):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    if tracer is not None:
        tracer.stop()
    log.info("stopped", extra={"fields": {"seconds": round(time.monotonic() - started, 3)}})
    return status

