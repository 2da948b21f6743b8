"""One upstream MCP server of the gateway, in its own sandboxd session, and the Fleet of them.

Each upstream gets a session of the calling user (``approval = never``: the person approves at the
gateway, and no approval ever widens an upstream's sandbox), labelled with the upstream's name,
with the sandbox, workspace, network and credentials its table gives, and the user's home hidden
(``hide_home``: the server never reads the person's keys). Its server runs there as
ONE long Exec call whose stdin and stdout are the MCP stdio transport (gateway/exec_stdio.py), and
an `mcp.client.session.ClientSession` talks to it (initialize, listings, notifications, resources,
prompts); a stdio upstream's tool calls take the transport's direct path beside it (one JSON line
each way, the result validated once: the SDK's session per call cost about 0.35 ms). Upstreams
never share a session.

The upstream is not trusted. Its own requests to us (sampling, elicitation, roots) are refused:
the client session declares none of those capabilities, so an upstream can never put a prompt in
front of the person. Its listings are bounded (1,024 tools, resources or prompts, 64 KiB each and
4 MiB in all, 64 pages), its results too (a tool result over 1 MiB serialized is replaced by an
error result saying so), and a call that outlives its timeout is cancelled
(``notifications/cancelled``) and fails. A server that
exits fails its pending calls with the exit status and the last lines of its stderr, and is
started again with back-off (1, 2, 4 ... 60 s, back to 1 s once it served a minute); its session
is reused while it is open.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import stat
import sys
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar
from urllib.parse import urlsplit

import anyio
import grpc
import grpc.aio
import mcp_types as types
from mcp.client.session import ClientSession
from mcp.shared.exceptions import MCPError
from pydantic import BaseModel

import sandboxd
from sandboxd.errors import InvalidPolicy
from sandboxd.mcp.daemon import Daemon, SessionSpec
from sandboxd.mcp.gateway.config import GatewayConfig, UpstreamConfig, default_workspace
from sandboxd.mcp.gateway.exec_stdio import DirectRequests, ServerProcess, exec_stdio_client
from sandboxd.policy.network import check_secret
from sandboxd.printable import printable
from sandboxd.v1 import sandboxd_pb2 as pb

log = logging.getLogger(__name__)

MAX_LISTED = 1024                 # tools (and resources, prompts) kept of one upstream's listing
MAX_PAGES = 64                    # pages of one listing: a cursor that never ends stops here
MAX_ITEM_BYTES = 64 << 10         # one tool (resource, prompt) as listed, serialized: a bigger one is left out
MAX_LISTING_BYTES = 4 << 20       # what one upstream's listing of one kind keeps in all
MAX_RESULT_BYTES = 1 << 20        # a CallToolResult, serialized
START_TIMEOUT_SECONDS = 60.0      # initialize and the first listings
START_WAIT_SECONDS = 10.0         # Fleet.start waits this long for the first tries; the rest go on behind
BACKOFF_SECONDS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0)
STEADY_SECONDS = 60.0             # served this long: its next fault starts the back-off at 1 s again
RELIST_INTERVAL_SECONDS = 1.0     # at most one listing per interval for list_changed notifications
OUTPUT_UNLIMITED = 1 << 62        # the server's output is the transport, never cut
CLIENT_INFO = types.Implementation(name="sandboxd-mcp-gateway", version="1")
GATEWAY_LABEL = "sandboxd-mcp-gateway"

Result = TypeVar("Result", bound=BaseModel)


class UpstreamError(Exception):
    """What went wrong with an upstream, for the model: printable, says what happened."""


class UpstreamRefused(UpstreamError):
    """The daemon refused its session's settings (INVALID_ARGUMENT: say, hide_home for a home that
    cannot be hidden): starting again would be refused again, so it is not retried on a timer."""


def session_spec(config: UpstreamConfig, environ: Mapping[str, str]) -> SessionSpec:
    """The upstream's own session: its policy from its table, approval never, its credentials'
    secrets from the gateway's environment (as `sandboxd mcp --credential` reads them)."""
    network_policy = None
    domains = list(config.allow_domains)
    host = urlsplit(config.url).hostname if config.url else None
    if host and config.sandbox == "workspace-write" and host not in domains:
        domains.append(host)                    # a url upstream: its bridge reaches the URL's host, nothing more
    if domains or config.credentials:
        # As cli.network_args.apply_network: an isolated network whose only way out is the proxy.
        network_policy = pb.SandboxPolicy(network_access=True, network_mode="isolated", allowed_domains=domains,
                                          credentials=list(config.credentials))
    secrets = {}
    for spec in config.credentials:
        name = spec.partition("=")[0]
        if name not in environ:
            raise UpstreamError(f"{config.name}: credential {name}: ${name} is not set in the gateway's environment: "
                                "set it to the secret")
        try:
            secrets[name] = pb.CredentialSecret(value=check_secret(name, os.fsencode(environ[name])))
        except InvalidPolicy as exc:
            raise UpstreamError(f"{config.name}: {printable(str(exc))}") from None
    return SessionSpec(workspace=config.workspace, sandbox=config.sandbox, network=config.network or bool(config.url),
                       writable_roots=config.writable_roots, approval="never",
                       labels={"client": GATEWAY_LABEL, "upstream": config.name}, network_policy=network_policy,
                       credential_secrets=secrets,
                       # A daemon session shows its owner's home read-only; an upstream server must not
                       # read the person's keys (~/.ssh, ~/.aws, ~/.config): the home is covered, its
                       # workspace inside it stays. danger-full-access has no walls to cover it with.
                       hide_home=config.sandbox != "danger-full-access")


