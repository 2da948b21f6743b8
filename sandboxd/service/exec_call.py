"""Exec: one command in a session, with stdin in and output streamed out.

Output is read from pipes in fixed-size chunks and yielded one message at a
time: when the client reads slowly, gRPC's flow control blocks the yield,
we stop reading, the pipe fills and the command blocks in write(). Memory is
bounded by the pipe and one chunk, never by the amount of output. Past the
per-call cap, output is still drained (so the command is not stuck) but
dropped, and the result says `output_truncated`.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Iterator

import grpc

from sandboxd.errors import InvalidPolicy, WrongState
from sandboxd.policy.limits import check_timeout
from sandboxd.policy.spec import check_command
from sandboxd.service import environment, terminal_call
from sandboxd.service.call_results import CallRecord
from sandboxd.service.calls import SessionCall, write_all
from sandboxd.service.sessions.registry import Session, SessionRegistry
from sandboxd.supervisor.fork_client import ForkServer
from sandboxd.supervisor.spawner import ExitInfo
from sandboxd.v1 import sandboxd_pb2 as pb

DEFAULT_OUTPUT_LIMIT = 64 << 20


def command_of(start: pb.ExecStart) -> list[str]:
    if start.argv and start.shell:
        raise InvalidPolicy("give either argv or shell, not both")
    if start.shell:
        return ["/bin/sh", "-c", start.shell]
    if not start.argv or not start.argv[0]:
        raise InvalidPolicy("nothing to run: give argv (a program and its arguments) or shell (a /bin/sh string)")
    return list(start.argv)


def check_start(start: pb.ExecStart, argv: list[str], session: Session) -> None:
    """What the kernel or the clock would refuse, refused before anything runs, saying what to fix."""
    environment.check_start(start)
    if start.checkpoint and not session.review:
        raise WrongState(f"session {session.id} is not in review mode: a call's checkpoint is a point of its "
                         "change set (create the session with review, or leave checkpoint unset)")
    check_command(argv, {**environment.worst_case(session, start), **session.extra_env})
    if start.timeout_seconds:
        check_timeout(start.timeout_seconds)
    if start.HasField("terminal"):
        terminal_call.check_terminal(start.terminal)


def check_unstreamed(start: pb.ExecStart) -> None:
    """What a call with no request stream (Run) cannot do, refused before it is authorized."""
    if start.HasField("terminal"):
        raise InvalidPolicy("a terminal call takes keystrokes and resizes after `start`: run it with Exec, not Run")


def run(registry: SessionRegistry, fork: ForkServer, session: Session, start: pb.ExecStart, argv: list[str],
        cwd: str, requests: Iterator[pb.ExecRequest] | None,
        context: grpc.ServicerContext, record: CallRecord | None = None, tag: str = "") -> Iterator[pb.ExecResponse]:
    """``argv`` and ``cwd``: from ``command_of(start)`` and ``cwd_inside``, as the caller checked them.
    ``requests``: Exec's stream after `start` (stdin, signals, resizes: read by a feeder thread);
    None for Run, where nothing follows `start`: its stdin is written and closed here, and a thread
    is started only for the part of it the pipe does not take at once. ``record``: the call's entry
    in the daemon's CallResults (WaitCall), fed its output and end; its id goes with the first message. ``tag``: the call's audit
    identity for a surviving supervisor (SessionCall)."""
    env = {**environment.command_env(registry, fork, session, start), **session.extra_env}
    timeout = start.timeout_seconds or session.limits.timeout_seconds
    limit = start.output_limit_bytes or DEFAULT_OUTPUT_LIMIT
    call: SessionCall
    if start.HasField("terminal"):
        call = terminal_call.TerminalCall(registry, fork, session, argv, env=terminal_call.environment(env, start.terminal),
                                          cwd=cwd, timeout=timeout, size=terminal_call.check_terminal(start.terminal))
    else:
        call = SessionCall(registry, fork, session, argv, env=env, cwd=cwd, timeout=timeout, tag=tag)
    try:
        yield from _run_call(call, fork, start, requests, context, limit, record)
    finally:
        # Given up (the client left, an error): as it ended. Not when this daemon handed its
        # sandboxes over: the call runs on, and the next daemon records its end (handover.adopt).
        if record is not None and not fork.handed_over:
            record.finished(call.exit_info)


def _run_call(call: SessionCall, fork: ForkServer, start: pb.ExecStart, requests: Iterator[pb.ExecRequest] | None,
              context: grpc.ServicerContext, limit: int, record: CallRecord | None) -> Iterator[pb.ExecResponse]:
    with call:
        context.add_callback(call.cancel)
        if record is not None:
            record.start()
        yield pb.ExecResponse(started_pid=call.inner_pid or 0, call_id=record.call_id if record is not None else "")
        assert call.call_id is not None
        if requests is None:
            assert not isinstance(call, terminal_call.TerminalCall), "check_unstreamed refuses a terminal"
            rest = _write_what_fits(call.take_stdin(), start.stdin)
            if rest is not None:
                threading.Thread(target=_write_and_close, args=rest, name=f"sandboxd-stdin-{call.call_id}",
                                 daemon=True).start()
        else:
            feeder, args = ((terminal_call.feed, (fork, call, start, requests))
                            if isinstance(call, terminal_call.TerminalCall)
                            else (_feed, (fork, call.call_id, call.take_stdin(), start, requests)))
            threading.Thread(target=feeder, args=args, name=f"sandboxd-stdin-{call.call_id}", daemon=True).start()
        truncated = False
        for stream, chunk in call.output():
            if record is not None:                        # the tail of what it wrote, past the cap too
                record.output(stream, chunk)
            if limit <= 0:
                truncated = True
                continue
            if len(chunk) > limit:
                chunk, truncated = chunk[:limit], True
            limit -= len(chunk)
            yield pb.ExecResponse(stdout=chunk) if stream == 1 else pb.ExecResponse(stderr=chunk)
        info = call.wait()
        if record is not None:
            record.finished(info)
        yield pb.ExecResponse(result=result_to_proto(info, truncated=truncated))


def result_to_proto(info: ExitInfo, *, truncated: bool) -> pb.ExecResult:
    return pb.ExecResult(exit_code=info.exit_code or 0, signal=info.signal or 0, timed_out=info.timed_out,
                         wall_seconds=info.wall_seconds, cpu_seconds=info.cpu_seconds or 0.0,
                         peak_memory_bytes=info.peak_memory_bytes or 0, output_truncated=truncated,
                         shell_status=info.shell_status, oom_killed=info.oom_killed)


def result_summary(result: pb.ExecResult) -> dict[str, object]:
    """What the audit log keeps of an ended command."""
    return {"exit_code": result.exit_code, "signal": result.signal, "timed_out": result.timed_out,
            "shell_status": result.shell_status, "wall_seconds": round(result.wall_seconds, 6),
            "output_truncated": result.output_truncated, "oom_killed": result.oom_killed}


def _write_what_fits(stdin_w: int, data: bytes) -> tuple[int, memoryview] | None:
    """Write ``data`` to the command's stdin without blocking and close it; when the pipe is full
    first, (the fd, set blocking again, and what is left) for a thread to finish: this thread must
    go on to read the output, or a command that writes before it reads would deadlock with us."""
    view = memoryview(data)
    try:
        if view:
            os.set_blocking(stdin_w, False)
            while view:
                view = view[os.write(stdin_w, view):]
    except BlockingIOError:
        os.set_blocking(stdin_w, True)
        return stdin_w, view
    except OSError:
        pass  # the command closed its stdin (EPIPE): what it did not read is dropped, as with Exec
    os.close(stdin_w)
    return None


def _write_and_close(stdin_w: int, rest: memoryview) -> None:
    try:
        while rest:
            rest = rest[os.write(stdin_w, rest):]
    except OSError:
        pass  # the command closed its stdin, or ended
    finally:
        os.close(stdin_w)


def _feed(fork: ForkServer, call_id: int, stdin_w: int, start: pb.ExecStart,
          requests: Iterator[pb.ExecRequest]) -> None:
    """Write stdin and deliver signals as the client sends them; close stdin when asked or at the end."""
    try:
        if start.stdin:
            write_all(stdin_w, start.stdin)
        if start.close_stdin:
            os.close(stdin_w)
            stdin_w = -1
        for request in requests:
            kind = request.WhichOneof("kind")
            if kind == "stdin" and stdin_w >= 0:
                write_all(stdin_w, request.stdin)
            elif kind == "close_stdin" and stdin_w >= 0:
                os.close(stdin_w)
                stdin_w = -1
            elif kind == "signal":
                if not 0 < request.signal < signal.NSIG:
                    continue
                fork.signal(call_id, request.signal)
    except (OSError, grpc.RpcError, ValueError):
        pass  # the command closed its stdin, or the client went away: the main flow sees it
    finally:
        if stdin_w >= 0:
            try:
                os.close(stdin_w)
            except OSError:
                pass

