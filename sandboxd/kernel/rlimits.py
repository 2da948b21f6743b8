"""Per-process resource limits (inherited by everything the command starts)."""

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
