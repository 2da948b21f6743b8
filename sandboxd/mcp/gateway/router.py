"""The gateway's MCP surface: the Fleet's tools, resources and prompts beside the built-in tools
of `sandboxd mcp` (mcp.handlers), each call through the daemon's policy engine.

- tools/list: the built-in tools, then each ready upstream's tools the gateway's session shows
  (mcp.gateway.effects), named `UPSTREAM__tool` (mcp.gateway.naming) and described
  `[UPSTREAM, sandbox: ..., trusted|untrusted] ` + the upstream's own text, printable and cut at
  2,000 characters (an upstream chooses it: it must not draw on a person's terminal or pass for
  ours). The annotations are the gateway's (from the effect), never the upstream's claims.
- tools/call of `UPSTREAM__tool`: Authorize on the connection's own session (held: the same
  elicitation as a held built-in call, mcp.approvals.answer_held; denied: the same typed
  denial), the upstream's call, then ReportToolResult. A tool the list does not show is refused,
  whoever calls it.
- resources/list|read and prompts/list|get pass through likewise (a read and a get are
  authorized as `UPSTREAM__resources/read` and `UPSTREAM__prompts/get`, read-only effect).
- list_changed: when an upstream's list changes (Fleet.on_change), every connection is told.

What an upstream returns (a tool's content, a resource, a prompt's messages) is data for the
model and passes as it is, within the bounds mcp.gateway.upstream keeps."""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import urllib.parse
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
import grpc
import mcp_types as types
from mcp.shared.exceptions import MCPError
from mcp_types import INTERNAL_ERROR, INVALID_PARAMS, INVALID_REQUEST

from sandboxd.mcp.approvals import Progress, answer_held, denied_result
from sandboxd.mcp.binding import Binding
from sandboxd.mcp.daemon import Daemon
from sandboxd.mcp.gateway import authorize, naming
from sandboxd.mcp.gateway.config import GatewayConfig, UpstreamConfig
from sandboxd.mcp.gateway.effects import ToolPolicy, hidden_because, request_policy, tool_policy
from sandboxd.mcp.gateway.upstream import MAX_RESULT_BYTES, Fleet, Upstream, UpstreamError, gateway_variables
from sandboxd.policy.network import parse_credential
from sandboxd.policy.tools import Effect
from sandboxd.printable import printable
from sandboxd.v1 import sandboxd_pb2 as pb

TYPE_CHECKING = False
if TYPE_CHECKING:
    from mcp.server.connection import Connection
    from mcp.server.context import ServerRequestContext

    Ctx = ServerRequestContext[Any, Any]

log = logging.getLogger("sandboxd.mcp")
DESCRIPTION_CHARS = 2000
TITLE_CHARS = 200
SCHEMA_BYTES = 64 << 10
# What one upstream's tools may add to a tools/list (schemas and descriptions): 1,024 tools of 64
# KiB schemas would be 64 MiB in every list a client reads. The tools past it are left out.
LIST_BYTES = 4 << 20
MAX_REMEMBERED = 4096            # tools left out whose log line was written
# Calls in flight to one upstream, from every connection: each holds a task and a pending request
# until its timeout, and a client could start them faster than a slow upstream ends them.
MAX_IN_FLIGHT = 32
READ_RESOURCE, GET_PROMPT = "resources/read", "prompts/get"   # no exposed tool name has a "/"
REPORT_TIMEOUT = 30.0
NOTIFY_TIMEOUT = 5.0
MAX_REPORTS = 64                 # ReportToolResult calls sent after their answer, on their way at once
T = TypeVar("T")


@dataclass(frozen=True)
class ExposedTool:
    name: str                 # UPSTREAM__tool
    upstream: Upstream
    original: str             # the upstream's own name
    tool: types.Tool          # as the upstream listed it
    policy: ToolPolicy


