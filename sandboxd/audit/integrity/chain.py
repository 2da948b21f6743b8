"""The writer's side of the chain: the head it links the next event to, each open session's
last hash, and when a checkpoint is due. Used by the event store under its lock, on the path that
already serialises writes, so linking costs one SHA-256 per event and no extra query (a session's
last hash is cached like its next sequence number; a miss costs one indexed query).
"""

from __future__ import annotations

import sqlite3

from sandboxd.audit.integrity import checkpoints
from sandboxd.audit.integrity.encoding import ZERO_HASH, event_hash

TYPE_CHECKING = False
if TYPE_CHECKING:
    from sandboxd.audit.integrity.keys import Signer

MAX_CACHED_SESSIONS = 16384


class ChainWriter:
    def __init__(self, db: sqlite3.Connection, signer: "Signer | None", checkpoint_events: int) -> None:
        """``db``: the store's connection, migrated; ``signer`` None: hashes only, no checkpoints
        (a store opened outside the daemon, e.g. by a test)."""
        self._db, self.signer, self.checkpoint_events = db, signer, checkpoint_events
        self.genesis_id = int(db.execute("SELECT first_event_id FROM audit_genesis").fetchone()[0])
        row = db.execute("SELECT id, hash FROM events WHERE hash IS NOT NULL ORDER BY id DESC LIMIT 1").fetchone()
        self.head_id, self.head_hash = (int(row[0]), bytes(row[1])) if row else (self.genesis_id - 1, ZERO_HASH)
        if row is None:
            pruned = checkpoints.latest(db)       # every chained event pruned: the chain goes on from the gap
            if pruned is not None and pruned.pruned_through >= self.genesis_id:
                self.head_id, self.head_hash = pruned.pruned_through, pruned.pruned_hash
        last = checkpoints.latest(db)
        self.checkpointed_id = last.last_event_id if last else self.head_id
        self._sessions: dict[str, bytes] = {}
        if signer is not None and (last is None or last.interval != checkpoint_events):
            # The verifier bounds the unsigned tail by the interval the last checkpoint signed: a
            # store always has one once the daemon opened it (none at all means they were deleted),
            # and a new interval is signed before events are written under it.
            self.checkpoint(checkpoints.Kind.START)
            db.execute("UPDATE audit_genesis SET checkpoint_events = ?", (checkpoint_events,))

    def next_id(self) -> int:
        return self.head_id + 1

    def session_head(self, session_id: str) -> bytes:
        cached = self._sessions.get(session_id)
        if cached is None:
            row = self._db.execute("SELECT hash FROM events WHERE session_id = ? ORDER BY seq DESC LIMIT 1",
                                   (session_id,)).fetchone()
            cached = bytes(row[0]) if row is not None and row[0] is not None else ZERO_HASH
        return cached

    def link(self, event_id: int, time: float, session_id: str, sequence: int, kind: str, call_id: str, tool: str,
             text: str, session_prev: bytes, prev: bytes) -> bytes:
        return event_hash(event_id, time, session_id, sequence, kind, call_id, tool, text, prev, session_prev)

    def advanced(self, session_id: str, head_id: int, head_hash: bytes, closed: bool) -> None:
        """After a commit: the new heads (the caller's transaction committed them)."""
        self.head_id, self.head_hash = head_id, head_hash
        if closed:
            self._sessions.pop(session_id, None)
        else:
            self._sessions[session_id] = head_hash
            while len(self._sessions) > MAX_CACHED_SESSIONS:
                del self._sessions[next(iter(self._sessions))]

    def checkpoint_due(self) -> bool:
        return self.signer is not None and self.head_id - self.checkpointed_id >= self.checkpoint_events

    def checkpoint(self, kind: str, pruned: tuple[int, bytes, int] | None = None) -> checkpoints.Checkpoint | None:
        """Sign the head (in its own transaction; the caller holds the store's lock)."""
        if self.signer is None:
            return None
        self._db.execute("BEGIN IMMEDIATE")
        try:
            written = checkpoints.write(self._db, self.signer, kind, self.genesis_id, self.head_id, self.head_hash,
                                        pruned, self.checkpoint_events)
            self._db.execute("COMMIT")
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self.checkpointed_id = self.head_id
        return written
