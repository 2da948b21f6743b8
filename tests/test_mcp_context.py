"""Held file-tool calls reach the client that made them (round 10, left open by hostile pass 9b).

Two `sandboxd mcp --session S` processes on one session could each be asked about the other's
held write_file: the file RPCs carried no execution_context_id, and mcp.binding routed a held call
to "the first waiter for the same daemon tool". Now every RPC whose call can be held carries one,
each MCP tool call tags its daemon calls with its own, and the daemon puts it on the held call
(ListPendingApprovals, the PermissionRequested event, the audit). `sandboxctl`'s file commands tag
theirs as `sandboxctl exec` does.

Against a real daemon: two processes, both holding a write_file at once, each asked about its own
call only; the control drives two Bindings (two processes' worth: an event watch each) on one
session with the old request shape (no id), where the first waiter takes the other's call."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
from pathlib import Path
from collections.abc import Callable
from typing import Any

import grpc
import mcp_types as types
import pytest

from conftest import SLOW
from daemon_fixtures import base, daemon, ws  # noqa: F401 - pytest fixtures
from daemon_helpers import Daemon
from mcp_helpers import ENV, SANDBOXCTL, mcp_client
from sandboxd.mcp.binding import Binding
from sandboxd.mcp.daemon import Daemon as McpDaemon
from sandboxd.mcp.events import EventHub
from sandboxd.v1 import sandboxd_pb2 as pb
from test_terminals import Tmux, ctl_command, tmux  # noqa: F401 - tmux: a pytest fixture

pytestmark = pytest.mark.timeout(int(300 * SLOW))
WAIT = 120 * SLOW               # a bound on a hung test, never a judgement of speed


def _held_session(daemon: Daemon, workspace: Path) -> pb.Session:
    return daemon.stub.CreateSession(pb.CreateSessionRequest(
        workspace=str(workspace), approval_policy=pb.ALWAYS,
        sandbox_policy=pb.SandboxPolicy(mode=pb.SandboxPolicy.WORKSPACE_WRITE)), timeout=120)


async def _held(daemon: Daemon, session_id: str, count: int) -> list[pb.PendingApproval]:
    """The session's held calls, once there are ``count`` of them."""
    async with asyncio.timeout(WAIT):
        while True:
            listed = await asyncio.to_thread(daemon.stub.ListPendingApprovals,
                                             pb.ListPendingApprovalsRequest(session_id=session_id))
            if len(listed.approvals) >= count:
                return list(listed.approvals)
            await asyncio.sleep(0.05)


def test_two_mcp_processes_on_one_session_are_each_asked_about_their_own_write(daemon: Daemon,  # noqa: F811
                                                                              ws: Path) -> None:
    """Both processes' write_file calls are held at the same time (no client answers before both
    were asked); each client is asked exactly once, about its own file; the held calls carry
    distinct MCP context ids, and so do their PermissionRequested events in the audit log."""
    session = _held_session(daemon, ws)
    asked: list[tuple[str, str]] = []
    seen_held: list[pb.PendingApproval] = []
    both_asked = asyncio.Event()

    def answer_as(name: str) -> Any:
        async def answer(_context: Any, params: types.ElicitRequestParams) -> types.ElicitResult:
            asked.append((name, params.message))
            if len(asked) >= 2:
                both_asked.set()
            await asyncio.wait_for(both_asked.wait(), WAIT)      # both held: neither answered yet
            listed = await asyncio.to_thread(daemon.stub.ListPendingApprovals,
                                             pb.ListPendingApprovalsRequest(session_id=session.id))
            if not seen_held:                                    # the first to look sees both held
                seen_held.extend(listed.approvals)
            return types.ElicitResult(action="accept", content={"decision": "allow_once"})
        return answer

    async def run() -> list[types.CallToolResult]:
        async with mcp_client(daemon.socket, ws, "--session", session.id, elicitation=answer_as("A")) as a, \
                mcp_client(daemon.socket, ws, "--session", session.id, elicitation=answer_as("B")) as b:
            await asyncio.gather(a.list_tools(), b.list_tools())        # both bound (watching) before a call
            async with asyncio.timeout(WAIT):
                return list(await asyncio.gather(a.call_tool("write_file", {"path": "a-file.txt", "content": "A"}),
                                                 b.call_tool("write_file", {"path": "b-file.txt", "content": "B"})))
    try:
        results = asyncio.run(run())
        events = daemon.stub.QueryEvents(pb.QueryEventsRequest(session_id=session.id,
                                                               types=["PermissionRequested"])).events
    finally:
        daemon.stub.CloseSession(pb.CloseSessionRequest(session_id=session.id), timeout=60)
    assert sorted(name for name, message in asked if "a-file.txt" in message) == ["A"], asked
    assert sorted(name for name, message in asked if "b-file.txt" in message) == ["B"], asked
    assert [result.is_error for result in results] == [False, False], results
    assert (ws / "a-file.txt").read_text() == "A" and (ws / "b-file.txt").read_text() == "B"
    contexts = {held.execution_context_id for held in seen_held}
    assert len(seen_held) == 2 and len(contexts) == 2 and all(c.startswith("mcp-") for c in contexts), seen_held
    audited = {json.loads(event.data_json)["execution_context_id"] for event in events if event.tool == "fs.write"}
    assert audited == contexts, (audited, contexts)


