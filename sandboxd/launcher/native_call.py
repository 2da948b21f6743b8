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

from sandboxd._record import Record
from sandboxd.launcher.plan import LaunchPlan

HELPER_NAME = "sandboxd-call"
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandboxd_call.c")
HEADER_NAME = "sandboxd_call.h"   # generated at build time (``header``), never edited or committed
DEFAULT_HELPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), HELPER_NAME)

# The descriptors the helper expects (see the header of sandboxd_call.c).
REPORT_FD, STATUS_FD, SESSION_PIDFD, INTAKE_FD, BPF_FD, ENV_FD = 3, 4, 5, 6, 7, 8
# The trace descriptor (-T) is moved at least this high, out of the fixed layout's way.
TRACE_FD_MIN = 16


def helper_path() -> str | None:
    """The built helper, or None (the Python path is used then). Built, not checked: see
    ``check_helper`` for whether it may be used."""
    return DEFAULT_HELPER if os.access(DEFAULT_HELPER, os.X_OK) else None


REBUILD = "python -m sandboxd.launcher.native_call build (packaging/setup.sh does it)"
# How long ``sandboxd-call -V`` may take: it prints one line; a helper that hangs is broken.
VERSION_SECONDS = 5.0


class HelperCheck(Record):
    """What ``check_helper`` found: the helper to run calls with (None: the Python path), and
    its state as `sandboxctl status` shows it (``call_helper``)."""

    path: str | None
    state: str                      # "built", "missing (...)", "stale (...)" or "broken (...)"

    @property
    def unusable(self) -> bool:
        """There is a helper, but it must not be used: say so loudly (a missing one is a choice)."""
        return self.path is None and not self.state.startswith("missing")


_checked: dict[tuple[str, int, int, int, int], HelperCheck] = {}


def check_helper(path: str | None = None) -> HelperCheck:
    """Whether the helper at ``path`` (the built one by default) was built from this sandboxd's
    constants and call plan: ``path -V`` prints the digest of the header it was compiled with,
    which must be ``digest()``. A helper built before a constant or a step changed would take
    steps the Python path no longer takes, or share values it no longer shares: it is not used
    (stale), nor is one that does not answer -V with a digest (broken). Remembered per file
    (device, inode, size, change time), so `sandboxctl status` runs it once per build."""
    helper = path or DEFAULT_HELPER
    try:
        st = os.stat(helper)
    except OSError:
        st = None
    if st is None or not os.access(helper, os.X_OK):
        return HelperCheck(None, "missing (Python call path)")
    key = (helper, st.st_dev, st.st_ino, st.st_size, st.st_ctime_ns)
    if key not in _checked:
        _checked.clear()                            # one entry: the helper as it is now
        _checked[key] = _run_version(helper)
    return _checked[key]


def _run_version(helper: str) -> HelperCheck:
    import re
    import subprocess

    try:
        # An empty environment, as the fork server gives it: it runs as root.
        result = subprocess.run([helper, "-V"], stdin=subprocess.DEVNULL, capture_output=True, env={},
                                timeout=VERSION_SECONDS)
    except subprocess.TimeoutExpired:
        return HelperCheck(None, f"broken ({helper} -V did not answer in {VERSION_SECONDS:g} s; Python call path)")
    except OSError as exc:
        return HelperCheck(None, f"broken ({helper} -V: {exc.strerror or exc}; Python call path)")
    built = result.stdout.decode(errors="replace").strip()
    if result.returncode != 0 or not re.fullmatch(r"[0-9a-f]{16}", built):
        said = (built or result.stderr.decode(errors="replace").strip())[:80]
        return HelperCheck(None, f"broken ({helper} -V exited {result.returncode} saying {said!r}, "
                                 f"not a digest; Python call path)")
    wanted = digest()
    if built != wanted:
        return HelperCheck(None, f"stale ({helper} was built with constants {built}, this sandboxd's are "
                                 f"{wanted}; Python call path)")
    return HelperCheck(helper, "built")


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
    # The plan's writable roots; the paths every call adds (landlock.EXTRA_WRITABLE,
    # FILE_WRITES_ONLY) come with the generated header.
    for path in plan.writable_roots:
        args += ["-W", path]
    if plan.terminal is not None:
        args += ["-t", f"{plan.terminal[0]}:{plan.terminal[1]}"]
    debug = plan.debug
    if debug is not None:                          # tests only (plan.DebugHooks)
        if debug.trace_path:
            args += ["-T", debug.trace_path]
        if debug.landlock_abi:
            args += ["-A", str(debug.landlock_abi)]
        if debug.no_close_range:
            args.append("-X")
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


Constant = int | str | tuple[int, ...] | tuple[str, ...] | tuple[tuple[int, int], ...]


