"""cgroups: memory and process-count limits, peak memory, OOM kills, and killing a whole tree.

Both layouts exist in the wild: cgroup v2 only (modern distributions, Kubernetes nodes), and v1
controllers beside an almost empty v2 (this project's CI machine). Each controller is taken from
v2 when our own v2 group can hand it down, else from its v1 hierarchy. A v2 group is also made
with no controller at all when v2 is mounted, for ``cgroup.kill``, which kills a tree in one write.

cgroup v2 the way systemd and container runtimes expect (Documentation/admin-guide/cgroup-v2.rst,
"Delegation" and "No Internal Process Constraint"):

- Sandboxes go below our own group (``/proc/self/cgroup``): ``<own>/sandboxd/<sandbox>``. Under
  systemd with ``Delegate=yes`` that group is the unit's and ours to manage; in a container with a
  private cgroup namespace it is the namespace's root; as root outside systemd it is the real root.
- ``+memory +pids +cpu`` (those our group has) are enabled in ``<own>/cgroup.subtree_control`` and
  ``<own>/sandboxd/cgroup.subtree_control``. A group that hands controllers down may hold no
  processes, so when ``<own>`` holds some (the daemon itself) they move to the leaf
  ``<own>/sandboxd-supervisor`` first - only when ``<own>`` is delegated to us (systemd marks it
  with the ``trusted.delegate`` xattr) or is the root of our cgroup namespace. Nothing outside
  ``<own>`` is ever written.
- What this process created (the ``sandboxd`` base groups) is removed at exit when empty, so a
  `sandboxd run` as root leaves nothing behind.

Who made a sandbox group is in its name: ``run-<pid>-<start>-<pidns>-<serial>`` (``group_name``): the
creator's pid, its start time (clock ticks after boot, /proc/PID/stat) and the inode of its PID
namespace. A sweep (``stale_groups``) takes only the groups whose creator is provably dead, by the one
rule of kernel.creators (isolated networks' links are judged by it too): its PID namespace is the
sweeper's own, and that pid is gone, a zombie, or another process since (another start time). A
group made in another PID namespace (a daemon in a container sharing the cgroup base) or named
otherwise is never touched: a pid alone names no process there, and one daemon must never kill,
remove or wait on another's sandboxes.

Nothing here that a loop calls waits: ``signal_once`` and ``try_remove`` are one pass of system calls
each (what a group still holds, or a group still being torn down, is left for a later pass:
supervisor.waits.Leftovers). ``kill`` and ``remove`` wait (bounded), for a process with nothing else
to do: `sandboxd run`.

The base group is also the ceiling: a launch may carry the caps of all sandboxes together
(``Ceiling``: pids.max, and memory.max or v1's memory.limit_in_bytes), written on the base group of
each hierarchy that enforces the controller when this process first prepares it. Both controllers
are hierarchical (v1 memory too since Linux 5.11 made use_hierarchy always 1), so the sandboxes below
cannot together exceed it, whatever their own limits say.

Between the two, the sandboxes of one owner (a daemon's caller: a uid or a TLS principal; an
``OwnerShare``) share a group ``<base>/owner-<key>`` whose caps are that owner's share of the ceiling,
so one owner's sandboxes together cannot fill it for everyone else (pids.max has no killer: at a full
ceiling every fork below it fails). It is made on an owner's first launch and removed with its last
sandbox group; it holds no process on v2 (survivors of a danger-full-access command go to its
``released`` group), and the stale sweep removes one a killed daemon left empty.
"""

from __future__ import annotations

import errno
import os
import _signal as signal  # the C module: signal.py builds IntEnums, which costs more than a launch
import time

from sandboxd._record import Record
from sandboxd.errors import LimitsUnavailable
from sandboxd.kernel._libc import from_oserror
from sandboxd.kernel.creators import Creator, DeadCreators, creator_tag, parse_creator

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable

    from sandboxd.kernel.host_limits import Ceiling, OwnerShare

