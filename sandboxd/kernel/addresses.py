"""Whether an IP address names this host: one rule for every spelling of "here".

A connection to this host can be asked for in many forms: 127.0.0.1 and all of 127/8, ::1,
0.0.0.0 and :: (which the kernel sends to itself), the IPv4-mapped ``::ffff:a.b.c.d`` and the
IPv4-compatible ``::a.b.c.d`` spellings of each, and every address of every interface of this
host (link-local ones with their scope). Callers judge a destination only through
``is_this_host``, so no spelling gets past a check written for another.

The address of an interface is recognised by asking the kernel to bind to it: that succeeds for
exactly the addresses this network namespace owns, now, whatever interfaces come and go.
"""

from __future__ import annotations

import _socket
import errno
import ipaddress
import struct
from collections.abc import Iterator

AF_INET = 2
AF_INET6 = 10
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
THIS_NETWORK = ipaddress.IPv4Network("0.0.0.0/8")       # "this host on this network" (RFC 1122)
# What a failed open or socket() says when the process (or the host) is short of something, not
# that the thing looked for is absent: a lookup that fails so knows nothing, and must not answer
# "none" (a server flooded to its descriptor limit took its own user for a stranger).
SHORT_OF_RESOURCES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


def normalized(address: IPAddress) -> IPAddress:
    """The IPv4 address an IPv6 address stands for (mapped ``::ffff:a.b.c.d`` or compatible
    ``::a.b.c.d``), else ``address`` itself. ``::`` and ``::1`` stay IPv6."""
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return address.ipv4_mapped
        packed = address.packed
        if packed[:12] == bytes(12) and int.from_bytes(packed[12:], "big") > 1:
            return ipaddress.IPv4Address(packed[12:])
    return address


def is_this_host(address: IPAddress, scope_id: int = 0) -> bool:
    """Whether a connection to ``address`` (an IPv6 one in interface ``scope_id``) would reach this
    host: unspecified, loopback, or an address of one of its interfaces, in any spelling."""
    address = normalized(address)
    if address.is_unspecified or address.is_loopback:
        return True
    if isinstance(address, ipaddress.IPv4Address) and address in THIS_NETWORK:
        return True
    return _owned(address, scope_id)


def sockaddr_destination(sockaddr: bytes) -> "tuple[IPAddress, int, int] | None":
    """(address, port, IPv6 scope id) of a raw AF_INET/AF_INET6 sockaddr; None for any other
    family or a sockaddr too short to hold one (which the kernel refuses anyway)."""
    if len(sockaddr) < 2:
        return None
    family = struct.unpack_from("=H", sockaddr)[0]
    if family == AF_INET and len(sockaddr) >= 8:
        return ipaddress.IPv4Address(sockaddr[4:8]), struct.unpack_from("!H", sockaddr, 2)[0], 0
    if family == AF_INET6 and len(sockaddr) >= 24:
        scope = struct.unpack_from("=I", sockaddr, 24)[0] if len(sockaddr) >= 28 else 0
        return ipaddress.IPv6Address(sockaddr[8:24]), struct.unpack_from("!H", sockaddr, 2)[0], scope
    return None


def proc_net_address(hex_address: str) -> IPAddress:
    """The address of a /proc/net/tcp{,6} entry's ``ADDRESS`` (hex, in 32-bit words of host byte
    order), an IPv4-mapped one as the IPv4 address (how IPv4 peers of IPv6 sockets appear there)."""
    raw = bytes.fromhex(hex_address)
    address = ipaddress.ip_address(b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)))
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def tcp_table_rows(*, strict: bool = False) -> Iterator[list[str]]:
    """The rows of this network namespace's /proc/net/tcp and tcp6, split into their fields
    (``sl local_address rem_address st ... uid timeout inode``), the header left out; a table that
    cannot be read is skipped, unless ``strict`` and the process is short of resources to read it
    (SHORT_OF_RESOURCES: the OSError is raised)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f, None)
                for line in f:
                    fields = line.split()
                    if len(fields) >= 10:
                        yield fields
        except OSError as exc:
            if strict and exc.errno in SHORT_OF_RESOURCES:
                raise
            continue


def _owned(address: IPAddress, scope_id: int) -> bool:
    """Whether an interface of this network namespace holds ``address`` (binding to it succeeds;
    with net.ipv4.ip_nonlocal_bind set, every address does, which errs on the side of "here")."""
    where: tuple[str, int] | tuple[str, int, int, int]
    if isinstance(address, ipaddress.IPv4Address):
        probe, where = _socket.socket(AF_INET, _socket.SOCK_DGRAM), (str(address), 0)
    else:
        probe, where = _socket.socket(AF_INET6, _socket.SOCK_DGRAM), (str(address), 0, 0, scope_id)
    try:
        probe.bind(where)
        return True
    except OSError:
        return False
    finally:
        probe.close()
