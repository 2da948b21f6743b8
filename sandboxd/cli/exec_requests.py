"""The request side of one Exec stream from sandboxctl (`exec`, `exec -t`, `shell`): a queue
gRPC's iterator reads from, fed by the caller (signals, resizes) and by a stdin pump thread."""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Iterator

from sandboxd.v1 import sandboxd_pb2 as pb

_STDIN_CHUNK = 1 << 16


class ExecRequests:
    """``start`` first, then whatever is put, until ``close``."""

    def __init__(self, start: pb.ExecStart) -> None:
        self._queue: queue.Queue[pb.ExecRequest | None] = queue.Queue()
        self._queue.put(pb.ExecRequest(start=start))

    def __iter__(self) -> Iterator[pb.ExecRequest]:
        while (request := self._queue.get()) is not None:
            yield request

    def put(self, request: pb.ExecRequest) -> None:
        self._queue.put(request)

    def close(self) -> None:
        """End the stream (the iterator returns)."""
        self._queue.put(None)

    def pump_stdin(self, fd: int, *, close_at_eof: bool) -> None:
        """Send what ``fd`` gives as stdin chunks, from a daemon thread; at its end a close_stdin
        if ``close_at_eof`` (a pipe's end; a terminal's end of file is typed instead)."""
        def pump() -> None:
            try:
                while chunk := os.read(fd, _STDIN_CHUNK):
                    self._queue.put(pb.ExecRequest(stdin=chunk))
            except OSError:
                pass
            if close_at_eof:
                self._queue.put(pb.ExecRequest(close_stdin=True))

        threading.Thread(target=pump, daemon=True, name="sandboxctl-stdin").start()
