"""Drain on a real daemon: `sandboxd drain` and SIGTERM let a running call finish while new
sessions and calls are refused with UNAVAILABLE and a retry hint, then the daemon exits 0; a drain
that runs out of time kills what is left with an audit event naming why; drain.shutdown = "stop"
(the control) kills the running call at once; only an administrator may drain."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import grpc
import pytest

from conftest import BASE_ENV, SANDBOXD
from daemon_helpers import Daemon, DaemonFactory, create_session, plain_users, rpc_error
from sandboxd.service.status import RETRY_AFTER_METADATA
from sandboxd.v1 import sandboxd_pb2 as pb
from sandboxd.v1 import sandboxd_pb2_grpc as pb_grpc
from test_call_results import OpenExec, run_to_end, wait_call

SANDBOXCTL = str(Path(SANDBOXD).with_name("sandboxctl"))
WAITS_FOR_STDIN = "echo begun; cat > /dev/null; echo done"


def events(stub: pb_grpc.SandboxStub, session_id: str, kind: str) -> list[pb.Event]:
    return list(stub.QueryEvents(pb.QueryEventsRequest(session_id=session_id, types=[kind])).events)


def refused_while_draining(error: grpc.RpcError) -> int:
    """The retry hint of a draining daemon's refusal (asserting it is one)."""
    assert error.code() == grpc.StatusCode.UNAVAILABLE, error
    assert "sandboxd is draining; retry in" in (error.details() or ""), error.details()
    hint = dict(error.trailing_metadata() or ()).get(RETRY_AFTER_METADATA)
    assert hint is not None and 1 <= int(hint) <= 5, error.trailing_metadata()
    return int(hint)


def started(stub: pb_grpc.SandboxStub, session_id: str) -> tuple[OpenExec, str]:
    call = OpenExec(stub, session_id, WAITS_FOR_STDIN)
    call_id = next(call.responses).call_id
    assert next(call.responses).stdout == b"begun\n"
    return call, call_id