async def _route_two_writes(socket: str, session_id: str, call_tags: tuple[str, str],
                            waiter_tags: tuple[str, str]) -> tuple[list[str], list[str]]:
    """Two Bindings on one session (each with its own event watch, as two processes have) wait for
    a write each (``waiter_tags``: their ids, "" for a waiter as untagged); two WriteFile calls are
    held (``call_tags``: "" for the old shape, no id). Which calls' events each Binding handed to
    its waiter, by path; every held call is denied at the end."""
    mcp_daemon = McpDaemon(socket)
    session = await mcp_daemon.stub.GetSession(pb.GetSessionRequest(session_id=session_id))

    async def unchanged() -> None:
        return None
    bindings = [Binding(mcp_daemon, session, False, EventHub(mcp_daemon), unchanged) for _ in range(2)]
    for binding in bindings:
        await binding.start()
    held = [binding.expect("fs.write", tag) for tag, binding in zip(waiter_tags, bindings)]
    calls = [mcp_daemon.stub.WriteFile(pb.WriteFileRequest(
        session_id=session_id, path=f"{name}-file.txt", data=b"x", execution_context_id=tag))
        for tag, name in zip(call_tags, "ab")]
    try:
        pending = await _held_async(mcp_daemon, session_id, 2)
        paths = {call.call_id: json.loads(call.arguments_json)["paths"][0] for call in pending}
        routed: list[list[str]] = [[], []]
        async with asyncio.timeout(WAIT):
            # Every event of the two calls reaches both watches: wait until each was handed out or
            # dropped (the two watches have read past both), then read each waiter's queue.
            last = max(int(event.id) for event in (await mcp_daemon.stub.QueryEvents(pb.QueryEventsRequest(
                session_id=session_id, types=["PermissionRequested"]))).events)
            while any(binding._events._last < last for binding in bindings):
                await asyncio.sleep(0.05)
        for n, waiter in enumerate(held):
            while not waiter.events.empty():
                routed[n].append(Path(paths[waiter.events.get_nowait().call_id]).name)
        return routed[0], routed[1]
    finally:
        for call in await _held_async(mcp_daemon, session_id, 0):
            await mcp_daemon.stub.ResolveApproval(pb.ResolveApprovalRequest(
                session_id=session_id, call_id=call.call_id, decision="deny"))
        for call in calls:
            with contextlib.suppress(grpc.RpcError):      # denied
                await call
        for binding in bindings:
            await binding.close()
        await mcp_daemon.close()


async def _held_async(mcp_daemon: McpDaemon, session_id: str, count: int) -> list[pb.PendingApproval]:
    async with asyncio.timeout(WAIT):
        while True:
            listed = await mcp_daemon.stub.ListPendingApprovals(pb.ListPendingApprovalsRequest(session_id=session_id))
            if len(listed.approvals) >= count:
                return list(listed.approvals)
            await asyncio.sleep(0.05)


def test_tagged_writes_reach_their_own_binding_and_the_old_shape_is_the_control(daemon: Daemon,  # noqa: F811
                                                                                ws: Path) -> None:
    """Tagged: each Binding's waiter gets its own write's held call, and no other. A raw client's
    untagged write beside them (round 10's hostile pass: it became a question inside the other
    client's write_file) reaches neither. The control, waiters and calls of the shape before round
    10 (no execution_context_id): the first waiter for fs.write takes both calls, in both Bindings,
    so each client would be asked about the other's write."""
    tags = ("mcp-test-0", "mcp-test-1")
    session = _held_session(daemon, ws)
    try:
        tagged = asyncio.run(_route_two_writes(daemon.socket, session.id, tags, tags))
        raw_beside = asyncio.run(_route_two_writes(daemon.socket, session.id, (tags[0], ""), tags))
        untagged = asyncio.run(_route_two_writes(daemon.socket, session.id, ("", ""), ("", "")))
    finally:
        daemon.stub.CloseSession(pb.CloseSessionRequest(session_id=session.id), timeout=60)
    assert tagged == (["a-file.txt"], ["b-file.txt"]), tagged
    assert raw_beside == (["a-file.txt"], []), raw_beside
    assert sorted(untagged[0]) == sorted(untagged[1]) == ["a-file.txt", "b-file.txt"], untagged


def _route(events: list[pb.Event]) -> dict[str, list[int]]:
    """Which waiter each event was handed to, on a Binding with no daemon behind it."""
    binding = Binding.__new__(Binding)
    binding._waiting = []
    waiters = {"write-a": binding.expect("fs.write", "mcp-a"), "write-b": binding.expect("fs.write", "mcp-b"),
               "shell": binding.expect("shell.exec", "mcp-s"), "upstream": binding.expect("github.create", "mcp-g"),
               "old-read": binding.expect("fs.read")}
    for event in events:
        binding._route(event, json.loads(event.data_json or "{}").get("execution_context_id", ""))
    got: dict[str, list[int]] = {}
    for name, waiter in waiters.items():
        while not waiter.events.empty():
            got.setdefault(name, []).append(int(waiter.events.get_nowait().id))
    return got


