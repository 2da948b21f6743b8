"""A caller's Kubernetes pod as cgroups: where its sessions' sandboxes go so the pod pays for them.

A kubelet gives each pod a group and each of its containers a group inside it, in every hierarchy
at the same path: ``/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid>.slice/
cri-containerd-<id>.scope`` (the systemd driver), ``/kubepods/burstable/pod<uid>/<id>`` (cgroupfs).
The pod's limits are on the pod's group; a sandbox placed as a leaf there, beside the containers
(``sandboxd-<name>``: on cgroup v2 a group that hands controllers down may hold no process itself,
so beside them, not in the pod's group), is charged to the pod and held to its limits, and the
scheduler's view of the pod covers it.

- ``caller_groups(pid)``: a process's groups from /proc/PID/cgroup ("unified" for v2, and each v1
  controller's), as paths below each hierarchy's mount. Track pods reads the same at accept
  (principal.cgroup_path); until then the daemon reads it at CreateSession from the caller's
  SO_PEERCRED pid.
- ``pod_of(groups)``: the pod's group in each hierarchy (the parent of the container's), or None when
  the caller is not in a pod: its group's parent must be named as a kubelet names a pod's group, below a
  ``kubepods`` group. A caller outside a pod (a host user, a systemd unit) is never placed by its
  cgroup: its sessions stay below the daemon's own, as everywhere else.
- ``pod_alive(pod)``: does any of the pod's own groups (its containers', not ours) still hold a
  process? A pod whose containers are all gone (or whose group vanished) is provably dead the way
  kernel.creators judges a sandbox group's creator: what it made is taken, nothing else.
"""

from __future__ import annotations

import errno
import json
import os
import re

from sandboxd.errors import InvalidPolicy, LimitsUnavailable
from sandboxd.kernel._libc import from_oserror
from sandboxd.kernel.cgroups import GROUP_PREFIX, CgroupSet, Hierarchies, hierarchies
from sandboxd.kernel.creators import DeadCreators, parse_creator

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterable

PLACED_PREFIX = "sandboxd-"          # our leaf beside a pod's containers: never judged as one of them
UNIFIED = "unified"                  # the key of the v2 hierarchy (the v1 ones are keyed by controller)
CONTROLLERS = ("memory", "pids")     # the v1 hierarchies a sandbox's limits may be in
_POD_NAME = re.compile(r"^(?:kubepods(?:-[a-z]+)?-pod[0-9a-f_]+\.slice|pod[0-9a-f-]+)$")


def caller_groups(pid: int) -> dict[str, str]:
    """The groups of process ``pid``: "unified" -> its v2 path, "memory"/"pids" -> its v1 paths (as
    /proc/PID/cgroup says them, below each hierarchy's root); {} when it is gone."""
    groups: dict[str, str] = {}
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            text = f.read()
    except OSError:
        return groups
    for line in text.splitlines():
        _, names, path = line.split(":", 2)
        if not names:
            groups[UNIFIED] = path
        for name in names.split(","):
            if name in CONTROLLERS:
                groups[name] = path
    return groups


def pod_of(groups: dict[str, str]) -> dict[str, str] | None:
    """The pod's group in each hierarchy of ``groups`` (a caller's): each container group's parent,
    when every one of them is named as a kubelet names a pod's group below a ``kubepods`` group;
    None otherwise (not in a pod, or in a pod's group itself: no container group)."""
    pods = {key: os.path.dirname(path.rstrip("/")) for key, path in groups.items() if path not in ("", "/")}
    if not pods or not all(is_pod_group(path) for path in pods.values()):
        return None
    return pods


def is_pod_group(path: str) -> bool:
    """Named as a kubelet names a pod's group, with a ``kubepods`` group above it."""
    parts = path.strip("/").split("/")
    return (len(parts) >= 2 and _POD_NAME.match(parts[-1]) is not None
            and any(part == "kubepods" or part.startswith("kubepods.") or part.startswith("kubepods-")
                    for part in parts[:-1]))


def check_placement(placement: dict[str, str]) -> None:
    """A placement as the fork server takes it: known hierarchies, normalized absolute paths of pod
    groups (no ``..``, no NUL); InvalidPolicy naming what is wrong."""
    for key, path in placement.items():
        if key not in (UNIFIED, *CONTROLLERS):
            raise InvalidPolicy(f"placement names an unknown hierarchy {key!r}")
        if "\0" in path or not path.startswith("/") or os.path.normpath(path) != path or not is_pod_group(path):
            raise InvalidPolicy(f"placement {key}={path!r} is not a pod's cgroup")


def directories(placement: dict[str, str], h: Hierarchies | None = None) -> dict[str, str]:
    """The pod's groups as directories: hierarchy key -> its directory under that hierarchy's mount
    (those of this host's hierarchies the placement names)."""
    h = h or hierarchies()
    found: dict[str, str] = {}
    if h.unified and UNIFIED in placement:
        found[UNIFIED] = os.path.join(h.unified, placement[UNIFIED].lstrip("/"))
    for controller in CONTROLLERS:
        if controller in h.v1 and controller in placement:
            found[controller] = os.path.join(h.v1[controller][0], placement[controller].lstrip("/"))
    return found


