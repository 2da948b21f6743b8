"""The fork server: a small single-threaded process that does every fork.

The daemon starts it before any gRPC thread exists (a forked child of a
threaded process can deadlock, and fork cost grows with the parent's
memory), then sends it launch requests over a SOCK_SEQPACKET socket pair:

  request  {"op": "launch", "id": N, "spec": {...}} + SCM_RIGHTS [stdin, stdout, stderr]
           {"op": "signal", "id": N, "signum": S}
  replies  {"id": N, "event": "started", "pid": P}
           {"id": N, "event": "error", "error": {step, errno, path, hint, ...}}
           {"id": N, "event": "exited", "info": {exit_code, signal, timed_out, ...}}

Each launch is the same ``Spawner.launch`` that ``sandboxd run`` calls.
"""

from __future__ import annotations

import array
import json
import os
import select
import signal
import socket
import threading
from typing import Any

from sandboxd.errors import InvalidPolicy, SandboxdError, SetupError
from sandboxd.policy.spec import LaunchSpec, spec_from_dict, spec_to_dict
from sandboxd.supervisor.spawner import ExitInfo, SandboxProcess, Spawner

MAX_MESSAGE = 1 << 20


def _send(sock: socket.socket, message: dict[str, Any], fds: list[int] | None = None) -> None:
    data = json.dumps(message).encode()
    if fds:
        sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    else:
        sock.send(data)


def _recv(sock: socket.socket) -> tuple[dict[str, Any] | None, list[int]]:
    fds = array.array("i")
    data, ancdata, _, _ = sock.recvmsg(MAX_MESSAGE, socket.CMSG_SPACE(16 * fds.itemsize))
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - (len(payload) % fds.itemsize)])
    if not data:
        return None, list(fds)
    return json.loads(data), list(fds)


def serve(sock: socket.socket) -> None:
    """The fork server loop. Returns when the client end closes."""
    spawner = Spawner()
    running: dict[int, tuple[SandboxProcess, float | None]] = {}
    while True:
        waitables: list[Any] = [sock] + [proc for proc, _ in running.values()]
        deadlines = [d for d in (proc.deadline(t) for proc, t in running.values()) if d is not None]
        timeout = max(0.0, min(deadlines) - _now()) if deadlines else None
        ready, _, _ = select.select(waitables, [], [], timeout)
        for call_id, (proc, limit) in list(running.items()):
            info = proc.poll(limit)
            if info is not None:
                del running[call_id]
                _send(sock, {"id": call_id, "event": "exited", "info": info.to_dict()})
        if sock not in ready:
            continue
        try:
            message, fds = _recv(sock)
        except (OSError, ValueError):
            message, fds = None, []
        if message is None:
            for proc, _ in running.values():
                proc.kill()
                proc.wait()
            return
        _handle(sock, spawner, running, message, fds)


def _handle(sock: socket.socket, spawner: Spawner, running: dict[int, tuple[SandboxProcess, float | None]],
            message: dict[str, Any], fds: list[int]) -> None:
    call_id = int(message.get("id", 0))
    try:
        if message.get("op") == "launch":
            if len(fds) != 3:
                raise InvalidPolicy("a launch needs exactly three descriptors: stdin, stdout, stderr")
            spec = spec_from_dict(message["spec"])
            proc = spawner.launch(spec, stdio=(fds[0], fds[1], fds[2]))
            try:
                proc.wait_started()
            finally:
                for fd in fds:
                    os.close(fd)
                fds = []
            running[call_id] = (proc, spec.limits.timeout_seconds)
            _send(sock, {"id": call_id, "event": "started", "pid": proc.pid})
        elif message.get("op") == "signal":
            entry = running.get(call_id)
            if entry:
                entry[0].send_signal(int(message["signum"]))
        else:
            raise InvalidPolicy(f"unknown fork server operation {message.get('op')!r}")
    except SandboxdError as exc:
        error = exc.to_dict() if isinstance(exc, SetupError) else {"kind": type(exc).__name__, "detail": str(exc)}
        _send(sock, {"id": call_id, "event": "error", "error": error})
    finally:
        for fd in fds:
            os.close(fd)


def _now() -> float:
    import time
    return time.monotonic()


class ForkServer:
    """Client handle of a running fork server. Thread-safe; one request at a time per handle."""

    def __init__(self, sock: socket.socket, pid: int) -> None:
        self._sock = sock
        self.pid = pid
        self._lock = threading.Lock()
        self._events: dict[int, list[dict[str, Any]]] = {}
        self._next_id = 1

    @classmethod
    def start(cls) -> "ForkServer":
        """Fork the server now. Call before any thread is started in this process."""
        if threading.active_count() > 1:
            raise SetupError("fork server start", 0,
                             hint="the fork server must be started before any thread exists in the process")
        parent_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        pid = os.fork()
        if pid == 0:
            parent_end.close()
            # Only our own end of our own socket: a descriptor inherited from the client
            # (another fork server's client end, a gRPC listener...) would keep it open.
            from sandboxd.kernel.process import close_all_except
            close_all_except({0, 1, 2, child_end.fileno()})
            try:
                import prctl  # python-prctl: off the one-shot launch path, so its import cost is fine here
                prctl.set_name("sandboxd-fork")
                prctl.set_pdeathsig(signal.SIGKILL)  # the fork server never outlives the daemon
                serve(child_end)
            finally:
                os._exit(0)
        child_end.close()
        return cls(parent_end, pid)

    def launch(self, spec: LaunchSpec, stdio: tuple[int, int, int] = (0, 1, 2)) -> int:
        """Start a sandbox; return its call id once the command is running, or raise SetupError."""
        with self._lock:
            call_id = self._next_id
            self._next_id += 1
            _send(self._sock, {"op": "launch", "id": call_id, "spec": spec_to_dict(spec)}, list(stdio))
        event = self._wait_event(call_id, ("started", "error"))
        if event["event"] == "error":
            error = event["error"]
            if error.get("kind") == "InvalidPolicy":
                raise InvalidPolicy(error.get("detail", "invalid launch"))
            raise SetupError.from_dict(error)
        return call_id

    def signal(self, call_id: int, signum: int) -> None:
        with self._lock:
            _send(self._sock, {"op": "signal", "id": call_id, "signum": signum})

    def wait(self, call_id: int) -> ExitInfo:
        event = self._wait_event(call_id, ("exited",))
        return ExitInfo(**event["info"])

    def _wait_event(self, call_id: int, kinds: tuple[str, ...]) -> dict[str, Any]:
        while True:
            with self._lock:
                for index, event in enumerate(self._events.get(call_id, [])):
                    if event["event"] in kinds:
                        return self._events[call_id].pop(index)
                message, fds = _recv(self._sock)
                for fd in fds:
                    os.close(fd)
                if message is None:
                    raise SetupError("fork server", 0, detail="the fork server exited")
                self._events.setdefault(int(message["id"]), []).append(message)

    def close(self) -> None:
        self._sock.close()
        try:
            os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass
