"""What an event keeps of the values a caller chose: every event's data fits in ``limit`` bytes
(``audit.event_bytes``, 16 KiB by default), whatever the caller sent.

An event whose data, as the store writes it (compact JSON, ``text_of``), takes at most ``limit``
bytes is kept whole: every event of an ordinary call is. A larger one keeps its shape and gives
up its biggest values, one at a time, until it fits. Each value given up is replaced by its
*head*, a string, and listed in ``data["clipped"]`` with its path, the length and the SHA-256 of
its whole JSON text::

    {"arguments": {"argv": "[\\"python3\\",\\"-c\\",\\"import os; ...", "cwd": "/ws"},
     "clipped": [{"path": ["arguments", "argv"], "bytes": 1835027, "sha256": "9f2c..."}]}

* The head of a string is its start; of anything else (a list, an object), the start of its JSON
  text. Either way the head's own JSON takes at most a quarter of ``limit`` (4 KiB by default).
* ``bytes`` and ``sha256`` are those of ``json.dumps(value, separators=(",", ":"))`` encoded as
  UTF-8 (the text is ASCII: other characters are ``\\u`` escapes). Whoever holds the whole value
  can check that it is the one recorded, e.g. for a command's argv::

      python3 -c 'import hashlib, json, sys; print(hashlib.sha256(json.dumps(sys.argv[1:],
          separators=(",", ":")).encode()).hexdigest())' python3 -c 'import os; ...'

* Which value goes: from the top, the member that holds at least half of its object's bytes is
  looked into (an object) or given up (anything else); an object where no member dominates is
  given up whole (at the top: its biggest member). So a long command gives up ``arguments.argv``
  and keeps its ``cwd``; an object of many middling values goes as one.
* Should the data still not fit after MAX_CLIPS values (never with the daemon's own events, which
  have a handful of members), it is replaced whole: ``{"head": ..., "clipped": [{"path": [], ...}]}``.

The approval a person gives is never taken from this form: a held call keeps its whole arguments
in the daemon (service/approvals.py), the summary a person reads says when it was cut, and the
call that runs is the one that was asked.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

CLIPPED = "clipped"      # the member listing what was given up
MAX_CLIPS = 8
MAX_DEPTH = 8            # how deep into nested objects a value is looked for


def text_of(value: Any) -> str:
    """A value's compact JSON, as the store writes it (ASCII; what is not JSON becomes its str)."""
    return json.dumps(value, separators=(",", ":"), default=str)


def bounded(data: dict[str, Any], limit: int) -> tuple[dict[str, Any], str]:
    """``data`` in its bounded form and the JSON text of that form, at most ``limit`` bytes."""
    text = text_of(data)
    if len(text) <= limit:
        return data, text
    head_bytes = limit // 4
    kept, clipped = dict(data), []
    for _ in range(MAX_CLIPS):
        path = _biggest(kept)
        value = _at(kept, path)
        whole = text_of(value)
        if len(whole) <= head_bytes + 2:             # giving it up would not make the data smaller
            break
        kept = _replaced(kept, path, _head(value if isinstance(value, str) else whole, head_bytes))
        clipped.append(_record(path, whole))
        text = text_of({**kept, CLIPPED: clipped})
        if len(text) <= limit:
            return {**kept, CLIPPED: clipped}, text
    whole = text_of(data)
    result = {"head": _head(whole, head_bytes), CLIPPED: [_record([], whole)]}
    return result, text_of(result)


def _record(path: list[str], whole: str) -> dict[str, Any]:
    encoded = whole.encode()
    return {"path": path, "bytes": len(encoded), "sha256": hashlib.sha256(encoded).hexdigest()}


def _biggest(data: dict[str, Any]) -> list[str]:
    """The path of the value to give up next (see the module's docstring)."""
    path: list[str] = []
    node: dict[str, Any] = data
    while True:
        sizes = {key: len(text_of(value)) for key, value in node.items()}
        key = max(sizes, key=lambda k: sizes[k])
        value = node[key]
        dominates = 2 * sizes[key] >= sum(sizes.values())
        if not path and not dominates:
            return [key]                             # the top is never given up whole here
        if not dominates:
            return path
        path = path + [key]
        if not isinstance(value, dict) or not value or len(path) >= MAX_DEPTH:
            return path
        node = value


def _at(data: dict[str, Any], path: list[str]) -> Any:
    node: Any = data
    for key in path:
        node = node[key]
    return node


def _replaced(data: dict[str, Any], path: list[str], head: str) -> dict[str, Any]:
    """A copy of ``data`` with the value at ``path`` replaced (the objects on the way copied, the
    caller's own left as they are)."""
    copy = dict(data)
    if len(path) == 1:
        copy[path[0]] = head
    else:
        copy[path[0]] = _replaced(data[path[0]], path[1:], head)
    return copy


def _head(text: str, limit: int) -> str:
    """The longest start of ``text`` whose JSON takes at most ``limit`` bytes (plus its quotes)."""
    low, high = 0, min(len(text), limit)
    while low < high:                                # escapes make a character up to 6 bytes
        middle = (low + high + 1) // 2
        if len(text_of(text[:middle])) <= limit + 2:
            low = middle
        else:
            high = middle - 1
    return text[:low]
