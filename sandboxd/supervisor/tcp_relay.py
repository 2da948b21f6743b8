"""TCP plumbing of published ports and the egress proxy: a listening service with one accept
thread and a thread per connection, and copying bytes both ways between two sockets."""

from __future__ import annotations

import socket
import threading

from sandboxd.errors import SetupError

CHUNK = 64 * 1024


def listen_tcp(address: str, port: int, *, step: str, hint: str | None = None) -> socket.socket:
    """A listening TCP socket on address:port, or a SetupError naming the step (and what to do)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((address, port))
    except OSError as exc:
        sock.close()
        raise SetupError(step, exc.errno or 0, f"{address}:{port}", hint=hint) from None
    sock.listen(128)
    return sock


def relay(a: socket.socket, b: socket.socket) -> None:
    """Copy a->b in this thread and b->a in another until both directions end; close both."""
    a.settimeout(None)
    b.settimeout(None)
    back = threading.Thread(target=_copy, args=(b, a), daemon=True)
    back.start()
    _copy(a, b)
    back.join()
    a.close()
    b.close()


def _copy(source: socket.socket, target: socket.socket) -> None:
    try:
        while data := source.recv(CHUNK):
            target.sendall(data)
    except OSError:
        pass
    finally:
        for sock, how in ((target, socket.SHUT_WR), (source, socket.SHUT_RD)):
            try:
                sock.shutdown(how)
            except OSError:
                pass


class TcpService:
    """Serves a bound, listening socket: ``handle(client, address)`` runs in a thread of its own
    for each connection, until ``close``."""

    def __init__(self, listener: socket.socket, name: str) -> None:
        self._listener = listener
        self._closed = False
        threading.Thread(target=self._accept, name=name, daemon=True).start()

    def handle(self, client: socket.socket, address: str) -> None:
        raise NotImplementedError

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, (address, _port) = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self.handle, args=(client, address), daemon=True).start()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                self._listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._listener.close()
