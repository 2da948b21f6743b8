"""The MCP stdio transport over one `Exec` call: an upstream server runs as one long command in its
own sandboxd session, and its stdin and stdout carry newline-delimited JSON-RPC, as the SDK's
`mcp.client.stdio` does with a local subprocess. The streams are the SDK's transport streams
(`mcp.client._transport.TransportStreams`), so `mcp.client.session.ClientSession` runs over them
unchanged.

The upstream is not trusted: one message is at most 4 MiB (a longer line means the server is
broken or hostile: the call is ended and the upstream restarted, rather than buffering without
end), what it writes on stderr is kept as its last 64 KiB only, for the message that says why it
stopped, and its own requests (sampling, elicitation, roots) are refused here, one at a time,
never reaching the client session (which would hold a task for each). What it sends unasked
(notifications, requests, lines that are not JSON-RPC) is bounded in rate: at most
MAX_UNASKED_PER_SECOND are handed on each second, the rest dropped (one log line a minute); past
RESTART_UNASKED_PER_SECOND in one second the upstream is broken and restarted, as a chatty server
must not cost the built-in tools and the other upstreams the gateway's one event loop.

The direct path (DirectRequests): a request the gateway sends often (tools/call) is written
straight onto stdin as one JSON line, with an id the client session never uses (the strings
"gw-N": the SDK's ids are integers), and its answer is taken in the reader by that id, before the
session's stream, and handed to the waiting caller as parsed JSON with its line's length. The
SDK's session per request (memory streams, a task per message, pydantic validation of the message
and again of the result) cost about 0.35 ms of each call (docs/performance.md). An answer with a "gw-" id nobody
waits for (its call timed out, or a hostile upstream's invention) is dropped, and counted among
the unasked lines (bounded in rate as they are). The answer is parsed as strictly as the session's
path parses it (pydantic's JSON parser: a lone surrogate in a string is refused, as it could never
be written to the client), and nested at most MAX_DIRECT_DEPTH deep; an answer to a direct id that
is neither is handed to its caller as invalid (an error for that call only), not dropped to wait
out the call's timeout.

A request is written whole or the upstream restarted: a line is written under a shield (bounded by
WRITE_LINE_SECONDS), since a caller cancelled between two of its chunks would leave part of a line
on stdin, and the next request would be glued to it. An upstream that does not take a line within
the bound is broken (it does not read its stdin), and ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import anyio
import grpc
import grpc.aio
import mcp_types as types
from mcp.client._transport import ReadStream, WriteStream
from mcp.shared.exceptions import MCPError
from mcp.shared.message import SessionMessage
from pydantic_core import from_json

from sandboxd.printable import printable
from sandboxd.v1 import sandboxd_pb2 as pb
from sandboxd.v1 import sandboxd_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 4 << 20          # one JSON-RPC line from the upstream
STDERR_TAIL_BYTES = 64 << 10         # what is kept of the upstream's stderr
STDIN_CHUNK_BYTES = 1 << 20          # one ExecRequest.stdin (the daemon's messages are at most a few MiB)
MAX_UNASKED_PER_SECOND = 100        # notifications/requests/stray lines handed on per second; the rest dropped
RESTART_UNASKED_PER_SECOND = 1000   # past this many in one second: the upstream is broken, restarted
DROP_LOG_SECONDS = 60.0             # one log line per this long about dropped lines
CLOSE_GRACE_SECONDS = 2.0            # stdin closed -> exit on its own; then SIGKILL -> the result; then cancel
DIRECT_ID_PREFIX = "gw-"             # ids of the direct requests (the SDK's client session numbers its own)
CANCEL_WRITE_SECONDS = 2.0           # writing a direct request's notifications/cancelled, at most
DIRECT_ID_MARK = b'"' + DIRECT_ID_PREFIX.encode()   # in a line that may answer a direct request (checked before parsing)
MAX_DIRECT_DEPTH = 64                # nesting of a direct answer (pydantic cannot serialize a few hundred deep)
WRITE_LINE_SECONDS = 10.0            # writing one line onto stdin, at most (shielded: a line is never cut)


@dataclass
class ServerProcess:
    """What is known of one run of an upstream's server (one Exec call)."""

    call_id: str = ""
    pid: int = 0
    result: pb.ExecResult | None = None
    error: str = ""                  # the Exec call failed (the daemon refused it, the channel broke)
    fault: str = ""                  # the upstream broke the transport (a message over the bound)
    invalid_lines: int = 0           # stdout lines that were not JSON-RPC messages (dropped)
    refused_requests: int = 0        # its own requests to the gateway (sampling, elicitation, roots), refused
    unasked: int = 0                 # notifications and requests of its own handed on (within the rate)
    dropped_unasked: int = 0         # lines past the rate, dropped unread (or unanswered)
    stray_answers: int = 0           # answers with a direct id nobody waits for (dropped)
    name: str = ""                   # the upstream's name, for the log
    stderr_tail: bytearray = field(default_factory=bytearray)
    _window_start: float = -1.0
    _in_window: int = 0
    _logged_at: float = -DROP_LOG_SECONDS
    ended: anyio.Event = field(default_factory=anyio.Event)   # the Exec call's stream ended

    def keep_stderr(self, data: bytes) -> None:
        self.stderr_tail += data
        if len(self.stderr_tail) > STDERR_TAIL_BYTES:
            del self.stderr_tail[:len(self.stderr_tail) - STDERR_TAIL_BYTES]

    def admit_unasked(self, now: float) -> bool:
        """Whether one more unasked line may be handed on now (within MAX_UNASKED_PER_SECOND);
        OverflowError past RESTART_UNASKED_PER_SECOND in one second."""
        if now - self._window_start >= 1.0:
            self._window_start, self._in_window = now, 0
        self._in_window += 1
        if self._in_window <= MAX_UNASKED_PER_SECOND:
            return True
        self.dropped_unasked += 1
        if self._in_window > RESTART_UNASKED_PER_SECOND:
            raise OverflowError
        if now - self._logged_at >= DROP_LOG_SECONDS:
            self._logged_at = now
            log.warning("gateway: %s sends more than %d notifications (or requests) a second: the rest are dropped "
                        "(%d so far; logged once a minute)", printable(self.name) or "an upstream",
                        MAX_UNASKED_PER_SECOND, self.dropped_unasked)
        return False

    def stderr_lines(self, count: int = 5) -> str:
        """The last lines of stderr, printable, for a message."""
        lines = bytes(self.stderr_tail).decode("utf-8", "replace").strip().splitlines()[-count:]
        return printable(" | ".join(lines))[:1000]

    def why_ended(self) -> str:
        """Why the server is gone, for a person or the model (printable)."""
        if self.fault:
            what = self.fault
        elif self.error:
            what = f"its Exec call failed: {printable(self.error)}"
        elif self.result is None:
            what = "its Exec call ended without a result"
        elif self.result.timed_out:
            what = "it ran past its session's time limit"
        elif self.result.signal:
            what = f"it was killed by signal {self.result.signal}" + (" (out of memory)" if self.result.oom_killed
                                                                         else "")
        else:
            what = f"it exited with status {self.result.exit_code}"
        tail = self.stderr_lines()
        return f"{what}; its last stderr: {tail}" if tail else what


