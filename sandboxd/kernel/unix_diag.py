"""Which Unix-domain sockets belong to this network namespace (NETLINK_SOCK_DIAG).

Unix sockets are tagged with the network namespace of their creator, and a
sandbox without network has a namespace of its own. So a socket file whose
inode is bound by a socket in *our* namespace was made inside the sandbox;
any other is a host socket. The query is hand-rolled with ``struct`` because
pyroute2's diag module takes about half a second to import, more than a
hundred sandbox launches.
"""

from __future__ import annotations

import _socket  # the C module: socket.py's enums cost more to import than a launch
import os
import struct

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST = 0x1
NLM_F_DUMP = 0x300
NLMSG_ERROR = 2
NLMSG_DONE = 3
UDIAG_SHOW_VFS = 0x2
UNIX_DIAG_VFS = 1
ALL_STATES = 0xFFFFFFFF
TCP_LISTEN = 10                  # a listening socket's state, as sock_diag numbers them

_HEADER = struct.Struct("=IHHII")
_REQUEST = struct.Struct("=BBHIIIII")
_MESSAGE = struct.Struct("=BBBBIII")


def bound_socket_files() -> set[tuple[int, int, int]]:
    """(major, minor, inode) of every socket file bound by a socket of this network namespace."""
    return {identity for _, identity in _bound_sockets(ALL_STATES)}


def listening_socket_files() -> dict[int, tuple[int, int, int]]:
    """The listening sockets of this network namespace that are bound to a file: socket inode ->
    (major, minor, inode) of that file (an approval channel is registered by it: service.approval_channels)."""
    return dict(_bound_sockets(1 << TCP_LISTEN))


def _bound_sockets(states: int) -> list[tuple[int, tuple[int, int, int]]]:
    """(socket inode, bound file's identity) of this namespace's Unix sockets in ``states`` (a bit
    mask of TCP_* states) that are bound to a file."""
    found: list[tuple[int, tuple[int, int, int]]] = []
    nl = _socket.socket(_socket.AF_NETLINK, _socket.SOCK_DGRAM | _socket.SOCK_CLOEXEC, NETLINK_SOCK_DIAG)
    try:
        body = _REQUEST.pack(_socket.AF_UNIX, 0, 0, states, 0, UDIAG_SHOW_VFS, 0xFFFFFFFF, 0xFFFFFFFF)
        nl.send(_HEADER.pack(_HEADER.size + len(body), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST | NLM_F_DUMP, 1, 0)
                + body)
        while True:
            data = nl.recv(65536)
            offset = 0
            while offset + _HEADER.size <= len(data):
                length, kind, _, _, _ = _HEADER.unpack_from(data, offset)
                if kind == NLMSG_DONE:
                    return found
                if kind == NLMSG_ERROR:
                    raise OSError(-struct.unpack_from("=i", data, offset + _HEADER.size)[0], "sock_diag")
                socket_inode = _MESSAGE.unpack_from(data, offset + _HEADER.size)[4]
                identity = _bound_file(data, offset + _HEADER.size + _MESSAGE.size, offset + length)
                if identity is not None:
                    found.append((socket_inode, identity))
                offset += (length + 3) & ~3
    finally:
        nl.close()


def _bound_file(data: bytes, start: int, end: int) -> tuple[int, int, int] | None:
    while start + 4 <= end:
        length, kind = struct.unpack_from("=HH", data, start)
        if length < 4:
            return None
        if kind == UNIX_DIAG_VFS and length >= 12:
            inode, dev = struct.unpack_from("=II", data, start + 4)
            # The kernel's internal dev_t: 12 bits of major above 20 bits of minor.
            return (dev >> 20, dev & 0xFFFFF, inode)
        start += (length + 3) & ~3
    return None


def file_identity(st: os.stat_result) -> tuple[int, int, int]:
    return (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)
