"""Retention: ``audit.retain_days`` and ``audit.max_bytes`` prune the oldest events, keeping the
chain verifiable.

Events go in whole chunks of ``CHUNK_EVENTS`` ids, oldest first, each chunk in one transaction
with a signed ``prune`` checkpoint that records the gap (every event up to ``pruned_through``, the
hash of the last of them, how many in all): the verifier starts the chain from that hash, so a log
pruned this way is whole, and one an attacker pruned without the key is not. A chunk goes when its
newest event is older than ``retain_days``, or while the database's used pages exceed
``max_bytes``. What is never pruned: the newest chunk, and an open session's last event and
everything after it (its sequence and its stream go on from there; call results and the session
rows of open sessions are not events and stay), and events an audit export has not delivered yet
(above the lowest ``audit-export-*.cursor`` in the state directory). Closed sessions' rows go with
their last events (review sessions' stay: their kept change sets name them).

It runs on a thread of its own (``Pruner``), at start and every ``PRUNE_SECONDS``, taking the
store's lock per chunk only, so appends interleave; afterwards a TRUNCATE checkpoint returns the
WAL to zero bytes (deleting a chunk writes its pages to the WAL first), from a connection that
never waits for a reader (``_truncate_wal``).
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import threading
import time
from typing import Callable, ContextManager, NamedTuple

from sandboxd.audit.integrity import checkpoints
from sandboxd.audit.integrity.chain import ChainWriter
from sandboxd.audit.integrity.checkpoints import Kind

log = logging.getLogger("sandboxd.audit")

CHUNK_EVENTS = 1000
PRUNE_SECONDS = 600.0
DAY = 86400.0
MAX_CHUNKS_PER_RUN = 100_000
EXPORT_CURSOR_PREFIX, EXPORT_CURSOR_SUFFIX = "audit-export-", ".cursor"
MAX_CURSOR_FILE = 4096
TRUNCATE_ATTEMPTS = 10
TRUNCATE_RETRY_SECONDS = 0.05


class Pruned(NamedTuple):
    events: int                  # events removed by this run
    through: int                 # the last id removed (0: none)
    used_before: int             # bytes of used pages before and after
    used_after: int
    held_back_by: str            # what stopped it: an open session's id, an export cursor ("" none)


def used_bytes(db: sqlite3.Connection) -> int:
    """The database's pages in use (what pruning frees: the file keeps its size, and reuses them)."""
    pages = int(db.execute("PRAGMA page_count").fetchone()[0])
    free = int(db.execute("PRAGMA freelist_count").fetchone()[0])
    return (pages - free) * int(db.execute("PRAGMA page_size").fetchone()[0])


def prune(db: sqlite3.Connection, chain: ChainWriter, lock: ContextManager[object], *, retain_days: float,
          max_bytes: int, directory: str, now: float | None = None, chunk: int = CHUNK_EVENTS,
          committed: Callable[[], None] = lambda: None) -> Pruned:
    """Prune what the settings say (see the module's text). Needs the chain's signer: a store
    without one prunes nothing (its gap could not be signed)."""
    now = time.time() if now is None else now
    cutoff = now - retain_days * DAY if retain_days else None
    with lock:
        before = used_bytes(db)
    removed, through, held = 0, 0, ""
    if chain.signer is None or (cutoff is None and not max_bytes):
        return Pruned(0, 0, before, before, "")
    for _ in range(MAX_CHUNKS_PER_RUN):
        with lock:
            step = _one_chunk(db, chain, cutoff, max_bytes, chunk, directory)
        if step is None:
            break
        if isinstance(step, str):
            held = step
            break
        removed, through = removed + step[0], step[1]
        committed()
    if removed:
        _truncate_wal(os.path.join(directory, os.path.basename(_main_file(db))))
    with lock:
        after = used_bytes(db)
    if held:
        log.warning("audit retention held back", extra={"fields": {"by": held}})
    return Pruned(removed, through, before, after, held)


def _main_file(db: sqlite3.Connection) -> str:
    return str(db.execute("PRAGMA database_list").fetchone()[2])


def _truncate_wal(path: str) -> bool:
    """Checkpoint the WAL into the database and cut it to zero bytes, from a connection of its own
    that never waits: TRUNCATE holds back new writers while it waits for readers (a VerifyAudit,
    an exporter), so a busy handler here would stall every append behind the slowest reader.
    Busy: tried again a few times, then left to the next run (the WAL stays bounded by the store's
    own checkpoints meanwhile). Whether it was truncated."""
    db = sqlite3.connect(path, timeout=0, isolation_level=None)
    try:
        for attempt in range(TRUNCATE_ATTEMPTS):
            if attempt:
                time.sleep(TRUNCATE_RETRY_SECONDS)
            try:
                busy = db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0]
            except sqlite3.OperationalError:          # locked: a writer holds it this instant
                busy = 1
            if not busy:
                return True
        return False
    finally:
        db.close()