def variables_of(config: UpstreamConfig, environ: Mapping[str, str]) -> dict[str, str]:
    """What an upstream takes from the gateway's environment: its credentials' secrets and its
    pass_env variables (those set)."""
    names = [spec.partition("=")[0] for spec in config.credentials] + list(config.pass_env)
    return {name: environ[name] for name in names if name in environ}


def gateway_variables(config: GatewayConfig, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """What all the upstreams of a gateway file take from the environment, for Fleet(environ=):
    read at start, before anything takes secrets out of the environment."""
    environ = os.environ if environ is None else environ
    return {name: value for upstream in config.upstreams for name, value in variables_of(upstream, environ).items()}


def private_directory(name: str, path: str) -> None:
    """An upstream's default workspace, ``STATE/sandboxd/gateway/NAME``: made 0700, and used only
    if every directory from your home down to it (``~/.local``, ``~/.local/state``, ``sandboxd``,
    ``gateway``; from ``$XDG_STATE_HOME`` when that is outside the home) is a real directory of
    yours that nobody else may write, and it is 0700. Another program of the user (an agent with
    the home as its workspace) could plant a link or a directory of its choosing there to hand the
    upstream a workspace; a group-writable ``~/.local`` lets others do the same. The walk opens
    each directory from the one above it (O_NOFOLLOW) and checks what it opened (fstat), so no
    link is followed between a check and the next step."""
    home = os.path.normpath(os.path.expanduser("~"))
    state = os.path.dirname(os.path.dirname(os.path.dirname(path)))        # $XDG_STATE_HOME or ~/.local/state
    if home != "/" and path.startswith(home + "/"):
        anchor = home
    else:
        anchor = state
        os.makedirs(anchor, mode=0o700, exist_ok=True)
    parts = os.path.relpath(path, anchor).split(os.sep)
    descriptor = os.open(anchor, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        where = anchor
        for index, part in enumerate(parts):
            last = index == len(parts) - 1
            where = os.path.join(where, part)
            with contextlib.suppress(FileExistsError):
                os.mkdir(part, mode=0o700, dir_fd=descriptor)
            try:
                inner = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=descriptor)
            except OSError:                        # ELOOP, ENOTDIR: a link or a file planted there
                inner, wrong = -1, "a link or not a directory"
            else:
                info = os.fstat(inner)
                mode = stat.S_IMODE(info.st_mode)
                wrong = (f"owned by uid {info.st_uid}" if info.st_uid != os.geteuid()
                         else f"mode {mode:o}" if mode & (0o077 if last else 0o022) else "")
            if inner >= 0:
                os.close(descriptor)
                descriptor = inner
            if wrong:
                need = "with mode 0700" if last else "that only you may write"
                raise UpstreamError(f"{name}: its private directory {printable(path)} needs {printable(where)} to be "
                                    f"a directory of yours {need}; it is {wrong}: remove it or fix its mode "
                                    f"(chmod {'700' if last else 'go-w'}), or give the upstream a workspace")
    finally:
        os.close(descriptor)


def check_bridge_visible(config: UpstreamConfig) -> None:
    """A url upstream's bridge is this interpreter and this sandboxd, run in a session that hides
    the user's home: installed in the home (a venv, pipx), they are not there to run."""
    if config.sandbox == "danger-full-access":
        return
    home = os.path.realpath(os.path.expanduser("~"))
    for what, path in (("the Python interpreter", sys.executable), ("sandboxd", os.path.dirname(sandboxd.__file__))):
        real = os.path.realpath(path)
        if home not in ("/", "") and (real == home or real.startswith(home + "/")):
            raise UpstreamError(f"{config.name}: a url upstream runs its HTTP bridge with {what} at "
                                f"{printable(real)}, inside your home, which the upstream's session hides: install "
                                "sandboxd outside your home (or give the server as command = [...])")


def exec_start(config: UpstreamConfig, session_id: str, environ: Mapping[str, str]) -> pb.ExecStart:
    """The server's one long call: its command (a url upstream: the HTTP bridge, by this interpreter),
    with its env and the named caller variables only."""
    overlay = dict(config.env)
    overlay.update({name: environ[name] for name in config.pass_env if name in environ})
    if config.command:
        argv = list(config.command)
    else:
        check_bridge_visible(config)
        argv = [sys.executable, "-m", "sandboxd.mcp.gateway.http_bridge", config.url,
                *(f"--credential={spec}" for spec in config.credentials)]
    return pb.ExecStart(session_id=session_id, argv=argv, env_overlay=overlay, timeout_seconds=0,
                        output_limit_bytes=OUTPUT_UNLIMITED)


async def _cancel_when(wait: Callable[[], Awaitable[Any]], scope: anyio.CancelScope) -> None:
    await wait()
    scope.cancel()


def _leaf(error: BaseException) -> BaseException:
    """The error inside task groups' exception groups: an UpstreamError if there is one."""
    while isinstance(error, BaseExceptionGroup):
        inner = [leaf for leaf in map(_leaf, error.exceptions) if isinstance(leaf, UpstreamError)]
        error = inner[0] if inner else _leaf(error.exceptions[0])
    return error


class Upstream:
    """One upstream server: its session, its server process, its MCP client session."""

    def __init__(self, daemon: Daemon, config: UpstreamConfig, on_change: Callable[[str], Awaitable[None]],
                 environ: Mapping[str, str] | None = None) -> None:
        self.name = config.name
        self.config = config
        self.session: pb.Session | None = None
        self._state = "stopped"
        self.tools: list[types.Tool] = []
        self.resources: list[types.Resource] = []
        self.prompts: list[types.Prompt] = []
        self.process: ServerProcess | None = None      # the current (or last) run of its server
        self.last_error = ""
        self._daemon = daemon
        self._on_change = on_change
        self._owns_session = False
        self._client: ClientSession | None = None
        self._direct: DirectRequests | None = None     # the current run's direct path (tools/call)
        self._runner: asyncio.Task[None] | None = None
        # The outcome of the next try to start it (None: ready; else why not); replaced as each is settled,
        # so that a caller arriving while it restarts waits for the try to come.
        self._attempt: asyncio.Future[str | None] | None = None
        self._stop = asyncio.Event()
        self._relist = asyncio.Event()
        self._dirty: set[str] = set()
        self._ready_at = 0.0
        # The variables it takes from the gateway's environment, read once (a restart finds the
        # same values); ``environ``: as read earlier (variables_of), before the gateway's own
        # --credential flags took theirs out of the environment.
        self._environ = variables_of(config, os.environ if environ is None else environ)

    @property
    def state(self) -> str:
        """"stopped" | "starting" | "ready" | "restarting" | "failed" | "closed"; a server whose call
        has ended is "restarting" at once, before the runner has wound it down."""
        if self._state == "ready" and self.process is not None and self.process.ended.is_set():
            return "restarting"
        return self._state

    @state.setter
    def state(self, value: str) -> None:
        self._state = value

    # -- the runner: one task per upstream, from the first start to close() --------------------------

    async def ensure_started(self) -> None:
        """Start it once (lazy or eager), and wait for the try under way; UpstreamError if it fails."""
        if self.state == "closed":
            raise UpstreamError(f"{self.name}: the gateway is closing")
        if self._attempt is None:
            self._attempt = asyncio.get_running_loop().create_future()
        if self._runner is None:
            self.state = "starting"
            self._runner = asyncio.get_running_loop().create_task(self._run(), name=f"gateway upstream {self.name}")
        if self.state == "ready" and self.process is not None and not self.process.ended.is_set():
            return
        error = await asyncio.shield(self._attempt)
        if error is not None:
            raise UpstreamError(error)

    def _settle(self, error: str | None) -> None:
        """Settle the try under way (None: ready); the next caller waits for the next try."""
        attempt, self._attempt = self._attempt, asyncio.get_running_loop().create_future()
        if attempt is not None and not attempt.done():
            attempt.set_result(error)

    async def _run(self) -> None:
        failures = 0
        while not self._stop.is_set():
            error = ""
            try:
                async with anyio.create_task_group() as watch:
                    watch.start_soon(self._stop_while_starting, watch.cancel_scope)
                    await self._serve()
                    watch.cancel_scope.cancel()
            except Exception as exc:  # noqa: BLE001 - whatever it was, the upstream restarts
                leaf = _leaf(exc)
                if isinstance(leaf, UpstreamRefused):
                    # Not a fault that passes: each caller is told why (a try each), none on a timer.
                    self.state, self.last_error, self._runner = "failed", str(leaf), None
                    log.warning("gateway: %s; not started again until it is called", leaf)
                    self._settle(str(leaf))
                    return
                if isinstance(leaf, UpstreamError):
                    error = str(leaf)
                else:
                    log.debug("gateway upstream %s", printable(self.name), exc_info=True)
                    error = f"{self.name}: {printable(type(leaf).__name__)}: {printable(str(leaf))[:500]}"
            was_ready, self._client, self._direct = self._state == "ready", None, None
            if self._stop.is_set():
                break
            if was_ready:
                # Gone: its lists with it (a client's next listing leaves them out), until it is back.
                gone = [kind for kind in ("prompts", "resources", "tools") if getattr(self, kind)]
                self.tools, self.resources, self.prompts = [], [], []
                self.state = "restarting"
                for kind in gone:
                    await self._on_change(kind)
            if not error:
                error = f"{self.name} stopped: {self.process.why_ended() if self.process else 'it never started'}"
            self.last_error = error
            self.state = "restarting" if was_ready else "failed"
            if was_ready and time.monotonic() - self._ready_at >= STEADY_SECONDS:
                failures = 0                 # it served a while: a new fault, not the same crash loop
            delay = BACKOFF_SECONDS[min(failures, len(BACKOFF_SECONDS) - 1)]
            failures += 1
            log.warning("gateway: %s; starting it again in %g s", error, delay)
            if not was_ready:                # a try that failed; after a crash, callers wait for the next try
                self._settle(error)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), delay)
            if not self._stop.is_set():
                self.state = "starting"
        self._settle(f"{self.name}: the gateway is closing")

    async def _stop_while_starting(self, scope: anyio.CancelScope) -> None:
        """close() ends a try that is not ready wherever it is (opening the session, a hung
        initialize); a ready one winds down in _serve."""
        await self._stop.wait()
        if self._client is None:
            scope.cancel()

    async def _open_session(self) -> pb.Session:
        """Its session: the one it had while that is open, else a new one."""
        if self.session is not None:
            try:
                session: pb.Session = await self._daemon.stub.GetSession(
                    pb.GetSessionRequest(session_id=self.session.id))
                if not session.closed_at:
                    self.session = session
                    return session
            except grpc.aio.AioRpcError:
                pass
        spec = session_spec(self.config, self._environ)
        if self.config.workspace == default_workspace(self.name):
            private_directory(self.name, self.config.workspace)
        try:
            opened, self._owns_session = await self._daemon.open(spec)
        except grpc.aio.AioRpcError as error:
            refused = error.code() == grpc.StatusCode.INVALID_ARGUMENT
            raise (UpstreamRefused if refused else UpstreamError)(
                f"{self.name}: its session could not be opened: {error.code().name}: "
                f"{printable(error.details() or '')}") from None
        self.session = opened
        return opened

    async def _serve(self) -> None:
        """One run of the server: start it, initialize, list, then follow it until it ends."""
        session = await self._open_session()
        self.process = process = ServerProcess(name=self.name)
        start = exec_start(self.config, session.id, self._environ)
        async with exec_stdio_client(self._daemon.stub, start, process) as (read_stream, write_stream, direct):
            async with ClientSession(read_stream, write_stream, message_handler=self._on_message,
                                     client_info=CLIENT_INFO) as client:
                before = self._listings()
                try:
                    with anyio.fail_after(START_TIMEOUT_SECONDS):
                        await client.initialize()
                        await self._list(client, {"tools", "resources", "prompts"})
                except TimeoutError:
                    tail = process.stderr_lines()
                    raise UpstreamError(f"{self.name} did not answer initialize and its listings within "
                                        f"{START_TIMEOUT_SECONDS:g} s" + (f"; its last stderr: {tail}" if tail else "")
                                        ) from None
                except MCPError as exc:
                    raise UpstreamError(self._failure(process, exc)) from None
                if self._stop.is_set():
                    return
                self._client, self._direct, self.state, self._ready_at = client, direct, "ready", time.monotonic()
                self._settle(None)
                # Started again (or at last): what its lists say now may differ from before.
                after = self._listings()
                for kind in sorted(kind for kind in after if after[kind] != before[kind]):
                    await self._on_change(kind)
                async with anyio.create_task_group() as tasks:
                    tasks.start_soon(self._follow_changes, client)
                    tasks.start_soon(_cancel_when, process.ended.wait, tasks.cancel_scope)
                    # Ready: close() leaves this loop, and the server is ended in order (stdin closed first).
                    tasks.start_soon(_cancel_when, self._stop.wait, tasks.cancel_scope)


    # -- listings -----------------------------------------------------------------------------------

    async def _on_message(self, message: Any) -> None:
        """The upstream's notifications: a list_changed marks that listing for the relister."""
        kinds: dict[type, str] = {types.ToolListChangedNotification: "tools",
                                  types.ResourceListChangedNotification: "resources",
                                  types.PromptListChangedNotification: "prompts"}
        kind = kinds.get(type(message))
        if kind is not None:
            self._dirty.add(kind)
            self._relist.set()

    def _listings(self) -> dict[str, list[dict[str, Any]]]:
        return {kind: [item.model_dump(by_alias=True, exclude_none=True) for item in getattr(self, kind)]
                for kind in ("tools", "resources", "prompts")}

    async def _follow_changes(self, client: ClientSession) -> None:
        while True:
            await self._relist.wait()
            self._relist.clear()
            kinds, self._dirty = self._dirty, set()
            try:
                with anyio.fail_after(self.config.timeout_seconds):
                    await self._list(client, kinds)
            except (MCPError, TimeoutError) as exc:
                log.warning("gateway: %s: listing its %s again failed: %s", printable(self.name),
                            ", ".join(sorted(kinds)), printable(str(exc))[:500])
                continue
            for kind in sorted(kinds):
                await self._on_change(kind)
            # An upstream that sends list_changed without end is listed (and its clients told) at
            # most once per interval: the notifications between are folded into the next listing.
            await anyio.sleep(RELIST_INTERVAL_SECONDS)

    async def _list(self, client: ClientSession, kinds: set[str]) -> None:
        capabilities = client.server_capabilities or types.ServerCapabilities()
        if "tools" in kinds and capabilities.tools is not None:
            self.tools = await self._pages(client.list_tools, "tools")
        if "resources" in kinds and capabilities.resources is not None:
            self.resources = await self._pages(client.list_resources, "resources")
        if "prompts" in kinds and capabilities.prompts is not None:
            self.prompts = await self._pages(client.list_prompts, "prompts")

    async def _pages(self, list_page: Callable[..., Awaitable[Any]], field: str) -> list[Any]:
        """One listing, read page by page: at most MAX_LISTED items and MAX_LISTING_BYTES kept, an
        item over MAX_ITEM_BYTES (serialized) left out, each cut logged once per listing."""
        items: list[Any] = []
        kept_bytes, left_out, cursor = 0, 0, None
        for _ in range(MAX_PAGES):
            page = await list_page(params=types.PaginatedRequestParams(cursor=cursor) if cursor else None)
            for item in getattr(page, field):
                size = len(item.model_dump_json(by_alias=True, exclude_none=True))
                if size > MAX_ITEM_BYTES or kept_bytes + size > MAX_LISTING_BYTES or len(items) >= MAX_LISTED:
                    left_out += 1
                    continue
                items.append(item)
                kept_bytes += size
            cursor = page.next_cursor
            if not cursor or len(items) >= MAX_LISTED or kept_bytes >= MAX_LISTING_BYTES:
                break
        if left_out or cursor:
            log.warning("gateway: %s lists more %s than the gateway keeps (at most %d, %d MiB in all, %d KiB each, "
                        "%d pages): %d kept, %d left out%s", printable(self.name), field, MAX_LISTED,
                        MAX_LISTING_BYTES >> 20, MAX_ITEM_BYTES >> 10, MAX_PAGES, len(items), left_out,
                        ", more pages not read" if cursor else "")
        return items

    # -- calls --------------------------------------------------------------------------------------

    def _failure(self, process: ServerProcess, error: MCPError) -> str:
        if error.code == types.CONNECTION_CLOSED or process.ended.is_set():
            return f"{self.name} stopped: {process.why_ended()}"
        return f"{self.name} answered with an error: {printable(error.message)[:2000]}"

    async def _request(self, what: str, timeout: float,
                       send: Callable[[ClientSession, DirectRequests], Awaitable[Result]]) -> Result:
        """One request to the upstream, started first if need be, bounded by ``timeout``."""
        with anyio.move_on_after(timeout) as waiting:
            await self.ensure_started()
        if waiting.cancelled_caught:
            raise UpstreamError(f"{self.name} did not start within {timeout:g} s: {self.last_error or 'starting'}")
        client, direct, process = self._client, self._direct, self.process
        if client is None or direct is None or process is None:
            raise UpstreamError(f"{self.name} is not running: {self.last_error or self.state}")
        try:
            # Abandoning a request (this scope's timeout) sends the upstream notifications/cancelled.
            with anyio.fail_after(timeout):
                result = await send(client, direct)
            # Serialized here once, as the client's transport will: a result that validates yet cannot be
            # written (a lone surrogate, nesting past pydantic's depth) fails this call only, not the gateway.
            result.model_dump_json(by_alias=True, exclude_none=True)
            return result
        except TimeoutError:
            raise UpstreamError(f"{self.name}: {printable(what)} timed out after {timeout:g} s (the upstream "
                                "was told to cancel it)") from None
        except MCPError as exc:
            raise UpstreamError(self._failure(process, exc)) from None
        except (RuntimeError, ValueError) as exc:          # a result that is not what MCP says
            raise UpstreamError(f"{self.name}: {printable(what)}: its answer is not valid MCP: "
                                f"{printable(str(exc))[:500]}") from None

    async def call_tool(self, tool: str, arguments: dict[str, Any], timeout: float) -> types.CallToolResult:
        """The upstream's tool ``tool``: a result over MAX_RESULT_BYTES is replaced by an error
        result saying so. A stdio upstream's call takes the direct path; a url upstream's (its
        bridge relays streamable HTTP) the client session's."""
        if self.config.command:
            return await self._request(f"tool {tool}", timeout,
                                       lambda client, direct: self._call_direct(client, direct, tool, arguments))
        result = await self._request(f"tool {tool}", timeout,
                                     lambda client, direct: client.call_tool(tool, arguments))
        size = len(result.model_dump_json(by_alias=True, exclude_none=True))
        return self._too_big(tool, size) if size > MAX_RESULT_BYTES else result

    async def _call_direct(self, client: ClientSession, direct: DirectRequests, tool: str,
                           arguments: dict[str, Any]) -> types.CallToolResult:
        """tools/call as one JSON line each way: the bound checked on the answer's line before
        anything is validated (the line is the result and a few dozen bytes of envelope), the
        result validated once, then against the tool's output schema as the SDK's session does
        (its compiled validator, cached per listing). A JSON-RPC error is an MCPError, a result
        that is not a CallToolResult a ValueError (both said by _request)."""
        answer = await direct.request("tools/call", {"name": tool, "arguments": arguments})
        if answer.invalid:
            raise ValueError(answer.invalid)
        if answer.size > MAX_RESULT_BYTES:
            return self._too_big(tool, answer.size)
        message = answer.message
        if "error" in message and "result" not in message:
            error = types.ErrorData.model_validate(message["error"], by_name=False)
            raise MCPError(error.code, error.message, error.data)
        if not isinstance(message.get("result"), dict):
            raise ValueError("the answer holds neither a result nor an error")
        result = types.CallToolResult.model_validate(message["result"], by_name=False)
        if not result.is_error:
            await client.validate_tool_result(tool, result)
        return result

    def _too_big(self, tool: str, size: int) -> types.CallToolResult:
        return types.CallToolResult(is_error=True, content=[types.TextContent(
            type="text", text=f"{self.name}'s tool {printable(tool)} returned {size} bytes, over the gateway's "
                              f"bound of {MAX_RESULT_BYTES >> 20} MiB: ask for less (a smaller range, a filter)")])

    async def read_resource(self, uri: str, timeout: float) -> types.ReadResourceResult:
        return await self._request(f"resource {uri}", timeout,
                                   lambda client, direct: client.read_resource(uri))

    async def get_prompt(self, name: str, arguments: dict[str, str] | None, timeout: float) -> types.GetPromptResult:
        return await self._request(f"prompt {name}", timeout,
                                   lambda client, direct: client.get_prompt(name, arguments))

    async def close(self) -> None:
        """End the server's call and close its session; idempotent."""
        if self.state == "closed":
            return
        self.state = "closed"
        self._stop.set()
        if self._runner is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._runner
        self._client = self._direct = None
        if self.session is not None and self._owns_session:
            with contextlib.suppress(grpc.aio.AioRpcError):
                await self._daemon.stub.CloseSession(pb.CloseSessionRequest(session_id=self.session.id))
        self.session = None