class _Lines:
    """stdout bytes -> complete lines, each at most MAX_MESSAGE_BYTES (else OverflowError)."""

    def __init__(self) -> None:
        self._partial = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        lines: list[bytes] = []
        start = 0
        while True:
            end = data.find(b"\n", start)
            piece = data[start:] if end < 0 else data[start:end]
            if len(self._partial) + len(piece) > MAX_MESSAGE_BYTES:
                raise OverflowError
            self._partial += piece
            if end < 0:
                return lines
            lines.append(bytes(self._partial))
            self._partial.clear()
            start = end + 1


def _parse(line: bytes) -> SessionMessage | None:
    try:
        return SessionMessage(types.jsonrpc_message_adapter.validate_json(line, by_name=False))
    except ValueError:                       # pydantic's ValidationError is a ValueError
        return None


class DirectAnswer(NamedTuple):
    """The upstream's answer to a direct request: the JSON-RPC message as parsed (a dict), and the
    length of its line (a bound can be checked before anything validates it); ``invalid`` says why
    the line is not valid JSON-RPC when it is not (then ``message`` holds only its id)."""

    message: dict[str, Any]
    size: int
    invalid: str = ""


def _depth_over(value: Any, limit: int) -> bool:
    """Whether ``value`` (parsed JSON) nests more than ``limit`` deep; iterative (no recursion)."""
    level: list[Any] = [value] if isinstance(value, (dict, list)) else []
    for _ in range(limit):
        if not level:
            return False
        level = [child for node in level for child in (node.values() if isinstance(node, dict) else node)
                 if isinstance(child, (dict, list))]
    return bool(level)