def pod_alive(placement: dict[str, str], h: Hierarchies | None = None) -> bool:
    """Does a group of the pod's own (a container's; not a ``sandboxd-`` leaf of ours) still hold a
    process? Judged in one hierarchy: v2's ``cgroup.events`` when there is one, else the v1 groups'
    ``cgroup.procs``. False when the pod's group is gone."""
    dirs = directories(placement, h)
    pod = dirs.get(UNIFIED) or next(iter(dirs.values()), None)
    if pod is None:
        return False
    try:
        children = [name for name in os.listdir(pod)
                    if not name.startswith(PLACED_PREFIX) and os.path.isdir(os.path.join(pod, name))]
    except OSError:
        return False                                      # the pod's group is gone
    v2 = UNIFIED in dirs and os.path.exists(os.path.join(pod, "cgroup.events"))
    return any(_populated_v2(os.path.join(pod, name)) if v2 else _populated_v1(os.path.join(pod, name))
               for name in children)


def _populated_v2(group: str) -> bool:
    try:
        with open(os.path.join(group, "cgroup.events")) as f:
            return "populated 1" in f.read().splitlines()
    except OSError:
        return False


def _populated_v1(group: str) -> bool:
    for top, _, _ in os.walk(group):
        try:
            with open(os.path.join(top, "cgroup.procs")) as f:
                if f.read().strip():
                    return True
        except OSError:
            pass
    return False


def encode(placement: dict[str, str]) -> str:
    """A placement as a session keeps it (its label: it outlives a daemon restart)."""
    return json.dumps(placement, sort_keys=True, separators=(",", ":"))


def decode(text: str) -> dict[str, str]:
    """A placement from ``encode``; InvalidPolicy when it is not one."""
    try:
        value = json.loads(text)
    except ValueError:
        raise InvalidPolicy("a placement is JSON") from None
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise InvalidPolicy("a placement is an object of strings")
    check_placement(value)
    return value


def create_placed(name: str, placement: dict[str, str], *, memory_bytes: int | None,
                  pids: int | None) -> CgroupSet:
    """The groups of sandbox ``name`` as leaves ``sandboxd-<name>`` of the pod's groups, with these
    limits: in v2 when the pod's group hands the controller down (its cgroup.subtree_control; a
    kubelet enables memory, pids and cpu there), else in the controller's v1 hierarchy; a v2 leaf
    always when v2 is mounted (``cgroup.kill``). Nothing above the leaves is written: the pod's groups
    are the kubelet's. LimitsUnavailable when a limit has nowhere to go or the pod's group is gone."""
    check_placement(placement)
    h = hierarchies()
    dirs = directories(placement, h)
    remove_dead_leaves(dirs.values())
    group = CgroupSet(PLACED_PREFIX + name)
    wanted = {c: v for c, v in (("memory", memory_bytes), ("pids", pids)) if v is not None}
    try:
        handed = set()
        if UNIFIED in dirs:
            handed = _subtree_control(dirs[UNIFIED])
            group.unified_dir = group._mkdir(os.path.join(dirs[UNIFIED], group.name))
        for controller, value in wanted.items():
            if controller in handed:
                continue
            if controller not in dirs:
                raise LimitsUnavailable(f"cgroup {controller}", errno.ENOENT, hint=(
                    f"the pod's cgroup {placement.get(UNIFIED, '?')} does not hand the {controller} controller "
                    f"down and no v1 hierarchy has it: drop the limit, or run the pod where the kubelet enables it"))
            group.limit_v1(controller, group._mkdir(os.path.join(dirs[controller], group.name)), value)
        group.limit_unified(wanted.get("memory") if "memory" in handed else None,
                            wanted.get("pids") if "pids" in handed else None)
    except FileNotFoundError as exc:
        group.remove()
        raise LimitsUnavailable("cgroup placement", errno.ENOENT, path=str(exc.filename or ""),
                                hint="the calling pod's cgroup is gone: the pod has ended") from None
    except OSError as exc:
        group.remove()
        raise from_oserror(exc, "cgroup placement") from None
    except BaseException:
        group.remove()
        raise
    return group


def remove_dead_leaves(pods: "Iterable[str]") -> int:
    """rmdir the empty leaves of the pods' groups whose creator is provably dead (kernel.creators): a
    SIGKILLed fork server's, whose sandboxes died with it. Once each, never waiting; a leaf that still
    holds a process is left (an empty leaf does not hold up the kubelet: runc and systemd remove a
    pod group's children first; a populated one does, and PodSessions closes its session). How many."""
    dead = DeadCreators()
    removed = 0
    for pod in pods:
        try:
            names = [name for name in os.listdir(pod) if name.startswith(PLACED_PREFIX + GROUP_PREFIX)]
        except OSError:
            continue
        for name in names:
            creator = parse_creator(name[len(PLACED_PREFIX + GROUP_PREFIX):])
            if creator is None or creator not in dead:
                continue
            try:
                os.rmdir(os.path.join(pod, name))
                removed += 1
            except OSError:
                pass                                       # still holds something: left
    return removed


def _subtree_control(directory: str) -> set[str]:
    with open(os.path.join(directory, "cgroup.subtree_control")) as f:
        return set(f.read().split())

