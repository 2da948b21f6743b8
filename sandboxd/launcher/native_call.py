"""The native call path: ``sandboxd-call``, the C twin of ``sequence.run_call``.

A call in a warm session is the daemon's hot path. In Python it costs two
forks of an interpreter (the call's supervisor, then the command) and their
page-table copies and copy-on-write faults: most of a call's CPU time on a
small machine. ``sandboxd_call.c`` does the same steps, in the same order,
as a small static program that the fork server spawns with posix_spawn
(a vfork, no page-table copy). The Python path stays for file tools (they
run Python in the sandbox), for machines where the helper was not built,
and as the reference the tests hold the helper to (tests/test_call_paths.py
runs the same checks on both).

This module owns the helper's build and its command line; the fork server's
``Spawner`` spawns it.
"""

from __future__ import annotations

import os

from sandboxd.launcher.plan import LaunchPlan

HELPER_NAME = "sandboxd-call"
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandboxd_call.c")
DEFAULT_HELPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), HELPER_NAME)

# The descriptors the helper expects (see the header of sandboxd_call.c).
REPORT_FD, STATUS_FD, SESSION_PIDFD, INTAKE_FD, BPF_FD, ENV_FD = 3, 4, 5, 6, 7, 8


def helper_path() -> str | None:
    """The built helper, or None (the Python path is used then)."""
    return DEFAULT_HELPER if os.access(DEFAULT_HELPER, os.X_OK) else None


def command_line(helper: str, plan: LaunchPlan, *, namespaces: int, cgroup_dirs: list[str]) -> list[str]:
    """argv for the helper. The command's environment is not in it (see ``environment_file``)."""
    args = [helper, "-u", str(plan.uid), "-g", str(plan.gid), "-c", plan.cwd, "-n", str(namespaces)]
    if plan.limits.cpu_seconds is not None:
        args += ["-C", str(plan.limits.cpu_seconds)]
    if plan.limits.open_files is not None:
        args += ["-F", str(plan.limits.open_files)]
    if plan.brokers_connect:
        args.append("-L")
    for path in cgroup_dirs:
        args += ["-G", path]
    # The same Landlock rules as sequence._run_command.
    for path in [*plan.writable_roots, "/tmp", "/dev/shm"]:
        args += ["-W", path]
    for path in ("/dev", "/proc"):
        args += ["-R", path]
    return [*args, "--", *plan.argv]


def environment_file(env: dict[str, str]) -> int:
    """A memfd with the command's environment, NUL-terminated KEY=VALUE entries, for ENV_FD.
    Not the helper's own environment (it starts as root: no LD_PRELOAD may reach it) and
    not its argv (the command line of any process is world-readable in /proc)."""
    fd = os.memfd_create("sandboxd-call-env", os.MFD_CLOEXEC)
    try:
        data = b"".join(os.fsencode(f"{key}={value}") + b"\0" for key, value in env.items())
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    except BaseException:
        os.close(fd)
        raise
    return fd


def build(output: str = DEFAULT_HELPER, compiler: str = "cc") -> str:
    """Compile the helper (static when the C library allows it). Returns its path."""
    import subprocess

    flags = ["-O2", "-Wall", "-Wextra", "-Werror", "-D_FORTIFY_SOURCE=2", "-fstack-protector-strong"]
    temporary = f"{output}.{os.getpid()}.tmp"
    for link in (["-static"], []):
        result = subprocess.run([compiler, *flags, *link, "-o", temporary, SOURCE], capture_output=True, text=True)
        if result.returncode == 0:
            os.chmod(temporary, 0o755)
            os.replace(temporary, output)
            return output
    raise RuntimeError(f"cannot build {HELPER_NAME} from {SOURCE}:\n{result.stderr}")


if __name__ == "__main__":
    import sys

    if sys.argv[1:] != ["build"]:
        sys.exit("usage: python -m sandboxd.launcher.native_call build")
    print(build())
