"""WatchEvents' filter (sandboxd.service.watch_filter), which EventStore runs inside every append
under its lock for every watcher: O(1) per event, no SQL of its own (hostile finding F12)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterator

import pytest

from sandboxd.audit.store import Event, EventStore, EventType, SessionRow
from sandboxd.errors import NotFound
from sandboxd.service.callers import session_owner
from sandboxd.service.watch_filter import WatchFilter

ALICE, BOB = 4242, 4343
OWNED_BEFORE = 20000                    # sessions Alice owned over time (closed ones count too)


def _row(session_id: str, uid: int) -> SessionRow:
    return SessionRow(session_id, uid, uid, "", "/ws", {"name": "read-only"}, "never", {}, {}, {}, 1.0, None)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[EventStore]:
    s = EventStore(str(tmp_path / "events.db"))
    s.save_session(_row("bobs", BOB))
    yield s
    s.close()


def _statements_of(store: EventStore, action: Callable[[], object]) -> list[str]:
    """The SQL run on the store's connection while ``action`` runs (appends hold the lock throughout)."""
    statements: list[str] = []
    store._db.set_trace_callback(statements.append)
    try:
        action()
    finally:
        store._db.set_trace_callback(None)
    return statements


def _alices_filter(store: EventStore) -> WatchFilter:
    """As AuditService.watch builds it for Alice watching every session she may see."""
    return WatchFilter(store, session_owner(ALICE, ALICE, ""), [f"alice-{n}" for n in range(OWNED_BEFORE)])


def test_other_owners_appends_run_no_sql_for_a_watcher_and_its_sessions_are_a_set(store: EventStore) -> None:
    filters = [_alices_filter(store) for _ in range(4)]          # quotas.streams_per_uid's default
    assert all(isinstance(f.visible, frozenset) and len(f.visible) == OWNED_BEFORE for f in filters)
    store.append("bobs", EventType.SESSION_CREATED)               # its owner cached, as in a daemon
    alone = _statements_of(store, lambda: store.append("bobs", EventType.TOOL_STARTED, tool="shell.exec"))
    subscriptions = [store.subscribe(f) for f in filters]
    watched = _statements_of(store, lambda: store.append("bobs", EventType.TOOL_STARTED, tool="shell.exec"))
    assert [s.split()[0] for s in watched] == [s.split()[0] for s in alone]
    assert not any("sessions" in statement for statement in watched), watched
    assert all(s.next(0) is None for s in subscriptions)          # Bob's events reach none of Alice's watchers

    # Control: the filter as it was (a list, and another owner's session looked up) runs SQL in the
    # append, once per watcher and event.
    def old_wants(event: Event, visible: list[str] = [f"alice-{n}" for n in range(OWNED_BEFORE)]) -> bool:
        if event.session_id not in visible:
            try:
                store.session(event.session_id)
            except NotFound:
                return False
            return False
        return True

    for subscription in subscriptions:
        store.unsubscribe(subscription)
    olds = [store.subscribe(old_wants) for _ in range(4)]
    looked_up = _statements_of(store, lambda: store.append("bobs", EventType.TOOL_STARTED, tool="shell.exec"))
    assert sum("FROM sessions" in statement for statement in looked_up) == 4, looked_up
    for subscription in olds:
        store.unsubscribe(subscription)


def test_a_session_made_after_the_watch_began_is_followed_to_its_close(store: EventStore) -> None:
    subscription = store.subscribe(_alices_filter(store))
    store.save_session(_row("alice-new", ALICE))
    for session in ("alice-new", "bobs"):
        store.append(session, EventType.SESSION_CREATED)
        store.append(session, EventType.SESSION_CLOSED)
    store.append("alice-0", EventType.TOOL_STARTED)               # one she owned before
    store.append("no-row", EventType.TOOL_STARTED)                # a session the store has no row of
    seen = []
    while (event := subscription.next(0)) is not None:
        seen.append((event.session_id, event.type))
    assert seen == [("alice-new", EventType.SESSION_CREATED), ("alice-new", EventType.SESSION_CLOSED),
                    ("alice-0", EventType.TOOL_STARTED)]
    store.unsubscribe(subscription)


def test_types_ids_and_a_single_session_filter_as_before(store: EventStore) -> None:
    alice = session_owner(ALICE, ALICE, "")
    store.save_session(_row("alice-0", ALICE))
    first = store.append("alice-0", EventType.SESSION_CREATED)
    second = store.append("alice-0", EventType.TOOL_STARTED)
    assert not WatchFilter(store, alice, ["alice-0"], types={EventType.TOOL_STARTED})(first)
    assert WatchFilter(store, alice, ["alice-0"], types={EventType.TOOL_STARTED})(second)
    assert not WatchFilter(store, alice, ["alice-0"], after_id=second.id)(second)
    assert WatchFilter(store, alice, ["alice-0"], single="alice-0", from_sequence=1)(second)
    assert not WatchFilter(store, alice, ["alice-0"], single="alice-0", from_sequence=2)(second)
    assert WatchFilter(store, session_owner(0, 0, ""), None)(store.append("bobs", EventType.SESSION_CREATED))
