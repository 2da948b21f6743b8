"""tools/list and tools/call of `sandboxd mcp`, on the daemon's RPCs.

One `App` per process holds the daemon channel and the session flags; each MCP connection gets
its own `Binding` (its session), made at its first request and ended with the connection."""

from __future__ import annotations

import asyncio
import codecs
import json
import os
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import grpc
import mcp_types as types
from mcp.server.lowlevel import NotificationOptions, Server
from mcp.server.models import InitializationOptions
from mcp.shared.exceptions import MCPError
from mcp_types import INTERNAL_ERROR, INVALID_REQUEST

from sandboxd.client import DrainWait, caller_environment
from sandboxd.mcp import catalog
from sandboxd.mcp.approvals import Progress, answer_held, denied_result
from sandboxd.mcp.binding import Binding
from sandboxd.mcp.daemon import Daemon, SessionSpec, denial
from sandboxd.mcp.events import EventHub
from sandboxd.mcp.gateway.naming import split as split_name
from sandboxd.printable import printable
from sandboxd.v1 import sandboxd_pb2 as pb

TYPE_CHECKING = False
if TYPE_CHECKING:
    from mcp.server.connection import Connection
    from mcp.server.context import ServerRequestContext

    from sandboxd.mcp.gateway.router import Gateway

    Ctx = ServerRequestContext[Any, Any]

# A command's output returned to the model, stdout and stderr together: past it the command keeps
# running and its output is counted, not kept (the result says output_truncated).
OUTPUT_LIMIT = 1 << 20
# The list_changed notifications the server declares (resources' and prompts' only where their
# handlers are: a gateway's).
NOTIFY = NotificationOptions(tools_changed=True, resources_changed=True, prompts_changed=True)
_STATE_KEY, _LOCK_KEY = "sandboxd.binding", "sandboxd.binding-lock"


class ToolError(Exception):
    """Bad arguments: a tool error that says what to fix."""


class App:
    def __init__(self, daemon: Daemon, spec: SessionSpec, ctl: str,
                 first: tuple[pb.Session, bool] | None = None, *, gateway: "Gateway | None" = None) -> None:
        self.daemon, self.spec, self.ctl = daemon, spec, ctl
        self.events = EventHub(daemon)   # one watch for every session of this process
        self._first = first              # stdio: the session opened before serving, for the one connection
        self.gateway = gateway           # --gateway: the upstream servers' tools, resources and prompts
        # --session: the connection the attached session serves. One at a time: a held call's
        # question goes to the connection that made the call, and two people on one session
        # could answer each other's (hostile pass 9b).
        self._attached_to: object | None = None

    def take_first(self) -> tuple[pb.Session, bool] | None:
        first, self._first = self._first, None
        return first

    async def binding(self, ctx: "Ctx") -> Binding:
        # The SDK hands handlers a per-request context; the per-connection state (and the
        # teardown that runs when the connection ends) lives on its Connection.
        connection: Connection = ctx.session._connection
        lock = connection.state.setdefault(_LOCK_KEY, asyncio.Lock())   # one session even for racing requests
        async with lock:
            bound = connection.state.get(_STATE_KEY)
            if isinstance(bound, Binding):
                return bound
            if self.spec.attach:
                self._claim_attached(connection)
            session, owned = self.take_first() or await self.daemon.open(self.spec)
            bound = Binding(self.daemon, session, owned, self.events, connection.send_tool_list_changed,
                            checkpoint_calls=self.spec.checkpoint_calls and session.review)
            connection.exit_stack.push_async_callback(bound.close)
            await bound.start()
            if self.gateway is not None:
                self.gateway.attach(connection)
            connection.state[_STATE_KEY] = bound
            return bound


    def _claim_attached(self, connection: "Connection") -> None:
        if self._attached_to is not None and self._attached_to is not connection:
            raise MCPError(INVALID_REQUEST, f"sandboxd mcp: the session {printable(self.spec.attach)} is in use by "
                           "another MCP connection (--session serves one at a time): end that one, or connect to a "
                           "`sandboxd mcp --http` without --session (a session per connection) or with another "
                           "session")
        self._attached_to = connection

        async def release() -> None:
            if self._attached_to is connection:
                self._attached_to = None
        connection.exit_stack.push_async_callback(release)