def test_sandboxd_drain_lets_the_running_call_finish_and_refuses_new_work(sandboxd_daemon: DaemonFactory) -> None:
    daemon = sandboxd_daemon()
    session = create_session(daemon.stub, sandboxd_daemon.workspace()).id
    job = daemon.stub.StartBackground(pb.StartBackgroundRequest(session_id=session, argv=["sleep", "600"], name="srv"))
    call, call_id = started(daemon.stub, session)
    drain = subprocess.Popen([SANDBOXD, "drain", "--socket", daemon.socket, "--timeout", "600"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=BASE_ENV)
    assert drain.stdout is not None
    assert "1 calls running" in drain.stdout.readline()          # the drain began
    refused_while_draining(rpc_error(lambda: run_to_end(daemon.stub, session, "true")))
    refused_while_draining(rpc_error(lambda: create_session(daemon.stub, sandboxd_daemon.workspace())))
    refused_while_draining(rpc_error(lambda: daemon.stub.ReadFile(pb.ReadFileRequest(session_id=session, path="x"))))
    # Reads keep working, WaitCall among them: the call runs on.
    assert wait_call(daemon.stub, session, call_id).state == pb.CALL_STATE_RUNNING
    assert daemon.proc is not None and daemon.proc.poll() is None
    call.close_stdin()
    rest = call.rest()
    assert rest[-1].result.exit_code == 0 and b"done\n" in b"".join(r.stdout for r in rest)
    assert daemon.proc.wait(timeout=120) == 0
    assert drain.wait(timeout=120) == 0, drain.stderr.read() if drain.stderr else ""
    assert not Path(daemon.socket).exists()
    log = daemon.log()
    assert '"msg": "draining"' in log and '"msg": "drained"' in log, log
    again = Daemon(daemon.base).start()                          # its end is in the audit log
    completed = events(again.stub, session, "ToolInvocationCompleted")
    assert call_id in [e.call_id for e in completed]
    # The call finished by itself: no CallStopped for it; the background process (a drain does not
    # wait for those) ended with the daemon, and the log says so.
    stopped = [json.loads(e.data_json) for e in events(again.stub, session, "CallStopped")]
    assert [(s["reason"], s["background"], s["name"]) for s in stopped] == [("daemon_stopped", job.id, "srv")]


def test_a_drain_that_runs_out_of_time_kills_the_call_and_says_why(sandboxd_daemon: DaemonFactory) -> None:
    daemon = sandboxd_daemon(config="[drain]\ntimeout_seconds = 1\n")
    session = create_session(daemon.stub, sandboxd_daemon.workspace()).id
    call, call_id = started(daemon.stub, session)
    os.kill(daemon.pid, signal.SIGTERM)                           # drains by default (drain.shutdown)
    assert daemon.proc is not None and daemon.proc.wait(timeout=120) == 0
    try:
        ended = call.rest()
    except grpc.RpcError:
        ended = []
    assert not any(r.WhichOneof("kind") == "result" and r.result.exit_code == 0 and not r.result.signal
                   for r in ended)                               # it did not finish by itself
    again = Daemon(daemon.base).start()
    stopped = events(again.stub, session, "CallStopped")
    assert [(e.call_id, json.loads(e.data_json)["reason"]) for e in stopped] == [(call_id, "drain_timeout")]
    answer = wait_call(again.stub, session, call_id)
    assert answer.state == pb.CALL_STATE_FINISHED and answer.reason == "drain_timeout"
    # (its stdin may be closed as its client's stream is cut, just before the kill: `done` then too)
    assert answer.stdout_tail.startswith(b"begun\n")
    assert '"why": "drain_timeout"' in daemon.log()


def test_the_control_shutdown_stop_kills_the_running_call_at_once(sandboxd_daemon: DaemonFactory) -> None:
    daemon = sandboxd_daemon(config='[drain]\nshutdown = "stop"\n')
    session = create_session(daemon.stub, sandboxd_daemon.workspace()).id
    call, call_id = started(daemon.stub, session)
    os.kill(daemon.pid, signal.SIGTERM)
    assert daemon.proc is not None and daemon.proc.wait(timeout=120) == 0
    try:
        call.rest()
    except grpc.RpcError:
        pass                                                      # cut: what shutdown = stop does
    assert '"msg": "draining"' not in daemon.log()
    again = Daemon(daemon.base).start()
    stopped = events(again.stub, session, "CallStopped")
    assert [(e.call_id, json.loads(e.data_json)["reason"]) for e in stopped] == [(call_id, "daemon_stopped")]
    assert wait_call(again.stub, session, call_id).reason == "daemon_stopped"


def test_only_an_administrator_may_drain(sandboxd_daemon: DaemonFactory) -> None:
    daemon = sandboxd_daemon()
    with plain_users(1) as (user,):
        def become() -> None:
            os.setgroups([])
            os.setresgid(user.gid, user.gid, user.gid)
            os.setresuid(user.uid, user.uid, user.uid)
        refused = subprocess.run([SANDBOXD, "drain", "--socket", daemon.socket], capture_output=True, text=True,
                                 timeout=60, env=BASE_ENV, preexec_fn=become)
    assert refused.returncode == 1 and "PERMISSION_DENIED" in refused.stderr, refused.stderr
    assert "listen.admin_group" in refused.stderr
    # The daemon still serves new work: nothing began draining.
    session = create_session(daemon.stub, sandboxd_daemon.workspace()).id
    assert run_to_end(daemon.stub, session, "echo ok")[-1].result.exit_code == 0


@pytest.mark.parametrize("timeout", ["-1", "nan", "86401"])
def test_a_bad_drain_timeout_is_refused_saying_what_to_fix(sandboxd_daemon: DaemonFactory, timeout: str) -> None:
    daemon = sandboxd_daemon()
    refused = subprocess.run([SANDBOXD, "drain", "--socket", daemon.socket, "--timeout", timeout],
                             capture_output=True, text=True, timeout=60, env=BASE_ENV)
    assert refused.returncode == 1 and "INVALID_ARGUMENT" in refused.stderr and "timeout_seconds" in refused.stderr


def test_sandboxctl_tries_again_across_a_drained_restart(sandboxd_daemon: DaemonFactory) -> None:
    """A call and a session refused by a draining daemon run on the next one, stdin whole; the
    control: a daemon that is simply gone is an error at once, as before."""
    daemon = sandboxd_daemon()
    session = create_session(daemon.stub, sandboxd_daemon.workspace()).id
    call, _ = started(daemon.stub, session)
    daemon.stub.Drain(pb.DrainRequest(timeout_seconds=600))
    ctl = [SANDBOXCTL, "--socket", daemon.socket]
    piped = subprocess.Popen([*ctl, "exec", session, "--", "cat"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, env=BASE_ENV)
    creating = subprocess.Popen([*ctl, "session", "create", str(sandboxd_daemon.workspace())],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=BASE_ENV)
    assert piped.stdin is not None and piped.stderr is not None and creating.stderr is not None
    piped.stdin.write(b"whole stdin\n")
    piped.stdin.close()
    assert b"sandboxd is draining" in piped.stderr.readline()     # refused, waiting: says so
    assert "sandboxd is draining" in creating.stderr.readline()
    call.close_stdin()
    assert call.rest()[-1].result.exit_code == 0
    assert daemon.proc is not None and daemon.proc.wait(timeout=120) == 0
    Daemon(daemon.base).start()                                   # the next daemon, on the same socket
    assert piped.stdout is not None
    out = piped.stdout.read()
    assert (piped.wait(timeout=180), out) == (0, b"whole stdin\n"), piped.stderr.read()
    made, err = creating.communicate(timeout=180)
    assert creating.returncode == 0 and made.strip(), err
    # The control: stopped, not drained: sandboxctl fails at once, as before (no wait, no retry).
    for again in sandboxd_daemon.daemons[1:]:
        again.stop(signal.SIGINT)
    gone = subprocess.run([*ctl, "exec", session, "--", "true"], capture_output=True, text=True, timeout=60,
                          env=BASE_ENV)
    assert gone.returncode == 1 and "cannot reach sandboxd" in gone.stderr and "draining" not in gone.stderr


def test_sandboxd_mcp_tries_a_refused_tool_call_again_on_the_next_daemon(sandboxd_daemon: DaemonFactory,
                                                                        capfd: pytest.CaptureFixture[str]) -> None:
    """`sandboxd mcp`'s shell tool, refused by a draining daemon, runs on the next one; its session
    (tied to the MCP server's process) lives on across the restart."""
    import asyncio

    from mcp_helpers import mcp_client, text

    daemon = sandboxd_daemon()
    workspace = sandboxd_daemon.workspace()

    async def scenario() -> str:
        async with mcp_client(daemon.socket, workspace, "--approval", "never") as mcp:
            listed = daemon.stub.ListSessions(pb.ListSessionsRequest()).sessions
            session = next(s.id for s in listed if s.workspace == str(workspace))
            call, _ = started(daemon.stub, session)              # keeps the drain going
            daemon.stub.Drain(pb.DrainRequest(timeout_seconds=600))
            # Asked after the drain began: it can only run on the next daemon.
            refused = asyncio.ensure_future(mcp.call_tool("shell", {"command": "echo after the restart"}))
            said, deadline = "", time.monotonic() + 120
            while "sandboxd is draining" not in said:            # the server's stderr (ours): it waits
                assert not refused.done(), refused.result()
                assert time.monotonic() < deadline, said
                await asyncio.sleep(0.1)
                said += capfd.readouterr().err
            call.close_stdin()
            assert call.rest()[-1].result.exit_code == 0
            assert daemon.proc is not None
            await asyncio.to_thread(daemon.proc.wait, 120)
            await asyncio.to_thread(lambda: Daemon(daemon.base).start())
            return text(await asyncio.wait_for(refused, 180))

    out = asyncio.run(scenario())
    assert "after the restart" in out and "exit status 0" in out, out
