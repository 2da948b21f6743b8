"""Background processes (monitor.start / list / stop) through a real daemon."""

from __future__ import annotations

import subprocess
import time
import uuid
from pathlib import Path

import grpc
import pytest

from daemon_fixtures import base, client  # noqa: F401 - pytest fixtures
from sandboxd.client import SandboxClient
from sandboxd.v1 import sandboxd_pb2 as pb


@pytest.fixture
def session(client: SandboxClient, base: Path, request: pytest.FixtureRequest) -> pb.Session:
    workspace = base / f"bg-{request.node.name}"
    workspace.mkdir()
    return client.create_session(str(workspace), approval="never")


def host_pids(marker: str) -> list[str]:
    return subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout.split()


def test_output_is_kept_and_followed_in_order(client: SandboxClient, session: pb.Session) -> None:
    job = client.stub.StartBackground(pb.StartBackgroundRequest(
        session_id=session.id, shell="for i in 1 2 3; do echo tick $i; sleep 0.2; done; echo done >&2",
        name="ticker"))
    assert job.running and job.pid >= 2 and job.name == "ticker"
    chunks = list(client.stub.ReadBackgroundOutput(pb.ReadBackgroundOutputRequest(
        session_id=session.id, id=job.id, follow=True)))
    assert b"".join(c.data for c in chunks) == b"tick 1\ntick 2\ntick 3\ndone\n"
    assert [c.offset for c in chunks] == sorted(c.offset for c in chunks)
    listed = client.stub.ListBackground(pb.ListBackgroundRequest(session_id=session.id)).processes
    assert [p.id for p in listed] == [job.id]
    assert not listed[0].running and listed[0].result.shell_status == 0 and listed[0].output_bytes == 26
    tail = list(client.stub.ReadBackgroundOutput(pb.ReadBackgroundOutputRequest(
        session_id=session.id, id=job.id, offset=21)))
    assert b"".join(c.data for c in tail) == b"done\n"


def test_a_dev_server_serves_other_calls_until_stopped(client: SandboxClient, session: pb.Session) -> None:
    """A server started in the background is reachable from the session's other calls (same network
    namespace); stopping it kills its whole tree."""
    marker = f"{uuid.uuid4().int % 10**9}"
    job = client.stub.StartBackground(pb.StartBackgroundRequest(
        session_id=session.id, shell=f"python3 -m http.server 8000 >/dev/null 2>&1 & sleep 300 {marker}"))
    probe = "python3 -c \"import urllib.request;print(urllib.request.urlopen('http://127.0.0.1:8000/').status)\""
    deadline = time.monotonic() + 60                    # a loaded machine starts Python slowly
    while True:
        outcome = client.exec(session.id, shell=probe)
        if outcome.stdout == b"200\n" or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert outcome.stdout == b"200\n", outcome.stderr
    assert host_pids(f"sleep 300 {marker}")
    stopped = client.stub.StopBackground(pb.StopBackgroundRequest(session_id=session.id, id=job.id))
    assert not stopped.running and stopped.result.signal == 9
    assert host_pids(f"sleep 300 {marker}") == []
    assert client.exec(session.id, shell=probe + " 2>/dev/null").stdout == b""


def test_closing_the_session_kills_background_processes(client: SandboxClient, base: Path) -> None:
    workspace = base / "bg-close"
    workspace.mkdir()
    session = client.create_session(str(workspace), approval="never")
    marker = f"{uuid.uuid4().int % 10**9}"
    client.stub.StartBackground(pb.StartBackgroundRequest(session_id=session.id, argv=["sleep", "300", marker]))
    assert host_pids(f"sleep 300 {marker}")
    client.close_session(session.id)
    assert host_pids(f"sleep 300 {marker}") == []


def test_unknown_background_process_is_not_found(client: SandboxClient, session: pb.Session) -> None:
    with pytest.raises(grpc.RpcError) as info:
        client.stub.StopBackground(pb.StopBackgroundRequest(session_id=session.id, id="nope"))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