def sandbox_text(config: UpstreamConfig) -> str:
    """The upstream's sandbox in a few words, for a model (printable: the file's paths and names).
    Its allowed domains, its credentials' hosts and a url upstream's host are then the only ones
    its session reaches (mcp.gateway.upstream.session_spec)."""
    hosts = list(config.allow_domains) + [parse_credential(spec).host for spec in config.credentials]
    if config.url and config.sandbox != "danger-full-access":
        hosts.append(urllib.parse.urlsplit(config.url).hostname or "")
    hosts = list(dict.fromkeys(host for host in hosts if host))
    if config.sandbox == "danger-full-access":
        network = "network on"
    elif hosts:
        network = "network: only " + ", ".join(hosts)
    else:
        network = "network on" if config.network else "network off"
    where = f" in {config.workspace}" if config.workspace and config.sandbox == "workspace-write" else ""
    return printable(f"{config.sandbox}{where}, {network}")


def _whose(config: UpstreamConfig) -> str:
    """The prefix that says whose a description or title is (the upstream cannot write it)."""
    trust = "trusted" if config.trusted else "untrusted"
    return f"[{config.name}, sandbox: {sandbox_text(config)}, {trust}] "


def describe(config: UpstreamConfig, text: str | None) -> str:
    return (_whose(config) + printable(text or ""))[:DESCRIPTION_CHARS]


def titled(config: UpstreamConfig, title: str | None) -> str | None:
    """An upstream's title (what a client shows a person instead of the name) behind the same
    prefix as its description: "files: Read file (read-only)" from an untrusted writer is
    otherwise another upstream's read-only tool in a tool picker. The title is cut, the prefix never."""
    return _whose(config) + _label(title) if title else None


def _schema_size(schema: Any) -> int | None:
    """The serialized size of a schema a client will take: a JSON object whose type is "object"
    (the TypeScript SDK refuses a whole tools/list over one that is not) below SCHEMA_BYTES; else None."""
    if not isinstance(schema, dict) or schema.get("type") != "object":
        return None
    try:
        size = len(json.dumps(schema).encode())
    except (TypeError, ValueError):
        return None
    return size if size < SCHEMA_BYTES else None


def _escaped_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """A schema as a client shows it: each "description" and "title" text printable (the titles
    cut), nothing else changed (names, enums and defaults are what the upstream takes back)."""
    def walk(value: Any) -> Any:
        if isinstance(value, dict):
            return {key: (_label(item, key) if key in ("description", "title") and isinstance(item, str)
                          else walk(item)) for key, item in value.items()}
        if isinstance(value, list):
            return [walk(item) for item in value]
        return value
    escaped: dict[str, Any] = walk(schema)
    return escaped


def _label(text: str, kind: str = "title") -> str:
    shown = printable(text)
    return shown[:TITLE_CHARS] if kind == "title" else shown[:DESCRIPTION_CHARS]


R = TypeVar("R", types.ReadResourceResult, types.GetPromptResult)


def _size(result: types.Result) -> int:
    """A result's size as the client's transport writes it (UTF-8 JSON): the bound's measure and the report's."""
    return len(result.model_dump_json(by_alias=True, exclude_none=True).encode())


def _bounded(result: R, upstream: Upstream) -> R:
    """A resource's contents or a prompt's messages within a tool result's bound (1 MiB)."""
    size = _size(result)
    if size > MAX_RESULT_BYTES:
        raise UpstreamError(f"{upstream.name} answered with {size} bytes, over the gateway's bound of "
                            f"{MAX_RESULT_BYTES >> 20} MiB")
    return result


def _error(text: str) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(text=text)], is_error=True)


def _denial(denied: Any) -> dict[str, str]:
    return {"call_id": denied.call_id, "tool": denied.tool, "reason": denied.reason, "by": denied.by,
            "detail": denied.detail, "message": denied.message}


@dataclass(frozen=True)
class GatewaySetup:
    """What `sandboxd mcp --gateway FILE` read before serving: the file, and its secrets' values."""

    config: GatewayConfig
    redactor: authorize.Redactor
    # What the upstreams take from the environment (credentials' secrets, pass_env), read before
    # the gateway's own --credential flags take theirs out of it (cli.network_args).
    environ: Mapping[str, str]

    @classmethod
    def read(cls, config: GatewayConfig) -> "GatewaySetup":
        environ = gateway_variables(config)
        return cls(config, authorize.Redactor.of(config, environ), environ)

    def gateway(self, daemon: Daemon, ctl: str) -> "Gateway":
        return Gateway(daemon, self.config, self.redactor, ctl, environ=self.environ)


