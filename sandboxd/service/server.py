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
from typing import Any

DEFAULT_SOCKET = "/run/sandboxd/sandboxd.sock"


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
    Its callers act as the local user ``uid:gid`` (sessions are told apart by certificate)."""

    def __init__(self, address: str, cert: str, key: str, client_ca: str, uid: int, gid: int) -> None:
        self.address, self.uid, self.gid = address, uid, gid
        with open(cert, "rb") as f:
            self.cert = f.read()
        with open(key, "rb") as f:
            self.key = f.read()
        with open(client_ca, "rb") as f:
            self.client_ca = f.read()


DEFAULT_STATE_DIR = "/var/lib/sandboxd"


def _self_test(fork: "Any") -> str | None:
    """Launch `true` in a read-only sandbox with a memory and a pids limit through the fork server:
    the whole set-up sequence (cgroups, namespaces, mounts, pivot_root, privileges, Landlock,
    seccomp). A machine where limits cannot be applied fails here, at start-up, with the fix,
    not at a user's first limited call. The problem, or None."""
    import tempfile

    from sandboxd.errors import SandboxdError
    from sandboxd.policy import LaunchSpec, Limits, ReadOnly

    workspace = tempfile.mkdtemp(prefix="sandboxd-selftest-", dir="/var/tmp")
    null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    try:
        call = fork.launch(LaunchSpec(argv=("true",), workspace=workspace, policy=ReadOnly(),
                                      limits=Limits(memory_bytes=64 << 20, pids=16),
                                      env={"PATH": "/usr/bin:/bin"}), (null, null, null))
        info = fork.wait(call)
        return None if info.exit_code == 0 else f"`true` in a sandbox ended with status {info.shell_status}"
    except SandboxdError as exc:
        return str(exc)
    finally:
        os.close(null)
        os.rmdir(workspace)


def serve(socket_path: str = DEFAULT_SOCKET, *, socket_mode: int = 0o666, admin_gid: int | None = None,
          workers: int = 64,
          ready: "threading.Event | None" = None, tls: "TlsListener | None" = None,
          state_dir: str = DEFAULT_STATE_DIR, approval_timeout: float = 300.0, dns: tuple[str, ...] = (),
          log_format: str = "json", log_level: str = "info", config_path: str | None = None,
          metrics_listen: str = "",
          session_defaults: "object | None" = None, network_pool: str = "") -> int:
    from sandboxd.supervisor.forkserver import ForkServer
    fork = ForkServer.start()                             # before gRPC's threads, and as a fresh process
    problem = _self_test(fork)
    if problem is not None:
        # Refuse to start rather than serve sessions the kernel cannot enforce.
        sys.stderr.write(f"sandboxd serve: this machine cannot build a sandbox: {problem}\n"
                         "  (sandboxd doctor says what is missing and how to fix it)\n")
        fork.close()
        return 1

    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection

    from sandboxd.audit.store import EventStore
    from sandboxd.service.approvals import ApprovalGate
    from sandboxd.service.peercred import FrontDoor, PeerCredentials
    from sandboxd.service.servicer import Callers, SandboxServicer
    from sandboxd.service.sessions import SessionRegistry
    from sandboxd.v1 import sandboxd_pb2, sandboxd_pb2_grpc

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonLogFormatter() if log_format == "json" else TextLogFormatter())
    log = logging.getLogger("sandboxd")
    log.addHandler(handler)
    log.setLevel({"debug": logging.DEBUG, "warning": logging.WARNING}.get(log_level, logging.INFO))

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
    if os.path.exists(backend):
        os.unlink(backend)

    # The audit log and session metadata: opened (and migrated) before anything is served.
    store = EventStore(os.path.join(state_dir, "events.db"))
    registry = SessionRegistry(fork, store, admin_gid=admin_gid, dns=dns, network_pool=network_pool)
    resumed = registry.restore()
    from sandboxd.service.metrics import Metrics
    metrics = Metrics()
    registry.metrics = metrics
    metrics.watch(sessions=lambda: len(registry.list(PeerCredentials(0, 0, 0))),
                  running=lambda: sum(s.running_calls for s in registry.list(PeerCredentials(0, 0, 0))),
                  events=store.last_id)
    gate = ApprovalGate(store, timeout=approval_timeout, metrics=metrics)
    door = FrontDoor(socket_path, backend, mode=socket_mode, relay_dir=os.path.join(private, "relay"),
                     listener=activated)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sandboxd-rpc"))
    callers = Callers(door, (tls.uid, tls.gid) if tls else None)
    sandboxd_pb2_grpc.add_SandboxServicer_to_server(
        SandboxServicer(registry, fork, callers, gate, metrics, session_defaults), server)  # type: ignore[arg-type]
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
        metrics.serve(metrics_listen)
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
                                          "sessions_resumed": resumed}})
    if ready is not None:
        ready.set()
    systemd.notify(f"READY=1\nSTATUS=serving on {socket_path}\nMAINPID={os.getpid()}")
    while not stopping:
        time.sleep(0.2)                                   # interrupted by the signal; the flag ends the loop
    for signum in (signal.SIGTERM, signal.SIGINT):
        # Stopping already: more of these must not cut the cleanup short (nor, at interpreter
        # exit, turn exit status 0 into death by signal). A stuck stop still yields to SIGKILL.
        signal.signal(signum, signal.SIG_IGN)
    started = time.monotonic()
    systemd.notify("STOPPING=1")
    log.info("stopping", extra={"fields": {"sessions": len(registry.list(PeerCredentials(0, 0, 0)))}})
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
    log.info("stopped", extra={"fields": {"seconds": round(time.monotonic() - started, 3)}})
    return 0