def build_server(app: App) -> "Server[App]":
    async def list_tools(ctx: "Ctx", _params: types.PaginatedRequestParams | None) -> types.ListToolsResult:
        try:
            binding = await app.binding(ctx)
            tools = await binding.visible(fresh=True)
            if app.gateway is not None:
                tools = tools + await app.gateway.tools(binding)
            return types.ListToolsResult(tools=tools)
        except grpc.RpcError as error:
            raise MCPError(INTERNAL_ERROR, f"sandboxd: {error.code().name}: {error.details()}") from None

    async def call_tool(ctx: "Ctx", params: types.CallToolRequestParams) -> types.CallToolResult:
        try:
            binding = await app.binding(ctx)
        except grpc.RpcError as error:          # no session for this connection (a quota, say): say why
            return _error(f"no sandboxd session: {error.code().name}: {error.details()}")
        try:
            shown = [listed.name for listed in await binding.visible()]
        except grpc.RpcError as error:
            return _error(f"sandboxd: {error.code().name}: {error.details()}")
        if app.gateway is not None and split_name(params.name) is not None:
            return await app.gateway.call_tool(ctx, binding, params.name, params.arguments or {})
        tool = catalog.BY_NAME.get(params.name)
        if tool is None or tool.name not in shown:
            # Hidden means refused: a tool the list does not show (a read-only sandbox, a
            # permission mode) never runs, whoever calls it.
            why = "unknown tool" if tool is None else "this session does not offer the tool"
            return _error(f"{why} {params.name!r} ({catalog.policy_text(binding.session)}); use one of "
                          f"{', '.join(shown)}")
        # Every daemon call this tool call makes carries it: its held calls are asked about here,
        # never by another client of the same session (mcp.binding).
        context_id = f"mcp-{secrets.token_hex(6)}"
        held = binding.expect(tool.daemon_tool, context_id)
        progress = Progress(ctx)
        result: types.CallToolResult | None = None
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(answer_held, ctx, binding, held, progress, app.ctl)
                try:
                    result = await RUNNERS[tool.name](binding, params.arguments or {}, progress, context_id)
                except (ToolError, ValueError, TypeError) as error:     # protobuf's range and type checks too
                    result = _error(str(error))
                except grpc.RpcError as error:
                    denied = denial(error)
                    result = denied_result(denied) if denied else _error(f"{error.code().name}: {error.details()}")
                group.cancel_scope.cancel()
        finally:
            binding.forget(held)
        return result or _error("the call ended without a result")

    instructions = ("Tools that run in a kernel-enforced sandboxd session: a shell, files, patches, search and "
                    "background processes. Each tool's description states the session's policy.")
    if app.gateway is not None:
        instructions += (" Tools named UPSTREAM__tool are an upstream MCP server's, run in a sandbox of its own; "
                         "their descriptions name the upstream, its sandbox and whether it is trusted.")
    server: Server[App] = _Server("sandboxd", version=_version(), on_list_tools=list_tools, on_call_tool=call_tool,
                                 instructions=instructions, **gateway_handlers(app))
    # The SDK's default middleware is OpenTelemetry's span per message: no exporter here, and its
    # cost lands on every call (tests/bench_mcp.py).
    server.middleware = []
    return server


class _Server(Server[App]):
    """The SDK's server whose defaults declare the list_changed notifications it sends: the HTTP
    transport's sessions initialize with the defaults (stdio passes NOTIFY itself)."""

    def create_initialization_options(self, notification_options: NotificationOptions | None = None,
                                      experimental_capabilities: dict[str, dict[str, Any]] | None = None,
                                      extensions: dict[str, dict[str, Any]] | None = None) -> InitializationOptions:
        return super().create_initialization_options(notification_options or NOTIFY, experimental_capabilities,
                                                     extensions)