def _one_chunk(db: sqlite3.Connection, chain: ChainWriter, cutoff: float | None, max_bytes: int,
               chunk: int, directory: str) -> tuple[int, int] | str | None:
    """Remove the oldest chunk if it is due: (events removed, last id removed); what holds the
    chunk back (an open session, an export's cursor); None when nothing is due. Under the store's
    lock."""
    first = db.execute("SELECT MIN(id) FROM events").fetchone()[0]
    if first is None:
        return None
    through = int(first) + chunk - 1
    if through > chain.head_id - chunk:
        return None                                   # the newest chunk stays
    newest = db.execute("SELECT time FROM events WHERE id <= ? ORDER BY id DESC LIMIT 1", (through,)).fetchone()
    too_old = cutoff is not None and newest is not None and float(newest[0]) < cutoff
    too_big = bool(max_bytes) and used_bytes(db) > max_bytes
    if not (too_old or too_big):
        return None
    exported = export_cursor(directory)
    if exported is not None and through > exported[0]:
        return f"the export cursor {exported[1]} (event {exported[0]})"
    holder = db.execute(
        "SELECT e.session_id FROM sessions s JOIN events e ON e.session_id = s.id AND e.seq = "
        "(SELECT MAX(seq) FROM events WHERE session_id = s.id) WHERE s.closed_at IS NULL AND e.id <= ? LIMIT 1",
        (through,)).fetchone()
    if holder is not None:
        return str(holder[0])
    last = db.execute("SELECT id, hash FROM events WHERE id <= ? ORDER BY id DESC LIMIT 1", (through,)).fetchone()
    db.execute("BEGIN IMMEDIATE")
    try:
        chained = int(db.execute("SELECT COUNT(*) FROM events WHERE id <= ? AND id >= ?",
                                 (through, chain.genesis_id)).fetchone()[0])
        closed = [row[0] for row in db.execute(
            "SELECT DISTINCT e.session_id FROM events e JOIN sessions s ON s.id = e.session_id "
            "WHERE e.id <= ? AND s.closed_at IS NOT NULL AND s.review = 0", (through,))]
        removed = db.execute("DELETE FROM events WHERE id <= ?", (through,)).rowcount
        for session_id in closed:
            db.execute("DELETE FROM sessions WHERE id = ? AND NOT EXISTS (SELECT 1 FROM events WHERE session_id = ?)",
                       (session_id, session_id))
        if last is not None and last[1] is not None and int(last[0]) >= chain.genesis_id:
            previous = checkpoints.latest(db)
            so_far = previous.pruned_count if previous else 0
            assert chain.signer is not None
            checkpoints.write(db, chain.signer, Kind.PRUNE, chain.genesis_id, chain.head_id, chain.head_hash,
                              (int(last[0]), bytes(last[1]), so_far + chained), chain.checkpoint_events)
        db.execute("COMMIT")
    except BaseException:
        db.execute("ROLLBACK")
        raise
    chain.checkpointed_id = chain.head_id
    return int(removed), through


def export_cursor(directory: str) -> tuple[int, str] | None:
    """The lowest cursor of the audit exports in the state directory (``audit-export-SINK.cursor``,
    ``{"version": 1, "last_id": N}``, track export's): events after it are not exported yet and
    are not pruned. A cursor file that cannot be read holds everything back (it is named)."""
    lowest: tuple[int, str] | None = None
    try:
        names = [name for name in os.listdir(directory) if name.startswith(EXPORT_CURSOR_PREFIX)
                 and name.endswith(EXPORT_CURSOR_SUFFIX)]
    except OSError:
        return None
    for name in names:
        try:
            with open(os.path.join(directory, name), encoding="utf-8") as handle:
                last_id = json.loads(handle.read(MAX_CURSOR_FILE))["last_id"]
            if isinstance(last_id, bool) or not isinstance(last_id, int):
                raise ValueError(last_id)
        except (OSError, ValueError, KeyError, TypeError):
            last_id = 0
        if lowest is None or last_id < lowest[0]:
            lowest = (last_id, name)
    return lowest


class Pruner:
    """``prune`` at start and every PRUNE_SECONDS on a thread of its own, until ``stop``."""

    def __init__(self, run: Callable[[], Pruned], interval: float = PRUNE_SECONDS) -> None:
        self._run_once, self._interval = run, interval
        self._stopping = threading.Event()
        self.last: Pruned | None = None
        self._thread = threading.Thread(target=self._loop, name="sandboxd-audit-retention", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join()

    def _loop(self) -> None:
        while True:
            try:
                self.last = self._run_once()
            except (sqlite3.Error, OSError):            # a full disk, a closed store: the next run tries again
                log.exception("audit retention failed")
            if self._stopping.wait(self._interval):
                return