def constants() -> dict[str, Constant]:
    """Every value the helper shares with the Python path, by its name in the header: the one
    source both are built from (the Python modules named here own them)."""
    from sandboxd.kernel import caps, cgroups, landlock, process, terminals
    from sandboxd.launcher import call_plan, report, sequence
    from sandboxd.policy import limits

    return {
        "SBX_REPORT_FD": REPORT_FD, "SBX_STATUS_FD": STATUS_FD, "SBX_SESSION_PIDFD": SESSION_PIDFD,
        "SBX_INTAKE_FD": INTAKE_FD, "SBX_BPF_FD": BPF_FD, "SBX_ENV_FD": ENV_FD, "SBX_TRACE_FD_MIN": TRACE_FD_MIN,
        "SBX_SETUP_FAILED_EXIT": report.SETUP_FAILED_EXIT,
        "SBX_CAPABILITY_VERSION_3": caps.CAPABILITY_VERSION_3,
        "SBX_CAP_SYS_ADMIN": caps.CAP_SYS_ADMIN,
        "SBX_FALLBACK_LAST_CAP": caps.FALLBACK_LAST_CAP,
        "SBX_SECUREBITS": caps.SECUREBITS,
        "SBX_FORWARDED_SIGNALS": tuple(int(s) for s in sequence.FORWARDED_SIGNALS),
        "SBX_KILL_TREE_SIGNAL": int(sequence.KILL_TREE_SIGNAL),
        "SBX_LL_WRITE_FILE": landlock.WRITE_FILE,
        "SBX_LL_TRUNCATE": landlock.TRUNCATE,
        "SBX_LL_WANTED_WRITES": landlock.WANTED_WRITES,
        "SBX_LL_WANTED_FILE_WRITES": landlock.WANTED_FILE_WRITES,
        "SBX_LL_WANTED_SCOPES": landlock.WANTED_SCOPES,
        "SBX_LL_RIGHT_ABI": tuple(sorted(landlock.RIGHT_ABI.items())),
        "SBX_LL_SCOPE_ABI": tuple(sorted(landlock.SCOPE_ABI.items())),
        "SBX_LL_NET_ABI": landlock.NET_ABI,
        "SBX_LL_SCOPE_ATTR_ABI": landlock.SCOPE_ATTR_ABI,
        "SBX_LL_EXTRA_WRITABLE": tuple(landlock.EXTRA_WRITABLE),
        "SBX_LL_FILE_WRITES_ONLY": tuple(landlock.FILE_WRITES_ONLY),
        "SBX_PTMX_PATH": terminals.PTMX_PATH,
        "SBX_COMMAND_OOM_SCORE_ADJ": process.COMMAND_OOM_SCORE_ADJ,
        "SBX_OOM_SCORE_ADJ_PATH": process.OOM_SCORE_ADJ_PATH,
        "SBX_TERMINAL_MIN_SIZE": terminals.MIN_SIZE,
        "SBX_TERMINAL_MAX_SIZE": terminals.MAX_SIZE,
        # What the helper holds and takes: more paths, or a number out of range, refuse the call.
        "SBX_MAX_WRITABLE_PATHS": limits.MAX_WRITABLE_PATHS,
        "SBX_MAX_CGROUP_DIRS": cgroups.MAX_SET_DIRS,
        "SBX_MAX_CPU_SECONDS": limits.MAX_TIMEOUT_SECONDS,
        "SBX_MAX_OPEN_FILES": limits.MAX_OPEN_FILES,
        "SBX_PATH_MAX": limits.PATH_MAX,
        "SBX_LL_HIGHEST_ABI": landlock.HIGHEST_KNOWN_ABI,
        # The call plan: the names the helper traces its steps by, and their order (unused by the
        # C code, here so that the digest changes with the plan: a helper built before is stale).
        **{f"SBX_STEP_{name}": text for name, text in call_plan.step_names().items()},
        "SBX_CALL_PLAN": tuple(text for text, _ in call_plan.CALL_PLAN),
    }


def _render(value: Constant) -> str:
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return f'"{value}"'
    items = [f'"{item}"' if isinstance(item, str) else _render(item) if isinstance(item, tuple) else str(item)
             for item in value]
    return "{" + ", ".join(items) + "}"


def _body() -> str:
    return "".join(f"#define {name} {_render(value)}\n" for name, value in constants().items())


def digest() -> str:
    """Names the constants a helper was built with (``sandboxd-call -V`` prints it)."""
    import hashlib

    return hashlib.sha256(_body().encode()).hexdigest()[:16]


def header() -> str:
    """The text of sandboxd_call.h."""
    return ("/* Generated by sandboxd/launcher/native_call.py from the Python constants: do not edit. */\n"
            "#ifndef SANDBOXD_CALL_H\n#define SANDBOXD_CALL_H\n"
            f'#define SBX_CONSTANTS_DIGEST "{digest()}"\n' + _body() + "#endif\n")


def build(output: str = DEFAULT_HELPER, compiler: str = "cc") -> str:
    """Compile the helper (static when the C library allows it) with a freshly generated
    header. Returns its path."""
    import subprocess
    import tempfile

    flags = ["-O2", "-Wall", "-Wextra", "-Werror", "-D_FORTIFY_SOURCE=2", "-fstack-protector-strong"]
    temporary = f"{output}.{os.getpid()}.tmp"
    with tempfile.TemporaryDirectory(prefix="sandboxd-call-build-") as include:
        with open(os.path.join(include, HEADER_NAME), "w") as f:
            f.write(header())
        # -iquote before the source's own directory: a stray sandboxd_call.h there is never used.
        for link in (["-static"], []):
            result = subprocess.run([compiler, *flags, *link, "-iquote", include, "-o", temporary, SOURCE],
                                    capture_output=True, text=True)
            if result.returncode == 0:
                os.chmod(temporary, 0o755)
                os.replace(temporary, output)
                return output
    raise RuntimeError(f"cannot build {HELPER_NAME} from {SOURCE}:\n{result.stderr}")


if __name__ == "__main__":
    import sys

    commands = {"build": build, "header": header, "digest": digest}
    if len(sys.argv) != 2 or sys.argv[1] not in commands:
        sys.exit("usage: python -m sandboxd.launcher.native_call build|header|digest")
    print(commands[sys.argv[1]]().rstrip("\n"))
