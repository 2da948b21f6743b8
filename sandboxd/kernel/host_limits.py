"""The built-in resource limits, derived from what this host has: a sandbox's default pids and memory
limits, and the caps of the parent cgroup every sandbox lives under (the ceiling).

Why these numbers (docs/threat-model.md says the same):

- pids 1024 per sandbox: a compiler driver, ``npm install``, ``make -j`` or pytest with workers stays
  in the low hundreds of tasks (threads count); a fork bomb reaches 1024 in well under a second and
  then gets EAGAIN.
- memory min(8 GiB, half of RAM) per sandbox: a large link or a test suite fits, while one sandbox
  can never take most of the machine.
- the ceiling: half of the host's task space (the smaller of kernel.pid_max and kernel.threads-max,
  as pids.max counts threads) and three quarters of RAM for all sandboxes together, so the host and
  its other users always keep the rest, however many sessions there are.
- an owner's share of the ceiling's pids: a fifth, so up to four users (or TLS principals) that fill
  their share still leave a fifth of it to everyone else. pids.max has no killer: at a full ceiling
  every fork below it fails, whoever caused it. Memory has one (the OOM killer acts at the full
  group), so an owner's memory share is set only when configured (limits.owner_memory).
- an owner's inotify watches (the git guard's, quotas.git_watches_per_uid): a sixteenth of root's
  fs.inotify.max_user_watches, which every root process on the host shares (systemd, udev, file
  managers, other daemons): four owners at their budget leave three quarters of it to the rest.
"""

from __future__ import annotations

from sandboxd._record import Record

DEFAULT_PIDS = 1024
DEFAULT_MEMORY_CAP = 8 << 30
OWNERS_SERVED = 5          # the default owner share is 1/5: four owners at theirs leave a fifth served
WATCH_SHARE = 16           # an owner's default inotify budget: 1/16 of root's fs.inotify.max_user_watches
# The git guards' default inotify instances: 1/8 of root's fs.inotify.max_user_instances (16 of the default
# 128). Root's other users hold some (systemd, journald, udevd, logind a few each; each running root
# `sandboxd run` one), and another sandboxd daemon on the host takes its own eighth.
INSTANCE_SHARE = 8


class Ceiling(Record):
    """The caps of the parent cgroup of all sandboxes (None: that cap is not set)."""

    pids: int | None = None
    memory_bytes: int | None = None


class OwnerShare(Record):
    """One owner's share of the ceiling: the caps of the group ``owner-<key>`` that all sandboxes of
    one owner (a local uid, or a TLS principal) live in, below the parent group (None: not capped)."""

    key: str
    pids: int | None = None
    memory_bytes: int | None = None


def owner_pids(total_pids: int) -> int:
    """An owner's pids share when nothing sets one: a fifth of the total, so four owners at their
    share still leave a fifth for everyone else."""
    return max(1, total_pids // OWNERS_SERVED)


def memory_total() -> int:
    """MemTotal of /proc/meminfo, in bytes."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise OSError("/proc/meminfo has no MemTotal line")


def task_space() -> int:
    """How many tasks the host can have at once: the smaller of kernel.pid_max and kernel.threads-max."""
    values = []
    for name in ("pid_max", "threads-max"):
        with open(f"/proc/sys/kernel/{name}") as f:
            values.append(int(f.read()))
    return min(values)


def default_memory() -> int:
    """A sandbox's memory limit when nothing sets one: min(8 GiB, half of RAM)."""
    return min(DEFAULT_MEMORY_CAP, _whole_mib(memory_total() // 2))


def default_ceiling() -> Ceiling:
    """The parent group's caps when nothing sets them: half the host's task space, three quarters of RAM."""
    return Ceiling(pids=task_space() // 2, memory_bytes=_whole_mib(memory_total() * 3 // 4))


def _whole_mib(size: int) -> int:
    """Rounded down to whole MiB: cgroup v1 rounds a limit down to pages, so it reads back as written."""
    return size >> 20 << 20


def git_instances() -> int:
    """The git guards' inotify instances when nothing sets how many: an eighth of this host's
    fs.inotify.max_user_instances (every root process's instances together), at least 2 (one owner's
    own and the one the others share)."""
    with open("/proc/sys/fs/inotify/max_user_instances") as f:
        return max(2, int(f.read()) // INSTANCE_SHARE)


def owner_watches() -> int:
    """An owner's inotify budget when nothing sets one: a sixteenth of this host's
    fs.inotify.max_user_watches (every root process's watches together)."""
    with open("/proc/sys/fs/inotify/max_user_watches") as f:
        return max(1, int(f.read()) // WATCH_SHARE)
