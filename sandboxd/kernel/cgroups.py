"""cgroups: memory and process-count limits, peak memory, and killing a whole tree.

Both layouts exist in the wild: cgroup v2 only (modern distributions), and v1
controllers beside an almost empty v2 (this project's CI machine). Each
controller is taken from v2 when the unified hierarchy offers it, else from
its v1 hierarchy. A v2 group is also made with no controller at all when v2 is
mounted, for ``cgroup.kill``, which kills a tree in one write.
"""

from __future__ import annotations

import errno
import os
import _signal as signal  # the C module: signal.py builds IntEnums, which costs more than a launch
import time

from sandboxd._record import Record
from sandboxd.errors import LimitsUnavailable
from sandboxd.kernel._libc import from_oserror

BASE_NAME = "sandboxd"


class Hierarchies(Record):
    unified: str | None               # cgroup2 mount point
    unified_own: str                  # our own v2 cgroup path ("/..." relative to the mount)
    unified_controllers: frozenset[str]
    v1: dict[str, tuple[str, str]]    # controller -> (mount point, our own path in it)


def detect() -> Hierarchies:
    unified = None
    v1: dict[str, tuple[str, str]] = {}
    own = _own_paths()
    with open("/proc/self/mountinfo") as info:
        for line in info:
            fields = line.split()
            sep = fields.index("-")
            fstype, options = fields[sep + 1], fields[sep + 3].split(",")
            point = fields[4]
            if fstype == "cgroup2" and unified is None:
                unified = point
            elif fstype == "cgroup":
                for controller in ("memory", "pids", "freezer"):
                    if controller in options:
                        v1[controller] = (point, own.get(controller, "/"))
    controllers: frozenset[str] = frozenset()
    if unified:
        try:
            with open(os.path.join(unified, "cgroup.controllers")) as f:
                controllers = frozenset(f.read().split())
        except OSError:
            pass
    return Hierarchies(unified, own.get("", "/"), controllers, v1)


def _own_paths() -> dict[str, str]:
    paths: dict[str, str] = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, names, path = line.rstrip("\n").split(":", 2)
            for name in names.split(",") if names else [""]:
                paths[name] = path
    return paths


_hierarchies: Hierarchies | None = None


def hierarchies() -> Hierarchies:
    global _hierarchies
    if _hierarchies is None:
        _hierarchies = detect()
    return _hierarchies


