"""glibc's malloc arenas for the daemon: two, not eight per core.

glibc gives threads that contend for the heap arenas of their own (up to 8 x cores), and an arena
only gives memory back from its top: every arena keeps the free space its busiest moment left.
The daemon's threads come and go with its calls (gRPC workers, a stdin feeder per Exec), so
under sustained load its C heaps kept growing with free memory that no object held: a soak's
tracemalloc showed the Python objects flat and glibc's mallinfo2 showed the heaps' free space
rising with RSS (issue 18, item 6: 80 -> 106 MiB of heaps over 12 minutes, 16-20 MiB in use).
With two arenas the same soak ended at 81 MiB of heaps (RSS 77 against 79 MiB: within the
noise of a 12-minute run; the 60-minute soak decides). The daemon's Python code runs under the
GIL anyway, and gRPC's own threads are few.

``MALLOC_ARENA_MAX`` in the daemon's environment (glibc's own knob) wins: then nothing is changed.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping

DAEMON_ARENAS = 2
M_ARENA_MAX = -8                    # <malloc.h>


def limit_arenas(count: int = DAEMON_ARENAS, environ: Mapping[str, str] = os.environ) -> bool:
    """Cap glibc's malloc arenas at ``count`` for the threads started from now on; True if set.
    False where the C library is not glibc, or where ``MALLOC_ARENA_MAX`` already says."""
    if environ.get("MALLOC_ARENA_MAX"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(M_ARENA_MAX, count))
