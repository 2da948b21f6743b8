"""The event store on its own (sandboxd.audit.store): migrations, append-only events with
per-session sequences, queries, live subscriptions, session rows and workspace memory."""

from __future__ import annotations

import os
import shutil
import sqlite3
import stat
import threading
import time
from pathlib import Path
from typing import Callable

import pytest

from conftest import SLOW
from sandboxd.audit import checkpointer
from sandboxd.audit.store import MIGRATIONS, PERMISSION_NAMESPACE, EventStore, EventType, SessionRow, query_sql
from sandboxd.errors import InvalidPolicy, NotFound


@pytest.fixture
def store(tmp_path: Path) -> EventStore:
    s = EventStore(str(tmp_path / "state" / "events.db"))
    yield s
    s.close()


def test_a_new_store_is_migrated_private_and_in_wal_mode(tmp_path: Path) -> None:
    path = tmp_path / "state" / "events.db"
    store = EventStore(str(path))
    assert store.schema_version == len(MIGRATIONS)
    store.close()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert db.execute("SELECT COUNT(*) FROM schema_version").fetchone()[0] == len(MIGRATIONS)
    db.close()
    EventStore(str(path)).close()                          # opening again migrates nothing twice
    db = sqlite3.connect(path)
    assert db.execute("SELECT COUNT(*) FROM schema_version").fetchone()[0] == len(MIGRATIONS)
    db.close()


def test_a_store_from_a_newer_sandboxd_is_refused_with_what_to_do(tmp_path: Path) -> None:
    path = tmp_path / "events.db"
    EventStore(str(path)).close()
    db = sqlite3.connect(path)
    db.execute("INSERT INTO schema_version (version) VALUES (99)")
    db.commit()
    db.close()
    with pytest.raises(InvalidPolicy, match="schema version 99.*upgrade sandboxd"):
        EventStore(str(path))


def test_sequences_are_per_session_and_survive_a_reopen(tmp_path: Path) -> None:
    path = str(tmp_path / "events.db")
    store = EventStore(path)
    a1 = store.append("a", EventType.SESSION_CREATED)
    b1 = store.append("b", EventType.SESSION_CREATED)
    a2, a3 = store.append_many("a", [(EventType.PERMISSION_GRANTED, "c1", "fs.read", {"by": "policy"}),
                                     (EventType.TOOL_STARTED, "c1", "fs.read", {})])
    assert [(e.session_id, e.sequence) for e in (a1, b1, a2, a3)] == [("a", 1), ("b", 1), ("a", 2), ("a", 3)]
    assert a1.id < b1.id < a2.id < a3.id
    store.close()
    reopened = EventStore(path)
    assert reopened.append("a", EventType.TOOL_COMPLETED, call_id="c1").sequence == 4
    assert [e.type for e in reopened.session_events("a")] == [
        "SessionCreated", "PermissionGranted", "ToolInvocationStarted", "ToolInvocationCompleted"]
    reopened.close()


