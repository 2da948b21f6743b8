"""Who opened the other end of a local TCP connection (NETLINK_SOCK_DIAG, one exact lookup).

A server that accepted a connection over loopback knows only the peer's address and port. The
kernel knows more: the client's socket, found by its exact four-tuple, carries the uid that
created it. One request, one answer, whatever the number of sockets on the host (reading
/proc/net/tcp would cost a pass over all of them per connection, which a local user could
inflate at will; that pass is only the fallback for a kernel without inet_diag). Hand-rolled
with ``struct`` like unix_diag, for the same import cost.
"""

from __future__ import annotations

import _socket
import errno
import ipaddress
import struct

from sandboxd.kernel.addresses import SHORT_OF_RESOURCES, proc_net_address, tcp_table_rows

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST = 0x1
NLMSG_ERROR = 2
IPPROTO_TCP = 6
ALL_STATES = 0xFFFFFFFF
NO_COOKIE = 0xFFFFFFFF
UID_OFFSET = 64                 # in struct inet_diag_msg: 4 bytes, inet_diag_sockid (48), expires, rqueue, wqueue

_HEADER = struct.Struct("=IHHII")


def tcp_peer_uid(peer: tuple[str, int], local: tuple[str, int]) -> int | None:
    """The uid that created the socket at ``peer`` connected to our ``local`` end (both in this
    network namespace), or None when there is no such socket here (it is gone, or remote);
    OSError as tcp_peer_socket."""
    found = tcp_peer_socket(peer, local)
    return None if found is None else found[0]


def tcp_peer_socket(peer: tuple[str, int], local: tuple[str, int]) -> tuple[int, int] | None:
    """(the uid that created it, its inode) of the socket at ``peer`` connected to our ``local``
    end (both in this network namespace), or None when there is no such socket here. OSError when
    the lookup itself could not be made for want of a descriptor or memory (SHORT_OF_RESOURCES):
    then nothing is known, and None would be a wrong answer."""
    try:
        peer_ip, local_ip = ipaddress.ip_address(peer[0].split("%")[0]), ipaddress.ip_address(local[0].split("%")[0])
    except ValueError:
        return None
    if isinstance(peer_ip, ipaddress.IPv6Address) and peer_ip.ipv4_mapped is not None:
        peer_ip = peer_ip.ipv4_mapped                     # a v4 client of a dual-stack listener
    if isinstance(local_ip, ipaddress.IPv6Address) and local_ip.ipv4_mapped is not None:
        local_ip = local_ip.ipv4_mapped
    if peer_ip.version != local_ip.version:
        return None
    family = _socket.AF_INET if peer_ip.version == 4 else _socket.AF_INET6
    sockid = (struct.pack("!HH", peer[1], local[1]) + peer_ip.packed.ljust(16, b"\0")
              + local_ip.packed.ljust(16, b"\0") + struct.pack("=III", 0, NO_COOKIE, NO_COOKIE))
    body = struct.pack("=BBBBI", family, IPPROTO_TCP, 0, 0, ALL_STATES) + sockid
    try:
        nl = _socket.socket(_socket.AF_NETLINK, _socket.SOCK_DGRAM | _socket.SOCK_CLOEXEC, NETLINK_SOCK_DIAG)
    except OSError as exc:
        if exc.errno in SHORT_OF_RESOURCES:
            raise
        return _socket_from_proc(peer_ip, peer[1], local_ip, local[1])
    try:
        nl.send(_HEADER.pack(_HEADER.size + len(body), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST, 1, 0) + body)
        data = nl.recv(65536)
    except OSError as exc:
        if exc.errno in SHORT_OF_RESOURCES:
            raise
        return _socket_from_proc(peer_ip, peer[1], local_ip, local[1])
    finally:
        nl.close()
    if len(data) < _HEADER.size:
        return None
    kind = _HEADER.unpack_from(data)[1]
    if kind == NLMSG_ERROR:
        code = -struct.unpack_from("=i", data, _HEADER.size)[0] if len(data) >= _HEADER.size + 4 else 0
        # ENOENT: no such socket here. Anything else (no inet_diag in this kernel): ask /proc.
        return None if code == errno.ENOENT else _socket_from_proc(peer_ip, peer[1], local_ip, local[1])
    if kind != SOCK_DIAG_BY_FAMILY or len(data) < _HEADER.size + UID_OFFSET + 8:
        return None
    uid, inode = struct.unpack_from("=II", data, _HEADER.size + UID_OFFSET)   # idiag_uid, then idiag_inode
    return int(uid), int(inode)


def _socket_from_proc(peer: "ipaddress.IPv4Address | ipaddress.IPv6Address", peer_port: int,
                   local: "ipaddress.IPv4Address | ipaddress.IPv6Address", local_port: int) -> tuple[int, int] | None:
    """The same answer (uid, inode) from /proc/net/tcp{,6} (a pass over every socket: only when the kernel has
    no inet_diag). Addresses there are hex, 32-bit words in host byte order; IPv4 peers of IPv6
    sockets appear mapped. OSError when a table cannot be opened for want of a descriptor."""
    def matches(field: str, address: "ipaddress.IPv4Address | ipaddress.IPv6Address", port: int) -> bool:
        host, _, hex_port = field.partition(":")
        return int(hex_port, 16) == port and proc_net_address(host) == address

    try:
        for fields in tcp_table_rows(strict=True):
            if matches(fields[1], peer, peer_port) and matches(fields[2], local, local_port):
                return int(fields[7]), int(fields[9])
    except ValueError:
        pass
    return None
