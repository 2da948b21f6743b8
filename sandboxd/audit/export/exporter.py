"""The exporter: a thread of the daemon that walks the event store from its cursor and sends each
batch to the configured sink as OCSF records, at least once.

Off every call's path: it reads on a read-only SQLite connection of its own (WAL: readers never
block the writer, and it never takes the store's lock), and nothing a call does waits for it.
What it holds is one batch (``audit.export.batch`` events, each at most ``audit.event_bytes``):
a sink that fails or hangs is retried with back-off from 1 s up to BACKOFF_MAX, the batch read
again from the store by cursor, so memory does not grow with the backlog; the backlog is the
store itself. The cursor moves only after the sink acknowledged a batch (sandboxd.audit.export.cursor).
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
import time
import urllib.parse
from typing import Callable

from sandboxd.audit.export import ocsf
from sandboxd.audit.export.cursor import Cursor
from sandboxd.audit.export.sinks import FileSink, OtlpSink, Sink, StdoutSink
from sandboxd.audit.store import Event, read_events_after
from sandboxd.policy.audit_export import AuditExport

log = logging.getLogger("sandboxd.audit.export")

# An idle exporter sleeps until the store says an event was committed (``noticed``), and looks on
# its own only this often (a store written by another process, a missed wake-up).
IDLE_POLL_SECONDS = 5.0
# After a wake-up it waits this long before reading, so events committed together (a call's three,
# a busy node's many) go in one batch and one sync, not one each.
COALESCE_SECONDS = 0.1
BACKOFF_FIRST = 1.0
BACKOFF_MAX = 60.0


def make_sink(settings: AuditExport) -> Sink:
    if settings.sink == "stdout":
        return StdoutSink()
    if settings.sink == "file":
        return FileSink(settings.path, settings.max_bytes, settings.keep)
    return OtlpSink(settings.endpoint)


def cursor_path(state_dir: str, sink: str) -> str:
    """One cursor per sink kind, beside the event store: a new sink starts from the first event."""
    return os.path.join(state_dir, f"audit-export-{sink}.cursor")


class EventReader:
    """Batches of events after a cursor, with their sessions' owners, on a connection of its own."""

    def __init__(self, db_path: str) -> None:
        # Read-only, and never inside a transaction between batches (each SELECT ends with its
        # fetch), so the export holds back no WAL checkpoint while its sink is slow.
        self._db = sqlite3.connect(f"file:{urllib.parse.quote(db_path)}?mode=ro", uri=True, check_same_thread=False)
        self._owners: dict[str, ocsf.Owner | None] = {}

    def batch(self, cursor: int, limit: int) -> list[tuple[ocsf.Owner | None, Event]]:
        events = read_events_after(self._db, cursor, limit)
        unknown = sorted({e.session_id for e in events} - self._owners.keys())
        if unknown:
            rows = self._db.execute(f"SELECT id, owner_uid, owner_principal FROM sessions WHERE id IN "
                                    f"({','.join('?' * len(unknown))})", unknown).fetchall()
            found = {r[0]: ocsf.Owner(r[1], r[2]) for r in rows}
            for session_id in unknown:
                self._owners[session_id] = found.get(session_id)
        if len(self._owners) > 4 * limit:              # a cache for this batch's neighbours, not a history
            self._owners = {e.session_id: self._owners[e.session_id] for e in events}
        return [(self._owners[e.session_id], e) for e in events]

    def close(self) -> None:
        self._db.close()


class Exporter:
    """Started with the daemon when ``audit.export.sink`` is not "none"; ``stop`` sends what is left
    (up to a deadline) and ends it."""

    def __init__(self, db_path: str, state_dir: str, settings: AuditExport, *,
                 sink: Sink | None = None, on_exported: Callable[[int], None] | None = None,
                 on_failure: Callable[[], None] | None = None) -> None:
        self.settings = settings
        self._db_path = db_path
        self.cursor = Cursor(cursor_path(state_dir, settings.sink))
        self._sink = sink or make_sink(settings)
        self._on_exported, self._on_failure = on_exported, on_failure
        self._new = threading.Event()               # an event was committed
        self._stop_wake = threading.Event()         # stop was asked: cuts a back-off or a coalescing wait
        self._stopping = False
        self._drain_until = 0.0
        self._thread = threading.Thread(target=self._run, name="sandboxd-export", daemon=True)
        self.exported = 0
        self.failures = 0

    def start(self) -> None:
        self._thread.start()

    def noticed(self, _event: Event) -> bool:
        """The store's subscriber callback (EventStore.subscribe): an event was committed. Wakes the
        exporter and keeps nothing (False: the subscription's queue stays empty)."""
        self._new.set()
        return False

    def stop(self, drain_seconds: float = 2.0) -> None:
        """Send what the store holds for up to ``drain_seconds``, then stop. The cursor says how far
        it got; the next daemon carries on from there."""
        self._drain_until = time.monotonic() + drain_seconds
        self._stopping = True
        self._stop_wake.set()
        self._new.set()
        self._thread.join(drain_seconds + 1.0)
        if not self._thread.is_alive():
            self._sink.close()

    def _run(self) -> None:
        reader: EventReader | None = None
        backoff = BACKOFF_FIRST
        while True:
            try:
                if reader is None:
                    reader = EventReader(self._db_path)
                sent = self._one_batch(reader)
                backoff = BACKOFF_FIRST
            except Exception as exc:  # noqa: BLE001 - a sink's or the store's failure: retried, never fatal
                self.failures += 1
                if self._on_failure is not None:
                    self._on_failure()
                log.warning("audit export failed; retrying from the cursor",
                            extra={"fields": {"sink": self.settings.sink, "cursor": self.cursor.last_id,
                                              "retry_seconds": backoff, "problem": f"{type(exc).__name__}: {exc}"}})
                if reader is not None and isinstance(exc, sqlite3.Error):
                    reader.close()
                    reader = None
                if self._stopping:
                    break
                self._stop_wake.wait(backoff)           # new events do not cut it short
                backoff = min(backoff * 2, BACKOFF_MAX)
                continue
            if self._stopping and (sent == 0 or time.monotonic() >= self._drain_until):
                break
            if sent < self.settings.batch and not self._stopping:
                if self._new.wait(IDLE_POLL_SECONDS):
                    self._stop_wake.wait(COALESCE_SECONDS)
                self._new.clear()
        if reader is not None:
            reader.close()

    def _one_batch(self, reader: EventReader) -> int:
        batch = reader.batch(self.cursor.last_id, self.settings.batch)
        if not batch:
            return 0
        records = []
        for owner, event in batch:
            record = ocsf.record_or_fallback(event, owner)
            records.append((record, ocsf.encode(record)))
        self._sink.send(records)
        self.cursor.store(batch[-1][1].id)
        self.exported += len(batch)
        if self._on_exported is not None:
            self._on_exported(len(batch))
        return len(batch)
