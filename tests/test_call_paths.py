"""Session calls on both paths: the native helper (sandboxd-call, the default) and the
Python reference (sequence.run_call). Every check runs on each, so the two cannot drift:
each call gets its own argv, env, cwd and stdio; timeouts and errors behave the same;
the same kernel walls hold; nothing is held or left behind.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from conftest import BASE_ENV, PY, SLOW
from sandboxd.errors import ExecFailed, SetupError
from sandboxd.kernel import cgroups, landlock
from sandboxd.launcher import call_plan, native_call, report
from sandboxd.launcher.native_call import helper_path
from sandboxd.launcher.plan import DebugHooks
from sandboxd.service.terminal_call import receive_master
from sandboxd.policy import LaunchSpec, Limits, WorkspaceWrite, limits
from sandboxd.supervisor.fork_client import ForkServer
from sandboxd.supervisor.spawner import Spawner

pytestmark = pytest.mark.timeout(120)


def test_the_native_helper_is_built() -> None:
    """Without it every daemon call silently takes the slower Python path."""
    assert helper_path() is not None, "sandboxd-call is not built: run packaging/setup.sh (or " \
        "python -m sandboxd.launcher.native_call build)"


@pytest.fixture(scope="module", params=["native", "python"])
def server(request: pytest.FixtureRequest) -> Iterator[ForkServer]:
    fs = ForkServer.start(native_calls=request.param == "native")
    assert fs.native_calls == (request.param == "native")
    try:
        yield fs
    finally:
        fs.close()


@pytest.fixture
def session(server: ForkServer, workspace: Path) -> Iterator[str]:
    name = f"call-{os.urandom(4).hex()}"
    server.open_session(name, LaunchSpec(argv=("true",), workspace=str(workspace), env=dict(BASE_ENV),
                                         policy=WorkspaceWrite()))
    try:
        yield name
    finally:
        server.close_session(name)


def run(server: ForkServer, session: str, argv: list[str], cwd: str, *, env: dict[str, str] | None = None,
        timeout: float | None = None) -> tuple[str, object]:
    """One call; (its combined output, read to EOF, and its ExitInfo)."""
    read_end, write_end = os.pipe()
    null = os.open("/dev/null", os.O_RDONLY)
    try:
        call_id, _ = server.call(session, argv, env or dict(BASE_ENV), cwd, timeout, (null, write_end, write_end))
        os.close(write_end)
        write_end = -1
        chunks = []
        while data := os.read(read_end, 65536):          # EOF only once no process holds the write end
            chunks.append(data)
        return b"".join(chunks).decode(), server.wait(call_id)
    finally:
        for fd in (read_end, write_end, null):
            if fd >= 0:
                os.close(fd)


def fork_server_children(server: ForkServer) -> list[psutil.Process]:
    return psutil.Process(server.pid).children(recursive=True)


def supervisors(server: ForkServer) -> list[psutil.Process]:
    return [p for p in psutil.Process(server.pid).children() if p.name() == "sandboxd-call"]


def test_each_call_gets_its_own_argv_env_and_cwd(server: ForkServer, session: str, workspace: Path) -> None:
    (workspace / "sub").mkdir()
    seen = []
    for index in range(4):
        cwd = str(workspace / "sub") if index % 2 else str(workspace)
        output, info = run(server, session, ["/bin/sh", "-c", 'echo "$0 $PWD $CALL_INDEX"', f"call{index}"], cwd,
                           env={**BASE_ENV, "CALL_INDEX": str(index)})
        assert info.exit_code == 0, output  # type: ignore[attr-defined]
        seen.append(output.strip())
    assert seen == [f"call{i} {workspace / 'sub' if i % 2 else workspace} {i}" for i in range(4)]


SLEEP_SYSCALLS = {"35", "230"}   # x86-64 nanosleep, clock_nanosleep


def _sleeping(pid: int) -> bool:
    """Whether the process is blocked in a sleep system call (its first field in /proc/PID/syscall)."""
    try:
        with open(f"/proc/{pid}/syscall") as f:
            return f.read().split(" ", 1)[0] in SLEEP_SYSCALLS
    except OSError:
        return False


def test_a_call_holds_only_its_own_descriptors(server: ForkServer, session: str, workspace: Path) -> None:
    """The command has exactly stdin, stdout and stderr; its supervisor only its status pipe
    (and, in Python, a signal wake-up pipe): no other call's pipe, no session pidfd."""
    read_end, write_end = os.pipe()
    null = os.open("/dev/null", os.O_RDONLY)
    try:
        call_id, _ = server.call(session, ["sleep", "5"], dict(BASE_ENV), str(workspace), None,
                                 (null, write_end, write_end))
        deadline = time.monotonic() + 10
        while not (found := [(s, s.children()) for s in supervisors(server) if s.children()]):
            assert time.monotonic() < deadline, "the call's supervisor never showed up"
            time.sleep(0.02)
        supervisor, (command,) = found[0]
        # Until its exec the command's process still holds the call's close-on-exec descriptors,
        # and after it the dynamic loader and the locale briefly hold their own files as fd 3 (a
        # wide window in an emulated guest): look once `sleep` is blocked in its sleep.
        while not _sleeping(command.pid):
            assert time.monotonic() < deadline, f"the command never slept: {command.cmdline()}"
            time.sleep(0.02)
        assert sorted(os.listdir(f"/proc/{command.pid}/fd"), key=int) == ["0", "1", "2"]
        assert len(os.listdir(f"/proc/{supervisor.pid}/fd")) <= (1 if server.native_calls else 3)
        server.cancel(call_id)
        assert server.wait(call_id).signal is not None
    finally:
        for fd in (read_end, write_end, null):
            os.close(fd)


