"""The transports of `sandboxd mcp`: stdio (one client, one session), or streamable HTTP on a
Unix socket or a loopback port (a session per MCP session), for the caller's own uid only: the
Unix socket is created mode 0600, and a TCP client whose socket belongs to another uid (found
through the kernel, sock_diag) is refused with 403 before any MCP message is read."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import stat
from collections.abc import AsyncIterator
from typing import Any

import anyio

from mcp.server.lowlevel import NotificationOptions
from mcp.server.runner import serve_loop
from mcp.server.stdio import stdio_server

from sandboxd.mcp.daemon import Daemon, SessionSpec
from sandboxd.mcp.handlers import App, build_server
from sandboxd.v1 import sandboxd_pb2 as pb

_NOTIFY = NotificationOptions(tools_changed=True)
# uvicorn's own log set-up would print its lines raw, beside ours: without it they reach the
# printable handler `sandboxd mcp` puts on the root logger (cli.mcp.log_printable).
PRINTABLE_LOGS = None


# The longest JSON-RPC line read from stdin: a write_file of the daemon's largest request (4 MiB),
# JSON-escaped, with room to spare.
MAX_LINE = 32 << 20


class _PipeLines:
    """stdin lines and stdout writes on the event loop itself. The SDK's default stdio wraps the
    files in threads, a thread hop per message each way: most of the latency `sandboxd mcp` adds
    to a call (tests/bench_mcp.py)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader, self._writer = reader, writer

    def __aiter__(self) -> "_PipeLines":
        return self

    async def __anext__(self) -> str:
        line = await self._reader.readline()
        if not line:
            raise StopAsyncIteration
        return line.decode("utf-8", "replace")

    async def write(self, text: str) -> None:
        self._writer.write(text.encode())

    async def flush(self) -> None:
        await self._writer.drain()


def _is_pipe(fd: int) -> bool:
    mode = os.fstat(fd).st_mode
    return stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)


@contextlib.asynccontextmanager
async def _stdio_streams() -> AsyncIterator[Any]:
    if not (_is_pipe(0) and _is_pipe(1)):              # a file or a terminal: the SDK's threads
        async with stdio_server() as streams:
            yield streams
        return
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=MAX_LINE)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), open(0, "rb", closefd=False))
    transport, protocol = await loop.connect_write_pipe(asyncio.streams.FlowControlMixin,
                                                        open(1, "wb", closefd=False))
    pipes = _PipeLines(reader, asyncio.StreamWriter(transport, protocol, None, loop))
    try:
        async with stdio_server(stdin=pipes, stdout=pipes) as streams:   # type: ignore[arg-type]
            yield streams
    finally:
        transport.close()


async def _cancel_on_signals(scope: anyio.CancelScope) -> None:
    """SIGTERM, SIGHUP or SIGINT (a client stopping its server, a closed terminal) end the serving
    loop the way a closed stdin does: running calls cancelled, the session closed."""
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGHUP, signal.SIGINT) as signals:
        async for _signum in signals:
            scope.cancel()
            return


async def serve_stdio(socket_path: str, spec: SessionSpec, ctl: str) -> None:
    daemon = Daemon(socket_path)
    try:
        # The session is opened before serving, so a bad flag or an unreachable daemon is a clear
        # error at start, not a failure of the client's first call.
        first = await daemon.open(spec)
        app = App(daemon, spec, ctl, first)
        server = build_server(app)
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(_cancel_on_signals, group.cancel_scope)
                async with _stdio_streams() as (read_stream, write_stream):
                    # The handshake era (initialize): the one every MCP client speaks today, and the one
                    # in which a server may ask the client (elicitation) and notify it (list_changed).
                    await serve_loop(server, read_stream, write_stream, lifespan_state=app,
                                     init_options=server.create_initialization_options(_NOTIFY))
                group.cancel_scope.cancel()
        finally:
            unused = app.take_first()        # a client that left before its first request
            if unused is not None and unused[1]:
                await daemon.stub.CloseSession(pb.CloseSessionRequest(session_id=unused[0].id), timeout=30)
    finally:
        await daemon.close()


class _OwnUidOnly:
    """ASGI middleware: only clients whose TCP socket belongs to this process's uid."""

    def __init__(self, app: Any) -> None:
        self._app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope.get("client") and scope.get("server"):
            from sandboxd.kernel.inet_diag import tcp_peer_uid
            client, server = scope["client"], scope["server"]
            if tcp_peer_uid((client[0], client[1]), (server[0], server[1])) != os.getuid():
                await send({"type": "http.response.start", "status": 403,
                            "headers": [(b"content-type", b"text/plain")]})
                await send({"type": "http.response.body", "body": b"sandboxd mcp serves its own user only\n"})
                return
        await self._app(scope, receive, send)


class _HandshakeOnly:
    """ASGI middleware: a request of the 2026-07-28 per-request era (its MCP-Protocol-Version
    header) gets a JSON-RPC "method not found", on which clients fall back to the initialize
    handshake. That era has no connection, so no session to keep: every request would open and
    close one (and background processes would die with it)."""

    def __init__(self, app: Any) -> None:
        self._app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS

        header = next((value.decode("latin-1") for key, value in scope.get("headers", ())
                       if key == b"mcp-protocol-version"), None) if scope["type"] == "http" else None
        if header is None or header in HANDSHAKE_PROTOCOL_VERSIONS:
            await self._app(scope, receive, send)
            return
        body, more = b"", True
        while more and len(body) <= MAX_LINE:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        try:
            request_id = json.loads(body).get("id")
        except (ValueError, AttributeError):
            request_id = None
        answer = json.dumps({"jsonrpc": "2.0", "id": request_id, "error": {
            "code": -32601, "message": "sandboxd mcp speaks the initialize handshake (protocol 2025-11-25 and "
                                       "earlier)"}}).encode()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": answer})


async def serve_http(socket_path: str, spec: SessionSpec, ctl: str, listen: tuple[str, int] | str) -> None:
    daemon = Daemon(socket_path)
    try:
        await _serve_http(daemon, spec, ctl, listen)
    finally:
        await daemon.close()


async def _serve_http(daemon: Daemon, spec: SessionSpec, ctl: str, listen: tuple[str, int] | str) -> None:
    import uvicorn

    if spec.attach:
        await daemon.open(spec)                          # an attached session must exist and be the caller's
    app = App(daemon, spec, ctl)
    server = build_server(app)
    asgi: Any = _HandshakeOnly(server.streamable_http_app(host="127.0.0.1"))
    if isinstance(listen, str):
        # Bound here, not by uvicorn (which makes its socket 0666): mode 0600 from the start, so
        # only this uid (and root) can connect.
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISSOCK(os.lstat(listen).st_mode):
                os.unlink(listen)                        # a socket left by an earlier run
        old = os.umask(0o177)
        try:
            listener.bind(listen)
        finally:
            os.umask(old)
        listener.listen(128)
        try:
            await uvicorn.Server(uvicorn.Config(asgi, log_level="warning", log_config=PRINTABLE_LOGS,
                                               lifespan="on")).serve(sockets=[listener])
        finally:
            listener.close()
            with contextlib.suppress(OSError):
                os.unlink(listen)
    else:
        config = uvicorn.Config(_OwnUidOnly(asgi), host=listen[0], port=listen[1], log_level="warning",
                                log_config=PRINTABLE_LOGS, lifespan="on")
        await uvicorn.Server(config).serve()
