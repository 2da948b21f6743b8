"""Which Kubernetes pod a process belongs to, from its cgroup (/proc/PID/cgroup): the pod's UID.

kubelet puts every container of a pod under one cgroup named for the pod's UID, below the node's
``kubepods`` cgroup, in one of two spellings (its cgroup driver), on cgroup v1 (once per
hierarchy) and v2 (the ``0::`` line):

- cgroupfs: ``/kubepods[/burstable|/besteffort]/pod<UID>/<container>``
- systemd: ``/kubepods.slice[/kubepods-<qos>.slice]/kubepods[-<qos>]-pod<UID with _ for ->.slice/<container>.scope``

That cgroup is the authority because a process cannot leave it: moving to another cgroup needs
write access to the destination's ``cgroup.procs`` (and, on v2, to the common ancestor's), which
a pod that is not privileged does not have (its cgroup file system is read-only, or on v2 its
cgroup namespace shows it only its own subtree). What a pod CAN do, if its runtime delegates it
a writable subtree, is create cgroups below its own, with any name: so the pod is read only at
its fixed depth under the kubepods root, never from a segment found further down; a name with
a line break (which /proc/PID/cgroup prints raw, as a forged extra line) is caught because every
hierarchy must appear exactly once, as in the daemon's own /proc/self/cgroup.

Where kubepods sits is the node's (kubelet --cgroup-root; kind nests it under /kubelet): the
daemon is told its parent (``root``, default "/"), and a kubepods found anywhere else (a local
user's delegated systemd subtree can hold a cgroup named kubepods too) is no pod.
"""

from __future__ import annotations

import os
import re

from sandboxd._record import Record
from sandboxd.kernel.namespaces import CLONE_NEWCGROUP, setns
from sandboxd.printable import printable

__all__ = ["POD_UID", "CgroupRefused", "PodCgroup", "hierarchy_ids", "join_node_cgroup_namespace", "pod_of",
           "read_cgroups"]

# /proc/PID/cgroup of any process is a handful of short lines; a delegated subtree's names can
# make it longer, never legitimately this long.
_MAX_BYTES = 64 * 1024
# A pod's UID: a UUID (API pods), or 32 hex digits (a static pod's: a hash of its manifest).
POD_UID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}|[0-9a-f]{32}")
_QOS = ("burstable", "besteffort")
# The inode of the kernel's initial cgroup namespace (PROC_CGROUP_INIT_INO): a thread in it reads
# every path from the root already, with no need to look at PID 1 (whose /proc entry may be closed).
_INITIAL_CGROUP_NAMESPACE = 0xEFFFFFFB


class CgroupRefused(Exception):
    """The caller's cgroup is below kubepods (or cannot be read as a path at all) but names no pod
    this parser can vouch for: the reason, said to the caller."""


class PodCgroup(Record):
    """A process's pod: its UID and the cgroup paths it was read from."""

    uid: str                 # the pod's UID, as the API server spells it (lower-case, with dashes)
    pod_path: str            # the pod's cgroup, e.g. /kubepods.slice/kubepods-pod<uid_>.slice
    cgroup_path: str         # the process's own cgroup (the v2 line's, else the first v1 line's naming the pod)


def read_cgroups(pid: "int | str") -> str:
    """/proc/PID/cgroup as text (bytes that are not UTF-8 kept as surrogates); OSError when the
    process is gone."""
    with open(f"/proc/{pid}/cgroup", "rb") as f:
        raw = f.read(_MAX_BYTES + 1)
    if len(raw) > _MAX_BYTES:
        raise CgroupRefused(f"the calling process's cgroup list is longer than {_MAX_BYTES} bytes")
    return raw.decode(errors="surrogateescape")


def join_node_cgroup_namespace(pid: int = 1) -> bool:
    """Join PID 1's cgroup namespace (the node's, when the daemon shares the node's PID namespace;
    ``pid``: another process's) on the calling thread, if it is in another: the kernel writes every
    /proc/PID/cgroup path relative to its reader's cgroup namespace, so a daemon in a container's
    own one (containerd gives every container one on cgroup v2) would read other pods' paths as
    "/../..": this thread then reads the node's. True when it joined; OSError when it could not."""
    target = f"/proc/{pid}/ns/cgroup"
    own = os.stat("/proc/thread-self/ns/cgroup").st_ino
    if (own == _INITIAL_CGROUP_NAMESPACE and pid == 1) or own == os.stat(target).st_ino:
        return False
    fd = os.open(target, os.O_RDONLY | os.O_CLOEXEC)
    try:
        setns(fd, CLONE_NEWCGROUP)
    finally:
        os.close(fd)
    return True


