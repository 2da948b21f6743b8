"""`sandboxd mcp` driven by the official MCP Python SDK client over stdio, against a real daemon:
the tool list per policy and its change notification, commands with their kernel walls, the
file tools, background processes, approvals answered by elicitation or by sandboxctl, denials as
typed tool errors, a client that goes away mid-command, and whose session it is."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import stat
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
from daemon_helpers import Daemon, PlainUser, proc_info
from mcp_helpers import (SANDBOXCTL, decide, http_client, http_server, mcp_client, server_params, structured, text,
                         tool_names)
from sandboxd.client import SandboxClient
from sandboxd.v1 import sandboxd_pb2 as pb

FULL = ["shell", "read_file", "write_file", "list_dir", "apply_patch", "search", "start_process", "list_processes",
        "read_process_output", "stop_process"]
READ_ONLY = ["read_file", "list_dir", "search", "list_processes", "read_process_output", "stop_process"]


def session_of(client: SandboxClient, workspace: Path, *, include_closed: bool = False) -> pb.Session:
    sessions = [s for s in client.stub.ListSessions(pb.ListSessionsRequest(include_closed=include_closed)).sessions
                if s.workspace == str(workspace)]
    assert len(sessions) == 1, sessions
    return sessions[0]


def ctl(daemon: Daemon, *args: str, user: PlainUser | None = None) -> subprocess.CompletedProcess[str]:
    prefix = ["setpriv", f"--reuid={user.uid}", f"--regid={user.gid}", "--clear-groups"] if user else []
    return subprocess.run([*prefix, SANDBOXCTL, "--socket", daemon.socket, *args], capture_output=True, text=True,
                          timeout=60, cwd="/")


async def approve_command(hints: list[str]) -> list[str]:
    """The `sandboxctl ... approve SESSION CALL` a waiting call's progress message names."""
    deadline = time.monotonic() + 30 * SLOW
    while not any(" approve " in hint for hint in hints):
        assert time.monotonic() < deadline, hints
        await asyncio.sleep(0.05)
    return next(hint for hint in hints if " approve " in hint).split("`")[1].split()


def test_tool_list_follows_the_policy_and_its_changes(daemon: Daemon, ws: Path, client: SandboxClient) -> None:
    async def scenario() -> tuple[list[str], list[str], list[str], str]:
        changed = asyncio.Event()

        async def messages(message: Any) -> None:
            if isinstance(message, types.ToolListChangedNotification):
                changed.set()

        async with mcp_client(daemon.socket, ws, "--sandbox", "read-only") as mcp:
            read_only = tool_names(await mcp.list_tools())
        async with mcp_client(daemon.socket, ws, "--permission-mode", "read_only") as mcp:
            assert tool_names(await mcp.list_tools()) == read_only
        async with mcp_client(daemon.socket, ws, messages=messages) as mcp:
            listing = await mcp.list_tools()
            before = tool_names(listing)
            shell = next(tool for tool in listing.tools if tool.name == "shell")
            session = session_of(client, ws)
            assert not changed.is_set()
            assert ctl(daemon, "session", "policy", session.id, "--sandbox", "read-only").returncode == 0
            await asyncio.wait_for(changed.wait(), 30 * SLOW)
            after = tool_names(await mcp.list_tools())
        return read_only, before, after, shell.description or ""

    read_only, before, after, description = asyncio.run(scenario())
    assert read_only == READ_ONLY
    assert before == FULL
    assert after == READ_ONLY
    # The policy is stated where the model reads it.
    assert f"writes allowed only under {ws}" in description and "network: off" in description


