"""Which Unix-domain sockets belong to this network namespace, and which file a socket is bound
to (NETLINK_SOCK_DIAG).

Unix sockets are tagged with the network namespace of their creator, and a
sandbox without network has a namespace of its own. So a socket file whose
inode is bound by a socket in *our* namespace was made inside the sandbox;
any other is a host socket (``bound_socket_files``: a dump of the sandbox's own
namespace, whose size is the sandbox's). With the host's network that test says
nothing (every socket is the host namespace's, and a dump of it is as large as
any local user makes it): there the connect broker looks at the sockets the
sandbox's processes hold and asks about each exactly (``socket_file``).
Files are named as sock_diag names them: by their superblock's device
(kernel.superblocks), which stat() does not always report.
The query is hand-rolled with ``struct`` because pyroute2's diag module takes
about half a second to import, more than a hundred sandbox launches.
"""

from __future__ import annotations

import _socket  # the C module: socket.py's enums cost more to import than a launch
import errno
import os
import struct

from sandboxd.kernel import sock_diag

NLM_F_DUMP = 0x300
NLMSG_ERROR = 2
NLMSG_DONE = 3
UDIAG_SHOW_VFS = 0x2
UNIX_DIAG_VFS = 1
ALL_STATES = 0xFFFFFFFF
TCP_LISTEN = 10                  # a listening socket's state, as sock_diag numbers them
LISTENING = 1 << TCP_LISTEN
NO_COOKIE = b"\xff" * 8

_HEADER = sock_diag.HEADER
_LENGTH_AND_KIND = struct.Struct("=IH")
_REQUEST = struct.Struct("=BBHIIIII")
_MESSAGE = struct.Struct("=BBBBIII")


def bound_socket_files() -> set[tuple[int, int, int]]:
    """(major, minor, inode) of every socket file bound by a socket of this network namespace."""
    return {file for _, vfs in _dump(ALL_STATES) if (file := _file(vfs))}


def listening_socket_files() -> dict[int, tuple[int, int, int]]:
    """The listening sockets of this network namespace that are bound to a file: socket inode ->
    (major, minor, inode) of that file (an approval channel is registered by it: service.approval_channels)."""
    return {inode: file for inode, vfs in _dump(LISTENING) if (file := _file(vfs))}


def socket_file(socket_inode: int, cookie: bytes = NO_COOKIE, fd: int = -1) -> tuple[int, int, int] | None:
    """(major, minor, inode) of the file the Unix socket ``socket_inode`` is bound to, None when it
    is bound to none or there is no such socket (in this network namespace, or ``fd``'s:
    kernel.sock_diag.ask); with ``cookie`` (SO_COOKIE, 8 bytes), only that very socket counts (an
    inode number, unlike a cookie, comes back one day). One question; the kernel finds the socket
    by walking its namespace's Unix sockets, so ask for one already known to matter."""
    value = struct.unpack("=Q", cookie)[0]
    low, high = value & 0xFFFFFFFF, value >> 32
    answer = sock_diag.ask(_REQUEST.pack(_socket.AF_UNIX, 0, 0, ALL_STATES, socket_inode, UDIAG_SHOW_VFS,
                                         low, high), fd)
    if answer is None or len(answer) < _MESSAGE.size:
        return None
    return _file(_attribute(answer, _MESSAGE.size, len(answer), UNIX_DIAG_VFS))


def _dump(states: int) -> list[tuple[int, bytes | None]]:
    """(socket inode, UNIX_DIAG_VFS payload or None) of this namespace's Unix sockets in
    ``states`` (a bit mask of TCP_* states)."""
    found: list[tuple[int, bytes | None]] = []
    nl = _socket.socket(_socket.AF_NETLINK, _socket.SOCK_DGRAM | _socket.SOCK_CLOEXEC, sock_diag.NETLINK_SOCK_DIAG)
    try:
        body = _REQUEST.pack(_socket.AF_UNIX, 0, 0, states, 0, UDIAG_SHOW_VFS, 0xFFFFFFFF, 0xFFFFFFFF)
        nl.send(_HEADER.pack(_HEADER.size + len(body), sock_diag.SOCK_DIAG_BY_FAMILY,
                             sock_diag.NLM_F_REQUEST | NLM_F_DUMP, 1, 0) + body)
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
                socket_inode = _MESSAGE.unpack_from(data, offset + _HEADER.size)[4]
                found.append((socket_inode, _attribute(data, offset + _HEADER.size + _MESSAGE.size, offset + length,
                                                       UNIX_DIAG_VFS)))
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
    """(major, minor, inode) as stat() reports them: to compare with another stat(), never with
    what sock_diag says (kernel.superblocks.identity)."""
    return (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)