def _is_direct(message: Any) -> bool:
    return (isinstance(message, dict) and "method" not in message and isinstance(message.get("id"), str)
            and message["id"].startswith(DIRECT_ID_PREFIX))


def _direct_answer(line: bytes) -> DirectAnswer | None:
    """``line`` parsed, if it is an answer (no "method") whose id is a direct one; else None. Parsed
    by pydantic's parser (jiter), as the session's path does: it refuses a lone surrogate (which
    json.loads takes, and no serializer writes back). A line it refuses whose id is a direct one
    (json.loads finds it) is an invalid answer for its caller."""
    try:
        message = from_json(line)
    except ValueError as error:              # not JSON, not UTF-8, a lone surrogate, nested past jiter's limit
        try:
            lenient = json.loads(line)
        except (ValueError, RecursionError):     # nested too deep for json too: the session's path counts it
            return None
        if not _is_direct(lenient):
            return None
        return DirectAnswer({"id": lenient["id"]}, len(line), f"its answer is not valid JSON: {printable(str(error))}")
    if not _is_direct(message):
        return None
    if _depth_over(message, MAX_DIRECT_DEPTH):
        return DirectAnswer({"id": message["id"]}, len(line), f"its answer nests more than {MAX_DIRECT_DEPTH} deep")
    return DirectAnswer(message, len(line))


class DirectRequests:
    """Requests written straight onto the upstream's stdin, their answers taken in the reader by
    their id (the module's doc). One per run of the server; a caller waits at most as long as its
    own bound (Upstream._request's timeout), and leaving the wait (a timeout, a cancel) sends the
    upstream ``notifications/cancelled`` with that id, as the SDK's session does."""

    def __init__(self, write: Callable[[bytes], Awaitable[None]]) -> None:
        self._write = write
        self._pending: dict[str, asyncio.Future[DirectAnswer]] = {}   # one per caller waiting (bounded by them)
        self._count = 0
        self._closed = False

    @property
    def pending(self) -> int:
        return len(self._pending)

    async def request(self, method: str, params: dict[str, Any]) -> DirectAnswer:
        """Send one request, wait for its answer. MCPError(CONNECTION_CLOSED) once the call is over."""
        if self._closed:
            raise MCPError(types.CONNECTION_CLOSED, "Connection closed")
        self._count += 1
        request_id = f"{DIRECT_ID_PREFIX}{self._count}"
        # json.dumps escapes every control character: the line cannot be split by what it carries.
        line = json.dumps({"jsonrpc": "2.0", "id": request_id, "method": method, "params": params},
                          separators=(",", ":")).encode() + b"\n"
        answer: asyncio.Future[DirectAnswer] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = answer
        written = False
        try:
            try:
                written = True            # a write interrupted may still have gone out: it counts as sent
                await self._write(line)
            except (grpc.aio.AioRpcError, grpc.aio.UsageError, RuntimeError):
                # The call is over: the reader's end fails the wait with why (its exit status, its stderr).
                with anyio.move_on_after(CLOSE_GRACE_SECONDS):
                    return await asyncio.shield(answer)
                raise MCPError(types.CONNECTION_CLOSED, "Connection closed") from None
            return await answer
        except asyncio.CancelledError:
            if written and not self._closed:
                await self._cancel(request_id)
            raise
        finally:
            del self._pending[request_id]

    async def _cancel(self, request_id: str) -> None:
        """Tell the upstream to stop working on ``request_id`` (a bounded write, shielded: the
        caller is being cancelled)."""
        line = json.dumps({"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {
            "requestId": request_id, "reason": "the gateway stopped waiting (the call's timeout or its client's cancel)"}},
            separators=(",", ":")).encode() + b"\n"
        with anyio.move_on_after(CANCEL_WRITE_SECONDS, shield=True):
            with contextlib.suppress(grpc.aio.AioRpcError, grpc.aio.UsageError, RuntimeError):
                await self._write(line)

    def answered(self, answer: DirectAnswer) -> bool:
        """The reader's answer for a direct id: to its caller (True), or nobody waits (False)."""
        waiting = self._pending.get(answer.message["id"])
        if waiting is None or waiting.done():
            return False
        waiting.set_result(answer)
        return True

    def close(self) -> None:
        """The transport ended: every caller waiting hears so (Upstream._failure says why)."""
        self._closed = True
        for waiting in self._pending.values():
            if not waiting.done():
                waiting.set_exception(MCPError(types.CONNECTION_CLOSED, "Connection closed"))