def test_timeout(server: ForkServer, session: str, workspace: Path) -> None:
    output, info = run(server, session, ["sleep", "0.3"], str(workspace), timeout=1.0 * SLOW)
    assert not info.timed_out and info.exit_code == 0, (output, info)  # type: ignore[attr-defined]
    assert info.wall_seconds < 1.0 * SLOW, info  # type: ignore[attr-defined]
    _, info = run(server, session, ["sleep", "30"], str(workspace), timeout=0.5)
    assert info.timed_out, info  # type: ignore[attr-defined]


def test_the_kernel_walls_hold(server: ForkServer, session: str, workspace: Path, outside: Path) -> None:
    # Landlock and the read-only mount: a write outside the writable roots fails.
    output, info = run(server, session, ["/bin/sh", "-c", f"echo x > {outside}/target.txt"], str(workspace))
    assert info.exit_code != 0 and (outside / "target.txt").read_text() == "original\n", output  # type: ignore[attr-defined]
    # seccomp: no new namespaces.
    output, info = run(server, session, ["unshare", "--mount", "true"], str(workspace))
    assert info.exit_code != 0 and "Operation not permitted" in output, output  # type: ignore[attr-defined]
    # No capabilities, no_new_privs.
    output, _ = run(server, session, ["grep", "-E", "^(CapEff|CapPrm|NoNewPrivs)", "/proc/self/status"],
                    str(workspace))
    assert "CapEff:\t0000000000000000" in output and "NoNewPrivs:\t1" in output, output
    # Landlock's signal scope: the command cannot kill its call's supervisor. Below ABI 6 (Linux 6.1)
    # nothing scopes signals inside the session's PID namespace (docs/kernels.md): the
    # command can end its own call that way, which is reported as killed, and the session goes on.
    output, info = run(server, session, ["/bin/sh", "-c", "kill -9 $PPID; echo status=$?"], str(workspace))
    if landlock.abi_version() >= landlock.SCOPE_ABI[landlock.SCOPE_SIGNAL]:
        assert "status=1" in output and info.signal is None, (output, info)  # type: ignore[attr-defined]
    else:
        assert info.signal == signal.SIGKILL, (output, info)  # type: ignore[attr-defined]
        output, info = run(server, session, ["/bin/sh", "-c", "echo next"], str(workspace))
        assert output == "next\n" and info.exit_code == 0, (output, info)  # type: ignore[attr-defined]


