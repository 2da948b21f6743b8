"""Which local TCP socket is where (NETLINK_SOCK_DIAG, one exact lookup each).

A server that accepted a connection over loopback knows only the peer's address and port. The
kernel knows more: the client's socket, found by its exact four-tuple, carries the uid that
created it (``tcp_peer_socket``). And the listening socket a connect() to an address and port
would reach is the one the kernel finds for a SYN there (``tcp_listener_at``: the connect broker
asks it of an approval channel's port). One request, one answer, whatever the number of sockets
on the host (reading /proc/net/tcp would cost a pass over all of them per connection, which a
local user could inflate at will; that pass is only the fallback for a kernel without inet_diag).
Hand-rolled with ``struct`` like unix_diag, for the same import cost; ipaddress is imported only
by the functions that take text addresses (a sandbox's init never calls them).
"""

from __future__ import annotations

import _socket
import struct

from sandboxd.kernel import sock_diag

TYPE_CHECKING = False
if TYPE_CHECKING:
    import ipaddress

IPPROTO_TCP = 6
ALL_STATES = 0xFFFFFFFF
NO_COOKIE = 0xFFFFFFFF
LOOPBACK_IFINDEX = 1            # the kernel gives lo this index in every network namespace
UID_OFFSET = 64                 # in struct inet_diag_msg: 4 bytes, inet_diag_sockid (48), expires, rqueue, wqueue


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
    import ipaddress

    from sandboxd.kernel.addresses import SHORT_OF_RESOURCES
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
    try:
        return _ask(peer_ip.packed, peer[1], local_ip.packed, local[1], 0)
    except OSError as exc:
        if exc.errno in SHORT_OF_RESOURCES:
            raise
        # No inet_diag in this kernel (or no netlink here): ask /proc.
        return _socket_from_proc(peer_ip, peer[1], local_ip, local[1])


def tcp_listener_at(address: bytes, port: int, fd: int = -1) -> tuple[int, int] | None:
    """(the uid that created it, its inode) of the listening socket a connect() over loopback to
    ``address`` (4 or 16 bytes) and ``port`` reaches, in this network namespace (or ``fd``'s:
    sock_diag.ask): the one the kernel finds for a SYN there (the most specific bound address; a
    dual-stack IPv6 listener for IPv4). None when none listens there; OSError when it cannot be told."""
    return _ask(address, port, bytes(len(address)), 0, LOOPBACK_IFINDEX, fd)


def _ask(source: bytes, source_port: int, destination: bytes, destination_port: int, interface: int,
         fd: int = -1) -> tuple[int, int] | None:
    """(uid, inode) of the TCP socket sock_diag finds for this id (its own address first, as the
    kernel's inet_diag_sockid has it), None when there is none."""
    family = _socket.AF_INET if len(source) == 4 else _socket.AF_INET6
    sockid = (struct.pack("!HH", source_port, destination_port) + source.ljust(16, b"\0")
              + destination.ljust(16, b"\0") + struct.pack("=III", interface, NO_COOKIE, NO_COOKIE))
    answer = sock_diag.ask(struct.pack("=BBBBI", family, IPPROTO_TCP, 0, 0, ALL_STATES) + sockid, fd)
    if answer is None or len(answer) < UID_OFFSET + 8:
        return None
    uid, inode = struct.unpack_from("=II", answer, UID_OFFSET)   # idiag_uid, then idiag_inode
    return int(uid), int(inode)


def _socket_from_proc(peer: "ipaddress.IPv4Address | ipaddress.IPv6Address", peer_port: int,
                      local: "ipaddress.IPv4Address | ipaddress.IPv6Address",
                      local_port: int) -> tuple[int, int] | None:
    """The same answer (uid, inode) from /proc/net/tcp{,6} (a pass over every socket: only when the kernel has
    no inet_diag). Addresses there are hex, 32-bit words in host byte order; IPv4 peers of IPv6
    sockets appear mapped. OSError when a table cannot be opened for want of a descriptor."""
    from sandboxd.kernel.addresses import proc_net_address, tcp_table_rows

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
