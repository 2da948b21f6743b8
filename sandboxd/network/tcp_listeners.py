"""The daemon's TCP listeners (``metrics.listen``, ``tls.address``) bound at start-up, and what
stops the start when one cannot be: one line naming the key, the value and the cause
(``metrics.listen 127.0.0.1:9464: address already in use``), never a traceback, and never taken
for another daemon on the Unix socket."""

from __future__ import annotations

import errno
import os
import socket

# What to do, per errno, after the kernel's own words.
_ADVICE = {
    errno.EADDRINUSE: "another process listens there: stop it, or choose another port",
    errno.EADDRNOTAVAIL: "not an address of this machine: name one of its addresses (or 0.0.0.0)",
    errno.EACCES: "not allowed to listen there",
}


class ListenerUnavailable(Exception):
    """A listener of ``key`` (a configuration key) could not be opened on ``address``."""

    def __init__(self, key: str, address: str, cause: str) -> None:
        self.key, self.address, self.cause = key, address, cause
        super().__init__(f"{key} {address}: {cause}")


def describe(error: OSError) -> str:
    """``address already in use (another process listens there: ...)``: the errno's words, then what to do."""
    words = os.strerror(error.errno).lower() if error.errno else str(error)
    advice = _ADVICE.get(error.errno or 0)
    return f"{words} ({advice})" if advice else words


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def bind_listener(key: str, address: str, *, backlog: int = 128) -> socket.socket:
    """A listening, non-blocking TCP socket on ``address`` (HOST:PORT, checked by config), for
    ``key``; ListenerUnavailable naming the key, the address and the cause otherwise."""
    host, port = _split(address)
    try:
        family, kind, proto, _, where = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                           flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise ListenerUnavailable(key, address, f"unknown host ({exc.strerror})") from None
    listener = socket.socket(family, kind, proto)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # not REUSEPORT: a busy port stays busy
        listener.bind(where)
        listener.listen(backlog)
        listener.setblocking(False)
    except OSError as exc:
        listener.close()
        raise ListenerUnavailable(key, address, describe(exc)) from None
    return listener


def check_bindable(key: str, address: str) -> None:
    """ListenerUnavailable if ``address`` cannot be listened on now (for a listener another
    library binds later: gRPC's TLS port)."""
    bind_listener(key, address, backlog=1).close()


def why_unbindable(key: str, address: str) -> ListenerUnavailable:
    """Why a listener another library failed to open (gRPC's ``add_secure_port`` says only 0)
    cannot be: the address bound once more, here, for the kernel's reason."""
    try:
        probe = bind_listener(key, address, backlog=1)
    except ListenerUnavailable as exc:
        return exc
    probe.close()
    return ListenerUnavailable(key, address, "could not listen there (it is free now: try again)")
