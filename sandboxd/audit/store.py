"""The event store: the authoritative, append-only audit log, and what outlives a daemon.

SQLite in WAL mode (the standard library's ``sqlite3``; one file, no server),
with versioned migrations. It holds:

- ``events``: every decision and every step of every tool call, with a global id
  (the order of the whole log, assigned by the writer: consecutive) and a per-session
  sequence number. Rows are only ever inserted; retention alone removes the oldest, under a
  signed checkpoint (below). One process writes a store: the writer keeps the chain's head.
- ``sessions``: each session's metadata (owner, workspace, both policy axes,
  limits, labels, open or closed), so that after a restart sessions can be
  listed, their logs read, and live ones resumed.
- ``memory``: small workspace-scoped records under a namespace of keys, each owned
  by the uid (and TLS principal) that made it; standing permission rules live in the
  ``permission`` namespace.

Durability: every append is committed before it returns, and the daemon appends
an event before it takes the action the event records, so a crash leaves a log
that says exactly how far each call got. ``synchronous=NORMAL`` in WAL mode
survives a crash of the daemon (the kill -9 case); a power loss may drop the
transactions of the last ``checkpointer.DELAY`` seconds, which a thread of its own
syncs to disk (sandboxd.audit.checkpointer, not the call that commits); ``durable=True``
makes every commit wait for the disk.

Bounds (the ``[audit]`` settings, policy.audit_limits): every event's data is kept in its
bounded form (sandboxd.audit.bounded: at most ``audit.event_bytes``, a longer value a caller
chose kept as its start, its length and its SHA-256); every byte written for a session (its
events, its row) and for a standing rule is spent from its owner's budget (sandboxd.audit.budget);
and ``admit`` refuses to let an owner start anything that writes once that budget is spent, or
when the disk is below ``audit.min_free`` (sandboxd.audit.disk_floor). ``append`` itself never
refuses: what must be recorded is recorded, and what may not be recorded does not start. Events
nobody's call asked for (a sandbox's denied connection, a git neutralization: ``note``) are
written while their owner may write, and otherwise counted, the count recorded with the next one
written or at the session's close.

Integrity (sandboxd.audit.integrity): every event is hash-chained as it is written, in the node's
stream and its session's; with the daemon's key a signed checkpoint of the head is written every
``audit.checkpoint_events`` events and at close; retention (``audit.retain_days``,
``audit.max_bytes``) prunes the oldest events on a thread of its own, under signed checkpoints.

Watching: ``watch`` registers a subscriber *before* reading the past, under the
same lock appends take, so the switch from past to live events has no gap and no
duplicate.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import threading
import time
from collections import deque
from typing import Any, Callable, NamedTuple

from sandboxd._record import Factory, Record
from sandboxd.audit import checkpointer
from sandboxd.audit.bounded import bounded
from sandboxd.audit.budget import OwnerBudgets
from sandboxd.audit.disk_floor import DiskFloor
from sandboxd.audit.integrity import schema as chain_schema
from sandboxd.audit.integrity.chain import ChainWriter
from sandboxd.audit.integrity.checkpoints import Kind as CheckpointKind
from sandboxd.audit.integrity.retention import Pruned, Pruner, prune
from sandboxd.errors import Exhausted, InvalidPolicy, NotFound
from sandboxd.policy.audit_limits import AuditLimits

TYPE_CHECKING = False
if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    from sandboxd.audit.integrity.checkpoints import Checkpoint
    from sandboxd.audit.integrity.keys import Signer


log = logging.getLogger("sandboxd.audit")

# Next sequence numbers (and owners) remembered (one per open session, so more than any daemon
# holds); past it the oldest go first and cost one indexed query at their next event.
MAX_CACHED_SEQUENCES = 16384
# What one row costs the disk beyond its text (SQLite's row and cell headers, the id, seq and time,
# and the entries of the four indexes, which repeat the session id, the type and the tool): the
# budget counts it so that it tracks the file's growth (measured in tests/test_audit_bounds.py).
ROW_OVERHEAD = 96
# The chain's three hashes per row (32 bytes each, with their headers).
CHAIN_OVERHEAD = 100


class EventType:
    SESSION_CREATED = "SessionCreated"
    POLICY_CHANGED = "PolicyChanged"
    PERMISSION_REQUESTED = "PermissionRequested"
    PERMISSION_GRANTED = "PermissionGranted"
    PERMISSION_DENIED = "PermissionDenied"
    TOOL_STARTED = "ToolInvocationStarted"
    TOOL_COMPLETED = "ToolInvocationCompleted"
    TOOL_FAILED = "ToolInvocationFailed"
    SESSION_CLOSED = "SessionClosed"
    # The git guard removed a hook, a config key or a redirect a call planted (gitguard/guard.py).
    GIT_CONFIG_NEUTRALIZED = "GitConfigNeutralized"
    # A person applied or discarded a review session's changes (service/review_calls.py): the
    # caller, the paths and content hashes (never contents), what was skipped and why, and the
    # flagged changes held back or named.
    CHANGES_APPLIED = "ChangesApplied"
    CHANGES_DISCARDED = "ChangesDiscarded"
    # A person marked a checkpoint of a review session's changes, or rolled them back to one: the
    # caller, the checkpoint (its label is the caller's string), what was dropped.
    CHECKPOINT_CREATED = "CheckpointCreated"
    CHANGES_ROLLED_BACK = "ChangesRolledBack"
    # The daemon itself ended a running call (service/drain.py): ``reason`` drain_timeout (the drain
    # ran out of drain.timeout_seconds) or daemon_stopped (shutdown = "stop"); written before the kill.
    CALL_STOPPED = "CallStopped"

    ALL = (SESSION_CREATED, POLICY_CHANGED, PERMISSION_REQUESTED, PERMISSION_GRANTED, PERMISSION_DENIED,
           TOOL_STARTED, TOOL_COMPLETED, TOOL_FAILED, SESSION_CLOSED, GIT_CONFIG_NEUTRALIZED, CHANGES_APPLIED,
           CHANGES_DISCARDED, CHECKPOINT_CREATED, CHANGES_ROLLED_BACK, CALL_STOPPED)


class Event(Record):
    id: int
    session_id: str
    sequence: int
    type: str
    time: float
    call_id: str
    tool: str
    data: dict[str, Any]   # JSON
    # The chain (sandboxd.audit.integrity), set by append and events_after (empty elsewhere, and
    # for events from before the chain): this event's hash, and the previous one's in the node's
    # stream and in its session's.
    hash: bytes = b""
    prev_hash: bytes = b""
    session_prev_hash: bytes = b""


class MemoryRow(Record):
    """One remembered record (a standing rule in the permission namespace) and who made it."""

    workspace: str
    key: str
    value: dict[str, Any]
    created_at: float
    owner_uid: int
    owner_principal: str


class SessionRow(Record):
    id: str
    owner_uid: int
    owner_gid: int
    owner_principal: str
    workspace: str
    sandbox_policy: dict[str, Any]
    approval_policy: str
    tool_rules: dict[str, Any]
    limits: dict[str, Any]
    labels: dict[str, str]
    created_at: float
    closed_at: float | None
    env: dict[str, str] = Factory(dict)   # the session's own variables (CreateSessionRequest.env)
    review: bool = False                  # review mode: its change set is under the state directory
    daemon_secrets: dict[str, str] = Factory(dict)   # credential VAR -> daemon secret NAME (never a secret)


class CallResultRow(Record):
    """A finished call as the store keeps it (the call_results table)."""
    call_id: str
    session_id: str
    owner: str
    exit_code: int
    signal: int
    timed_out: bool
    shell_status: int
    reason: str
    stdout_tail: bytes
    stderr_tail: bytes
    finished_at: float


MIGRATIONS: tuple[str, ...] = (
    # 1: the first schema.
    """
    CREATE TABLE sessions (
        id TEXT PRIMARY KEY, owner_uid INTEGER NOT NULL, owner_gid INTEGER NOT NULL,
        owner_principal TEXT NOT NULL DEFAULT '', workspace TEXT NOT NULL, sandbox_policy TEXT NOT NULL,
        approval_policy TEXT NOT NULL, tool_rules TEXT NOT NULL DEFAULT '{}', limits TEXT NOT NULL,
        labels TEXT NOT NULL, created_at REAL NOT NULL, closed_at REAL);
    CREATE TABLE events (
        id INTEGER PRIMARY KEY AUTOINCREMENT, session_id TEXT NOT NULL, seq INTEGER NOT NULL,
        type TEXT NOT NULL, time REAL NOT NULL, call_id TEXT NOT NULL DEFAULT '',
        tool TEXT NOT NULL DEFAULT '', data TEXT NOT NULL, UNIQUE (session_id, seq));
    CREATE INDEX events_by_type ON events (type, id);
    CREATE INDEX events_by_tool ON events (tool, id);
    CREATE INDEX events_by_time ON events (time);
    CREATE TABLE memory (
        namespace TEXT NOT NULL, workspace TEXT NOT NULL, key TEXT NOT NULL, value TEXT NOT NULL,
        created_at REAL NOT NULL, PRIMARY KEY (namespace, workspace, key));
    """,
    # 2: memory belongs to whoever made it (a standing rule applies only to its maker's sessions).
    # Existing rows keep the by_uid they recorded; a row without one is owned by nobody (-1).
    """
    CREATE TABLE memory_owned (
        namespace TEXT NOT NULL, workspace TEXT NOT NULL, owner_uid INTEGER NOT NULL,
        owner_principal TEXT NOT NULL DEFAULT '', key TEXT NOT NULL, value TEXT NOT NULL,
        created_at REAL NOT NULL, PRIMARY KEY (namespace, workspace, owner_uid, owner_principal, key));
    INSERT INTO memory_owned (namespace, workspace, owner_uid, owner_principal, key, value, created_at)
        SELECT namespace, workspace, COALESCE(CAST(json_extract(value, '$.by_uid') AS INTEGER), -1), '', key,
               value, created_at FROM memory;
    DROP TABLE memory;
    ALTER TABLE memory_owned RENAME TO memory;
    """,
    # 3: a session's own environment (--env / --env-file), so a resumed session keeps it.
    """
    ALTER TABLE sessions ADD COLUMN env TEXT NOT NULL DEFAULT '{}';
    """,
    # 4: review mode (docs/review-mode.md), so a resumed session is rebuilt over its change set.
    """
    ALTER TABLE sessions ADD COLUMN review INTEGER NOT NULL DEFAULT 0;
    """,
    # 5: which credential variables use a daemon secret (VAR -> [network.secrets] NAME, never a
    # secret), so a resumed session reads them again (service/credential_vault.py).
    """
    ALTER TABLE sessions ADD COLUMN daemon_secrets TEXT NOT NULL DEFAULT '{}';
    """,
    # 6: the hash chain and its signed checkpoints (sandboxd.audit.integrity): events before it stay
    # unchained, and the genesis row says where the chain starts.
    chain_schema.MIGRATION,
    # 7: finished calls' results (service/call_results.py), so WaitCall answers after a restart:
    # exit information and the last 64 KiB of each output stream, kept a day and CALL_RESULTS_PER_OWNER
    # per owner.
    """
    CREATE TABLE call_results (
        call_id TEXT PRIMARY KEY, session_id TEXT NOT NULL, owner TEXT NOT NULL, exit_code INTEGER NOT NULL,
        signal INTEGER NOT NULL, timed_out INTEGER NOT NULL, shell_status INTEGER NOT NULL,
        reason TEXT NOT NULL, stdout_tail BLOB NOT NULL, stderr_tail BLOB NOT NULL, finished_at REAL NOT NULL);
    CREATE INDEX call_results_by_owner ON call_results (owner, finished_at);
    CREATE INDEX call_results_by_time ON call_results (finished_at);
    """,
    # 8: the checkpoint interval, signed into each checkpoint (sandboxd.audit.integrity.schema).
    chain_schema.INTERVAL_MIGRATION,
    # 9: a page of some sessions' events (a plain caller's QueryEvents/WatchEvents) found from those
    # sessions' own rows after the cursor, not by walking every owner's events of a type or tool
    # under the store's lock (EventStore.query; hostile finding F8). Built once at the upgrade: a
    # scan of the table.
    """
    CREATE INDEX events_by_session ON events (session_id, id);
    """,
    # 10: a plain caller's sessions (which events it may read, its closed sessions) found by owner,
    # not by reading every owner's session rows on each QueryEvents/WatchEvents/ListSessions
    # (EventStore.session_owners, sessions(owner=...)).
    """
    CREATE INDEX sessions_by_owner ON sessions (owner_principal, owner_uid);
    """,
)

# Finished calls' results kept (call_results): a day, and at most this many per owner and in all
# (each up to 128 KiB of output tails: 8 MiB per owner, 512 MiB in all at worst); the oldest go first.
CALL_RESULTS_KEEP_SECONDS = 86400.0
CALL_RESULTS_PER_OWNER = 64
CALL_RESULTS_TOTAL = 4096
CALL_RESULTS_PRUNE_EVERY = 64        # the total is held to within this many rows

PERMISSION_NAMESPACE = "permission"
MAX_PAGE = 1000
WATCH_BACKLOG = 10000


class Subscription:
    """A live feed of appended events that match ``wants``; ``overflowed`` once the reader fell
    more than WATCH_BACKLOG events behind (it must resume from its last sequence)."""

    def __init__(self, wants: Callable[[Event], bool]) -> None:
        self.wants = wants
        self.queue: deque[Event] = deque()
        self.cond = threading.Condition()
        self.overflowed = False
        self.closed = False
        self.high_water = 0

    def push(self, event: Event) -> None:
        with self.cond:
            if len(self.queue) >= WATCH_BACKLOG:
                self.overflowed = True
            else:
                self.queue.append(event)
            self.cond.notify_all()

    def next(self, timeout: float) -> Event | None:
        with self.cond:
            if not self.queue and not self.closed:
                self.cond.wait(timeout)
            return self.queue.popleft() if self.queue else None


def owner_key(owner_uid: int, owner_principal: str) -> str:
    """Whose budget a session's writes are spent from: a TLS caller's principal, else its uid
    (the owners service.quotas counts)."""
    return owner_principal or f"uid {owner_uid}"


class SessionOwner(NamedTuple):
    """Whose a session is, as its row says."""
    uid: int
    principal: str

    @property
    def key(self) -> str:
        """Whose audit budget its writes are spent from (``owner_key``)."""
        return owner_key(self.uid, self.principal)

    @property
    def exempt(self) -> bool:
        """Local root's: never refused a write."""
        return self.uid == 0 and not self.principal


