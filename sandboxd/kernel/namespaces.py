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

# Every namespace a filesystem-confined sandbox gets. The network namespace is
# added separately because network_access=true keeps the host's for now.
ISOLATED = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWCGROUP

_NAMES = {CLONE_NEWNS: "mnt", CLONE_NEWPID: "pid", CLONE_NEWIPC: "ipc", CLONE_NEWUTS: "uts",
          CLONE_NEWCGROUP: "cgroup", CLONE_NEWNET: "net", CLONE_NEWUSER: "user"}


def describe(flags: int) -> str:
    return ",".join(name for bit, name in _NAMES.items() if flags & bit)


def unshare(flags: int) -> None:
    """Move the caller into new namespaces (the new PID namespace applies to its next child)."""
    checked(libc.unshare(ctypes.c_int(flags)), f"unshare({describe(flags)})")


def set_hostname(name: str) -> None:
    data = name.encode()
    checked(libc.sethostname(data, ctypes.c_size_t(len(data))), "sethostname")
