"""Driving `sandboxd mcp` from the official MCP Python SDK client over stdio, for the MCP tests
and the latency benchmark; and a minimal JSON-lines client (RawClient) for the benchmarks."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import mcp_types as types
from mcp import Client
from mcp.client.session import ElicitationFnT, MessageHandlerFnT
from mcp.client import stdio
from mcp.client.stdio import StdioServerParameters

REPO = Path(__file__).resolve().parents[1]
SANDBOXD = str(REPO / ".venv" / "bin" / "sandboxd")
SANDBOXCTL = str(REPO / ".venv" / "bin" / "sandboxctl")
ENV = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"}


def server_params(socket: str, workspace: str | os.PathLike[str], *flags: str,
                  as_user: tuple[int, int] | None = None) -> StdioServerParameters:
    """`sandboxd mcp` on ``socket`` for ``workspace``; ``as_user`` (uid, gid): run it as that user."""
    command = [SANDBOXD, "mcp", "--socket", socket, "--workspace", str(workspace), *flags]
    if as_user is not None:
        command = ["setpriv", f"--reuid={as_user[0]}", f"--regid={as_user[1]}", "--clear-groups", *command]
    return StdioServerParameters(command=command[0], args=command[1:], env=ENV, cwd="/")


class RawClient:
    """An MCP stdio server (``command``) spoken to in JSON lines, one out and one in per call: no
    client library in a measurement (tests/bench_mcp.py, tests/bench_mcp_gateway.py). What the
    server sends between (notifications, list_changed) is skipped."""

    def __init__(self, command: Sequence[str], env: Mapping[str, str]) -> None:
        self.server = subprocess.Popen(list(command), stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=dict(env),
                                       cwd="/")
        self.ids = 0
        self.initialize()

    def initialize(self) -> None:
        self.call("initialize", {"protocolVersion": "2025-11-25", "capabilities": {},
                                 "clientInfo": {"name": "bench", "version": "0"}})
        self.send({"jsonrpc": "2.0", "method": "notifications/initialized"})

    def send(self, message: dict[str, Any]) -> None:
        assert self.server.stdin is not None
        self.server.stdin.write((json.dumps(message) + "\n").encode())
        self.server.stdin.flush()

    def receive(self) -> bytes:
        assert self.server.stdout is not None
        return self.server.stdout.readline()

    def call(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        self.ids += 1
        self.send({"jsonrpc": "2.0", "id": self.ids, "method": method, "params": params})
        while True:
            answer: dict[str, Any] = json.loads(self.receive())
            if answer.get("id") == self.ids:
                return answer

    def close(self) -> None:
        assert self.server.stdin is not None
        self.server.stdin.close()
        self.server.wait(timeout=60)


@contextlib.asynccontextmanager
async def mcp_client(socket: str, workspace: str | os.PathLike[str], *flags: str,
                     elicitation: ElicitationFnT | None = None, messages: MessageHandlerFnT | None = None,
                     as_user: tuple[int, int] | None = None) -> AsyncIterator[Client]:
    # The SDK's stdio_client takes the server's stderr from a default bound when it was imported
    # (sys.stderr then: an earlier test's capture, gone since); fd 2, whatever captures it now.
    stdio.stdio_client.__wrapped__.__defaults__ = (sys.__stderr__,)  # type: ignore[attr-defined]
    async with Client(server_params(socket, workspace, *flags, as_user=as_user), elicitation_callback=elicitation,
                      message_handler=messages, read_timeout_seconds=120) as client:
        yield client


def text(result: types.CallToolResult) -> str:
    return "".join(block.text for block in result.content if isinstance(block, types.TextContent))


def tool_names(listing: types.ListToolsResult) -> list[str]:
    return [tool.name for tool in listing.tools]


def structured(result: types.CallToolResult) -> dict[str, Any]:
    assert isinstance(result.structured_content, dict), result
    return result.structured_content


def decide(decisions: Sequence[str], asked: list[types.ElicitRequestParams]) -> ElicitationFnT:
    """An elicitation callback answering each request with the next decision, recording the requests."""
    pending = list(decisions)

    async def answer(_context: Any, params: types.ElicitRequestParams) -> types.ElicitResult:
        asked.append(params)
        decision = pending.pop(0)
        if decision == "decline":
            return types.ElicitResult(action="decline")
        return types.ElicitResult(action="accept", content={"decision": decision})
    return answer


@contextlib.contextmanager
def http_server(socket: str, workspace: str | os.PathLike[str], listen: str, *flags: str, log: Path,
                as_user: tuple[int, int] | None = None,
                env: dict[str, str] | None = None) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """`sandboxd mcp --http LISTEN FLAGS` (its output in ``log``), once it says it serves: the
    process and its bearer token (read from the file it names, or ``env``'s SANDBOXD_MCP_TOKEN)."""
    params = server_params(socket, workspace, *flags, "--http", listen, as_user=as_user)
    with open(log, "wb") as out:
        server = subprocess.Popen([params.command, *params.args], env={**ENV, **(env or {})}, cwd="/",
                                  stdin=subprocess.DEVNULL, stdout=out, stderr=out)
    try:
        deadline = time.monotonic() + 120 * float(os.environ.get("SANDBOXD_TEST_SLOW", "1"))
        while "serving" not in log.read_text():
            assert server.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        line = next(line for line in log.read_text().splitlines() if "serving" in line)
        token = (env or {}).get("SANDBOXD_MCP_TOKEN") or Path(line.split("the token in ", 1)[1].strip()).read_text()
        yield server, token.strip()
    finally:
        if server.poll() is None:
            server.terminate()
        server.wait(timeout=60)


def http_client(url: str, token: str, *, uds: str = "", **options: Any) -> Client:
    """An MCP client of a `sandboxd mcp --http` server, sending ``token``; over the Unix socket
    ``uds`` when given (``url`` then names only the path and the Host)."""
    import httpx2
    from mcp.client.streamable_http import streamable_http_client
    from mcp.shared._httpx_utils import create_mcp_http_client

    headers = {"Authorization": f"Bearer {token}"}
    http = (httpx2.AsyncClient(transport=httpx2.AsyncHTTPTransport(uds=uds), headers=headers,
                               timeout=httpx2.Timeout(30, read=300)) if uds else create_mcp_http_client(headers=headers))
    return Client(streamable_http_client(url, http_client=http), **options)
