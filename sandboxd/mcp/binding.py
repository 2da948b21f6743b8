"""One MCP connection's sandboxd session: the tools it shows, and the calls it holds.

The process's event watch (mcp.events: PermissionRequested and PolicyChanged) turns a policy
change into `notifications/tools/list_changed`, and hands each held call to the tool call that
made it, by its execution context id: each MCP tool call tags every daemon call it makes with an
id of its own (mcp.handlers), and the daemon puts it on the held call's event. A held call tagged
with an id no waiter here has is another client's (a second `sandboxd mcp --session` on the same
session, `sandboxctl`): it is left alone, so no person is asked about a call they did not make.

A held call with no id at all is nobody's here: a raw gRPC client, or `sandboxctl` of an older
release, tags nothing, and its call must not become a question inside this client's tool call of
the same tool (round 10's hostile pass: a raw client's untagged WriteFile was asked about as part of
another client's write_file). It goes by its tool's name only to a waiter that tags nothing itself
(``expect`` without an id: a caller older than the ids), never to one whose own calls carry ids.
So against a daemon older than round 10, which drops the id of the file and background-process
RPCs (it knew it on Exec and Authorize only), those held calls are not asked about here: the
person answers them with `sandboxctl approvals`.

The tools a session shows (``visible``: the daemon's ListTools, less what a read-only sandbox
hides) are the only ones it runs: a hidden tool called anyway is refused (mcp.handlers), so the
list a client was given and what runs never disagree. It is read again after each policy change.

When the connection ends (the client closed stdin, was killed, or its HTTP session ended), every
call still running is cancelled (the daemon kills a cancelled command's process tree) and the
session is closed, unless it was attached with --session. If `sandboxd mcp` itself is killed,
the daemon closes its sessions (they were created with close_with_caller)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable

import grpc
import mcp_types as types

from sandboxd.mcp import catalog
from sandboxd.mcp.daemon import Daemon
from sandboxd.mcp.events import EventHub
from sandboxd.v1 import sandboxd_pb2 as pb

log = logging.getLogger("sandboxd.mcp")


class HeldCalls:
    """Where one tool call waits for the PermissionRequested events of its own daemon calls."""

    def __init__(self, daemon_tool: str, context_id: str) -> None:
        self.daemon_tool, self.context_id = daemon_tool, context_id
        self.events: asyncio.Queue[pb.Event] = asyncio.Queue()


class Binding:
    def __init__(self, daemon: Daemon, session: pb.Session, owned: bool, events: EventHub,
                 tools_changed: Callable[[], Awaitable[None]], *, checkpoint_calls: bool = False) -> None:
        self.daemon, self.session, self.owned = daemon, session, owned
        self.checkpoint_calls = checkpoint_calls     # each shell call marks a checkpoint (review sessions)
        self.session_id = session.id
        self._events = events
        self._tools_changed = tools_changed
        self._waiting: list[HeldCalls] = []
        self._calls: set[grpc.aio.Call] = set()
        self._visible: list[types.Tool] | None = None

    async def start(self) -> None:
        """Watch this session's events (before any call of it can be held)."""
        await self._events.subscribe(self.session_id, self._on_event)

    # -- the tools it shows ----------------------------------------------------------------------

    async def visible(self, fresh: bool = False) -> list[types.Tool]:
        """The tools this session shows (and runs): asked of the daemon when ``fresh``, or after a
        policy change."""
        shown = self._visible
        if shown is None or fresh:
            session, listed = await asyncio.gather(
                self.daemon.stub.GetSession(pb.GetSessionRequest(session_id=self.session_id)),
                self.daemon.stub.ListTools(pb.ListToolsRequest(session_id=self.session_id)))
            shown = catalog.visible(session, [tool.name for tool in listed.tools])
            self.session, self._visible = session, shown
        return shown

    # -- calls in flight -------------------------------------------------------------------------

    def expect(self, daemon_tool: str, context_id: str = "") -> HeldCalls:
        """Wait for the held calls tagged ``context_id`` ("": untagged ones of ``daemon_tool``)."""
        held = HeldCalls(daemon_tool, context_id)
        self._waiting.append(held)
        return held

    def forget(self, held: HeldCalls) -> None:
        self._waiting.remove(held)

    def track(self, call: grpc.aio.Call) -> None:
        self._calls.add(call)

    def untrack(self, call: grpc.aio.Call) -> None:
        self._calls.discard(call)

    def _route(self, event: pb.Event, context_id: str) -> None:
        """Hand a held call to the tool call that made it (``context_id``: the event's), or to none.
        An untagged one goes only to a waiter as untagged, by its tool (see the module's doc)."""
        if context_id:
            mine = (held for held in self._waiting if held.context_id == context_id)
        else:
            mine = (held for held in self._waiting if not held.context_id and held.daemon_tool == event.tool)
        held = next(mine, None)
        if held is not None:
            held.events.put_nowait(event)

    async def _on_event(self, event: pb.Event) -> None:
        if event.type == "PolicyChanged":
            self._visible = None                  # read again before the next list or call
            try:
                await self._tools_changed()
            except Exception:                       # noqa: BLE001 - a closed connection while notifying
                log.debug("could not notify the client of a tool list change", exc_info=True)
        else:
            data = json.loads(event.data_json or "{}")
            self._route(event, str(data.get("execution_context_id") or ""))

    # -- the end ---------------------------------------------------------------------------------

    async def close(self) -> None:
        """Cancel what still runs (the daemon kills those trees), then close an owned session."""
        self._events.unsubscribe(self.session_id, self._on_event)
        for call in list(self._calls):
            call.cancel()
        if self.owned:
            try:
                await self.daemon.stub.CloseSession(pb.CloseSessionRequest(session_id=self.session_id), timeout=30)
            except grpc.RpcError as error:
                log.warning("sandboxd mcp: could not close session %s: %s", self.session_id, error.details())