def test_errors_keep_their_step(server: ForkServer, session: str, workspace: Path) -> None:
    with pytest.raises(ExecFailed) as missing:
        run(server, session, ["no-such-program-here"], str(workspace))
    assert missing.value.errno == errno.ENOENT and missing.value.hint and "not found" in missing.value.hint
    with pytest.raises(SetupError) as bad_cwd:
        run(server, session, ["true"], str(workspace / "does-not-exist"))
    assert bad_cwd.value.errno == errno.ENOENT, bad_cwd.value
    output, info = run(server, session, ["echo", "still fine"], str(workspace))
    assert output == "still fine\n" and info.exit_code == 0  # type: ignore[attr-defined]


def test_a_path_longer_than_the_kernel_takes_is_refused_never_cut_short(server: ForkServer, session: str,
                                                                         workspace: Path) -> None:
    """A PATH entry whose candidate (entry, "/", program) is longer than PATH_MAX: the helper used to
    cut it to its buffer and exec what the cut named (a `true` planted where `truecolour` was asked
    for). Both paths refuse it as the kernel does (ENAMETOOLONG) and look on; the control: the
    planted program is there, and runs when named by a path that fits."""
    program = "truecolour"
    deep, length = str(workspace), limits.PATH_MAX - 1 - len("/true")     # the cut would end in ".../true"
    while length - len(deep) > 201:
        deep += "/" + "d" * 200
    deep += "/" + "d" * (length - len(deep) - 1)                         # 1 to 200 characters
    assert len(deep) == length
    os.makedirs(deep)
    planted = Path(deep) / "true"
    planted.write_text("#!/bin/sh\necho cut short\n")
    planted.chmod(0o755)
    env = {**BASE_ENV, "PATH": f"{deep}:/usr/bin:/bin"}
    with pytest.raises(ExecFailed) as refused:
        run(server, session, [program], str(workspace), env=env)
    assert refused.value.errno == errno.ENAMETOOLONG, refused.value
    output, info = run(server, session, ["true"], deep, env={**BASE_ENV, "PATH": "."})
    assert output == "cut short\n" and info.exit_code == 0, (output, info)  # type: ignore[attr-defined]


def test_closing_the_session_leaves_nothing(server: ForkServer, workspace: Path) -> None:
    name = f"call-close-{os.urandom(4).hex()}"
    server.open_session(name, LaunchSpec(argv=("true",), workspace=str(workspace), env=dict(BASE_ENV),
                                         policy=WorkspaceWrite()))
    read_end, write_end = os.pipe()
    try:
        call_id, _ = server.call(name, ["/bin/sh", "-c", "sleep 60 & sleep 60"], dict(BASE_ENV), str(workspace),
                                 None, (write_end, write_end, write_end))
        assert fork_server_children(server)
        server.close_session(name)
        assert server.wait(call_id).signal is not None
    finally:
        os.close(read_end)
        os.close(write_end)
    # Every other test closed its session too: nothing may be left, not even a zombie.
    assert fork_server_children(server) == []


def test_limits_reach_the_command(server: ForkServer, workspace: Path) -> None:
    name = f"call-limits-{os.urandom(4).hex()}"
    server.open_session(name, LaunchSpec(argv=("true",), workspace=str(workspace), env=dict(BASE_ENV),
                                         policy=WorkspaceWrite(), limits=Limits(cpu_seconds=7, open_files=77)))
    try:
        output, info = run(server, name, ["/bin/sh", "-c", "ulimit -t; ulimit -n; ulimit -c"], str(workspace))
        assert output.split() == ["7", "77", "0"], output
    finally:
        server.close_session(name)