def gateway_handlers(app: App) -> dict[str, Any]:
    """resources/list|read and prompts/list|get, for a gateway only: declared (and their
    capabilities with them) only when there are upstreams to pass them through to."""
    gateway = app.gateway
    if gateway is None:
        return {}

    # Each binds the connection first, as tools/list does: from then on it hears of list changes.
    async def list_resources(ctx: "Ctx", _params: types.PaginatedRequestParams | None) -> types.ListResourcesResult:
        return await gateway.list_resources(await _bound(app, ctx))

    async def read_resource(ctx: "Ctx", params: types.ReadResourceRequestParams) -> types.ReadResourceResult:
        return await gateway.read_resource(ctx, await _bound(app, ctx), str(params.uri))

    async def list_prompts(ctx: "Ctx", _params: types.PaginatedRequestParams | None) -> types.ListPromptsResult:
        return await gateway.list_prompts(await _bound(app, ctx))

    async def get_prompt(ctx: "Ctx", params: types.GetPromptRequestParams) -> types.GetPromptResult:
        return await gateway.get_prompt(ctx, await _bound(app, ctx), params.name, params.arguments)

    return {"on_list_resources": list_resources, "on_read_resource": read_resource,
            "on_list_prompts": list_prompts, "on_get_prompt": get_prompt}


async def _bound(app: App, ctx: "Ctx") -> Binding:
    try:
        return await app.binding(ctx)
    except grpc.RpcError as error:
        raise MCPError(INTERNAL_ERROR, f"no sandboxd session: {error.code().name}: {error.details()}") from None


def _version() -> str:
    from sandboxd import __version__
    return __version__


def _error(text: str) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(text=text)], is_error=True)


def _ok(text: str, structured: dict[str, Any] | None = None) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(text=text)], structured_content=structured)


_KINDS = {str: "a string", int: "an integer", float: "a number", bool: "true or false", dict: "an object", list: "a list"}


def _arg(args: dict[str, Any], name: str, kind: type, default: Any = None) -> Any:
    """``args[name]`` if it is of ``kind`` (a float also takes an integer), ``default`` when absent."""
    value = args.get(name)
    if value is None:
        return default
    wanted = (int, float) if kind is float else kind
    if not isinstance(value, wanted) or (isinstance(value, bool) and kind is not bool):
        raise ToolError(f"{name} must be {_KINDS[kind]}, not {json.dumps(value)[:40]}")
    return value


def _required(args: dict[str, Any], name: str) -> str:
    value = _arg(args, name, str)
    if not value:
        raise ToolError(f"{name} is required")
    return str(value)


def _env(args: dict[str, Any]) -> dict[str, str]:
    env = _arg(args, "env", dict, {})
    if not all(isinstance(key, str) and isinstance(value, str) for key, value in env.items()):
        raise ToolError("env must map names to strings")
    return dict(env)


# What the MCP client (the agent runtime that started ``sandboxd mcp``) passes of its own
# environment: its PATH (the daemon keeps the entries the sandbox has) and LANG; never TERM (a
# tool's output goes to a model, not a terminal), never anything else.
CALLER_ENV = caller_environment(on_terminal=False)


Runner = Callable[[Binding, dict[str, Any], Progress, str], Awaitable[types.CallToolResult]]


async def _shell(binding: Binding, args: dict[str, Any], progress: Progress, context_id: str) -> types.CallToolResult:
    timeout = _arg(args, "timeout", float, 0)
    start = pb.ExecStart(session_id=binding.session_id, shell=_required(args, "command"), cwd=_arg(args, "cwd", str, ""),
                         env_overlay=_env(args), caller_env=CALLER_ENV, timeout_seconds=float(timeout),
                         close_stdin=True, checkpoint=binding.checkpoint_calls,
                         output_limit_bytes=OUTPUT_LIMIT, execution_context_id=context_id)
    output: dict[str, list[bytes]] = {"stdout": [], "stderr": []}
    decoders = {kind: codecs.getincrementaldecoder("utf-8")("replace") for kind in output}
    result: pb.ExecResult | None = None
    drain = DrainWait()
    while True:
        call = binding.daemon.stub.Exec(iter([pb.ExecRequest(start=start)]))
        binding.track(call)
        answered = False
        try:
            async for response in call:
                answered = True
                kind = response.WhichOneof("kind")
                if kind in output:
                    chunk = getattr(response, kind)
                    output[kind].append(chunk)
                    await progress.say(decoders[kind].decode(chunk))
                elif kind == "result":
                    result = response.result
            break
        except grpc.RpcError as error:
            # Refused by a draining daemon before it ran: again once the next one serves.
            delay = None if answered else drain.delay(error.code(), await call.trailing_metadata())
            if delay is None:
                raise
            await asyncio.sleep(delay)
        finally:
            binding.untrack(call)
            call.cancel()               # a no-op once it ended; else the daemon kills the tree
    if result is None:
        return _error("the daemon ended the command without a result")
    stdout, stderr = (b"".join(output[kind]).decode("utf-8", "replace") for kind in ("stdout", "stderr"))
    status = {"exit_code": result.exit_code, "signal": result.signal, "timed_out": result.timed_out,
              "shell_status": result.shell_status, "output_truncated": result.output_truncated,
              "oom_killed": result.oom_killed, "wall_seconds": round(result.wall_seconds, 3)}
    how = (f"timed out (killed after {start.timeout_seconds:g} s)" if result.timed_out
           else f"killed by signal {result.signal}" if result.signal else f"exit status {result.exit_code}")
    text = how + (" (output truncated)" if result.output_truncated else "")
    if stdout:
        text += f"\n--- stdout ---\n{stdout}"
    if stderr:
        text += f"\n--- stderr ---\n{stderr}"
    return _ok(text, {**status, "stdout": stdout, "stderr": stderr})