class _Prepared(NamedTuple):
    """One event ready to insert: its data in its bounded form, and that form's JSON text."""
    kind: str
    call_id: str
    tool: str
    data: dict[str, Any]
    text: str


class EventStore:
    def __init__(self, path: str, *, durable: bool = False, limits: AuditLimits | None = None,
                 signer: "Signer | None" = None) -> None:
        """Open (creating and migrating as needed) the store at ``path``; ":memory:" for tests.
        ``signer``: the key checkpoints are signed with (the daemon's); None: the events are
        chained, but no checkpoint is written."""
        if path != ":memory:":
            os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", mode=0o700, exist_ok=True)
            _make_private(path)                        # one an older sandboxd left readable
        self.path = path
        self.limits = limits = limits or AuditLimits()
        self._lock = threading.RLock()
        self._next_seq: dict[str, int] = {}
        self._owners: dict[str, SessionOwner | None] = {}     # None: the session has no row
        # (session, type, tool) -> events ``note`` only counted. Bounded by the open sessions: a
        # session's close records and drops its counts, and nothing notes for a closed session
        # (its proxy and git guard are stopped before its SessionClosed is appended).
        self._unrecorded: dict[tuple[str, str, str], int] = {}
        self._subscribers: list[Subscription] = []
        self._call_results_saved = 0          # save_call_result's count, for the total's prune
        self._budgets = OwnerBudgets(limits.owner_budget_bytes, limits.budget_period_seconds)
        self._floor = DiskFloor(os.path.dirname(os.path.abspath(path)), 0 if path == ":memory:" else
                                limits.min_free_bytes, 0.0 if path == ":memory:" else limits.min_free_percent,
                                _min_free_text(limits))
        # The audit log (argv, paths, answers) is the daemon's alone, from its first byte: sqlite
        # creates the database, its WAL and its SHM with 0644 less the umask (and the WAL and
        # SHM later with the database's mode), so the umask is tight while they are made.
        previous = os.umask(0o077)
        try:
            self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            synchronous = "FULL" if durable else "NORMAL"
            self._db.execute(f"PRAGMA synchronous={synchronous}")
            self._db.execute("PRAGMA foreign_keys=ON")
            self._migrate()
        finally:
            os.umask(previous)
        self._chain = ChainWriter(self._db, signer, limits.checkpoint_events)
        self._checkpoints: checkpointer.Checkpointer | None = None
        if path != ":memory:":
            _make_private(path)
            self._db.execute(f"PRAGMA wal_autocheckpoint={checkpointer.FALLBACK_PAGES}")
            self._checkpoints = checkpointer.Checkpointer(path, synchronous)
        self._pruner: Pruner | None = None
        if signer is not None and path != ":memory:" and (limits.retain_days or limits.max_bytes):
            self._pruner = Pruner(self.prune)             # last: it may run at once

    def _committed(self) -> None:
        if self._checkpoints is not None:
            self._checkpoints.committed()

    # -- schema ----------------------------------------------------------------------------------

    def _migrate(self) -> None:
        with self._lock:
            self._db.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
            row = self._db.execute("SELECT MAX(version) FROM schema_version").fetchone()
            current = row[0] or 0
            if current > len(MIGRATIONS):
                raise InvalidPolicy(f"the event store {self.path} has schema version {current}, newer than this "
                                    f"sandboxd knows ({len(MIGRATIONS)}): upgrade sandboxd or use another path")
            for version in range(current + 1, len(MIGRATIONS) + 1):
                self._db.execute("BEGIN IMMEDIATE")
                try:
                    for statement in MIGRATIONS[version - 1].split(";"):
                        if statement.strip():
                            self._db.execute(statement)
                    self._db.execute("INSERT INTO schema_version (version) VALUES (?)", (version,))
                    self._db.execute("COMMIT")
                except BaseException:
                    self._db.execute("ROLLBACK")
                    raise

    @property
    def schema_version(self) -> int:
        return int(self._db.execute("SELECT MAX(version) FROM schema_version").fetchone()[0] or 0)

    def close(self) -> None:
        if self._pruner is not None:
            self._pruner.stop()
        with self._lock:
            if self._chain.signer is not None and self._chain.head_id > self._chain.checkpointed_id:
                self._checkpoint(CheckpointKind.SHUTDOWN)
        if self._checkpoints is not None:
            self._checkpoints.stop()
        with self._lock:
            for subscriber in self._subscribers:
                with subscriber.cond:
                    subscriber.closed = True
                    subscriber.cond.notify_all()
            self._db.close()

    # -- admission: what may start writing ------------------------------------------------------

    def admit(self, owner_uid: int, owner_principal: str = "") -> None:
        """Whether this owner may start something that writes (a call, a session, a policy change,
        a standing rule): Exhausted, naming the setting, when the log's disk is below
        ``audit.min_free`` or (local root excepted) the owner's budget is spent."""
        problem = self._floor.shortfall()
        if problem is not None:
            raise Exhausted(problem)
        if owner_uid == 0 and not owner_principal:
            return
        owner = owner_key(owner_uid, owner_principal)
        wait = self._budgets.refusal(owner)
        if wait is not None:
            limits = self.limits
            raise Exhausted(
                f"{owner} has written its whole audit budget (audit.owner_budget: {_size_text(limits.owner_budget_bytes)} "
                f"per audit.budget_period_seconds: {limits.budget_period_seconds:g} s) to the audit log: its new calls, "
                f"sessions and policy changes are refused for about {wait:.0f} s, until the budget refills (reads and "
                "calls under way are not affected; an administrator may raise audit.owner_budget)")

    def budget_left(self, owner_uid: int, owner_principal: str = "") -> float:
        """Bytes the owner may still write before ``admit`` refuses it (below zero: its overdraft)."""
        return self._budgets.left(owner_key(owner_uid, owner_principal))

    def _owner(self, session_id: str) -> SessionOwner | None:
        """The session's owner; None for a session without a row (the store's own tests). Under
        the lock; a lookup only when the session is not among the cached."""
        if session_id in self._owners:
            return self._owners[session_id]
        row = self._db.execute("SELECT owner_uid, owner_principal FROM sessions WHERE id = ?",
                               (session_id,)).fetchone()
        owner = None if row is None else SessionOwner(int(row[0]), str(row[1]))
        self._remember_owner(session_id, owner)
        return owner

    def owner_of(self, session_id: str) -> SessionOwner | None:
        """The owner of a session (None: no such session). What a watcher's filter asks for an
        event of a session it did not know: inside an append it is the cached owner the append
        itself just looked up, so no SQL runs under the lock for it (hostile finding F12)."""
        with self._lock:
            return self._owner(session_id)

    def _remember_owner(self, session_id: str, owner: SessionOwner | None) -> None:
        self._owners[session_id] = owner
        while len(self._owners) > MAX_CACHED_SEQUENCES:
            del self._owners[next(iter(self._owners))]

    def _spend(self, owner: SessionOwner | None, amount: int) -> None:
        if owner is not None:
            self._budgets.spend(owner.key, amount)

    def _may_write(self, owner: SessionOwner | None) -> bool:
        if self._floor.shortfall() is not None:
            return False
        return owner is None or owner.exempt or self._budgets.refusal(owner.key) is None

    # -- events ----------------------------------------------------------------------------------

    def append(self, session_id: str, kind: str, *, call_id: str = "", tool: str = "",
               data: dict[str, Any] | None = None) -> Event:
        """Append one event; committed when this returns."""
        return self.append_many(session_id, [(kind, call_id, tool, data or {})])[0]

    def append_many(self, session_id: str, rows: list[tuple[str, str, str, dict[str, Any]]]) -> list[Event]:
        """Append several events of one session in one transaction (kind, call_id, tool, data),
        each in its bounded form, never refused: the caller was admitted before it started
        what they record (``admit``). A session's close first records what ``note`` only counted."""
        prepared = self._prepared(rows)
        with self._lock:
            if any(kind == EventType.SESSION_CLOSED for kind, *_ in rows):
                prepared = self._prepared(self._counted_rows(session_id)) + prepared
            return self._write(session_id, prepared)

    def note(self, session_id: str, rows: list[tuple[str, str, str, dict[str, Any]]]) -> list[Event]:
        """Append events nobody's call asked for and that no refusal can prevent (a sandbox's
        denied connection, a git neutralization: the protection itself happens either way).
        Written while the session's owner may write (``admit``'s conditions); otherwise only
        counted, and the count recorded as ``unrecorded`` in the next such event written, or in
        one event of that type when the session closes. Returns the events written."""
        prepared = self._prepared(rows)
        with self._lock:
            owner = self._owner(session_id)
            if not self._may_write(owner):
                for kind, _call_id, tool, _data in rows:
                    key = (session_id, kind, tool)
                    self._unrecorded[key] = self._unrecorded.get(key, 0) + 1
                return []
            for index, (kind, call_id, tool, _data) in enumerate(rows):
                missed = self._unrecorded.pop((session_id, kind, tool), 0)
                if missed:
                    prepared[index] = self._prepared([(kind, call_id, tool, {**rows[index][3], "unrecorded": missed})])[0]
            return self._write(session_id, prepared)

    def _prepared(self, rows: list[tuple[str, str, str, dict[str, Any]]]) -> list[_Prepared]:
        """Each row checked and in its bounded form, with its text: done before the lock is taken
        (a caller's megabytes take milliseconds to bound, and nobody else's event waits for it)."""
        prepared = []
        for kind, call_id, tool, data in rows:
            if kind not in EventType.ALL:
                raise InvalidPolicy(f"unknown event type {kind!r}")
            kept, text = bounded(data, self.limits.event_bytes)
            prepared.append(_Prepared(kind, call_id, tool, kept, text))
        return prepared

    def _counted_rows(self, session_id: str) -> list[tuple[str, str, str, dict[str, Any]]]:
        """One event per type that ``note`` only counted in this session (under the lock)."""
        rows = []
        for key in [k for k in self._unrecorded if k[0] == session_id]:
            missed = self._unrecorded.pop(key)
            rows.append((key[1], "", key[2], {
                "unrecorded": missed, "message": f"{missed} more {key[1]} events of this session were counted, "
                "not recorded one by one: its owner's audit budget (audit.owner_budget) was spent or the disk was "
                "below audit.min_free"}))
        return rows

    def _write(self, session_id: str, rows: list[_Prepared]) -> list[Event]:
        """Insert ``rows`` in one transaction and tell the watchers (under the lock)."""
        now = time.time()
        seq = self._next_seq.get(session_id)
        if seq is None:
            seq = int(self._db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM events WHERE session_id = ?",
                                       (session_id,)).fetchone()[0])
        owner = self._owner(session_id)
        events, cost = [], 0
        chain = self._chain
        # Ids are given, not left to AUTOINCREMENT: each is hashed before its row exists, and the
        # chain's ids have no gaps (one is a deleted event).
        event_id, prev, session_prev = chain.next_id(), chain.head_hash, chain.session_head(session_id)
        self._db.execute("BEGIN IMMEDIATE")
        try:
            for offset, (kind, call_id, tool, kept, text) in enumerate(rows):
                digest = chain.link(event_id, now, session_id, seq + offset, kind, call_id, tool, text, session_prev,
                                    prev)
                self._db.execute(
                    "INSERT INTO events (id, session_id, seq, type, time, call_id, tool, data, prev_hash, hash, "
                    "session_prev_hash) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (event_id, session_id, seq + offset, kind, now, call_id, tool, text, prev, digest, session_prev))
                events.append(Event(event_id, session_id, seq + offset, kind, now, call_id, tool, kept, digest, prev,
                                    session_prev))
                cost += len(text) + len(call_id) + 2 * (len(session_id) + len(kind) + len(tool)) + ROW_OVERHEAD \
                    + CHAIN_OVERHEAD
                event_id, prev, session_prev = event_id + 1, digest, digest
            self._db.execute("COMMIT")
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._committed()
        self._spend(owner, cost)
        chain.advanced(session_id, event_id - 1, prev, any(kind == EventType.SESSION_CLOSED for kind, *_ in rows))
        if chain.checkpoint_due():
            self._checkpoint(CheckpointKind.PERIODIC)
        # Before a closing session's owner leaves the cache: the watchers' filters ask for it
        # (owner_of). Each filter is O(1) and runs no SQL here (service/watch_filter.py).
        for subscriber in self._subscribers:
            for event in events:
                if subscriber.wants(event):
                    subscriber.push(event)
        if any(kind == EventType.SESSION_CLOSED for kind, *_ in rows):
            # A cache (a miss asks the index): a closed session's entry would stay forever, one
            # per session the daemon ever served, the soak's steady growth.
            self._next_seq.pop(session_id, None)
            self._owners.pop(session_id, None)
        else:
            self._next_seq[session_id] = seq + len(rows)
            while len(self._next_seq) > MAX_CACHED_SEQUENCES:      # late events of closed ones
                del self._next_seq[next(iter(self._next_seq))]
        return events

    @property
    def signing_key(self) -> "Ed25519PublicKey | None":
        """The public key this store's checkpoints are signed with (None: it writes none)."""
        return self._chain.signer.public if self._chain.signer is not None else None

    def prune(self, now: float | None = None) -> Pruned:
        """Apply audit.retain_days and audit.max_bytes once (sandboxd.audit.integrity.retention;
        the store's own thread does this at start and every PRUNE_SECONDS)."""
        return prune(self._db, self._chain, self._lock, retain_days=self.limits.retain_days,
                     max_bytes=self.limits.max_bytes, directory=os.path.dirname(os.path.abspath(self.path)), now=now,
                     committed=self._committed)

    def _checkpoint(self, kind: str) -> None:
        """Sign the chain's head (under the lock). A failure is logged, never raised: the events
        are committed, and the next checkpoint signs them."""
        try:
            self._chain.checkpoint(kind)
            self._committed()
        except (sqlite3.Error, OSError) as error:
            log.warning("audit checkpoint failed", extra={"fields": {"error": str(error)}})

    def query(self, *, session_ids: list[str] | None = None, types: list[str] | None = None, tool: str = "",
              since: float | None = None, until: float | None = None, after_id: int = 0,
              limit: int = 100) -> list[Event]:
        """Events in log order, filtered; ``after_id`` pages (pass the last id seen).
        ``session_ids`` None: every session; an empty list: none."""
        if session_ids is not None and not session_ids:
            return []
        sql, args = query_sql(session_ids=session_ids, types=types, tool=tool, since=since, until=until,
                              after_id=after_id, limit=limit)
        with self._lock:
            rows = self._db.execute(sql, args).fetchall()
        return [_event(r) for r in rows]

    def checkpoints_after(self, checkpoint_id: int, limit: int = MAX_PAGE) -> "list[Checkpoint]":
        """Signed checkpoints with id > ``checkpoint_id``, oldest first (what an export ships off
        the node so a rewrite by root on it can be found: docs/threat-model.md)."""
        from sandboxd.audit.integrity.checkpoints import from_row
        from sandboxd.audit.integrity.schema import CHECKPOINT_COLUMNS

        with self._lock:
            rows = self._db.execute(f"SELECT {CHECKPOINT_COLUMNS} FROM audit_checkpoints WHERE id > ? ORDER BY id "
                                    "LIMIT ?", (checkpoint_id, max(1, min(limit, MAX_PAGE)))).fetchall()
        return [from_row(row) for row in rows]

    def session_events(self, session_id: str, from_sequence: int = 0, limit: int = MAX_PAGE) -> list[Event]:
        """One session's events with sequence > ``from_sequence``, in order (uses the unique index)."""
        with self._lock:
            rows = self._db.execute(f"SELECT {_EVENT_COLUMNS} FROM events WHERE session_id = ? AND seq > ? ORDER BY seq "
                                    "LIMIT ?", (session_id, from_sequence, limit)).fetchall()
        return [_event(r) for r in rows]

    def events_after(self, cursor_id: int, limit: int = MAX_PAGE) -> list[Event]:
        """Every session's events with id > ``cursor_id``, in log order, at most ``limit``, with
        their chain hashes: how an exporter walks the log from its cursor (the id of the last event
        it delivered)."""
        with self._lock:
            return read_events_after(self._db, cursor_id, limit)

    def subscribe(self, wants: Callable[[Event], bool]) -> Subscription:
        """Start a live feed of the events ``wants`` accepts. Its ``high_water`` is the last event
        id committed before it began: read the past up to there (``query``), then the feed,
        and nothing is missed or seen twice (both are taken under the append lock)."""
        subscription = Subscription(wants)
        with self._lock:
            self._subscribers.append(subscription)
            subscription.high_water = int(self._db.execute("SELECT COALESCE(MAX(id), 0) FROM events").fetchone()[0])
        return subscription

    def unsubscribe(self, subscription: Subscription) -> None:
        with self._lock:
            if subscription in self._subscribers:
                self._subscribers.remove(subscription)

    def last_id(self) -> int:
        """The id of the newest event (ids start at 1 and are never reused; the number of events
        too, until retention prunes)."""
        with self._lock:
            return int(self._db.execute("SELECT COALESCE(MAX(id), 0) FROM events").fetchone()[0])

    def count(self) -> int:
        with self._lock:
            return int(self._db.execute("SELECT COUNT(*) FROM events").fetchone()[0])

    # -- call results (service/call_results.py) ----------------------------------------------------

    def save_call_result(self, row: CallResultRow) -> None:
        """Keep a finished call's result, dropping those older than CALL_RESULTS_KEEP_SECONDS and the
        oldest past CALL_RESULTS_PER_OWNER (its owner's) and CALL_RESULTS_TOTAL. Its bytes are spent
        from its owner's audit budget, like its events."""
        values = (row.call_id, row.session_id, row.owner, row.exit_code, row.signal, int(row.timed_out),
                  row.shell_status, row.reason, row.stdout_tail, row.stderr_tail, row.finished_at)
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute("INSERT OR REPLACE INTO call_results (call_id, session_id, owner, exit_code, signal, "
                                 "timed_out, shell_status, reason, stdout_tail, stderr_tail, finished_at) "
                                 "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", values)
                # Each by an index, on the call's path: the owner's oldest past its cap, the day's end,
                # and (every CALL_RESULTS_PRUNE_EVERY saves: it counts them all) the oldest past the total.
                self._db.execute("DELETE FROM call_results WHERE finished_at < ?",
                                 (row.finished_at - CALL_RESULTS_KEEP_SECONDS,))
                held = self._db.execute("SELECT COUNT(*) FROM call_results WHERE owner = ?", (row.owner,)).fetchone()[0]
                if held > CALL_RESULTS_PER_OWNER:
                    self._db.execute("DELETE FROM call_results WHERE call_id IN (SELECT call_id FROM call_results "
                                     "WHERE owner = ? ORDER BY finished_at LIMIT ?)",
                                     (row.owner, held - CALL_RESULTS_PER_OWNER))
                self._call_results_saved += 1
                if self._call_results_saved % CALL_RESULTS_PRUNE_EVERY == 0:
                    total = self._db.execute("SELECT COUNT(*) FROM call_results").fetchone()[0]
                    if total > CALL_RESULTS_TOTAL:
                        self._db.execute("DELETE FROM call_results WHERE call_id IN (SELECT call_id FROM "
                                         "call_results ORDER BY finished_at LIMIT ?)", (total - CALL_RESULTS_TOTAL,))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._committed()
            owner = self._owner(row.session_id)
            self._spend(owner, len(row.stdout_tail) + len(row.stderr_tail) + len(row.reason) + ROW_OVERHEAD)

    def call_result(self, call_id: str) -> CallResultRow | None:
        """A finished call's kept result, or None (never known, or no longer kept)."""
        with self._lock:
            r = self._db.execute("SELECT call_id, session_id, owner, exit_code, signal, timed_out, shell_status, reason, "
                                 "stdout_tail, stderr_tail, finished_at FROM call_results WHERE call_id = ?",
                                 (call_id,)).fetchone()
        if r is None:
            return None
        return CallResultRow(str(r[0]), str(r[1]), str(r[2]), int(r[3]), int(r[4]), bool(r[5]), int(r[6]), str(r[7]),
                             bytes(r[8]), bytes(r[9]), float(r[10]))

    # -- sessions --------------------------------------------------------------------------------

    def save_session(self, row: SessionRow) -> None:
        """Insert or update a session's metadata (committed when this returns)."""
        values = (row.id, row.owner_uid, row.owner_gid, row.owner_principal, row.workspace,
                  json.dumps(row.sandbox_policy), row.approval_policy, json.dumps(row.tool_rules),
                  json.dumps(row.limits), json.dumps(row.labels), row.created_at, row.closed_at, json.dumps(row.env),
                  int(row.review), json.dumps(row.daemon_secrets))
        with self._lock:
            self._db.execute(
                "INSERT INTO sessions (id, owner_uid, owner_gid, owner_principal, workspace, sandbox_policy, "
                "approval_policy, tool_rules, limits, labels, created_at, closed_at, env, review, daemon_secrets) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (id) DO UPDATE SET "
                "sandbox_policy = excluded.sandbox_policy, approval_policy = excluded.approval_policy, "
                "daemon_secrets = excluded.daemon_secrets, "
                "tool_rules = excluded.tool_rules, closed_at = excluded.closed_at", values)
            self._committed()
            owner = SessionOwner(row.owner_uid, row.owner_principal)
            if row.closed_at is None:
                self._remember_owner(row.id, owner)
            self._spend(owner, sum(len(v) for v in values if isinstance(v, str)) + ROW_OVERHEAD)

    _SESSION_COLUMNS = ("SELECT id, owner_uid, owner_gid, owner_principal, workspace, sandbox_policy, "
                        "approval_policy, tool_rules, limits, labels, created_at, closed_at, env, review, daemon_secrets "
                        "FROM sessions")

    def sessions(self, *, include_closed: bool = False,
                 owner: "tuple[str, int | None] | None" = None) -> list[SessionRow]:
        """Session rows, oldest first; ``owner`` (principal, uid; None: any uid): only those."""
        clauses, args = ([] if include_closed else ["closed_at IS NULL"]), list[object]()
        if owner is not None:
            clauses.append("owner_principal = ?")
            args.append(owner[0])
            if owner[1] is not None:
                clauses.append("owner_uid = ?")
                args.append(owner[1])
        sql = self._SESSION_COLUMNS + (f" WHERE {' AND '.join(clauses)}" if clauses else "")
        with self._lock:
            rows = self._db.execute(sql + " ORDER BY created_at", args).fetchall()
        return [_session_row(r) for r in rows]

    def session_owners(self, principal: str, uid: int | None = None) -> list[tuple[str, SessionOwner]]:
        """The ids and owners of the sessions, open or closed, of owner ``principal`` (and ``uid``;
        None: any), found through sessions_by_owner: only those rows are read, not every owner's
        (and none of their JSON decoded)."""
        sql = "SELECT id, owner_uid, owner_principal FROM sessions WHERE owner_principal = ?"
        args: list[object] = [principal]
        if uid is not None:
            sql += " AND owner_uid = ?"
            args.append(uid)
        with self._lock:
            rows = self._db.execute(sql, args).fetchall()
        return [(str(r[0]), SessionOwner(int(r[1]), str(r[2]))) for r in rows]

    def review_session_ids(self, owner_uid: int, owner_principal: str = "") -> list[str]:
        """The ids of one owner's review sessions, closed ones included (whose change sets may be
        kept): only their ids, not every session's row."""
        with self._lock:
            rows = self._db.execute("SELECT id FROM sessions WHERE review = 1 AND owner_uid = ? AND owner_principal = ?",
                                    (owner_uid, owner_principal)).fetchall()
        return [str(row[0]) for row in rows]

    def session(self, session_id: str) -> SessionRow:
        with self._lock:
            row = self._db.execute(self._SESSION_COLUMNS + " WHERE id = ?", (session_id,)).fetchone()
        if row is None:
            raise NotFound(f"no session {session_id!r} in the event store")
        return _session_row(row)

    # -- workspace memory (standing rules) -------------------------------------------------------
    # Every row has an owner: the uid and (for a TLS caller) the certificate that made it. Each
    # owner has its own rows; nobody's row answers for another's sessions.

    def remember(self, namespace: str, workspace: str, key: str, value: dict[str, Any], *, owner_uid: int,
                 owner_principal: str = "") -> None:
        """Insert or replace one owner's row, spent from its budget (the caller was admitted)."""
        text = json.dumps(value)
        with self._lock:
            self._db.execute("INSERT INTO memory (namespace, workspace, owner_uid, owner_principal, key, value, "
                             "created_at) VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT "
                             "(namespace, workspace, owner_uid, owner_principal, key) DO UPDATE SET value = "
                             "excluded.value",
                             (namespace, workspace, owner_uid, owner_principal, key, text, time.time()))
            self._committed()
        self._budgets.spend(owner_key(owner_uid, owner_principal),
                            len(namespace) + 2 * (len(workspace) + len(key) + len(owner_principal)) + len(text)
                            + ROW_OVERHEAD)

    def forget(self, namespace: str, workspace: str, key: str, *, owner_uid: int, owner_principal: str = "") -> bool:
        """Remove one owner's row; whether there was one."""
        with self._lock:
            cursor = self._db.execute("DELETE FROM memory WHERE namespace = ? AND workspace = ? AND key = ? "
                                      "AND owner_uid = ? AND owner_principal = ?",
                                      (namespace, workspace, key, owner_uid, owner_principal))
            self._committed()
        return cursor.rowcount > 0

    def recall(self, namespace: str, workspace: str | None = None, *, owner_uid: int | None = None,
               owner_principal: str = "") -> list[MemoryRow]:
        """Rows of a namespace, for one workspace or all; of one owner (``owner_uid`` and
        ``owner_principal``) or, with ``owner_uid`` None, of every owner."""
        sql = "SELECT workspace, key, value, created_at, owner_uid, owner_principal FROM memory WHERE namespace = ?"
        args: list[Any] = [namespace]
        if workspace is not None:
            sql += " AND workspace = ?"
            args.append(workspace)
        if owner_uid is not None:
            sql += " AND owner_uid = ? AND owner_principal = ?"
            args += [owner_uid, owner_principal]
        with self._lock:
            rows = self._db.execute(sql + " ORDER BY workspace, key, owner_uid, owner_principal", args).fetchall()
        return [MemoryRow(r[0], r[1], json.loads(r[2]), r[3], r[4], r[5]) for r in rows]

    def has_memory(self, namespace: str, workspace: str, key: str, *, owner_uid: int,
                   owner_principal: str = "") -> bool:
        with self._lock:
            return self._db.execute("SELECT 1 FROM memory WHERE namespace = ? AND workspace = ? AND key = ? "
                                    "AND owner_uid = ? AND owner_principal = ?",
                                    (namespace, workspace, key, owner_uid, owner_principal)).fetchone() is not None


STORE_SUFFIXES = ("", "-wal", "-shm")                # the database and the files sqlite keeps beside it


def open_in_state_dir(state_dir: str, *, durable: bool = False, limits: AuditLimits | None = None) -> EventStore:
    """The daemon's store, ``events.db`` in ``state_dir``, which is forced to 0700 first (it
    may be an older sandboxd's, or made by hand with the default umask), its checkpoints signed
    with the state directory's key (made on first start: sandboxd.audit.integrity.keys)."""
    from sandboxd.audit.integrity.keys import load_or_create

    os.makedirs(state_dir, mode=0o700, exist_ok=True)
    st = os.stat(state_dir)
    if st.st_uid != os.geteuid():
        raise InvalidPolicy(f"the state directory {state_dir} belongs to uid {st.st_uid}, not to the daemon's "
                            f"uid {os.geteuid()}: chown it or use another --state-dir")
    os.chmod(state_dir, 0o700)
    return EventStore(os.path.join(state_dir, "events.db"), durable=durable, limits=limits,
                      signer=load_or_create(state_dir))


def query_sql(*, session_ids: list[str] | None, types: list[str] | None, tool: str, since: float | None,
              until: float | None, after_id: int, limit: int) -> tuple[str, list[object]]:
    """The SELECT ``EventStore.query`` runs, and its arguments. Named sessions (every plain
    caller's query names its own) are read through events_by_session, whatever else filters: the
    planner would otherwise walk events_by_type or events_by_tool over every owner's events of
    that type, id by id, until it found a page of the caller's (F8). Their ids go as one JSON
    array, so a caller with more sessions than SQLite takes variables is still answered."""
    clauses, args = ["id > ?"], list[object]([after_id])
    source = "events"
    if session_ids is not None:
        source = "events INDEXED BY events_by_session"
        clauses.append("session_id IN (SELECT value FROM json_each(?))")
        args.append(json.dumps(session_ids))
    if types:
        unknown = set(types) - set(EventType.ALL)
        if unknown:
            raise InvalidPolicy(f"unknown event type(s) {sorted(unknown)}: use {', '.join(EventType.ALL)}")
        kinds = sorted(set(types))                 # a type named twice is one variable
        clauses.append(f"type IN ({','.join('?' * len(kinds))})")
        args += kinds
    if tool:
        clauses.append("tool = ?")
        args.append(tool)
    if since is not None:
        clauses.append("time >= ?")
        args.append(since)
    if until is not None:
        clauses.append("time < ?")
        args.append(until)
    limit = max(1, min(limit, MAX_PAGE))
    return f"SELECT {_EVENT_COLUMNS} FROM {source} WHERE {' AND '.join(clauses)} ORDER BY id LIMIT {limit}", args


def read_events_after(db: sqlite3.Connection, cursor_id: int, limit: int) -> list[Event]:
    """Events with id > ``cursor_id`` in id order, at most ``limit`` (1 to MAX_PAGE), from ``db``:
    the store's own connection, or a reader's (sandboxd.audit.export reads on a connection of its
    own, so an export never holds the lock appends take)."""
    rows = db.execute(f"SELECT {_EVENT_COLUMNS} FROM events WHERE id > ? ORDER BY id LIMIT ?",
                      (cursor_id, max(1, min(limit, MAX_PAGE)))).fetchall()
    return [_event(r) for r in rows]


def _size_text(size: int) -> str:
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if size >= 1 << shift and size % (1 << shift) == 0:
            return f"{size >> shift}{unit}"
    return f"{size} bytes"


def _min_free_text(limits: AuditLimits) -> str:
    """audit.min_free as it would be written."""
    return f"{limits.min_free_percent:g}%" if limits.min_free_percent else _size_text(limits.min_free_bytes)


def _make_private(path: str) -> None:
    """The database, its WAL and its SHM: 0600, whichever exist."""
    for suffix in STORE_SUFFIXES:
        try:
            os.chmod(path + suffix, 0o600)
        except FileNotFoundError:
            pass


_EVENT_COLUMNS = "id, session_id, seq, type, time, call_id, tool, data, hash, prev_hash, session_prev_hash"


def _event(r: tuple[Any, ...]) -> Event:
    """An events row read with _EVENT_COLUMNS (an event from before the chain has no hashes)."""
    return Event(r[0], r[1], r[2], r[3], r[4], r[5], r[6], json.loads(r[7]), bytes(r[8] or b""), bytes(r[9] or b""),
                 bytes(r[10] or b""))


def _session_row(r: tuple[Any, ...]) -> SessionRow:
    return SessionRow(r[0], r[1], r[2], r[3], r[4], json.loads(r[5]), r[6], json.loads(r[7]), json.loads(r[8]),
                      json.loads(r[9]), r[10], r[11], json.loads(r[12]), bool(r[13]),
                      json.loads(r[14]))
