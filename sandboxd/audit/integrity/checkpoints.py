"""Checkpoint rows: read, encoded for signing, written signed.

A checkpoint signs the chain's head (the last event's id and hash, and the count of events from
the genesis through it, pruned ones included), the genesis, what retention pruned, and the digest
of the previous checkpoint's message: the checkpoints are a chain of their own, so one removed
from the middle is caught too.
"""

from __future__ import annotations

import sqlite3
import time
from typing import Any, NamedTuple

from sandboxd.audit.integrity.encoding import ZERO_HASH, checkpoint_message, digest
from sandboxd.audit.integrity.schema import CHECKPOINT_COLUMNS

TYPE_CHECKING = False
if TYPE_CHECKING:
    from sandboxd.audit.integrity.keys import Signer


class Kind:
    PERIODIC = "periodic"       # every audit.checkpoint_events events
    SHUTDOWN = "shutdown"       # the store closing
    PRUNE = "prune"             # retention removed events up to pruned_through
    START = "start"             # the store opened with no checkpoint yet, or under another interval


class Checkpoint(NamedTuple):
    id: int
    kind: str
    genesis_id: int
    last_event_id: int
    head_hash: bytes
    event_count: int           # the column ``count``: events from the genesis through last_event_id
    pruned_through: int
    pruned_hash: bytes
    pruned_count: int
    prev_digest: bytes
    signature: bytes
    key_id: str
    time: float
    interval: int = 0          # audit.checkpoint_events when it was written (0: an older checkpoint, none signed)

    def message(self) -> bytes:
        return checkpoint_message(self.id, self.kind, self.genesis_id, self.last_event_id, self.head_hash,
                                  self.event_count, self.pruned_through, self.pruned_hash, self.pruned_count,
                                  self.prev_digest, self.time, self.key_id, self.interval)


def from_row(row: tuple[Any, ...]) -> Checkpoint:
    return Checkpoint(int(row[0]), str(row[1]), int(row[2]), int(row[3]), bytes(row[4]), int(row[5]),
                      int(row[6]), bytes(row[7]), int(row[8]), bytes(row[9]), bytes(row[10]), str(row[11]),
                      float(row[12]), int(row[13]))


def latest(db: sqlite3.Connection) -> Checkpoint | None:
    row = db.execute(f"SELECT {CHECKPOINT_COLUMNS} FROM audit_checkpoints ORDER BY id DESC LIMIT 1").fetchone()
    return None if row is None else from_row(row)


def write(db: sqlite3.Connection, signer: "Signer", kind: str, genesis_id: int, last_event_id: int, head_hash: bytes,
          pruned: tuple[int, bytes, int] | None = None, interval: int = 0) -> Checkpoint:
    """Sign and insert one checkpoint (the caller holds the store's lock; its own transaction).
    ``pruned``: (through id, its hash, how many) when this one records a prune; else the
    previous checkpoint's, carried forward."""
    previous = latest(db)
    if pruned is None:
        pruned = (previous.pruned_through, previous.pruned_hash, previous.pruned_count) if previous else \
            (0, ZERO_HASH, 0)
    count = last_event_id - genesis_id + 1 if last_event_id >= genesis_id else 0
    unsigned = Checkpoint((previous.id if previous else 0) + 1, kind, genesis_id, last_event_id, head_hash, count,
                          pruned[0], pruned[1], pruned[2], digest(previous.message()) if previous else ZERO_HASH,
                          b"", signer.key_id, time.time(), interval)
    signed = unsigned._replace(signature=signer.sign(unsigned.message()))
    db.execute(f"INSERT INTO audit_checkpoints ({CHECKPOINT_COLUMNS}) VALUES ({', '.join('?' * 14)})", signed)
    return signed
