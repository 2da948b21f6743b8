"""Paths walked beneath a directory descriptor, never out of it: openat2(2) (Linux 5.6).

Review mode reads a session's upper layer and writes the host workspace from descriptors of
their top directories. A name in either may be swapped for a symlink (to /etc, to another
user's home) between the moment a person looked at a change and the moment it is applied, or a
file system may be mounted on a directory of the workspace. Every lookup here is made by the
kernel with RESOLVE_BENEATH (no ``..`` above the descriptor, no absolute path),
RESOLVE_NO_SYMLINKS (no symlink in any component, the last one included), RESOLVE_NO_MAGICLINKS
and RESOLVE_NO_XDEV (no crossing into another mount): such a name is refused (ELOOP, EXDEV),
never followed. What is then done with the descriptor is done to that very object.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat

from sandboxd.kernel._libc import libc, raw_syscall

RESOLVE_NO_XDEV = 0x01
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
# Every walk of this module: beneath the descriptor, through no symlink and no other mount.
STRICT = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV

DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
PATH_ONLY = os.O_PATH | os.O_CLOEXEC


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def open_beneath(dir_fd: int, rel: str, flags: int, mode: int = 0, *, resolve: int = STRICT) -> int:
    """A descriptor of ``rel`` (a relative path; "" or "." is ``dir_fd`` itself) looked up beneath
    ``dir_fd`` with ``resolve``. Raises OSError: ELOOP for a symlink on the way (or at the end,
    unless ``flags`` has O_PATH|O_NOFOLLOW), EXDEV for another mount or an escape."""
    how = _OpenHow(flags | os.O_CLOEXEC, mode, resolve)
    name = os.fsencode(rel or ".")
    result = raw_syscall("openat2", ctypes.c_int(dir_fd), ctypes.c_char_p(name), ctypes.byref(how),
                         ctypes.c_size_t(ctypes.sizeof(how)))
    if result < 0:
        raise OSError(-result, os.strerror(-result), rel)
    return result


def split(rel: str) -> tuple[str, str]:
    """("a/b", "c") for "a/b/c"; ("", "c") for "c"."""
    parent, _, name = rel.rpartition("/")
    return parent, name


def open_parent(dir_fd: int, rel: str) -> tuple[int, str]:
    """The directory holding ``rel`` (opened beneath ``dir_fd``, O_RDONLY|O_DIRECTORY) and the last
    name, which the caller then uses with ``*at`` calls that do not follow it."""
    parent, name = split(rel)
    if not name or name in (".", ".."):
        raise OSError(errno.EINVAL, "not a name in a directory", rel)
    return open_beneath(dir_fd, parent, DIRECTORY), name


def lstat_at(dir_fd: int, name: str) -> os.stat_result | None:
    """lstat of ``name`` in ``dir_fd`` (never followed), or None when there is nothing."""
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def remove_tree(dir_fd: int, name: str) -> int:
    """Remove ``name`` in ``dir_fd`` and, for a directory, everything below it: each directory is
    opened beneath its parent's descriptor (STRICT: a symlink or a mount is never entered; a
    symlink is unlinked as a name), so nothing outside is touched whatever is swapped meanwhile.
    Iterative (a tree may be deeper than Python's recursion limit). Returns the entries removed;
    raises OSError on the first refusal."""
    top = lstat_at(dir_fd, name)
    if top is None:
        return 0
    if not stat.S_ISDIR(top.st_mode):
        os.unlink(name, dir_fd=dir_fd)
        return 1
    removed = 0
    # (descriptor of a directory, its parent's descriptor, its name there)
    stack: list[tuple[int, int, str]] = [(open_beneath(dir_fd, name, DIRECTORY), dir_fd, name)]
    try:
        while stack:
            fd, parent, entry_name = stack[-1]
            subdir = None
            with os.scandir(fd) as entries:
                for entry in entries:
                    if entry.is_dir(follow_symlinks=False):
                        subdir = entry.name
                        break
                    os.unlink(entry.name, dir_fd=fd)
                    removed += 1
            if subdir is not None:
                stack.append((open_beneath(fd, subdir, DIRECTORY), fd, subdir))
                continue
            stack.pop()
            os.close(fd)
            os.rmdir(entry_name, dir_fd=parent)
            removed += 1
    finally:
        for fd, _, _ in stack:
            os.close(fd)
    return removed


RENAME_EXCHANGE = 2                         # <linux/fs.h>


def exchange(dir_fd: int, first: str, second: str) -> None:
    """Swap the names ``first`` and ``second`` in ``dir_fd`` at once (renameat2 RENAME_EXCHANGE,
    Linux 3.15): a reader sees one or the other, never neither."""
    if libc.renameat2(ctypes.c_int(dir_fd), os.fsencode(first), ctypes.c_int(dir_fd), os.fsencode(second),
                      ctypes.c_uint(RENAME_EXCHANGE)) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), first)
