"""One call in a session as the daemon drives it (Exec, file tools, patches, search).

``SessionCall`` owns the pipes to the call's stdio, counts the call as running
in its session while it lives, and guarantees the end: a call given up before
``wait`` (the client went away, an error) is cancelled, which kills its whole
tree, and waited for; every pipe is closed either way.
"""

from __future__ import annotations

import fcntl
import os
import select
from typing import Iterator

from sandboxd.service.sessions.registry import Session, SessionRegistry
from sandboxd.supervisor.fork_client import ForkServer, HandedOver
from sandboxd.supervisor.fork_protocol import check_timeout
from sandboxd.supervisor.spawner import ExitInfo

# One gRPC message per CHUNK: larger chunks mean fewer messages for Python to frame
# on both ends, which is what bounds throughput; the pipes are grown to match
# (F_SETPIPE_SZ), so a fast writer fills a chunk between two reads.
CHUNK = 1 << 20
PIPE_SIZE = 1 << 20
F_SETPIPE_SZ = 1031


class SessionCall:
    def __init__(self, registry: SessionRegistry, fork: ForkServer, session: Session, argv: list[str], *,
                 env: dict[str, str], cwd: str, timeout: float | None,
                 tool: dict[str, object] | None = None, tag: str = "") -> None:
        """``tag``: what a surviving supervisor keeps of the call for the next daemon (its audit
        identity: handover.adopt.call_tag); the supervisor also gets the output pipes' read ends."""
        self._registry, self._fork, self._session = registry, fork, session
        self._tag = tag
        # Refused here, before any pipe exists, with what to fix (the fork server checks again).
        timeout = check_timeout(timeout)
        self._request = (argv, env, cwd, timeout, tool)
        self.call_id: int | None = None
        self.inner_pid: int | None = None
        self.stdin_w = self.out_r = self.err_r = -1
        self._generation: int | None = None
        self.exit_info: ExitInfo | None = None        # how it ended, once waited for (also when given up)

    def __enter__(self) -> "SessionCall":
        child_stdio = self._child_stdio()
        try:
            self._generation = self._registry.begin_call(self._session)
            argv, env, cwd, timeout, tool = self._request
            self._start(self._session.sandbox_name(self._generation), argv, env, cwd, timeout, child_stdio, tool)
        except BaseException:
            self.__exit__()
            raise
        finally:
            for fd in set(child_stdio):
                os.close(fd)
        return self

    def _child_stdio(self) -> tuple[int, int, int]:
        """The call's ends of its stdin, stdout and stderr pipes (closed here once it has them)."""
        stdin_r, self.stdin_w = os.pipe2(os.O_CLOEXEC)
        self.out_r, out_w = os.pipe2(os.O_CLOEXEC)
        self.err_r, err_w = os.pipe2(os.O_CLOEXEC)
        for fd in (self.out_r, self.err_r):
            try:
                fcntl.fcntl(fd, F_SETPIPE_SZ, PIPE_SIZE)
            except OSError:
                pass  # above /proc/sys/fs/pipe-max-size for an unprivileged daemon: the default still works
        return stdin_r, out_w, err_w

    def _start(self, sandbox: str, argv: list[str], env: dict[str, str], cwd: str, timeout: float | None,
               stdio: tuple[int, int, int], tool: dict[str, object] | None) -> None:
        self.call_id, self.inner_pid = self._fork.call(sandbox, argv, env, cwd, timeout, stdio, tool=tool,
                                                       tag=self._tag, taps=(self.out_r, self.err_r))

    def take_stdin(self) -> int:
        """The write end of the command's stdin; the caller closes it from now on."""
        fd, self.stdin_w = self.stdin_w, -1
        return fd

    def output(self) -> Iterator[tuple[int, bytes]]:
        """(1 or 2, chunk) as output arrives on stdout or stderr, until both are closed. HandedOver
        when the daemon hands its sandboxes over meanwhile: the call runs on, its output is the
        surviving supervisor's to drain (supervisor.tails)."""
        streams = {self.out_r: 1, self.err_r: 2}
        poller = select.poll()                            # not select(): these fds may be past 1024
        for fd in streams:
            poller.register(fd, select.POLLIN)
        handover = self._fork.handover_fd
        if handover >= 0:                                 # -1: a closed client (nothing to hand over)
            poller.register(handover, select.POLLIN)
        while streams:
            for fd, _ in poller.poll():
                if fd == handover:
                    raise HandedOver()
                if fd not in streams:
                    continue
                data = os.read(fd, CHUNK)
                if not data:                              # EOF (POLLHUP comes with it, or alone)
                    poller.unregister(fd)
                    del streams[fd]
                    continue
                yield streams[fd], data

    def wait(self) -> ExitInfo:
        assert self.call_id is not None
        info = self._fork.wait(self.call_id)
        self.call_id, self.exit_info = None, info
        self._registry.call_ended(self._session)          # before the caller hears the call ended
        return info

    def cancel(self) -> None:
        """Kill the call's tree if it still runs (safe from any thread, and after the end)."""
        call_id = self.call_id
        if call_id is not None:
            self._fork.cancel(call_id)

    def __exit__(self, *_exc: object) -> None:
        try:
            if self.call_id is not None:                  # given up mid-call: kill the tree, collect it
                self._fork.cancel(self.call_id)
                self.wait()
        finally:
            for fd in (self.stdin_w, self.out_r, self.err_r):
                if fd >= 0:
                    try:
                        os.close(fd)
                    except OSError:
                        pass
            self.stdin_w = self.out_r = self.err_r = -1
            if self._generation is not None:
                self._registry.end_call(self._session, self._generation)
                self._generation = None


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
