"""A secret a client takes from its own environment (``--credential VAR=...``: `sandboxd run`,
`sandboxd mcp`, `sandboxctl session create|policy`), moved out of every place the user's other
processes could read it.

A plain user's other processes (another agent, a danger-full-access command) run as the same uid:
they read /proc/PID/environ and, while the process is dumpable, its memory (/proc/PID/mem,
ptrace). So a client that takes a secret from its environment is first made non-dumpable
(``take_secrets``), then each secret is moved into a mapping the kernel empties in every child
(MADV_WIPEONFORK: `sandboxd run` forks its sandbox after) and each copy the process had is zeroed:
libc's (the environment block /proc/PID/environ shows) and the bytes Python's os.environ keeps.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Iterable

from sandboxd.errors import InvalidPolicy
from sandboxd.kernel import process
from sandboxd.policy.network import check_secret

MADV_WIPEONFORK = 18                 # Linux 4.14 (not in Python's mmap module)


class HeldSecret:
    """A secret kept, before the sandbox's fork, where no child gets it: a private anonymous
    mapping the kernel gives every child empty (MADV_WIPEONFORK; MADV_DONTFORK before Linux 4.14:
    the child has no such mapping at all)."""

    def __init__(self, source: memoryview) -> None:
        self._length = len(source)
        self._map = mmap.mmap(-1, max(self._length, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        try:
            self._map.madvise(MADV_WIPEONFORK)
        except OSError:
            self._map.madvise(mmap.MADV_DONTFORK)
        self._map[:self._length] = source

    def take(self) -> bytes:
        """The secret (a copy made now, after the fork), and the mapping zeroed and gone."""
        value = bytes(self._map[:self._length])
        self._map[:self._length] = bytes(self._length)
        self._map.close()
        return value


def take_from_environment(name: str) -> HeldSecret:
    """Move the secret of credential ``name`` out of this process's environment into a HeldSecret,
    zeroing the copies the process had (see the module's text), or InvalidPolicy naming ``name``
    (never the value) when it is unset or no header could carry it."""
    key = os.fsencode(name)
    value = os.environb.get(key)                     # Python's own bytes (os.environ's data): no copy
    if value is None:
        raise InvalidPolicy(f"credential {name}: ${name} is not set in your environment: export it, or give "
                            f"--credential-file {name}=PATH")
    check_secret(name, value)
    held = HeldSecret(memoryview(value))
    _zero_in_libc_environment(key)
    if len(value) > 1:                               # (one byte is the interpreter's shared object)
        ctypes.memset(ctypes.c_char_p(value), 0, len(value))   # the bytes' own buffer: no copy
    del os.environb[key]                             # unsetenv, and Python's entry
    return held


def _zero_in_libc_environment(key: bytes) -> None:
    """Zero the value of every ``key=`` entry of libc's environment (the block /proc/PID/environ
    shows; a name given twice has two), compared and measured in place: no copy is made."""
    libc = ctypes.CDLL(None)
    libc.strncmp.argtypes = (ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t)
    libc.strlen.argtypes, libc.strlen.restype = (ctypes.c_void_p,), ctypes.c_size_t
    environ = ctypes.POINTER(ctypes.c_void_p).in_dll(libc, "environ")
    prefix = key + b"="
    index = 0
    while (entry := environ[index]) is not None:
        if libc.strncmp(entry, prefix, len(prefix)) == 0:
            ctypes.memset(entry + len(prefix), 0, libc.strlen(entry + len(prefix)))
        index += 1


def take_secrets(names: "Iterable[str]") -> dict[str, bytes]:
    """The secrets of the variables ``names`` that are set, taken out of this process's
    environment after it is made non-dumpable (for a client that sends them at once: the daemon's
    clients). InvalidPolicy naming a variable (never the value) no header could carry."""
    present = [name for name in names if os.fsencode(name) in os.environb]
    if not present:
        return {}
    process.set_dumpable(False)
    return {name: take_from_environment(name).take() for name in present}


__all__ = ["HeldSecret", "take_from_environment", "take_secrets"]
