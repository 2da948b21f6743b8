"""Copying bytes both ways between two connected TCP sockets (published ports, the egress proxy)."""

from __future__ import annotations

import socket
import threading

CHUNK = 64 * 1024


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
