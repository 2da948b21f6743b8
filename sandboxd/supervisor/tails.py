"""The output of calls whose daemon is gone, drained by the surviving supervisor into bounded tails.

A call's stdout and stderr are pipes the daemon made and reads. With a surviving supervisor the
daemon also passes it a copy of each read end (fork_protocol.Call's taps), which nobody reads while
that daemon is attached. When the daemon's connection ends (a crash, SIGKILL, a handover) the
pipes would fill and the command block in write() for ever (or, had the supervisor no copy, get
SIGPIPE): from then on the supervisor's loop drains them, never blocking (O_NONBLOCK, polled,
at most DRAIN_PER_TURN bytes per pipe per turn, so one chatty command cannot starve the loop), and
keeps only the last TAIL_BYTES of each stream. The tails go to the next daemon with the call's end
(fork_protocol.CallEnded), which records them (CallResults) and in the audit log.

Bounded per call (two tails of TAIL_BYTES) and in number by the calls that run: a call's tails go
when its end is handed over (or dropped with the oldest ended calls, fork_server.MAX_ENDED).
"""

from __future__ import annotations

import os
import select

TAIL_BYTES = 64 << 10            # what is kept of each stream: its last 64 KiB
DRAIN_PER_TURN = 1 << 20         # the most one pipe is read per turn of the loop
_READ = 64 << 10


class _Tail:
    __slots__ = ("fd", "data", "dropped", "draining")

    def __init__(self, fd: int) -> None:
        self.fd, self.data, self.dropped, self.draining = fd, bytearray(), 0, False

    def keep(self, block: bytes) -> None:
        self.data += block
        extra = len(self.data) - TAIL_BYTES
        if extra > 0:
            del self.data[:extra]
            self.dropped += extra


class OutputTails:
    """The taps of the calls (by call id): held closed-eyed while a daemon reads the pipes, drained
    into tails once ``drain`` is called (the daemon is gone), handed out by ``take``."""

    def __init__(self, poller: "select.poll") -> None:
        self._poller = poller
        self._calls: dict[int, list[_Tail]] = {}
        self._by_fd: dict[int, _Tail] = {}

    def __len__(self) -> int:
        return len(self._calls)

    def __contains__(self, call_id: int) -> bool:
        return call_id in self._calls

    def hold(self, call_id: int, fds: list[int]) -> None:
        """Keep ``fds`` (the call's stdout and stderr read ends, this module's to close) unread."""
        self.drop(call_id)
        self._calls[call_id] = [_Tail(fd) for fd in fds]

    def drain(self, call_id: int) -> None:
        """Nobody else reads the call's output now: drain it on the loop from here on."""
        for tail in self._calls.get(call_id, []):
            if tail.draining or tail.fd < 0:
                continue
            tail.draining = True
            os.set_blocking(tail.fd, False)
            self._by_fd[tail.fd] = tail
            self._poller.register(tail.fd, select.POLLIN)

    def ready(self, fd: int) -> None:
        """poll() said ``fd`` is readable (or hung up): read what is there, up to DRAIN_PER_TURN."""
        tail = self._by_fd.get(fd)
        if tail is not None:
            self._read(tail, DRAIN_PER_TURN)

    def take(self, call_id: int) -> tuple[bytes, bytes, int]:
        """The call ended: what is still in its pipes is read (without waiting: a background
        process of its may hold the write end open for ever), the taps closed, and (stdout's tail,
        stderr's tail, bytes dropped) returned. Empty tails for a call whose output its daemon read."""
        tails = self._calls.pop(call_id, [])
        for tail in tails:
            if tail.draining:
                self._read(tail, TAIL_BYTES * 16)
            self._close(tail)
        out = bytes(tails[0].data) if tails else b""
        err = bytes(tails[1].data) if len(tails) > 1 else b""
        return out, err, sum(tail.dropped for tail in tails)

    def drop(self, call_id: int) -> None:
        """Close the call's taps unread (its daemon read its output, or it never started)."""
        for tail in self._calls.pop(call_id, []):
            self._close(tail)

    def close(self) -> None:
        for call_id in list(self._calls):
            self.drop(call_id)

    def _read(self, tail: _Tail, budget: int) -> None:
        while budget > 0 and tail.fd >= 0:
            try:
                block = os.read(tail.fd, _READ)
            except BlockingIOError:
                return
            except OSError:
                block = b""
            if not block:                                  # EOF: every writer is gone
                self._unwatch(tail)
                return
            budget -= len(block)
            tail.keep(block)

    def _unwatch(self, tail: _Tail) -> None:
        if self._by_fd.pop(tail.fd, None) is not None:
            self._poller.unregister(tail.fd)
        os.close(tail.fd)
        tail.fd = -1

    def _close(self, tail: _Tail) -> None:
        if tail.fd >= 0:
            self._unwatch(tail)
