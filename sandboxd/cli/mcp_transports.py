"""The transports of `sandboxd mcp`: stdio (one client, one session), or streamable HTTP on a
Unix socket or a loopback port (a session per MCP session). HTTP is for the caller's own uid,
outside any sandbox, with this server's bearer token (cli.mcp_door): the Unix socket is created
mode 0600, a connection of another uid or from inside a sandbox gets 403 before any MCP message
is read (cli.mcp_accept: what such connections hold is bounded), a request without the token 401;
and the listening socket is registered with the daemon
before anything is served, so no sandbox's connect() reaches it. An HTTP session no request
reached for ``idle_timeout`` seconds is ended (with its sandboxd session) as a DELETE would."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import stat
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import anyio

from mcp.server.runner import serve_loop
from mcp.server.stdio import stdio_server

from sandboxd.mcp.daemon import Daemon, SessionSpec
from sandboxd.mcp.gateway.router import Gateway, GatewaySetup
from sandboxd.mcp.handlers import NOTIFY, App, build_server
from sandboxd.printable import printable
from sandboxd.v1 import sandboxd_pb2 as pb

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


@contextlib.asynccontextmanager
async def _gateway(daemon: Daemon, ctl: str, setup: GatewaySetup | None) -> AsyncIterator[Gateway | None]:
    """--gateway: the upstreams started (those started with the gateway) before anything is
    served, and closed (their sessions with them) when serving ends."""
    if setup is None:
        yield None
        return
    gateway = setup.gateway(daemon, ctl)
    try:
        await gateway.start()
        yield gateway
    finally:
        with anyio.CancelScope(shield=True):
            await gateway.close()


async def serve_stdio(socket_path: str, spec: SessionSpec, ctl: str, gateway: GatewaySetup | None = None) -> None:
    daemon = Daemon(socket_path)
    try:
        # The session is opened before serving, so a bad flag or an unreachable daemon is a clear
        # error at start, not a failure of the client's first call.
        first = await daemon.open(spec)
        app = App(daemon, spec, ctl, first)
        try:
            async with _gateway(daemon, ctl, gateway) as app.gateway:
                server = build_server(app)
                async with anyio.create_task_group() as group:
                    group.start_soon(_cancel_on_signals, group.cancel_scope)
                    async with _stdio_streams() as (read_stream, write_stream):
                        # The handshake era (initialize): the one every MCP client speaks today, and the one
                        # in which a server may ask the client (elicitation) and notify it (list_changed).
                        await serve_loop(server, read_stream, write_stream, lifespan_state=app,
                                         init_options=server.create_initialization_options(NOTIFY))
                    group.cancel_scope.cancel()
        finally:
            unused = app.take_first()        # a client that left before its first request
            if unused is not None and unused[1]:
                await daemon.stub.CloseSession(pb.CloseSessionRequest(session_id=unused[0].id), timeout=30)
    finally:
        await daemon.close()


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


@dataclass(frozen=True)
class HttpOptions:
    """What `sandboxd mcp --http` takes besides the session's flags."""

    listen: tuple[str, int] | str                 # (loopback host, port), or a Unix socket's path
    token_file: str = ""                          # "": the user's directory in the daemon's place
    idle_timeout: float = 600.0                   # an MCP session with no request for this long ends
    max_sessions: int = 64


async def serve_http(socket_path: str, spec: SessionSpec, ctl: str, options: HttpOptions,
                     gateway: GatewaySetup | None = None) -> None:
    daemon = Daemon(socket_path)
    try:
        await _serve_http(daemon, spec, ctl, options, gateway)
    finally:
        await daemon.close()


# Host headers a request may carry (the SDK's DNS rebinding wall): on a loopback port, a loopback
# name with a port; on a Unix socket also without one (curl --unix-socket sends "localhost").
_LOOPBACK_HOSTS = ["127.0.0.1:*", "localhost:*", "[::1]:*"]
_PORTLESS_HOSTS = ["127.0.0.1", "localhost", "[::1]"]
_LOOPBACK_ORIGINS = ["http://127.0.0.1:*", "http://localhost:*", "http://[::1]:*"]


