"""The operations metrics, counted by a real daemon and read by scraping it: quota refusals by
quota, fork server restarts, session build time, session churn by reason, OOM kills, call
timeouts, sandboxd_build_info; and no caller-chosen string as a label value. Each count is read
before (0, the control) and after the thing it counts."""

from __future__ import annotations

import os
import platform
import signal
import socket
import sys
import urllib.request
from pathlib import Path

import pytest

from conftest import eventually
from daemon_helpers import (Daemon, DaemonFactory, PlainUser, create_session, owned_dir, read_only, run_client_as,
                            run_exec, workspace_write)
from sandboxd import __version__
from sandboxd.v1 import sandboxd_pb2 as pb

pytestmark = pytest.mark.timeout(240)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def scraped(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


@pytest.fixture
def daemon(sandboxd_daemon: DaemonFactory) -> tuple[Daemon, int]:
    port = free_port()
    return sandboxd_daemon(args=["--metrics", f"127.0.0.1:{port}"], config="[quotas]\nsessions_per_uid = 1\n"), port


def test_build_info_and_session_churn_and_build_time(daemon: tuple[Daemon, int], sandboxd_daemon: DaemonFactory) -> None:
    d, port = daemon
    before = scraped(port)
    info = (f'sandboxd_build_info{{kernel="{platform.release()}",python="{platform.python_version()}",'
            f'version="{__version__}"}}')
    assert before[info] == 1, sorted(before)
    assert before["sandboxd_sessions_created_total"] == 0 and before["sandboxd_session_build_seconds_count"] == 0
    workspace = sandboxd_daemon.workspace()
    first = create_session(d.stub, workspace, read_only())
    create_session(d.stub, workspace, read_only())
    d.stub.CloseSession(pb.CloseSessionRequest(session_id=first.id))
    after = scraped(port)
    assert after["sandboxd_sessions_created_total"] == 2
    assert after['sandboxd_sessions_closed_total{reason="client"}'] == 1
    assert after["sandboxd_session_build_seconds_count"] == 2 and after["sandboxd_session_build_seconds_sum"] > 0


def test_timeouts_and_oom_kills_are_counted(daemon: tuple[Daemon, int], sandboxd_daemon: DaemonFactory) -> None:
    d, port = daemon
    assert scraped(port).get('sandboxd_call_timeouts_total{tool="shell.exec"}', 0) == 0
    assert scraped(port)["sandboxd_oom_kills_total"] == 0
    session = create_session(d.stub, sandboxd_daemon.workspace(), read_only(),
                             limits=pb.Limits(memory_bytes=64 << 20))
    timed = run_exec(d.stub, session.id, ["sleep", "30"], timeout_seconds=1).result
    assert timed.timed_out
    oom = run_exec(d.stub, session.id, [sys.executable, "-c", "b = bytearray(256 << 20)\n"
                                        "for i in range(0, len(b), 4096): b[i] = 1"]).result
    assert oom.oom_killed, oom
    after = scraped(port)
    assert after['sandboxd_call_timeouts_total{tool="shell.exec"}'] == 1
    assert after["sandboxd_oom_kills_total"] == 1


def test_quota_refusals_are_counted_by_quota(daemon: tuple[Daemon, int], plain_users, base_dir: Path) -> None:
    d, port = daemon
    assert 'sandboxd_quota_refusals_total{quota="quotas.sessions_per_uid"}' not in scraped(port)
    user: PlainUser = plain_users(1)[0]
    workspace = owned_dir(base_dir / "alice-ws", user)
    out = run_client_as(user.uid, user.gid, d.socket, """
first = stub.CreateSession(pb.CreateSessionRequest(workspace=ARGS["ws"], approval_policy=pb.NEVER))
second = code(lambda: stub.CreateSession(pb.CreateSessionRequest(workspace=ARGS["ws"], approval_policy=pb.NEVER)))
stub.CloseSession(pb.CloseSessionRequest(session_id=first.id))
print(json.dumps({"second": second}))
""", {"ws": str(workspace)})
    assert out["second"] == "RESOURCE_EXHAUSTED"
    assert scraped(port)['sandboxd_quota_refusals_total{quota="quotas.sessions_per_uid"}'] == 1


def test_a_fork_server_restart_is_counted(daemon: tuple[Daemon, int]) -> None:
    d, port = daemon
    assert scraped(port)["sandboxd_fork_server_restarts_total"] == 0
    first = d.fork_server_pid()
    assert first is not None
    os.kill(first, signal.SIGKILL)
    assert eventually(lambda: scraped(port)["sandboxd_fork_server_restarts_total"] == 1, within=60)
    assert d.fork_server_pid() not in (None, first)


def test_a_tool_a_caller_names_is_no_label(daemon: tuple[Daemon, int], sandboxd_daemon: DaemonFactory) -> None:
    """Before: each tool name an Authorize named became a series of sandboxd_tool_calls_total, held
    for the daemon's life: a caller could grow the daemon's memory and every scrape without bound."""
    d, port = daemon
    session = create_session(d.stub, sandboxd_daemon.workspace(), workspace_write())
    names = [f"caller.tool{n}" for n in range(5)] + ['x"} sandboxd_fake 1\n']
    for name in names:
        granted = d.stub.Authorize(pb.AuthorizeRequest(session_id=session.id, tool=name, effect=pb.EFFECT_READ_ONLY,
                                                       mcp_server="docs", server_trusted=True))
        assert granted.allowed
        d.stub.ReportToolResult(pb.ReportToolResultRequest(session_id=session.id, call_id=granted.call_id, ok=True))
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    assert "caller.tool" not in text and "sandboxd_fake" not in text, text
    assert scraped(port)['sandboxd_tool_calls_total{outcome="completed",tool="external"}'] == len(names)
