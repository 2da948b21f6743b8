"""One key at a time from a terminal, for the prompts a person answers in place: a held call's
(cli.approval_prompt: y, s, n) and the end of `sandboxd run --review` (cli.run_review: a, d, k, r)."""

from __future__ import annotations

import os
import selectors
import sys
import termios
import threading
import time

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Callable

CTRL_C, CTRL_D = "\x03", "\x04"
POLL_SECONDS = 0.25              # how often a prompt checks whether it is still wanted
# After input that is not one plain key (a terminal's reply to a query the sandbox printed, a
# paste), everything is dropped until the terminal has been quiet this long: a reply may come in
# pieces, and a piece of one ("EINVAL", "rgb:") must not answer for the person.
QUIET_SECONDS = 0.3


def person_at_terminal() -> bool:
    """A person can be asked in place: stdin and stderr are a terminal. Either may be closed
    (`exec 0<&-`: Python's sys.stdin is then None), which is no terminal, not an error."""
    return all(stream is not None and stream.isatty() for stream in (sys.stdin, sys.stderr))


def _say(text: str) -> None:
    sys.stderr.write(text)
    sys.stderr.flush()


def is_typed(data: bytes) -> bool:
    """Whether one read is keys a person typed: printable ASCII, Ctrl-C or Ctrl-D only (a fast
    typist's two keys, or a link's batching, may come in one read). A terminal's answer to an escape
    sequence the sandbox printed (a cursor report, a colour, a graphics reply carrying "EINVAL")
    starts with ESC (or a C1 control), and is not an answer, nor anything after it until quiet."""
    return all(0x20 <= byte < 0x7F or byte in (0x03, 0x04) for byte in data)


class KeyReader:
    """One key at a time from a terminal: non-canonical, no echo, no signals (Ctrl-C arrives as a
    key, so the caller decides what it means), the terminal's mode restored afterwards."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._saved: list[Any] | None = None
        self._lock = threading.Lock()

    def read(self, prompt: str, keys: str, *, keep_waiting: Callable[[], bool]) -> str | None:
        """Show ``prompt``, then the first of ``keys`` (case-insensitive) typed, or Ctrl-C / Ctrl-D
        (also at the end of input); None once ``keep_waiting`` says no (checked every POLL_SECONDS).
        Only keys a person typed count (is_typed); after anything else, nothing counts until the
        terminal was quiet for QUIET_SECONDS.
        The terminal leaves canonical mode before the prompt shows, so no key typed after it is echoed."""
        self._raw()
        try:
            _say(prompt)
            with selectors.DefaultSelector() as selector:
                selector.register(self._fd, selectors.EVENT_READ)
                dropping_until = 0.0
                while keep_waiting():
                    if not selector.select(POLL_SECONDS):
                        continue
                    data = os.read(self._fd, 64)
                    if not data:
                        return CTRL_D                         # the terminal's end: as Ctrl-D
                    now = time.monotonic()
                    if now < dropping_until or not is_typed(data):
                        dropping_until = now + QUIET_SECONDS
                        continue
                    for key in data.decode().lower():
                        if key in keys or key in (CTRL_C, CTRL_D):
                            return key
        finally:
            self.restore()
        return None

    def _raw(self) -> None:
        mode = termios.tcgetattr(self._fd)
        with self._lock:
            self._saved = list(mode)
        mode[3] &= ~(termios.ICANON | termios.ECHO | termios.ISIG)      # lflag
        mode[6][termios.VMIN], mode[6][termios.VTIME] = 1, 0
        termios.tcsetattr(self._fd, termios.TCSANOW, mode)

    def restore(self) -> None:
        with self._lock:
            saved, self._saved = self._saved, None
        if saved is not None:
            try:
                termios.tcsetattr(self._fd, termios.TCSANOW, saved)
            except termios.error:
                pass                                          # the terminal is gone


REVIEW_KEYS = "adkr"


def ask_review(show_diff: "Callable[[], None]") -> str:
    """The end of a review (`sandboxd run --review`, a review session's terminal work): ``a``,
    ``d`` or ``k`` for `[a]pply [d]iscard [k]eep [r]eview` on stdin's terminal; r calls
    ``show_diff`` and asks again; Ctrl-C, Ctrl-D or the terminal's end keep (``k``)."""
    fd = sys.stdin.fileno()
    keys = KeyReader(fd)
    while True:
        # Only a key typed once the question shows answers it: one typed ahead (for the command,
        # while it ran) is dropped.
        termios.tcflush(fd, termios.TCIFLUSH)
        key = keys.read("review: [a]pply [d]iscard [k]eep [r]eview? ", REVIEW_KEYS, keep_waiting=lambda: True)
        sys.stderr.write((key if key and key in REVIEW_KEYS else "") + "\n")
        if key == "r":
            show_diff()
            continue
        return key if key in ("a", "d") else "k"
