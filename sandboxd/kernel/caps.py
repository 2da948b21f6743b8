"""Privileges: switch to the sandbox uid/gid and leave no capability anywhere.

Order matters: the bounding set and securebits need CAP_SETPCAP, so they go
before the uid switch; the capability sets are cleared explicitly afterwards
because a switch to uid 0 keeps them; no_new_privs last, so no setuid binary
or file capability can hand anything back.
"""

from __future__ import annotations

import ctypes
import errno
import os

from sandboxd.errors import SetupError
from sandboxd.kernel._libc import checked, from_oserror, libc, prctl

PR_CAPBSET_READ = 23
PR_CAPBSET_DROP = 24
PR_GET_NO_NEW_PRIVS = 39
CAP_SYS_ADMIN = 21
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
PR_SET_SECUREBITS = 28
PR_SET_NO_NEW_PRIVS = 38
CAPABILITY_VERSION_3 = 0x20080522
# NOROOT: uid 0 gets no capabilities from exec; NO_CAP_AMBIENT_RAISE: none can
# be raised back; each locked so the sandboxed program cannot undo them.
SECBIT_NOROOT = 1 << 0
SECBIT_NOROOT_LOCKED = 1 << 1
SECBIT_KEEP_CAPS_LOCKED = 1 << 5
SECBIT_NO_CAP_AMBIENT_RAISE = 1 << 6
SECBIT_NO_CAP_AMBIENT_RAISE_LOCKED = 1 << 7
SECUREBITS = (SECBIT_NOROOT | SECBIT_NOROOT_LOCKED | SECBIT_KEEP_CAPS_LOCKED | SECBIT_NO_CAP_AMBIENT_RAISE
              | SECBIT_NO_CAP_AMBIENT_RAISE_LOCKED)
# Used when /proc/sys/kernel/cap_last_cap cannot be read (the native helper too).
FALLBACK_LAST_CAP = 40


def last_cap() -> int:
    try:
        with open("/proc/sys/kernel/cap_last_cap") as f:
            return int(f.read())
    except OSError:
        return FALLBACK_LAST_CAP


def drop_privileges(uid: int, gid: int, groups: "tuple[int, ...]" = (), *, keep_groups: bool = False) -> None:
    """Become ``uid:gid`` (with supplementary ``groups``: none unless given) with empty bounding,
    ambient, inheritable, permitted and effective sets, and NNP. ``keep_groups``: leave the
    supplementary groups as they are (in a user namespace with setgroups denied, the kernel
    refuses to change them: they stay the caller's own)."""
    try:
        for cap in range(last_cap() + 1):
            prctl(PR_CAPBSET_DROP, cap, step="drop capability bounding set")
        prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, step="clear ambient capabilities")
        prctl(PR_SET_SECUREBITS, SECUREBITS, step="set securebits")
        if not keep_groups:
            os.setgroups(list(groups))
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
        # For uid 0 the kernel keeps the capability sets across setresuid: clear them.
        clear_capability_sets()
        prctl(PR_SET_NO_NEW_PRIVS, 1, step="set no_new_privs")
    except OSError as exc:
        raise from_oserror(exc, "drop privileges") from None


def set_no_new_privs() -> None:
    prctl(PR_SET_NO_NEW_PRIVS, 1, step="set no_new_privs")


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def clear_capability_sets() -> None:
    """capset(2) with all-zero effective, permitted and inheritable sets (both 32-bit halves).

    One system call through ctypes; python-prctl's libcap wrappers would cost
    an import of several milliseconds on every launch for the same result.
    """
    header = _CapHeader(CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    checked(libc.capset(ctypes.byref(header), data), "capset")


def verify_dropped() -> None:
    """Refuse to go on unless the inherited no_new_privs and empty bounding set are really there.

    Two prctl reads: cheap enough for the launch path (parsing /proc/self/status is not).
    """
    if prctl(PR_GET_NO_NEW_PRIVS, step="verify privileges") != 1:
        raise SetupError("verify privileges", errno.EPERM, detail="no_new_privs is not set")
    if prctl(PR_CAPBSET_READ, CAP_SYS_ADMIN, step="verify privileges") != 0:
        raise SetupError("verify privileges", errno.EPERM, detail="the capability bounding set is not empty")
