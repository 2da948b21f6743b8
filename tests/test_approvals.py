"""The policy engine, approvals and the audit log, end to end over gRPC with a real daemon:
calls held for approval and answered (once, for the session, denied, timed out), the alias
table, permission modes, external tools (judged by the sandbox of the session they run in, when
named), standing rules, and the event store's log (ordered,
complete, surviving a SIGKILL and a restart)."""

from __future__ import annotations

import json
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from conftest import make_dir
from daemon_helpers import (
    SAFETY_DEADLINE,
    Daemon,
    ExecCall,
    PlainUser,
    close_quietly,
    create_session,
    exec_start,
    owned_dir,
    read_only,
    rpc_error,
    run_client_as,
    run_exec,
    running_daemon,
    workspace_write,
)
from daemon_fixtures import daemon, stub, ws  # noqa: F401 - pytest fixtures
from sandboxd.service.approvals import DECISION_ALIASES
from sandboxd.v1 import sandboxd_pb2 as pb
from sandboxd.v1 import sandboxd_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def opened(stub: pb_grpc.SandboxStub) -> Iterator[Callable[..., pb.Session]]:
    """Open sessions (closed at the end): opened(ws, policy=..., approval_policy=..., **request fields)."""
    ids: list[str] = []

    def open_session(workspace: Path, policy: pb.SandboxPolicy | None = None, **kwargs: Any) -> pb.Session:
        session = create_session(stub, workspace, policy, **kwargs)
        ids.append(session.id)
        return session
    try:
        yield open_session
    finally:
        for session_id in ids:
            close_quietly(stub, session_id)


def events(stub: pb_grpc.SandboxStub, session_id: str, **filters: Any) -> list[pb.Event]:
    return list(stub.QueryEvents(pb.QueryEventsRequest(session_id=session_id, page_size=1000, **filters),
                                 timeout=SAFETY_DEADLINE).events)


def kinds(stub: pb_grpc.SandboxStub, session_id: str, call_id: str = "") -> list[str]:
    return [e.type for e in events(stub, session_id) if not call_id or e.call_id == call_id]


def wait_pending(stub: pb_grpc.SandboxStub, session_id: str, within: float = 30.0) -> pb.PendingApproval:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        pending = stub.ListPendingApprovals(pb.ListPendingApprovalsRequest(session_id=session_id)).approvals
        if pending:
            return pending[0]
        time.sleep(0.02)
    raise AssertionError("no call was held for approval")


def resolve(stub: pb_grpc.SandboxStub, session_id: str, call_id: str, decision: str) -> str:
    return stub.ResolveApproval(pb.ResolveApprovalRequest(session_id=session_id, call_id=call_id,
                                                          decision=decision)).decision


def denial_of(error: grpc.RpcError) -> dict[str, Any]:
    metadata = dict(error.trailing_metadata() or ())
    return json.loads(metadata["sandboxd-permission-denied"])


