"""The fork server's loop with many calls running: a turn polls only the calls whose pidfd is ready
or whose time limit or stop grace has come (``_Server._collect_exits``), so it must still see every
end, every time limit and every cancel, whichever other calls are running meanwhile."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import BASE_ENV
from sandboxd.policy import LaunchSpec, Limits, WorkspaceWrite
from sandboxd.supervisor.fork_client import ForkServer

pytestmark = pytest.mark.timeout(180)

RUNNING = 40


@pytest.fixture
def session(workspace: Path) -> Iterator[tuple[ForkServer, str]]:
    server = ForkServer.start()
    try:
        server.open_session("loop", LaunchSpec(argv=("true",), workspace=str(workspace), env=dict(BASE_ENV),
                                               policy=WorkspaceWrite(), limits=Limits(pids=1024)))
        yield server, "loop"
    finally:
        server.close()


def test_ends_limits_and_cancels_are_seen_while_many_calls_run(session: tuple[ForkServer, str],
                                                                workspace: Path) -> None:
    server, name = session
    null = os.open("/dev/null", os.O_RDWR)
    stdio = (null, null, null)
    cwd = str(workspace)
    try:
        sleepers = [server.call(name, ["sleep", "600"], dict(BASE_ENV), cwd, None, stdio)[0] for _ in range(RUNNING)]
        # An end among many running calls: reported with its own status (its pidfd is the ready one).
        quick, _ = server.call(name, ["sh", "-c", "exit 7"], dict(BASE_ENV), cwd, None, stdio)
        assert server.wait(quick).exit_code == 7
        # A time limit: no descriptor of it becomes ready before its deadline, the loop must wake
        # for it anyway (a missed one hangs here until the module's timeout fails the test).
        limited, _ = server.call(name, ["sleep", "600"], dict(BASE_ENV), cwd, 0.5, stdio)
        info = server.wait(limited)
        assert info.timed_out and info.shell_status == 124, info
        # The calls that were never ready all this time are still there and still end when asked.
        for call_id in sleepers[:RUNNING // 2]:
            server.cancel(call_id)
        for call_id in sleepers[:RUNNING // 2]:
            ended = server.wait(call_id)
            assert not ended.timed_out and ended.exit_code is None and ended.signal is not None, ended
        # Control: the others were not touched by any of it, and a plain call still runs.
        again, _ = server.call(name, ["true"], dict(BASE_ENV), cwd, None, stdio)
        assert server.wait(again).exit_code == 0
        running = [call_id for call_id in sleepers[RUNNING // 2:]]
        for call_id in running:
            server.signal(call_id, 15)
        for call_id in running:
            ended = server.wait(call_id)
            assert ended.signal == 15 and not ended.timed_out, ended
    finally:
        os.close(null)
