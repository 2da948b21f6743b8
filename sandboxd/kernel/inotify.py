"""inotify(7), for the git guard: which watched directories had entries created, removed or renamed.

Only what the guard needs: a non-blocking instance, watches added through an
already opened directory descriptor (so the watch is on exactly the inode the
caller reached without following symlinks), and a drain of the pending events
into a set of watch descriptors. Errors are OSError: a caller that cannot watch
falls back to looking at everything.
"""

from __future__ import annotations

import ctypes
import os
import struct

from sandboxd.kernel._libc import libc

IN_MODIFY = 0x00000002
IN_ATTRIB = 0x00000004
IN_MOVED_FROM = 0x00000040
IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_DELETE = 0x00000200
IN_DELETE_SELF = 0x00000400
IN_MOVE_SELF = 0x00000800
IN_Q_OVERFLOW = 0x00004000
IN_IGNORED = 0x00008000
IN_ONLYDIR = 0x01000000
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC
# A directory's entries changed: what moves its ctime.
ENTRIES_CHANGED = IN_CREATE | IN_DELETE | IN_MOVED_FROM | IN_MOVED_TO | IN_DELETE_SELF | IN_MOVE_SELF

_EVENT = struct.Struct("iIII")
libc.inotify_init1.argtypes = [ctypes.c_int]
libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
libc.inotify_rm_watch.argtypes = [ctypes.c_int, ctypes.c_int]


class Inotify:
    def __init__(self) -> None:
        fd = libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if fd < 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code), "inotify_init1")
        self.fd = fd

    def watch_fd(self, dir_fd: int, mask: int = ENTRIES_CHANGED) -> int:
        """Watch the directory open as ``dir_fd`` (the same inode twice gives the same watch)."""
        wd: int = libc.inotify_add_watch(self.fd, f"/proc/self/fd/{dir_fd}".encode(), mask | IN_ONLYDIR)
        if wd < 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code), "inotify_add_watch")
        return wd

    def remove_watch(self, wd: int) -> None:
        """Stop watching (nothing when the kernel removed the watch already: its inode is gone)."""
        libc.inotify_rm_watch(self.fd, wd)

    def drain(self) -> tuple[set[int], bool]:
        """(the watches that saw an event since the last drain, whether the kernel's queue overflowed)."""
        fired: set[int] = set()
        overflow = False
        while True:
            try:
                data = os.read(self.fd, 65536)
            except BlockingIOError:
                return fired, overflow
            offset = 0
            while offset + _EVENT.size <= len(data):
                wd, mask, _cookie, length = _EVENT.unpack_from(data, offset)
                offset += _EVENT.size + length
                if mask & IN_Q_OVERFLOW:
                    overflow = True
                elif wd >= 0:
                    fired.add(wd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
