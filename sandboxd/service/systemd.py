"""systemd integration, without libsystemd: socket activation and readiness notification.

- Socket activation (sd_listen_fds): with ``LISTEN_PID`` naming this process and
  ``LISTEN_FDS=1``, descriptor 3 is the public Unix socket systemd bound and listens on
  (packaging/systemd/sandboxd.socket); the front door accepts on it instead of binding its own.
- Readiness (sd_notify): ``READY=1`` is sent to ``NOTIFY_SOCKET`` only once the daemon accepts
  calls, ``STOPPING=1`` when it begins to stop (Type=notify in sandboxd.service).
"""

from __future__ import annotations

import os
import socket

SD_LISTEN_FDS_START = 3


def activated_socket() -> socket.socket | None:
    """The socket systemd passed us, or None when not socket-activated. The variables are
    removed so that no child mistakes them for its own."""
    pid, count = os.environ.pop("LISTEN_PID", ""), os.environ.pop("LISTEN_FDS", "")
    os.environ.pop("LISTEN_FDNAMES", None)
    if not pid or int(pid) != os.getpid() or not count:
        return None
    if int(count) != 1:
        raise ValueError(f"socket activation passed {count} sockets: sandboxd.socket must have exactly one "
                         "ListenStream= (the daemon's Unix socket)")
    sock = socket.socket(fileno=SD_LISTEN_FDS_START)
    if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_STREAM:
        raise ValueError("the socket systemd passed is not a Unix stream socket: check ListenStream= in sandboxd.socket")
    os.set_inheritable(sock.fileno(), False)
    return sock


def notify(state: str) -> bool:
    """Send ``state`` (e.g. "READY=1") to the service manager; False when there is none."""
    address = os.environ.get("NOTIFY_SOCKET", "")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]                  # an abstract socket
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
        sock.connect(address)
        sock.sendall(state.encode())
    return True
