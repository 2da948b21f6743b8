"""Landlock: a second, independent wall for filesystem writes (and signals).

The read-only mount tree is the first wall. Landlock restricts the command
by path as well, so a mistake in the mount sequence alone would not make the
host writable. Only write-type accesses are handled: reads and execution stay
governed by the mount tree and file permissions. Kernels without Landlock
(before 5.13, or with it disabled) keep the first wall only; ``abi_version``
tells which.

Every right is handled only from the ABI that introduced it (``RIGHT_ABI``), so
an older kernel gets the subset it knows and never an EINVAL. The constants
here are the single source for the native helper too: native_call.py writes
them into the header sandboxd_call.c is built with.
"""

from __future__ import annotations

import ctypes
import errno
import os

from sandboxd.kernel._libc import checked, raw_syscall

WRITE_FILE = 1 << 1
REMOVE_DIR = 1 << 4
REMOVE_FILE = 1 << 5
MAKE_CHAR = 1 << 6
MAKE_DIR = 1 << 7
MAKE_REG = 1 << 8
MAKE_SOCK = 1 << 9
MAKE_FIFO = 1 << 10
MAKE_BLOCK = 1 << 11
MAKE_SYM = 1 << 12
REFER = 1 << 13        # ABI 2: rename/link across directories (ABI 1 denies every such reparenting)
TRUNCATE = 1 << 14     # ABI 3
IOCTL_DEV = 1 << 15    # ABI 5: not handled (device ioctls are the seccomp filter's and nodev mounts' job)
SCOPE_ABSTRACT_UNIX_SOCKET = 1 << 0  # ABI 6: not handled (see docs/kernels.md: abstract sockets)
SCOPE_SIGNAL = 1 << 1  # ABI 6: no signals to processes outside the domain (init, the host)

# The first ABI that knows each right: handling a right the kernel does not know is EINVAL.
RIGHT_ABI = {WRITE_FILE: 1, REMOVE_DIR: 1, REMOVE_FILE: 1, MAKE_CHAR: 1, MAKE_DIR: 1, MAKE_REG: 1,
             MAKE_SOCK: 1, MAKE_FIFO: 1, MAKE_BLOCK: 1, MAKE_SYM: 1, REFER: 2, TRUNCATE: 3, IOCTL_DEV: 5}
SCOPE_ABI = {SCOPE_ABSTRACT_UNIX_SOCKET: 6, SCOPE_SIGNAL: 6}
NET_ABI = 4          # handled_access_net exists (ruleset attr 16 bytes); not handled: namespaces and seccomp
SCOPE_ATTR_ABI = 6   # scoped exists (ruleset attr 24 bytes)
HIGHEST_KNOWN_ABI = 7

# What the sandbox wants handled, before the ABI cut.
WANTED_WRITES = (WRITE_FILE | REMOVE_DIR | REMOVE_FILE | MAKE_CHAR | MAKE_DIR | MAKE_REG | MAKE_SOCK | MAKE_FIFO
                 | MAKE_BLOCK | MAKE_SYM | REFER | TRUNCATE)
WANTED_FILE_WRITES = WRITE_FILE | TRUNCATE   # on /dev and /proc; the only rights a rule on a file may hold
WANTED_SCOPES = SCOPE_SIGNAL

# Paths every command may write besides its plan's writable roots, and where it may only
# write to existing files (/dev/null, /proc/self knobs). Shared with the native helper.
EXTRA_WRITABLE = ("/tmp", "/dev/shm")
FILE_WRITES_ONLY = ("/dev", "/proc")

_CREATE_VERSION = 1
_RULE_PATH_BENEATH = 1


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


_abi: int | None = None


def abi_version() -> int:
    """The kernel's Landlock ABI, 0 when unavailable (ENOSYS: not built; EOPNOTSUPP: disabled at
    boot; either way the read-only mounts stay the only wall, as on the native path)."""
    global _abi
    if _abi is None:
        result = raw_syscall("landlock_create_ruleset", None, 0, _CREATE_VERSION)
        if result in (-errno.ENOSYS, -errno.EOPNOTSUPP):
            result = 0
        # Any other refusal is not "an old kernel": fail rather than run without the wall.
        _abi = checked(result, "landlock version")
    return _abi


def known_rights(abi: int) -> int:
    return sum(right for right, first in RIGHT_ABI.items() if abi >= first)


def known_scopes(abi: int) -> int:
    return sum(scope for scope, first in SCOPE_ABI.items() if abi >= first)


def write_accesses(abi: int) -> int:
    """The write rights handled at ``abi``: what the sandbox wants, cut to what that ABI knows."""
    return WANTED_WRITES & known_rights(abi)


def effective_abi(forced: int = 0) -> int:
    """The ABI to use: the kernel's, or ``forced`` (tests only) when that is lower."""
    abi = abi_version()
    return min(abi, forced) if forced > 0 else abi


def restrict_writes(writable: list[str], file_writes_only: list[str], *, forced_abi: int = 0) -> int:
    """Allow every write beneath ``writable`` and plain file writes beneath ``file_writes_only``
    (``/dev`` for /dev/null, ``/proc`` for /proc/self knobs); deny all other writes.
    Needs no_new_privs. Returns the ABI used (0: not enforced by this kernel).
    ``forced_abi`` (tests only) uses a lower ABI's rights, as an older kernel would."""
    abi = effective_abi(forced_abi)
    if abi == 0:
        return 0
    handled = write_accesses(abi)
    attr = _RulesetAttr(handled, 0, WANTED_SCOPES & known_scopes(abi))
    size = ctypes.sizeof(attr) if abi >= SCOPE_ATTR_ABI else 16 if abi >= NET_ABI else 8
    # From here on every failure is fatal, ENOSYS included: Landlock answered the version query,
    # so a ruleset that cannot be enforced is a wall missing, not an old kernel (the native
    # helper does the same).
    ruleset = checked(raw_syscall("landlock_create_ruleset", ctypes.byref(attr), size, 0), "landlock ruleset")
    try:
        file_access = WANTED_FILE_WRITES & handled
        for paths, access in ((writable, handled), (file_writes_only, file_access)):
            for path in paths:
                try:
                    fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
                except FileNotFoundError:
                    continue
                try:
                    is_dir = os.path.isdir(f"/proc/self/fd/{fd}")
                    # On a file only file rights may be granted (EINVAL otherwise).
                    allowed = access if is_dir else access & WANTED_FILE_WRITES
                    rule = _PathBeneath(allowed, fd)
                    checked(raw_syscall("landlock_add_rule", ruleset, _RULE_PATH_BENEATH, ctypes.byref(rule), 0),
                            "landlock rule", path)
                finally:
                    os.close(fd)
        checked(raw_syscall("landlock_restrict_self", ruleset, 0), "landlock restrict")
    finally:
        os.close(ruleset)
    return abi
