"""The daemon's allocation tracer, for finding memory growth under load (a soak): off by default.

``SANDBOXD_TRACEMALLOC=<file>`` in ``sandboxd serve``'s environment starts :mod:`tracemalloc`
(``SANDBOXD_TRACEMALLOC_FRAMES`` frames per traceback, 8 by default) and a thread that, every
``SANDBOXD_TRACEMALLOC_INTERVAL`` seconds (300 by default), appends to ``<file>`` the process's
RSS, the traced total, and the allocations that grew most by traceback, both since the first
snapshot (what keeps growing) and since the previous one (what grows now).

Only whoever starts the daemon (root, a service manager) sets its environment; no caller can
turn this on. The file is created 0600 and never followed through a symbolic link. When the
variable is unset nothing is started or traced: the only cost is one environment lookup at
start. Tracing slows every allocation (a few times) and holds a trace per live block:
it is a debugging aid, not something to leave on in production.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
import tracemalloc
from collections.abc import Mapping
from typing import TextIO

import psutil

ENV_FILE = "SANDBOXD_TRACEMALLOC"
ENV_INTERVAL = "SANDBOXD_TRACEMALLOC_INTERVAL"
ENV_FRAMES = "SANDBOXD_TRACEMALLOC_FRAMES"
DEFAULT_INTERVAL_S = 300.0
DEFAULT_FRAMES = 8
TOP = 25                    # tracebacks listed per comparison
# Frames that are the tracer itself or the import machinery: noise in every comparison.
IGNORED = (tracemalloc.__file__, "<frozen importlib._bootstrap>", "<frozen importlib._bootstrap_external>",
           "<unknown>")


def rss_kib() -> int | None:
    """This process's resident set (KiB: VmRSS), None where the kernel does not say."""
    try:
        return int(psutil.Process().memory_info().rss) // 1024
    except psutil.Error:
        return None


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def malloc_kib() -> str:
    """glibc's view of the C heap, every arena summed (mallinfo2): what is in use, what is free but
    kept (fragmentation: RSS that no Python object accounts for), what is mmapped. "" elsewhere."""
    try:
        mallinfo2 = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):                 # not glibc, or older than 2.33
        return ""
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return (f"  malloc: in use {info.uordblks >> 10} KiB, free in heaps {info.fordblks >> 10} KiB "
            f"(top {info.keepcost >> 10}), heaps {info.arena >> 10} KiB, mmapped {info.hblkhd >> 10} KiB")


class MemoryTracer:
    """tracemalloc plus a thread that writes a comparison every ``interval`` seconds until ``stop``."""

    def __init__(self, path: str, interval: float = DEFAULT_INTERVAL_S, frames: int = DEFAULT_FRAMES) -> None:
        if interval <= 0 or frames < 1:
            raise ValueError(f"{ENV_INTERVAL} must be > 0 and {ENV_FRAMES} >= 1 (got {interval}, {frames})")
        self.path, self.interval, self.frames = path, interval, frames
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sandboxd-memtrace", daemon=True)
        self._first: tracemalloc.Snapshot | None = None
        self._previous: tracemalloc.Snapshot | None = None
        self._started = time.monotonic()
        self.dumps = 0

    def start(self) -> None:
        tracemalloc.start(self.frames)
        self._first = self._previous = self._snapshot()
        self._write_header()
        self._thread.start()

    def stop(self) -> None:
        """One last comparison, then tracing off (its traces freed)."""
        self._stopping.set()
        self._thread.join(timeout=30)
        if tracemalloc.is_tracing():
            self.dump()
            tracemalloc.stop()

    def _run(self) -> None:
        while not self._stopping.wait(self.interval):
            self.dump()

    def _snapshot(self) -> tracemalloc.Snapshot:
        return tracemalloc.take_snapshot().filter_traces(
            [tracemalloc.Filter(False, pattern) for pattern in IGNORED])

    def _open(self) -> TextIO:
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        return os.fdopen(fd, "a", encoding="utf-8")

    def _write_header(self) -> None:
        with self._open() as out:
            out.write(f"# sandboxd tracemalloc: pid {os.getpid()}, {self.frames} frames, a dump every "
                      f"{self.interval:g} s; RSS {rss_kib()} KiB at start\n")

    def dump(self) -> None:
        """Append the growth since the first and since the previous snapshot, by traceback."""
        snapshot = self._snapshot()
        traced, peak = tracemalloc.get_traced_memory()
        assert self._first is not None and self._previous is not None
        with self._open() as out:
            out.write(f"\n## t={time.monotonic() - self._started:.0f} s  RSS {rss_kib()} KiB  traced "
                      f"{traced / 1024:.0f} KiB (peak {peak / 1024:.0f} KiB)  tracer's own "
                      f"{tracemalloc.get_tracemalloc_memory() / 1024:.0f} KiB{malloc_kib()}\n")
            for title, base in (("since the first snapshot", self._first), ("since the previous", self._previous)):
                out.write(f"### top {TOP} by traceback, {title}\n")
                for stat in snapshot.compare_to(base, "traceback")[:TOP]:
                    out.write(f"{stat.size_diff / 1024:+9.1f} KiB  {stat.count_diff:+7d} blocks  "
                              f"now {stat.size / 1024:9.1f} KiB in {stat.count} blocks\n")
                    # File and line only: traceback.format() would read every source file into
                    # linecache, which then grows with each dump (the tracer measuring itself).
                    for frame in reversed(stat.traceback):
                        out.write(f"      {frame.filename}:{frame.lineno}\n")
        self._previous = snapshot
        self.dumps += 1


def start_from_environment(environ: Mapping[str, str] = os.environ) -> MemoryTracer | None:
    """The tracer ``environ`` asks for, started; None (and nothing traced) when it asks for none."""
    path = environ.get(ENV_FILE, "")
    if not path:
        return None
    tracer = MemoryTracer(path, interval=float(environ.get(ENV_INTERVAL) or DEFAULT_INTERVAL_S),
                          frames=int(environ.get(ENV_FRAMES) or DEFAULT_FRAMES))
    tracer.start()
    return tracer
