"""`sandboxd mcp --review` against a real daemon: the session keeps its writes for a person, the
model is offered list_changes and diff_changes (its own change set, read-only) and nothing that
applies or discards; the control without --review writes to the host and offers neither."""

from __future__ import annotations

import asyncio
from pathlib import Path

import mcp_types as types

from daemon_fixtures import client, daemon, ws  # noqa: F401 - pytest fixtures
from daemon_helpers import Daemon
from mcp_helpers import mcp_client, structured, text, tool_names
from sandboxd.client import SandboxClient
from sandboxd.v1 import sandboxd_pb2 as pb


def test_review_session_offers_its_change_set_read_only(daemon: Daemon, ws: Path, client: SandboxClient) -> None:
    (ws / "kept.txt").write_text("host's\n")
    before = {path.name: path.read_bytes() for path in ws.iterdir()}

    async def scenario() -> dict[str, object]:
        async with mcp_client(daemon.socket, ws, "--review", "--approval", "never") as mcp:
            listing = await mcp.list_tools()
            sessions = [s for s in client.stub.ListSessions(pb.ListSessionsRequest()).sessions
                        if s.workspace == str(ws)]
            return {
                "tools": tool_names(listing),
                "shell": next(tool.description or "" for tool in listing.tools if tool.name == "shell"),
                "review": [s.review for s in sessions],
                "write": await mcp.call_tool("write_file", {"path": "new.txt", "content": "made in review\n"}),
                "edit": await mcp.call_tool("shell", {"command": "echo changed > kept.txt"}),
                "changes": await mcp.call_tool("list_changes", {}),
                "diff": await mcp.call_tool("diff_changes", {"paths": ["kept.txt"]}),
                "bad": await mcp.call_tool("list_changes", {"paths": "kept.txt"}),
                "apply": await mcp.call_tool("apply_changes", {}),
            }

    out = asyncio.run(scenario())
    tools = out["tools"]
    assert isinstance(tools, list) and {"list_changes", "diff_changes"} <= set(tools)
    assert not any("apply" in name or "discard" in name for name in tools if name != "apply_patch"), tools
    assert out["review"] == [True]
    assert "review mode" in str(out["shell"])
    write, edit, changes, diff, bad, apply = (out[k] for k in ("write", "edit", "changes", "diff", "bad", "apply"))
    assert isinstance(write, types.CallToolResult) and not write.is_error, write
    assert isinstance(edit, types.CallToolResult) and not edit.is_error, edit
    # The host saw nothing: the same names, the same bytes.
    assert {path.name: path.read_bytes() for path in ws.iterdir()} == before
    assert isinstance(changes, types.CallToolResult) and not changes.is_error, changes
    listed = {(c["path"], c["kind"]) for c in structured(changes)["changes"]}
    assert {("new.txt", "added"), ("kept.txt", "modified")} <= listed, listed
    assert isinstance(diff, types.CallToolResult) and not diff.is_error
    assert "-host's" in text(diff) and "+changed" in text(diff) and "new.txt" not in text(diff)
    assert isinstance(bad, types.CallToolResult) and bad.is_error and "paths must be" in text(bad)
    # The model cannot apply its own changes: no such tool.
    assert isinstance(apply, types.CallToolResult) and apply.is_error and "unknown tool" in text(apply)


def test_control_without_review_writes_the_host_and_offers_no_review_tools(daemon: Daemon, ws: Path) -> None:
    async def scenario() -> tuple[list[str], types.CallToolResult]:
        async with mcp_client(daemon.socket, ws, "--approval", "never") as mcp:
            names = tool_names(await mcp.list_tools())
            return names, await mcp.call_tool("write_file", {"path": "direct.txt", "content": "direct\n"})

    names, write = asyncio.run(scenario())
    assert not write.is_error and (ws / "direct.txt").read_text() == "direct\n"
    assert "list_changes" not in names and "diff_changes" not in names


def test_checkpoint_calls_marks_a_point_before_each_shell_call_that_a_person_rolls_back_to(
        daemon: Daemon, ws: Path, client: SandboxClient) -> None:  # noqa: F811
    """`sandboxd mcp --review --checkpoint-calls`: each shell call after a change marks a checkpoint
    labelled with the call; rolling back to the last one undoes the model's last call only."""
    async def scenario() -> str:
        async with mcp_client(daemon.socket, ws, "--review", "--checkpoint-calls", "--approval", "never") as mcp:
            for command in ("echo one > a.txt", "echo two > b.txt", "rm a.txt"):
                result = await mcp.call_tool("shell", {"command": command})
                assert not result.is_error, result
            session = next(s for s in client.stub.ListSessions(pb.ListSessionsRequest()).sessions
                           if s.workspace == str(ws))
            marked = client.list_checkpoints(session.id)
            assert [item.id for item in marked] == [1, 2], marked
            assert all(item.call_id and item.label.startswith(f"before {item.call_id}: ") for item in marked), marked
            client.rollback_changes(session.id, 2)                  # before `rm a.txt`
            return text(await mcp.call_tool("shell", {"command": "cat a.txt b.txt"}))

    shown = asyncio.run(scenario())
    assert "exit status 0" in shown and shown.split()[-2:] == ["one", "two"], shown
    assert not (ws / "a.txt").exists()                              # the host: nothing applied
