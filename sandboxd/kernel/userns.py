"""User namespaces for rootless launches: the caller's own uid and gid mapped to themselves.

As bwrap does for a plain user: the process unshares a user namespace, denies setgroups (the
kernel requires it before an unprivileged gid_map), and maps exactly its own uid and gid, so the
command is the same user inside as outside (never uid 0) while the process holds, inside that
namespace only, the capabilities needed to build the other namespaces and the mounts.
"""

from __future__ import annotations

import errno
import os

from sandboxd.errors import SetupError
from sandboxd.kernel import namespaces

USERNS_HINT = ("this host does not let a plain user create user namespaces (kernel.unprivileged_userns_clone, "
               "user.max_user_namespaces or an AppArmor/SELinux rule forbids it): run sandboxd run as root, "
               "or allow unprivileged user namespaces")


def enter_own(uid: int, gid: int) -> None:
    """Unshare a user namespace and map ``uid``/``gid`` (the caller's own) to themselves."""
    try:
        namespaces.unshare(namespaces.CLONE_NEWUSER)
    except SetupError as exc:
        if exc.errno in (errno.EPERM, errno.ENOSPC, errno.EUSERS, errno.EACCES):
            raise SetupError("unshare(user)", exc.errno, hint=USERNS_HINT) from None
        raise
    # "deny" first: without CAP_SETGID in the parent namespace the kernel refuses gid_map otherwise,
    # and it also keeps the command from dropping a supplementary group that a host file denies.
    _write("/proc/self/setgroups", "deny", "deny setgroups")
    _write("/proc/self/uid_map", f"{uid} {uid} 1\n", "write uid_map")
    _write("/proc/self/gid_map", f"{gid} {gid} 1\n", "write gid_map")


def _write(path: str, text: str, step: str) -> None:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.write(fd, text.encode())
        finally:
            os.close(fd)
    except OSError as exc:
        raise SetupError(step, exc.errno or errno.EIO, path) from None