async def _serve_http(daemon: Daemon, spec: SessionSpec, ctl: str, options: HttpOptions,
                      gateway: GatewaySetup | None) -> None:
    import uvicorn
    from mcp.server.transport_security import TransportSecuritySettings

    from sandboxd.cli import mcp_accept, mcp_door
    from sandboxd.kernel.rlimits import raise_nofile_limit

    listen = options.listen
    given = mcp_door.runtime_token()
    if given is not None and options.token_file:
        raise ValueError(f"--token-file and ${mcp_door.TOKEN_ENV} both name the token: use one")
    if spec.attach:
        await daemon.open(spec)                          # an attached session must exist and be the caller's
    descriptors = raise_nofile_limit()                   # room for the owner's connections (the bound: mcp_accept)
    listener = _listen(listen)
    token, token_path = given or mcp_door.new_token(), ""
    try:
        # Registered before anything is served: from here on no sandbox's connect() reaches it.
        channel = await daemon.stub.RegisterApprovalChannel(pb.RegisterApprovalChannelRequest())
        if given is None:
            token_path = options.token_file or os.path.join(channel.secrets_dir, mcp_door.token_file_name(listen))
            mcp_door.write_token(token_path, token)
        where = (f"http://localhost/mcp on the Unix socket {listen}" if isinstance(listen, str) else
                 f"http://{'[' + listen[0] + ']' if ':' in listen[0] else listen[0]}:{listen[1]}/mcp")
        source = f"the token in {token_path}" if token_path else f"${mcp_door.TOKEN_ENV}"
        sys.stderr.write(f"sandboxd mcp: serving {printable(where)}; clients send `Authorization: Bearer` with "
                         f"{printable(source)}\n")
        sys.stderr.flush()
        app = App(daemon, spec, ctl)
        async with _gateway(daemon, ctl, gateway) as app.gateway:       # once per process, for every session
            server = build_server(app)
            security = TransportSecuritySettings(
                enable_dns_rebinding_protection=True, allowed_origins=_LOOPBACK_ORIGINS,
                allowed_hosts=_LOOPBACK_HOSTS + (_PORTLESS_HOSTS if isinstance(listen, str) else []))
            asgi: Any = mcp_door.BearerOnly(_HandshakeOnly(server.streamable_http_app(
                transport_security=security, session_idle_timeout=options.idle_timeout,
                max_sessions=options.max_sessions)), token)
            config = uvicorn.Config(asgi, log_level="warning", log_config=PRINTABLE_LOGS, lifespan="on")
            await mcp_accept.Server(config, mcp_accept.Doorkeeper(listener, mcp_door.PeerCheck(),
                                                                  descriptors)).serve()
    finally:
        listener.close()
        if isinstance(listen, str):
            with contextlib.suppress(OSError):
                os.unlink(listen)
        if token_path:
            mcp_door.remove_token(token_path, token)


def _listen(listen: tuple[str, int] | str) -> socket.socket:
    """The listening socket, bound here rather than by uvicorn: a Unix socket mode 0600 from the
    start (uvicorn makes its 0666), and both held before the daemon is asked to register them."""
    if isinstance(listen, str):
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISSOCK(os.lstat(listen).st_mode):
                os.unlink(listen)                        # a socket left by an earlier run
        old = os.umask(0o177)
        try:
            listener.bind(listen)
        finally:
            os.umask(old)
    else:
        listener = socket.socket(socket.AF_INET6 if ":" in listen[0] else socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind(listen)
        except OSError:
            listener.close()
            raise
    # The kernel's longest queue: another user's flood fills a short one, and then the owner's
    # connect waits for a retransmitted SYN (a second or more) instead of its turn.
    listener.listen(socket.SOMAXCONN)
    return listener
