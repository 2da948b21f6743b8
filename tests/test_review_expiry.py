"""review.keep_days (service.review_expiry): a closed review session's kept change set older than
keep_days is removed by the daemon's sweep, its store unmounted, with an audit event; one closed
more recently, an open session's and any with keep_days 0 stay (the controls). The sweep is given
its clock, so nothing waits days; the stores are real tmpfs mounts (root)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandboxd.audit.store import EventStore, EventType, SessionRow
from sandboxd.kernel import overlay, review_space
from sandboxd.service.review_expiry import DAY, ChangeSetExpiry

NOW = 1_800_000_000.0


@pytest.fixture
def state(tmp_path: Path) -> Iterator[tuple[EventStore, Path]]:
    os.chmod(tmp_path, 0o700)
    store = EventStore(str(tmp_path / "events.db"))
    review = tmp_path / "review"
    review.mkdir(mode=0o700)
    try:
        yield store, review
    finally:
        store.close()
        for path in review.iterdir():
            overlay.remove_layers(str(path))


def kept(store: EventStore, review: Path, session: str, closed_at: float | None) -> str:
    """A review session's row and its bounded store holding one change."""
    store.save_session(SessionRow(session, 1000, 1000, "", "/ws", {}, "never", {}, {}, {}, 0.0, closed_at,
                                  review=True))
    path = str(review / session)
    review_space.make_store(path, session_bytes=4 << 20, owner_bytes=16 << 20, owner_total=0)
    os.makedirs(f"{path}/0/upper")
    Path(f"{path}/0/upper/added.txt").write_text("x\n")
    overlay.write_aside(path, overlay.LAYERS_FILE, b"[]", reserve=True)
    return path


def test_the_sweep_removes_change_sets_older_than_keep_days_with_an_event(state: tuple[EventStore, Path]) -> None:
    store, review = state
    old = kept(store, review, "old", NOW - 3 * DAY)
    recent = kept(store, review, "recent", NOW - 1 * DAY)
    still_open = kept(store, review, "open", None)
    expiry = ChangeSetExpiry(store, lambda session: str(review / session), 2)
    assert expiry.sweep(NOW) == ["old"]
    assert not os.path.lexists(old) and old not in Path("/proc/self/mountinfo").read_text()
    assert review_space.is_store(recent) and review_space.is_store(still_open)      # controls
    events = store.query(session_ids=["old"], types=[EventType.CHANGES_DISCARDED])
    assert len(events) == 1 and events[0].data["by"] == "review.keep_days", events
    # A fraction of a day is taken as it is: the recent one goes under a keep_days of half a day.
    assert ChangeSetExpiry(store, lambda session: str(review / session), 0.5).sweep(NOW) == ["recent"]


def test_keep_days_zero_keeps_change_sets_for_good(state: tuple[EventStore, Path]) -> None:
    store, review = state
    path = kept(store, review, "ancient", NOW - 1000 * DAY)
    assert ChangeSetExpiry(store, lambda session: str(review / session), 0).sweep(NOW) == []
    assert review_space.is_store(path)


def test_a_closed_sessions_directory_a_removal_left_without_its_record_is_swept(
        state: tuple[EventStore, Path]) -> None:
    """A removal (apply or discard of everything, an expiry) cut short after the record went: the
    store, still mounted, would count against its owner for good. Swept whatever keep_days."""
    store, review = state
    cut = kept(store, review, "cut", NOW - 1 * DAY)
    os.unlink(f"{cut}/{overlay.LAYERS_FILE}")                       # as remove_layers does first
    intact = kept(store, review, "intact", NOW - 1 * DAY)
    still_open = kept(store, review, "open-cut", None)
    os.unlink(f"{still_open}/{overlay.LAYERS_FILE}")                # open: its build may be writing it
    assert ChangeSetExpiry(store, lambda session: str(review / session), 0).sweep(NOW) == ["cut"]
    assert not os.path.lexists(cut) and cut not in Path("/proc/self/mountinfo").read_text()
    assert review_space.is_store(intact) and review_space.is_store(still_open)     # controls
