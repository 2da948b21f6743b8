"""Which Unix-domain sockets belong to this network namespace (NETLINK_SOCK_DIAG).

Unix sockets are tagged with the network namespace of their creator, and a
sandbox without network has a namespace of its own. So a socket file whose
inode is bound by a socket in *our* namespace was made inside the sandbox;
any other is a host socket. With the host's network that test says nothing
(every socket is the host namespace's): there the question is which listening
socket a connect() would reach (``listener_bound_to``, ``listener_named``),
and the connect broker then asks who holds it (kernel.process.socket_holder_here).
The query is hand-rolled with ``struct`` because pyroute2's diag module takes
about half a second to import, more than a hundred sandbox launches.
"""

from __future__ import annotations

import _socket  # the C module: socket.py's enums cost more to import than a launch
import errno
import os
import struct

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST = 0x1
NLM_F_DUMP = 0x300
NLMSG_ERROR = 2
NLMSG_DONE = 3
UDIAG_SHOW_NAME = 0x1
UDIAG_SHOW_VFS = 0x2
UNIX_DIAG_NAME = 0
UNIX_DIAG_VFS = 1
ALL_STATES = 0xFFFFFFFF
TCP_LISTEN = 10                  # a listening socket's state, as sock_diag numbers them
LISTENING = 1 << TCP_LISTEN

_HEADER = struct.Struct("=IHHII")
_LENGTH_AND_KIND = struct.Struct("=IH")
_REQUEST = struct.Struct("=BBHIIIII")
_MESSAGE = struct.Struct("=BBBBIII")


def bound_socket_files() -> set[tuple[int, int, int]]:
    """(major, minor, inode) of every socket file bound by a socket of this network namespace."""
    return {file for _, _, vfs in _dump(ALL_STATES, UDIAG_SHOW_VFS, UNIX_DIAG_VFS) if (file := _file(vfs))}


def listening_socket_files() -> dict[int, tuple[int, int, int]]:
    """The listening sockets of this network namespace that are bound to a file: socket inode ->
    (major, minor, inode) of that file (an approval channel is registered by it: service.approval_channels)."""
    return {inode: file for inode, _, vfs in _dump(LISTENING, UDIAG_SHOW_VFS, UNIX_DIAG_VFS) if (file := _file(vfs))}


def listener_bound_to(identity: tuple[int, int, int]) -> int | None:
    """The socket inode of this namespace's listening socket bound to the file ``identity``, None
    when none listens there (a connect() to it is refused: ECONNREFUSED). A file is bound by one
    socket at most, for good: while the caller holds the file open, no other socket can take it."""
    major, minor, inode = identity
    attribute = struct.pack("=HHII", 12, UNIX_DIAG_VFS, inode, major << 20 | minor)
    return next((found for found, _, vfs in _dump(LISTENING, UDIAG_SHOW_VFS, UNIX_DIAG_VFS, attribute)
                 if _file(vfs) == identity), None)


def listener_named(name: bytes, kind: int) -> int | None:
    """The socket inode of this namespace's listening socket of type ``kind`` (SOCK_STREAM,
    SOCK_SEQPACKET) bound to the abstract ``name`` (its leading NUL included, as in the sockaddr),
    None when none listens there. Abstract names are unique per type: the one a connect() of a
    socket of ``kind`` would reach."""
    attribute = struct.pack("=HH", 4 + len(name), UNIX_DIAG_NAME) + name
    return next((found for found, found_kind, bound in _dump(LISTENING, UDIAG_SHOW_NAME, UNIX_DIAG_NAME, attribute)
                 if found_kind == kind and bound == name), None)


def _dump(states: int, show: int, attribute: int, containing: bytes = b"") -> list[tuple[int, int, bytes | None]]:
    """(socket inode, socket type, payload of ``attribute`` or None) of this namespace's Unix
    sockets in ``states`` (a bit mask of TCP_* states), asked with ``show`` (UDIAG_SHOW_*); with
    ``containing``, only of the messages holding those bytes (an attribute looked for, whole): the
    others are not parsed, which keeps a look-up among a desktop's hundreds of listeners cheap."""
    found: list[tuple[int, int, bytes | None]] = []
    nl = _socket.socket(_socket.AF_NETLINK, _socket.SOCK_DGRAM | _socket.SOCK_CLOEXEC, NETLINK_SOCK_DIAG)
    try:
        body = _REQUEST.pack(_socket.AF_UNIX, 0, 0, states, 0, show, 0xFFFFFFFF, 0xFFFFFFFF)
        nl.send(_HEADER.pack(_HEADER.size + len(body), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST | NLM_F_DUMP, 1, 0)
                + body)
        while True:
            data = nl.recv(65536)
            offset = 0
            while offset + _HEADER.size <= len(data):
                length, kind = _LENGTH_AND_KIND.unpack_from(data, offset)
                if length < _HEADER.size:
                    raise OSError(errno.EPROTO, "sock_diag: a message shorter than its header")
                if kind == NLMSG_DONE:
                    return found
                if kind == NLMSG_ERROR:
                    raise OSError(-struct.unpack_from("=i", data, offset + _HEADER.size)[0], "sock_diag")
                if not containing or data.find(containing, offset, offset + length) >= 0:
                    _, socket_type, _, _, socket_inode, _, _ = _MESSAGE.unpack_from(data, offset + _HEADER.size)
                    found.append((socket_inode, socket_type,
                                  _attribute(data, offset + _HEADER.size + _MESSAGE.size, offset + length, attribute)))
                offset += (length + 3) & ~3
    finally:
        nl.close()


def _attribute(data: bytes, start: int, end: int, wanted: int) -> bytes | None:
    """The payload of the first attribute of kind ``wanted`` in data[start:end], None if absent."""
    while start + 4 <= end:
        length, kind = struct.unpack_from("=HH", data, start)
        if length < 4:
            return None
        if kind == wanted:
            return data[start + 4:start + length]
        start += (length + 3) & ~3
    return None


def _file(vfs: bytes | None) -> tuple[int, int, int] | None:
    """(major, minor, inode) of a UNIX_DIAG_VFS payload (inode, then the kernel's internal dev_t:
    12 bits of major above 20 bits of minor); None without one (a socket bound to no file)."""
    if vfs is None or len(vfs) < 8:
        return None
    inode, dev = struct.unpack_from("=II", vfs)
    return (dev >> 20, dev & 0xFFFFF, inode)


def file_identity(st: os.stat_result) -> tuple[int, int, int]:
    return (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)