def test_a_closed_sessions_sequence_is_not_remembered_yet_a_late_event_follows_on(
        store: EventStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """The next-sequence cache held one entry per session ever served: the soak's steady growth."""
    for n in range(50):
        store.append(f"s{n}", EventType.SESSION_CREATED)
        store.append(f"s{n}", EventType.SESSION_CLOSED)
    assert store._next_seq == {}
    assert store.append("s7", EventType.GIT_CONFIG_NEUTRALIZED).sequence == 3    # asked of the index
    monkeypatch.setattr("sandboxd.audit.store.MAX_CACHED_SEQUENCES", 8)
    for n in range(20):                                   # open sessions past the bound: the oldest go
        store.append(f"open{n}", EventType.SESSION_CREATED)
    assert len(store._next_seq) == 8
    assert store.append("open0", EventType.TOOL_STARTED).sequence == 2
    assert store.append("open19", EventType.TOOL_STARTED).sequence == 2


def test_unknown_event_types_are_refused(store: EventStore) -> None:
    with pytest.raises(InvalidPolicy, match="unknown event type"):
        store.append("a", "SomethingElse")
    with pytest.raises(InvalidPolicy, match="unknown event type"):
        store.query(types=["SomethingElse"])
    assert store.count() == 0


def test_queries_filter_and_page(store: EventStore) -> None:
    for n in range(10):
        store.append("a" if n % 2 else "b", EventType.TOOL_STARTED, tool="fs.read" if n < 5 else "search")
    assert len(store.query(session_ids=["a"])) == 5
    assert len(store.query(tool="search")) == 5
    assert len(store.query(session_ids=["a"], tool="search")) == 3
    assert store.query(session_ids=[]) == []
    page1 = store.query(limit=4)
    page2 = store.query(limit=4, after_id=page1[-1].id)
    assert [e.id for e in page1 + page2] == [e.id for e in store.query(limit=8)]
    everything = store.query()
    cut = everything[3].time
    later, earlier = store.query(since=cut), store.query(until=cut)
    assert all(e.time >= cut for e in later) and all(e.time < cut for e in earlier)
    assert sorted(e.id for e in later + earlier) == [e.id for e in everything] and everything[3] in later


def _statements_and_steps(store: EventStore, query: Callable[[], object]) -> tuple[list[str], int]:
    """The SQL ``query`` ran on the store's connection and the SQLite VM steps it took (in 10s):
    a measure of the rows walked that no other load on the machine changes."""
    statements: list[str] = []
    steps = [0]

    def step() -> int:
        steps[0] += 1
        return 0

    store._db.set_trace_callback(statements.append)
    store._db.set_progress_handler(step, 10)
    try:
        query()
    finally:
        store._db.set_progress_handler(None, 0)
        store._db.set_trace_callback(None)
    return statements, steps[0]


def test_a_page_of_some_sessions_is_read_from_their_own_rows_not_every_owners(tmp_path: Path) -> None:
    """Hostile finding F8: a plain caller's QueryEvents/WatchEvents names its sessions and a common
    type (or tool); SQLite walked events_by_type over every owner's events of that type under the
    store's lock. Now the page comes from events_by_session (session_id, id): its plan starts with
    session_id, and its cost does not grow with other owners' events."""
    store = EventStore(str(tmp_path / "events.db"))
    store.append("mine", EventType.TOOL_STARTED, call_id="x", tool="shell.exec")
    mine = {"session_ids": ["mine"], "after_id": 0, "limit": 1000}
    shapes = [dict(mine, types=[EventType.TOOL_STARTED]), dict(mine, tool="shell.exec"), mine,
              dict(mine, types=[EventType.TOOL_STARTED, EventType.TOOL_COMPLETED], session_ids=["mine", "gone"])]

    def cost() -> list[int]:
        steps = []
        for shape in shapes:
            [sql], spent = _statements_and_steps(store, lambda: store.query(**shape))
            assert "INDEXED BY events_by_session" in sql, sql
            assert [e.call_id for e in store.query(**shape)] == ["x"], shape
            steps.append(spent)
        return steps

    few = cost()
    for index in range(5000):
        store.append(f"other-{index % 50}", EventType.TOOL_STARTED, call_id=f"c{index}", tool="shell.exec")
    many = cost()
    for shape in shapes:                                   # the plan of the statement the store runs
        sql, args = query_sql(**{"types": None, "tool": "", "since": None, "until": None, **shape})
        plan = " ".join(row[3] for row in store._db.execute("EXPLAIN QUERY PLAN " + sql, args).fetchall())
        assert plan.startswith("SEARCH events USING INDEX events_by_session (session_id=? AND id>?)"), (shape, plan)
    # Control: the same question without the index named is planned over events_by_type, and walks
    # the type's rows of every owner.
    unnamed = ("SELECT id FROM events WHERE id > 0 AND session_id IN (SELECT value FROM json_each('[\"mine\"]')) "
               "AND type IN ('ToolInvocationStarted') ORDER BY id LIMIT 1000")
    control = " ".join(row[3] for row in store._db.execute("EXPLAIN QUERY PLAN " + unnamed).fetchall())
    assert control.startswith("SEARCH events USING INDEX events_by_type"), control
    _, walked = _statements_and_steps(store, lambda: store._db.execute(unnamed).fetchall())
    assert walked > 100 * max(few), (walked, few)           # the control grows with the node's events
    assert all(after <= before + 2 for before, after in zip(few, many)), (few, many)
    store.close()


def test_a_caller_with_more_sessions_than_sqlite_takes_variables_is_answered(store: EventStore) -> None:
    store.append("s-39999", EventType.SESSION_CREATED)
    store.append("someone-else", EventType.SESSION_CREATED)
    named = [f"s-{n}" for n in range(40000)]
    assert [e.session_id for e in store.query(session_ids=named, types=[EventType.SESSION_CREATED] * 40000)] == \
        ["s-39999"]


def test_a_store_of_schema_8_gets_the_indexes_a_plain_callers_reads_use(tmp_path: Path) -> None:
    path = tmp_path / "events.db"
    EventStore(str(path)).close()
    db = sqlite3.connect(path)
    db.execute("DROP INDEX events_by_session")
    db.execute("DROP INDEX sessions_by_owner")
    db.execute("DELETE FROM schema_version WHERE version > 8")
    db.commit()
    db.close()
    EventStore(str(path)).close()
    db = sqlite3.connect(path)
    assert dict(db.execute("SELECT name, sql FROM sqlite_master WHERE name IN ('events_by_session', "
                           "'sessions_by_owner')").fetchall()) == {
        "events_by_session": "CREATE INDEX events_by_session ON events (session_id, id)",
        "sessions_by_owner": "CREATE INDEX sessions_by_owner ON sessions (owner_principal, owner_uid)"}
    db.close()


def test_a_plain_callers_sessions_are_found_by_owner_not_by_reading_every_owners_rows(tmp_path: Path) -> None:
    """QueryEvents/WatchEvents/ListSessions first list the sessions a plain caller may see
    (access.visible_ids): that read every session row of the node and decoded its JSON, on every
    call (1.3 s at 50,000 sessions). Now only the caller's rows, through sessions_by_owner; who
    sees what is still access.sees's to say (a pod's uid 0 every uid's of its pod, another uid
    only its own)."""
    from sandboxd.service.callers import session_owner
    from sandboxd.service.sessions.access import visible_ids

    store = EventStore(str(tmp_path / "events.db"))

    def add(session_id: str, uid: int, principal: str = "", closed: float | None = None) -> None:
        store.save_session(SessionRow(session_id, uid, uid, principal, "/ws", {"name": "read-only"}, "never", {}, {},
                                      {}, 1.0, closed))

    for name, uid, principal, closed in (("mine", 4242, "", None), ("mine-closed", 4242, "", 2.0),
                                         ("pod-root", 0, "pod:p1", None), ("pod-4242", 4242, "pod:p1", None),
                                         ("tls", 4242, "cn=alice", None)):
        add(name, uid, principal, closed)
    alice, pod_root, pod_alice = (session_owner(4242, 4242, ""), session_owner(0, 0, "pod:p1"),
                                  session_owner(4242, 4242, "pod:p1"))

    def found(caller: object) -> tuple[set[str], int]:
        statements, steps = _statements_and_steps(store, lambda: visible.append(visible_ids(store, caller)))
        [sql] = statements
        plan = " ".join(row[3] for row in store._db.execute("EXPLAIN QUERY PLAN " + sql).fetchall())
        assert plan.startswith("SEARCH sessions USING INDEX sessions_by_owner (owner_principal=?"), plan
        return set(visible.pop()), steps

    visible: list[object] = []
    few = [found(alice), found(pod_root), found(pod_alice)]
    assert [ids for ids, _ in few] == [{"mine", "mine-closed"}, {"pod-root", "pod-4242"}, {"pod-4242"}]
    for n in range(2000):
        add(f"other-{n}", 5000 + n % 7, "pod:p2" if n % 3 == 0 else "")
    many = [found(alice), found(pod_root), found(pod_alice)]
    assert [ids for ids, _ in many] == [ids for ids, _ in few]
    assert all(after <= before + 2 for (_, before), (_, after) in zip(few, many)), (few, many)
    assert visible_ids(store, session_owner(0, 0, "")) is None              # root: every owner's
    assert [row.id for row in store.sessions(include_closed=True, owner=("", 4242))] == ["mine", "mine-closed"]
    store.close()


def test_subscribers_see_every_event_after_their_start_once(store: EventStore) -> None:
    store.append("a", EventType.SESSION_CREATED)
    subscription = store.subscribe(lambda e: e.session_id == "a")
    writers = [threading.Thread(target=lambda: [store.append("a", EventType.TOOL_STARTED) for _ in range(50)])
               for _ in range(4)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join()
    live = []
    while (event := subscription.next(0.1)) is not None:
        live.append(event)
    past = [e for e in store.query(session_ids=["a"], limit=1000) if e.id <= subscription.high_water]
    combined = [e.sequence for e in past + live]
    assert combined == list(range(1, 202))                 # no gap, no duplicate, in order
    store.unsubscribe(subscription)


def test_session_rows_and_workspace_memory(store: EventStore) -> None:
    row = SessionRow("s1", 1000, 1000, "", "/ws", {"name": "read-only"}, "never", {"mode": "read_only"},
                     {"timeout_seconds": None}, {"k": "v"}, 1.0, None)
    store.save_session(row)
    assert store.session("s1") == row and store.sessions() == [row]
    store.save_session(row.replace(closed_at=2.0))
    assert store.sessions() == [] and store.sessions(include_closed=True)[0].closed_at == 2.0
    with pytest.raises(NotFound):
        store.session("nope")
    store.remember(PERMISSION_NAMESPACE, "/ws", "allow:fs.read", {"tool": "fs.read"}, owner_uid=1000)
    store.remember("other", "/ws", "allow:fs.read", {"tool": "fs.read"}, owner_uid=1000)
    assert store.has_memory(PERMISSION_NAMESPACE, "/ws", "allow:fs.read", owner_uid=1000)
    assert not store.has_memory(PERMISSION_NAMESPACE, "/ws", "allow:fs.read", owner_uid=1001)   # owners apart
    assert not store.has_memory(PERMISSION_NAMESPACE, "/ws", "allow:fs.read", owner_uid=1000, owner_principal="cn")
    assert [r.key for r in store.recall(PERMISSION_NAMESPACE)] == ["allow:fs.read"]
    assert store.recall(PERMISSION_NAMESPACE, owner_uid=1001) == []
    assert not store.forget(PERMISSION_NAMESPACE, "/ws", "allow:fs.read", owner_uid=1001)
    assert store.forget(PERMISSION_NAMESPACE, "/ws", "allow:fs.read", owner_uid=1000)
    assert not store.has_memory(PERMISSION_NAMESPACE, "/ws", "allow:fs.read", owner_uid=1000)
    assert store.has_memory("other", "/ws", "allow:fs.read", owner_uid=1000)    # namespaces are separate


def test_a_sessions_env_survives_a_reopen_and_older_rows_get_none(tmp_path: Path) -> None:
    """Migration 3: a session's own variables are kept with its row (a resumed session keeps them);
    a row written before the migration reads back with an empty env."""
    path = tmp_path / "events.db"
    db = sqlite3.connect(path)                             # a store as schema version 2 left it
    db.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
    for version, migration in enumerate(MIGRATIONS[:2], 1):
        db.executescript(migration)
        db.execute("INSERT INTO schema_version (version) VALUES (?)", (version,))
    db.execute("INSERT INTO sessions (id, owner_uid, owner_gid, workspace, sandbox_policy, approval_policy, limits, "
               "labels, created_at) VALUES ('old', 1000, 1000, '/ws', '{}', 'never', '{}', '{}', 1.0)")
    db.commit()
    db.close()
    store = EventStore(str(path))
    assert store.session("old").env == {}
    row = SessionRow("s1", 1000, 1000, "", "/ws", {"name": "read-only"}, "never", {}, {}, {}, 1.0, None,
                     env={"TOKEN": "kept", "EMPTY": ""})
    store.save_session(row)
    store.close()
    again = EventStore(str(path))
    assert again.session("s1").env == {"TOKEN": "kept", "EMPTY": ""}
    again.close()


# ---- checkpoints on their own thread (sandboxd.audit.checkpointer) ---------------------------------

def events_in_the_database_file(path: Path, copy: Path) -> int:
    """Events in the database file alone (a copy without its WAL): what a checkpoint has moved there."""
    shutil.copyfile(path, copy)
    db = sqlite3.connect(f"file:{copy}?immutable=1", uri=True)
    try:
        return int(db.execute("SELECT COUNT(*) FROM events").fetchone()[0])
    except sqlite3.DatabaseError:
        return -1                                          # copied in the middle of a checkpoint: look again
    finally:
        db.close()


def test_the_thread_syncs_soon_after_a_commit_checkpoints_every_so_many_and_sleeps_when_idle(
        tmp_path: Path) -> None:
    """One commit: synced by the thread (no checkpoint: the next commit would pay for the WAL's
    restart). CHECKPOINT_COMMITS commits: the thread checkpoints, so the events are in the database
    file itself, long before sqlite's own checkpoint (FALLBACK_PAGES of WAL) would have run. Then,
    with nothing committed, the thread stays asleep."""
    path = tmp_path / "events.db"
    store = EventStore(str(path))
    try:
        thread = store._checkpoints
        assert thread is not None
        store.append("s1", EventType.SESSION_CREATED)
        deadline = time.monotonic() + 30 * SLOW
        while thread.syncs < 1:
            assert time.monotonic() < deadline, "the commit was never synced"
            time.sleep(0.05)
        assert thread.checkpoints == 0
        for n in range(checkpointer.CHECKPOINT_COMMITS):
            store.append_many("s1", [(EventType.TOOL_STARTED, f"c{n}", "shell.exec", {}),
                                     (EventType.TOOL_COMPLETED, f"c{n}", "shell.exec", {})])
        wanted = 1 + 2 * checkpointer.CHECKPOINT_COMMITS
        copy = tmp_path / "copy.db"
        while events_in_the_database_file(path, copy) != wanted:
            assert time.monotonic() < deadline, "the commits never reached the database file"
            time.sleep(0.05)
        while thread.checkpoints < 1:       # counted when the checkpoint returns: after the file has the pages
            assert time.monotonic() < deadline, "the checkpoint was never counted"
            time.sleep(0.05)
        assert thread.checkpoints == 1
        syncs = thread.syncs
        time.sleep(3 * checkpointer.DELAY)
        assert thread.syncs == syncs                               # idle: no sync, no wake-up
    finally:
        store.close()


def test_closing_the_store_ends_its_checkpoint_thread(tmp_path: Path) -> None:
    before = {t.ident for t in threading.enumerate() if t.name == "sandboxd-wal-checkpoint"}
    store = EventStore(str(tmp_path / "events.db"))
    mine = [t for t in threading.enumerate() if t.name == "sandboxd-wal-checkpoint" and t.ident not in before]
    assert len(mine) == 1
    store.append("s1", EventType.SESSION_CREATED)
    store.close()
    assert not mine[0].is_alive()
    memory = EventStore(":memory:")                        # no WAL, no thread
    assert memory._checkpoints is None
    memory.close()
