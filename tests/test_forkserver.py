"""The fork server (the daemon's launch path): launches, exit information, errors, signals, shutdown."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import BASE_ENV, PY, kill_marked, make_dir, pids_with_marker, wait_until_gone
from sandboxd.errors import ExecFailed, InvalidPolicy, SetupError
from sandboxd.policy import DangerFullAccess, LaunchSpec, Limits, ReadOnly, WorkspaceWrite
from sandboxd.supervisor.fork_client import ForkServer

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def server() -> Iterator[ForkServer]:
    """One fork server for the module (started while this process is still single-threaded)."""
    fs = ForkServer.start()
    try:
        yield fs
    finally:
        fs.close()


class Captured:
    """A pipe whose write end is handed to the sandbox as stdout and stderr."""

    def __init__(self) -> None:
        self.read_end, self.write_end = os.pipe()
        self.null = os.open("/dev/null", os.O_RDONLY)

    @property
    def stdio(self) -> tuple[int, int, int]:
        return (self.null, self.write_end, self.write_end)

    def after_launch(self) -> None:
        """Close our copy of the write end (the server got its own), so reading ends at the sandbox's exit."""
        if self.write_end >= 0:
            os.close(self.write_end)
            self.write_end = -1

    def read(self) -> str:
        self.after_launch()
        chunks = []
        while True:
            data = os.read(self.read_end, 65536)
            if not data:
                break
            chunks.append(data)
        return b"".join(chunks).decode()

    def close(self) -> None:
        for fd in (self.read_end, self.write_end, self.null):
            if fd >= 0:
                os.close(fd)


@pytest.fixture
def out() -> Iterator[Captured]:
    captured = Captured()
    try:
        yield captured
    finally:
        captured.close()