def hierarchy_ids(text: str) -> frozenset[str]:
    """The hierarchy IDs of a /proc/PID/cgroup text (the daemon's own: what every caller's must match)."""
    return frozenset(line.split(":", 1)[0] for line in text.splitlines() if line)


def pod_of(text: str, expected_ids: frozenset[str], root: str = "/") -> PodCgroup | None:
    """The pod of a process whose /proc/PID/cgroup is ``text``; None when it is in no pod (below
    no kubepods under ``root``); CgroupRefused, saying why, when it is below kubepods but its
    pod cannot be vouched for, or the text is not one line per hierarchy of ``expected_ids``."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    seen: set[str] = set()
    found: list[tuple[str, str, str, str]] = []  # (hierarchy, uid, pod path, cgroup path) per line naming a pod
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3 or parts[0] in seen or parts[0] not in expected_ids:
            raise CgroupRefused("the calling process's cgroup list is not one line per cgroup hierarchy "
                                "(a cgroup name holding a line break?)")
        seen.add(parts[0])
        pod = _pod_in(parts[2], root)
        if pod is not None:
            found.append((parts[0], *pod, parts[2]))
    if seen != expected_ids:
        raise CgroupRefused("the calling process's cgroup list is not one line per cgroup hierarchy")
    if not found:
        return None
    uids = {uid for _, uid, _, _ in found}
    if len(uids) > 1:
        raise CgroupRefused(f"the calling process is in the cgroups of {len(uids)} different pods "
                            "(one per hierarchy): it cannot be told which pod it is")
    # v2's line (hierarchy 0) when it names the pod: the one cgroup placement can use.
    _, uid, pod_path, cgroup_path = min(found, key=lambda entry: entry[0] != "0")
    return PodCgroup(uid=uid, pod_path=pod_path, cgroup_path=cgroup_path)


def _pod_in(path: str, root: str) -> tuple[str, str] | None:
    """(pod UID, pod cgroup path) when ``path`` is below ``root``'s kubepods; None when it is
    not below kubepods at all; CgroupRefused when it is, but not in a pod at kubelet's depth."""
    if not path.startswith("/"):
        raise CgroupRefused("the calling process's cgroup path is not absolute")
    segments = path.split("/")[1:]
    if ".." in segments:
        # Outside the daemon's cgroup namespace, the kernel prints the path relative to ours.
        raise CgroupRefused("the calling process's cgroup is outside the daemon's cgroup namespace: run the daemon "
                            "in the node's cgroup namespace (it reads the caller's pod from its cgroup)")
    base = [s for s in root.split("/") if s]
    if segments[:len(base)] != base:
        return None
    below = segments[len(base):]
    if not below or below[0] not in ("kubepods", "kubepods.slice"):
        return None
    found = _cgroupfs_pod(below) if below[0] == "kubepods" else _systemd_pod(below)
    if found is None:
        raise CgroupRefused(f"the calling process is below kubepods but in no pod cgroup kubelet makes "
                            f"({_shown(path)})")
    uid, depth = found
    return uid, "/" + "/".join([*base, *below[:depth]])


def _cgroupfs_pod(segments: list[str]) -> tuple[str, int] | None:
    """``kubepods[/<qos>]/pod<UID>``: the UID and the pod cgroup's depth."""
    at = 2 if len(segments) > 1 and segments[1] in _QOS else 1
    if len(segments) <= at or not segments[at].startswith("pod"):
        return None
    uid = segments[at][len("pod"):]
    return (uid, at + 1) if POD_UID.fullmatch(uid) else None


def _systemd_pod(segments: list[str]) -> tuple[str, int] | None:
    """``kubepods.slice[/kubepods-<qos>.slice]/kubepods[-<qos>]-pod<UID_>.slice``: systemd spells
    the UID's dashes as underscores (a dash separates a slice's ancestors)."""
    prefix, at = "kubepods-pod", 1
    if len(segments) > 1 and segments[1] in {f"kubepods-{q}.slice" for q in _QOS}:
        prefix, at = f"{segments[1][:-len('.slice')]}-pod", 2
    if len(segments) <= at:
        return None
    name = segments[at]
    if not (name.startswith(prefix) and name.endswith(".slice")):
        return None
    escaped = name[len(prefix):-len(".slice")]
    if "-" in escaped:                        # systemd would read it as a deeper slice: kubelet never names one so
        return None
    uid = escaped.replace("_", "-")
    return (uid, at + 1) if POD_UID.fullmatch(uid) else None


def _shown(path: str) -> str:
    return printable(path[:300])
