"""Per-process resource limits: a sandbox's (inherited by everything the command starts), and the
descriptor limit a server of sandboxd raises for itself (the daemon, `sandboxd mcp --http`)."""

from __future__ import annotations

import resource

from sandboxd.kernel._libc import from_oserror


def apply(*, cpu_seconds: int | None, open_files: int | None) -> None:
    """Lower the limits; a sandbox never raises them. Also disable core dumps (they could land in the workspace)."""
    try:
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if cpu_seconds is not None:
            # The soft limit sends SIGXCPU, the hard one a second later SIGKILL.
            resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds + 1))
        if open_files is not None:
            _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            value = open_files if hard == resource.RLIM_INFINITY else min(open_files, hard)
            resource.setrlimit(resource.RLIMIT_NOFILE, (value, value))
    except OSError as exc:
        raise from_oserror(exc, "setrlimit") from None


def nofile_target() -> tuple[int, int, int]:
    """RLIMIT_NOFILE as (soft, hard, what a server raises the soft limit to: the hard limit).
    Every session holds descriptors in the daemon and the fork server, so 1024 caps a daemon
    at about 500 sessions; the hard limit is what the service manager allows (LimitNOFILE=)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if hard == resource.RLIM_INFINITY:                # Linux caps descriptors at fs.nr_open anyway
        try:
            with open("/proc/sys/fs/nr_open") as f:
                target = int(f.read())
        except (OSError, ValueError):
            target = 1 << 20
    return soft, hard, max(soft, target) if soft != resource.RLIM_INFINITY else soft


def raise_nofile_limit() -> int:
    """Raise our soft RLIMIT_NOFILE to the hard limit (the daemon: before the fork server starts,
    which inherits it); returns the soft limit in force."""
    soft, hard, target = nofile_target()
    if target != soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (OSError, ValueError):
            return soft
    return target
