"""Linux namespaces: unshare in the child that becomes the sandbox."""

from __future__ import annotations

import ctypes

from sandboxd.kernel._libc import checked, libc

CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

# The namespaces a confined sandbox's init unshares for itself. The PID
# namespace is made by the spawner (see ``pid_namespace_for_next_child``); the
# network namespace is added separately because network_access=true keeps the
# host's for now.
ISOLATED_NOW = CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWCGROUP

_NAMES = {CLONE_NEWNS: "mnt", CLONE_NEWPID: "pid", CLONE_NEWIPC: "ipc", CLONE_NEWUTS: "uts",
          CLONE_NEWCGROUP: "cgroup", CLONE_NEWNET: "net", CLONE_NEWUSER: "user"}


def describe(flags: int) -> str:
    return ",".join(name for bit, name in _NAMES.items() if flags & bit)


def unshare(flags: int) -> None:
    """Move the caller into new namespaces (the new PID namespace applies to its next child)."""
    checked(libc.unshare(ctypes.c_int(flags)), f"unshare({describe(flags)})")


class PidNamespaceForNextChild:
    """Make the caller's next fork() PID 1 of a new PID namespace, then undo that.

    unshare(CLONE_NEWPID) moves only the caller's future children, and cannot
    be repeated while they go to a namespace other than the caller's own; a
    setns() to the caller's own PID namespace resets that. Holding this around
    a single fork costs no extra process (no intermediate "anchor" fork).
    """

    def __init__(self) -> None:
        import os
        self._own = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)

    def enter(self, existing: int | None = None) -> None:
        """A new PID namespace for the next child, or the one of pidfd ``existing`` (a session's)."""
        if existing is None:
            unshare(CLONE_NEWPID)
        else:
            setns(existing, CLONE_NEWPID)

    def leave(self) -> None:
        """Call in the parent only (in the child the old namespace is an ancestor: EINVAL)."""
        checked(libc.setns(ctypes.c_int(self._own), ctypes.c_int(CLONE_NEWPID)), "setns(pid) back")


def setns(fd: int, flags: int) -> None:
    """Join the namespaces of ``fd``: a namespace file, or a pidfd with several CLONE_NEW* flags (5.8+)."""
    checked(libc.setns(ctypes.c_int(fd), ctypes.c_int(flags)), f"setns({describe(flags)})")


def set_hostname(name: str) -> None:
    data = name.encode()
    checked(libc.sethostname(data, ctypes.c_size_t(len(data))), "sethostname")
