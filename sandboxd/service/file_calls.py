"""ReadFile, WriteFile, ListDir: the policy engine answers first, with a reason (see
``write_effect`` and sandboxd.service.approvals); then the tool runs inside the session's
sandbox (sandboxd.launcher.file_tools), where the kernel answers too."""

from __future__ import annotations

import errno
import os
import threading
from typing import Iterator

from sandboxd.errors import DeadlineExceeded, Forbidden, InvalidPolicy, NotFound, SandboxdError
from sandboxd.policy.git_config import GIT_GUARD_SUBPATH
from sandboxd.policy.sandbox import SandboxMode
from sandboxd.policy.tools import WriteScope
from sandboxd.service.calls import SessionCall, write_all
from sandboxd.service.convert import check_path
from sandboxd.service.sessions.registry import Session, SessionRegistry
from sandboxd.supervisor.fork_client import ForkServer
from sandboxd.supervisor.spawner import ExitInfo
from sandboxd.v1 import sandboxd_pb2 as pb

# A default ReadFile answer fits a default gRPC client (it accepts 4 MiB messages; the rest is
# room for the message around the data). A larger max_bytes is honoured up to the daemon's
# maximum, whatever the request says: the daemon buffers one answer per call.
DEFAULT_READ_LIMIT = (4 << 20) - (64 << 10)
MAX_READ_LIMIT = 64 << 20
TOOL_TIMEOUT = 60.0
TOOL_ARGV = ["sandboxd-file-tool"]  # shown as the call's argv; nothing is exec'd


def read_limit(max_bytes: int) -> int:
    """ReadFile's byte limit: the default for 0, else what was asked, capped at the daemon's maximum."""
    return min(int(max_bytes), MAX_READ_LIMIT) or DEFAULT_READ_LIMIT


def resolve(session: Session, path: str) -> str:
    if not path:
        return session.workspace
    check_path(path)
    resolved = os.path.normpath(path if path.startswith("/") else os.path.join(session.workspace, path))
    return check_path(resolved, "the path (joined to the workspace)")


def write_scope(session: Session) -> WriteScope:
    """Where the session's calls write without anyone being asked (policy.tools.WriteScope): the
    workspace and the writable roots its current sandbox was built with (the fork server's facts:
    their real paths, as the owner's lookup resolved them by descriptor, which is what the sandbox
    binds; never the policy's names looked up again here, as root, which a caller could swap for a
    symlink meanwhile), their protected subpaths, and a confined sandbox's private /tmp and
    /dev/shm. Without a sandbox (resumed, not built yet: SessionRegistry.ready builds it first) only
    the workspace: every other write is asked about."""
    with session.lock:
        policy, facts, workspace = session.policy, session.built.get(session.generation), session.workspace
    roots = (workspace,) if facts is None else (facts.workspace, *facts.writable_roots)
    protected = policy.protected_subpaths
    read_only = policy.mode is SandboxMode.READ_ONLY
    return WriteScope(roots=roots, protected=protected, scratch=("/tmp", "/dev/shm") if policy.confined else (),
                      writes_allowed=not read_only, git_guarded=read_only or GIT_GUARD_SUBPATH in protected)


def write_effect(session: Session, paths: list[str]) -> tuple[str, str]:
    """The effect of writing ``paths`` (resolved, absolute) in this session, and for a destructive
    one the reason: a write outside the writable roots, or under a protected subpath, counts as
    destructive (the policy engine then refuses it unless the sandbox is danger-full-access)."""
    return write_scope(session).effect_of(paths)


def run_tool(registry: SessionRegistry, fork: ForkServer, session: Session, tool: dict[str, object],
             data: bytes = b"", limit: int = DEFAULT_READ_LIMIT, timeout: float = TOOL_TIMEOUT) -> tuple[int, bytes]:
    """Run a file tool in the session; return (exit code, stdout); raise the mapped error on failure."""
    info, out, err = run_in_session(registry, fork, session, TOOL_ARGV, tool=tool, data=data, limit=limit,
                                    timeout=timeout)
    if info.timed_out:
        raise DeadlineExceeded(f"the file tool ({tool.get('op')}) ran past its {timeout:g} s budget and was "
                               "stopped" + (": simplify the pattern (nested repeats like (a+)+ backtrack) or use "
                                            "ripgrep" if tool.get("op") == "search" else ""))
    if info.exit_code in (0, 3):
        return info.exit_code, out
    raise _error_from(err)


def run_in_session(registry: SessionRegistry, fork: ForkServer, session: Session, argv: list[str], *,
                   tool: dict[str, object] | None = None, data: bytes = b"", limit: int = DEFAULT_READ_LIMIT,
                   env: dict[str, str] | None = None, timeout: float = TOOL_TIMEOUT) -> "tuple[ExitInfo, bytes, bytes]":
    """A short command (or file tool) in the session with ``data`` on stdin; (how it ended, stdout, stderr)."""
    with SessionCall(registry, fork, session, argv, env=env or {}, cwd=session.workspace, timeout=timeout,
                     tool=tool) as call:
        threading.Thread(target=_feed, args=(call.take_stdin(), data), daemon=True).start()
        out, err = _collect(call.output(), limit)
        return call.wait(), out, err


def _feed(fd: int, data: bytes) -> None:
    try:
        write_all(fd, data)
    except OSError:
        pass  # the tool stopped reading: it reports why
    finally:
        os.close(fd)


def _collect(output: Iterator[tuple[int, bytes]], limit: int) -> tuple[bytes, bytes]:
    """stdout up to ``limit`` and stderr up to 64 KiB; the rest is drained and dropped."""
    chunks: dict[int, list[bytes]] = {1: [], 2: []}
    sizes = {1: 0, 2: 0}
    for stream, data in output:
        if sizes[stream] < (limit if stream == 1 else 65536):
            chunks[stream].append(data)
            sizes[stream] += len(data)
    return b"".join(chunks[1])[:limit], b"".join(chunks[2])


def _error_from(err: bytes) -> SandboxdError:
    code_text, _, message = err.decode(errors="replace").partition("\t")
    code = int(code_text) if code_text.isdigit() else errno.EIO
    text = f"{message or os.strerror(code)} ({errno.errorcode.get(code, code)})"
    if code == errno.ENOENT:
        return NotFound(text)
    if code in (errno.EACCES, errno.EPERM, errno.EROFS):
        return Forbidden(f"refused by the kernel inside the sandbox: {text}")
    return InvalidPolicy(text)


def parse_listing(out: bytes) -> list[pb.DirEntry]:
    entries = []
    for line in out.decode().splitlines():
        kind, size, mode, mtime, name = line.split("\t")
        entries.append(pb.DirEntry(name=os.fsdecode(bytes.fromhex(name)), type=kind, size=int(size),
                                   mode=int(mode), mtime=float(mtime)))
    return entries