async def _read(binding: Binding, args: dict[str, Any], _progress: Progress, context_id: str) -> types.CallToolResult:
    answer = await binding.daemon.stub.ReadFile(pb.ReadFileRequest(
        session_id=binding.session_id, path=_required(args, "path"), max_bytes=_arg(args, "max_bytes", int, 0),
        execution_context_id=context_id))
    text = answer.data.decode("utf-8", "replace")
    return _ok(text + ("\n[truncated: the file is longer]" if answer.truncated else ""),
               {"bytes": len(answer.data), "truncated": answer.truncated})


async def _write(binding: Binding, args: dict[str, Any], _progress: Progress, context_id: str) -> types.CallToolResult:
    content = _arg(args, "content", str)
    if content is None:
        raise ToolError("content is required (the whole new file)")
    path = _required(args, "path")
    written = await binding.daemon.stub.WriteFile(pb.WriteFileRequest(
        session_id=binding.session_id, path=path, data=content.encode(), create_parents=True,
        execution_context_id=context_id))
    return _ok(f"wrote {written.bytes_written} bytes to {path}", {"bytes_written": written.bytes_written})


async def _list(binding: Binding, args: dict[str, Any], _progress: Progress, context_id: str) -> types.CallToolResult:
    listing = await binding.daemon.stub.ListDir(pb.ListDirRequest(
        session_id=binding.session_id, path=_arg(args, "path", str, ""), execution_context_id=context_id))
    lines = [f"{entry.type:<7} {entry.mode:04o} {entry.size:>10}  {entry.name}" for entry in listing.entries]
    return _ok("\n".join(lines) or "(empty)", {"entries": [
        {"name": entry.name, "type": entry.type, "size": entry.size} for entry in listing.entries]})


async def _patch(binding: Binding, args: dict[str, Any], _progress: Progress, context_id: str) -> types.CallToolResult:
    answer = await binding.daemon.stub.ApplyPatch(pb.ApplyPatchRequest(
        session_id=binding.session_id, patch=_required(args, "patch"), strip=_arg(args, "strip", int, 0),
        execution_context_id=context_id))
    return _ok("\n".join(f"{patched.action}\t{patched.path}" for patched in answer.files),
               {"files": [{"path": patched.path, "action": patched.action} for patched in answer.files]})


async def _search(binding: Binding, args: dict[str, Any], _progress: Progress, context_id: str) -> types.CallToolResult:
    answer = await binding.daemon.stub.Search(pb.SearchRequest(
        session_id=binding.session_id, pattern=_required(args, "pattern"), path=_arg(args, "path", str, ""),
        max_results=_arg(args, "max_results", int, 0), case_insensitive=bool(_arg(args, "case_insensitive", bool)),
        execution_context_id=context_id))
    lines = [f"{match.path}:{match.line}: {match.text}" for match in answer.matches]
    if answer.truncated:
        lines.append("[more matches not shown: narrow the pattern or the path]")
    return _ok("\n".join(lines) or "no matches", {"matches": len(answer.matches), "truncated": answer.truncated})


def _job(job: pb.BackgroundProcess) -> dict[str, Any]:
    return {"id": job.id, "name": job.name, "pid": job.pid, "running": job.running,
            "shell_status": None if job.running else job.result.shell_status, "output_bytes": job.output_bytes}


