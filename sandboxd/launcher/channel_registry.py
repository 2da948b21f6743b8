"""The registry of approval channels: the listening sockets of the processes that answer approvals
(`sandboxd mcp --http`), which connect() is refused for in every sandbox (connect_broker).

A directory (``defaults.channel_registry``: ``.sandboxd-mcp/listeners`` beside the daemon's
socket), owned by root and written only by the daemon (service.approval_channels), holding one
empty file per listening socket whose name says what it is:

    tcp-7f000001-8765-SOCKET-KEY      a TCP listener on 127.0.0.1:8765 (the address in hex)
    tcp-00000000000000000000000000000001-8765-SOCKET-KEY     one on [::1]:8765
    unix-MAJOR-MINOR-INODE-SOCKET-KEY a Unix listener bound to that file (its device, as sock_diag
                                      names it: kernel.superblocks, and inode)

    netns-INODE                       the daemon's network namespace (/proc/self/ns/net's inode),
                                      where the registered sockets are

SOCKET is the listening socket's inode, KEY names the registration (uid, pid, a counter). Names
only: one getdents tells a broker all. An entry stands for that socket, not for its address: the
broker refuses a connect() only while the socket found there (the listener at that address and
port, the socket bound to that file) is the registered one, so a channel that closed its listener
blocks nothing, although its entry lasts as long as its process.

A sandbox's init opens the registries when it starts, before it builds the sandbox (inside, the
directory is hidden with the rest of the daemon's places), and lists them again on every
connect() it judges: a channel registered after the sandbox was built is refused all the same,
and one whose process ended is reachable again once the daemon removed its entries. A directory
that is not root's, or that others may write, is ignored (a daemon refuses to start beside one).

Loaded by every sandbox's init: the standard library's small C modules only.
"""

from __future__ import annotations

import os
import struct

AF_INET = 2
AF_INET6 = 10
_V4_MAPPED = bytes(10) + b"\xff\xff"
_LOOPBACK_V4 = bytes((127, 0, 0, 1))
_LOOPBACK_V6 = bytes(15) + b"\x01"


NETNS = "netns"


def network_namespace_entry(inode: int) -> str:
    """The entry naming the daemon's network namespace (the inode of its /proc/self/ns/net)."""
    return f"{NETNS}-{inode}"


def tcp_entry(packed: bytes, port: int, socket_inode: int, key: str) -> str:
    """The entry of the TCP listener ``socket_inode`` on ``packed`` (4 or 16 bytes, an IPv4-mapped
    one as 4), ``port``."""
    return f"tcp-{packed.hex()}-{port}-{socket_inode}-{key}"


def unix_entry(identity: tuple[int, int, int], socket_inode: int, key: str) -> str:
    """The entry of the Unix listener ``socket_inode`` bound to the file ``identity`` (major,
    minor, inode, as sock_diag names it)."""
    return f"unix-{identity[0]}-{identity[1]}-{identity[2]}-{socket_inode}-{key}"


class Registered:
    """One reading of the registries: the TCP listeners by (address bytes, port) and the Unix ones
    by the bound file's identity, each as the set of the registered sockets' inodes."""

    __slots__ = ("tcp", "unix", "network_namespaces")

    def __init__(self) -> None:
        self.tcp: dict[tuple[bytes, int], set[int]] = {}
        self.unix: dict[tuple[int, int, int], set[int]] = {}
        self.network_namespaces: set[int] = set()       # of the daemons that wrote the registries

    def add(self, name: str) -> None:
        parts = name.split("-")
        try:
            if parts[0] == NETNS and len(parts) == 2:
                self.network_namespaces.add(int(parts[1]))
            elif parts[0] == "tcp" and len(parts) == 5:
                self.tcp.setdefault((bytes.fromhex(parts[1]), int(parts[2])), set()).add(int(parts[3]))
            elif parts[0] == "unix" and len(parts) == 6:
                self.unix.setdefault((int(parts[1]), int(parts[2]), int(parts[3])), set()).add(int(parts[4]))
        except ValueError:
            pass                          # not an entry (the daemon writes nothing else here)


def open_registries(paths: "tuple[str, ...]") -> tuple[int, ...]:
    """Descriptors of the registries among ``paths`` that exist and are root's alone; opened by
    a sandbox's init before it builds (and, rootless, before it enters its user namespace, where
    root's files would show as nobody's)."""
    fds = []
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue                      # no daemon there (yet): nothing is registered
        st = os.fstat(fd)
        if st.st_uid != 0 or st.st_mode & 0o022:
            os.close(fd)
            continue
        fds.append(fd)
    return tuple(fds)


def read(fds: "tuple[int, ...]") -> Registered:
    """What the registries hold now. Each is listed through a fresh open of the directory (its own
    offset: brokers list from several threads). A registry that cannot be read counts as holding
    every address (OSError: the caller refuses)."""
    found = Registered()
    for fd in fds:
        here = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=fd)
        try:
            names = os.listdir(here)
        finally:
            os.close(here)
        for name in names:
            found.add(name)
    return found


def tcp_destination(sockaddr: bytes) -> tuple[bytes, int] | None:
    """(address bytes, port) a connect() to this AF_INET/AF_INET6 sockaddr reaches, as listeners
    are registered: an IPv4-mapped or -compatible IPv6 address as its IPv4 address, the
    unspecified addresses as the loopback ones the kernel sends them to. None for anything else."""
    if len(sockaddr) < 4:
        return None
    family, port = struct.unpack_from("=H", sockaddr)[0], struct.unpack_from("!H", sockaddr, 2)[0]
    if family == AF_INET and len(sockaddr) >= 8:
        address = sockaddr[4:8]
    elif family == AF_INET6 and len(sockaddr) >= 24:
        address = sockaddr[8:24]
        if address[:12] == _V4_MAPPED or (address[:12] == bytes(12) and int.from_bytes(address[12:], "big") > 1):
            address = address[12:]
        elif address == bytes(16):
            address = _LOOPBACK_V6
    else:
        return None
    if address == bytes(4):
        address = _LOOPBACK_V4
    return address, port
