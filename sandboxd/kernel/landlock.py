"""Landlock: a second, independent wall for filesystem writes (and signals).

The read-only mount tree is the first wall. Landlock restricts the command
by path as well, so a mistake in the mount sequence alone would not make the
host writable. Only write-type accesses are handled: reads and execution stay
governed by the mount tree and file permissions. Kernels without Landlock
(before 5.13, or with it disabled) keep the first wall only; ``abi_version``
tells which.
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
REFER = 1 << 13        # ABI 2: rename/link across directories
TRUNCATE = 1 << 14     # ABI 3
SCOPE_SIGNAL = 1 << 1  # ABI 6: no signals to processes outside the domain (init, the host)

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
    """The kernel's Landlock ABI, 0 when unavailable."""
    global _abi
    if _abi is None:
        result = raw_syscall("landlock_create_ruleset", None, 0, _CREATE_VERSION)
        _abi = result if result > 0 else 0
    return _abi


def write_accesses(abi: int) -> int:
    access = (WRITE_FILE | REMOVE_DIR | REMOVE_FILE | MAKE_CHAR | MAKE_DIR | MAKE_REG | MAKE_SOCK | MAKE_FIFO
              | MAKE_BLOCK | MAKE_SYM)
    if abi >= 2:
        access |= REFER
    if abi >= 3:
        access |= TRUNCATE
    return access


def restrict_writes(writable: list[str], file_writes_only: list[str]) -> int:
    """Allow every write beneath ``writable`` and plain file writes beneath ``file_writes_only``
    (``/dev`` for /dev/null, ``/proc`` for /proc/self knobs); deny all other writes.
    Needs no_new_privs. Returns the ABI used (0: not enforced by this kernel)."""
    abi = abi_version()
    if abi == 0:
        return 0
    handled = write_accesses(abi)
    attr = _RulesetAttr(handled, 0, SCOPE_SIGNAL if abi >= 6 else 0)
    size = ctypes.sizeof(attr) if abi >= 6 else 16 if abi >= 4 else 8
    ruleset = checked(raw_syscall("landlock_create_ruleset", ctypes.byref(attr), size, 0), "landlock ruleset")
    try:
        file_access = WRITE_FILE | (TRUNCATE if abi >= 3 else 0)
        for paths, access in ((writable, handled), (file_writes_only, file_access)):
            for path in paths:
                try:
                    fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
                except FileNotFoundError:
                    continue
                try:
                    is_dir = os.path.isdir(f"/proc/self/fd/{fd}")
                    # On a file only file rights may be granted (EINVAL otherwise).
                    allowed = access if is_dir else access & (WRITE_FILE | TRUNCATE)
                    rule = _PathBeneath(allowed, fd)
                    checked(raw_syscall("landlock_add_rule", ruleset, _RULE_PATH_BENEATH, ctypes.byref(rule), 0),
                            "landlock rule", path)
                finally:
                    os.close(fd)
        result = raw_syscall("landlock_restrict_self", ruleset, 0)
        if result == -errno.ENOSYS:
            return 0
        checked(result, "landlock restrict")
    finally:
        os.close(ruleset)
    return abi
