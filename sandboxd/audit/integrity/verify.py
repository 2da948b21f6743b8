"""The verifier: walks the chain and the checkpoints and names the first thing wrong.

Read-only, over any sqlite3 connection (``open_read_only`` for a file on disk). The walk reads
events in id order, in chunks (``chunk``; ``between_chunks`` is called after each, where the daemon
lets other work run), keeps one hash and one entry per open session, and stops at the first
problem, which it names by kind:

- ``edited``: an event's fields no longer give its hash, or (its hash recomputed by the editor)
  the next event links to another one, or a checkpoint signed another hash for it;
- ``deleted``: ids missing from the chain, or events a checkpoint signed are gone;
- ``inserted``: a row that is not in the chain (no hash, or the next event links past it);
- ``reordered``: an event that links to an event other than the one before it;
- ``checkpoint``: a checkpoint whose signature does not verify (edited or forged), that is signed by
  another key, or that is missing from the checkpoints' own chain; or checkpoints that must exist do
  not: more events after the last one than its signed interval (``audit.checkpoint_events``) allows,
  or, with a pinned key, none at all over a chain the daemon opened (it signs one when it opens a
  store), which is what deleting every checkpoint to rewrite the log looks like.

A crafted file is answered, never crashed on: ``events``, ``audit_genesis`` and ``audit_checkpoints``
must be tables (a view can be made to never end), and every value is type- and length-checked in SQL
before Python reads it (an integer where a hash belongs is not turned into that many bytes).

What it proves, and what it does not, is in docs/threat-model.md ("The audit chain").
"""

from __future__ import annotations

import errno
import os
import sqlite3
import time
from dataclasses import dataclass, field
from typing import Callable

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from sandboxd.audit.integrity.checkpoints import Checkpoint, from_row
from sandboxd.audit.integrity.encoding import ZERO_HASH, digest, event_hash
from sandboxd.audit.integrity.keys import key_id, verifies
from sandboxd.audit.integrity.schema import CHECKPOINT_COLUMNS

CHUNK = 5000
# What a checkpoint's interval allows after it: the store signs once ``interval`` events are
# committed, after the append that reached it, and one append writes at most a few events.
BATCH_SLACK = 8
HASH_BYTES = 32
_TABLES = ("events", "audit_genesis", "audit_checkpoints")
_HASH_OK = "(typeof({0}) = 'blob' AND length({0}) = 32)"
# 1 when a row's values have the types the chain's encoding reads (NULL hashes: an unchained row).
_EVENT_TYPES_OK = (
    "(typeof(id) = 'integer' AND typeof(time) IN ('real', 'integer') AND typeof(session_id) = 'text' "
    "AND typeof(seq) = 'integer' AND typeof(type) = 'text' AND typeof(call_id) = 'text' AND typeof(tool) = 'text' "
    "AND typeof(data) = 'text' AND ((prev_hash IS NULL AND hash IS NULL AND session_prev_hash IS NULL) OR ("
    + " AND ".join(_HASH_OK.format(column) for column in ("prev_hash", "hash", "session_prev_hash")) + ")))")
_CHECKPOINT_TYPES_OK = (
    "(typeof(id) = 'integer' AND typeof(kind) = 'text' AND typeof(genesis_id) = 'integer' "
    "AND typeof(last_event_id) = 'integer' AND typeof(count) = 'integer' AND typeof(pruned_through) = 'integer' "
    "AND typeof(pruned_count) = 'integer' AND typeof(key_id) = 'text' AND length(key_id) <= 64 "
    "AND typeof(time) IN ('real', 'integer') AND typeof(interval) = 'integer' "
    "AND typeof(signature) = 'blob' AND length(signature) = 64 AND "
    + " AND ".join(_HASH_OK.format(column) for column in ("head_hash", "pruned_hash", "prev_digest")) + ")")
SESSION_CLOSED = "SessionClosed"
EVENT_COLUMNS = "id, time, session_id, seq, type, call_id, tool, data, prev_hash, hash, session_prev_hash"


class Kind:
    EDITED = "edited"
    DELETED = "deleted"
    INSERTED = "inserted"
    REORDERED = "reordered"
    CHECKPOINT = "checkpoint"
    UNCHAINED = "unchained"     # no chain at all (a store older than the chain, or not a store)


@dataclass(frozen=True)
class Problem:
    kind: str
    detail: str
    event_id: int = 0
    checkpoint_id: int = 0