def test_the_environment_stays_private(server: ForkServer, session: str, workspace: Path) -> None:
    """The command's environment reaches it, but neither the supervisor's own environment
    (it starts as root: no LD_PRELOAD) nor any world-readable command line."""
    secret = f"secret-{os.urandom(6).hex()}"
    read_end, write_end = os.pipe()
    null = os.open("/dev/null", os.O_RDONLY)
    try:
        call_id, _ = server.call(session, ["/bin/sh", "-c", 'echo "$API_TOKEN $LD_PRELOAD"; exec sleep 5'],
                                 {**BASE_ENV, "API_TOKEN": secret, "LD_PRELOAD": "/nonexistent.so"},
                                 str(workspace), None, (null, write_end, write_end))
        os.close(write_end)
        write_end = -1
        deadline, seen = time.monotonic() + 10, ""
        while f"{secret} /nonexistent.so" not in seen:       # the command's own loader may complain first
            assert time.monotonic() < deadline, seen
            seen += os.read(read_end, 4096).decode()
        for process in supervisors(server):
            assert secret not in " ".join(process.cmdline())
            assert "API_TOKEN" not in process.environ() and "LD_PRELOAD" not in process.environ()
            for child in process.children():
                assert secret not in " ".join(child.cmdline())
        server.cancel(call_id)
        server.wait(call_id)
    finally:
        for fd in (read_end, write_end, null):
            if fd >= 0:
                os.close(fd)


WRITE_EACH = 'for d in "$@"; do { echo "$d" > "$d/written"; } 2>/dev/null || echo "refused $d"; done'


def test_every_writable_root_is_writable_at_the_maximum(server: ForkServer, workspace: Path, base_dir: Path) -> None:
    """A policy may name MAX_WRITABLE_ROOTS roots, and the workspace comes on top: each of them gets its
    Landlock rule on both paths (the native helper once held 256 paths, and the 257th silently lost
    its rule). The roots sit outside the workspace and beside each other, so no other rule covers
    one; the last one in the plan's order (the deepest, then by name) is the one a short list drops."""
    parent = base_dir / "roots"
    parent.mkdir()
    roots = [parent / f"root-{index:03}" for index in range(limits.MAX_WRITABLE_ROOTS)]
    for root in roots:
        root.mkdir()
    control = parent / "not-a-root"                       # bound read-only with the rest of the host
    control.mkdir()
    name = f"call-roots-{os.urandom(4).hex()}"
    server.open_session(name, LaunchSpec(argv=("true",), workspace=str(workspace), env=dict(BASE_ENV),
                                         policy=WorkspaceWrite(writable_roots=tuple(map(str, roots)))))
    try:
        targets = [workspace, *roots, control]
        output, info = run(server, name, ["/bin/sh", "-c", WRITE_EACH, "sh", *map(str, targets)], str(workspace))
    finally:
        server.close_session(name)
    assert info.exit_code == 0, (output, info)  # type: ignore[attr-defined]
    # The control: a directory beside the roots that is not one stays unwritable (the wall is there).
    assert output.splitlines() == [f"refused {control}"], output
    assert not (control / "written").exists()
    assert [(t / "written").read_text() for t in targets[:-1]] == [f"{t}\n" for t in targets[:-1]]


# -- the helper's own command line: what it cannot hold or read, it refuses --

def run_helper(arguments: list[str]) -> tuple[int, dict[str, str]]:
    """sandboxd-call run directly, with only its report pipe (descriptor 3): (its exit status, the
    fields of its report). A command line it accepts fails one step later, at the environment
    (descriptor 8 is not there)."""
    helper = helper_path()
    assert helper is not None
    read_end, write_end = os.pipe()
    try:
        pid = os.posix_spawn(helper, [helper, *arguments], {},
                             file_actions=[(os.POSIX_SPAWN_DUP2, write_end, native_call.REPORT_FD),
                                           (os.POSIX_SPAWN_CLOSE, native_call.ENV_FD)])
        os.close(write_end)
        write_end = -1
        data = report.read_all(read_end)
        _, status = os.waitpid(pid, 0)
    finally:
        for fd in (read_end, write_end):
            if fd >= 0:
                os.close(fd)
    return os.waitstatus_to_exitcode(status), report.decode(data)


