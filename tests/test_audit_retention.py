"""Retention (audit.retain_days, audit.max_bytes; sandboxd.audit.integrity.retention): the oldest
events go in whole chunks under a signed checkpoint that spans the gap, so the log still verifies
whole; the same deletion without the key does not; an open session's last event holds retention
back; the WAL is truncated after a prune."""

from __future__ import annotations

import os
import sqlite3
import time
from pathlib import Path

from sandboxd.audit.integrity import keys
from sandboxd.audit.integrity.retention import CHUNK_EVENTS, used_bytes
from sandboxd.audit.integrity.verify import Kind, Report, Verifier, open_read_only
from sandboxd.audit.store import EventStore, EventType, SessionRow, open_in_state_dir
from sandboxd.policy.audit_limits import MIN_MAX_BYTES, AuditLimits

DAY = 86400.0


def _row(session_id: str, closed: bool) -> SessionRow:
    return SessionRow(session_id, 1000, 1000, "", "/ws", {}, "never", {}, {}, {}, time.time(),
                      time.time() if closed else None)


def _fill(store: EventStore, events: int, *, session: str = "old", data: dict[str, object] | None = None) -> None:
    for index in range(events):
        store.append(session, EventType.TOOL_STARTED, call_id=f"c{index}", data=data or {"i": index})


def _verify(path: Path) -> Report:
    db = open_read_only(str(path))
    try:
        return Verifier(db, keys.read_public_of_state(str(path.parent)), pinned=True).verify()
    finally:
        db.close()


def test_old_events_are_pruned_in_chunks_under_a_checkpoint_that_spans_the_gap(tmp_path: Path) -> None:
    state = tmp_path / "state"
    store = open_in_state_dir(str(state), limits=AuditLimits(checkpoint_events=100, retain_days=1))
    store.save_session(_row("old", closed=True))
    _fill(store, 3500)
    assert store.prune().events == 0                              # nothing is a day old yet: the control
    pruned = store.prune(now=time.time() + 2 * DAY)
    assert (pruned.events, pruned.through) == (2 * CHUNK_EVENTS, 2 * CHUNK_EVENTS)   # the newest chunk stays
    store.append("new", EventType.SESSION_CREATED)                # the chain goes on past the gap
    store.close()
    report = _verify(state / "events.db")
    assert report.whole, report.text()
    assert report.text().startswith("whole: 1501 events, head 3501")
    assert f"2000 pruned before id 2001 under checkpoint {report.pruned_under}" in report.text()
    db = sqlite3.connect(state / "events.db")
    assert db.execute("SELECT COUNT(*) FROM sessions WHERE id = 'old'").fetchone()[0] == 1   # it has events left
    db.close()


def test_the_same_deletion_without_the_key_is_caught(tmp_path: Path) -> None:
    state = tmp_path / "state"
    store = open_in_state_dir(str(state), limits=AuditLimits(checkpoint_events=100))
    _fill(store, 2500)
    store.close()
    db = sqlite3.connect(state / "events.db")
    db.execute("DELETE FROM events WHERE id <= 1000")
    db.commit()
    db.close()
    report = _verify(state / "events.db")
    assert report.problem is not None and (report.problem.event_id, report.problem.kind) == (1001, Kind.DELETED)


def test_an_open_sessions_last_event_holds_retention_back(tmp_path: Path) -> None:
    state = tmp_path / "state"
    store = open_in_state_dir(str(state), limits=AuditLimits(retain_days=1))
    store.save_session(_row("idle", closed=False))
    store.append("idle", EventType.SESSION_CREATED)              # id 1, and nothing since
    store.save_session(_row("busy", closed=True))
    _fill(store, 3000, session="busy")
    held = store.prune(now=time.time() + 2 * DAY)
    assert (held.events, held.held_back_by) == (0, "idle")
    assert store.session("idle").closed_at is None
    store.append("idle", EventType.SESSION_CLOSED)
    store.save_session(_row("idle", closed=True))
    went = store.prune(now=time.time() + 2 * DAY)
    assert went.events == 2 * CHUNK_EVENTS and not went.held_back_by
    store.close()
    db = sqlite3.connect(state / "events.db")
    # gone's row went with its events; idle's (its close is new) and busy's (events left) stay
    assert db.execute("SELECT id FROM sessions ORDER BY id").fetchall() == [("busy",), ("idle",)]
    db.close()
    assert _verify(state / "events.db").whole


