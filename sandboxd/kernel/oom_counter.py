"""A session's OOM-kill count, read twice per call from a descriptor the call opens once.

Every session call reads its session group's OOM kills before it starts and after it ends
(``SandboxProcess.count_oom_kills_in``). ``CgroupSet.oom_kills`` opens, decodes and closes the
file each time: about 15 us per read here, 30 us per call in the fork server's loop. A kernfs file
gives fresh contents to every ``pread`` at offset 0, so the call keeps it open from its start to
its end and a read is one system call and a bytes search (about 2 us). Same values, same file,
same meaning. Not the session's to keep: a descriptor held per open session is copied into every
helper the fork server spawns (spawner.SessionSandbox).
"""

from __future__ import annotations

import os

from sandboxd.kernel.cgroups import CgroupSet

_KEY = b"\noom_kill "    # memory.events (v2) and memory.oom_control (v1) both have an "oom_kill N" line
_READ_SIZE = 4096        # both files are a few lines long


class OomCounter:
    """``oom_kills()`` of one group, as ``CgroupSet.oom_kills`` counts them (0 without a memory group)."""

    def __init__(self, group: CgroupSet) -> None:
        self._fd = -1
        if group.memory_dir:
            name = "memory.events" if group.memory_v2 else "memory.oom_control"
            try:
                self._fd = os.open(os.path.join(group.memory_dir, name), os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                self._fd = -1     # as oom_kills: an unreadable file counts no kills

    def oom_kills(self) -> int:
        if self._fd < 0:
            return 0
        try:
            data = b"\n" + os.pread(self._fd, _READ_SIZE, 0)
            start = data.find(_KEY)
            if start < 0:
                return 0
            start += len(_KEY)
            end = data.find(b"\n", start)
            return int(data[start:end if end >= 0 else len(data)])
        except (OSError, ValueError):
            return 0

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