class StdioTransport(NamedTuple):
    """What exec_stdio_client yields: the SDK's transport streams (for a ClientSession), and the
    direct path beside them."""

    read_stream: ReadStream[SessionMessage | Exception]
    write_stream: WriteStream[SessionMessage]
    direct: DirectRequests


@contextlib.asynccontextmanager
async def exec_stdio_client(stub: pb_grpc.SandboxStub, start: pb.ExecStart,
                            process: ServerProcess) -> AsyncIterator[StdioTransport]:
    """Run ``start`` (a command in a session) as one Exec call and yield the MCP transport streams
    over its stdin and stdout, and the direct path beside them; ``process`` is filled as the call
    goes. Leaving the context ends the
    call: stdin is closed, then the command is killed, then the call is cancelled, each after a
    bounded wait, so that no server outlives its transport."""
    call = stub.Exec()
    read_writer, read_stream = anyio.create_memory_object_stream[SessionMessage | Exception](0)
    write_stream, write_reader = anyio.create_memory_object_stream[SessionMessage](0)

    async def read_output() -> None:
        lines = _Lines()
        try:
            async with read_writer:
                while True:
                    response = await call.read()
                    if response is grpc.aio.EOF:
                        return
                    kind = response.WhichOneof("kind")
                    if kind == "started_pid":
                        process.pid, process.call_id = response.started_pid, response.call_id
                    elif kind == "stderr":
                        process.keep_stderr(response.stderr)
                    elif kind == "result":
                        process.result = response.result
                    elif kind == "stdout":
                        try:
                            complete = lines.feed(response.stdout)
                        except OverflowError:
                            process.fault = f"it sent a message over {MAX_MESSAGE_BYTES >> 20} MiB"
                            return
                        try:
                            for line in complete:
                                await hand_on(line)
                        except OverflowError:
                            process.fault = (f"it sent over {RESTART_UNASKED_PER_SECOND} notifications (or requests) "
                                             f"in one second (the gateway takes {MAX_UNASKED_PER_SECOND})")
                            return
        except grpc.aio.AioRpcError as error:
            if error.code() != grpc.StatusCode.CANCELLED:
                process.error = f"{error.code().name}: {error.details()}"
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            pass                              # the session is gone; the context's exit ends the call
        finally:
            direct.close()
            process.ended.set()

    async def hand_on(line: bytes) -> None:
        """One stdout line: an answer to a direct request to its caller (one whose id nobody waits
        for is dropped, and counted against the rate), other answers to the session; what the
        upstream sends unasked only within its rate (OverflowError past the restart rate). Past the rate, a line
        that cannot be an answer (no "id") is dropped before it is parsed: dropping stays cheap."""
        if not line.strip():
            return
        has_id = b'"id"' in line
        if has_id and DIRECT_ID_MARK in line:
            answer = _direct_answer(line)
            if answer is not None:
                if not direct.answered(answer):
                    process.stray_answers += 1
                    process.admit_unasked(time.monotonic())     # dropped either way; a flood of them restarts it
                return
        if not has_id and not process.admit_unasked(time.monotonic()):   # a notification or a stray line
            return
        message = _parse(line)
        unasked = message is None or not isinstance(message.message, (types.JSONRPCResponse, types.JSONRPCError))
        if unasked and has_id and not process.admit_unasked(time.monotonic()):
            return
        if message is None:
            # Not JSON-RPC (a stray print, a hostile server): counted and dropped,
            # neither logged line by line nor handed to the session.
            process.invalid_lines += 1
        elif isinstance(message.message, types.JSONRPCRequest):
            process.unasked += 1
            await answer_request(message.message)
        else:
            process.unasked += unasked
            await read_writer.send(message)

    async def send_line(message: types.JSONRPCMessage) -> None:
        await write_line((message.model_dump_json(by_alias=True, exclude_unset=True) + "\n").encode())

    async def write_line(data: bytes) -> None:
        """One line onto stdin, whole (the module's doc): shielded from its caller's cancel, bounded
        by WRITE_LINE_SECONDS; past the bound the upstream is ended (RuntimeError)."""
        async with writing:                   # one write at a time on the call
            written = 0
            with anyio.move_on_after(WRITE_LINE_SECONDS, shield=True):
                for offset in range(0, len(data), STDIN_CHUNK_BYTES):
                    try:
                        await call.write(pb.ExecRequest(stdin=data[offset:offset + STDIN_CHUNK_BYTES]))
                    except asyncio.InvalidStateError:       # grpc's word for a call already finished
                        raise RuntimeError("the upstream's Exec call is over") from None
                    written = offset + STDIN_CHUNK_BYTES
            if written < len(data):
                process.fault = process.fault or (f"it did not read a line of its stdin within {WRITE_LINE_SECONDS:g} s "
                                                  "(the line would be cut)")
                call.cancel()
                raise RuntimeError(process.fault)

    async def answer_request(request: types.JSONRPCRequest) -> None:
        """The upstream's own request, answered here, in the reader, before its next line is read:
        a ping with an empty result; anything else (sampling, elicitation, roots, ...) refused, as
        the gateway declares no such capability. Answered one at a time, so an upstream that sends
        requests without reading the answers stalls itself, and holds nothing of the gateway's."""
        if request.method == "ping":
            answer: types.JSONRPCMessage = types.JSONRPCResponse(jsonrpc="2.0", id=request.id, result={})
        else:
            answer = types.JSONRPCError(jsonrpc="2.0", id=request.id, error=types.ErrorData(
                code=types.METHOD_NOT_FOUND, message=f"refused: the sandboxd gateway declares no client capability "
                                                     f"for {printable(request.method)[:100]}"))
        process.refused_requests += request.method != "ping"
        with contextlib.suppress(grpc.aio.AioRpcError, grpc.aio.UsageError, RuntimeError):
            await send_line(answer)

    async def write_input() -> None:
        try:
            async with write_reader:
                async for message in write_reader:
                    await send_line(message.message)
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, anyio.ClosedResourceError, anyio.BrokenResourceError,
                RuntimeError) as error:
            # The call is over (the server exited, the daemon went away): the session must see the
            # connection end rather than wait on a request nobody will read.
            log.debug("gateway: writing to an upstream's stdin failed: %s", printable(str(error)))
            await read_writer.aclose()

    async def finish() -> None:
        """Stdin closed, then SIGKILL, then the call cancelled: each after a bounded wait."""
        for request in (pb.ExecRequest(close_stdin=True), pb.ExecRequest(signal=int(signal.SIGKILL))):
            if process.ended.is_set():
                return
            with contextlib.suppress(grpc.aio.AioRpcError, grpc.aio.UsageError, RuntimeError):
                with anyio.move_on_after(CLOSE_GRACE_SECONDS):
                    async with writing:
                        await call.write(request)
            with anyio.move_on_after(CLOSE_GRACE_SECONDS):
                await process.ended.wait()
        if not process.ended.is_set():
            call.cancel()

    writing = anyio.Lock()
    direct = DirectRequests(write_line)
    await call.write(pb.ExecRequest(start=start))
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(read_output)
        tasks.start_soon(write_input)
        try:
            yield StdioTransport(read_stream, write_stream, direct)
        finally:
            with anyio.CancelScope(shield=True):
                write_stream.close()
                read_stream.close()
                await finish()
                call.cancel()                  # no-op once the call has ended
            tasks.cancel_scope.cancel()