@dataclass
class Report:
    events: int = 0                       # chained events present
    legacy: int = 0                       # events from before the chain began
    pruned: int = 0                       # events retention removed (as the checkpoints say)
    pruned_through: int = 0
    pruned_under: int = 0                 # the checkpoint that records the prune
    head_id: int = 0
    head_hash: bytes = ZERO_HASH
    checkpoints: int = 0
    last_checkpoint: Checkpoint | None = None
    key_id: str = ""                      # the key the signatures were checked with ("": not checked)
    pinned: bool = False
    unsigned_tail: int = 0                # events after the last checkpoint
    session_id: str = ""                  # a session's own stream was verified, not the node's
    problem: Problem | None = None
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def whole(self) -> bool:
        return self.problem is None

    def text(self) -> str:
        """What ``sandboxd audit verify`` prints (the ids and hashes are the store's, never a
        caller's text; a session id is shown as the caller gave it to be escaped by the printer)."""
        if self.problem is not None:
            where = f"event {self.problem.event_id}" if self.problem.event_id else \
                f"checkpoint {self.problem.checkpoint_id}" if self.problem.checkpoint_id else "the log"
            return f"NOT WHOLE: {where} {self.problem.kind}: {self.problem.detail}"
        subject = f"session {self.session_id}: " if self.session_id else ""
        parts = [f"{subject}whole: {self.events} events, head {self.head_id} {self.head_hash.hex()[:16]}"]
        if self.pruned:
            parts.append(f"{self.pruned} pruned before id {self.pruned_through + 1} under checkpoint "
                         f"{self.pruned_under}")
        if self.legacy:
            parts.append(f"{self.legacy} older events from before the chain began (not chained)")
        checkpoint = self.last_checkpoint
        if checkpoint is None:
            parts.append("no signed checkpoint (nothing is signed yet)")
        else:
            signer = f"signed by {self.key_id}" + ("" if self.pinned else " (not pinned: pass --pubkey)") \
                if self.key_id else f"signature NOT checked (no public key; its key id says {checkpoint.key_id})"
            parts.append(f"last checkpoint {checkpoint.id} at event {checkpoint.last_event_id} {signer}")
        if self.unsigned_tail:
            parts.append(f"{self.unsigned_tail} events after it not yet signed")
        parts.extend(self.notes)
        return "; ".join(parts)


def _typed(row: tuple[object, ...]) -> None:
    """An event row whose last column (``_EVENT_TYPES_OK``) says its values are not the chain's."""
    if not row[-1]:
        event_id = row[0] if isinstance(row[0], int) else 0
        raise _Failed(Problem(Kind.EDITED, "its columns do not hold what an event holds (a wrong type, or a hash "
                              f"that is not {HASH_BYTES} bytes)", event_id))


class _Failed(Exception):
    def __init__(self, problem: Problem) -> None:
        self.problem = problem