def test_shell_output_status_timeout_and_kernel_wall(daemon: Daemon, ws: Path) -> None:
    async def scenario() -> dict[str, Any]:
        progress: list[str] = []

        async def on_progress(_done: float, _total: float | None, message: str | None) -> None:
            progress.append(message or "")

        async with mcp_client(daemon.socket, ws, "--approval", "never") as mcp:
            out: dict[str, Any] = {}
            out["echo"] = await mcp.call_tool("shell", {"command": "echo streamed; echo oops >&2; exit 3"},
                                              progress_callback=on_progress)
            out["progress"] = list(progress)
            out["timeout"] = await mcp.call_tool("shell", {"command": "sleep 60", "timeout": 1})
            # env is added to the session's environment: HOME and LANG stay.
            out["env_cwd"] = await mcp.call_tool("shell", {"command": "mkdir -p sub && cd sub && pwd && echo $GREETING"
                                                           " && echo $HOME $LANG",
                                                           "env": {"GREETING": "hello", "PATH": "/usr/bin:/bin"}})
            # The kernel's wall: python3 is not a command the policy can vouch for, so it runs, and the
            # write outside the workspace fails inside the sandbox; the same write in the workspace works.
            write = "import sys; open(sys.argv[1], 'w').write('x'); print('wrote')"
            out["outside"] = await mcp.call_tool("shell", {"command": f"python3 -c \"{write}\" /etc/mcp-probe"})
            out["inside"] = await mcp.call_tool("shell", {"command": f"python3 -c \"{write}\" {ws}/mcp-probe"})
            out["bad"] = await mcp.call_tool("shell", {"command": "true", "timeout": "soon"})
            return out

    out = asyncio.run(scenario())
    echo = structured(out["echo"])
    assert (echo["exit_code"], echo["shell_status"], echo["signal"], echo["timed_out"]) == (3, 3, 0, False)
    assert (echo["stdout"], echo["stderr"], echo["output_truncated"]) == ("streamed\n", "oops\n", False)
    assert not out["echo"].is_error and "exit status 3" in text(out["echo"])
    assert "streamed\n" in out["progress"] and "oops\n" in out["progress"]
    timed = structured(out["timeout"])
    assert timed["timed_out"] and timed["shell_status"] == 124 and "timed out" in text(out["timeout"])
    assert structured(out["env_cwd"])["stdout"] == f"{ws}/sub\nhello\n/tmp/sandboxd-home C.UTF-8\n"
    outside = structured(out["outside"])
    assert outside["exit_code"] != 0 and "Read-only file system" in outside["stderr"], outside
    assert not os.path.exists("/etc/mcp-probe")
    assert structured(out["inside"])["stdout"] == "wrote\n" and (ws / "mcp-probe").read_text() == "x"
    assert out["bad"].is_error and "timeout must be" in text(out["bad"])


def test_file_tools(daemon: Daemon, ws: Path) -> None:
    (ws / "notes.txt").write_text("alpha\nbeta\n")
    patch = ("--- a/notes.txt\n+++ b/notes.txt\n@@ -1,2 +1,2 @@\n alpha\n-beta\n+gamma\n")

    async def scenario() -> dict[str, types.CallToolResult]:
        async with mcp_client(daemon.socket, ws, "--approval", "never") as mcp:
            return {
                "write": await mcp.call_tool("write_file", {"path": "src/new.py", "content": "print('new')\n"}),
                "read": await mcp.call_tool("read_file", {"path": "src/new.py"}),
                "list": await mcp.call_tool("list_dir", {}),
                "patch": await mcp.call_tool("apply_patch", {"patch": patch}),
                "search": await mcp.call_tool("search", {"pattern": "gam+a"}),
                "outside": await mcp.call_tool("write_file", {"path": "/etc/mcp-outside", "content": "x"}),
                "missing": await mcp.call_tool("read_file", {"path": "nope.txt"}),
            }

    out = asyncio.run(scenario())
    assert (ws / "src" / "new.py").read_text() == "print('new')\n" and not out["write"].is_error
    assert text(out["read"]) == "print('new')\n"
    names = {entry["name"] for entry in structured(out["list"])["entries"]}
    assert {"notes.txt", "src"} <= names
    assert structured(out["patch"])["files"] == [{"path": "notes.txt", "action": "modified"}]
    assert (ws / "notes.txt").read_text() == "alpha\ngamma\n"
    assert "notes.txt:2: gamma" in text(out["search"])
    # A write outside the writable roots: refused with its typed reason, and nothing written.
    assert out["outside"].is_error and structured(out["outside"])["by"] == "sandbox"
    assert not os.path.exists("/etc/mcp-outside")
    assert out["missing"].is_error and "NOT_FOUND" in text(out["missing"])


def test_background_processes(daemon: Daemon, ws: Path) -> None:
    async def scenario() -> dict[str, types.CallToolResult]:
        async with mcp_client(daemon.socket, ws, "--approval", "never") as mcp:
            started = await mcp.call_tool("start_process", {"command": "echo serving; exec sleep 300", "name": "srv"})
            job = structured(started)["id"]
            deadline = time.monotonic() + 30 * SLOW
            while True:
                output = await mcp.call_tool("read_process_output", {"id": job})
                if "serving" in text(output) or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.1)
            listed = await mcp.call_tool("list_processes", {})
            stopped = await mcp.call_tool("stop_process", {"id": job})
            after = await mcp.call_tool("list_processes", {})
            return {"started": started, "output": output, "listed": listed, "stopped": stopped, "after": after}

    out = asyncio.run(scenario())
    assert text(out["output"]) == "serving\n" and structured(out["output"])["next_offset"] == len("serving\n")
    (listed,) = structured(out["listed"])["processes"]
    assert listed["running"] and listed["name"] == "srv"
    (after,) = structured(out["after"])["processes"]
    assert not after["running"] and after["shell_status"] in (128 + 15, 128 + 9)


