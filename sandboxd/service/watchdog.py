"""The daemon's watchdog on its fork server: a server that stops answering is replaced.

The fork server's loop never waits on a caller's path (supervisor.waits), so a fork server that
does not answer a ping within ``timeout`` seconds is stuck for a reason nobody foresaw (a kernel
bug, a stop signal, a blocking call missed). Every session would hang behind it, with health
still SERVING. The watchdog pings it every third of ``timeout``; on a missed answer (and no other
answer within ``timeout`` either: under load a ping may queue behind many requests) it says
NOT_SERVING (``on_hang``), logs why, and SIGKILLs the server; the daemon's main loop sees the
death and runs the restart it runs for a crash (a new fork server, sessions resumed on their
next call, SERVING again).

A fork server that has not answered anything since it was started is starting, not hung: a fresh
interpreter, its imports, the helper check. It gets ``START_SECONDS`` (or ``timeout``, if longer)
from its start before a missed ping counts. Its start-up no longer waits on anything a caller
made: what a predecessor left (stale cgroups, however stuck) is handed to its loop's first turn,
which never waits either; so a replacement is never taken for a hung one and killed, which used
to end the daemon ("cannot restart the fork server").
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import TYPE_CHECKING

from sandboxd.errors import SetupError

if TYPE_CHECKING:
    from collections.abc import Callable

    from sandboxd.supervisor.fork_client import ForkServer

log = logging.getLogger("sandboxd")

# How long a fork server may take from its start to its first answer (an interpreter starting on a
# loaded machine takes seconds; nothing in the start-up waits on a caller).
START_SECONDS = 60.0


class Watchdog:
    """Pings ``fork`` from a thread of its own until ``stop``."""

    def __init__(self, fork: "ForkServer", timeout: float, on_hang: "Callable[[], object]") -> None:
        self._fork, self.timeout, self._on_hang = fork, timeout, on_hang
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sandboxd-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stopping.wait(self.timeout / 3):
            self.check()

    def check(self) -> bool:
        """Ping once; False (and the server killed) if it did not answer in time."""
        pid = self._fork.pid
        try:
            if self._fork.ping(self.timeout):
                return True
        except SetupError:
            return True          # it has exited (or is being replaced): the main loop restarts it
        if self._stopping.is_set() or pid != self._fork.pid:
            return True          # replaced meanwhile: the new one gets the next ping
        now = time.monotonic()
        if now - self._fork.last_heard < self.timeout:
            return True          # a long queue of requests ahead of the ping, but answering: alive
        if not self._fork.answered and now - self._fork.started_at < max(self.timeout, START_SECONDS):
            return True          # not answered anything yet since its start: starting, not hung
        self._on_hang()
        log.error("fork server did not answer a ping: killing it, to be replaced like a crashed one "
                  "(every sandbox dies with it; sessions resume on their next call)",
                  extra={"fields": {"fork_server_pid": pid, "ping_timeout_seconds": self.timeout}})
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return False