GOOD = {"-u": "1000", "-g": "1000", "-n": "0", "-C": "7", "-F": "77", "-A": "1", "-t": "24:80"}


def helper_arguments(**changed: str) -> list[str]:
    options = {**GOOD, **{f"-{key}": value for key, value in changed.items()}}
    return ["-c", "/", *[item for pair in options.items() for item in pair], "--", "true"]


PASSED_PARSING = {"native": "1", "errno": str(errno.EBADF), "step": "environment"}


def test_the_helper_refuses_more_paths_than_it_holds() -> None:
    """One writable path or cgroup more than the header's maximum is refused (E2BIG, naming the path
    it could not hold), not dropped; exactly the maximum is taken (the control)."""
    if helper_path() is None:
        pytest.skip("sandboxd-call is not built (test_the_native_helper_is_built fails)")
    paths = [f"/var/tmp/root-{index:03}" for index in range(limits.MAX_WRITABLE_PATHS + 1)]
    writable = [item for path in paths for item in ("-W", path)]
    assert run_helper([*writable[:-2], *helper_arguments()]) == (report.SETUP_FAILED_EXIT, PASSED_PARSING)
    assert run_helper([*writable, *helper_arguments()]) == (report.SETUP_FAILED_EXIT, {
        "native": "1", "errno": str(errno.E2BIG), "step": "call helper arguments", "path": paths[-1]})
    groups = [item for index in range(cgroups.MAX_SET_DIRS + 1) for item in ("-G", f"/sys/fs/cgroup/g{index}")]
    assert run_helper([*groups[:-2], *helper_arguments()]) == (report.SETUP_FAILED_EXIT, PASSED_PARSING)
    assert run_helper([*groups, *helper_arguments()])[1]["errno"] == str(errno.E2BIG)


BAD_NUMBERS = {
    # Not a number to its end: strtoul alone read these as 0, 1, 12, 16 or ULONG_MAX.
    "": errno.EINVAL, "x": errno.EINVAL, "-1": errno.EINVAL, "+1": errno.EINVAL, " 1": errno.EINVAL,
    "12x": errno.EINVAL, "0x10": errno.EINVAL, "1 ": errno.EINVAL,
    # Out of range: past the type (strtoul's overflow), or past what the option may be.
    "18446744073709551616": errno.ERANGE, "99999999999999999999999": errno.ERANGE,
}
TOO_BIG = {"u": str(2**32 - 1), "g": str(2**32 - 1), "n": str(2**31), "C": str(limits.MAX_TIMEOUT_SECONDS + 1),
           "F": str(limits.MAX_OPEN_FILES + 1), "A": str(landlock.HIGHEST_KNOWN_ABI + 1)}


@pytest.mark.parametrize("option", sorted(TOO_BIG))
def test_the_helper_refuses_bad_numbers(option: str) -> None:
    """Every number on the helper's command line is checked (digits to the end, errno, range): a bad
    one refuses the call with EINVAL or ERANGE naming it, where an unchecked strtoul ran the call
    with another uid, limit or ABI. The control: the largest good value passes."""
    if helper_path() is None:
        pytest.skip("sandboxd-call is not built (test_the_native_helper_is_built fails)")
    for value, code in {**BAD_NUMBERS, TOO_BIG[option]: errno.ERANGE}.items():
        assert run_helper(helper_arguments(**{option: value})) == (report.SETUP_FAILED_EXIT, {
            "native": "1", "errno": str(code), "step": "call helper arguments", "path": value}), value
    largest = str(int(TOO_BIG[option]) - 1)
    assert run_helper(helper_arguments(**{option: largest})) == (report.SETUP_FAILED_EXIT, PASSED_PARSING)


