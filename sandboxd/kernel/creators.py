"""Who made something that outlives its maker, and whether that maker is provably dead.

A SIGKILLed daemon's fork server or `sandboxd run` leaves its sandbox cgroups (kernel.cgroups) and
its isolated networks' host links (kernel.netns) behind, and the next daemon sweeps them. Several
daemons may share those places: a cgroup base, the host's network namespace (a container with host
networking but a PID namespace of its own). So each thing carries its creator as ``creator_tag``,
``<pid>-<start>-<pidns>``: the pid, its start time (clock ticks after boot, /proc/PID/stat) and the
inode of its PID namespace; a cgroup in its name, a link in its alias.

A sweep takes a thing only when its creator is provably dead (``DeadCreators``): made in the
sweeper's own PID namespace, and that pid is gone, a zombie, or another process since (another start
time). A pid alone names no process in another namespace, so a thing made there, or one that names
no creator this way (an older sandboxd's), is never taken: one daemon must never kill, remove or
wait on another's sandboxes, nor cut their networks.
"""

from __future__ import annotations

import os

Creator = tuple[int, int, int]          # (pid, start time, PID namespace inode)

_own: tuple[int, str] | None = None     # (pid, its tag): read once per process (a forked child is another)


def creator_tag() -> str:
    """This process as a creator: ``<pid>-<start>-<pidns>``."""
    global _own
    pid = os.getpid()
    if _own is None or _own[0] != pid:
        _own = (pid, f"{pid}-{start_time(pid)}-{os.stat('/proc/self/ns/pid').st_ino}")
    return _own[1]


def parse_creator(text: str) -> Creator | None:
    """The creator a ``creator_tag`` names, from text that begins with one (what follows it after a
    ``-`` is the caller's: a cgroup's serial); None for any other text."""
    fields = text.split("-")
    if len(fields) < 3 or not all(field.isascii() and field.isdigit() for field in fields[:3]):
        return None
    return int(fields[0]), int(fields[1]), int(fields[2])


def start_time(pid: int) -> int | None:
    """When ``pid`` started (clock ticks after boot: field 22 of /proc/PID/stat); None if there is
    no such process or it has exited (a zombie: a SIGKILLed daemon's fork server is one until its
    new parent reaps it, and what it made is stale already)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat_file:
            fields = stat_file.read().rpartition(b")")[2].split()
    except OSError:
        return None
    if len(fields) < 20 or fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])


def own_pid_namespace() -> int | None:
    """Our PID namespace's inode, when /proc is that namespace's (else the pids /proc shows are not
    ours to look up: None, and nothing can be proven dead)."""
    try:
        if os.readlink("/proc/self") != str(os.getpid()):
            return None
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def provably_dead(creator: Creator, namespace: int) -> bool:
    """Made in our PID namespace (``namespace``) by a process that is no longer there (gone, a
    zombie, or its pid reused by a process that started at another time)."""
    pid, start, made_in = creator
    return made_in == namespace and start_time(pid) != start


class DeadCreators:
    """One sweep's verdicts: ``creator in dead`` when it is provably dead. Each creator is judged once
    per sweep, not once per thing: a fork server with 1,000 sessions would otherwise read its own
    /proc entry 1,000 times a sweep."""

    def __init__(self) -> None:
        self.namespace = own_pid_namespace()       # None: /proc is not our namespace's, nothing is dead
        self._verdicts: dict[Creator, bool] = {}

    def __contains__(self, creator: Creator) -> bool:
        if self.namespace is None:
            return False
        verdict = self._verdicts.get(creator)
        if verdict is None:
            verdict = self._verdicts[creator] = provably_dead(creator, self.namespace)
        return verdict
