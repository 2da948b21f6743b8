"""The free space the audit log's disk must keep before anything that writes may start
(``audit.min_free``): every event is committed before the action it records, so a full disk
would fail the calls under way half-way and refuse every new one with a storage error. Below the
floor the daemon refuses new calls, sessions and policy changes with RESOURCE_EXHAUSTED saying
where and how much is free, while what is under way finishes and is recorded (the floor is far
above what it can write) and every read keeps working.

The space counted is what the daemon itself can still write: as root it also writes the blocks a
file system reserves for root (``f_bfree``, not ``f_bavail``). So on a file system with a root
reserve at least as large as the floor (ext4's default 5% on any disk over 10 GiB, against the
default 512M), no user can bring the daemon below it by filling the disk with their own files or
from a sandbox's workspace: they run out of space first. On one without a reserve (tmpfs, xfs,
btrfs) they can, and the daemon then refuses everyone: give the state directory a file system of
its own, or a reserve (docs/operations.md says so). One ``statvfs`` per admission, a few
microseconds: no cache, so the daemon serves again as soon as space is freed.
"""

from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger("sandboxd")


class DiskFloor:
    def __init__(self, directory: str, min_bytes: int, min_percent: float, setting: str) -> None:
        self.directory, self._bytes, self._percent, self._setting = directory, min_bytes, min_percent, setting
        self._low = False                   # the last answer, to log each change once
        self._lock = threading.Lock()

    def shortfall(self) -> str | None:
        """Why nothing may start now (the disk is below the floor), or None."""
        if not self._bytes and not self._percent:
            return None
        try:
            stat = os.statvfs(self.directory)
        except OSError as exc:
            return self._changed(f"the audit log's directory {self.directory} cannot be examined ({exc.strerror})")
        free, size = stat.f_bfree * stat.f_frsize, stat.f_blocks * stat.f_frsize
        floor = self._bytes or int(size * self._percent / 100)
        if free >= floor:
            return self._changed(None)
        return self._changed(
            f"the disk holding the audit log ({self.directory}) has {_mib(free)} free, below audit.min_free "
            f"({self._setting}, {_mib(floor)}): no new call, session or policy change can be recorded, so none "
            "starts until space is freed there (calls under way finish; reading events and sessions still works)")

    def _changed(self, problem: str | None) -> str | None:
        with self._lock:
            was, self._low = self._low, problem is not None
        if problem is not None and not was:
            log.warning("refusing new calls: %s", problem)
        elif problem is None and was:
            log.warning("the audit log's disk has room again: calls are served")
        return problem


def _mib(size: int) -> str:
    return f"{size / (1 << 20):.1f} MiB"
