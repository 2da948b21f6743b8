"""The ``[audit]`` settings of the daemon: how much of a caller's values one event keeps, how many
bytes one owner's sessions may add to the audit log per period, and how much free space the
log's disk must keep (audit/store.py enforces them; docs/approvals-and-audit.md says why).

The defaults, and why:

* ``event_bytes`` 16 KiB: a real event is a few hundred bytes (an Exec's three events together
  are about 1 KiB with the row overheads); an agent's whole tool input (a patch's path list, a
  browser action) fits, while a command of 2 MiB (ARG_MAX) is kept as its first 4 KiB, its length
  and its SHA-256 (audit/bounded.py), so one call writes at most about 50 KiB, not 2 MiB per event.
* ``owner_budget`` 256 MiB per ``budget_period_seconds`` one day: a token bucket that holds a
  day's budget and refills it evenly over the day. An agent that runs calls back to back all day
  (about 3 a second, sustained) or in bursts of 250,000 calls stays within it; a hostile owner
  adds at most 256 MiB at once and then about 3 KiB a second, 256 MiB a day, whatever it sends.
* ``min_free`` 512 MiB: what must stay free for unprivileged users on the log's disk before a
  call, a session or a policy change may start. It is ten times what the writes already under
  way can add (the WAL's checkpoint threshold, 40 MiB, and every running call's last events),
  so those never meet a full disk, and the rest of the machine keeps room for its own logs.
* ``checkpoint_events`` 1000: a signed checkpoint costs one Ed25519 signature and one row (about
  0.1 ms and 300 bytes), a thousandth of the events' own cost; the events after the last
  checkpoint are the part a local attacker without the key could rewrite unnoticed (also signed
  at every shutdown).
* ``retain_days`` 0 and ``max_bytes`` 0: nothing is pruned unless the operator says how long the
  evidence is kept (an export off the node, track export, is where long retention belongs).
"""

from __future__ import annotations

from sandboxd._record import Record
from sandboxd.errors import InvalidPolicy

MIN_EVENT_BYTES = 1 << 10
MAX_EVENT_BYTES = 1 << 20
MAX_CHECKPOINT_EVENTS = 1_000_000
MIN_MAX_BYTES = 16 << 20


class AuditLimits(Record):
    """The ``[audit]`` settings (sandboxd.config documents each)."""

    event_bytes: int = 16 << 10
    owner_budget_bytes: int = 256 << 20        # per period, per owner (root: counted, never refused)
    budget_period_seconds: float = 86400.0
    min_free_bytes: int = 512 << 20            # on the store's disk, for unprivileged users (f_bavail)
    min_free_percent: float = 0.0              # or this share of the disk, when given instead
    checkpoint_events: int = 1000              # events between signed checkpoints of the chain
    retain_days: float = 0.0                   # events older than this are pruned (0: kept for good)
    max_bytes: int = 0                         # the oldest events are pruned past this (0: no bound)

    def __post_init__(self) -> None:
        if not MIN_EVENT_BYTES <= self.event_bytes <= MAX_EVENT_BYTES:
            raise InvalidPolicy(f"audit.event_bytes must be from {MIN_EVENT_BYTES} to {MAX_EVENT_BYTES}, "
                                f"not {self.event_bytes}")
        if self.owner_budget_bytes < 16 * self.event_bytes:
            raise InvalidPolicy(f"audit.owner_budget ({self.owner_budget_bytes} bytes) must hold at least 16 "
                                f"events of audit.event_bytes ({self.event_bytes}): a call writes up to four")
        if not self.budget_period_seconds > 0:
            raise InvalidPolicy("audit.budget_period_seconds must be above 0")
        if self.min_free_bytes < 0 or not 0 <= self.min_free_percent < 100:
            raise InvalidPolicy("audit.min_free must be a size or a percentage below 100%")
        if not 1 <= self.checkpoint_events <= MAX_CHECKPOINT_EVENTS:
            raise InvalidPolicy(f"audit.checkpoint_events must be from 1 to {MAX_CHECKPOINT_EVENTS}, "
                                f"not {self.checkpoint_events}")
        if not self.retain_days >= 0:
            raise InvalidPolicy("audit.retain_days must be 0 (kept for good) or more")
        if self.max_bytes and self.max_bytes < MIN_MAX_BYTES:
            raise InvalidPolicy(f"audit.max_bytes must be 0 (no bound) or at least {MIN_MAX_BYTES >> 20}M: "
                                "retention prunes in chunks, and the newest chunk always stays")


def parse_min_free(text: str) -> tuple[int, float]:
    """``audit.min_free``: a size (``512M``, ``2G``, ``0``: no floor) or a share of the disk
    (``5%``); returns (bytes, percent), one of them 0. InvalidPolicy otherwise."""
    from sandboxd.policy.limits import parse_size

    body = text.strip()
    if body.endswith("%"):
        number = body[:-1].strip()
        try:
            percent = float(number)
        except ValueError:
            percent = -1.0
        if not 0 <= percent < 100:                   # nan and inf fail this too
            raise InvalidPolicy(f"bad audit.min_free {text!r}: a percentage must be from 0% to below 100%")
        return 0, percent
    if body == "0":
        return 0, 0.0
    return parse_size(body, "audit.min_free"), 0.0