def test_max_bytes_prunes_on_the_stores_own_thread_and_the_wal_is_truncated(tmp_path: Path) -> None:
    """A 20 MiB log under audit.max_bytes 16M: the store's retention thread, at open, prunes the
    oldest chunks until the used pages fit, and the WAL ends empty (the figures go to the report)."""
    state = tmp_path / "state"
    store = open_in_state_dir(str(state), limits=AuditLimits(checkpoint_events=1000))
    _fill(store, 5000, data={"blob": "x" * 4000})
    store.close()
    path = state / "events.db"
    db = sqlite3.connect(path)
    before = used_bytes(db)
    db.close()
    assert before > MIN_MAX_BYTES                                  # the control: it is over the bound
    store = open_in_state_dir(str(state), limits=AuditLimits(max_bytes=MIN_MAX_BYTES))
    pruner = store._pruner
    assert pruner is not None
    while pruner.last is None:                                     # its first run, at open
        time.sleep(0.05)
    result = pruner.last
    assert result.events > 0 and result.events % CHUNK_EVENTS == 0
    assert result.used_after <= MIN_MAX_BYTES < result.used_before
    assert os.path.getsize(str(path) + "-wal") == 0
    print(f"max_bytes 16M: {result.events} events pruned, used {result.used_before >> 10} KiB -> "
          f"{result.used_after >> 10} KiB, file {os.path.getsize(path) >> 10} KiB, WAL 0")
    store.close()
    report = _verify(path)
    assert report.whole, report.text()
    assert report.pruned == result.events


def test_events_an_export_has_not_delivered_are_not_pruned(tmp_path: Path) -> None:
    """Track export's cursor file: retention stops at it, and goes on once it moves."""
    state = tmp_path / "state"
    store = open_in_state_dir(str(state), limits=AuditLimits(retain_days=1))
    _fill(store, 4000)
    cursor = state / "audit-export-file.cursor"
    cursor.write_text('{"version": 1, "last_id": 1500}')
    held = store.prune(now=time.time() + 2 * DAY)
    assert (held.events, held.through) == (CHUNK_EVENTS, CHUNK_EVENTS)
    assert held.held_back_by == "the export cursor audit-export-file.cursor (event 1500)"
    cursor.write_text('{"version": 1, "last_id": 4000}')
    assert store.prune(now=time.time() + 2 * DAY).events == 2 * CHUNK_EVENTS
    store.close()
    assert _verify(state / "events.db").whole


def test_a_migrated_log_whose_older_events_were_pruned_stays_whole(tmp_path: Path) -> None:
    """A session begun before the chain, its unchained events pruned: its first chained event
    (sequence above 1) is no deletion."""
    from sandboxd.audit.store import MIGRATIONS

    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    db = sqlite3.connect(state / "events.db")
    db.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
    for version, migration in enumerate(MIGRATIONS[:5], 1):
        for statement in migration.split(";"):
            if statement.strip():
                db.execute(statement)
        db.execute("INSERT INTO schema_version VALUES (?)", (version,))
    db.executemany("INSERT INTO events (session_id, seq, type, time, data) VALUES ('old', ?, 'ToolInvocationStarted', "
                   "1.0, '{}')", [(seq,) for seq in range(1, CHUNK_EVENTS + 1)])
    db.commit()
    db.close()
    store = open_in_state_dir(str(state), limits=AuditLimits(retain_days=1))
    _fill(store, CHUNK_EVENTS + 1, session="old")
    pruned = store.prune(now=time.time() + 2 * DAY)
    assert (pruned.events, pruned.through) == (CHUNK_EVENTS, CHUNK_EVENTS)      # the unchained chunk only
    store.close()
    report = _verify(state / "events.db")
    assert report.whole, report.text()
    assert report.text().startswith(f"whole: {CHUNK_EVENTS + 1} events") and "pruned" not in report.text()
