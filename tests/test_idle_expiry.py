"""sessions.idle_expiry_seconds and quotas.root_sessions on a real daemon: an idle session is
closed with an audit event saying why, one with a running call or background process is not (until
it is idle); root's own sessions are held to a quota of their own."""

from __future__ import annotations

import json
import time

import grpc

from daemon_helpers import DaemonFactory, create_session, rpc_error
from sandboxd.v1 import sandboxd_pb2 as pb
from sandboxd.v1 import sandboxd_pb2_grpc as pb_grpc
from test_call_results import OpenExec

WAIT = 60.0          # the longest the tests wait for the daemon's sweep (it looks every half second here)


def is_open(stub: pb_grpc.SandboxStub, session_id: str) -> bool:
    try:
        stub.GetSession(pb.GetSessionRequest(session_id=session_id))
        return True
    except grpc.RpcError as error:
        assert error.code() == grpc.StatusCode.NOT_FOUND, error
        return False


def wait_closed(stub: pb_grpc.SandboxStub, session_id: str) -> None:
    deadline = time.monotonic() + WAIT
    while is_open(stub, session_id):
        assert time.monotonic() < deadline, f"session {session_id} was never closed as idle"
        time.sleep(0.2)


def close_reason(stub: pb_grpc.SandboxStub, session_id: str) -> str:
    closed = stub.QueryEvents(pb.QueryEventsRequest(session_id=session_id, types=["SessionClosed"])).events
    assert len(closed) == 1, closed
    return str(json.loads(closed[0].data_json).get("reason"))


def test_idle_sessions_are_closed_and_busy_ones_are_not(sandboxd_daemon: DaemonFactory) -> None:
    daemon = sandboxd_daemon(config="[sessions]\nidle_expiry_seconds = 1\n")
    stub = daemon.stub
    idle, calling, background = (create_session(stub, sandboxd_daemon.workspace()).id for _ in range(3))
    call = OpenExec(stub, calling, "echo begun; cat > /dev/null")
    assert next(call.responses).call_id and next(call.responses).stdout == b"begun\n"
    job = stub.StartBackground(pb.StartBackgroundRequest(session_id=background, argv=["sleep", "600"]))
    wait_closed(stub, idle)
    assert close_reason(stub, idle) == "idle_expiry"
    # The sweep that closed the idle one judged the busy ones too (made before it): still open.
    assert is_open(stub, calling) and is_open(stub, background)
    # Once their work ends they are idle too, and go the same way.
    call.close_stdin()
    assert call.rest()[-1].result.exit_code == 0
    stub.StopBackground(pb.StopBackgroundRequest(session_id=background, id=job.id))
    for session in (calling, background):
        wait_closed(stub, session)
        assert close_reason(stub, session) == "idle_expiry"


def test_roots_sessions_have_a_quota_of_their_own(sandboxd_daemon: DaemonFactory) -> None:
    daemon = sandboxd_daemon(config="[quotas]\nroot_sessions = 2\nsessions_per_uid = 1\n")
    first, _second = (create_session(daemon.stub, sandboxd_daemon.workspace()).id for _ in range(2))
    refused = rpc_error(lambda: create_session(daemon.stub, sandboxd_daemon.workspace()))
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "quotas.root_sessions" in (refused.details() or "") and "2 open sessions" in (refused.details() or "")
    # The control: one closed, one more may be made.
    daemon.stub.CloseSession(pb.CloseSessionRequest(session_id=first))
    create_session(daemon.stub, sandboxd_daemon.workspace())