class Gateway:
    """One per `sandboxd mcp --gateway` process: its Fleet, shared by every MCP connection."""

    def __init__(self, daemon: Daemon, config: GatewayConfig, redactor: authorize.Redactor, ctl: str, *,
                 environ: Mapping[str, str] | None = None, fleet: Callable[..., Fleet] = Fleet) -> None:
        self.config, self.ctl = config, ctl
        self._daemon, self._redactor = daemon, redactor
        self.fleet = fleet(daemon, config, self._changed, environ)
        self._connections: set["Connection"] = set()
        self._names: dict[tuple[str, str], tuple[tuple[str, ...], naming.Names]] = {}
        self._dropped: set[tuple[str, str]] = set()     # tools left out already said in the log
        self._in_flight: dict[str, int] = {}             # upstream -> its calls running now
        self._reports: set[asyncio.Task[None]] = set()   # ReportToolResult calls on their way
        self._exposed: dict[str, tuple[list[types.Tool], dict[str, ExposedTool]]] = {}   # upstream -> its listing's

    async def start(self) -> None:
        await self.fleet.start()

    async def close(self) -> None:
        await self.settle()
        await self.fleet.close()

    # -- connections and their list_changed -----------------------------------------------------

    def attach(self, connection: "Connection") -> None:
        """Tell ``connection`` of list changes until it ends."""
        self._connections.add(connection)
        connection.exit_stack.callback(self._connections.discard, connection)
        # Pushed after the session's close (App.binding), so it runs first: reports land in the
        # session while it is open.
        connection.exit_stack.push_async_callback(self.settle)

    async def _changed(self, upstream: str, kind: str) -> None:
        method = {"tools": "send_tool_list_changed", "resources": "send_resource_list_changed",
                  "prompts": "send_prompt_list_changed"}.get(kind)
        if method is None:
            return
        for connection in list(self._connections):
            try:
                with anyio.move_on_after(NOTIFY_TIMEOUT):       # a client not reading: the others still hear
                    await getattr(connection, method)()
            except Exception:                       # noqa: BLE001 - a connection closing meanwhile
                log.debug("could not tell a client of %s's %s list change", upstream, kind, exc_info=True)

    # -- names -----------------------------------------------------------------------------------

    def _named(self, upstream: Upstream, kind: str, originals: list[str]) -> naming.Names:
        listed = tuple(originals)
        cached = self._names.get((upstream.name, kind))
        if cached is None or cached[0] != listed:
            cached = (listed, naming.Names(upstream.name, listed))
            self._names[(upstream.name, kind)] = cached
        return cached[1]

    def _ready(self) -> list[Upstream]:
        return [upstream for upstream in self.fleet.upstreams.values() if upstream.state == "ready"]

    async def _start_first_use(self) -> None:
        """Start the upstreams started on first use that are not yet: a model's first use of one
        is reading the list (it cannot call a tool it was not shown)."""
        waiting = [upstream for upstream in self.fleet.upstreams.values()
                   if upstream.config.start == "first_use" and upstream.state == "stopped"]

        async def start(upstream: Upstream) -> None:
            try:
                await asyncio.wait_for(upstream.ensure_started(), upstream.config.timeout_seconds)
            except (UpstreamError, asyncio.TimeoutError) as error:
                log.warning("sandboxd mcp gateway: %s did not start: %s", upstream.name, printable(str(error)))
        if waiting:
            await asyncio.gather(*(start(upstream) for upstream in waiting))

    # -- tools -----------------------------------------------------------------------------------

    def exposed_tools(self) -> list[ExposedTool]:
        """Every ready upstream's tools under their exposed names (shown or not)."""
        return [tool for upstream in self._ready() for tool in self._exposed_of(upstream).values()]

    def _exposed_of(self, upstream: Upstream) -> dict[str, ExposedTool]:
        """One upstream's tools by exposed name, worked out once per listing (the upstream assigns
        a new list when it lists again): a call looks its tool up here."""
        tools = upstream.tools
        cached = self._exposed.get(upstream.name)
        if cached is not None and cached[0] is tools:
            return cached[1]
        names = self._named(upstream, "tools", [tool.name for tool in tools])
        found: dict[str, ExposedTool] = {}
        budget = LIST_BYTES
        for tool in tools:
            exposed = names.exposed(tool.name)
            if exposed is None:
                continue
            size = _schema_size(tool.input_schema)
            if size is not None:
                budget -= size + len(tool.description or "")
            if size is None or budget < 0:
                self._left_out(upstream, tool.name, "its input schema is not a JSON object of type \"object\" below "
                               f"{SCHEMA_BYTES >> 10} KiB" if size is None else
                               f"its tools' schemas and descriptions are over {LIST_BYTES >> 20} MiB together")
                continue
            found[exposed] = ExposedTool(exposed, upstream, tool.name, tool,
                                         tool_policy(upstream.config, tool.name, tool.annotations))
        self._exposed[upstream.name] = (tools, found)
        return found

    def _left_out(self, upstream: Upstream, tool: str, why: str) -> None:
        """One log line per tool left out (lists are read again and again)."""
        if (upstream.name, tool) not in self._dropped:
            if len(self._dropped) >= MAX_REMEMBERED:      # an upstream renaming its tools on every restart
                self._dropped.clear()
            self._dropped.add((upstream.name, tool))
            log.warning("sandboxd mcp gateway: %s: left out the tool %s: %s", upstream.name, printable(tool), why)

    async def tools(self, binding: Binding) -> list[types.Tool]:
        """The upstream tools the connection's session shows (binding.session: as fresh as its list)."""
        await self._start_first_use()
        shown = []
        for exposed in self.exposed_tools():
            if hidden_because(binding.session, exposed.policy) is not None:
                continue
            config, tool = exposed.upstream.config, exposed.tool
            output = tool.output_schema if _schema_size(tool.output_schema) is not None else None
            shown.append(types.Tool(
                name=exposed.name, title=titled(config, tool.title),
                description=describe(config, tool.description), input_schema=_escaped_schema(tool.input_schema),
                output_schema=_escaped_schema(output) if output is not None else None,
                annotations=types.ToolAnnotations(read_only_hint=exposed.policy.effect == Effect.READ_ONLY,
                                                  destructive_hint=exposed.policy.effect == Effect.DESTRUCTIVE,
                                                  open_world_hint=bool(config.network or config.allow_domains
                                                                       or config.credentials or config.url))))
        return shown

    async def call_tool(self, ctx: "Ctx", binding: Binding, name: str,
                        arguments: dict[str, Any]) -> types.CallToolResult:
        """A call of ``name`` (UPSTREAM__tool): refused unless the session shows it, then through
        the policy engine to the upstream."""
        upstream = self.fleet.upstreams.get((naming.split(name) or ("", ""))[0])
        if upstream is not None and upstream.state == "stopped":
            # A client that kept the list of an earlier connection may call before it lists.
            await self._start_first_use()
        exposed = self._exposed_of(upstream).get(name) if upstream is not None and upstream.state == "ready" else None
        if exposed is None:
            why = (f"the upstream {upstream.name} is {upstream.state}" if upstream is not None and
                   upstream.state != "ready" else "no upstream lists it")
            return _error(f"unknown tool {printable(name)!r} ({why}); call tools/list for the tools there are")
        hidden = hidden_because(binding.session, exposed.policy)
        if hidden is not None:
            return _error(f"this session does not offer the tool {name}: {hidden}")
        upstream = exposed.upstream

        async def run() -> types.CallToolResult:
            return await upstream.call_tool(exposed.original, arguments, upstream.config.timeout_seconds)

        def measured(result: types.CallToolResult) -> tuple[int, bool]:
            return _size(result), bool(result.is_error)

        try:
            return await self._through_policy(ctx, binding, name, upstream, exposed.policy, arguments, run, measured)
        except _Refused as refused:
            if _schema_size(exposed.tool.output_schema) is not None:
                # A client checks structuredContent against the tool's output schema, even in an
                # error (the TypeScript SDK then throws instead of showing it): the text says it all.
                refused.result.structured_content = None
            return refused.result

    # -- resources and prompts -------------------------------------------------------------------

    def _offering(self, binding: Binding, request: str) -> list[Upstream]:
        """The ready upstreams whose ``request`` (resources/read, prompts/get) the session shows."""
        return [upstream for upstream in self._ready()
                if hidden_because(binding.session, request_policy(upstream.config, request)) is None]

    def _offered(self, binding: Binding, upstream: Upstream, request: str) -> ToolPolicy:
        """The policy of ``upstream``'s ``request``; MCPError when the session does not offer it."""
        policy = request_policy(upstream.config, request)
        hidden = hidden_because(binding.session, policy)
        if hidden is not None:
            raise MCPError(INVALID_REQUEST, f"this session does not offer {request} of the upstream {upstream.name}: "
                                            f"{hidden}")
        return policy

    async def list_resources(self, binding: Binding) -> types.ListResourcesResult:
        await self._start_first_use()
        listed = []
        for upstream in self._offering(binding, READ_RESOURCE):
            for resource in list(upstream.resources):
                try:
                    uri = naming.resource_uri(upstream.name, resource.uri)
                except UnicodeError:
                    continue
                listed.append(types.Resource(
                    uri=uri, name=_label(resource.name), title=titled(upstream.config, resource.title),
                    description=describe(upstream.config, resource.description),
                    mime_type=printable(resource.mime_type) if resource.mime_type else None,
                    size=resource.size))
        return types.ListResourcesResult(resources=listed)

    async def read_resource(self, ctx: "Ctx", binding: Binding, uri: str) -> types.ReadResourceResult:
        try:
            origin = naming.resource_origin(uri)
        except UnicodeError:
            origin = None
        upstream = self.fleet.upstreams.get(origin[0]) if origin else None
        if upstream is not None and upstream.state == "stopped":
            await self._start_first_use()
        # Only a URI the upstream listed: any other is a request of the model's making that the
        # person never saw offered (the gateway passes no resource templates).
        if (origin is None or upstream is None or upstream.state != "ready"
                or origin[1] not in {str(resource.uri) for resource in upstream.resources}):
            raise MCPError(INVALID_PARAMS, f"unknown resource {printable(uri)}: resources/list names those there are")
        original = origin[1]
        policy = self._offered(binding, upstream, READ_RESOURCE)

        async def run() -> types.ReadResourceResult:
            result = _bounded(await upstream.read_resource(original, upstream.config.timeout_seconds), upstream)
            for content in result.contents:            # the URIs the client knows
                try:
                    content.uri = naming.resource_uri(upstream.name, content.uri)
                except UnicodeError:
                    content.uri = uri
            return result

        def measured(result: types.ReadResourceResult) -> tuple[int, bool]:
            return _size(result), False

        return await self._through_request(ctx, binding, f"{upstream.name}{naming.SEPARATOR}{READ_RESOURCE}",
                                           upstream, policy, {"uri": original}, run, measured)

    async def list_prompts(self, binding: Binding) -> types.ListPromptsResult:
        await self._start_first_use()
        listed = []
        for upstream in self._offering(binding, GET_PROMPT):
            prompts = list(upstream.prompts)
            names = self._named(upstream, "prompts", [prompt.name for prompt in prompts])
            for prompt in prompts:
                exposed = names.exposed(prompt.name)
                if exposed is None:
                    continue
                # An argument's name goes back to the upstream as it is, so it cannot be shown
                # escaped: one that would need escaping is left out (the upstream's, not ours).
                arguments = [types.PromptArgument(name=argument.name, required=argument.required,
                                                  description=_label(argument.description, "description")
                                                  if argument.description else None)
                             for argument in prompt.arguments or [] if printable(argument.name) == argument.name]
                listed.append(types.Prompt(name=exposed, title=titled(upstream.config, prompt.title),
                                           description=describe(upstream.config, prompt.description),
                                           arguments=arguments or None))
        return types.ListPromptsResult(prompts=listed)

    async def get_prompt(self, ctx: "Ctx", binding: Binding, name: str,
                         arguments: dict[str, str] | None) -> types.GetPromptResult:
        split = naming.split(name)
        upstream = self.fleet.upstreams.get(split[0]) if split else None
        if upstream is not None and upstream.state == "stopped":
            await self._start_first_use()
        original = None
        if upstream is not None and upstream.state == "ready":
            original = self._named(upstream, "prompts", [prompt.name for prompt in upstream.prompts]).original(name)
        if upstream is None or original is None:
            raise MCPError(INVALID_PARAMS, f"unknown prompt {printable(name)!r}: prompts/list names those there are")
        prompt_name = original
        policy = self._offered(binding, upstream, GET_PROMPT)

        async def run() -> types.GetPromptResult:
            result = _bounded(await upstream.get_prompt(prompt_name, arguments, upstream.config.timeout_seconds),
                              upstream)
            if result.description:
                result.description = _label(result.description, "description")
            return result

        def measured(result: types.GetPromptResult) -> tuple[int, bool]:
            return _size(result), False

        return await self._through_request(ctx, binding, f"{upstream.name}{naming.SEPARATOR}{GET_PROMPT}", upstream,
                                           policy, {"name": original, "arguments": arguments or {}}, run, measured)

    async def _through_request(self, ctx: "Ctx", binding: Binding, tool: str, upstream: Upstream, policy: ToolPolicy,
                               arguments: dict[str, Any], run: Callable[[], Awaitable[T]],
                               measured: Callable[[T], tuple[int, bool]]) -> T:
        """_through_policy for a request that is not a tool call: a refusal is a JSON-RPC error."""
        try:
            return await self._through_policy(ctx, binding, tool, upstream, policy, arguments, run, measured)
        except _Refused as refused:
            text = "".join(block.text for block in refused.result.content if isinstance(block, types.TextContent))
            raise MCPError(INVALID_REQUEST if refused.result.structured_content else INTERNAL_ERROR, text,
                           data=refused.result.structured_content) from None

    # -- the policy around each call -------------------------------------------------------------

    async def _through_policy(self, ctx: "Ctx", binding: Binding, tool: str, upstream: Upstream, policy: ToolPolicy,
                              arguments: dict[str, Any], run: Callable[[], Awaitable[T]],
                              measured: Callable[[T], tuple[int, bool]]) -> T:
        """Authorize ``tool`` (held: asked as a held built-in call is), ``run`` it, report how it
        ended. Raises _Refused (with the tool result to return) when it may not run or failed."""
        if self._in_flight.get(upstream.name, 0) >= MAX_IN_FLIGHT:
            raise _Refused(_error(f"{tool}: {upstream.name} has {MAX_IN_FLIGHT} calls running already: wait for one "
                                  "to end"))
        self._in_flight[upstream.name] = self._in_flight.get(upstream.name, 0) + 1
        try:
            return await self._authorized(ctx, binding, tool, upstream, policy, arguments, run, measured)
        finally:
            self._in_flight[upstream.name] -= 1

    async def _authorized(self, ctx: "Ctx", binding: Binding, tool: str, upstream: Upstream, policy: ToolPolicy,
                          arguments: dict[str, Any], run: Callable[[], Awaitable[T]],
                          measured: Callable[[T], tuple[int, bool]]) -> T:
        session = await self._session_of(upstream, tool)
        context_id = f"mcp-{secrets.token_hex(6)}"
        held = binding.expect(tool, context_id)
        progress = Progress(ctx)
        answers: list[pb.AuthorizeResponse | grpc.RpcError] = []
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(answer_held, ctx, binding, held, progress, self.ctl)
                try:
                    answers.append(await authorize.authorize(
                        self._daemon, binding.session_id, tool=tool, upstream=upstream.name,
                        trusted=upstream.config.trusted, policy=policy, context_id=context_id, runs_in=session.id,
                        arguments=authorize.arguments_json(arguments, self._redactor)))
                except grpc.RpcError as error:
                    answers.append(error)
                group.cancel_scope.cancel()               # no more questions once the daemon answered
        finally:
            binding.forget(held)
        answer = answers[0]
        if isinstance(answer, grpc.RpcError):
            if answer.code() == grpc.StatusCode.NOT_FOUND:     # the upstream's session (or ours) is gone
                raise _Refused(_error(f"{tool}: {upstream.name}'s session {session.id} is gone (the upstream is "
                                      f"{upstream.state}): call again in a moment; sandboxd said: "
                                      f"{printable(answer.details() or '')}"))
            raise _Refused(_error(f"sandboxd: {answer.code().name}: {printable(answer.details() or '')}"))
        if not answer.allowed:
            raise _Refused(denied_result(_denial(answer.denied)))
        try:
            result = await run()
        except UpstreamError as error:
            failure = {"ok": False, "error": str(error)}
            await self._report_later(binding, answer.call_id, lambda: failure)
            raise _Refused(_error(f"{tool}: {printable(str(error))}")) from None
        except BaseException:                          # cancelled (the client's cancel, the connection's end)
            with anyio.CancelScope(shield=True):
                await self._report(binding, answer.call_id, ok=False, error="cancelled before the upstream answered")
            raise

        def outcome() -> dict[str, Any]:
            # Measured when the report leaves, after the answer: a serialization less on the call's
            # path (the client's transport serializes the result once more anyway).
            size, is_error = measured(result)
            return {"ok": not is_error, "error": "the tool returned an error" if is_error else "",
                    "content_bytes": size, "is_error": is_error}

        await self._report_later(binding, answer.call_id, outcome)
        return result

    async def _session_of(self, upstream: Upstream, tool: str) -> pb.Session:
        """The upstream's own session (its sandbox judges the call's effect), started if need be."""
        if upstream.session is None:
            try:
                with anyio.fail_after(upstream.config.timeout_seconds):
                    await upstream.ensure_started()
            except (UpstreamError, TimeoutError) as error:
                why = printable(str(error)) or f"{upstream.name} did not start in time"
                raise _Refused(_error(f"{tool}: {why}")) from None
        if upstream.session is None:
            raise _Refused(_error(f"{tool}: {upstream.name} is {upstream.state}: call again in a moment"))
        return upstream.session

    async def _report_later(self, binding: Binding, call_id: str, outcome: Callable[[], dict[str, Any]]) -> None:
        """ReportToolResult once the answer is on its way to the client (a round trip to the daemon
        less in every call's latency: tests/bench_mcp_gateway.py). Sent before the connection's
        session closes (``settle``), else the daemon would record the call as never reported. At
        most MAX_REPORTS on their way: past it the call waits for its own (a client calling faster
        than the daemon records piles up no tasks). ``outcome``: the report's fields (ok, error,
        content_bytes, is_error), worked out as it leaves."""
        if len(self._reports) >= MAX_REPORTS:
            await self._report_outcome(binding, call_id, outcome)
            return
        task = asyncio.get_running_loop().create_task(self._report_outcome(binding, call_id, outcome))
        self._reports.add(task)
        task.add_done_callback(self._reports.discard)

    async def _report_outcome(self, binding: Binding, call_id: str, outcome: Callable[[], dict[str, Any]]) -> None:
        """The report of one call, whatever happens: a result that cannot be measured (serialized) is
        reported as failed, saying why, and no failure of the report ends its task unlogged."""
        try:
            fields = outcome()
        except Exception as error:  # noqa: BLE001 - any failure to measure: the daemon still hears of the call
            fields = {"ok": False, "error": f"the result could not be measured: {printable(str(error))[:500]}"}
        try:
            await self._report(binding, call_id, **fields)
        except Exception as error:  # noqa: BLE001 - a task's exception is otherwise seen by nobody
            log.warning("sandboxd mcp gateway: reporting call %s's result failed: %s", call_id,
                        printable(repr(error))[:500])

    async def settle(self) -> None:
        """Wait for the reports still on their way (each bounded by REPORT_TIMEOUT)."""
        if self._reports:
            await asyncio.wait(set(self._reports))

    async def _report(self, binding: Binding, call_id: str, *, ok: bool, error: str = "", content_bytes: int = 0,
                      is_error: bool = False) -> None:
        try:
            await asyncio.wait_for(authorize.report(self._daemon, binding.session_id, call_id, ok=ok, error=error,
                                                    content_bytes=content_bytes, is_error=is_error), REPORT_TIMEOUT)
        except (grpc.RpcError, asyncio.TimeoutError) as failure:
            # The call's end is recorded anyway when the session closes ("no result reported").
            log.warning("sandboxd mcp gateway: could not report call %s's result: %s", call_id,
                        printable(str(failure)))


class _Refused(Exception):
    """A call that did not run, or failed: the tool result that says so."""

    def __init__(self, result: types.CallToolResult) -> None:
        super().__init__()
        self.result = result