def test_the_helper_refuses_a_bad_terminal_size() -> None:
    if helper_path() is None:
        pytest.skip("sandboxd-call is not built (test_the_native_helper_is_built fails)")
    for size in ("24", "24:", ":80", "24:80x", "24x:80", "-1:80", "24:-1", "0:80", "24:0", "18446744073709551617:80",
                 f"24:{2**32 + 80}"):
        code, fields = run_helper(helper_arguments(t=size))
        assert (code, fields["step"]) == (report.SETUP_FAILED_EXIT, "call helper arguments"), (size, fields)
        assert fields["errno"] in {str(errno.EINVAL), str(errno.ERANGE)}, (size, fields)
    assert run_helper(helper_arguments(t="1:1")) == (report.SETUP_FAILED_EXIT, PASSED_PARSING)


UNIX_CONNECT = """
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    s.connect(sys.argv[1])
    print("connected")
except OSError as e:
    print("refused", e.errno)
"""


def test_host_unix_sockets_stay_unreachable(server: ForkServer, session: str, workspace: Path,
                                            base_dir: Path) -> None:
    """Without network, connect() is brokered by the session's init (the call's seccomp listener
    went to it): a host socket is refused, one bound inside the session is reachable."""
    import socket

    host_path = base_dir / "host.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(host_path))
    listener.listen(4)
    os.chmod(host_path, 0o777)
    try:
        output, _ = run(server, session, [PY, "-c", UNIX_CONNECT, str(host_path)], str(workspace))
        assert output.split() == ["refused", str(errno.EACCES)], output
        inside = workspace / "inside.sock"
        # The listener serves one connection; the client starts once the socket file exists.
        script = (f"{PY} -c 'import socket; s=socket.socket(socket.AF_UNIX); s.bind(\"{inside}\"); "
                  f"s.listen(1); s.accept()' & while [ ! -S {inside} ]; do sleep 0.05; done; "
                  f"{PY} -c '{UNIX_CONNECT}' {inside}; wait")
        output, _ = run(server, session, ["/bin/sh", "-c", script], str(workspace))
        assert output.split() == ["connected"], output
    finally:
        listener.close()


# -- one behaviour for both paths: the setup trace, the close_range fallback, every Landlock ABI --
#
# These drive a Spawner in this process (no fork server), so that a test can set the plan's
# DebugHooks, which no request can reach.

class LocalSession:
    """A session's sandbox opened by a Spawner in this process, on one call path."""

    def __init__(self, native: bool, workspace: Path, trace_dir: Path) -> None:
        self.native = native
        self.workspace = workspace
        self.trace_dir = trace_dir
        self.spawner = Spawner(native_helper=helper_path() if native else None)
        self.session = self.spawner.open_session(LaunchSpec(argv=("true",), workspace=str(workspace),
                                                            env=dict(BASE_ENV), policy=WorkspaceWrite()))

    def call(self, argv: list[str], terminal: tuple[int, int] | None = None,
             **hooks: object) -> tuple[str, object, list[str]]:
        """One call with DebugHooks(**hooks) and a trace: (its output, its ExitInfo, the trace's steps).
        With ``terminal``, on a terminal as the daemon runs one (terminal_call.TerminalCall)."""
        trace = self.trace_dir / f"trace-{os.urandom(4).hex()}"
        trace.write_text("")
        self.session.plan = self.session.plan.replace(debug=DebugHooks(trace_path=str(trace), **hooks))
        if terminal is not None:
            read_end, write_end = (end.detach() for end in socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET))
            stdio = (write_end, write_end, write_end)
        else:
            read_end, write_end = os.pipe()
            stdio = (os.open("/dev/null", os.O_RDONLY), write_end, write_end)
        child_ends = set(stdio)                           # ours are closed once the call has them
        try:
            proc = self.spawner.launch_call(self.session, tuple(argv), dict(BASE_ENV), str(self.workspace), stdio,
                                            terminal=terminal)
            try:
                proc.wait_started()
            except BaseException:
                proc.wait()
                raise
            if terminal is not None:
                channel, read_end = socket.socket(fileno=read_end), -1
                with channel:
                    read_end = receive_master(channel)
            while child_ends:
                os.close(child_ends.pop())
            chunks = []
            while data := _read_to_hangup(read_end):
                chunks.append(data)
            info = proc.wait()
        finally:
            for fd in child_ends | {read_end} - {-1}:
                os.close(fd)
        return b"".join(chunks).decode(), info, trace.read_text().splitlines()

    def close(self) -> None:
        self.session.close()