async def _start(binding: Binding, args: dict[str, Any], _progress: Progress, context_id: str) -> types.CallToolResult:
    job = await binding.daemon.stub.StartBackground(pb.StartBackgroundRequest(
        session_id=binding.session_id, shell=_required(args, "command"), cwd=_arg(args, "cwd", str, ""),
        env_overlay=_env(args), caller_env=CALLER_ENV, name=_arg(args, "name", str, ""),
        execution_context_id=context_id))
    return _ok(f"started {job.id} (pid {job.pid})", _job(job))


async def _processes(binding: Binding, _args: dict[str, Any], _progress: Progress,
                     context_id: str) -> types.CallToolResult:
    jobs = (await binding.daemon.stub.ListBackground(pb.ListBackgroundRequest(
        session_id=binding.session_id, execution_context_id=context_id))).processes
    lines = [f"{job.id}  pid={job.pid}  {'running' if job.running else f'exited {job.result.shell_status}'}  "
             f"{job.name}" for job in jobs]
    return _ok("\n".join(lines) or "no background processes", {"processes": [_job(job) for job in jobs]})


async def _output(binding: Binding, args: dict[str, Any], _progress: Progress, _context: str) -> types.CallToolResult:
    offset = _arg(args, "offset", int, 0)
    chunks, dropped, end = [], 0, offset
    async for chunk in binding.daemon.stub.ReadBackgroundOutput(pb.ReadBackgroundOutputRequest(
            session_id=binding.session_id, id=_required(args, "id"), offset=offset)):
        chunks.append(chunk.data)
        dropped += chunk.dropped
        end = chunk.offset + len(chunk.data)
    text = b"".join(chunks).decode("utf-8", "replace")
    return _ok(text + (f"\n[{dropped} earlier bytes no longer kept]" if dropped else ""),
               {"next_offset": end, "dropped": dropped})


async def _stop(binding: Binding, args: dict[str, Any], _progress: Progress, context_id: str) -> types.CallToolResult:
    job = await binding.daemon.stub.StopBackground(pb.StopBackgroundRequest(
        session_id=binding.session_id, id=_required(args, "id"), execution_context_id=context_id))
    return _ok(f"{job.id} stopped (status {job.result.shell_status})", _job(job))


def _paths(args: dict[str, Any]) -> list[str]:
    paths = _arg(args, "paths", list, [])
    if not all(isinstance(path, str) for path in paths):
        raise ToolError("paths must be a list of strings (absolute, or relative to the workspace)")
    return list(paths)


async def _changes(binding: Binding, args: dict[str, Any], _progress: Progress, _context: str) -> types.CallToolResult:
    answer = await binding.daemon.stub.ListChanges(pb.ListChangesRequest(
        session_id=binding.session_id, paths=_paths(args), page_token=_arg(args, "page_token", str, "")))
    lines, listed = [], []
    for change in answer.changes:
        kind = pb.FileChange.Kind.Name(change.kind).lower()
        where = os.path.join(change.root, change.path) if change.path else change.root
        notes = [f"flagged: {', '.join(change.flags)}"] if change.flags else []
        notes += [f"conflict: {change.conflict}"] if change.conflict else []
        lines.append(f"{kind:<12} {where}" + (f"  ({'; '.join(notes)})" if notes else ""))
        listed.append({"kind": kind, "root": change.root, "path": change.path, "flags": list(change.flags),
                       "conflict": change.conflict, "size": change.size, "sha256": change.sha256})
    if answer.next_page_token:
        lines.append(f"[more: call again with page_token {answer.next_page_token}]")
    return _ok("\n".join(lines) or "no pending changes",
               {"changes": listed, "next_page_token": answer.next_page_token})


async def _diff(binding: Binding, args: dict[str, Any], _progress: Progress, _context: str) -> types.CallToolResult:
    answer = await binding.daemon.stub.DiffChanges(pb.DiffChangesRequest(
        session_id=binding.session_id, paths=_paths(args), page_token=_arg(args, "page_token", str, "")))
    more = f"\n[more: call again with page_token {answer.next_page_token}]" if answer.next_page_token else ""
    return _ok((answer.diff or "no pending changes") + more, {"next_page_token": answer.next_page_token})


RUNNERS: dict[str, Runner] = {"list_changes": _changes, "diff_changes": _diff, "shell": _shell, "read_file": _read, "write_file": _write, "list_dir": _list,
                              "apply_patch": _patch, "search": _search, "start_process": _start,
                              "list_processes": _processes, "read_process_output": _output, "stop_process": _stop}