def test_elicitation_allow_once_allow_session_and_deny(daemon: Daemon, ws: Path) -> None:
    asked: list[types.ElicitRequestParams] = []

    async def scenario() -> list[types.CallToolResult]:
        answers = decide(["allow_once", "deny", "allow_session"], asked)
        async with mcp_client(daemon.socket, ws, "--approval", "always", elicitation=answers) as mcp:
            return [await mcp.call_tool("shell", {"command": f"echo call-{n}"}) for n in range(4)]

    once, denied, session_wide, remembered = asyncio.run(scenario())
    assert structured(once)["stdout"] == "call-0\n"
    assert denied.is_error and structured(denied)["by"] == "user" and structured(denied)["reason"] == "policy_always"
    assert "denied by user" in text(denied) and "reason: policy_always" in text(denied)
    assert structured(session_wide)["stdout"] == "call-2\n"
    assert structured(remembered)["stdout"] == "call-3\n"
    # Three questions for four calls: allow_session answered the fourth.
    assert len(asked) == 3
    first = asked[0]
    assert isinstance(first, types.ElicitRequestFormParams)
    assert "shell.exec" in first.message and "policy_always" in first.message and "echo call-0" in first.message
    assert first.requested_schema["properties"]["decision"]["enum"] == ["allow_once", "allow_session", "deny"]


def test_without_elicitation_the_call_waits_for_sandboxctl(daemon: Daemon, ws: Path, client: SandboxClient) -> None:
    async def held_call(mcp: Any, command: str, hints: list[str]) -> types.CallToolResult:
        async def on_progress(_done: float, _total: float | None, message: str | None) -> None:
            hints.append(message or "")
        return await mcp.call_tool("shell", {"command": command}, progress_callback=on_progress)

    async def answer_when_asked(hints: list[str], verb: str) -> list[str]:
        command = await approve_command(hints)
        # The hint's own command, run as written (deny: its other half).
        if verb == "deny":
            command[command.index("approve")] = "deny"
        done = await asyncio.to_thread(subprocess.run, [SANDBOXCTL, *command[1:]], capture_output=True, text=True,
                                       timeout=60)
        assert done.returncode == 0, done.stderr
        return command

    async def scenario() -> tuple[types.CallToolResult, types.CallToolResult, list[str], list[str]]:
        async with mcp_client(daemon.socket, ws, "--approval", "always") as mcp:
            hints: list[str] = []
            approved, command = await asyncio.gather(held_call(mcp, "echo approved", hints),
                                                     answer_when_asked(hints, "approve"))
            denied_hints: list[str] = []
            denied, _ = await asyncio.gather(held_call(mcp, "echo never", denied_hints),
                                             answer_when_asked(denied_hints, "deny"))
            return approved, denied, command, hints

    approved, denied, command, hints = asyncio.run(scenario())
    session = session_of(client, ws, include_closed=True)
    assert command[:4] == ["sandboxctl", "--socket", daemon.socket, "approve"]
    assert command[4] == session.id and command[5].startswith("call_")
    assert structured(approved)["stdout"] == "approved\n"
    assert denied.is_error and structured(denied)["by"] == "user" and structured(denied)["reason"] == "policy_always"