def spec(argv: list[str], workspace: Path, **kwargs: object) -> LaunchSpec:
    return LaunchSpec(argv=tuple(argv), workspace=str(workspace), env=dict(BASE_ENV), **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("policy", [ReadOnly(), WorkspaceWrite(), WorkspaceWrite(network_access=True),
                                    DangerFullAccess()], ids=lambda p: f"{p.name}{'+net' if p.network_access else ''}")
def test_launch_and_wait(server: ForkServer, out: Captured, workspace: Path, policy: object) -> None:
    """A launched command runs with the given stdio; wait() returns its ExitInfo."""
    cid = server.launch(spec(["sh", "-c", "echo hello; echo err >&2; exit 0"], workspace, policy=policy),
                        stdio=out.stdio)
    out.after_launch()
    info = server.wait(cid)
    assert out.read() == "hello\nerr\n"
    assert (info.exit_code, info.signal, info.timed_out) == (0, None, False)
    assert info.shell_status == 0
    assert 0 < info.wall_seconds < 30


def test_exit_code(server: ForkServer, out: Captured, workspace: Path) -> None:
    """A non-zero exit code is reported as such."""
    cid = server.launch(spec(["sh", "-c", "exit 7"], workspace), stdio=out.stdio)
    out.after_launch()
    info = server.wait(cid)
    assert (info.exit_code, info.signal, info.timed_out, info.shell_status) == (7, None, False, 7)


def test_killed_by_signal(server: ForkServer, out: Captured, workspace: Path) -> None:
    """A command killed by a signal reports the signal (and 128+N as shell status)."""
    cid = server.launch(spec(["sh", "-c", "kill -KILL $$"], workspace), stdio=out.stdio)
    out.after_launch()
    info = server.wait(cid)
    assert info.signal == signal.SIGKILL and info.exit_code is None and info.shell_status == 137


def test_sandbox_is_enforced(server: ForkServer, out: Captured, base_dir: Path, workspace: Path,
                             outside: Path) -> None:
    """The fork server path enforces the same policy: workspace and roots writable, outside not, no network."""
    root = make_dir(base_dir / "root")
    script = (f"echo a > {workspace}/a && echo b > {root}/b && echo WROTE-IN; echo c > {outside}/c && echo WROTE-OUT; "
              "ip -o link | wc -l; grep NoNewPrivs /proc/self/status")
    cid = server.launch(spec(["sh", "-c", script], workspace, policy=WorkspaceWrite(writable_roots=(str(root),))),
                        stdio=out.stdio)
    out.after_launch()
    info = server.wait(cid)
    text = out.read()
    assert info.exit_code == 0, text
    assert "WROTE-IN" in text and "WROTE-OUT" not in text, text
    assert "\n1\n" in text and "NoNewPrivs:\t1" in text, text
    assert (workspace / "a").exists() and (root / "b").exists() and not (outside / "c").exists()


def test_environment_and_cwd(server: ForkServer, workspace: Path) -> None:
    """The spec's env is the command's whole environment, and cwd is honoured."""
    sub = make_dir(workspace / "sub")
    for argv, env, expected in ((["/usr/bin/env"], {"ONLY": "this"}, "ONLY=this\n"),
                                (["/bin/pwd"], {}, f"{sub}\n")):
        captured = Captured()
        try:
            cid = server.launch(LaunchSpec(argv=tuple(argv), workspace=str(workspace), env=env, cwd=str(sub)),
                                stdio=captured.stdio)
            captured.after_launch()
            assert server.wait(cid).exit_code == 0
            assert captured.read() == expected
        finally:
            captured.close()


def test_timeout(server: ForkServer, out: Captured, workspace: Path, marker: str) -> None:
    """A timeout kills the whole tree and reports timed_out (shell status 124)."""
    script = f"({PY} -c 'import time; time.sleep(60)' {marker} &); sleep 60"
    started = time.monotonic()
    try:
        cid = server.launch(spec(["sh", "-c", script], workspace, limits=Limits(timeout_seconds=0.5)),
                            stdio=out.stdio)
        out.after_launch()
        info = server.wait(cid)
        assert info.timed_out and info.shell_status == 124
        assert time.monotonic() - started >= 0.5  # not before the deadline (speed itself is the benchmark's)
        assert wait_until_gone(marker) == []
    finally:
        kill_marked(marker)


def test_signal_is_delivered(server: ForkServer, out: Captured, workspace: Path) -> None:
    """signal(cid, SIGTERM) reaches the command."""
    cid = server.launch(spec([PY, "-c", "import time; print('up', flush=True); time.sleep(60)"], workspace),
                        stdio=out.stdio)
    out.after_launch()
    assert os.read(out.read_end, 3) == b"up\n"
    server.signal(cid, signal.SIGTERM)
    info = server.wait(cid)
    assert info.signal == signal.SIGTERM and info.shell_status == 143


def test_concurrent_launches_wait_in_any_order(server: ForkServer, workspace: Path) -> None:
    """Several sandboxes can run at once; their results are matched to their ids whatever the wait order."""
    ids = []
    null = os.open("/dev/null", os.O_RDWR)
    try:
        for code in (3, 4, 5):
            ids.append(server.launch(spec(["sh", "-c", f"sleep 0.{code}; exit {code}"], workspace),
                                     stdio=(null, null, null)))
    finally:
        os.close(null)
    assert [server.wait(cid).exit_code for cid in reversed(ids)] == [5, 4, 3]


def test_missing_program_raises_exec_failed(server: ForkServer, out: Captured, workspace: Path) -> None:
    """A program that does not exist raises ExecFailed with step 'exec' and errno ENOENT; the server lives on."""
    with pytest.raises(ExecFailed) as caught:
        server.launch(spec(["/nonexistent/sbx-program"], workspace), stdio=out.stdio)
    assert isinstance(caught.value, SetupError)
    assert caught.value.step == "exec" and caught.value.errno == errno.ENOENT
    cid = server.launch(spec(["true"], workspace), stdio=out.stdio)
    assert server.wait(cid).exit_code == 0


def test_setup_failure_raises_setup_error(server: ForkServer, out: Captured, git_workspace: Path,
                                          outside: Path) -> None:
    """A protected path that is a symlink fails setup: SetupError naming the step, errno and path."""
    hooks = git_workspace / ".git" / "hooks"
    os.rename(hooks, outside / "hooks")
    hooks.symlink_to(outside / "hooks")
    with pytest.raises(SetupError) as caught:
        server.launch(spec(["sh", "-c", f"touch {git_workspace}/ran"], git_workspace), stdio=out.stdio)
    error = caught.value
    assert not isinstance(error, ExecFailed)
    assert error.step and error.errno == errno.ELOOP and str(hooks) in (error.path or "")
    assert not (git_workspace / "ran").exists()


def test_invalid_workspace_is_refused(server: ForkServer, out: Captured, base_dir: Path) -> None:
    """A workspace that does not exist is refused before anything runs."""
    with pytest.raises((InvalidPolicy, SetupError)):
        server.launch(spec(["true"], base_dir / "missing"), stdio=out.stdio)


def test_close_kills_running_sandboxes(workspace: Path, marker: str) -> None:
    """Closing a fork server kills the sandboxes it still runs (a dedicated server, closed here)."""
    fs = ForkServer.start()
    null = os.open("/dev/null", os.O_RDWR)
    try:
        fs.launch(spec([PY, "-c", "import time; time.sleep(60)", marker], workspace), stdio=(null, null, null))
        assert pids_with_marker(marker), "the sandboxed command is not running"
        fs.close()
        assert wait_until_gone(marker) == []
        with pytest.raises(ProcessLookupError):
            os.kill(fs.pid, 0)
    finally:
        fs.close()  # idempotent; a server left running would hold the module server's socket open
        os.close(null)
        kill_marked(marker)


def test_two_fork_servers_close_independently() -> None:
    """With two fork servers in one process, closing the first returns promptly (it must not wait on the
    second one, which should not hold the first one's client socket). Run in a child with a deadline."""
    code = (
        "import time\n"
        "from sandboxd.supervisor.fork_client import ForkServer\n"
        "a = ForkServer.start(); b = ForkServer.start()\n"
        "t = time.monotonic(); a.close(); print('first closed in', round(time.monotonic() - t, 2), flush=True)\n"
        "b.close(); print('both closed', flush=True)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=15)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"closing the first of two fork servers hung (stdout={stdout!r}, stderr={stderr[-500:]!r})")
    assert proc.returncode == 0 and "both closed" in stdout, (stdout, stderr)


def test_a_session_comes_back_with_the_real_paths_it_was_built_with(server: ForkServer, base_dir: Path) -> None:
    """SessionReady carries what the fork server built: the workspace and the writable roots by the
    real paths its lookup (by descriptor, as the caller) found, which is what the sandbox binds and
    the daemon keeps (never resolving the names again itself), and its PID namespace. Named through
    symlinks here: the facts are the targets; a root named twice (by itself and through a link) is
    one root."""
    real_ws, real_root = make_dir(base_dir / "real-ws"), make_dir(base_dir / "real-root")
    (base_dir / "ws-link").symlink_to(real_ws)
    (base_dir / "root-link").symlink_to(real_root)
    spec = LaunchSpec(argv=("true",), workspace=str(base_dir / "ws-link"), env=dict(BASE_ENV),
                      policy=WorkspaceWrite(writable_roots=(str(base_dir / "root-link"), str(real_root))),
                      caller=(65534, 65534, ()))
    os.chown(real_ws, 65534, 65534)
    os.chown(real_root, 65534, 65534)
    info = server.open_session("facts#1", spec)
    try:
        assert (info.workspace, info.writable_roots) == (str(real_ws), (str(real_root),))
        # Its PID namespace too, read by the fork server while the init was surely its child.
        namespace = os.stat(f"/proc/{info.init_pid}/ns/pid").st_ino
        assert info.pid_namespace == namespace != os.stat("/proc/self/ns/pid").st_ino
    finally:
        server.close_session("facts#1")
    read_only = server.open_session("facts#2", spec.replace(policy=ReadOnly()))
    try:
        assert (read_only.workspace, read_only.writable_roots) == (str(real_ws), ())
    finally:
        server.close_session("facts#2")