BASE_NAME = "sandboxd"
LEAF_NAME = "sandboxd-supervisor"   # where our own processes go when our group hands controllers down
RELEASED_NAME = "released"          # v2: survivors of a danger-full-access command (base is not a leaf)
OWNER_PREFIX = "owner-"             # <base>/owner-<key>: the sandboxes of one owner, under its share
V2_CONTROLLERS = ("cpu", "memory", "pids")
# The most groups one CgroupSet has: the v2 one, and a v1 one per controller a limit may take from
# v1 (memory, pids). The native call helper holds this many (native_call's header).
MAX_SET_DIRS = 3
DELEGATE_HINT = ("run the daemon from its systemd unit (Delegate=yes), or wrap the command: "
                 "systemd-run --scope -p Delegate=yes sandboxd run ...")


class Hierarchies(Record):
    unified: str | None               # cgroup2 mount point
    unified_own: str                  # our v2 group ("/..." relative to the mount), without our leaf
    unified_controllers: frozenset[str]  # what our v2 group can hand down (its cgroup.controllers)
    v1: dict[str, tuple[str, str]]    # controller -> (mount point, our own path in it)


def detect() -> Hierarchies:
    unified, unified_root = None, "/"
    v1: dict[str, tuple[str, str]] = {}
    own = _own_paths()
    with open("/proc/self/mountinfo") as info:
        for line in info:
            fields = line.split()
            sep = fields.index("-")
            fstype, options = fields[sep + 1], fields[sep + 3].split(",")
            root, point = fields[3], fields[4]
            if fstype == "cgroup2" and unified is None:
                unified, unified_root = point, root
            elif fstype == "cgroup":
                for controller in ("memory", "pids", "freezer"):
                    if controller in options:
                        v1[controller] = (point, below_mount(own.get(controller, "/"), root))
    unified_own = below_mount(own.get("", "/"), unified_root) if unified else own.get("", "/")
    if os.path.basename(unified_own) == LEAF_NAME:          # we moved ourselves there: sandboxes go beside it
        unified_own = os.path.dirname(unified_own)
    controllers: frozenset[str] = frozenset()
    if unified:
        try:
            with open(os.path.join(unified, unified_own.lstrip("/"), "cgroup.controllers")) as f:
                controllers = frozenset(f.read().split())
        except OSError:
            pass
    return Hierarchies(unified, unified_own, controllers, v1)


def below_mount(own: str, mount_root: str) -> str:
    """Our group ``own`` (from /proc/self/cgroup: a path from the hierarchy's root, as our cgroup
    namespace sees it) as a path below a mount of the hierarchy whose root is ``mount_root`` (field
    4 of mountinfo). A container runtime without a cgroup namespace (cgroup v1; a pod under
    `podman kube play` or a kubelet) bind-mounts the container's own group at /sys/fs/cgroup/<x>:
    there /proc/self/cgroup says /kubepods/.../<ctr> and that group is the mount's root, not a
    directory below it."""
    if mount_root in ("", "/") or not (own == mount_root or own.startswith(mount_root.rstrip("/") + "/")):
        return own
    return own[len(mount_root.rstrip("/")):] or "/"


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


def where(controller: str) -> str | None:
    """``"v2"``, ``"v1"`` or None: where a limit on ``controller`` would be enforced."""
    h = hierarchies()
    if controller in h.unified_controllers:
        return "v2"
    return "v1" if controller in h.v1 else None