@pytest.mark.parametrize("gone", ["stdin-closed", "sigterm"])
def test_a_client_gone_mid_command_kills_it_and_closes_the_session(daemon: Daemon, ws: Path, client: SandboxClient,
                                                                     gone: str) -> None:
    """The client's end of stdio closes mid-command (as when it is killed), or the client stops its
    server with SIGTERM: the command's process tree is killed and the session closed; the audit
    log says how the call ended."""
    params = server_params(daemon.socket, ws, "--approval", "never")
    server = subprocess.Popen([params.command, *params.args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, env=params.env, cwd="/")
    assert server.stdin is not None and server.stdout is not None

    def send(message: dict[str, Any]) -> None:
        assert server.stdin is not None
        server.stdin.write((json.dumps({"jsonrpc": "2.0", **message}) + "\n").encode())
        server.stdin.flush()

    send({"id": 1, "method": "initialize", "params": {"protocolVersion": "2025-11-25", "capabilities": {},
                                                       "clientInfo": {"name": "raw", "version": "0"}}})
    assert json.loads(server.stdout.readline())["id"] == 1
    send({"method": "notifications/initialized"})
    marker = "7391.25"
    send({"id": 2, "method": "tools/call", "params": {"name": "shell", "arguments": {"command": f"sleep {marker}"}}})
    deadline = time.monotonic() + 30 * SLOW
    pids: list[int] = []
    while not pids:
        assert time.monotonic() < deadline, "the command never started"
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit() and (info := proc_info(int(p))) is not None
                and info.cmdline == f"sleep\0{marker}".encode()]
        time.sleep(0.05)
    session = session_of(client, ws)
    if gone == "sigterm":
        server.terminate()
    else:
        server.stdin.close()                                    # the client is gone
    assert server.wait(timeout=60 * SLOW) == 0
    assert all(proc_info(pid) is None for pid in pids), "the command outlived its client"
    closed = session_of(client, ws, include_closed=True)
    assert closed.id == session.id and closed.closed_at > 0
    events = client.stub.QueryEvents(pb.QueryEventsRequest(session_id=session.id, page_size=1000)).events
    ended = [json.loads(e.data_json or "{}") for e in events if e.type in ("ToolInvocationCompleted",
                                                                          "ToolInvocationFailed")]
    assert ended and (ended[-1].get("signal") or ended[-1].get("error")), ended
    assert events[-1].type == "SessionClosed"


def test_the_session_is_the_callers_own(daemon: Daemon, ws: Path, client: SandboxClient,
                                        plain_users: Callable[[int], list[PlainUser]]) -> None:
    owner, other = plain_users(2)
    os.chown(ws, owner.uid, owner.gid)

    async def scenario() -> tuple[types.CallToolResult, dict[str, subprocess.CompletedProcess[str]]]:
        hints: list[str] = []

        async def on_progress(_done: float, _total: float | None, message: str | None) -> None:
            hints.append(message or "")

        async def intruder() -> dict[str, subprocess.CompletedProcess[str]]:
            command = await approve_command(hints)
            session_id, call_id = command[-2:]
            tried = {"list": await asyncio.to_thread(ctl, daemon, "session", "list", user=other),
                     "approve": await asyncio.to_thread(ctl, daemon, "approve", session_id, call_id, user=other),
                     "pending": await asyncio.to_thread(ctl, daemon, "pending", session_id, user=other)}
            # Control: the owner answers the same call the same way.
            tried["owner"] = await asyncio.to_thread(ctl, daemon, "approve", session_id, call_id, user=owner)
            return tried

        async with mcp_client(daemon.socket, ws, "--approval", "always", as_user=(owner.uid, owner.gid)) as mcp:
            result, tried = await asyncio.wait_for(asyncio.gather(
                mcp.call_tool("shell", {"command": "id -u"}, progress_callback=on_progress), intruder()), 60 * SLOW)
        return result, tried

    result, tried = asyncio.run(scenario())
    session = session_of(client, ws, include_closed=True)
    assert session.owner_uid == owner.uid
    assert structured(result)["stdout"] == f"{owner.uid}\n"
    assert session.id not in tried["list"].stdout
    assert tried["approve"].returncode == 1 and "NOT_FOUND" in tried["approve"].stderr, tried["approve"].stderr
    assert tried["pending"].returncode == 1
    assert tried["owner"].returncode == 0, tried["owner"].stderr
    # Nor can another user attach to the owner's session (control: the owner can, and leaving does not close it).
    created = ctl(daemon, "session", "create", str(ws), "--approval", "never", user=owner)
    assert created.returncode == 0, created.stderr
    session_id = created.stdout.strip()
    try:
        status = {}
        for user in (other, owner):
            params = server_params(daemon.socket, ws, "--session", session_id, as_user=(user.uid, user.gid))
            done = subprocess.run([params.command, *params.args], capture_output=True, text=True, timeout=60,
                                  env=params.env, stdin=subprocess.DEVNULL, cwd="/")
            status[user.name] = (done.returncode, done.stderr)
        assert status[other.name][0] == 1 and "NOT_FOUND" in status[other.name][1], status
        assert status[owner.name] == (0, ""), status
        assert client.get_session(session_id).closed_at == 0
    finally:
        client.close_session(session_id)


