"""The limits of the cgroups above the sandboxes: what a session can really get, whatever it asks.

Every sandbox group sits below a group that is not ours to set: the daemon's own (a systemd unit, a
container, a pod) and that group's ancestors, up to the hierarchy's root as this process sees it.
memory and pids are hierarchical, so the tightest cap on that path bounds every sandbox below it: a
session given 2 GiB under a parent capped at 700 MiB is OOM-killed at 700 MiB by a cap it never
mentioned. ``limits_above`` reads that path (the group itself included) and names the tightest cap
per resource, so the daemon can refuse a session that asks for more, and cap a default to fit.

Read, not written: nothing here touches a group. What a process cannot see (the groups above the root
of its cgroup namespace, or above a v1 hierarchy bind-mounted at a container's own group) is not read:
the group at that root is, and a container runtime puts the container's own limit there.

- cgroup v2: ``memory.max`` (the OOM killer acts there) and ``memory.high`` (reclaim throttles a group
  above it, so a session never gets past it usefully either), ``pids.max``; in each group that has
  the file (a group whose parent has not enabled the controller has none, and is charged to the
  nearest one that has).
- cgroup v1: ``memory.limit_in_bytes`` in the memory hierarchy (hierarchical since Linux 5.11 made
  use_hierarchy always 1), ``pids.max`` in the pids hierarchy. v1 says "unlimited" with a huge
  page-rounded number, not a word.
"""

from __future__ import annotations

import os

from sandboxd._record import Record
from sandboxd.kernel.cgroups import Hierarchies, hierarchies

UNLIMITED_V1 = 1 << 62            # v1 writes "no limit" as LONG_MAX rounded down to a page: anything this big
V2_FILES = {"memory": ("memory.max", "memory.high"), "pids": ("pids.max",)}
V1_FILES = {"memory": "memory.limit_in_bytes", "pids": "pids.max"}


class Bound(Record):
    """The tightest cap on one resource above the sandboxes, and where it is."""

    value: int
    group: str          # the group's path in its hierarchy ("/kubepods.slice/...", "/" for the root)
    file: str           # the file holding it: "memory.max", "memory.limit_in_bytes", ...
    hierarchy: str      # "v2", or "v1 memory" / "v1 pids"

    def where(self) -> str:
        return f"{self.group} ({self.hierarchy} {self.file})"


class AncestorLimits(Record):
    """The tightest memory and pids caps above the sandboxes (None: nothing caps it)."""

    memory: Bound | None = None
    pids: Bound | None = None

    def get(self, resource: str) -> Bound | None:
        return self.memory if resource == "memory" else self.pids if resource == "pids" else None


def limits_above(h: Hierarchies | None = None, unified_group: str | None = None,
                 v1_groups: dict[str, str] | None = None) -> AncestorLimits:
    """The tightest caps on the path from a group up to each hierarchy's root: this process's own
    group by default (``h``: its hierarchies), else ``unified_group`` (a v2 path below the mount) and
    ``v1_groups`` (controller -> its v1 path), a pod's group for a session placed under it."""
    h = h or hierarchies()
    found: dict[str, Bound] = {}
    if h.unified:
        start = h.unified_own if unified_group is None else unified_group
        for group in _path_up(start):
            directory = os.path.join(h.unified, group.lstrip("/"))
            for resource, names in V2_FILES.items():
                for name in names:
                    _tighter(found, resource, _read_limit(directory, name), group, name, "v2")
    for resource, name in V1_FILES.items():
        if resource not in h.v1:
            continue
        point, own = h.v1[resource]
        v1_start = own if v1_groups is None else v1_groups.get(resource)
        if v1_start is None:
            continue
        for group in _path_up(v1_start):
            _tighter(found, resource, _read_limit(os.path.join(point, group.lstrip("/")), name), group, name,
                     f"v1 {resource}")
    return AncestorLimits(memory=found.get("memory"), pids=found.get("pids"))


def _path_up(group: str) -> list[str]:
    """``group`` and each group above it, to ``/``: "/a/b" -> ["/a/b", "/a", "/"]."""
    path = "/" + group.strip("/")
    groups = [path]
    while path != "/":
        path = os.path.dirname(path)
        groups.append(path)
    return groups


def _tighter(found: dict[str, Bound], resource: str, value: int | None, group: str, name: str,
             hierarchy: str) -> None:
    """Keep the lower cap; on a tie the one nearer the sandboxes (found first)."""
    if value is not None and (resource not in found or value < found[resource].value):
        found[resource] = Bound(value, group, name, hierarchy)


def _read_limit(directory: str, name: str) -> int | None:
    """A limit file's value; None for "max", v1's "unlimited", or no such file (the root has none on
    v2; a group whose parent does not hand the controller down has none)."""
    try:
        with open(os.path.join(directory, name)) as f:
            text = f.read().strip()
    except OSError:
        return None
    if not text.isdigit():
        return None                                       # "max"
    value = int(text)
    return None if value >= UNLIMITED_V1 else value
