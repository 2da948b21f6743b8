"""Privileges: switch to the sandbox uid/gid and leave no capability anywhere.

Order matters: the bounding set and securebits need CAP_SETPCAP, so they go
before the uid switch; the capability sets are cleared explicitly afterwards
because a switch to uid 0 keeps them; no_new_privs last, so no setuid binary
or file capability can hand anything back.
"""

from __future__ import annotations

import errno
import os

import prctl as _prctl  # python-prctl: capset(2) via libcap, securebits, no_new_privs

from sandboxd.errors import SetupError
from sandboxd.kernel._libc import from_oserror, prctl

PR_CAPBSET_READ = 23
PR_CAPBSET_DROP = 24
PR_GET_NO_NEW_PRIVS = 39
CAP_SYS_ADMIN = 21
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
PR_SET_SECUREBITS = 28
# NOROOT: uid 0 gets no capabilities from exec; NO_CAP_AMBIENT_RAISE: none can
# be raised back; each locked so the sandboxed program cannot undo them.
SECUREBITS = (1 << 0) | (1 << 1) | (1 << 5) | (1 << 6) | (1 << 7)  # NOROOT(+LOCKED), KEEP_CAPS_LOCKED, NO_CAP_AMBIENT_RAISE(+LOCKED)


def last_cap() -> int:
    try:
        with open("/proc/sys/kernel/cap_last_cap") as f:
            return int(f.read())
    except OSError:
        return 40


def drop_privileges(uid: int, gid: int) -> None:
    """Become ``uid:gid`` with empty bounding, ambient, inheritable, permitted and effective sets, and NNP."""
    try:
        for cap in range(last_cap() + 1):
            prctl(PR_CAPBSET_DROP, cap, step="drop capability bounding set")
        prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, step="clear ambient capabilities")
        prctl(PR_SET_SECUREBITS, SECUREBITS, step="set securebits")
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
        # For uid 0 the kernel keeps the capability sets across setresuid: clear them.
        _prctl.cap_effective.limit()
        _prctl.cap_permitted.limit()
        _prctl.cap_inheritable.limit()
        _prctl.set_no_new_privs(1)
    except OSError as exc:
        raise from_oserror(exc, "drop privileges") from None


def verify_dropped() -> None:
    """Refuse to go on unless the inherited no_new_privs and empty bounding set are really there.

    Two prctl reads: cheap enough for the launch path (parsing /proc/self/status is not).
    """
    if prctl(PR_GET_NO_NEW_PRIVS, step="verify privileges") != 1:
        raise SetupError("verify privileges", errno.EPERM, detail="no_new_privs is not set")
    if prctl(PR_CAPBSET_READ, CAP_SYS_ADMIN, step="verify privileges") != 0:
        raise SetupError("verify privileges", errno.EPERM, detail="the capability bounding set is not empty")
