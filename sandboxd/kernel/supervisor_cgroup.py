"""The surviving supervisor's own cgroup, outside the daemon's (``supervisor.cgroup``).

A container runtime stopping a container kills every process of the container's cgroup (and
``systemctl`` with ``KillMode=control-group`` every process of the unit's): a supervisor that stays
in the daemon's group dies with the old daemon, and every sandbox with it. Which hierarchy the
runtime reads the container's processes from varies with the runtime and the node (podman has
runc ``kill --all`` a container sharing the host's PID namespace, a DaemonSet pod with hostPID; on
a v1 node runc also freezes the container's ``freezer`` group). So, given a group (a path from
each hierarchy's root, e.g. ``/sandboxd.supervisor``), the supervisor moves itself there in EVERY
hierarchy it belongs to (v2 and each v1 one), at start, before it makes any sandbox, so that the
sandboxes' groups go below it too (kernel.cgroups puts them below the creating process's own
group) and outlive the container.

A pod needs the node's cgroup hierarchy for it: hostPID (PID 1 is the node's: its cgroup namespace
is joined when ours is another, as the front door does) and a privileged container. A container
runtime without a cgroup namespace shows the container only its own group at /sys/fs/cgroup/* (a
bind mount of that group: mountinfo's root field is not "/"); then the supervisor enters a mount
namespace of its own (a slave of the container's: everything else is the same) and mounts each
hierarchy from its root at /sys/fs/cgroup there, so that it and kernel.cgroups can name groups
outside the container. On a host whose mounts show the roots already nothing is mounted.
"""

from __future__ import annotations

import os

from sandboxd.errors import InvalidPolicy, SetupError

CGROUP_MOUNTS = "/sys/fs/cgroup"


def check_path(path: str) -> str:
    """``path`` if it names a group below the hierarchies' roots (absolute, normal, not the root itself)."""
    if not path.startswith("/") or path == "/" or os.path.normpath(path) != path or "\0" in path:
        raise InvalidPolicy(f"supervisor.cgroup must be an absolute normal path below the cgroup root, not {path!r}")
    return path


def own_hierarchies() -> list[str]:
    """This process's hierarchies, from /proc/self/cgroup, by what names them at a mount: a v1
    one's controllers or name= ("memory", "cpu,cpuacct", "name=systemd"), "" for v2. A v1 line
    with neither (nothing to mount it by) is left out."""
    found = []
    with open("/proc/self/cgroup") as f:
        for line in f:
            hierarchy, names, _ = line.rstrip("\n").split(":", 2)
            if names or hierarchy == "0":
                found.append(names)
    return found


def root_mount(names: str) -> str | None:
    """A mount point that shows the hierarchy of ``names`` (see own_hierarchies) from its root, if
    this mount namespace has one in view (not covered by a later mount at it or above it)."""
    with open("/proc/self/mountinfo") as info:
        lines = [line.split() for line in info]
    points = [fields[4] for fields in lines]
    for index, fields in enumerate(lines):
        sep = fields.index("-")
        fstype, root, point = fields[sep + 1], fields[3], fields[4]
        if root != "/" or any(later == point or point.startswith(later.rstrip("/") + "/")
                              for later in points[index + 1:]):
            continue
        if fstype == "cgroup2" and not names:
            return point
        if fstype == "cgroup" and names and set(names.split(",")) <= set(fields[sep + 3].split(",")):
            return point
    return None


def mount_roots(wanted: list[str]) -> dict[str, str]:
    """Enter a mount namespace of our own (single-threaded callers only) with each hierarchy of
    ``wanted`` (see own_hierarchies) mounted from its root below /sys/fs/cgroup; their mount points."""
    from sandboxd.kernel import mounts, namespaces

    namespaces.unshare(namespaces.CLONE_NEWNS)
    mounts.mount(None, "/", None, mounts.MS_REC | mounts.MS_SLAVE, step="mount --make-rslave /")
    flags = mounts.MS_NOSUID | mounts.MS_NODEV | mounts.MS_NOEXEC
    if not any(wanted):                                    # cgroup v2 only: its usual place
        mounts.mount("cgroup2", CGROUP_MOUNTS, "cgroup2", flags, step="mount cgroup2")
        return {"": CGROUP_MOUNTS}
    mounts.mount("tmpfs", CGROUP_MOUNTS, "tmpfs", flags, "mode=755,size=64k", step="mount tmpfs")
    points: dict[str, str] = {}
    for names in wanted:
        point = os.path.join(CGROUP_MOUNTS, names.replace("name=", "").replace(",", "+") if names else "unified")
        os.mkdir(point, 0o755)
        if names:                                          # a named hierarchy alone: "none,name=..."
            options = names if any(not n.startswith("name=") for n in names.split(",")) else "none," + names
            mounts.mount("cgroup", point, "cgroup", flags, options, step=f"mount cgroup {names}")
        else:
            mounts.mount("cgroup2", point, "cgroup2", flags, step="mount cgroup2")
        points[names] = point
    return points


def _inherit_cpuset(root: str, path: str) -> None:
    """A v1 cpuset group takes no process while its cpus or mems are empty, and takes only a subset
    of its parent's (EACCES otherwise): each level of ``path`` below ``root`` gets its parent's."""
    parent = root
    for part in path.strip("/").split("/"):
        group = os.path.join(parent, part)
        for name in ("cpuset.cpus", "cpuset.mems"):
            with open(os.path.join(group, name)) as mine:
                if mine.read().strip():
                    continue
            with open(os.path.join(parent, name)) as theirs, open(os.path.join(group, name), "w") as child:
                child.write(theirs.read().strip())
        parent = group


def move_self(path: str) -> list[str]:
    """Move this process (single-threaded: the supervisor before its loop) into the group ``path``
    of every hierarchy it belongs to, made where missing; those groups' directories. Before
    anything here reads our own group."""
    from sandboxd.kernel import cgroups, pod_cgroups

    check_path(path)
    try:
        pod_cgroups.join_node_cgroup_namespace()           # hostPID: the node's; else a no-op
    except OSError as exc:
        raise SetupError("supervisor cgroup", detail=f"cannot join the node's cgroup namespace "
                                                     f"(/proc/1/ns/cgroup): {exc}") from exc
    own = own_hierarchies()
    if not own:
        raise SetupError("supervisor cgroup", detail="this process is in no cgroup hierarchy")
    found = {names: root_mount(names) for names in own}
    points = ({names: point for names, point in found.items() if point is not None}
              if all(found.values()) else mount_roots(own))
    groups = []
    for names in own:
        root = points[names]
        group = os.path.join(root, path.lstrip("/"))
        os.makedirs(group, mode=0o755, exist_ok=True)
        if "cpuset" in names.split(","):
            _inherit_cpuset(root, path)
        with open(os.path.join(group, "cgroup.procs"), "w") as procs:
            procs.write("0")                               # "0": the writing process
        groups.append(group)
    cgroups._hierarchies = None                            # noqa: SLF001 - our own group changed: read again
    return groups
