"""`sandboxd mcp`'s sessions (issue 24, items 7/9 and a newcomer defect): they end with the server
process however it ends, HTTP sessions never ended by their client expire, every session of a
server shares one event watch, the Unix-socket transport takes a port-less Host, and a tool the
list hides is refused when called anyway.

Each against a real daemon, with the attack it closes and a control: a client process that did not
ask for close_with_caller leaves its sessions open when killed, until the user's quota is gone."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mcp_types as types
import pytest

from conftest import SLOW
from daemon_fixtures import client, daemon, ws  # noqa: F401 - pytest fixtures
from daemon_helpers import Daemon, DaemonFactory, PlainUser, run_client_as
from mcp_helpers import decide, http_client, http_server, mcp_client, server_params, structured, text, tool_names
from sandboxd.client import SandboxClient
from sandboxd.v1 import sandboxd_pb2 as pb

pytestmark = pytest.mark.timeout(int(600 * SLOW))
READ_ONLY_TOOLS = ["read_file", "list_dir", "search", "list_processes", "read_process_output", "stop_process"]


def wait_until(what: Callable[[], Any], why: str, within: float = 60.0) -> Any:
    """``what()`` once it is true; fails after ``within`` seconds (scaled), saying ``why``: a bound
    on a hung test, never a judgement of speed."""
    deadline = time.monotonic() + within * SLOW
    while not (found := what()):
        assert time.monotonic() < deadline, why
        time.sleep(0.05)
    return found


def sessions_on(client: SandboxClient, workspace: Path, *, include_closed: bool = False) -> list[pb.Session]:
    return [s for s in client.stub.ListSessions(pb.ListSessionsRequest(include_closed=include_closed)).sessions
            if s.workspace == str(workspace)]


def start_stdio(daemon: Daemon, workspace: Path, *flags: str, as_user: PlainUser | None = None) -> subprocess.Popen[bytes]:
    params = server_params(daemon.socket, workspace, *flags,
                           as_user=(as_user.uid, as_user.gid) if as_user else None)
    return subprocess.Popen([params.command, *params.args], env=params.env, cwd="/", stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)


def kill(process: subprocess.Popen[Any]) -> None:
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=60)


def test_a_killed_server_leaves_no_session_open(daemon: Daemon, ws: Path, client: SandboxClient) -> None:  # noqa: F811
    """SIGKILL of `sandboxd mcp` (nothing of it runs to close anything): the daemon closes its
    session itself, and says why. Control: a client of the daemon killed the same way, whose
    session did not ask for close_with_caller, leaves it open."""
    control_ws = ws.parent / f"{ws.name}-control"
    control_ws.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, daemon.socket, str(control_ws)],
                              stdout=subprocess.PIPE, text=True, cwd="/")
    assert holder.stdout is not None
    control_id = holder.stdout.readline().strip()
    server = start_stdio(daemon, ws, "--approval", "never")
    (session,) = wait_until(lambda: sessions_on(client, ws), "sandboxd mcp opened no session")
    assert session.labels["sandboxd.closes-with"].split(":")[1] == str(server.pid)
    kill(server)
    kill(holder)
    wait_until(lambda: not sessions_on(client, ws), "the killed server's session stayed open")
    # The session leaves the table before its closing event is written: wait for the event too.
    closed = wait_until(lambda: client.stub.QueryEvents(pb.QueryEventsRequest(
        session_id=session.id, types=["SessionClosed"])).events, "no SessionClosed event for the killed server's session")
    assert "the process that created it exited" in json.loads(closed[0].data_json)["reason"], closed
    # The control's process died at the same moment; its session is still there.
    assert [s.id for s in sessions_on(client, control_ws)] == [control_id]
    client.stub.CloseSession(pb.CloseSessionRequest(session_id=control_id))


# A client of the daemon that opens a session without close_with_caller, says its id, and waits.
HOLDER = """
import sys, time, grpc
from sandboxd.v1 import sandboxd_pb2 as pb, sandboxd_pb2_grpc as pb_grpc
stub = pb_grpc.SandboxStub(grpc.insecure_channel("unix:" + sys.argv[1]))
session = stub.CreateSession(pb.CreateSessionRequest(workspace=sys.argv[2], approval_policy=pb.NEVER))
print(session.id, flush=True)
time.sleep(3600)
"""


def test_kills_no_longer_use_up_the_users_sessions(sandboxd_daemon: DaemonFactory,
                                                   plain_users: Callable[[int], list[PlainUser]]) -> None:
    """The attack of round 4: each killed `sandboxd mcp` left a session, and after
    quotas.sessions_per_uid kills (64 by default; 3 here) the user's MCP stopped working. Now
    five servers killed in turn leave nothing, and the next one serves. Control: clients killed
    without close_with_caller use the quota up, and the next CreateSession is RESOURCE_EXHAUSTED."""
    d = sandboxd_daemon(config="[quotas]\nsessions_per_uid = 3\n")
    (user,) = plain_users(1)
    workspace = d.base / "ws-user"
    workspace.mkdir()
    os.chown(workspace, user.uid, user.gid)
    with SandboxClient(d.socket) as root:
        for _ in range(5):
            server = start_stdio(d, workspace, "--approval", "never", as_user=user)
            wait_until(lambda: sessions_on(root, workspace), "sandboxd mcp opened no session")
            kill(server)
            wait_until(lambda: not sessions_on(root, workspace), "the killed server's session stayed open")

        async def list_tools() -> list[str]:
            async with asyncio.timeout(120 * SLOW):
                async with mcp_client(d.socket, workspace, "--approval", "never", as_user=(user.uid, user.gid)) as mcp:
                    return tool_names(await mcp.list_tools())
        assert "shell" in asyncio.run(list_tools())

        body = ("killed = []\n"
                "for n in range(4):\n"
                "    try:\n"
                "        stub.CreateSession(pb.CreateSessionRequest(workspace=ARGS['ws'], approval_policy=pb.NEVER))\n"
                "        killed.append('OK')\n"
                "    except grpc.RpcError as e:\n"
                "        killed.append(e.code().name)\n"
                "print(json.dumps(killed))\n")
        # The control: this client process ends (as killed ones do) without closing what it made.
        seen = run_client_as(user.uid, user.gid, d.socket, body.replace("print(json.dumps(killed))",
                                                                         "print(json.dumps({'codes': killed}))"),
                             {"ws": str(workspace)})
        assert seen["codes"] == ["OK", "OK", "OK", "RESOURCE_EXHAUSTED"], seen
        for session in sessions_on(root, workspace):
            root.stub.CloseSession(pb.CloseSessionRequest(session_id=session.id))


def test_a_restarted_daemon_ends_sessions_whose_server_died_meanwhile(sandboxd_daemon: DaemonFactory) -> None:
    """The tie outlives the daemon: a server killed while no daemon ran has its session closed when
    the daemon starts; one still running keeps its session, tied again (killed later, it goes)."""
    d = sandboxd_daemon()
    dead_ws, live_ws = sandboxd_daemon.workspace(), sandboxd_daemon.workspace()
    with SandboxClient(d.socket) as root:
        dead, live = (start_stdio(d, path, "--approval", "never") for path in (dead_ws, live_ws))
        for path in (dead_ws, live_ws):
            wait_until(lambda: sessions_on(root, path), "sandboxd mcp opened no session")
    d.stop()
    kill(dead)
    restarted = Daemon(d.base).start()
    with SandboxClient(restarted.socket) as root:
        assert sessions_on(root, dead_ws) == [] and len(sessions_on(root, live_ws)) == 1
        kill(live)
        wait_until(lambda: not sessions_on(root, live_ws), "the session of a server killed after the restart stayed")


def test_a_client_may_not_forge_the_tie(client: SandboxClient, ws: Path) -> None:  # noqa: F811
    """The label that ties a session to a process is the daemon's: a client naming another process
    there (which would close the session when that one exits, or keep it) is INVALID_ARGUMENT."""
    import grpc

    with pytest.raises(grpc.RpcError) as refused:
        client.stub.CreateSession(pb.CreateSessionRequest(workspace=str(ws), approval_policy=pb.NEVER,
                                                          labels={"sandboxd.closes-with": "x:1:1"}))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "close_with_caller" in refused.value.details()


def _post(port_or_path: int | str, body: dict[str, Any], token: str, session: str = "",
          host: str = "127.0.0.1") -> tuple[int, dict[str, str], bytes]:
    if isinstance(port_or_path, str):
        connection: http.client.HTTPConnection = _UnixConnection(port_or_path)
    else:
        connection = http.client.HTTPConnection("127.0.0.1", port_or_path, timeout=60)
        host = f"{host}:{port_or_path}" if ":" not in host else host
    headers = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream",
               "Authorization": f"Bearer {token}", "Host": host, "MCP-Protocol-Version": "2025-06-18"}
    if session:
        headers["Mcp-Session-Id"] = session
    connection.request("POST", "/mcp", json.dumps(body), headers)
    response = connection.getresponse()
    return response.status, dict(response.getheaders()), response.read()


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str) -> None:
        super().__init__("localhost", timeout=60)
        self._path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.connect(self._path)


INITIALIZE = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
    "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "raw", "version": "1"}}}


def _raw_session(port: int, token: str) -> str:
    """An MCP session over HTTP that lists the tools (so it has a sandboxd session) and is then left,
    never DELETEd: its id."""
    status, headers, _ = _post(port, INITIALIZE, token)
    assert status == 200
    session = next(value for key, value in headers.items() if key.lower() == "mcp-session-id")
    _post(port, {"jsonrpc": "2.0", "method": "notifications/initialized"}, token, session)
    status, _, listing = _post(port, {"jsonrpc": "2.0", "id": 2, "method": "tools/list"}, token, session)
    assert status == 200 and b"shell" in listing, listing
    return session


def test_http_sessions_share_one_watch_and_expire(daemon: Daemon, ws: Path, client: SandboxClient,  # noqa: F811
                                                  tmp_path: Path) -> None:
    """The attack of round 4: each HTTP MCP session kept a WatchEvents stream, so four sessions a
    client never ended took the user's quotas.streams_per_uid, and the user's next sessions got
    no elicitation. Now a server keeps one watch: with five such sessions open, a sixth is asked
    about its held call and answered; and a session no request reached for --idle-timeout goes,
    with its sandboxd session (control: the one whose client is still connected stays)."""
    port = _free_port()
    with http_server(daemon.socket, ws, f"127.0.0.1:{port}", "--approval", "always", "--idle-timeout", "4",
                     log=tmp_path / "mcp.log") as (_server, token):
        for _ in range(5):
            _raw_session(port, token)
        assert len(sessions_on(client, ws)) == 5
        usage = client.stub.GetStatus(pb.GetStatusRequest()).quota_usage
        assert usage["streams"] == 1, usage                 # one watch, for every session of the server

        asked: list[types.ElicitRequestParams] = []

        async def sixth() -> tuple[types.CallToolResult, int]:
            async with http_client(f"http://127.0.0.1:{port}/mcp", token,
                                   elicitation_callback=decide(["allow_once"], asked)) as mcp:
                result = await mcp.call_tool("shell", {"command": "echo asked"})
                # The five left alone expire; this one, connected, stays.
                await asyncio.to_thread(wait_until, lambda: len(sessions_on(client, ws)) == 1,
                                        "HTTP sessions without a request for --idle-timeout stayed open")
                return result, len(sessions_on(client, ws))
        result, left = asyncio.run(sixth())
        assert structured(result)["stdout"] == "asked\n" and len(asked) == 1, (text(result), asked)
        assert left == 1


def test_the_unix_transport_takes_a_portless_host(daemon: Daemon, ws: Path, tmp_path: Path) -> None:  # noqa: F811
    """curl --unix-socket and other clients of a Unix socket send `Host: localhost`, without a
    port: served (it was 421). The DNS rebinding wall stays: a foreign Host is still 421."""
    path = str(tmp_path / "mcp.sock")
    with http_server(daemon.socket, ws, f"unix:{path}", "--approval", "never", log=tmp_path / "mcp.log") as (
            _server, token):
        assert _post(path, INITIALIZE, token, host="localhost")[0] == 200
        assert _post(path, INITIALIZE, token, host="localhost:8765")[0] == 200
        assert _post(path, INITIALIZE, token, host="evil.example")[0] == 421


@pytest.mark.parametrize("flags", [("--sandbox", "read-only"), ("--permission-mode", "read_only")])
def test_a_hidden_tool_is_refused(daemon: Daemon, ws: Path, client: SandboxClient,  # noqa: F811
                                  flags: tuple[str, str]) -> None:
    """The OmicOS rule: hidden means refused. A read-only session lists no shell, write_file,
    apply_patch or start_process; a client that calls one anyway gets a tool error, and nothing
    runs (no ToolInvocationStarted in the session's log). Control: read_file, which it lists, runs; and the
    same shell call runs in a workspace-write session."""
    (ws / "notes.txt").write_text("hello\n")
    hidden = {"shell": {"command": "touch ran"}, "write_file": {"path": "w.txt", "content": "x"},
              "apply_patch": {"patch": "--- a/notes.txt\n+++ b/notes.txt\n@@ -1 +1 @@\n-hello\n+bye\n"},
              "start_process": {"command": "touch ran"}}

    async def scenario(*flags: str) -> tuple[list[str], dict[str, types.CallToolResult]]:
        async with mcp_client(daemon.socket, ws, "--approval", "never", *flags) as mcp:
            listed = tool_names(await mcp.list_tools())
            results = {name: await mcp.call_tool(name, arguments) for name, arguments in hidden.items()}
            results["read_file"] = await mcp.call_tool("read_file", {"path": "notes.txt"})
            return listed, results

    listed, results = asyncio.run(scenario(*flags))
    assert listed == READ_ONLY_TOOLS
    for name in hidden:
        assert results[name].is_error and "does not offer the tool" in text(results[name]), (name, text(results[name]))
    assert not results["read_file"].is_error and text(results["read_file"]) == "hello\n"
    (session,) = [s for s in sessions_on(client, ws, include_closed=True)]
    started = client.stub.QueryEvents(pb.QueryEventsRequest(session_id=session.id, types=["ToolInvocationStarted"])).events
    assert [event.tool for event in started] == ["fs.read"], started
    assert not (ws / "ran").exists() and not (ws / "w.txt").exists() and (ws / "notes.txt").read_text() == "hello\n"

    _, results = asyncio.run(scenario("--sandbox", "workspace-write"))      # the control
    assert not results["shell"].is_error and (ws / "ran").exists(), text(results["shell"])


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_a_credential_secret_leaves_the_servers_environment_and_memory_unreadable(
        sandboxd_daemon: DaemonFactory, plain_users: Callable[[int], list[PlainUser]]) -> None:
    """Hostile r7b L4: `sandboxd mcp --credential` (long-lived) takes $VAR as `sandboxd run` does:
    made non-dumpable, the secret's value zeroed in /proc/PID/environ. Control: another process
    of the same user, started with the same environment, is readable by that user."""
    from test_run_credentials import readable_by

    secret = b"ghs_REALsecretVALUE0123456789abcdefXYZ"
    d = sandboxd_daemon()
    (user,) = plain_users(1)
    workspace = d.base / "ws-cred"
    workspace.mkdir()
    os.chown(workspace, user.uid, user.gid)
    params = server_params(d.socket, workspace, "--approval", "never", "--credential", "GH_TOKEN=https://api.example.com",
                           as_user=(user.uid, user.gid))
    env = {**params.env, "GH_TOKEN": secret.decode()}
    server = subprocess.Popen([params.command, *params.args], env=env, cwd="/", stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    control = subprocess.Popen(["sleep", "600"], env=env, user=user.uid, group=user.gid, extra_groups=[])
    try:
        with SandboxClient(d.socket) as root:
            wait_until(lambda: sessions_on(root, workspace), "sandboxd mcp opened no session")
        assert server.poll() is None
        assert readable_by(user.uid, user.gid, server.pid).split() == [
            "mem", "PermissionError", "environ", "PermissionError"]
        with open(f"/proc/{server.pid}/environ", "rb") as environ:             # as root
            assert secret not in environ.read()                                # its value zeroed
        with open(f"/proc/{control.pid}/environ", "rb") as environ:
            assert secret in environ.read()                                    # control: it would be seen
        yama = Path("/proc/sys/kernel/yama/ptrace_scope")
        mem = "read" if not yama.exists() or yama.read_text().strip() == "0" else "PermissionError"
        assert readable_by(user.uid, user.gid, control.pid).split() == ["mem", mem, "environ", "read"]
    finally:
        control.kill()
        control.wait()
        kill(server)
