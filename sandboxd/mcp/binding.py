"""One MCP connection's sandboxd session, and the one event watch that serves it.

The watch (WatchEvents: PermissionRequested and PolicyChanged of this session) turns a policy
change into `notifications/tools/list_changed`, and hands each held call to the tool call that
made it: a command by its execution context id (unique per MCP call), any other tool by its name
(first come, first served; the daemon's file tools carry no context id).

When the connection ends (the client closed stdin, was killed, or its HTTP session ended), every
call still running is cancelled (the daemon kills a cancelled command's process tree) and the
session is closed, unless it was attached with --session."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable

import grpc

from sandboxd.mcp.daemon import Daemon
from sandboxd.v1 import sandboxd_pb2 as pb

log = logging.getLogger("sandboxd.mcp")
WATCHED = ("PermissionRequested", "PolicyChanged")


class HeldCalls:
    """Where one tool call waits for the PermissionRequested events of its own daemon calls."""

    def __init__(self, daemon_tool: str, context_id: str) -> None:
        self.daemon_tool, self.context_id = daemon_tool, context_id
        self.events: asyncio.Queue[pb.Event] = asyncio.Queue()


class Binding:
    def __init__(self, daemon: Daemon, session: pb.Session, owned: bool,
                 tools_changed: Callable[[], Awaitable[None]]) -> None:
        self.daemon, self.session, self.owned = daemon, session, owned
        self.session_id = session.id
        self._tools_changed = tools_changed
        self._waiting: list[HeldCalls] = []
        self._calls: set[grpc.aio.Call] = set()
        self._since = time.time()
        self._watch = asyncio.get_running_loop().create_task(self._watch_events())

    # -- calls in flight -------------------------------------------------------------------------

    def expect(self, daemon_tool: str, context_id: str = "") -> HeldCalls:
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
        for held in self._waiting:
            if context_id and held.context_id == context_id:
                held.events.put_nowait(event)
                return
        for held in self._waiting:
            if not held.context_id and not context_id and held.daemon_tool == event.tool:
                held.events.put_nowait(event)
                return

    async def _watch_events(self) -> None:
        request = pb.WatchEventsRequest(session_id=self.session_id, types=list(WATCHED))
        try:
            async for event in self.daemon.stub.WatchEvents(request):
                if event.time < self._since:       # history from before this connection
                    continue
                if event.type == "PolicyChanged":
                    await self._tools_changed()
                else:
                    data = json.loads(event.data_json or "{}")
                    self._route(event, str(data.get("execution_context_id") or ""))
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.CANCELLED:
                log.warning("sandboxd mcp: the event watch ended: %s", error.details())
        except Exception:                           # noqa: BLE001 - a closed connection while notifying
            log.debug("the event watch ended", exc_info=True)

    # -- the end ---------------------------------------------------------------------------------

    async def close(self) -> None:
        """Cancel what still runs (the daemon kills those trees), then close an owned session."""
        self._watch.cancel()
        for call in list(self._calls):
            call.cancel()
        if self.owned:
            try:
                await self.daemon.stub.CloseSession(pb.CloseSessionRequest(session_id=self.session_id), timeout=30)
            except grpc.RpcError as error:
                log.warning("sandboxd mcp: could not close session %s: %s", self.session_id, error.details())
