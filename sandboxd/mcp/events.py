"""The one event watch of a `sandboxd mcp` process, shared by all its sessions.

The daemon counts long-lived streams per user (quotas.streams_per_uid, 4 by default). A watch per
MCP session, as there once was, let four HTTP sessions a client never ended take them all: the
user's next MCP sessions got no elicitation, and `sandboxctl approvals --follow` no stream. So a
process keeps one WatchEvents (PermissionRequested and PolicyChanged of every session its user
may see) while it has sessions to serve, and hands each event to every subscriber of the session
it is about (none is dropped for a later one: each Binding acts only on the calls it made).

It starts from the daemon's last event id, read before the first session's first call can be
held (``subscribe`` returns only then), so no held call is missed; after a failure it starts
again from the last event it saw, so none is missed then either.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import grpc

from sandboxd.mcp.daemon import Daemon
from sandboxd.v1 import sandboxd_pb2 as pb

log = logging.getLogger("sandboxd.mcp")
WATCHED = ("PermissionRequested", "PolicyChanged")
RETRY_FIRST, RETRY_MAX = 0.5, 30.0
Handler = Callable[[pb.Event], Awaitable[None]]


class EventHub:
    def __init__(self, daemon: Daemon) -> None:
        self._daemon = daemon
        self._handlers: dict[str, list[Handler]] = {}
        self._task: asyncio.Task[None] | None = None
        self._starting = asyncio.Lock()         # sessions subscribing at once start one watch
        self._last = 0                          # the last event id seen (or the start)

    async def subscribe(self, session_id: str, handler: Handler) -> None:
        """Hand ``session_id``'s events to ``handler`` from now on (its calls' events included), as
        to any other subscriber of that session."""
        self._handlers.setdefault(session_id, []).append(handler)
        async with self._starting:
            if self._task is None or self._task.done():
                self._last = (await self._daemon.stub.GetStatus(pb.GetStatusRequest())).events
                self._task = asyncio.get_running_loop().create_task(self._watch())

    def unsubscribe(self, session_id: str, handler: Handler) -> None:
        """No more events of ``session_id`` for ``handler`` (its other subscribers keep theirs); the
        stream ends with the last subscriber."""
        handlers = self._handlers.get(session_id, [])
        if handler in handlers:
            handlers.remove(handler)
        if not handlers:
            self._handlers.pop(session_id, None)
        if not self._handlers and self._task is not None:
            self._task.cancel()
            self._task = None

    async def _watch(self) -> None:
        delay = RETRY_FIRST
        while self._handlers:
            request = pb.WatchEventsRequest(types=list(WATCHED), from_sequence=self._last)
            try:
                async for event in self._daemon.stub.WatchEvents(request):
                    self._last, delay = max(self._last, event.id), RETRY_FIRST
                    for handler in list(self._handlers.get(event.session_id, ())):
                        await handler(event)
                log.warning("sandboxd mcp: the daemon ended the event watch; watching again in %.1f s", delay)
            except grpc.RpcError as error:
                if error.code() == grpc.StatusCode.CANCELLED:
                    return
                log.warning("sandboxd mcp: the event watch ended (%s: %s); watching again in %.1f s",
                            error.code().name, error.details(), delay)
            await asyncio.sleep(delay)
            delay = min(2 * delay, RETRY_MAX)
