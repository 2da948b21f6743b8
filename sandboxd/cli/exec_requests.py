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


class ExecRequests:
    """``start`` first, then whatever is put, until ``close``."""

    def __init__(self, start: pb.ExecStart) -> None:
        self._queue: queue.Queue[pb.ExecRequest | None] = queue.Queue()
        self._queue.put(pb.ExecRequest(start=start))
        self._pump: threading.Thread | None = None
        self._stop_r, self._stop_w = -1, -1

    def __iter__(self) -> Iterator[pb.ExecRequest]:
        while (request := self._queue.get()) is not None:
            yield request

    def put(self, request: pb.ExecRequest) -> None:
        self._queue.put(request)

    def close(self) -> None:
        """End the stream (the iterator returns), and the stdin pump with it: a key typed after the
        call is no longer the command's (a prompt of sandboxctl's own may read it next)."""
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
