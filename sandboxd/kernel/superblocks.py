"""A file as the kernel's sockets name it: its superblock's device and its inode.

stat() reports the device a file system chooses to show, which is not always its superblock's:
btrfs gives each subvolume an anonymous device of its own (a file on the top subvolume stats as
0:67 while its superblock is 0:66). sock_diag's UNIX_DIAG_VFS names the file a socket is bound to
by the superblock's device (``dentry->d_sb->s_dev``), and so does /proc/PID/mountinfo. Comparing
a socket file the connect broker opened (fstat) with what sock_diag says (the registry of approval
channels, the sandbox's own sockets) must use the same device: this one. ``identity(fd)``: statx
gives the file's mount id, the mount namespace's table that mount's superblock device.

The table is cached, and read again whenever the mount namespace has changed since: the kernel
reports a change by a poll() on an open /proc/self/mountinfo (POLLPRI, proc(5)), each change once
per open file. A mount id is freed only when its mount leaves every namespace, which our namespace
reports; statx is asked first, on a descriptor that holds the mount (its id cannot be freed while
we look), then the poll: a cached id is the mount it was when the table was read.
"""

from __future__ import annotations

import _thread
import ctypes
import errno
import os
import select

from sandboxd.kernel._libc import raw_syscall

AT_EMPTY_PATH = 0x1000
STATX_INO = 0x100
STATX_MNT_ID = 0x1000
STATX_SIZE = 256
STX_MASK, STX_INO, STX_MNT_ID = 0, 32, 144            # offsets in struct statx
MOUNTINFO = "/proc/self/mountinfo"


class _Devices:
    """The mount namespace's superblock devices by mount id (the module's docstring)."""

    def __init__(self) -> None:
        self._lock = _thread.allocate_lock()            # the broker judges connects from several threads
        self._by_mount: dict[int, tuple[int, int]] = {}
        self._watch: "select.poll | None" = None
        self._watched = -1

    def identity(self, fd: int, st: os.stat_result) -> tuple[int, int, int]:
        """(major, minor, inode) of the file open on ``fd`` (``st``: its fstat), the device its
        superblock's; OSError when it cannot be told (the caller refuses)."""
        buffer = ctypes.create_string_buffer(STATX_SIZE)
        result = raw_syscall("statx", fd, b"", AT_EMPTY_PATH, STATX_INO | STATX_MNT_ID, buffer)
        if result < 0:
            raise OSError(-result, "statx")
        mask = int.from_bytes(buffer.raw[STX_MASK:STX_MASK + 4], "little")
        if not mask & STATX_MNT_ID:
            # A kernel before 5.8 has no mount ids in statx: stat's device, which is the
            # superblock's on every file system but btrfs.
            return (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)
        mount = int.from_bytes(buffer.raw[STX_MNT_ID:STX_MNT_ID + 8], "little")
        with self._lock:
            if self._changed() or mount not in self._by_mount:
                self._by_mount = _read_table()
            device = self._by_mount.get(mount)
        if device is None:
            raise OSError(errno.ENOENT, "the file's mount is not in this mount namespace")
        return (device[0], device[1], st.st_ino)

    def _changed(self) -> bool:
        """Whether the mount namespace changed since the last look (the first look: it did)."""
        if self._watch is None:
            self._watched = os.open(MOUNTINFO, os.O_RDONLY | os.O_CLOEXEC)
            self._watch = select.poll()
            self._watch.register(self._watched, select.POLLPRI)
            return True
        return any(events & (select.POLLPRI | select.POLLERR) for _, events in self._watch.poll(0))


def _read_table() -> dict[int, tuple[int, int]]:
    """Mount id -> (major, minor) of its superblock, from /proc/self/mountinfo ("ID PARENT MAJOR:MINOR ...")."""
    table = {}
    with open(MOUNTINFO, "rb") as f:
        for line in f:
            fields = line.split(b" ", 3)
            if len(fields) < 3:
                continue
            major, _, minor = fields[2].partition(b":")
            try:
                table[int(fields[0])] = (int(major), int(minor))
            except ValueError:
                continue
    return table


_devices = _Devices()


def identity(fd: int, st: os.stat_result) -> tuple[int, int, int]:
    """The file open on ``fd`` as sock_diag names it (see the module's docstring)."""
    return _devices.identity(fd, st)