class Verifier:
    def __init__(self, db: sqlite3.Connection, public: Ed25519PublicKey | None, *, pinned: bool = False,
                 chunk: int = CHUNK, between_chunks: Callable[[], None] | None = None) -> None:
        self._db, self._public, self._pinned, self._chunk = db, public, pinned, chunk
        self._between = between_chunks or (lambda: None)
        self.legacy_before = False
        self.interval = 0                 # the genesis row's audit.checkpoint_events (0: not recorded)
        self._checkpoint_columns, self._checkpoint_ok = CHECKPOINT_COLUMNS, _CHECKPOINT_TYPES_OK

    # -- the node's stream ------------------------------------------------------------------------

    def verify(self) -> Report:
        report = Report(pinned=self._pinned, key_id=key_id(self._public) if self._public else "")
        began = time.monotonic()
        try:
            self._db.execute("BEGIN")              # one snapshot: a write meanwhile is not half-seen
            try:
                self._walk(report)
            finally:
                self._db.execute("COMMIT")
        except _Failed as failed:
            report.problem = failed.problem
        report.seconds = time.monotonic() - began
        return report

    def _walk(self, report: Report) -> None:
        genesis = self._genesis()
        checkpoints = self._checkpoints(genesis, report)
        last = checkpoints[-1] if checkpoints else None
        report.last_checkpoint, report.checkpoints = last, len(checkpoints)
        if last is not None and last.pruned_through >= genesis:
            expected_id, expected_prev = last.pruned_through + 1, last.pruned_hash
            report.pruned, report.pruned_through = last.pruned_count, last.pruned_through
            report.pruned_under = next(c.id for c in checkpoints if c.pruned_through == last.pruned_through)
        else:
            expected_id, expected_prev = genesis, ZERO_HASH
        report.legacy = int(self._db.execute("SELECT COUNT(*) FROM events WHERE id < ?", (genesis,)).fetchone()[0])
        signed_heads = {c.last_event_id: c for c in checkpoints if c.last_event_id >= expected_id}
        sessions: dict[str, tuple[int, bytes]] = {}
        # A session's earlier events may be gone for a good reason: before the chain, or pruned.
        incomplete_sessions = bool(self.legacy_before or report.pruned)
        after = expected_id - 1
        while True:
            rows = self._db.execute(f"SELECT {EVENT_COLUMNS}, {_EVENT_TYPES_OK} FROM events WHERE id > ? ORDER BY id "
                                    "LIMIT ?", (after, self._chunk)).fetchall()
            if not rows:
                break
            for row in rows:
                _typed(row)
                event_id, stamp, session_id, seq, kind, call_id, tool, data, prev, stored, session_prev, _ = row
                if stored is None or prev is None or session_prev is None:
                    raise _Failed(Problem(Kind.INSERTED, "a row without the chain's hashes, after the chain began "
                                          f"(at id {genesis})", event_id))
                prev, stored, session_prev = bytes(prev), bytes(stored), bytes(session_prev)
                if event_id != expected_id:
                    raise _Failed(Problem(Kind.DELETED, f"events {expected_id} to {event_id - 1} are missing "
                                          f"(the chain goes from {expected_id - 1} to {event_id})", event_id))
                computed = event_hash(event_id, stamp, session_id, seq, kind, call_id, tool, data, prev, session_prev)
                if computed != stored:
                    if event_hash(event_id - 1, stamp, session_id, seq, kind, call_id, tool, data, prev,
                                  session_prev) == stored:
                        raise _Failed(Problem(Kind.INSERTED, "it is not in the chain: the events after it were "
                                              "renumbered to make room for it", event_id - 1))
                    moved = self._holder(prev, event_id)
                    if prev != expected_prev and moved:
                        raise _Failed(Problem(Kind.REORDERED, f"it was written after event {moved}, not after "
                                              f"event {event_id - 1} (its id was changed)", event_id))
                    raise _Failed(Problem(Kind.EDITED, "its fields no longer give its hash", event_id))
                if prev != expected_prev:
                    raise _Failed(self._broken_link(event_id, prev, expected_prev, report))
                self._session_link(sessions, incomplete_sessions, event_id, session_id, seq, kind, session_prev,
                                   stored)
                signed = signed_heads.get(event_id)
                if signed is not None and signed.head_hash != stored:
                    if self._holder(signed.head_hash, event_id) == event_id + 1:
                        raise _Failed(Problem(Kind.INSERTED, f"it is not in the chain: the event checkpoint "
                                              f"{signed.id} signed as {event_id} follows it, renumbered", event_id))
                    raise _Failed(Problem(Kind.EDITED, f"checkpoint {signed.id} signed another hash for it: events "
                                          "up to it were rewritten with their hashes recomputed", event_id,
                                          signed.id))
                report.events += 1
                report.head_id, report.head_hash = event_id, stored
                expected_id, expected_prev = event_id + 1, stored
            after = rows[-1][0]
            self._between()
        if last is not None and last.last_event_id > report.head_id and last.last_event_id >= expected_id:
            raise _Failed(Problem(Kind.DELETED, f"checkpoint {last.id} signed events through id "
                                  f"{last.last_event_id}, but the log ends at id {report.head_id}: the newest events "
                                  "were deleted", report.head_id + 1, last.id))
        if report.head_id == 0 and last is not None:
            report.head_id, report.head_hash = last.pruned_through, last.pruned_hash
        report.unsigned_tail = max(0, report.head_id - last.last_event_id) if last else report.events
        self._signed_enough(report, last)

    def _signed_enough(self, report: Report, last: Checkpoint | None) -> None:
        """The checkpoints that must be there are: deleting them is how a log is rewritten whole
        by someone without the key (every event edited, its hash recomputed)."""
        if last is None:
            if self._pinned and report.events:
                raise _Failed(Problem(Kind.CHECKPOINT, f"no signed checkpoint over {report.events} chained events: "
                                      "the daemon signs one when it opens a store, so every checkpoint was deleted "
                                      "(and the events may have been rewritten)", report.head_id))
            # The genesis row's interval is not signed: with no checkpoint it is the only bound.
            interval = self.interval
        else:
            # Signed when the key was checked; an older sandboxd's checkpoint signed none (0): then
            # the genesis row's, unsigned, is still a bound to edit away.
            interval = last.interval or self.interval
        if interval and report.unsigned_tail > interval + BATCH_SLACK:
            where = f"checkpoint {last.id}" if last else "the genesis"
            raise _Failed(Problem(Kind.CHECKPOINT, f"{report.unsigned_tail} events after {where}, but a checkpoint is "
                                  f"signed every {interval} events: the checkpoints after it were deleted (and the "
                                  "events after it may have been rewritten)", report.head_id))

    def _genesis(self) -> int:
        """Where the chain starts (and ``self.legacy_before``: whether events preceded it), after
        checking the tables are tables."""
        kinds = dict(self._db.execute("SELECT name, type FROM sqlite_master WHERE name IN (?, ?, ?)",
                                      _TABLES).fetchall())
        if "audit_genesis" not in kinds:
            raise _Failed(Problem(Kind.UNCHAINED, "this database has no audit chain (a sandboxd older than the "
                                  "chain wrote it, or it is not an event store)"))
        for name in _TABLES:
            if kinds.get(name) != "table":
                raise _Failed(Problem(Kind.UNCHAINED, f"{name} is {'missing' if name not in kinds else 'not a table'}: "
                                      "this is not an event store sandboxd wrote"))
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(audit_genesis)")}
        interval = "checkpoint_events" if "checkpoint_events" in columns else "0"
        try:
            row = self._db.execute(
                f"SELECT first_event_id, legacy_events, {interval} FROM audit_genesis WHERE typeof(first_event_id) = "
                f"'integer' AND typeof(legacy_events) = 'integer' AND typeof({interval}) = 'integer' LIMIT 2").fetchall()
            signed_interval = {row[1] for row in self._db.execute("PRAGMA table_info(audit_checkpoints)")}
            if "interval" not in signed_interval:          # a store older than migration 8: none signed
                self._checkpoint_columns = CHECKPOINT_COLUMNS.replace(", interval", ", 0")
                self._checkpoint_ok = _CHECKPOINT_TYPES_OK.replace("typeof(interval)", "typeof(0)")
            self._db.execute(f"SELECT {self._checkpoint_columns} FROM audit_checkpoints LIMIT 0")
        except sqlite3.OperationalError as exc:
            raise _Failed(Problem(Kind.UNCHAINED, f"not the event store's schema ({exc})")) from None
        total = int(self._db.execute("SELECT COUNT(*) FROM audit_genesis").fetchone()[0])
        if len(row) != 1 or total != 1:
            raise _Failed(Problem(Kind.EDITED, f"the chain's genesis record is missing, doubled or not numbers "
                                  f"({total} rows)"))
        self.legacy_before = int(row[0][1]) > 0
        self.interval = max(0, int(row[0][2]))
        return int(row[0][0])

    def _checkpoints(self, genesis: int, report: Report) -> list[Checkpoint]:
        """Every checkpoint, each checked: its signature, its key, its link to the one before."""
        checked: list[Checkpoint] = []
        previous: Checkpoint | None = None
        after = -(2 ** 63)
        while True:
            rows = self._db.execute(f"SELECT {self._checkpoint_columns}, {self._checkpoint_ok} FROM audit_checkpoints "
                                    "WHERE id > ? ORDER BY id LIMIT ?", (after, self._chunk)).fetchall()
            if not rows:
                return checked
            for row in rows:
                previous = self._checkpoint(row, previous, genesis, report)
                checked.append(previous)
            after = rows[-1][0]
            self._between()

    def _checkpoint(self, row: tuple[object, ...], previous: Checkpoint | None, genesis: int,
                    report: Report) -> Checkpoint:
        """One checkpoint row, checked against the one before it."""
        if not row[-1]:
            raise _Failed(Problem(Kind.CHECKPOINT, "its columns do not hold what a checkpoint holds (a wrong "
                                  "type or length)", checkpoint_id=row[0] if isinstance(row[0], int) else 0))
        checkpoint = from_row(row[:-1])
        if self._public is not None:
            if checkpoint.key_id != report.key_id:
                raise _Failed(Problem(Kind.CHECKPOINT, f"signed by key {checkpoint.key_id}, not {report.key_id}",
                                      checkpoint_id=checkpoint.id))
            if not verifies(self._public, checkpoint.signature, checkpoint.message()):
                raise _Failed(Problem(Kind.CHECKPOINT, f"its signature does not verify with key {report.key_id}: "
                                      "it was edited, or forged without the key", checkpoint_id=checkpoint.id))
        expected = (previous.id + 1) if previous else 1
        link = digest(previous.message()) if previous else ZERO_HASH
        if checkpoint.id != expected or checkpoint.prev_digest != link:
            raise _Failed(Problem(Kind.CHECKPOINT, f"the checkpoint before it (id {expected - 1}) is missing or "
                                  "not the one it signed", checkpoint_id=checkpoint.id))
        if checkpoint.genesis_id != genesis:
            raise _Failed(Problem(Kind.EDITED, f"the genesis record says the chain starts at id {genesis}, "
                                  f"checkpoint {checkpoint.id} signed {checkpoint.genesis_id}",
                                  checkpoint_id=checkpoint.id))
        if checkpoint.event_count != max(0, checkpoint.last_event_id - genesis + 1):
            raise _Failed(Problem(Kind.CHECKPOINT, f"it signed {checkpoint.event_count} events through id "
                                  f"{checkpoint.last_event_id}, which a chain from id {genesis} cannot hold",
                                  checkpoint_id=checkpoint.id))
        if previous is not None and (checkpoint.last_event_id < previous.last_event_id
                                     or checkpoint.pruned_through < previous.pruned_through):
            raise _Failed(Problem(Kind.CHECKPOINT, "it goes back from the checkpoint before it",
                                  checkpoint_id=checkpoint.id))
        return checkpoint

    def _latest_checkpoint(self, genesis: int, report: Report) -> Checkpoint | None:
        """The newest checkpoint alone, its signature checked: all a session's verify needs (its
        stream is checked event by event; the node's checkpoints are the node's verify's work, one
        Ed25519 check each, which a tenant's tiny session must not cost)."""
        row = self._db.execute(f"SELECT {self._checkpoint_columns}, {self._checkpoint_ok} FROM audit_checkpoints "
                               "ORDER BY id DESC LIMIT 1").fetchone()
        if row is None:
            return None
        if not row[-1]:
            raise _Failed(Problem(Kind.CHECKPOINT, "its columns do not hold what a checkpoint holds",
                                  checkpoint_id=row[0] if isinstance(row[0], int) else 0))
        checkpoint = from_row(row[:-1])
        if self._public is not None and (checkpoint.key_id != report.key_id or not verifies(
                self._public, checkpoint.signature, checkpoint.message())):
            raise _Failed(Problem(Kind.CHECKPOINT, f"its signature does not verify with key {report.key_id}",
                                  checkpoint_id=checkpoint.id))
        if checkpoint.genesis_id != genesis:
            raise _Failed(Problem(Kind.EDITED, f"the genesis record says the chain starts at id {genesis}, "
                                  f"checkpoint {checkpoint.id} signed {checkpoint.genesis_id}",
                                  checkpoint_id=checkpoint.id))
        return checkpoint

    def _holder(self, wanted: bytes, not_id: int) -> int:
        """The id of another present event whose hash is ``wanted`` (0: none). A full scan: only
        on the way to a report."""
        row = self._db.execute("SELECT id FROM events WHERE hash = ? AND id != ? LIMIT 1", (wanted, not_id)).fetchone()
        return int(row[0]) if row else 0

    def _broken_link(self, event_id: int, prev: bytes, expected_prev: bytes, report: Report) -> Problem:
        """Event ``event_id`` hashes right but links to something other than the event before it."""
        moved = self._holder(prev, event_id)
        if moved:
            return Problem(Kind.REORDERED, f"it links to event {moved}, not to event {event_id - 1} before it",
                           event_id)
        following = self._db.execute(f"SELECT CASE WHEN {_HASH_OK.format('prev_hash')} THEN prev_hash END FROM events "
                                     "WHERE id > ? ORDER BY id LIMIT 1", (event_id,)).fetchone()
        if following is not None and following[0] == expected_prev:
            return Problem(Kind.INSERTED, "it is not in the chain: the event after it links to the one before it",
                           event_id)
        if report.events == 0:
            return Problem(Kind.EDITED, "it does not link to the start of the chain (the genesis, or the last "
                           "event a signed prune removed)", event_id)
        return Problem(Kind.EDITED, f"its hash was recomputed after an edit: event {event_id} links to another hash "
                       "for it", event_id - 1)

    @staticmethod
    def _session_link(sessions: dict[str, tuple[int, bytes]], incomplete: bool, event_id: int, session_id: str,
                      seq: int, kind: str, session_prev: bytes, stored: bytes) -> None:
        known = sessions.get(session_id)
        if known is not None:
            if seq > known[0] + 1:
                raise _Failed(Problem(Kind.DELETED, f"its session's events with sequence {known[0] + 1} to {seq - 1} "
                                      "are missing", event_id))
            if seq != known[0] + 1:
                raise _Failed(Problem(Kind.REORDERED, f"its session sequence {seq} comes after {known[0]}", event_id))
            if session_prev != known[1]:
                raise _Failed(Problem(Kind.EDITED, "it links to another event of its session than the one before it",
                                      event_id))
        elif seq == 1:
            if session_prev != ZERO_HASH:
                raise _Failed(Problem(Kind.EDITED, "the first event of its session links to an earlier one",
                                      event_id))
        elif not incomplete:
            raise _Failed(Problem(Kind.DELETED, f"its session's events before sequence {seq} are missing", event_id))
        if kind == SESSION_CLOSED:
            sessions.pop(session_id, None)     # bounded by the open sessions, not the log
        else:
            sessions[session_id] = (seq, stored)

    # -- one session's stream (what its owner may verify) ---------------------------------------

    def verify_session(self, session_id: str) -> Report:
        """One session's events: each hashes right, each links to the one before it in the
        session, no sequence number is missing. Not the node's chain (other owners' events)."""
        report = Report(session_id=session_id, pinned=self._pinned, key_id=key_id(self._public) if self._public else "")
        began = time.monotonic()
        try:
            self._db.execute("BEGIN")
            try:
                genesis = self._genesis()
                last = self._latest_checkpoint(genesis, report)
                report.last_checkpoint, report.checkpoints = last, 1 if last else 0
                pruned = bool(last and last.pruned_through >= genesis)
                sessions: dict[str, tuple[int, bytes]] = {}
                after = 0
                while True:
                    rows = self._db.execute(f"SELECT {EVENT_COLUMNS}, {_EVENT_TYPES_OK} FROM events WHERE session_id "
                                            "= ? AND seq > ? ORDER BY seq LIMIT ?",
                                            (session_id, after, self._chunk)).fetchall()
                    if not rows:
                        break
                    for row in rows:
                        _typed(row)
                        event_id, stamp, sid, seq, kind, call_id, tool, data, prev, stored, session_prev, _ = row
                        if stored is None:
                            report.legacy += 1
                            continue
                        computed = event_hash(event_id, stamp, sid, seq, kind, call_id, tool, data, prev,
                                              session_prev)
                        if computed != stored:
                            raise _Failed(Problem(Kind.EDITED, "its fields no longer give its hash", event_id))
                        self._session_link(sessions, pruned or self.legacy_before, event_id, sid, seq, "",
                                           session_prev, stored)
                        report.events += 1
                        report.head_id, report.head_hash = event_id, stored
                    after = rows[-1][3]
                    self._between()
                report.unsigned_tail = 0 if last is None or report.head_id <= last.last_event_id else 1
            finally:
                self._db.execute("COMMIT")
        except _Failed as failed:
            report.problem = failed.problem
        report.seconds = time.monotonic() - began
        return report


