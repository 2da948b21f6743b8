"""Mount primitives: bind, remount, fresh kernel filesystems, pivot_root.

The order in which they are used to build a sandbox's root lives in
``sandboxd.launcher.rootfs``; this module only knows how to do each one.
"""

from __future__ import annotations

import ctypes
import errno
import os

from sandboxd.errors import SetupError
from sandboxd.kernel._libc import checked, fsencode, libc, raw_syscall, setup_error

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_BIND = 4096
MS_MOVE = 8192
MS_REC = 16384
MS_PRIVATE = 1 << 18
MS_SLAVE = 1 << 19
MNT_DETACH = 2

MOUNT_ATTR_RDONLY = 0x1
MOUNT_ATTR_NOSUID = 0x2
MOUNT_ATTR_NODEV = 0x4
MOUNT_ATTR_NOEXEC = 0x8
AT_RECURSIVE = 0x8000
AT_EMPTY_PATH = 0x1000


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None,
          *, step: str | None = None) -> None:
    result = libc.mount(fsencode(source), fsencode(target), fsencode(fstype), ctypes.c_ulong(flags),
                        fsencode(data))
    checked(result, step or f"mount {fstype or 'bind'}", target)


def make_private(path: str = "/") -> None:
    """Stop mount events propagating between the host and the sandbox, both ways."""
    mount(None, path, None, MS_REC | MS_PRIVATE, step="mount --make-rprivate")


def bind(source: str, target: str, *, recursive: bool = True, step: str | None = None) -> None:
    mount(source, target, None, MS_BIND | (MS_REC if recursive else 0), step=step or "bind", )


OPEN_TREE_CLONE = 1
OPEN_TREE_CLOEXEC = os.O_CLOEXEC
AT_EMPTY_PATH = 0x1000
MOVE_MOUNT_F_EMPTY_PATH = 0x4


def clone_tree(fd: int, *, step: str, path: str | None = None) -> int:
    """A detached copy of the mount tree at ``fd`` (open_tree(OPEN_TREE_CLONE), Linux 5.2): a
    descriptor that a child in a new mount namespace can attach with ``attach_tree``. A path
    opened in the host's namespace cannot be a bind source there; a detached tree can, and it is
    exactly the object that was opened and checked, whatever happens to the name later."""
    flags = OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC | AT_EMPTY_PATH | AT_RECURSIVE
    return checked(raw_syscall("open_tree", ctypes.c_int(fd), b"", ctypes.c_uint(flags)), step, path)


def attach_tree(tree: int, target: str, *, step: str) -> None:
    """Mount a tree from ``clone_tree`` at ``target`` (move_mount, Linux 5.2)."""
    checked(raw_syscall("move_mount", ctypes.c_int(tree), b"", ctypes.c_int(-100), fsencode(target),
                        ctypes.c_uint(MOVE_MOUNT_F_EMPTY_PATH)), step, target)


def set_attrs_recursive(target: str, attr_set: int, attr_clr: int = 0, *, step: str) -> None:
    """Change per-mount flags on ``target`` and every mount below it, in one call.

    mount_setattr(2) (Linux 5.12) does it atomically; older kernels get a walk
    over /proc/self/mountinfo remounting each mount point.
    """
    attr = _MountAttr(attr_set, attr_clr, 0, 0)
    result = raw_syscall("mount_setattr", ctypes.c_int(-100), fsencode(target), ctypes.c_uint(AT_RECURSIVE),
                         ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr)))
    if result == -errno.ENOSYS:
        _remount_each(target, attr_set, step=step)
        return
    checked(result, step, target)


def _remount_each(target: str, attr_set: int, *, step: str) -> None:
    flags = MS_REMOUNT | MS_BIND
    if attr_set & MOUNT_ATTR_RDONLY:
        flags |= MS_RDONLY
    if attr_set & MOUNT_ATTR_NOSUID:
        flags |= MS_NOSUID
    if attr_set & MOUNT_ATTR_NODEV:
        flags |= MS_NODEV
    prefix = target.rstrip("/") + "/"
    with open("/proc/self/mountinfo", "rb") as info:
        points = [os.fsdecode(line.split()[4]).replace("\\040", " ") for line in info]
    for point in points:
        if point == target or point.startswith(prefix):
            try:
                mount(None, point, None, flags, step=step)
            except SetupError as exc:
                # A mount that vanished meanwhile or a kernel pseudo-file we cannot remount is not a hole:
                # the parent is read-only already. Anything else is fatal.
                if exc.errno not in (errno.ENOENT, errno.EINVAL):
                    raise


def remount_readonly(target: str, *, extra: int = 0, step: str | None = None) -> None:
    """Make the single mount at ``target`` read-only (after a bind of it onto itself)."""
    mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | extra, step=step or "remount read-only")


def bind_readonly(source: str, target: str, *, step: str | None = None) -> None:
    bind(source, target, recursive=True, step=step)
    set_attrs_recursive(target, MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV,
                        step=step or "bind read-only")


def tmpfs(target: str, *, size: int, mode: int = 0o755, flags: int = MS_NOSUID | MS_NODEV,
          step: str | None = None) -> None:
    mount("tmpfs", target, "tmpfs", flags, f"size={size},mode={mode:o}", step=step or "mount tmpfs")


def pivot_root_here(new_root: str) -> None:
    """Make ``new_root`` the root and detach the old one so it is unreachable.

    pivot_root(".", ".") stacks the old root on top of the new one, which
    needs no put_old directory inside a read-only tree; the lazy unmount then
    takes the old root away from this namespace for good.
    """
    try:
        os.chdir(new_root)
    except OSError as exc:
        raise setup_error("pivot_root (chdir)", exc.errno or errno.EIO, new_root) from None
    checked(raw_syscall("pivot_root", b".", b"."), "pivot_root", new_root)
    checked(libc.umount2(b".", ctypes.c_int(MNT_DETACH)), "umount old root", "/")
    os.chdir("/")
