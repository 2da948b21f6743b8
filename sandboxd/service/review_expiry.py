"""review.keep_days: a closed review session's kept change set is removed once it is older than
that (its session's closed_at, in the event store's records: what a restarted daemon knows too),
with an audit event (EventType.CHANGES_DISCARDED, ``by``: review.keep_days). A thread of the
daemon's own sweeps at its start and then every SWEEP_SECONDS (less for a keep_days under a day's
quarter), never the fork server's loop: removing a tree and unmounting its store take as long as
the tree is big. A closed session's sandbox is gone, so nothing writes there meanwhile.

Whatever keep_days (0 too), the sweep also removes a closed session's review directory that has
no record of its layers: a removal (an apply or discard of everything, an expiry) cut short
after kernel.overlay.remove_layers took the record first. Nothing lists or applies it any more,
but its store would count against its owner's review.owner_bytes and review.owner_stores for good.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

from sandboxd.audit.store import EventStore, EventType
from sandboxd.kernel import overlay

log = logging.getLogger("sandboxd")

DAY = 86400.0
SWEEP_SECONDS = 3600.0
MIN_SWEEP_SECONDS = 1.0


class ChangeSetExpiry:
    """Removes kept change sets older than ``keep_days`` (0: none ever) from a thread of its own
    (``start``, ``stop``), or once (``sweep``). ``review_dir_of(id)``: where session ``id``'s is."""

    def __init__(self, store: EventStore, review_dir_of: Callable[[str], str], keep_days: float) -> None:
        self._store, self._review_dir_of, self.keep_days = store, review_dir_of, keep_days
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sandboxd-review-expiry", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        interval = max(MIN_SWEEP_SECONDS, min(SWEEP_SECONDS, self.keep_days * DAY / 4)) if self.keep_days \
            else SWEEP_SECONDS
        while True:
            try:
                self.sweep()
            except Exception:  # noqa: BLE001 - the store or a directory gone odd: the next sweep tries again
                log.exception("sweeping expired review change sets failed")
            if self._stopping.wait(interval):
                return

    def sweep(self, now: float | None = None) -> list[str]:
        """Remove every kept change set of a session closed more than keep_days before ``now``
        (default: the time), and every closed session's directory a removal left without its
        record; the ids of those removed."""
        now = time.time() if now is None else now
        removed = []
        for row in self._store.sessions(include_closed=True):
            if not row.review or row.closed_at is None:
                continue
            path = self._review_dir_of(row.id)
            if not os.path.lexists(path):
                continue
            if not os.path.lexists(os.path.join(path, overlay.LAYERS_FILE)):
                log.warning("session %s: removing what a cut-short removal left of its change set", row.id)
                overlay.remove_layers(path)
                removed.append(row.id)
                continue
            if not self.keep_days or now - row.closed_at < self.keep_days * DAY:
                continue
            overlay.remove_layers(path)
            removed.append(row.id)
            self._store.append(row.id, EventType.CHANGES_DISCARDED, data={
                "by": "review.keep_days", "summary": f"expired: closed {(now - row.closed_at) / DAY:.1f} days ago, "
                f"review.keep_days is {self.keep_days:g}", "paths": ["(all)"]})
        return removed
