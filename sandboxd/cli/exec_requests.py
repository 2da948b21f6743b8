"""The request side of one Exec stream from sandboxctl (`exec`, `exec -t`, `shell`): a queue
gRPC's iterator reads from, fed by the caller (signals, resizes) and by a stdin pump thread."""

from __future__ import annotations

import os
import queue
import selectors
import threading
from collections.abc import Iterator

from sandboxd.v1 import sandboxd_pb2 as pb

_STDIN_CHUNK = 1 << 16


class _Stream:
    """One Exec stream's use of the requests: held back until it started, or abandoned."""

    __slots__ = ("opened", "abandoned")

    def __init__(self) -> None:
        self.opened = threading.Event()
        self.abandoned = False


class ExecRequests:
    """``start`` first, then whatever is put, until ``close``. With ``hold_until_started``, what is
    put waits until ``started`` (the daemon ran the command): a call a draining daemon refused took
    only its ``start``, so iterating again (a new stream, after ``abandon``) sends everything whole."""

    def __init__(self, start: pb.ExecStart, *, hold_until_started: bool = False) -> None:
        self._start = pb.ExecRequest(start=start)
        self._queue: queue.Queue[pb.ExecRequest | None] = queue.Queue()
        self._hold = hold_until_started
        self._stream = _Stream()
        self._pump: threading.Thread | None = None
        self._stop_r, self._stop_w = -1, -1

    def __iter__(self) -> Iterator[pb.ExecRequest]:
        stream = self._stream = _Stream()
        yield self._start
        if self._hold:
            stream.opened.wait()
            if stream.abandoned:
                return
        while (request := self._queue.get()) is not None:
            yield request

    def started(self) -> None:
        """The daemon runs the command: what was put flows from now on."""
        self._stream.opened.set()

    def abandon(self) -> None:
        """The stream was refused before it started: its iterator ends, taking nothing put."""
        self._stream.abandoned = True
        self._stream.opened.set()

    def put(self, request: pb.ExecRequest) -> None:
        self._queue.put(request)

    def close(self) -> None:
        """End the stream (the iterator returns), and the stdin pump with it: a key typed after the
        call is no longer the command's (a prompt of sandboxctl's own may read it next)."""
        if not self._stream.opened.is_set():
            self.abandon()
        self._queue.put(None)
        if self._pump is not None:
            os.write(self._stop_w, b"x")
            self._pump.join()
            self._pump = None
            os.close(self._stop_r)
            os.close(self._stop_w)

    def pump_stdin(self, fd: int, *, close_at_eof: bool) -> None:
        """Send what ``fd`` gives as stdin chunks, from a daemon thread; at its end a close_stdin
        if ``close_at_eof`` (a pipe's end; a terminal's end of file is typed instead)."""
        self._stop_r, self._stop_w = os.pipe2(os.O_CLOEXEC)
        stop = self._stop_r

        def pump() -> None:
            with selectors.DefaultSelector() as selector:
                selector.register(stop, selectors.EVENT_READ)
                try:
                    selector.register(fd, selectors.EVENT_READ)
                    pollable = True
                except PermissionError:
                    pollable = False                # a regular file (< FILE): its reads never wait
                try:
                    while True:
                        ready = {key.fd for key, _ in selector.select(None if pollable else 0)}
                        if stop in ready:
                            return                  # closed: nothing more is read for the command
                        chunk = os.read(fd, _STDIN_CHUNK)
                        if not chunk:
                            break
                        self._queue.put(pb.ExecRequest(stdin=chunk))
                except OSError:
                    pass
            if close_at_eof:
                self._queue.put(pb.ExecRequest(close_stdin=True))

        self._pump = threading.Thread(target=pump, daemon=True, name="sandboxctl-stdin")
        self._pump.start()
