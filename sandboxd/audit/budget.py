"""How many bytes each owner's sessions may still add to the audit log: one token bucket per
owner (a uid, or a TLS caller's principal), holding ``capacity`` bytes and refilled evenly over
``period`` seconds (``audit.owner_budget`` per ``audit.budget_period_seconds``).

Everything an owner's sessions write is spent from its bucket, and nothing is ever refused
here: an event that records something already done (a call's end, a denial, a session's close)
is always written, and may leave the bucket below zero. What the bucket decides is whether the
owner may *start* something that writes (a call, a session, a policy change): only while it
holds more than zero bytes (``refusal``). An owner's overdraft is bounded by what its calls
already admitted can still write (a few events each, each at most ``audit.event_bytes``), and
it waits the overdraft off like the rest. So over any span of T seconds an owner adds at most
``capacity * (1 + T / period)`` bytes, plus that overdraft.

Memory: a bucket that has refilled is the same as none, so full buckets are forgotten whenever
the table holds more than SWEEP_AT owners.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

SWEEP_AT = 1024


class OwnerBudgets:
    def __init__(self, capacity: int, period: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity, self.period = capacity, period
        self._rate = capacity / period                 # bytes a second
        self._clock = clock
        self._lock = threading.Lock()
        self._levels: dict[str, tuple[float, float]] = {}    # owner -> (bytes left, when)

    def _level(self, owner: str, now: float) -> float:
        left, when = self._levels.get(owner, (float(self.capacity), now))
        return min(float(self.capacity), left + (now - when) * self._rate)

    def spend(self, owner: str, amount: int) -> None:
        with self._lock:
            now = self._clock()
            self._levels[owner] = (self._level(owner, now) - amount, now)
            if len(self._levels) > SWEEP_AT:
                self._levels = {o: v for o, v in self._levels.items() if self._level(o, now) < self.capacity}

    def left(self, owner: str) -> float:
        """Bytes the owner may still add (below zero: its overdraft)."""
        with self._lock:
            return self._level(owner, self._clock())

    def refusal(self, owner: str) -> float | None:
        """None while the owner may start something; else the seconds until it may again."""
        left = self.left(owner)
        return None if left > 0 else (1 - left) / self._rate
