"""Calls' outcomes by call id, for a client whose stream broke or a daemon that restarted (WaitCall,
`sandboxctl call result`).

A running call (Exec, Run; track adopt's adopted calls too) is ``started`` here, its output's last
TAIL_BYTES per stream kept as it passes (``output``), and its end recorded (``finished``): the
result is then written to the event store's ``call_results`` table (audit.store keeps a day's,
CALL_RESULTS_PER_OWNER per owner), where ``wait`` finds it after a restart. In memory only the
running calls are held: bounded by the callers' running-call quotas already, and here again by
RUNNING_PER_OWNER and RUNNING_TOTAL (a call past them runs, untracked: WaitCall says NOT_FOUND).

``wait`` on a running call sleeps on one condition for all calls, up to MAX_WAIT_SECONDS: its RPC
holds one of its caller's running-call slots meanwhile (quotas), so waiters cost no more threads
than an owner's calls may hold.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Callable

from sandboxd._record import Record

if TYPE_CHECKING:
    from sandboxd.audit.store import EventStore
    from sandboxd.supervisor.spawner import ExitInfo

log = logging.getLogger("sandboxd")

TAIL_BYTES = 64 << 10
MAX_WAIT_SECONDS = 300.0
RUNNING_PER_OWNER = 256
RUNNING_TOTAL = 2048
WANTED_SECONDS = 1.0

RUNNING = "running"
FINISHED = "finished"

# Why the daemon ended a call (CallResult.reason); empty when it ended by itself or its own timeout.
CLIENT_GONE = "client_gone"
DRAIN_TIMEOUT = "drain_timeout"
DAEMON_STOPPED = "daemon_stopped"


class CallResult(Record):
    """A call's outcome as WaitCall answers it: RUNNING (the tails so far) or FINISHED."""
    call_id: str
    session_id: str
    owner: str
    state: str
    exit_code: int = 0
    signal: int = 0
    timed_out: bool = False
    shell_status: int = 0
    reason: str = ""
    stdout_tail: bytes = b""
    stderr_tail: bytes = b""
    finished_at: float = 0.0


class _Running:
    __slots__ = ("session_id", "owner", "tails", "reason")

    def __init__(self, session_id: str, owner: str) -> None:
        self.session_id, self.owner = session_id, owner
        self.tails = {1: bytearray(), 2: bytearray()}
        self.reason = ""                          # set by the daemon before it ends the call itself