class CgroupSet:
    """The cgroups of one sandbox, across hierarchies."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.dirs: list[str] = []
        self.unified_dir: str | None = None
        self.unified_limits = False       # the v2 group enforces a limit (memory or pids is v2's)
        self.memory_dir: str | None = None
        self.memory_v2 = False
        self.nested = False               # a call's group inside a session's (``child``)

    def child(self, name: str) -> "CgroupSet":
        """A group ``name`` inside each of this set's groups, with no controller of its own: what
        it holds counts against this set's limits (memory and pids are hierarchical), and it can be
        killed alone. A non-root caller's danger-full-access call runs in one: no PID namespace
        bounds its tree, this does. Its ``release`` hands survivors to this set."""
        group = CgroupSet(name)
        group.nested = True
        try:
            for path in self.dirs:
                made = group._mkdir(os.path.join(path, name))
                if path == self.unified_dir:
                    group.unified_dir = made
                if path == self.memory_dir and not self.memory_v2:
                    group.memory_dir = made       # v1 accounts each group (its peak); v2 would need +memory
        except OSError as exc:
            group.remove()
            raise from_oserror(exc, "cgroup setup") from None
        return group

    @classmethod
    def create(cls, name: str, *, memory_bytes: int | None, pids: int | None,
               ceiling: "Ceiling | None" = None, owner: "OwnerShare | None" = None) -> "CgroupSet":
        """The groups of sandbox ``name`` with these limits, below the base groups, whose caps
        ``ceiling`` sets (None: they are left as they are); with ``owner``, in that owner's group
        below each base group, with the owner's caps."""
        h = hierarchies()
        group = cls(name)
        try:
            wanted = {c for c, v in (("memory", memory_bytes), ("pids", pids)) if v is not None}
            v2_controllers = {c for c in wanted if c in h.unified_controllers}
            if h.unified:
                group.unified_dir = group._mkdir_below(lambda: _v2_owner(
                    _v2_base(h, bool(v2_controllers), ceiling), h, bool(v2_controllers), owner), name)
            for controller in sorted(wanted - v2_controllers):
                if controller not in h.v1:
                    raise LimitsUnavailable(f"cgroup {controller}", errno.ENOENT, hint=_missing_hint(h, controller))
                point, own = h.v1[controller]
                path = group._mkdir_below(
                    lambda: _v1_owner(_v1_base(point, own, controller, ceiling), controller, owner),  # noqa: B023
                    name)                                                  # (called right here)
                group.limit_v1(controller, path, memory_bytes if controller == "memory" else pids)
            group.limit_unified(memory_bytes if "memory" in v2_controllers else None,   # made above: v2
                                pids if "pids" in v2_controllers else None)            # controllers mean h.unified
        except OSError as exc:
            group.remove()
            raise from_oserror(exc, "cgroup setup") from None
        except BaseException:
            group.remove()
            raise
        return group

    def limiting_dirs(self) -> list[str]:
        """The groups a confined process joins (a session call, a one-shot sandbox's init): each
        one that enforces a limit. A v2 group with no controller (memory and pids are v1's on this
        host) enforces none: it is there to kill a tree in one write, and a confined tree is in a
        PID namespace of its own (the session's, or the one-shot's), which its end kills. Joining it
        would cost a write to ``cgroup.procs``, whose wait for an RCU grace period (``join``) is the
        largest part of a call that comes after a quiet moment."""
        return [path for path in self.dirs if path != self.unified_dir or self.unified_limits]

    def _mkdir_below(self, base: "Callable[[], str]", name: str) -> str:
        """mkdir ``name`` in the base group ``base()`` prepares; once more if the base vanished
        meanwhile (an idle `sandboxd run` beside us removes an empty base at its exit)."""
        for attempt in (0, 1):
            try:
                return self._mkdir(os.path.join(base(), name))
            except FileNotFoundError:
                _prepared.clear()
                _capped.clear()
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def limit_v1(self, controller: str, path: str, value: int | None) -> None:
        """Write ``value`` as the limit of v1 ``controller`` ("memory" or "pids") into this set's
        group ``path`` in that hierarchy (memory: swap too, where the kernel accounts it). Shared
        by ``create`` and kernel.pod_placement, so a limit means the same wherever a group is made."""
        if controller == "memory":
            self.memory_dir = path
            _write(path, "memory.limit_in_bytes", value)
            if os.path.exists(os.path.join(path, "memory.memsw.limit_in_bytes")):
                _write(path, "memory.memsw.limit_in_bytes", value)
        else:
            _write(path, "pids.max", value)

    def limit_unified(self, memory_bytes: int | None, pids: int | None) -> None:
        """Write the limits the v2 group enforces (None: that controller is not v2's here, or no
        limit) into ``unified_dir``; memory with no swap."""
        self.unified_limits = memory_bytes is not None or pids is not None
        if memory_bytes is not None:
            assert self.unified_dir is not None
            self.memory_dir, self.memory_v2 = self.unified_dir, True
            _write(self.unified_dir, "memory.max", memory_bytes)
            if os.path.exists(os.path.join(self.unified_dir, "memory.swap.max")):
                _write(self.unified_dir, "memory.swap.max", 0)
        if pids is not None:
            assert self.unified_dir is not None
            _write(self.unified_dir, "pids.max", pids)

    def _mkdir(self, path: str) -> str:
        os.mkdir(path, 0o755)
        self.dirs.append(path)
        return path

    def pids(self, dirs: "list[str] | None" = None) -> set[int]:
        """Every process in the set (or in those of its ``dirs``), in the groups nested in them too
        (``child``: v1 has no cgroup.kill)."""
        found: set[int] = set()
        for path in self.dirs if dirs is None else dirs:
            for group in _nested_groups(path):
                try:
                    with open(os.path.join(group, "cgroup.procs")) as f:
                        found.update(int(x) for x in f.read().split())
                except OSError:
                    pass
        return found

    def open_events(self) -> int | None:
        """A descriptor of the v2 group's ``cgroup.events`` (None: no v2 group): poll it for
        POLLPRI, which the kernel raises when ``populated`` changes, then ask ``populated``."""
        if not self.unified_dir:
            return None
        try:
            return os.open(os.path.join(self.unified_dir, "cgroup.events"), os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None

    @staticmethod
    def populated(events_fd: int) -> bool:
        """Does the group (or one nested in it) still hold a process? Read from ``open_events``'s
        descriptor, which also re-arms its POLLPRI."""
        try:
            text = os.pread(events_fd, 4096, 0).decode()
        except OSError:
            return False                                  # the group is gone
        return "populated 1" in text.splitlines()

    def signal_once(self) -> None:
        """SIGKILL everything in the set now, without waiting for it to go: ``cgroup.kill`` of the v2
        group (one write, a fork racing it included), and one pass over ``cgroup.procs`` of the
        others, for what is only in them (a confined process joins only the groups that limit it:
        ``limiting_dirs``; and v1 has no cgroup.kill)."""
        others = self.dirs
        if self.unified_dir and os.path.exists(os.path.join(self.unified_dir, "cgroup.kill")):
            try:
                _write(self.unified_dir, "cgroup.kill", 1)
                others = [path for path in self.dirs if path != self.unified_dir]
            except OSError:
                pass
        for pid in self.pids(others):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        """SIGKILL everything in the set, and wait until the groups are empty (bounded: up to 5 s).
        Never from a loop that serves others (the fork server): ``signal_once`` there."""
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
        """Move survivors out (danger-full-access keeps background jobs): to the parent group in
        v1, to ``<base>/released`` in v2, where the base hands controllers down and so may hold
        no process itself. A nested group (``child``) keeps its survivors: it is inside a session's
        group already, under its limits, and goes with it, or once they end (moving them was a cgroup
        migration each, which costs the kernel an RCU grace period: a caller's many survivors, moved
        one by one, held the fork server's loop)."""
        if self.nested:
            return
        for path in self.dirs:
            parent = os.path.dirname(path)
            if path == self.unified_dir:
                # a leaf in a pod (kernel.pod_cgroups) names its released group as ours, not the pod's
                released = ("sandboxd-" if self.name.startswith("sandboxd-") else "") + RELEASED_NAME
                parent = os.path.join(parent, released)
                os.makedirs(parent, exist_ok=True)
            for pid in _procs(path):
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
        return self.oom_kills() > 0

    def oom_kills(self) -> int:
        """How many processes the kernel's OOM killer killed in this group so far (``oom_kill`` of
        memory.events on v2, memory.oom_control on v1; 0 without a memory group)."""
        if not self.memory_dir:
            return 0
        name = "memory.events" if self.memory_v2 else "memory.oom_control"
        try:
            with open(os.path.join(self.memory_dir, name)) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except (OSError, ValueError):
            pass
        return 0

    def remove(self) -> None:
        """rmdir the groups (waiting briefly for the last process's teardown: up to 1 s a group),
        then the owner groups they were in when nothing else is left there. Never from a loop that
        serves others: ``try_remove`` there."""
        for path in reversed(self.dirs):
            for group in reversed(_nested_groups(path)):    # a session's calls' groups first
                _rmdir_patiently(group)
        self._remove_owner_groups()
        self.dirs.clear()

    def try_remove(self) -> bool:
        """rmdir the groups once each, the groups nested in them first, never waiting: True once
        every one is gone (and then the owner groups they were in, when nothing else is left there).
        A group that still holds a process, or whose last one is still being torn down (EBUSY),
        stays for a later try; so do the groups it is in."""
        left = False
        for path in reversed(self.dirs):
            for group in reversed(_nested_groups(path)):
                try:
                    os.rmdir(group)
                except FileNotFoundError:
                    pass
                except OSError:
                    left = True
                    break                                   # the groups it is in cannot go before it
        if left:
            return False
        self._remove_owner_groups()
        self.dirs.clear()
        return True

    def _remove_owner_groups(self) -> None:
        for parent in dict.fromkeys(os.path.dirname(path) for path in self.dirs):
            if os.path.basename(parent).startswith(OWNER_PREFIX):
                remove_owner_group(parent)


def _nested_groups(path: str) -> list[str]:
    """``path`` and the groups inside it, parents first."""
    return [path, *(os.path.join(top, sub) for top, subs, _ in os.walk(path) for sub in subs)]


def _procs(path: str) -> list[str]:
    try:
        with open(os.path.join(path, "cgroup.procs")) as f:
            return f.read().split()
    except OSError:
        return []


def _rmdir_patiently(path: str) -> None:
    """rmdir, retrying while the last process is torn down (up to 1 s: `sandboxd run` only)."""
    for _ in range(200):
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError as exc:
            if exc.errno != errno.EBUSY:
                return
            time.sleep(0.005)  # the last process is still being torn down


def join(dirs: list[str], pid: int = 0) -> None:
    """Move ``pid`` (0: the caller) into each group of ``dirs`` (a CgroupSet's ``dirs``, which a
    forked child has without the set).

    A write to ``cgroup.procs`` moves a whole process under the kernel's global
    ``cgroup_threadgroup_rwsem``, whose write side first waits for an RCU grace period unless
    another migration ran in the last few ticks: 10 to 25 ms here, more than the rest of a session
    call, paid by a call that comes after a quiet moment (docs/performance.md, "Session calls and
    the cgroup join"). Moving only the calling thread skips that lock
    (cgroup_procs_write_start: a move of ``current`` alone needs no threadgroup stability), and a
    single-threaded process's one thread is all of it. So a single-threaded caller moves itself
    into a v1 group through ``tasks``; v2 has no such move across groups (``cgroup.threads``
    stays within a threaded domain): ``cgroup.procs`` there, and for anyone else."""
    alone = pid == 0 and _single_threaded()
    try:
        for path in dirs:
            if not (alone and _move_thread(path)):
                _write(path, "cgroup.procs", pid)
    except OSError as exc:
        raise from_oserror(exc, "cgroup join") from None


def owner_pids_group(owner: "OwnerShare") -> str | None:
    """``owner``'s group in the v1 pids hierarchy (made, with its cap when ``owner`` carries one),
    for a single-threaded child of this process to move itself into through ``tasks`` (``join``: no
    grace period), so that it counts against the owner's pids share; None where pids is v2's or
    missing. v1 lets a process sit beside child groups; v2 would need a leaf and a ``cgroup.procs``
    write, which costs an RCU grace period (about 5 ms here) in every move."""
    h = hierarchies()
    if "pids" in h.unified_controllers or "pids" not in h.v1:
        return None
    point, own = h.v1["pids"]
    for _ in (0, 1):
        try:
            group = _v1_owner(_v1_base(point, own, "pids"), "pids", owner)
        except OSError:
            return None
        if os.path.isdir(group):
            return group
        _prepared.discard(group)          # swept meanwhile (an empty owner group is): made again
        _capped.pop(os.path.join(group, "pids.max"), None)
    return None


def _single_threaded() -> bool:
    try:
        return len(os.listdir("/proc/self/task")) == 1
    except OSError:
        return False


def _move_thread(group: str) -> bool:
    """Move the calling thread into v1 ``group`` through its ``tasks``; False for a v2 group
    (no such file: opened without O_CREAT, which a cgroup directory refuses with EACCES)."""
    try:
        fd = os.open(os.path.join(group, "tasks"), os.O_WRONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        os.write(fd, b"0")
    finally:
        os.close(fd)
    return True


GROUP_PREFIX = "run-"


def group_name(serial: str) -> str:
    """The name of a new sandbox group of this process: ``run-<pid>-<start>-<pidns>-<serial>``
    (kernel.creators.creator_tag), where ``serial`` makes it unique within the process: what a sweep
    needs to prove its creator dead (``stale_groups``), the same in every hierarchy (a cgroup directory
    can hold no file of ours)."""
    return f"{GROUP_PREFIX}{creator_tag()}-{serial}"


def _creator_of(name: str) -> Creator | None:
    """(pid, start time, PID namespace inode) from a sandbox group's name; None for any other name
    (an older sandboxd's ``run-<pid>-<serial>-<random>`` cannot be judged: it names no namespace)."""
    if not name.startswith(GROUP_PREFIX) or name.count("-") < 4:
        return None
    return parse_creator(name[len(GROUP_PREFIX):])


def stale_groups() -> list[CgroupSet]:
    """The sandbox groups a dead process left behind (a SIGKILLed daemon's fork server, a killed
    `sandboxd run`): the ``run-*`` groups under our base groups and their owner groups whose creator
    is provably dead, one set per sandbox across hierarchies. Nothing is signalled or removed here:
    the caller disposes of them (the fork server hands them to supervisor.waits.Leftovers, which
    never waits). Owner groups a killed daemon left empty are removed on the way."""
    dead = DeadCreators()
    if dead.namespace is None:
        return []
    h = hierarchies()
    unified = h.unified.rstrip("/") + "/" if h.unified else None
    found: dict[str, CgroupSet] = {}
    for base in _sweep_bases(h):
        owner_groups = _owner_groups(base)
        for parent in (base, *owner_groups):
            try:
                names = os.listdir(parent)
            except OSError:
                continue
            for name in names:
                creator = _creator_of(name)
                if creator is None or creator not in dead:
                    continue
                path = os.path.join(parent, name)
                group = found.setdefault(name, CgroupSet(name))
                group.dirs.append(path)                  # with the groups nested in it (pids, try_remove)
                if unified and path.startswith(unified):
                    group.unified_dir = path
        for owner_group in owner_groups:
            remove_owner_group(owner_group)       # only if nothing is left in it: a live sandbox keeps it
    return list(found.values())


def _owner_groups(base: str) -> list[str]:
    try:
        return [os.path.join(base, name) for name in os.listdir(base) if name.startswith(OWNER_PREFIX)]
    except OSError:
        return []


def remove_owner_group(group: str) -> bool:
    """rmdir an owner group (and its empty ``released`` group) if no sandbox group or process is
    left in it, and forget what this process prepared there; True once it is gone. A launch of
    another process that finds it gone meanwhile makes it again (``CgroupSet._mkdir_below``)."""
    for path in (os.path.join(group, RELEASED_NAME), group):
        try:
            os.rmdir(path)
        except FileNotFoundError:
            pass
        except OSError:
            return False                  # still used (EBUSY, ENOTEMPTY): its last sandbox removes it
    _prepared.discard(group)
    for name in [name for name in _capped if name.startswith(group + "/")]:
        del _capped[name]
    return True


def _sweep_bases(h: Hierarchies) -> list[str]:
    """Every base group sandboxes of this host's daemons may sit in: ours in each hierarchy, and,
    for a process that ``_v2_base`` moved into the ``LEAF_NAME`` leaf (cgroup v2 forbids
    processes beside the groups it hands controllers to), the base beside that leaf."""
    bases = []
    if h.unified:
        own = h.unified_own.rstrip("/")
        bases.append(os.path.join(h.unified, own.lstrip("/"), BASE_NAME))
        if os.path.basename(own) == LEAF_NAME:
            bases.append(os.path.join(h.unified, os.path.dirname(own).lstrip("/"), BASE_NAME))
    bases += [os.path.join(point, own.lstrip("/"), BASE_NAME) for point, own in h.v1.values()]
    return list(dict.fromkeys(bases))


_prepared: set[str] = set()      # base groups whose controllers this process has enabled
_created: list[str] = []         # base groups this process made: removed at exit when empty
_capped: dict[str, int] = {}     # base group file (pids.max ...) -> the cap this process wrote there


def _v2_base(h: Hierarchies, controllers: bool, ceiling: "Ceiling | None" = None) -> str:
    """Our v2 base group ``<own>/sandboxd``; with ``controllers``, +cpu +memory +pids (those our
    group has) enabled down the path so the groups below it can be limited, and ``ceiling``'s caps
    written on it for those of them that v2 enforces."""
    assert h.unified
    own = os.path.join(h.unified, h.unified_own.lstrip("/"))
    base = os.path.join(own, BASE_NAME)
    if base not in _prepared:
        if not controllers:
            _make_base(base)
            return base
        enable = [c for c in V2_CONTROLLERS if c in h.unified_controllers]
        _enable_controllers(own, h.unified_own == "/", enable)
        _make_base(base)
        _enable_controllers(base, False, enable)
        _prepared.add(base)
    if ceiling is not None:
        if "memory" in h.unified_controllers:
            _cap(base, "memory.max", ceiling.memory_bytes)
        if "pids" in h.unified_controllers:
            _cap(base, "pids.max", ceiling.pids)
    return base


def _v1_base(point: str, own: str, controller: str, ceiling: "Ceiling | None" = None) -> str:
    """Our base group in the v1 hierarchy of ``controller``, with ``ceiling``'s cap for it."""
    base = os.path.join(point, own.lstrip("/"), BASE_NAME)
    _make_base(base)
    if ceiling is not None:
        if controller == "memory":
            _cap(base, "memory.limit_in_bytes", ceiling.memory_bytes)
        elif controller == "pids":
            _cap(base, "pids.max", ceiling.pids)
    return base


def _owner_dir(base: str, owner: "OwnerShare") -> str:
    """``owner``'s group in ``base``, made unless this process prepared it already (a sandbox or
    sweep of another process may have removed it since: then it is made again)."""
    group = os.path.join(base, OWNER_PREFIX + owner.key)
    if group not in _prepared:
        try:
            os.mkdir(group, 0o755)
        except FileExistsError:
            pass
    return group


def _v2_owner(base: str, h: Hierarchies, controllers: bool, owner: "OwnerShare | None") -> str:
    """The v2 group of ``owner`` in ``base`` (no owner: ``base`` itself); with ``controllers``, those of
    the base handed down once more (it holds no process, so that is allowed), and the owner's caps."""
    if owner is None:
        return base
    group = _owner_dir(base, owner)
    if group not in _prepared:
        if not controllers:
            return group
        _enable_controllers(group, False, [c for c in V2_CONTROLLERS if c in h.unified_controllers])
        _prepared.add(group)
    if "memory" in h.unified_controllers:
        _cap(group, "memory.max", owner.memory_bytes)
    if "pids" in h.unified_controllers:
        _cap(group, "pids.max", owner.pids)
    return group


def _v1_owner(base: str, controller: str, owner: "OwnerShare | None") -> str:
    """The group of ``owner`` in the v1 base group ``base`` of ``controller``, with its cap there."""
    if owner is None:
        return base
    group = _owner_dir(base, owner)
    _prepared.add(group)
    if controller == "memory":
        _cap(group, "memory.limit_in_bytes", owner.memory_bytes)
    elif controller == "pids":
        _cap(group, "pids.max", owner.pids)
    return group


def _cap(base: str, name: str, value: int | None) -> None:
    """Write the ceiling ``value`` to ``base``/``name``, once per value in this process (a launch
    costs one dict lookup). The last process to prepare a base group sets its caps: a daemon and a
    `sandboxd run` normally each have their own (a systemd unit's, a login session's)."""
    if value is None or _capped.get(os.path.join(base, name)) == value:
        return
    _write(base, name, value)
    _capped[os.path.join(base, name)] = value


def ceiling_in_force() -> dict[str, tuple[str, str]]:
    """What caps the base groups carry now: controller -> (the file, its value), for memory and pids
    where a base group of this process's cgroup exists (for `sandboxd doctor`)."""
    h = hierarchies()
    found: dict[str, tuple[str, str]] = {}
    for controller, v2_name, v1_name in (("memory", "memory.max", "memory.limit_in_bytes"),
                                         ("pids", "pids.max", "pids.max")):
        if controller in h.unified_controllers and h.unified:
            path = os.path.join(h.unified, h.unified_own.lstrip("/"), BASE_NAME, v2_name)
        elif controller in h.v1:
            point, own = h.v1[controller]
            path = os.path.join(point, own.lstrip("/"), BASE_NAME, v1_name)
        else:
            continue
        try:
            with open(path) as f:
                found[controller] = (path, f.read().strip())
        except OSError:
            pass
    return found


def _make_base(base: str) -> None:
    try:
        os.mkdir(base, 0o755)
    except FileExistsError:
        return
    if not _created:
        import atexit
        atexit.register(remove_created_bases)
    _created.append(base)


def remove_created_bases() -> None:
    """rmdir the base groups this process made, when empty (at exit: `sandboxd run` leaves nothing)."""
    for base in reversed(_created):
        for owner_group in _owner_groups(base):
            remove_owner_group(owner_group)
        for leftover in (os.path.join(base, RELEASED_NAME), base):
            try:
                os.rmdir(leftover)
            except OSError:
                pass                                   # still in use: the next owner's sweep takes it
    _created.clear()
    _prepared.clear()
    _capped.clear()


def _enable_controllers(group: str, namespace_root: bool, controllers: list[str]) -> None:
    """Write ``+c`` for each controller not yet in ``group``'s subtree_control. When the group
    holds processes (EBUSY: the no-internal-process rule), move them to ``<group>/sandboxd-supervisor``
    first, if the group is ours to rearrange."""
    with open(os.path.join(group, "cgroup.subtree_control")) as f:
        missing = [c for c in controllers if c not in f.read().split()]
    if not missing:
        return
    wanted = " ".join("+" + c for c in missing)
    for _ in range(20):
        try:
            _write(group, "cgroup.subtree_control", wanted)
            return
        except OSError as exc:
            if exc.errno != errno.EBUSY:
                raise
        if not (namespace_root or _delegated(group)):
            raise LimitsUnavailable(
                "cgroup setup", errno.EBUSY, path=group,
                hint="this cgroup holds processes and is not delegated to sandboxd, so its controllers cannot be "
                     "handed down to sandboxes: " + DELEGATE_HINT)
        leaf = os.path.join(group, LEAF_NAME)
        os.makedirs(leaf, exist_ok=True)
        with open(os.path.join(group, "cgroup.procs")) as f:
            pids = f.read().split()
        for pid in pids:                               # a process forked meanwhile: the next round
            try:
                _write(leaf, "cgroup.procs", pid)
            except OSError:
                pass                                   # gone, or a kernel thread
    raise LimitsUnavailable("cgroup setup", errno.EBUSY, path=group,
                            hint="processes keep appearing in this cgroup; " + DELEGATE_HINT)


def _delegated(group: str) -> bool:
    """systemd marks a group it delegated (Delegate=yes, v251+) with trusted.delegate (system
    units) or user.delegate (user units)."""
    for name in ("trusted.delegate", "user.delegate"):
        try:
            if os.getxattr(group, name) == b"1":
                return True
        except OSError:
            pass
    return False


def _missing_hint(h: Hierarchies, controller: str) -> str:
    if h.unified and not h.v1:
        return (f"the cgroup {h.unified_own} cannot hand down the {controller} controller (its parent has not "
                f"enabled it for it): {DELEGATE_HINT}, or drop the limit")
    return (f"no cgroup v1 or v2 hierarchy offers the {controller} controller: enable it (cgroup v2: "
            f"Delegate=yes, or +{controller} in the cgroup.subtree_control above sandboxd) or drop the limit")


def _write(directory: str, name: str, value: object) -> None:
    with open(os.path.join(directory, name), "w") as f:
        f.write(str(value))


def _read_int(directory: str, name: str) -> int | None:
    try:
        with open(os.path.join(directory, name)) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
