"""Results of calls by call id, for a client whose stream is gone (a daemon restart cut it).

A SHIM of track drain's ``sandboxd.service.call_results.CallResults`` (docs: /work/briefs
interfaces, "Call results"), with its interface and none of its persistence: until that lands,
adopted calls (handover.adopt) report here. At the merge this module goes and its users import
``call_results.CallResults`` instead (the same methods).

Bounded: at most ``per_owner`` results per owner and ``total`` in all (the oldest finished one
goes first; past that, a new one is not kept, and ``started`` says so by returning False); each
keeps the last TAIL_BYTES of each stream.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

from sandboxd._record import Record

TAIL_BYTES = 64 << 10


class CallResult(Record):
    call_id: str
    session: str
    owner: str
    finished: bool = False
    exit_code: int | None = None
    signal: int | None = None
    timed_out: bool = False
    stdout_tail: bytes = b""
    stderr_tail: bytes = b""
    reason: str = ""
    finished_at: float = 0.0


class CallResults:
    def __init__(self, per_owner: int = 256, total: int = 4096) -> None:
        self._per_owner, self._total = per_owner, total
        self._results: OrderedDict[str, CallResult] = OrderedDict()
        self._cond = threading.Condition()

    def started(self, call_id: str, session: str, owner: str) -> bool:
        with self._cond:
            mine = [key for key, result in self._results.items() if result.owner == owner]
            if len(mine) >= self._per_owner and not self._forget_finished(mine):
                return False
            if len(self._results) >= self._total and not self._forget_finished(list(self._results)):
                return False
            self._results[call_id] = CallResult(call_id, session, owner)
            return True

    def _forget_finished(self, keys: list[str]) -> bool:
        for key in keys:
            if self._results[key].finished:
                del self._results[key]
                return True
        return False

    def output(self, call_id: str, stream: int, data: bytes) -> None:
        with self._cond:
            result = self._results.get(call_id)
            if result is None or stream not in (1, 2):
                return
            field = "stdout_tail" if stream == 1 else "stderr_tail"
            self._results[call_id] = result.replace(**{field: (getattr(result, field) + data)[-TAIL_BYTES:]})

    def finished(self, call_id: str, exit_code: int | None, signal: int | None, timed_out: bool, reason: str) -> None:
        with self._cond:
            result = self._results.get(call_id)
            if result is None:
                return
            self._results[call_id] = result.replace(finished=True, exit_code=exit_code, signal=signal,
                                                    timed_out=timed_out, reason=reason, finished_at=time.time())
            self._cond.notify_all()

    def wait(self, call_id: str, timeout: float) -> CallResult | None:
        """The call's result once finished (or as it is at ``timeout``); None if unknown."""
        with self._cond:
            self._cond.wait_for(lambda: call_id not in self._results or self._results[call_id].finished,
                                timeout=timeout)
            return self._results.get(call_id)
