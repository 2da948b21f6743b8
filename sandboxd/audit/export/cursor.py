"""The export's cursor: the id of the last event a sink acknowledged, kept in a file beside the
event store, replaced whole (written to a temporary file, synced, renamed over, the directory
synced) so that a crash leaves the old cursor or the new one, never a torn one. At-least-once:
it is stored after a batch is acknowledged, so a crash between the two repeats that batch and no
more; it is never ahead of what was delivered."""

from __future__ import annotations

import json
import os

CURSOR_VERSION = 1


class Cursor:
    def __init__(self, path: str) -> None:
        self.path = path
        self.last_id = self._read()

    def _read(self) -> int:
        try:
            with open(self.path, "rb") as f:
                data = json.loads(f.read(4096))
        except FileNotFoundError:
            return 0                                   # never exported: from the first event
        except (OSError, ValueError):
            # Unreadable (it is only ever replaced whole, so this is someone's edit): from the
            # start rather than skipping events; the sink sees repeats, never a gap.
            return 0
        value = data.get("last_id") if isinstance(data, dict) else None
        return value if isinstance(value, int) and value >= 0 else 0

    def store(self, last_id: int) -> None:
        """Record that every event up to ``last_id`` was delivered (durable when this returns)."""
        temporary = f"{self.path}.tmp"
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, json.dumps({"version": CURSOR_VERSION, "last_id": last_id}).encode() + b"\n")
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temporary, self.path)
        directory = os.open(os.path.dirname(os.path.abspath(self.path)), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
        self.last_id = last_id
