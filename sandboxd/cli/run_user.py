"""Who `sandboxd run`'s command runs as, and what that changes.

A plain user's run is rootless (launcher.rootless): the command is that user, and the default
memory and pids limits, which need a cgroup a plain user cannot create, are left out (the
per-process rlimits still apply). Root's run starts the command as the owner of the workspace;
when that command fails, one line says which uid it was and why.
"""

from __future__ import annotations

import os

from sandboxd.errors import InvalidPolicy
from sandboxd.policy import Limits

CGROUP_FLAGS = (("memory", "--memory"), ("pids", "--pids"))


def plain_user() -> bool:
    return os.geteuid() != 0


def limits_for_plain_user(limits: Limits, explicit: dict[str, object]) -> Limits:
    """``limits`` for a rootless run: a cgroup limit asked for is refused with the reason; the
    defaults are dropped without a word (the tree stays bounded by the user's own host limits, as
    everything else the user runs: nothing in the sandbox runs with more rights than the user)."""
    for key, flag in CGROUP_FLAGS:
        if explicit.get(key) is not None:
            raise InvalidPolicy(f"{flag} needs root: it is a cgroup limit, and a plain user cannot create cgroups "
                                "here; run sandboxd run as root, or drop it (--cpu-seconds and --open-files are "
                                "per-process limits that work rootless)")
    return limits.replace(memory_bytes=None, pids=None, total_pids=None, total_memory_bytes=None)


def uid_note(uid: int, gid: int, workspace: str, asked: bool) -> str | None:
    """For root's run whose command failed: the line saying which uid it ran as and why (None
    when it ran as root, or as the uid --user named)."""
    if plain_user() or uid == 0 or asked:
        return None
    return (f"the command ran as uid {uid} (gid {gid}), the owner of the workspace {workspace}, not as root: "
            f"a \"Permission denied\" may come from that; --user 0 runs it as root, "
            f"or chown the workspace to the user it should run as")
