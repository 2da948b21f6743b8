"""Which appended events one WatchEvents caller receives.

EventStore runs every watcher's filter inside every append, under the store's lock, for every
owner's events: each watcher's cost is paid by every tenant's writes. So a filter is O(1) per
event and runs no SQL of its own (hostile finding F12): the sessions the caller could see when it
began are a frozenset (a plain caller's are every session it ever owned, closed ones included),
and an event of a session not among them (one made after the watch began, or someone else's)
is judged by its owner, which the append has just looked up (``EventStore.owner_of``, cached).
"""

from __future__ import annotations

from typing import AbstractSet, Iterable

from sandboxd.audit.store import Event, EventStore
from sandboxd.service.callers import Caller
from sandboxd.service.sessions.access import sees


class WatchFilter:
    """``visible``: the sessions the caller may read (None: all, an administrator's); ``single``:
    the one session watched (then ``from_sequence`` is its sequence), else ``from_sequence`` is an
    event id, as WatchEventsRequest says."""

    def __init__(self, store: EventStore, who: Caller, visible: Iterable[str] | None, *,
                 types: AbstractSet[str] = frozenset(), after_id: int = 0, single: str | None = None,
                 from_sequence: int = 0) -> None:
        self._store = store
        self._who = who
        self.visible: frozenset[str] | None = None if visible is None else frozenset(visible)
        self._types = frozenset(types)
        self._after_id = after_id
        self._single = single
        self._from_sequence = from_sequence

    def __call__(self, event: Event) -> bool:
        if (self._types and event.type not in self._types) or event.id <= self._after_id:
            return False
        if self._single is not None:
            return event.session_id == self._single and event.sequence > self._from_sequence
        if self.visible is not None and event.session_id not in self.visible and not self._owned_now(event):
            return False
        return event.id > self._from_sequence

    def _owned_now(self, event: Event) -> bool:
        """A session created after the watch began may be the caller's too."""
        owner = self._store.owner_of(event.session_id)
        return owner is not None and sees(self._who, owner.uid, owner.principal)
