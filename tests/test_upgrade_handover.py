"""An upgrade as an operator runs one: SIGTERM (drain.shutdown = "drain", the default) with a call
still running, then the next daemon on the same socket and state.

With ``supervisor.survive_restart`` the drain hands over: the daemon exits 0 at the drain's end
while the call runs on in its sandbox, the next daemon adopts it, ``WaitCall`` gives its exit and
the tail of its output (what no client saw), the session keeps working, the call's end is in the
audit log once, and ``sandboxd audit verify`` says the log is whole. The control: with
``survive_restart = false`` the same drain ends the call (``drain_timeout``) and the next daemon
reports that instead.
"""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from daemon_helpers import (SANDBOXD, Daemon, ExecCall, base_with_workspace, create_session, exec_start, run_exec,
                            workspace_write)
from sandboxd.v1 import sandboxd_pb2 as pb

pytestmark = pytest.mark.timeout(300)

DRAIN_ONE_SECOND = {"SANDBOXD_DRAIN_TIMEOUT_SECONDS": "1"}
SURVIVE = {"SANDBOXD_SUPERVISOR_SURVIVE_RESTART": "true", **DRAIN_ONE_SECOND}
DIE = {"SANDBOXD_SUPERVISOR_SURVIVE_RESTART": "false", **DRAIN_ONE_SECOND}
SHELL = "echo up; sleep 4; echo done; exit 7"


@pytest.fixture
def base() -> Iterator[Path]:
    with base_with_workspace("sbxupgrade-") as path:
        yield path


def drain_with_a_call_running(base: Path, env: dict[str, str]) -> tuple[str, str]:
    """A daemon with a session and a call that outlasts the drain, stopped with SIGTERM.
    (the session's id, the call's id)."""
    first = Daemon(base, env=env).start()
    try:
        session = create_session(first.stub, base / "ws", workspace_write())
        call = ExecCall(first.stub, exec_start(session.id, shell=SHELL))
        call.wait_stdout(b"up")
        [started] = [e for e in first.stub.QueryEvents(pb.QueryEventsRequest(
            session_id=session.id, types=["ToolInvocationStarted"]), timeout=30).events]
        assert first.stop(signal.SIGTERM) == 0, first.log()
        call.close()             # its stream ended with the daemon: no gRPC thread of it may outlive the test
    finally:
        first.close()
    return session.id, started.call_id


def wait_call(daemon: Daemon, session_id: str, call_id: str, seconds: float) -> pb.WaitCallResponse:
    return daemon.stub.WaitCall(pb.WaitCallRequest(session_id=session_id, call_id=call_id, timeout_seconds=seconds),
                                timeout=seconds + 30)


def completions(daemon: Daemon, session_id: str, call_id: str) -> list[pb.Event]:
    reply = daemon.stub.QueryEvents(pb.QueryEventsRequest(session_id=session_id, types=["ToolInvocationCompleted"]),
                                    timeout=30)
    return [e for e in reply.events if e.call_id == call_id]


def test_a_drained_daemon_hands_its_running_call_to_the_next(base: Path) -> None:
    session_id, call_id = drain_with_a_call_running(base, SURVIVE)
    second = Daemon(base, env=SURVIVE).start()
    try:
        result = wait_call(second, session_id, call_id, 60)
        assert result.state == pb.CALL_STATE_FINISHED, result
        assert (result.exit_code, result.signal, result.reason) == (7, 0, "adopted"), result
        assert result.stdout_tail.endswith(b"done\n"), result.stdout_tail
        assert run_exec(second.stub, session_id, shell="echo still here").result.exit_code == 0
        assert len(completions(second, session_id, call_id)) == 1
    finally:
        assert second.stop(signal.SIGINT) == 0
    verified = subprocess.run([SANDBOXD, "audit", "verify", "--state-dir", str(base / "state")],
                              capture_output=True, text=True, timeout=120)
    assert verified.returncode == 0 and verified.stdout.startswith("whole"), verified.stdout + verified.stderr


def test_control_without_a_surviving_supervisor_the_drain_ends_the_call(base: Path) -> None:
    session_id, call_id = drain_with_a_call_running(base, DIE)
    second = Daemon(base, env=DIE).start()
    try:
        result = wait_call(second, session_id, call_id, 5)
        assert result.state == pb.CALL_STATE_FINISHED and result.reason == "drain_timeout", result
        assert not result.stdout_tail.endswith(b"done\n")
    finally:
        second.close()