class CallResults:
    """Per daemon; thread-safe. ``store`` None: finished results are not kept (unit tests)."""

    def __init__(self, store: "EventStore | None") -> None:
        self._store = store
        self._cond = threading.Condition()
        self._running: dict[str, _Running] = {}
        self._by_owner: dict[str, int] = {}
        # Results finished since the store closed (the daemon stopping): none is lost to a waiter
        # still answering; bounded like the running ones, as each was one.
        self._unsaved: dict[str, CallResult] = {}

    def started(self, call_id: str, session: str, owner: str) -> None:
        with self._cond:
            if call_id in self._running:
                return
            if len(self._running) >= RUNNING_TOTAL or self._by_owner.get(owner, 0) >= RUNNING_PER_OWNER:
                log.warning("call %s is not tracked for WaitCall: %d calls are (%s: %d)", call_id,
                            len(self._running), owner, self._by_owner.get(owner, 0))
                return
            self._running[call_id] = _Running(session, owner)
            self._by_owner[owner] = self._by_owner.get(owner, 0) + 1

    def output(self, call_id: str, stream: int, data: bytes) -> None:
        """``data`` passed on ``stream`` (1 stdout, 2 stderr): its last TAIL_BYTES are kept."""
        with self._cond:
            entry = self._running.get(call_id)
            if entry is None or stream not in entry.tails:
                return
            tail = entry.tails[stream]
            if len(data) >= TAIL_BYTES:
                tail[:] = data[-TAIL_BYTES:]
            else:
                tail += data
                if len(tail) > 2 * TAIL_BYTES:       # trimmed in bulk: O(1) amortized per byte
                    del tail[:-TAIL_BYTES]

    def end_reason(self, call_id: str, reason: str) -> bool:
        """The daemon is about to end this running call itself, for ``reason``: its result says so.
        False when it had a reason already, or runs no more."""
        with self._cond:
            entry = self._running.get(call_id)
            if entry is None or entry.reason:
                return False
            entry.reason = reason
            return True

    def running(self) -> list[tuple[str, str]]:
        """(call_id, session_id) of every running call tracked."""
        with self._cond:
            return [(call_id, entry.session_id) for call_id, entry in self._running.items()]

    def finished(self, call_id: str, exit_code: int | None, signal: int | None, timed_out: bool, reason: str = "",
                 shell_status: int | None = None) -> None:
        """The call ended: its result is kept (the store) and its waiters woken. A reason the
        daemon set first (``end_reason``) wins over ``reason``."""
        with self._cond:
            entry = self._running.pop(call_id, None)
            if entry is None:
                return
            left = self._by_owner[entry.owner] - 1
            if left:
                self._by_owner[entry.owner] = left
            else:
                del self._by_owner[entry.owner]
            if shell_status is None:
                shell_status = 124 if timed_out else 128 + signal if signal else exit_code or 0
            result = CallResult(call_id, entry.session_id, entry.owner, FINISHED, exit_code or 0, signal or 0,
                                timed_out, shell_status, entry.reason or reason, _tail(entry.tails[1]),
                                _tail(entry.tails[2]), time.time())
            # Seen by waiters while it is being stored: between leaving the running ones and its
            # row's commit, a WaitCall must not find the call nowhere.
            self._unsaved[call_id] = result
        saved = self._save(result)
        with self._cond:
            if saved:
                self._unsaved.pop(call_id, None)
            while len(self._unsaved) > RUNNING_TOTAL:
                del self._unsaved[next(iter(self._unsaved))]
            self._cond.notify_all()

    def _save(self, result: CallResult) -> bool:
        from sandboxd.audit.store import CallResultRow

        if self._store is None:
            return False
        try:
            self._store.save_call_result(CallResultRow(
                result.call_id, result.session_id, result.owner, result.exit_code, result.signal, result.timed_out,
                result.shell_status, result.reason, result.stdout_tail, result.stderr_tail, result.finished_at))
            return True
        except Exception:  # noqa: BLE001 - the store closed (stopping) or its disk failed: kept in memory
            log.warning("the result of call %s could not be stored", result.call_id, exc_info=True)
            return False

    def wait(self, call_id: str, timeout: float,
             still_wanted: "Callable[[], bool]" = lambda: True) -> CallResult | None:
        """The call's result once it is finished, waiting up to ``timeout`` seconds (at most
        MAX_WAIT_SECONDS) while it runs and ``still_wanted()`` (looked at every WANTED_SECONDS: a
        waiter that went away frees its worker); RUNNING with the tails so far if it still runs
        then; None for a call not known (never, or no longer kept)."""
        deadline = time.monotonic() + min(max(timeout, 0.0), MAX_WAIT_SECONDS)
        with self._cond:
            while True:
                entry = self._running.get(call_id)
                if entry is None:
                    break
                left = deadline - time.monotonic()
                if left <= 0 or not still_wanted():
                    return CallResult(call_id, entry.session_id, entry.owner, RUNNING,
                                      stdout_tail=_tail(entry.tails[1]), stderr_tail=_tail(entry.tails[2]))
                self._cond.wait(min(left, WANTED_SECONDS))
            unsaved = self._unsaved.get(call_id)
        if unsaved is not None:
            return unsaved
        if self._store is None:
            return None
        try:
            row = self._store.call_result(call_id)
        except Exception:  # noqa: BLE001 - the store closed under us: the daemon is stopping
            return None
        if row is None:
            return None
        return CallResult(row.call_id, row.session_id, row.owner, FINISHED, row.exit_code, row.signal, row.timed_out,
                          row.shell_status, row.reason, row.stdout_tail, row.stderr_tail, row.finished_at)


class CallRecord:
    """One Exec's or Run's entry in ``results`` (service.exec_call feeds it): started once the
    command runs, its output as it passes, its end with the exit the fork server reported."""

    def __init__(self, results: CallResults, call_id: str, session_id: str, owner: str,
                 still_wanted: Callable[[], bool]) -> None:
        self._results, self.call_id, self._session_id, self._owner = results, call_id, session_id, owner
        self._still_wanted = still_wanted
        self._started = self.done = False

    def start(self) -> None:
        self._results.started(self.call_id, self._session_id, self._owner)
        self._started = True

    def output(self, stream: int, data: bytes) -> None:
        self._results.output(self.call_id, stream, data)

    def finished(self, info: "ExitInfo | None") -> None:
        """Its end (``info`` None: unknown, the daemon gave it up); CLIENT_GONE when its client
        left before it ended (the daemon then ended it: Exec's stream is the call's life)."""
        if self.done or not self._started:
            return
        self.done = True
        reason = "" if info is not None and self._still_wanted() else CLIENT_GONE
        if info is None:
            self._results.finished(self.call_id, None, 9, False, reason)
        else:
            self._results.finished(self.call_id, info.exit_code, info.signal, info.timed_out, reason,
                                   info.shell_status)


def _tail(buffer: bytearray) -> bytes:
    return bytes(buffer[-TAIL_BYTES:])
