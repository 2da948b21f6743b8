"""Network namespace set-up that must be cheap: bringing up loopback.

A new network namespace has only ``lo``, and it is down. An ioctl on any
socket in the namespace brings it up without loading a netlink library, which
keeps the one-shot path fast. (pyroute2 is for the veth work of isolated
network sessions.)
"""

from __future__ import annotations

import _socket  # the C module: socket.py's enums cost more to import than a launch
import fcntl
import struct

from sandboxd.kernel._libc import from_oserror

SIOCGIFFLAGS = 0x8913
SIOCSIFFLAGS = 0x8914
IFF_UP = 0x1


def bring_up_loopback() -> None:
    try:
        sock = _socket.socket(_socket.AF_INET, _socket.SOCK_DGRAM | _socket.SOCK_CLOEXEC, 0)
        try:
            request = struct.pack("16sH14x", b"lo", 0)
            flags = struct.unpack("16sH14x", fcntl.ioctl(sock.fileno(), SIOCGIFFLAGS, request))[1]
            fcntl.ioctl(sock.fileno(), SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | IFF_UP))
        finally:
            sock.close()
    except OSError as exc:
        raise from_oserror(exc, "bring up loopback", "lo") from None
