"""A command's output on its way to this terminal, held back while `sandboxctl exec` shows a card
in place (cli.approval_prompt): a network question is asked while the command runs and writes raw
bytes to the same terminal, and bytes written after the card could erase it and draw another
(one naming a different host) before the person presses a key.

So while a card is up, nothing of the command's reaches the terminal: its output waits here, in
order, up to HOLD_BYTES; past that this stops reading the Exec stream (the daemon, then the
command, wait: backpressure), and nothing is dropped or reordered. After the answer it is written.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

from sandboxd.client import write_through

HOLD_BYTES = 1 << 20
# Before a card: undo what the command's bytes may have left the terminal in. CAN ends an unfinished
# escape or control sequence and ST an unfinished string (an OSC title would swallow the card), SGR 0
# drops colours (black on black, concealed), DECSTR (soft reset) resets modes, character sets and
# the scroll region without clearing the screen, and may leave autowrap off, which would cut the card's
# long lines at the margin: turned on again; CR, then the card's own newline: a fresh line.
SOFT_RESET = "\x18\x1b\\\x1b[0m\x1b[!p\x1b[?7h\r"


class HeldOutput:
    """``write`` passes the command's output through unless ``holding``; then it keeps it (in
    order) until the hold ends, and past ``limit`` bytes it blocks its caller until then."""

    def __init__(self, write: Callable[[int, bytes], None] = write_through, limit: int = HOLD_BYTES) -> None:
        self._write, self._limit = write, limit
        self._changed = threading.Condition()
        self._held: list[tuple[int, bytes]] = []
        self._size = 0
        self._holding = False

    def write(self, stream: int, data: bytes) -> None:
        with self._changed:
            if not self._holding:
                self._write(stream, data)          # under the lock: a hold begins only between writes
                return
            self._held.append((stream, data))
            self._size += len(data)
            while self._holding and self._size >= self._limit:
                self._changed.wait()               # stop reading the stream until the answer

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        """Nothing of the command's is written inside; what came meanwhile is written after."""
        with self._changed:                        # waits for a write in progress
            self._holding = True
        try:
            yield
        finally:
            self.release()

    def release(self) -> None:
        """Write what was held, in order, and let output through again."""
        with self._changed:
            self._holding = False
            held, self._held, self._size = self._held, [], 0
            for stream, data in held:
                self._write(stream, data)
            self._changed.notify_all()
