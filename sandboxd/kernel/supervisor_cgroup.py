"""The surviving supervisor's own cgroup v2 group, outside the daemon's (``supervisor.cgroup``).

A container runtime stopping a container kills every process of the container's cgroup (and
``systemctl`` with ``KillMode=control-group`` every process of the unit's): a supervisor that stays
in the daemon's group dies with the old daemon, and every sandbox with it. Given a group (a path
from the cgroup2 mount's root, e.g. ``/sandboxd.supervisor``; a pod needs the node's cgroup
hierarchy for it: hostPID and the host's /sys/fs/cgroup), the supervisor moves itself there at
start, before it makes any sandbox, so that the sandboxes' v2 groups go below it too
(kernel.cgroups puts them below the creating process's own group) and outlive the container.
"""

from __future__ import annotations

import os

from sandboxd.errors import InvalidPolicy, SetupError


def check_path(path: str) -> str:
    """``path`` if it names a group below the cgroup2 root (absolute, normal, not the root itself)."""
    if not path.startswith("/") or path == "/" or os.path.normpath(path) != path or "\0" in path:
        raise InvalidPolicy(f"supervisor.cgroup must be an absolute normal path below the cgroup2 root, not {path!r}")
    return path


def move_self(path: str) -> str:
    """Move this process (single-threaded: the supervisor before its loop) into the v2 group
    ``path``, made if missing; its directory. Before anything here read our own group."""
    from sandboxd.kernel import cgroups

    unified = cgroups.detect().unified
    if unified is None:
        raise SetupError("supervisor cgroup", detail="supervisor.cgroup needs cgroup v2 (no cgroup2 file system "
                                                     "is mounted)")
    group = os.path.join(unified, check_path(path).lstrip("/"))
    os.makedirs(group, mode=0o755, exist_ok=True)
    with open(os.path.join(group, "cgroup.procs"), "w") as procs:
        procs.write("0")                                  # "0": the writing process
    cgroups._hierarchies = None                           # noqa: SLF001 - our own group changed: read again
    return group
