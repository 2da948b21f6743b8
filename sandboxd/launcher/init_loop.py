"""The loop of a sandbox's resident process (init, a session's init, a call supervisor):
reap every child and broker connect() calls for sandboxed processes, until told to stop.

Signals only wake the loop (through a wakeup pipe); the work happens here, in
the main flow, never inside a signal handler.
"""

from __future__ import annotations

import _signal as signal  # the C module: signal.py builds IntEnums, which costs more than a launch
import _socket  # likewise for socket.py
import os
import select

from sandboxd.launcher.connect_broker import ConnectBroker

TYPE_CHECKING = False
if TYPE_CHECKING:
    from resource import struct_rusage
    from typing import Callable, NoReturn

    from sandboxd.launcher.plan import BrokerRules


def receive_fd(sock: "_socket.socket") -> int | None:
    """One descriptor sent with SCM_RIGHTS on ``sock``; None at EOF or without one."""
    try:
        data, ancillary, _, _ = sock.recvmsg(1, _socket.CMSG_SPACE(4))
    except OSError:
        return None
    for level, kind, payload in ancillary:
        if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS and len(payload) >= 4:
            return int.from_bytes(payload[:4], "little")
    return None


def send_fd(sock: "_socket.socket", fd: int) -> None:
    sock.sendmsg([b"L"], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, fd.to_bytes(4, "little"))])


class InitLoop:
    def __init__(self, on_exit: "Callable[[int, int, struct_rusage], None]", rules: "BrokerRules | None" = None) -> None:
        """``on_exit(pid, wait_status, rusage)`` runs for every reaped child; it may end the process.
        ``rules``: what the connect brokers let through (fixed in the plan, before the fork)."""
        self._on_exit = on_exit
        self._rules = rules
        self._wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda _s, _f: None)  # a handler, so SIGCHLD wakes poll()
        self._poller = select.poll()
        self._poller.register(self._wake_r, select.POLLIN)
        self._brokers: dict[int, ConnectBroker] = {}
        self._intake: "_socket.socket | None" = None

    def add_listener(self, listener: int) -> None:
        """Answer the connect() notifications of a seccomp filter (see connect_broker)."""
        assert self._rules is not None, "a loop that brokers connect() needs the plan's rules"
        self._brokers[listener] = ConnectBroker(listener, self._rules)
        self._poller.register(listener, select.POLLIN)

    def add_intake(self, sock: "_socket.socket") -> None:
        """Accept more listeners, one per message (a session's calls send theirs here)."""
        self._intake = sock
        self._poller.register(sock.fileno(), select.POLLIN)

    def run(self) -> "NoReturn":
        while True:
            self._reap()
            for fd, events in self._poller.poll():
                if fd == self._wake_r:
                    _drain(fd)
                elif self._intake is not None and fd == self._intake.fileno():
                    listener = receive_fd(self._intake)
                    if listener is not None:
                        self.add_listener(listener)
                    elif events & (select.POLLHUP | select.POLLERR):
                        self._poller.unregister(fd)
                        self._intake = None
                elif fd in self._brokers:
                    if events & select.POLLIN:
                        try:
                            self._brokers[fd].handle_one()
                        except OSError:
                            pass  # the caller died mid-call; its sandbox is unaffected
                    if events & (select.POLLHUP | select.POLLERR):
                        self._poller.unregister(fd)   # every process under that filter is gone
                        del self._brokers[fd]
                        os.close(fd)

    def _reap(self) -> None:
        while True:
            try:
                pid, status, usage = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self._on_exit(pid, status, usage)


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 512):
            pass
    except BlockingIOError:
        pass
