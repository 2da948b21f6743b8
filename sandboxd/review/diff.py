"""One change shown to a person: a unified diff for text, a summary line for anything else.

Both sides are read beneath their descriptors (kernel.beneath), as the session's owner, at most
``max_bytes`` each; the text is the files' own (a person's terminal shows it through
``sandboxd.printable``, never raw).
"""

from __future__ import annotations

import difflib
import hashlib
import os
import stat
from typing import NamedTuple

from sandboxd.kernel import beneath
from sandboxd.printable import printable
from sandboxd.review.changes import Change, Comparison, attributes, fingerprint

MAX_BYTES = 1 << 20
MAX_LINES = 5000


def _read(dir_fd: int, rel: str, limit: int) -> bytes | None:
    """The regular file ``rel``'s first ``limit`` + 1 bytes (None: not a readable regular file)."""
    try:
        fd = beneath.open_beneath(dir_fd, rel, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        chunks, left = [], limit + 1
        while left > 0:
            block = os.read(fd, min(left, 1 << 16))
            if not block:
                break
            chunks.append(block)
            left -= len(block)
        return b"".join(chunks)
    except OSError:
        return None
    finally:
        os.close(fd)


def _text(data: bytes | None) -> list[str] | None:
    if data is None or b"\0" in data:
        return None
    try:
        return data.decode().splitlines(keepends=True)
    except UnicodeDecodeError:
        return None


def show(comparison: Comparison, change: Change, *, max_bytes: int = MAX_BYTES, max_lines: int = MAX_LINES) -> str:
    """The diff of ``change`` (from ``comparison.list``): host side a/, sandbox side b/. The path
    (the sandbox chose it) is shown escaped (``printable``): a newline in a name must not start a
    header line of its own."""
    return shown(comparison, change, max_bytes=max_bytes, max_lines=max_lines).text


class Shown(NamedTuple):
    text: str
    fingerprint: str        # what the text showed in full (review.changes.fingerprint); "" when not all of it
    too_big: bool           # a file past the size a diff reads: shown as one line


def shown(comparison: Comparison, change: Change, *, max_bytes: int = MAX_BYTES, max_lines: int = MAX_LINES) -> Shown:
    """:func:`show`'s text and the fingerprint of what it showed: a file's content is read again to
    be shown, so the fingerprint hashes the bytes read then (a file rewritten between the listing's
    hash and the diff is vouched for as it was shown). A change shown only in part (its diff cut at
    ``max_lines``, a file too big or binary, shown as one line) is vouched for by no fingerprint:
    nobody saw its content."""
    text, content = _show(comparison, change, max_bytes, max_lines)
    if content is _PARTLY or content is _TOO_BIG:
        return Shown(text, "", content is _TOO_BIG)
    return Shown(text, fingerprint(change, None if content is None else hashlib.sha256(content).hexdigest()), False)


# Sentinels for _show's second value, told apart from any content by identity (``is``).
_PARTLY = bytes(bytearray(b"partly"))
_TOO_BIG = bytes(bytearray(b"too big"))


def _show(comparison: Comparison, change: Change, max_bytes: int, max_lines: int) -> tuple[str, bytes | None]:
    """The text, and the sandbox's bytes it was made from (None: the listed hash stands; _PARTLY,
    _TOO_BIG: its content was not all shown)."""
    path = printable(change.path or ".")
    modes = attributes(change)
    if change.type not in ("file", "") or change.host_type not in ("file", ""):
        if change.type == "symlink" or change.host_type == "symlink":
            return (f"{change.kind} {path}: symlink {printable(change.host_target or '-')} -> "
                    f"{printable(change.target or '-')}\n"), None
        if modes and change.type == change.host_type:         # a directory's mode or owner
            return f"{change.kind} {path}: {change.type} {modes}\n", None
        return f"{change.kind} {path}: {change.host_type or 'nothing'} -> {change.type or 'nothing'}\n", None
    theirs = _read(comparison.host_fd, change.path, max_bytes) if change.host_type else b""
    mine = _read(comparison.layer_fd(change.path), change.path, max_bytes) if change.type else b""
    if theirs is not None and mine is not None and max(len(theirs), len(mine)) > max_bytes:
        return f"{change.kind} {path}: too big to show ({change.host_size} -> {change.size} bytes)\n", _TOO_BIG
    old, new = _text(theirs), _text(mine)
    if old is None or new is None:
        return (f"{change.kind} {path}: binary or unreadable ({change.host_size} -> {change.size} bytes, "
                f"sha256 {change.host_sha256 or '-'} -> {change.sha256 or '-'})\n"), _PARTLY
    lines = list(difflib.unified_diff(old, new, f"a/{path}" if change.host_type else "/dev/null",
                                      f"b/{path}" if change.type else "/dev/null"))
    cut = len(lines) > max_lines
    if cut:
        lines = lines[:max_lines] + [f"... {len(lines) - max_lines} more lines\n"]
    if modes:                                   # with the content's diff, if the content changed too
        lines.insert(0, f"{change.kind} {path}: {modes}\n")
    text = "".join(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n" for line in lines)
    return text, (_PARTLY if cut else mine if change.type else None)