@pytest.fixture
def local_sessions(workspace: Path, base_dir: Path) -> Iterator[dict[str, LocalSession]]:
    """Both paths, each on its own session of the same workspace."""
    opened: dict[str, LocalSession] = {}
    try:
        for name in ("native", "python"):
            opened[name] = LocalSession(name == "native", workspace, base_dir)
        yield opened
    finally:
        for local in opened.values():
            local.close()


def test_both_paths_take_the_same_setup_steps(local_sessions: dict[str, LocalSession]) -> None:
    """The trace of a call's setup steps is the same list on both paths, and the reference one
    (a step added to one path only, or moved, fails here)."""
    traces = {}
    for name, local in local_sessions.items():
        output, info, steps = local.call(["echo", "traced"])
        assert output == "traced\n" and info.exit_code == 0, (name, output, info)  # type: ignore[attr-defined]
        traces[name] = steps
    listener = local_sessions["native"].session.plan.brokers_connect
    for name, steps in traces.items():
        assert call_plan.misplaced(steps) is None, (name, call_plan.misplaced(steps), steps)
    expected = call_plan.expected(landlock_abi=landlock.abi_version(), listener=listener)
    assert traces["native"] == traces["python"] == expected, traces


def test_both_paths_take_the_same_steps_on_a_terminal(local_sessions: dict[str, LocalSession]) -> None:
    """A call on a terminal adds the same two steps on both paths: the supervisor opens it (as the
    caller, inside the session) before the fork, the command takes it right after setsid."""
    traces = {}
    for name, local in local_sessions.items():
        output, info, steps = local.call(["sh", "-c", "tty; stty size"], terminal=(12, 34))
        assert output.split() == ["/dev/pts/0", "12", "34"] and info.exit_code == 0, (name, output, info)  # type: ignore[attr-defined]
        traces[name] = steps
    listener = local_sessions["native"].session.plan.brokers_connect
    for name, steps in traces.items():
        assert call_plan.misplaced(steps) is None, (name, call_plan.misplaced(steps), steps)
    expected = call_plan.expected(landlock_abi=landlock.abi_version(), listener=listener, terminal=True)
    assert traces["native"] == traces["python"] == expected, traces


def _read_to_hangup(fd: int) -> bytes:
    """A read of a pipe or a terminal's master: b"" at EOF and at a terminal's hang-up (EIO)."""
    try:
        return os.read(fd, 65536)
    except OSError as exc:
        if exc.errno != errno.EIO:
            raise
        return b""


def test_the_trace_is_off_unless_asked(local_sessions: dict[str, LocalSession]) -> None:
    """Production plans carry no DebugHooks: the helper gets none of the test flags."""
    plan = local_sessions["native"].session.plan
    assert plan.debug is None
    argv = native_call.command_line("sandboxd-call", plan, namespaces=0, cgroup_dirs=[])
    assert not {"-T", "-A", "-X"} & set(argv[:argv.index("--")]), argv


OPEN_DESCRIPTORS = """
import os
def is_open(fd):
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False
print(sorted(fd for fd in range(3, 1024) if is_open(fd)))
"""


def test_the_close_range_fallback_leaks_nothing(local_sessions: dict[str, LocalSession]) -> None:
    """As on a kernel without CLOSE_RANGE_CLOEXEC (before 5.11): the /proc/self/fd walk marks the
    report and status pipes, the session pidfd and the rest close-on-exec, on both paths. The
    helper's own descriptors 3..8 are not close-on-exec (posix_spawn's dup2 clears it), so a
    skipped walk would show them here."""
    for name, local in local_sessions.items():
        output, info, steps = local.call([PY, "-c", OPEN_DESCRIPTORS], no_close_range=True)
        assert output.split() == ["[]"] and info.exit_code == 0, (name, output, info)  # type: ignore[attr-defined]
        assert call_plan.Step.CLOSE_ON_EXEC_WALK in steps, (name, steps)    # the walk really ran
        assert call_plan.misplaced(steps) is None, (name, call_plan.misplaced(steps), steps)
        # Control: without the flag close_range does it, and the walk is not taken.
        output, info, steps = local.call([PY, "-c", OPEN_DESCRIPTORS])
        assert output.split() == ["[]"] and "close-on-exec by /proc/self/fd" not in steps, (name, output, steps)