class Fleet:
    """Every upstream of one gateway process, shared by its MCP connections."""

    def __init__(self, daemon: Daemon, config: GatewayConfig, on_change: Callable[[str, str], Awaitable[None]],
                 environ: Mapping[str, str] | None = None) -> None:
        """``environ``: the variables the upstreams take (gateway_variables), when read earlier
        than now; else this process's environment now."""
        self.config = config
        self._on_change = on_change
        self.upstreams: dict[str, Upstream] = {
            upstream.name: Upstream(daemon, upstream, self._changed_callback(upstream.name), environ)
            for upstream in config.upstreams}

    def _changed_callback(self, name: str) -> Callable[[str], Awaitable[None]]:
        async def changed(kind: str) -> None:
            await self._on_change(name, kind)
        return changed

    async def start(self) -> None:
        """Start the upstreams whose table says start = "gateway", side by side, and wait for each
        one's first try, at most START_WAIT_SECONDS: an MCP client gives its server only so long to
        answer initialize, and one slow upstream must not cost the others. One still starting then
        goes on in the background and announces its lists through on_change when ready; one that
        fails is logged and tried again with back-off (its calls say why meanwhile)."""
        async def start_one(upstream: Upstream) -> None:
            try:
                await upstream.ensure_started()
            except UpstreamError as exc:
                log.warning("gateway: %s", printable(str(exc)))
        with anyio.move_on_after(START_WAIT_SECONDS):
            async with anyio.create_task_group() as tasks:
                for upstream in self.upstreams.values():
                    if upstream.config.start == "gateway":
                        tasks.start_soon(start_one, upstream)

    async def close(self) -> None:
        async with anyio.create_task_group() as tasks:
            for upstream in self.upstreams.values():
                tasks.start_soon(upstream.close)