class CgroupSet:
    """The cgroups of one sandbox, across hierarchies."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.dirs: list[str] = []
        self.unified_dir: str | None = None
        self.memory_dir: str | None = None
        self.memory_v2 = False

    @classmethod
    def create(cls, name: str, *, memory_bytes: int | None, pids: int | None) -> "CgroupSet":
        h = hierarchies()
        group = cls(name)
        try:
            wanted = {c for c, v in (("memory", memory_bytes), ("pids", pids)) if v is not None}
            v2_controllers = {c for c in wanted if c in h.unified_controllers}
            if h.unified:
                base = _v2_base(h, v2_controllers)
                group.unified_dir = group._mkdir(os.path.join(base, name))
            for controller in sorted(wanted - v2_controllers):
                if controller not in h.v1:
                    raise LimitsUnavailable(
                        f"cgroup {controller}", errno.ENOENT,
                        hint=f"no cgroup v1 or v2 hierarchy offers the {controller} controller: enable it "
                             f"(cgroup v2: add +{controller} to cgroup.subtree_control) or drop the limit")
                point, own = h.v1[controller]
                base = os.path.join(point, own.lstrip("/"), BASE_NAME)
                os.makedirs(base, exist_ok=True)
                path = group._mkdir(os.path.join(base, name))
                if controller == "memory":
                    group.memory_dir = path
                    _write(path, "memory.limit_in_bytes", memory_bytes)
                    if os.path.exists(os.path.join(path, "memory.memsw.limit_in_bytes")):
                        _write(path, "memory.memsw.limit_in_bytes", memory_bytes)
                else:
                    _write(path, "pids.max", pids)
            if "memory" in v2_controllers:
                group.memory_dir, group.memory_v2 = group.unified_dir, True
                _write(group.unified_dir, "memory.max", memory_bytes)
                if os.path.exists(os.path.join(group.unified_dir, "memory.swap.max")):
                    _write(group.unified_dir, "memory.swap.max", 0)
            if "pids" in v2_controllers:
                _write(group.unified_dir, "pids.max", pids)
        except OSError as exc:
            group.remove()
            raise from_oserror(exc, "cgroup setup") from None
        except BaseException:
            group.remove()
            raise
        return group

    def _mkdir(self, path: str) -> str:
        os.mkdir(path, 0o755)
        self.dirs.append(path)
        return path

    def pids(self) -> set[int]:
        found: set[int] = set()
        for path in self.dirs:
            try:
                with open(os.path.join(path, "cgroup.procs")) as f:
                    found.update(int(x) for x in f.read().split())
            except OSError:
                pass
        return found

    def kill(self) -> None:
        """SIGKILL everything in the set, and wait until the groups are empty (bounded)."""
        if self.unified_dir and os.path.exists(os.path.join(self.unified_dir, "cgroup.kill")):
            try:
                _write(self.unified_dir, "cgroup.kill", 1)
            except OSError:
                pass
        deadline = time.monotonic() + 5
        while True:
            left = self.pids()
            if not left or time.monotonic() > deadline:
                return
            for pid in left:  # v1 has no cgroup.kill; a pids limit bounds any fork race here
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.002)

    def release(self) -> None:
        """Move survivors out to the parent groups (danger-full-access keeps background jobs)."""
        for path in self.dirs:
            parent = os.path.dirname(path)
            for pid in self.pids():
                try:
                    _write(parent, "cgroup.procs", pid)
                except OSError:
                    pass

    def peak_memory(self) -> int | None:
        if not self.memory_dir:
            return None
        name = "memory.peak" if self.memory_v2 else "memory.max_usage_in_bytes"
        return _read_int(self.memory_dir, name)

    def oom_killed(self) -> bool:
        if not self.memory_dir:
            return False
        name = "memory.events" if self.memory_v2 else "memory.oom_control"
        try:
            with open(os.path.join(self.memory_dir, name)) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill" and int(value) > 0:
                        return True
        except OSError:
            pass
        return False

    def remove(self) -> None:
        for path in reversed(self.dirs):
            for _ in range(200):
                try:
                    os.rmdir(path)
                    break
                except FileNotFoundError:
                    break
                except OSError as exc:
                    if exc.errno != errno.EBUSY:
                        break
                    time.sleep(0.005)  # the last process is still being torn down
        self.dirs.clear()


def join(dirs: list[str], pid: int = 0) -> None:
    """Move ``pid`` (0: the caller) into each group of ``dirs`` (a CgroupSet's ``dirs``, which a
    forked child has without the set)."""
    try:
        for path in dirs:
            _write(path, "cgroup.procs", pid)
    except OSError as exc:
        raise from_oserror(exc, "cgroup join") from None


def sweep_stale(prefix: str = "run-") -> int:
    """Remove the groups a killed daemon or `sandboxd run` left behind: ``<prefix><pid>-*`` under
    our base groups whose creator is dead. What still runs in one (a process that escaped its
    parent-death signal) is killed first: its sandbox's owner is gone, nobody can collect it.
    Returns how many groups were removed."""
    removed = 0
    for base in _sweep_bases(hierarchies()):
        try:
            names = os.listdir(base)
        except OSError:
            continue
        for name in names:
            owner = name[len(prefix):].split("-", 1)[0]
            if not name.startswith(prefix) or not owner.isdigit() or os.path.exists(f"/proc/{owner}"):
                continue
            group = os.path.join(base, name)
            stale = CgroupSet(name)
            # Parents first (remove() goes in reverse): a sandbox may have made groups inside its own.
            stale.dirs = [group] + [os.path.join(path, sub) for path, subs, _ in os.walk(group) for sub in subs]
            stale.unified_dir = group if os.path.exists(os.path.join(group, "cgroup.kill")) else None
            stale.kill()
            stale.remove()
            removed += not os.path.exists(group)
    return removed


def _sweep_bases(h: Hierarchies) -> list[str]:
    """Every base group sandboxes of this host's daemons may sit in: ours in each hierarchy, and,
    for a process that ``_v2_base`` moved into the ``supervisor`` leaf (cgroup v2 forbids
    processes beside the groups it hands controllers to), the base beside that leaf."""
    bases = []
    if h.unified:
        own = h.unified_own.rstrip("/")
        bases.append(os.path.join(h.unified, own.lstrip("/"), BASE_NAME))
        if os.path.basename(own) == "supervisor":
            bases.append(os.path.join(h.unified, os.path.dirname(own).lstrip("/"), BASE_NAME))
    bases += [os.path.join(point, own.lstrip("/"), BASE_NAME) for point, own in h.v1.values()]
    return list(dict.fromkeys(bases))


def _v2_base(h: Hierarchies, controllers: set[str]) -> str:
    """Our v2 base group, with ``controllers`` enabled for the groups below it."""
    assert h.unified
    own = os.path.join(h.unified, h.unified_own.lstrip("/"))
    base = os.path.join(own, BASE_NAME)
    os.makedirs(base, exist_ok=True)
    if controllers:
        wanted = " ".join("+" + c for c in sorted(controllers))
        try:
            if own.rstrip("/") != h.unified.rstrip("/"):
                _write(own, "cgroup.subtree_control", wanted)
        except OSError as exc:
            if exc.errno != errno.EBUSY:
                raise
            # cgroup v2 forbids processes in a group that hands controllers down:
            # move ourselves into a leaf beside the sandboxes (what Delegate=yes expects).
            leaf = os.path.join(own, "supervisor")
            os.makedirs(leaf, exist_ok=True)
            _write(leaf, "cgroup.procs", 0)
            _write(own, "cgroup.subtree_control", wanted)
        _write(base, "cgroup.subtree_control", wanted)
    return base


def _write(directory: str, name: str, value: object) -> None:
    with open(os.path.join(directory, name), "w") as f:
        f.write(str(value))


def _read_int(directory: str, name: str) -> int | None:
    try:
        with open(os.path.join(directory, name)) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
