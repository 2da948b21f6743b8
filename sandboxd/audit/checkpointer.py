"""The event store's disk syncs and WAL checkpoints, on a thread of their own instead of in a call.

In WAL mode a commit appends its pages to the WAL; at ``synchronous=NORMAL`` it does not wait for
the disk. The disk waits (fdatasync of the WAL, then of the database, then of the WAL's new header
when the next commit starts it over) come with a checkpoint, which sqlite runs by default inside
whichever commit takes the WAL past 1,000 pages: about one Exec in 40-70 held the store's lock
through three fdatasyncs and the copy, and every other call's appends queued behind it. Until that
checkpoint nothing was synced, so a power loss could take every commit since the last one, with no
bound in time.

Here a thread wakes ``DELAY`` seconds after the first commit it has not synced and fdatasyncs the
WAL: a commit is exactly as durable as before when it returns (in the WAL: it survives a crash of
the daemon), and on disk at most ``DELAY`` seconds plus one fdatasync later. Every
``CHECKPOINT_COMMITS`` commits the thread also checkpoints, through a connection of its own, in
PASSIVE mode (it never blocks a writer, and a writer never waits for it). A checkpoint that
completes lets the next commit start the WAL over, which costs that commit one fdatasync of the
header, so it is not done after every sync: sparse calls would pay it each time. Under steady
load a PASSIVE checkpoint may never catch up with the writers; sqlite's own checkpoint in the
writer then still runs past ``FALLBACK_PAGES`` of WAL (ten times rarer than before), so the WAL
stays bounded. With nothing committed the thread sleeps without a timeout: an idle daemon never
wakes for it.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading

log = logging.getLogger("sandboxd.audit")

DELAY = 0.5                 # seconds from the first unsynced commit to its sync (the power-loss window)
CHECKPOINT_COMMITS = 100    # commits between checkpoints (about 700 WAL pages of Exec events)
FALLBACK_PAGES = 10000      # the writer checkpoints itself past this many WAL pages (40 MiB of 4 KiB pages)
STOP_WITHIN = 10.0          # seconds close() waits for a checkpoint in progress


class Checkpointer:
    def __init__(self, path: str, synchronous: str) -> None:
        """``path``: a WAL-mode database that exists; ``synchronous``: its connections' level."""
        self._path, self._synchronous = path, synchronous
        self._wanted = threading.Event()          # a commit since the last sync began
        self._stopping = threading.Event()
        self._commits = 0                         # since the last checkpoint (a lost increment costs nothing)
        self.syncs = self.checkpoints = 0         # how many ran (for tests and the benchmark)
        self._thread = threading.Thread(target=self._loop, name="sandboxd-wal-checkpoint", daemon=True)
        self._thread.start()

    def committed(self) -> None:
        """Call after each commit: it is on disk within DELAY seconds."""
        self._commits += 1
        if not self._wanted.is_set():             # the common case after the first commit: one load, no lock
            self._wanted.set()

    def stop(self) -> None:
        """Sync what is pending and end the thread (closing the store checkpoints the rest)."""
        self._stopping.set()
        self._wanted.set()
        self._thread.join(STOP_WITHIN)

    def _loop(self) -> None:
        db = sqlite3.connect(self._path, check_same_thread=False, isolation_level=None)
        try:
            db.execute(f"PRAGMA synchronous={self._synchronous}")
            while True:
                self._wanted.wait()
                self._stopping.wait(DELAY)        # gather the commits of the next DELAY seconds into one sync
                self._wanted.clear()              # before the sync: a commit during it asks for another
                try:
                    if self._commits >= CHECKPOINT_COMMITS:
                        self._commits = 0
                        db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()   # syncs the WAL first
                        self.checkpoints += 1
                    else:
                        self._sync_wal()
                    self.syncs += 1
                except (sqlite3.Error, OSError) as error:   # a full or failing disk: the writer's fallback still runs
                    log.warning("event store sync failed", extra={"fields": {"error": str(error)}})
                if self._stopping.is_set():
                    return
        finally:
            db.close()

    def _sync_wal(self) -> None:
        try:
            fd = os.open(self._path + "-wal", os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return                                # no WAL (nothing written since the last close)
        try:
            os.fdatasync(fd)
        finally:
            os.close(fd)
