"""`sandboxd mcp --http --session ID`: an attached session serves one MCP connection at a time.

Every connection of an attached session would bind the same session, and a held call's question
could reach the other client: its person approves the first client's call (hostile pass 9b). So a
second connection is refused with a message while the first is served, and mcp.events.EventHub
hands each event to every subscriber of a session (none silently replaced by a later one). The
control: two connections of `--http` without --session (a session each) are each asked about their
own call only."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from typing import Any

import mcp_types as types
import pytest
from mcp.shared.exceptions import MCPError

from daemon_fixtures import daemon, ws  # noqa: F401
from daemon_helpers import Daemon
from mcp_helpers import http_client, http_server
from sandboxd.mcp.events import EventHub
from sandboxd.v1 import sandboxd_pb2 as pb

pytestmark = pytest.mark.timeout(300)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _recorder(name: str, asked: list[tuple[str, str]], before_first: Any = None) -> Any:
    async def answer(_context: Any, params: types.ElicitRequestParams) -> types.ElicitResult:
        asked.append((name, params.message))
        if before_first is not None and len([a for a in asked if a[0] == name]) == 1:
            await before_first()
        return types.ElicitResult(action="accept", content={"decision": "allow_once"})
    return answer


def test_control_separate_sessions_each_client_is_asked_about_its_own_call(daemon: Daemon, ws: Path,  # noqa: F811
                                                                          tmp_path: Path) -> None:
    port, asked = _free_port(), []
    with http_server(daemon.socket, ws, f"127.0.0.1:{port}", "--approval", "always",
                     log=tmp_path / "separate.log") as (_server, token):
        url = f"http://127.0.0.1:{port}/mcp"

        async def run() -> types.CallToolResult:
            async with http_client(url, token, elicitation_callback=_recorder("A", asked)) as a:
                await a.list_tools()
                async with http_client(url, token, elicitation_callback=_recorder("B", asked)) as b:
                    await b.list_tools()
                    b_call = asyncio.create_task(b.call_tool("write_file", {"path": "b-file.txt", "content": "B"}))
                    while not asked:
                        await asyncio.sleep(0.05)
                    a_result = await a.call_tool("write_file", {"path": "a-file.txt", "content": "A"})
                    b_result = await b_call
                    assert not b_result.is_error, b_result
                    return a_result
        a_result = asyncio.run(run())
    assert not a_result.is_error, a_result
    assert [name for name, message in asked if "a-file.txt" in message] == ["A"], asked
    assert [name for name, message in asked if "b-file.txt" in message] == ["B"], asked


def test_an_attached_session_serves_one_connection_at_a_time(daemon: Daemon, ws: Path,  # noqa: F811
                                                             tmp_path: Path) -> None:
    port, asked = _free_port(), []
    created = daemon.stub.CreateSession(pb.CreateSessionRequest(
        workspace=str(ws), approval_policy=pb.ALWAYS,
        sandbox_policy=pb.SandboxPolicy(mode=pb.SandboxPolicy.WORKSPACE_WRITE)), timeout=120)
    try:
        with http_server(daemon.socket, ws, f"127.0.0.1:{port}", "--session", created.id,
                         log=tmp_path / "attached.log") as (_server, token):
            url = f"http://127.0.0.1:{port}/mcp"

            async def run() -> tuple[str, types.CallToolResult, list[str]]:
                async with http_client(url, token, elicitation_callback=_recorder("A", asked)) as a:
                    await a.list_tools()                                  # A binds the session
                    async with http_client(url, token, elicitation_callback=_recorder("B", asked)) as b:
                        with pytest.raises(MCPError) as refused:
                            await b.list_tools()
                        a_result = await a.call_tool("write_file", {"path": "a-file.txt", "content": "A"})
                # A is gone: the session is free for the next connection.
                async with http_client(url, token, elicitation_callback=_recorder("C", asked)) as c:
                    later = [tool.name for tool in (await c.list_tools()).tools]
                return str(refused.value), a_result, later
            refused, a_result, later = asyncio.run(run())
    finally:
        daemon.stub.CloseSession(pb.CloseSessionRequest(session_id=created.id), timeout=60)
    assert "in use by another MCP connection" in refused and created.id in refused, refused
    assert not a_result.is_error, a_result
    assert [name for name, message in asked if "a-file.txt" in message] == ["A"], asked   # A alone is asked
    assert "write_file" in later


class _Watch:
    """A daemon stub with one PermissionRequested event to watch."""

    def __init__(self, event: pb.Event) -> None:
        self.event, self.stub = event, self

    async def GetStatus(self, _request: pb.GetStatusRequest) -> pb.DaemonStatus:  # noqa: N802
        return pb.DaemonStatus(events=0)

    async def WatchEvents(self, _request: pb.WatchEventsRequest) -> Any:  # noqa: N802
        yield self.event
        await asyncio.Event().wait()


def test_every_subscriber_of_a_session_gets_its_events() -> None:
    """No last-wins: two subscribers of one session both get its event; one unsubscribing leaves
    the other subscribed (a Binding then acts only on the calls it expects)."""
    async def main() -> tuple[list[str], bool]:
        hub = EventHub(_Watch(pb.Event(id=1, session_id="s1", type="PermissionRequested")))  # type: ignore[arg-type]
        seen: list[str] = []
        got = asyncio.Event()

        async def first(_event: pb.Event) -> None:
            seen.append("first")

        async def second(_event: pb.Event) -> None:
            seen.append("second")
            got.set()
        await hub.subscribe("s1", first)
        await hub.subscribe("s1", second)
        await asyncio.wait_for(got.wait(), 60)
        hub.unsubscribe("s1", first)
        still = hub._handlers.get("s1") == [second]
        hub.unsubscribe("s1", second)
        return seen, still and not hub._handlers
    seen, still = asyncio.run(main())
    assert seen == ["first", "second"] and still, seen