def open_read_only(path: str, *, live: bool = False) -> sqlite3.Connection:
    """``path`` opened so that nothing is written beside it: ``immutable`` (nothing at all is
    created or locked). ``live``: the caller knows a writer has it open (the daemon's own
    VerifyAudit, in its own state directory): read-only through the WAL, whose shared memory the
    daemon already keeps. A file with a ``-wal`` beside it and no ``live`` is refused (OSError
    saying what to do): opened in place, SQLite would create and write ``-shm`` beside it (in
    what may be someone else's directory, which they can change under root's reader), and opened
    immutable it would not see the WAL's events."""
    if not os.path.isfile(path):
        raise FileNotFoundError(path)
    if not live and os.path.lexists(path + "-wal"):
        raise OSError(errno.EBUSY, f"{path} has a write-ahead log ({path}-wal): a daemon has it open, or did not "
                      "close it. Verify a running daemon's log with `sandboxctl audit verify`; or stop the daemon "
                      "(it folds the log in at close); or copy both files to a directory of yours and run "
                      "`sqlite3 COPY 'PRAGMA wal_checkpoint(TRUNCATE)'` on the copy first")
    from urllib.parse import quote

    uri = f"file:{quote(os.path.abspath(path))}?mode=ro" + ("" if live else "&immutable=1")
    db = sqlite3.connect(uri, uri=True, isolation_level=None, check_same_thread=False)
    db.execute("PRAGMA query_only=ON")
    return db