LANDLOCK_PROBE = """
import errno, os, sys
outside = sys.argv[1]
def attempt(action):
    try:
        action()
        return "ok"
    except OSError as exc:
        return errno.errorcode[exc.errno]
def write_outside():
    with open(os.path.join(outside, "target.txt"), "w") as f:
        f.write("overwritten")
def write_inside():
    with open("inside.txt", "w") as f:
        f.write("x")
def move_across():
    os.makedirs("from", exist_ok=True)
    os.makedirs("to", exist_ok=True)
    open("from/moved", "w").close()
    os.rename("from/moved", "to/moved")
print("outside", attempt(write_outside))
print("inside", attempt(write_inside))
print("truncate", attempt(lambda: os.truncate("inside.txt", 0)))
print("refer", attempt(move_across))
print("signal", attempt(lambda: os.kill(os.getppid(), 0)))
"""


@pytest.mark.parametrize("abi", range(1, landlock.HIGHEST_KNOWN_ABI + 1))
def test_landlock_at_every_abi(local_sessions: dict[str, LocalSession], outside: Path, abi: int) -> None:
    """Forced down to each ABI (as an older kernel would be), both paths hand the kernel only
    the rights that ABI knows, the kernel accepts them, and the walls hold as far as that ABI
    reaches: writes outside stay refused everywhere, cross-directory renames work from ABI 2
    (REFER; ABI 1 refuses every reparenting with EXDEV), and the command cannot signal its
    call's supervisor from ABI 6 (the signal scope; before it, only the uid separates them)."""
    kernel = landlock.abi_version()
    if kernel < abi:
        pytest.skip(f"this kernel's Landlock ABI is {kernel}, below {abi}")
    results = {}
    for name, local in local_sessions.items():
        for leftover in ("from", "to"):
            shutil.rmtree(local.workspace / leftover, ignore_errors=True)
        output, info, steps = local.call([PY, "-c", LANDLOCK_PROBE, str(outside)], landlock_abi=abi)
        assert info.exit_code == 0, (name, output, info)  # type: ignore[attr-defined]
        assert call_plan.Step.LANDLOCK_ABI % abi in steps, (name, steps)
        results[name] = dict(line.split() for line in output.splitlines())
        assert (outside / "target.txt").read_text() == "original\n"
    expected = {"outside": "EROFS", "inside": "ok", "truncate": "ok", "refer": "ok" if abi >= 2 else "EXDEV",
                "signal": "EPERM" if abi >= 6 else "ok"}
    assert results["native"] == results["python"] == expected, results


def test_landlock_rights_follow_the_abi() -> None:
    """The pure part: each ABI's handled set holds exactly the rights introduced up to it."""
    assert landlock.write_accesses(1) & (landlock.REFER | landlock.TRUNCATE) == 0
    assert landlock.write_accesses(2) & landlock.REFER and not landlock.write_accesses(2) & landlock.TRUNCATE
    assert landlock.write_accesses(3) & landlock.TRUNCATE
    for abi in range(1, landlock.HIGHEST_KNOWN_ABI + 1):
        assert landlock.write_accesses(abi) & ~landlock.known_rights(abi) == 0
        assert landlock.known_scopes(abi) == (0 if abi < 6 else
                                              landlock.SCOPE_SIGNAL | landlock.SCOPE_ABSTRACT_UNIX_SOCKET)
    assert landlock.known_rights(4) & landlock.IOCTL_DEV == 0 and landlock.known_rights(5) & landlock.IOCTL_DEV