def _event(number: int, tool: str, context_id: str) -> pb.Event:
    return pb.Event(id=number, type="PermissionRequested", tool=tool,
                    data_json=json.dumps({"execution_context_id": context_id}))


def test_route_goes_by_context_id_and_untagged_calls_only_to_untagged_waiters() -> None:
    """A tagged held call goes to the waiter with its id, whatever its tool; one tagged with an id
    no waiter has (another client's) goes nowhere; an untagged one (a raw client's, an older
    daemon's file RPC) never goes to a waiter whose own calls carry ids (a write, a command, an
    external tool: each would ask this client's person about a call it did not make), only to an
    untagged waiter for its daemon tool (the control: the fallback still serves such a caller)."""
    got = _route([_event(1, "fs.write", "mcp-b"), _event(2, "fs.write", "mcp-other"), _event(3, "fs.write", ""),
                  _event(4, "shell.exec", "mcp-s"), _event(5, "shell.exec", ""), _event(6, "github.create", ""),
                  _event(7, "github.create", "mcp-g"), _event(8, "fs.read", ""), _event(9, "fs.list", "")])
    assert got == {"write-b": [1], "shell": [4], "upstream": [7], "old-read": [8]}, got


def test_a_held_sandboxctl_write_is_tagged_and_says_how_to_answer(daemon: Daemon, ws: Path) -> None:  # noqa: F811
    """`sandboxctl write` off a terminal, held: it says how to answer (approve or deny, with the
    call's id), its held call carries its sandboxctl-PID-RANDOM tag, and approved it writes."""
    session = _held_session(daemon, ws)
    try:
        writer = subprocess.Popen([SANDBOXCTL, "--socket", daemon.socket, "write", session.id, "ctl-file.txt"],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV,
                                  cwd="/")
        assert writer.stdin is not None
        writer.stdin.write(b"from sandboxctl")
        writer.stdin.close()
        (held,) = asyncio.run(_held(daemon, session.id, 1))
        assert held.execution_context_id.startswith(f"sandboxctl-{writer.pid}-"), held
        assert writer.stderr is not None
        said = [writer.stderr.readline()]
        while b" approve " not in said[-1] and said[-1]:             # its hint, before it is answered
            said.append(writer.stderr.readline())
        daemon.stub.ResolveApproval(pb.ResolveApprovalRequest(session_id=session.id, call_id=held.call_id,
                                                               decision="allow_once"))
        assert writer.stdout is not None
        out, rest = writer.stdout.read(), writer.stderr.read()    # both small: read to their ends
        writer.wait(timeout=WAIT)
        err = b"".join(said) + rest
    finally:
        daemon.stub.CloseSession(pb.CloseSessionRequest(session_id=session.id), timeout=60)
    assert writer.returncode == 0 and out.strip() == b"15", (out, err)
    assert f"approve {session.id} {held.call_id}".encode() in err, err
    assert (ws / "ctl-file.txt").read_text() == "from sandboxctl"


def test_a_held_sandboxctl_ls_is_asked_in_place_on_a_terminal(daemon: Daemon, ws: Path,  # noqa: F811
                                                              tmux: Callable[[str], Tmux]) -> None:  # noqa: F811
    """On a terminal, `sandboxctl ls` held asks in place as exec does: n denies (exit 1, nothing
    listed); the control, y, lists the workspace."""
    (ws / "listed-here.txt").write_text("x")
    session = _held_session(daemon, ws)
    try:
        denied = tmux(ctl_command(daemon, "ls", session.id))
        denied.expect("[n] deny ?", within=WAIT)
        assert "  tool:    fs.list" in denied.screen().splitlines(), denied.screen()
        denied.keys("n")
        screen = denied.expect("EXIT=", within=WAIT)
        assert "EXIT=1" in screen and "PERMISSION_DENIED" in screen and "listed-here.txt" not in screen, screen
        allowed = tmux(ctl_command(daemon, "ls", session.id))
        allowed.expect("[n] deny ?", within=WAIT)
        allowed.keys("y")
        screen = allowed.expect("EXIT=", within=WAIT)
        assert "EXIT=0" in screen and "listed-here.txt" in screen, screen
    finally:
        daemon.stub.CloseSession(pb.CloseSessionRequest(session_id=session.id), timeout=60)


def test_a_context_id_is_bounded(daemon: Daemon, ws: Path) -> None:  # noqa: F811
    """Kept with a held call and its events: one past 1024 characters is INVALID_ARGUMENT, saying so."""
    session = _held_session(daemon, ws)
    try:
        with pytest.raises(grpc.RpcError) as refused:
            daemon.stub.WriteFile(pb.WriteFileRequest(session_id=session.id, path="f", data=b"",
                                                      execution_context_id="x" * 1025), timeout=60)
    finally:
        daemon.stub.CloseSession(pb.CloseSessionRequest(session_id=session.id), timeout=60)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value
    assert "execution_context_id" in (refused.value.details() or ""), refused.value.details()
