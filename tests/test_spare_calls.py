"""Spare calls: a session's next call, forked ahead of need (Spawner.fork_spare).

After a session's first call the fork server keeps one call forked and waiting,
its command process already joined, unprivileged, under Landlock and seccomp.
These tests drive sessions through the fork server and check that a call that
takes a spare behaves exactly like one that does not: its own argv, env, cwd
and stdio; timeouts counted from the call, not from the fork; the same kernel
walls; errors reported with their step; nothing held or left behind.
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from conftest import BASE_ENV
from sandboxd.errors import ExecFailed, SetupError
from sandboxd.policy import LaunchSpec, WorkspaceWrite
from sandboxd.supervisor.forkserver import ForkServer

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def server() -> Iterator[ForkServer]:
    fs = ForkServer.start()
    try:
        yield fs
    finally:
        fs.close()


@pytest.fixture
def session(server: ForkServer, workspace: Path) -> Iterator[str]:
    name = f"spare-{os.urandom(4).hex()}"
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


def wait_for_spare(server: ForkServer) -> None:
    """A spare is a call supervisor (``sandboxd-call``) with a waiting child and no call running."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if any(p.name() == "sandboxd-call" and p.children() for p in fork_server_children(server)):
            return
        time.sleep(0.02)
    raise AssertionError("no spare call was forked after the session's first call")


def test_a_spare_is_ready_after_the_first_call(server: ForkServer, session: str, workspace: Path) -> None:
    output, info = run(server, session, ["echo", "first"], str(workspace))
    assert (output, info.exit_code) == ("first\n", 0)  # type: ignore[attr-defined]
    wait_for_spare(server)


def test_each_call_gets_its_own_argv_env_and_cwd(server: ForkServer, session: str, workspace: Path) -> None:
    (workspace / "sub").mkdir()
    seen = []
    for index in range(4):                               # the first forks; the others take spares
        cwd = str(workspace / "sub") if index % 2 else str(workspace)
        output, info = run(server, session, ["/bin/sh", "-c", 'echo "$0 $PWD $CALL_INDEX"', f"call{index}"], cwd,
                           env={**BASE_ENV, "CALL_INDEX": str(index)})
        assert info.exit_code == 0, output  # type: ignore[attr-defined]
        seen.append(output.strip())
        wait_for_spare(server)
    assert seen == [f"call{i} {workspace / 'sub' if i % 2 else workspace} {i}" for i in range(4)]


def test_a_spare_holds_no_descriptor_of_another_call(server: ForkServer, session: str, workspace: Path) -> None:
    """The spare forked after a call must not keep that call's stdout open: its reader would
    never see EOF. (``run`` reads to EOF, so a leaked descriptor hangs this test.)"""
    run(server, session, ["true"], str(workspace))
    wait_for_spare(server)
    for _ in range(3):
        output, _info = run(server, session, ["echo", "done"], str(workspace))
        assert output == "done\n"
        wait_for_spare(server)
    for proc in fork_server_children(server):
        if proc.name() in ("sandboxd-call",) or (proc.parent() and proc.parent().name() == "sandboxd-call"):
            assert sorted(f.fd for f in proc.open_files()) == [], proc.open_files()
            assert len(os.listdir(f"/proc/{proc.pid}/fd")) <= 6, os.listdir(f"/proc/{proc.pid}/fd")


def test_timeout_counts_from_the_call_not_from_the_fork(server: ForkServer, session: str, workspace: Path) -> None:
    run(server, session, ["true"], str(workspace))
    wait_for_spare(server)
    time.sleep(1.5)                                      # the spare has waited longer than the timeout
    output, info = run(server, session, ["sleep", "0.3"], str(workspace), timeout=1.0)
    assert not info.timed_out and info.exit_code == 0, (output, info)  # type: ignore[attr-defined]
    assert info.wall_seconds < 1.0, info  # type: ignore[attr-defined]
    _, info = run(server, session, ["sleep", "30"], str(workspace), timeout=0.5)
    assert info.timed_out, info  # type: ignore[attr-defined]


def test_the_kernel_walls_hold_in_a_spare(server: ForkServer, session: str, workspace: Path, outside: Path) -> None:
    run(server, session, ["true"], str(workspace))
    wait_for_spare(server)
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
    # Landlock's signal scope: the command cannot kill its call's supervisor.
    output, info = run(server, session, ["/bin/sh", "-c", "kill -9 $PPID; echo status=$?"], str(workspace))
    assert "status=1" in output and info.signal is None, (output, info)  # type: ignore[attr-defined]


def test_errors_keep_their_step(server: ForkServer, session: str, workspace: Path) -> None:
    run(server, session, ["true"], str(workspace))
    wait_for_spare(server)
    with pytest.raises(ExecFailed) as missing:
        run(server, session, ["no-such-program-here"], str(workspace))
    assert missing.value.errno == errno.ENOENT
    wait_for_spare(server)
    with pytest.raises(SetupError) as bad_cwd:
        run(server, session, ["true"], str(workspace / "does-not-exist"))
    assert bad_cwd.value.errno == errno.ENOENT, bad_cwd.value
    output, info = run(server, session, ["echo", "still fine"], str(workspace))
    assert output == "still fine\n" and info.exit_code == 0  # type: ignore[attr-defined]


def test_closing_the_session_ends_its_spare(server: ForkServer, workspace: Path) -> None:
    name = f"spare-close-{os.urandom(4).hex()}"
    server.open_session(name, LaunchSpec(argv=("true",), workspace=str(workspace), env=dict(BASE_ENV),
                                         policy=WorkspaceWrite()))
    run(server, name, ["true"], str(workspace))
    wait_for_spare(server)
    assert fork_server_children(server)
    server.close_session(name)
    # Every other test closed its session too: nothing may be left, not even a zombie.
    assert fork_server_children(server) == []
