"""The Run RPC (Exec with one request message and no request stream), end to end over gRPC with
a real daemon: the same responses, stdin, audit, approvals, quota hold, cancellation and
isolation between users as Exec, what it refuses (a terminal), and the Python client's use of it
(with Exec as the fallback against a daemon that has no Run)."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from conftest import make_dir, wait_until_gone
from daemon_helpers import (
    SAFETY_DEADLINE,
    Daemon,
    create_session,
    exec_start,
    read_only,
    rpc_error,
    run_client_as,
    run_exec,
    stand_in_daemon,
    workspace_write,
)
from daemon_fixtures import daemon, stub, ws  # noqa: F401 - pytest fixtures
from sandboxd.client import SandboxClient
from sandboxd.v1 import sandboxd_pb2 as pb
from sandboxd.v1 import sandboxd_pb2_grpc as pb_grpc
from test_approvals import Background, denial_of, events, kinds, opened, resolve, wait_pending  # noqa: F401
from test_daemon import poll, session, sessions, sleep_marker, wait_marker_appears  # noqa: F401 - fixtures

pytestmark = pytest.mark.timeout(180)

NOBODY = 65534


def run(stub: pb_grpc.SandboxStub, session_id: str, argv: list[str] | None = None, shell: str | None = None,
        **kwargs: object) -> list[pb.ExecResponse]:
    return list(stub.Run(exec_start(session_id, argv, shell, **kwargs), timeout=SAFETY_DEADLINE))


def kinds_of(responses: list[pb.ExecResponse]) -> list[str]:
    return [str(r.WhichOneof("kind")) for r in responses]


def stdout_of(responses: list[pb.ExecResponse]) -> bytes:
    return b"".join(r.stdout for r in responses if r.WhichOneof("kind") == "stdout")


def test_run_answers_as_exec_does(stub: pb_grpc.SandboxStub, session: pb.Session) -> None:
    script = "echo out; echo err >&2; exit 3"
    ran = run(stub, session.id, shell=script)
    execed = run_exec(stub, session.id, shell=script)
    assert kinds_of(ran)[0] == "started_pid" and kinds_of(ran)[-1] == "result"
    assert sorted(kinds_of(ran)) == sorted(execed.kinds)
    assert ran[0].started_pid > 1
    assert stdout_of(ran) == execed.stdout == b"out\n"
    assert b"".join(r.stderr for r in ran if r.WhichOneof("kind") == "stderr") == execed.stderr == b"err\n"
    assert (ran[-1].result.exit_code, ran[-1].result.shell_status) == (3, 3)
    assert execed.result is not None and execed.result.exit_code == 3


def test_run_delivers_stdin_and_closes_it(stub: pb_grpc.SandboxStub, session: pb.Session) -> None:
    # close_stdin unset: Run closes stdin after `stdin` anyway (nothing can follow), so `cat` ends.
    assert stdout_of(run(stub, session.id, ["cat"], stdin=b"hello\n")) == b"hello\n"
    assert stdout_of(run(stub, session.id, ["wc", "-c"])).strip() == b"0"


def test_run_stdin_larger_than_the_pipe_while_the_command_writes_first(stub: pb_grpc.SandboxStub,
                                                                      session: pb.Session) -> None:
    """3 MiB of stdin (far more than a pipe holds) to a command that writes 2 MiB before it reads:
    writing stdin inline would deadlock against the unread output; the rest goes to a thread."""
    data = os.urandom(3 << 20)
    out = stdout_of(run(stub, session.id, shell="head -c 2097152 /dev/zero; sha256sum", stdin=data))
    assert out[:2 << 20] == b"\0" * (2 << 20)
    assert out[2 << 20:].split()[0].decode() == hashlib.sha256(data).hexdigest()


def test_run_refuses_a_terminal_before_anything_is_decided(stub: pb_grpc.SandboxStub, session: pb.Session) -> None:
    before = events(stub, session.id)
    error = rpc_error(lambda: run(stub, session.id, ["true"], terminal=pb.Terminal(rows=24, columns=80)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "use Exec" in (error.details() or "") or "with Exec" in (error.details() or ""), error.details()
    assert events(stub, session.id) == before                 # nothing granted, nothing recorded
    # Control: the same terminal call through Exec runs.
    outcome = run_exec(stub, session.id, ["tty"], terminal=pb.Terminal(rows=24, columns=80), close_stdin=True)
    assert outcome.result is not None and outcome.result.exit_code == 0, outcome.describe()


def test_run_is_audited_like_exec(stub: pb_grpc.SandboxStub, session: pb.Session) -> None:
    responses = run(stub, session.id, ["sh", "-c", "exit 7"], execution_context_id="turn-run")
    assert responses[-1].result.exit_code == 7
    started = events(stub, session.id, types=["ToolInvocationStarted"])[-1]
    assert kinds(stub, session.id, started.call_id) == [
        "PermissionGranted", "ToolInvocationStarted", "ToolInvocationCompleted"]
    assert json.loads(started.data_json)["arguments"]["argv"] == ["sh", "-c", "exit 7"]
    completed = events(stub, session.id, types=["ToolInvocationCompleted"])[-1]
    assert (completed.call_id, json.loads(completed.data_json)["exit_code"]) == (started.call_id, 7)


def test_run_is_held_for_approval_and_a_denial_says_why(stub: pb_grpc.SandboxStub, ws: Path,
                                                         opened) -> None:  # type: ignore[no-untyped-def]
    session = opened(ws, workspace_write(), approval_policy=pb.ON_REQUEST)
    denied = Background(lambda: run(stub, session.id, shell="touch should-not-exist; exec true"))
    pending = wait_pending(stub, session.id)
    assert pending.tool == "shell.exec"
    resolve(stub, session.id, pending.call_id, "deny")
    with pytest.raises(grpc.RpcError) as raised:
        denied.result()
    assert raised.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert denial_of(raised.value)["by"] == "user"
    assert not (ws / "should-not-exist").exists()
    assert kinds(stub, session.id, pending.call_id) == ["PermissionRequested", "PermissionDenied"]
    # Control: allowed, the same call runs.
    allowed = Background(lambda: run(stub, session.id, shell="touch made; exec echo ran"))
    resolve(stub, session.id, wait_pending(stub, session.id).call_id, "allow")
    assert stdout_of(allowed.result()) == b"ran\n" and (ws / "made").exists()


def test_run_holds_a_call_quota_and_cancel_kills_the_tree(stub: pb_grpc.SandboxStub, session: pb.Session,
                                                         sleep_marker: str) -> None:
    def calls_held() -> int:
        return int(stub.GetStatus(pb.GetStatusRequest()).quota_usage["calls"])

    idle = calls_held()
    call = stub.Run(exec_start(session.id, shell=f"sleep 300 {sleep_marker} & sleep 300 {sleep_marker}"),
                    timeout=SAFETY_DEADLINE)
    assert next(call).WhichOneof("kind") == "started_pid"
    assert wait_marker_appears(sleep_marker)
    assert calls_held() == idle + 1                           # counted as one of the caller's running calls
    call.cancel()
    with pytest.raises(grpc.RpcError) as raised:
        list(call)
    assert raised.value.code() == grpc.StatusCode.CANCELLED
    assert wait_until_gone(sleep_marker, within=10) == []     # the background sleep too: the whole tree
    assert poll(lambda: calls_held() == idle)
    assert poll(lambda: stub.GetSession(pb.GetSessionRequest(session_id=session.id)).running_calls == 0)


OTHER_USER = r'''
def run_rpc(session_id):
    out = b""
    for r in stub.Run(pb.ExecStart(session_id=session_id, argv=["sh", "-c", "id -u; touch $0", ARGS["probe"]]),
                      timeout=120):
        out += r.stdout
    return out.decode().strip()
res = {"victim": code(lambda: run_rpc(ARGS["victim"]))}
mine = stub.CreateSession(pb.CreateSessionRequest(workspace=ARGS["own_ws"], approval_policy=pb.NEVER))
res["own"] = run_rpc(mine.id)
stub.CloseSession(pb.CloseSessionRequest(session_id=mine.id))
print(json.dumps(res))
'''


def test_another_user_cannot_run_in_a_session_that_is_not_theirs(daemon: Daemon, stub: pb_grpc.SandboxStub, ws: Path,
                                                                 sessions: list[str]) -> None:
    victim = create_session(stub, ws, workspace_write())
    sessions.append(victim.id)
    own_ws = make_dir(ws / "nobody", 0o755)
    os.chown(own_ws, NOBODY, NOBODY)
    res = run_client_as(NOBODY, NOBODY, daemon.socket, OTHER_USER, {
        "victim": victim.id, "own_ws": str(own_ws), "probe": "planted"})
    assert res["victim"] == "NOT_FOUND"
    assert not (ws / "planted").exists()
    assert kinds(stub, victim.id) == ["SessionCreated"]       # nothing asked, granted or run in it
    # Control: the same user's Run in its own session runs, as that user.
    assert res["own"] == str(NOBODY)
    assert os.stat(own_ws / "planted").st_uid == NOBODY


def test_client_exec_uses_run(daemon: Daemon, session: pb.Session) -> None:
    with SandboxClient(daemon.socket) as client:
        outcome = client.exec(session.id, ["cat"], stdin=b"via client\n")
        assert outcome.stdout == b"via client\n" and outcome.result.exit_code == 0
        assert client._run_supported                          # Run answered: no fallback was needed


class ExecOnly(pb_grpc.SandboxServicer):
    """A daemon older than Run: the generated base answers UNIMPLEMENTED for it."""

    def __init__(self) -> None:
        self.starts: list[pb.ExecStart] = []

    def Exec(self, request_iterator: Iterator[pb.ExecRequest],
             context: grpc.ServicerContext) -> Iterator[pb.ExecResponse]:
        self.starts.append(next(request_iterator).start)
        yield pb.ExecResponse(started_pid=2)
        yield pb.ExecResponse(stdout=self.starts[-1].stdin)
        yield pb.ExecResponse(result=pb.ExecResult(exit_code=0))


def test_client_falls_back_to_exec_on_a_daemon_without_run(tmp_path: Path) -> None:
    servicer = ExecOnly()
    with stand_in_daemon(servicer, tmp_path / "old.sock", workers=2) as socket, SandboxClient(socket) as client:
        first = client.exec("s1", ["cat"], stdin=b"one")
        second = client.exec("s1", ["cat"], stdin=b"two")
        assert (first.stdout, second.stdout) == (b"one", b"two")
        assert [s.stdin for s in servicer.starts] == [b"one", b"two"]   # each ran exactly once, via Exec
        assert not client._run_supported                   # asked once, then Exec directly


def test_a_run_error_other_than_unimplemented_is_not_retried(daemon: Daemon, stub: pb_grpc.SandboxStub,
                                                             ws: Path, sessions: list[str]) -> None:
    session = create_session(stub, ws, read_only())
    sessions.append(session.id)
    with SandboxClient(daemon.socket) as client:
        error = rpc_error(lambda: client.exec(session.id, ["true"], shell="true"))        # both: refused
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert client._run_supported
    assert kinds(stub, session.id) == ["SessionCreated"]       # refused before any decision