class Background:
    """Run ``fn`` in a thread; ``result()`` returns its value or raises its exception."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self._value: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self._value = fn()
        except BaseException as error:  # noqa: BLE001 - handed to the test
            self._error = error

    def result(self, within: float = 60.0) -> Any:
        self._thread.join(within)
        assert not self._thread.is_alive(), "the call never ended"
        if self._error is not None:
            raise self._error
        return self._value


# ---- held calls ---------------------------------------------------------------------------------

def test_a_held_call_runs_once_allowed(stub: pb_grpc.SandboxStub, ws: Path, opened: Callable[..., pb.Session]) -> None:
    session = opened(ws, workspace_write(), approval_policy=pb.ON_REQUEST)
    call = Background(lambda: run_exec(stub, session.id, shell="echo approved > made; echo ran",
                                       execution_context_id="turn-7/sub-2"))
    pending = wait_pending(stub, session.id)
    assert (pending.tool, pending.reason, pending.risk) == ("shell.exec", "unknown_command", "high")
    assert pending.execution_context_id == "turn-7/sub-2"
    requested = events(stub, session.id, types=["PermissionRequested"])[-1]
    assert json.loads(requested.data_json)["execution_context_id"] == "turn-7/sub-2"
    assert pending.summary == "Execute: echo approved > made; echo ran"
    assert not (ws / "made").exists()                     # held: nothing ran yet
    assert resolve(stub, session.id, pending.call_id, "approve") == "allow_once"
    outcome = call.result()
    assert outcome.stdout == b"ran\n" and (ws / "made").read_text() == "approved\n"
    assert kinds(stub, session.id, pending.call_id) == [
        "PermissionRequested", "PermissionGranted", "ToolInvocationStarted", "ToolInvocationCompleted"]
    granted = [e for e in events(stub, session.id) if e.type == "PermissionGranted"][0]
    assert json.loads(granted.data_json)["by"] == "user"
    completed = [e for e in events(stub, session.id) if e.type == "ToolInvocationCompleted"][0]
    assert json.loads(completed.data_json)["exit_code"] == 0
    # allow_once remembers nothing: the next such call is asked about again.
    again = Background(lambda: run_exec(stub, session.id, shell="echo again; exec true"))
    assert wait_pending(stub, session.id).call_id != pending.call_id
    resolve(stub, session.id, wait_pending(stub, session.id).call_id, "ok")
    assert again.result().stdout == b"again\n"


def test_allow_session_remembers_the_tool_for_that_session_only(
        stub: pb_grpc.SandboxStub, ws: Path, opened: Callable[..., pb.Session]) -> None:
    session = opened(ws, workspace_write(), approval_policy=pb.ON_REQUEST)
    first = Background(lambda: run_exec(stub, session.id, shell="echo one; exec true"))
    resolve(stub, session.id, wait_pending(stub, session.id).call_id, "always")
    assert first.result().stdout == b"one\n"
    # The same tool again: no prompt, granted by the session's memory.
    assert run_exec(stub, session.id, shell="echo two; exec true").stdout == b"two\n"
    grants = [json.loads(e.data_json)["by"] for e in events(stub, session.id, types=["PermissionGranted"])]
    assert grants == ["user", "session"]
    assert len(events(stub, session.id, types=["PermissionRequested"])) == 1
    # Another session asks again.
    other = opened(ws, workspace_write(), approval_policy=pb.ON_REQUEST)
    held = Background(lambda: run_exec(stub, other.id, shell="echo three; exec true"))
    resolve(stub, other.id, wait_pending(stub, other.id).call_id, "allow")
    assert held.result().stdout == b"three\n"


def test_a_denied_call_never_runs_and_says_why(stub: pb_grpc.SandboxStub, ws: Path,
                                               opened: Callable[..., pb.Session]) -> None:
    session = opened(ws, workspace_write(), approval_policy=pb.ON_REQUEST)
    call = Background(lambda: run_exec(stub, session.id, shell="touch should-not-exist; exec true"))
    pending = wait_pending(stub, session.id)
    assert resolve(stub, session.id, pending.call_id, "reject") == "deny"
    with pytest.raises(grpc.RpcError) as raised:
        call.result()
    error = raised.value
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED and "denied by user" in error.details()
    denial = denial_of(error)
    assert (denial["call_id"], denial["by"], denial["reason"], denial["tool"]) == (
        pending.call_id, "user", "unknown_command", "shell.exec")
    assert not (ws / "should-not-exist").exists()
    assert kinds(stub, session.id, pending.call_id) == ["PermissionRequested", "PermissionDenied"]


def test_an_unanswered_call_is_denied_at_the_timeout(ws: Path) -> None:
    with running_daemon("sbxd-timeout-") as d:
        d.stop()
        quick = Daemon(d.base, args=["--approval-timeout", "1"])
        quick.start()
        try:
            session = create_session(quick.stub, ws, workspace_write(), approval_policy=pb.ALWAYS)
            started = time.monotonic()
            error = rpc_error(lambda: run_exec(quick.stub, session.id, ["true"]))
            assert error.code() == grpc.StatusCode.PERMISSION_DENIED
            assert denial_of(error)["by"] == "timeout" and time.monotonic() - started < 30
            assert kinds(quick.stub, session.id)[-2:] == ["PermissionRequested", "PermissionDenied"]
        finally:
            quick.close()


@pytest.mark.parametrize("alias", sorted(DECISION_ALIASES))
def test_every_decision_alias(stub: pb_grpc.SandboxStub, ws: Path, opened: Callable[..., pb.Session],
                              alias: str) -> None:
    session = opened(ws, workspace_write(), approval_policy=pb.ALWAYS)
    call = Background(lambda: stub.ReadFile(pb.ReadFileRequest(session_id=session.id, path="f")))
    (ws / "f").write_text("data")
    assert resolve(stub, session.id, wait_pending(stub, session.id).call_id, alias.upper()) == DECISION_ALIASES[alias]
    if DECISION_ALIASES[alias] == "deny":
        with pytest.raises(grpc.RpcError):
            call.result()
    else:
        assert call.result().data == b"data"


def test_an_unknown_decision_is_invalid_and_leaves_the_call_held(
        stub: pb_grpc.SandboxStub, ws: Path, opened: Callable[..., pb.Session]) -> None:
    session = opened(ws, workspace_write(), approval_policy=pb.ALWAYS)
    call = Background(lambda: stub.ListDir(pb.ListDirRequest(session_id=session.id)))
    pending = wait_pending(stub, session.id)
    error = rpc_error(lambda: resolve(stub, session.id, pending.call_id, "maybe"))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "allow_once" in error.details()
    missing = rpc_error(lambda: resolve(stub, session.id, "call_nope", "allow"))
    assert missing.code() == grpc.StatusCode.NOT_FOUND
    resolve(stub, session.id, pending.call_id, "allow_once")
    assert call.result() is not None


def test_an_approved_call_is_not_revoked_by_a_later_policy_change(
        stub: pb_grpc.SandboxStub, ws: Path, opened: Callable[..., pb.Session]) -> None:
    session = opened(ws, workspace_write(), approval_policy=pb.ON_REQUEST)
    running = ExecCall(stub, exec_start(session.id, shell="read go; echo finished > late; echo ok"))
    resolve(stub, session.id, wait_pending(stub, session.id).call_id, "allow")
    running.wait_started()
    # Both axes tightened while it runs: read-only, and ask for everything.
    stub.UpdateSessionPolicy(pb.UpdateSessionPolicyRequest(session_id=session.id, sandbox_policy=read_only(),
                                                           approval_policy=pb.ALWAYS))
    running.send_stdin(b"go\n")
    outcome = running.finish()
    assert outcome.result is not None and outcome.result.exit_code == 0, outcome.describe()
    assert (ws / "late").read_text() == "finished\n"      # it kept the sandbox it was approved in
    log = kinds(stub, session.id)
    assert log[-2:] == ["PolicyChanged", "ToolInvocationCompleted"], log
    # The next call meets the new policy.
    error = rpc_error(lambda: stub.WriteFile(pb.WriteFileRequest(session_id=session.id, path="y", data=b"y")))
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED and denial_of(error)["by"] == "sandbox"


# ---- the sandbox is structural ------------------------------------------------------------------

def test_approving_a_write_under_read_only_does_not_unlock_it(
        stub: pb_grpc.SandboxStub, ws: Path, opened: Callable[..., pb.Session]) -> None:
    session = opened(ws, read_only(), approval_policy=pb.ALWAYS)
    # A file write: denied by the sandbox at once, never even asked about.
    error = rpc_error(lambda: stub.WriteFile(pb.WriteFileRequest(session_id=session.id, path="x", data=b"x")))
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED and denial_of(error)["by"] == "sandbox"
    assert "read-only" in error.details()
    assert not events(stub, session.id, types=["PermissionRequested"])
    # A shell command that writes: the engine cannot tell, asks, the user approves ... and the
    # kernel still refuses the write.
    call = Background(lambda: run_exec(stub, session.id, shell="echo x > written; echo status=$?"))
    resolve(stub, session.id, wait_pending(stub, session.id).call_id, "allow_session")
    outcome = call.result()
    assert b"status=2" in outcome.stdout or b"status=1" in outcome.stdout, outcome.describe()
    assert b"Read-only file system" in outcome.stderr and not (ws / "written").exists()


def test_a_destructive_write_is_denied_with_its_path(stub: pb_grpc.SandboxStub, ws: Path, daemon: Daemon,
                                                     opened: Callable[..., pb.Session]) -> None:
    session = opened(ws, workspace_write(), approval_policy=pb.NEVER)
    outside = make_dir(daemon.base / f"outside-{uuid.uuid4().hex[:6]}")
    error = rpc_error(lambda: stub.WriteFile(pb.WriteFileRequest(session_id=session.id, path=str(outside / "x"),
                                                                 data=b"x")))
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED and "outside the workspace" in error.details()
    denied = events(stub, session.id, types=["PermissionDenied"])[-1]
    data = json.loads(denied.data_json)
    assert (data["effect"], data["reason"], data["by"]) == ("destructive", "sandbox_rejected", "sandbox")
    assert not (outside / "x").exists()


# ---- permission modes ---------------------------------------------------------------------------

def tool_names(stub: pb_grpc.SandboxStub, session_id: str) -> set[str]:
    return {t.name for t in stub.ListTools(pb.ListToolsRequest(session_id=session_id)).tools}


def test_read_only_mode_hides_and_refuses_writes_and_execution(
        stub: pb_grpc.SandboxStub, ws: Path, opened: Callable[..., pb.Session]) -> None:
    session = opened(ws, permission_mode="readonly")
    assert session.permission_mode == "read_only" and session.sandbox_policy.mode == pb.SandboxPolicy.READ_ONLY
    names = tool_names(stub, session.id)
    assert {"fs.read", "fs.list", "search", "monitor.list"} <= names
    assert not names & {"fs.write", "patch.apply", "shell.exec", "monitor.start"}
    for refused in (lambda: run_exec(stub, session.id, ["ls"]),
                    lambda: stub.WriteFile(pb.WriteFileRequest(session_id=session.id, path="x", data=b"x"))):
        error = rpc_error(refused)
        assert error.code() == grpc.StatusCode.PERMISSION_DENIED and "permission mode read_only" in error.details()
    (ws / "r").write_text("readable")
    assert stub.ReadFile(pb.ReadFileRequest(session_id=session.id, path="r")).data == b"readable"


def test_auto_mode_asks_for_writes_but_not_reads(stub: pb_grpc.SandboxStub, ws: Path,
                                                 opened: Callable[..., pb.Session]) -> None:
    session = opened(ws, permission_mode="auto")
    assert tool_names(stub, session.id) >= {"fs.write", "shell.exec"}
    (ws / "r").write_text("readable")
    assert stub.ReadFile(pb.ReadFileRequest(session_id=session.id, path="r")).data == b"readable"
    write = Background(lambda: stub.WriteFile(pb.WriteFileRequest(session_id=session.id, path="w", data=b"w")))
    pending = wait_pending(stub, session.id)
    assert (pending.tool, pending.reason) == ("fs.write", "policy_always")
    resolve(stub, session.id, pending.call_id, "allow")
    write.result()
    assert (ws / "w").read_text() == "w"


@pytest.mark.parametrize("mode", ["full", "full_access", "", "nonsense"])
def test_full_mode_asks_nothing(stub: pb_grpc.SandboxStub, ws: Path, opened: Callable[..., pb.Session],
                                mode: str) -> None:
    session = opened(ws, permission_mode=mode or "something-new") if mode else opened(
        ws, allow_shell=True, allow_file_write=True)
    assert session.permission_mode == "full" and session.approval_policy == pb.NEVER
    assert session.sandbox_policy.mode == pb.SandboxPolicy.WORKSPACE_WRITE   # full never drops the kernel sandbox
    assert run_exec(stub, session.id, shell="echo free; true").stdout == b"free\n"


def test_legacy_fields_win_over_permission_mode(stub: pb_grpc.SandboxStub, ws: Path,
                                                opened: Callable[..., pb.Session]) -> None:
    session = opened(ws, permission_mode="full", allow_shell=False, allow_file_write=False)
    assert session.permission_mode == "read_only"
    assert "shell.exec" not in tool_names(stub, session.id)
    shell_only = opened(ws, permission_mode="read_only", allow_shell=True, allow_file_write=False)
    assert "shell.exec" in tool_names(stub, shell_only.id) and "fs.write" not in tool_names(stub, shell_only.id)
    assert shell_only.sandbox_policy.mode == pb.SandboxPolicy.READ_ONLY


# ---- external tools -----------------------------------------------------------------------------

def test_external_tools_go_through_the_same_flow(stub: pb_grpc.SandboxStub, ws: Path,
                                                  opened: Callable[..., pb.Session]) -> None:
    session = opened(ws, workspace_write(), approval_policy=pb.ON_REQUEST)
    # Declared read-only, from a trusted server: allowed at once.
    quick = stub.Authorize(pb.AuthorizeRequest(session_id=session.id, tool="docs.lookup",
                                               effect=pb.EFFECT_READ_ONLY, mcp_server="docs", server_trusted=True))
    assert quick.allowed and quick.granted_by == "policy"
    stub.ReportToolResult(pb.ReportToolResultRequest(session_id=session.id, call_id=quick.call_id, ok=True,
                                                     result_json='{"hits": 3}'))
    # No declared effect: the unknown-command reason; approved by a person.
    held = Background(lambda: stub.Authorize(pb.AuthorizeRequest(
        session_id=session.id, tool="browser.action", command="click #submit", arguments_json='{"x": 1}')))
    pending = wait_pending(stub, session.id)
    assert (pending.tool, pending.reason, pending.summary) == ("browser.action", "unknown_command",
                                                               "Execute: click #submit")
    resolve(stub, session.id, pending.call_id, "allow")
    answer = held.result()
    assert answer.allowed and answer.granted_by == "user" and answer.reason == "unknown_command"
    stub.ReportToolResult(pb.ReportToolResultRequest(session_id=session.id, call_id=answer.call_id, ok=False,
                                                     error="element not found"))
    assert kinds(stub, session.id, answer.call_id) == [
        "PermissionRequested", "PermissionGranted", "ToolInvocationStarted", "ToolInvocationFailed"]
    # A second report for the same call is refused.
    twice = rpc_error(lambda: stub.ReportToolResult(pb.ReportToolResultRequest(
        session_id=session.id, call_id=answer.call_id, ok=True)))
    assert twice.code() == grpc.StatusCode.NOT_FOUND
    # An untrusted server is asked about even for a read; a denial is an answer, not an error.
    untrusted = Background(lambda: stub.Authorize(pb.AuthorizeRequest(
        session_id=session.id, tool="files.peek", effect=pb.EFFECT_READ_ONLY, mcp_server="random")))
    pending = wait_pending(stub, session.id)
    assert pending.reason == "untrusted_mcp_server"
    resolve(stub, session.id, pending.call_id, "deny")
    refused = untrusted.result()
    assert not refused.allowed and refused.denied.by == "user" and "denied by user" in refused.denied.message
    # What the sandbox rules out stays out: network with the network off.
    blocked = stub.Authorize(pb.AuthorizeRequest(session_id=session.id, tool="http.get", effect=pb.EFFECT_NETWORK))
    assert not blocked.allowed and blocked.denied.by == "sandbox" and blocked.denied.reason == "sandbox_rejected"
    bad = rpc_error(lambda: stub.Authorize(pb.AuthorizeRequest(session_id=session.id, tool="shell.exec")))
    assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_authorize_judges_the_effect_by_the_session_the_tool_runs_in(stub: pb_grpc.SandboxStub, ws: Path,
                                                                      opened: Callable[..., pb.Session]) -> None:
    """runs_in_session_id (an MCP gateway's upstream server in a session of its own): the effect is judged
    against that session's sandbox; approval, the held call and the audit stay the gateway session's."""
    gateway = opened(ws, workspace_write(), approval_policy=pb.ON_REQUEST)          # no network
    upstream = opened(ws, workspace_write(network_access=True), approval_policy=pb.NEVER)

    def authorize(effect: int, runs_in: str = "") -> pb.AuthorizeResponse:
        return stub.Authorize(pb.AuthorizeRequest(session_id=gateway.id, tool="github__create_issue", effect=effect,
                                                  mcp_server="github", server_trusted=True,
                                                  runs_in_session_id=runs_in), timeout=SAFETY_DEADLINE)

    # The control: judged by the gateway's own sandbox, the network is off.
    control = authorize(pb.EFFECT_NETWORK)
    assert not control.allowed and control.denied.reason == "sandbox_rejected", control
    # Where it runs the network is on: asked as a network request (the gateway's approval policy),
    # held on the gateway's session, not the upstream's.
    held = Background(lambda: authorize(pb.EFFECT_NETWORK, upstream.id))
    pending = wait_pending(stub, gateway.id)
    assert (pending.tool, pending.reason) == ("github__create_issue", "network_request")
    assert not stub.ListPendingApprovals(pb.ListPendingApprovalsRequest(session_id=upstream.id)).approvals
    resolve(stub, gateway.id, pending.call_id, "allow")
    answer = held.result()
    assert answer.allowed and answer.granted_by == "user" and answer.reason == "network_request", answer
    stub.ReportToolResult(pb.ReportToolResultRequest(session_id=gateway.id, call_id=answer.call_id, ok=True))
    recorded = {e.type: json.loads(e.data_json) for e in events(stub, gateway.id) if e.call_id == answer.call_id}
    assert recorded["PermissionRequested"]["runs_in_session"] == upstream.id
    assert recorded["PermissionGranted"]["runs_in_session"] == upstream.id
    assert "runs_in_session" not in json.loads(events(stub, gateway.id, types=["PermissionDenied"])[0].data_json)
    assert not events(stub, upstream.id, types=["PermissionRequested", "PermissionGranted", "PermissionDenied"])
    # Destructive stays sandbox_rejected unless the sandbox it runs in is danger-full-access; the
    # denial says whose sandbox, and is recorded with it.
    destructive = authorize(pb.EFFECT_DESTRUCTIVE, upstream.id)
    assert not destructive.allowed and destructive.denied.reason == "sandbox_rejected", destructive
    assert upstream.id in destructive.denied.detail
    denied = [json.loads(e.data_json) for e in events(stub, gateway.id, types=["PermissionDenied"])
              if e.call_id == destructive.call_id]
    assert denied and denied[0]["runs_in_session"] == upstream.id
    # A session that is not there is NOT_FOUND, not a silent judgement by the gateway's sandbox.
    missing = rpc_error(lambda: authorize(pb.EFFECT_NETWORK, "sess_nonexistent"))
    assert missing.code() == grpc.StatusCode.NOT_FOUND


RUNS_IN_AS_USER = r'''
def session():
    return stub.CreateSession(pb.CreateSessionRequest(workspace=ARGS["ws"], approval_policy=pb.NEVER,
        sandbox_policy=pb.SandboxPolicy(mode=pb.SandboxPolicy.WORKSPACE_WRITE, network_access=True)), timeout=60)
gateway, own = session(), session()
def authorize(runs_in):
    return stub.Authorize(pb.AuthorizeRequest(session_id=gateway.id, tool="up__get", effect=pb.EFFECT_NETWORK,
                                              runs_in_session_id=runs_in), timeout=60)
out = {"others": code(lambda: authorize(ARGS["other"])), "own": authorize(own.id).allowed}
for sid in (gateway.id, own.id):
    stub.CloseSession(pb.CloseSessionRequest(session_id=sid), timeout=60)
print(json.dumps(out))
'''


def test_runs_in_another_owners_session_is_not_found(daemon: Daemon, stub: pb_grpc.SandboxStub, ws: Path,
                                                      opened: Callable[..., pb.Session],
                                                      plain_users: Callable[[int], list[PlainUser]]) -> None:
    """A plain user may name only a session of its own as where its tool runs (control: its own is allowed)."""
    root_session = opened(ws, workspace_write(network_access=True), approval_policy=pb.NEVER)
    (user,) = plain_users(1)
    user_ws = owned_dir(daemon.base / f"runs-in-{uuid.uuid4().hex[:8]}", user)
    seen = run_client_as(user.uid, user.gid, daemon.socket, RUNS_IN_AS_USER,
                         {"ws": str(user_ws), "other": root_session.id})
    assert seen == {"others": "NOT_FOUND", "own": True}, seen


# ---- standing rules -----------------------------------------------------------------------------

def test_standing_rules_allow_a_tool_in_a_workspace(stub: pb_grpc.SandboxStub, ws: Path,
                                                    opened: Callable[..., pb.Session]) -> None:
    session = opened(ws, workspace_write(), approval_policy=pb.ALWAYS)
    rule = stub.AddStandingRule(pb.StandingRule(workspace=str(ws), tool="fs.list"))
    assert rule.tool == "fs.list" and rule.created_at > 0
    assert [(r.workspace, r.tool) for r in stub.ListStandingRules(
        pb.ListStandingRulesRequest(workspace=str(ws))).rules] == [(str(ws), "fs.list")]
    stub.ListDir(pb.ListDirRequest(session_id=session.id))            # not held: the rule answers
    granted = events(stub, session.id, types=["PermissionGranted"])[-1]
    assert json.loads(granted.data_json)["by"] == "workspace_rule"
    assert stub.RemoveStandingRule(pb.StandingRule(workspace=str(ws), tool="fs.list")).removed
    held = Background(lambda: stub.ListDir(pb.ListDirRequest(session_id=session.id)))
    resolve(stub, session.id, wait_pending(stub, session.id).call_id, "deny")
    with pytest.raises(grpc.RpcError):
        held.result()


# ---- the event log ------------------------------------------------------------------------------

def test_watch_events_switches_from_past_to_live_without_gap_or_duplicate(
        stub: pb_grpc.SandboxStub, ws: Path, opened: Callable[..., pb.Session], daemon: Daemon) -> None:
    session = opened(ws, workspace_write(), approval_policy=pb.NEVER)
    for i in range(5):
        stub.ListDir(pb.ListDirRequest(session_id=session.id))
    seen: list[pb.Event] = []
    watch = daemon.stub.WatchEvents(pb.WatchEventsRequest(session_id=session.id))
    def read() -> None:
        try:
            for event in watch:
                seen.append(event)
        except grpc.RpcError as error:
            assert error.code() == grpc.StatusCode.CANCELLED      # ended by watch.cancel() below
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    for i in range(20):                                   # appends racing the switch to live
        stub.ListDir(pb.ListDirRequest(session_id=session.id))
    deadline = time.monotonic() + 30
    total = len(events(stub, session.id))
    while len(seen) < total and time.monotonic() < deadline:
        time.sleep(0.05)
    watch.cancel()
    assert [e.sequence for e in seen] == list(range(1, total + 1))
    assert [e.id for e in seen] == [e.id for e in events(stub, session.id)]
    # From a sequence on: only what comes after it.
    later = daemon.stub.WatchEvents(pb.WatchEventsRequest(session_id=session.id, from_sequence=total - 2,
                                                          types=["ToolInvocationCompleted"]))
    first = next(iter(later))
    later.cancel()
    assert first.sequence > total - 2 and first.type == "ToolInvocationCompleted"


def test_query_events_filters_and_pages(stub: pb_grpc.SandboxStub, ws: Path,
                                        opened: Callable[..., pb.Session]) -> None:
    session = opened(ws, workspace_write(), approval_policy=pb.NEVER)
    before = time.time()
    for _ in range(3):
        stub.ListDir(pb.ListDirRequest(session_id=session.id))
    run_exec(stub, session.id, ["true"])
    lists = events(stub, session.id, tool="fs.list", types=["ToolInvocationStarted"])
    assert len(lists) == 3 and all(e.tool == "fs.list" for e in lists)
    assert len(events(stub, session.id, since=before, tool="shell.exec")) == 3   # granted, started, completed
    pages, token = [], ""
    while True:
        page = stub.QueryEvents(pb.QueryEventsRequest(session_id=session.id, page_size=4, page_token=token))
        pages.append([e.sequence for e in page.events])
        token = page.next_page_token
        if not token:
            break
    flat = [s for page in pages for s in page]
    assert flat == list(range(1, len(events(stub, session.id)) + 1)) and max(len(p) for p in pages) == 4
    assert rpc_error(lambda: stub.QueryEvents(pb.QueryEventsRequest(types=["Nope"]))).code() == \
        grpc.StatusCode.INVALID_ARGUMENT


def test_the_log_is_complete_and_ordered_after_sigkill_and_restart(ws: Path) -> None:
    with running_daemon("sbxd-crash-") as d:
        session = create_session(d.stub, ws, workspace_write(), approval_policy=pb.NEVER,
                                 labels={"purpose": "crash test"})
        assert run_exec(d.stub, session.id, ["echo", "done"]).stdout == b"done\n"
        d.stub.UpdateSessionPolicy(pb.UpdateSessionPolicyRequest(session_id=session.id, approval_policy=pb.ALWAYS))
        d.stub.UpdateSessionPolicy(pb.UpdateSessionPolicyRequest(session_id=session.id, approval_policy=pb.NEVER))
        running = ExecCall(d.stub, exec_start(session.id, ["sleep", "300"]))
        running.wait_started()
        assert d.stop(signal.SIGKILL) == -signal.SIGKILL
        running.close()
        again = Daemon(d.base)
        again.start()
        try:
            log = events(again.stub, session.id)
            assert [e.sequence for e in log] == list(range(1, len(log) + 1))
            assert [e.type for e in log] == [
                "SessionCreated",
                "PermissionGranted", "ToolInvocationStarted", "ToolInvocationCompleted",     # echo done
                "PolicyChanged", "PolicyChanged",
                "PermissionGranted", "ToolInvocationStarted",                                # the killed sleep
            ]
            assert json.loads(log[0].data_json)["labels"] == {"purpose": "crash test"}
            assert json.loads(log[-1].data_json)["arguments"]["argv"] == ["sleep", "300"]
            # The session itself is back, and resumes (its sandbox rebuilt) on its next call.
            resumed = again.stub.GetSession(pb.GetSessionRequest(session_id=session.id))
            assert not resumed.sandbox_ready and resumed.approval_policy == pb.NEVER
            assert run_exec(again.stub, session.id, ["echo", "resumed"]).stdout == b"resumed\n"
            again.stub.CloseSession(pb.CloseSessionRequest(session_id=session.id))
            closed = again.stub.ListSessions(pb.ListSessionsRequest(include_closed=True)).sessions
            assert [s.closed_at > 0 for s in closed if s.id == session.id] == [True]
            assert events(again.stub, session.id)[-1].type == "SessionClosed"
        finally:
            again.close()


def test_events_of_other_users_sessions_stay_hidden(daemon: Daemon, ws: Path,
                                                    opened: Callable[..., pb.Session]) -> None:
    from daemon_helpers import run_client_as

    session = opened(ws, workspace_write(), approval_policy=pb.NEVER)
    body = """
res = {}
res["query"] = code(lambda: stub.QueryEvents(pb.QueryEventsRequest(session_id=ARGS["sid"])))
res["all"] = len(stub.QueryEvents(pb.QueryEventsRequest()).events)
res["resolve"] = code(lambda: stub.ResolveApproval(pb.ResolveApprovalRequest(
    session_id=ARGS["sid"], call_id="x", decision="allow")))
print(json.dumps(res))
"""
    res = run_client_as(65534, 65534, daemon.socket, body, {"sid": session.id})
    assert res == {"query": "NOT_FOUND", "all": 0, "resolve": "NOT_FOUND"}