@pytest.mark.parametrize("flag", ["--session"])
def test_attached_session_stays_open(daemon: Daemon, ws: Path, client: SandboxClient, flag: str) -> None:
    session = client.create_session(str(ws), approval="never")
    try:
        async def scenario() -> types.CallToolResult:
            async with mcp_client(daemon.socket, ws, flag, session.id) as mcp:
                return await mcp.call_tool("shell", {"command": "echo attached"})
        assert structured(asyncio.run(scenario()))["stdout"] == "attached\n"
        assert client.get_session(session.id).closed_at == 0
    finally:
        client.close_session(session.id)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _post_as(user: PlainUser, target: str) -> str:
    """An MCP initialize POSTed by ``user`` (to http://127.0.0.1:PORT/mcp, or a Unix socket path):
    the HTTP status, or the connection error."""
    script = ("import http.client, json, socket, sys\n"
              "target = sys.argv[1]\n"
              "class Unix(http.client.HTTPConnection):\n"
              "    def connect(self):\n"
              "        self.sock = socket.socket(socket.AF_UNIX); self.sock.connect(target)\n"
              "try:\n"
              "    c = Unix('localhost') if target.startswith('/') else http.client.HTTPConnection(*target.split(':'))\n"
              "    body = json.dumps({'jsonrpc': '2.0', 'id': 1, 'method': 'initialize', 'params': {\n"
              "        'protocolVersion': '2025-11-25', 'capabilities': {}, 'clientInfo': {'name': 'x', 'version': '0'}}})\n"
              "    c.request('POST', '/mcp', body, {'Content-Type': 'application/json',\n"
              "              'Accept': 'application/json, text/event-stream', 'Host': 'localhost'})\n"
              "    print(c.getresponse().status)\n"
              "except OSError as e:\n"
              "    print(type(e).__name__)\n")
    done = subprocess.run(["setpriv", f"--reuid={user.uid}", f"--regid={user.gid}", "--clear-groups",
                           sys.executable, "-c", script, target], capture_output=True, text=True, timeout=60, cwd="/")
    return done.stdout.strip() or done.stderr


def test_http_serves_its_own_user_only(daemon: Daemon, ws: Path, client: SandboxClient, tmp_path: Path,
                                       plain_users: Callable[[int], list[PlainUser]]) -> None:
    (other,) = plain_users(1)
    port = _free_port()
    with http_server(daemon.socket, ws, f"127.0.0.1:{port}", "--approval", "never", log=tmp_path / "tcp.log") as (
            _server, token):
        async def own_user() -> tuple[str, types.CallToolResult]:
            async with http_client(f"http://127.0.0.1:{port}/mcp", token) as mcp:
                return mcp.protocol_version, await mcp.call_tool("shell", {"command": "echo over-http"})

        version, result = asyncio.run(own_user())
        assert version == "2025-11-25" and structured(result)["stdout"] == "over-http\n"
        assert _post_as(other, f"127.0.0.1:{port}") == "403"       # another uid, same port: refused
    # The HTTP session ended with its client, and its sandboxd session with it.
    assert session_of(client, ws, include_closed=True).closed_at > 0

    path = tmp_path / "mcp.sock"
    os.chmod(tmp_path, 0o755)
    with http_server(daemon.socket, ws, f"unix:{path}", "--approval", "never", log=tmp_path / "unix.log"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert _post_as(other, str(path)) == "PermissionError"


def test_bad_start_says_what_to_do(daemon: Daemon, tmp_path: Path) -> None:
    def start(*flags: str, socket_path: str = daemon.socket) -> subprocess.CompletedProcess[str]:
        params = server_params(socket_path, *flags)
        return subprocess.run([params.command, *params.args], capture_output=True, text=True, timeout=60,
                              env=params.env, stdin=subprocess.DEVNULL, cwd="/")

    unreachable = start(str(tmp_path), socket_path=str(tmp_path / "none.sock"))
    assert unreachable.returncode == 1 and "is `sandboxd serve` running?" in unreachable.stderr
    missing = start(str(tmp_path / "missing"))
    assert missing.returncode == 1 and "INVALID_ARGUMENT" in missing.stderr and "missing" in missing.stderr
    anywhere = start(str(tmp_path), "--http", "0.0.0.0:8080")
    assert anywhere.returncode == 2 and "localhost only" in anywhere.stderr
    for done in (unreachable, missing, anywhere):
        assert "Traceback" not in done.stderr and done.stderr.count("\n") == 1, done.stderr


def test_the_daemon_never_imports_the_mcp_sdk() -> None:
    """The MCP SDK is `sandboxd mcp`'s alone: the daemon's code does not load it (control: the
    MCP command's own modules do)."""
    probe = ("import sys; import sandboxd.cli.serve, sandboxd.service.daemon; "
             "print(any(name == 'mcp' or name.startswith('mcp.') for name in sys.modules)); "
             "import sandboxd.cli.mcp_transports; print('mcp' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, cwd="/")
    assert done.stdout.split() == ["False", "True"], done.stderr
