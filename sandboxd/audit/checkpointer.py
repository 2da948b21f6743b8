"""The event store's WAL checkpoints, on a thread of their own instead of inside a call.

In WAL mode a commit appends its pages to the WAL; at ``synchronous=NORMAL`` it does not wait for
the disk. The disk waits (fdatasync of the WAL, then of the database) come at a checkpoint, which
sqlite runs by default inside whichever commit takes the WAL past 1,000 pages. For the daemon that
was one Exec in about twenty: it held the store's lock through two fdatasyncs (milliseconds on a
busy disk), and every other call's appends queued behind it.

Here a thread checkpoints ``DELAY`` seconds after the first commit it has not checkpointed yet,
through a connection of its own, in PASSIVE mode (it never blocks a writer, and a writer never
waits for it). A commit is then exactly as durable as before when it returns: in the WAL, so it
survives a crash of the daemon; on disk once the next checkpoint has synced the WAL, which is now
at most ``DELAY`` seconds plus one checkpoint later (before: at the next 1,000th page, with no bound
in time). With nothing committed, the thread sleeps without a timeout: an idle daemon never wakes
for it. If the thread falls behind (a stalled disk), sqlite's own checkpoint in the writer still
runs, past ``FALLBACK_PAGES`` of WAL, so the WAL stays bounded.
"""

from __future__ import annotations

import logging
import sqlite3
import threading

log = logging.getLogger("sandboxd.audit")

DELAY = 0.5                 # seconds from the first unsynced commit to its checkpoint (the power-loss window)
FALLBACK_PAGES = 10000      # the writer checkpoints itself past this many WAL pages (40 MiB of 4 KiB pages)
STOP_WITHIN = 10.0          # seconds close() waits for a checkpoint in progress


class Checkpointer:
    def __init__(self, path: str, synchronous: str) -> None:
        """``path``: a WAL-mode database that exists; ``synchronous``: its connections' level."""
        self._path, self._synchronous = path, synchronous
        self._wanted = threading.Event()          # a commit since the last checkpoint began
        self._stopping = threading.Event()
        self.checkpoints = 0                      # how many ran (for tests and the benchmark)
        self._thread = threading.Thread(target=self._loop, name="sandboxd-wal-checkpoint", daemon=True)
        self._thread.start()

    def committed(self) -> None:
        """Call after each commit: it is synced within DELAY seconds."""
        if not self._wanted.is_set():             # the common case after the first commit: one load, no lock
            self._wanted.set()

    def stop(self) -> None:
        """Checkpoint what is pending and end the thread."""
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
                self._wanted.clear()              # before the checkpoint: a commit during it asks for another
                try:
                    db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
                    self.checkpoints += 1
                except sqlite3.Error as error:     # a full or failing disk: the writer's fallback still runs
                    log.warning("event store checkpoint failed", extra={"fields": {"error": str(error)}})
                if self._stopping.is_set():
                    return
        finally:
            db.close()
