"""ReadFile, WriteFile, ListDir: the policy answers first, with a reason; then the tool runs
inside the session's sandbox (sandboxd.launcher.file_tools), where the kernel answers too."""

from __future__ import annotations

import errno
import os
import select
import threading

from sandboxd.errors import Forbidden, InvalidPolicy, NotFound, SandboxdError
from sandboxd.policy.sandbox import DangerFullAccess, ReadOnly, WorkspaceWrite, is_within
from sandboxd.service.sessions import Session, SessionRegistry
from sandboxd.supervisor.forkserver import ForkServer
from sandboxd.supervisor.spawner import ExitInfo
from sandboxd.v1 import sandboxd_pb2 as pb

DEFAULT_READ_LIMIT = 16 << 20
TOOL_TIMEOUT = 60.0
TOOL_ARGV = ["sandboxd-file-tool"]  # shown as the call's argv; nothing is exec'd


def resolve(session: Session, path: str) -> str:
    if not path:
        return session.workspace
    if "\0" in path:
        raise InvalidPolicy("a path may not contain NUL bytes")
    return os.path.normpath(path if path.startswith("/") else os.path.join(session.workspace, path))


def check_write(session: Session, path: str) -> None:
    """The policy's answer before anything runs: refused writes say why."""
    policy = session.policy
    if isinstance(policy, DangerFullAccess):
        return
    if isinstance(policy, ReadOnly):
        raise Forbidden(f"write to {path!r} refused by the sandbox policy read-only: nothing is writable "
                        "(switch the session to workspace-write to write the workspace)")
    assert isinstance(policy, WorkspaceWrite)
    roots = [session.workspace] + [os.path.realpath(r) for r in policy.writable_roots]
    inside = [root for root in roots if is_within(path, root)]
    if not inside and not (is_within(path, "/tmp") or is_within(path, "/dev/shm")):
        raise Forbidden(f"write to {path!r} refused by the sandbox policy workspace-write: it is outside the "
                        f"workspace and the writable roots ({', '.join(roots)})")
    for root in inside:
        for sub in policy.protected_subpaths:
            if is_within(path, os.path.join(root, sub)):
                raise Forbidden(f"write to {path!r} refused by the sandbox policy: {sub} stays read-only "
                                "inside writable roots")


def run_tool(registry: SessionRegistry, fork: ForkServer, session: Session, tool: dict[str, object],
             data: bytes = b"", limit: int = DEFAULT_READ_LIMIT) -> tuple[int, bytes]:
    """Run a file tool in the session; return (exit code, stdout); raise the mapped error on failure."""
    info, out, err = run_in_session(registry, fork, session, TOOL_ARGV, tool=tool, data=data, limit=limit)
    if info.exit_code in (0, 3):
        return info.exit_code, out
    raise _error_from(err, info.timed_out)


def run_in_session(registry: SessionRegistry, fork: ForkServer, session: Session, argv: list[str], *,
                   tool: dict[str, object] | None = None, data: bytes = b"", limit: int = DEFAULT_READ_LIMIT,
                   env: dict[str, str] | None = None) -> "tuple[ExitInfo, bytes, bytes]":
    """A short command (or file tool) in the session with ``data`` on stdin; (how it ended, stdout, stderr)."""
    stdin_r, stdin_w = os.pipe2(os.O_CLOEXEC)
    out_r, out_w = os.pipe2(os.O_CLOEXEC)
    err_r, err_w = os.pipe2(os.O_CLOEXEC)
    generation = registry.begin_call(session)
    call_id = None
    try:
        try:
            call_id, _ = fork.call(session.sandbox_name(generation), argv, env or {}, session.workspace,
                                   TOOL_TIMEOUT, (stdin_r, out_w, err_w), tool=tool)
        finally:
            for fd in (stdin_r, out_w, err_w):
                os.close(fd)
        feeder = threading.Thread(target=_feed, args=(stdin_w, data), daemon=True)
        stdin_w = -1
        feeder.start()
        out, err = _collect(out_r, err_r, limit)
        info = fork.wait(call_id)
        call_id = None
    finally:
        if call_id is not None:
            fork.cancel(call_id)
            fork.wait(call_id)
        for fd in (stdin_w, out_r, err_r):
            if fd >= 0:
                os.close(fd)
        registry.end_call(session, generation)
    return info, out, err


def _feed(fd: int, data: bytes) -> None:
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    except OSError:
        pass
    finally:
        os.close(fd)


def _collect(out_r: int, err_r: int, limit: int) -> tuple[bytes, bytes]:
    chunks: dict[int, list[bytes]] = {out_r: [], err_r: []}
    sizes = {out_r: 0, err_r: 0}
    open_fds = [out_r, err_r]
    while open_fds:
        ready, _, _ = select.select(open_fds, [], [])
        for fd in ready:
            data = os.read(fd, 1 << 20)
            if not data:
                open_fds.remove(fd)
            elif sizes[fd] < (limit if fd == out_r else 65536):
                chunks[fd].append(data)
                sizes[fd] += len(data)
    return b"".join(chunks[out_r])[:limit], b"".join(chunks[err_r])


def _error_from(err: bytes, timed_out: bool) -> SandboxdError:
    if timed_out:
        return SandboxdError("the file tool timed out")
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
