"""The ``[quotas]`` settings of the daemon, checked together: per-owner calls, streams, requests,
terminals, sessions and background processes, and the worker reserve (service/quotas.py enforces
them; the module's docstring there says why each exists)."""

from __future__ import annotations

from sandboxd._record import Record
from sandboxd.errors import InvalidPolicy

# How many owners at their quotas must always leave room for one more (checked at start-up).
FAIR_OWNERS = 4


class QuotaLimits(Record):
    """The ``[quotas]`` settings (sandboxd.config documents each)."""

    sessions_per_uid: int = 64
    # Local root's own sessions (an agent pod running as root, a script): four times an owner's.
    root_sessions: int = 256
    # With the default 128 workers: a pool of 96, a first-slot share of 12, and 4 owners at
    # 16 calls + 4 streams each hold 80 slots: 4 more, and the 12 of the share, stay for others.
    # 16 running calls covers an agent's parallel tool calls; 4 streams are a WatchEvents, an MCP
    # client's event follower and two followed background outputs. Idle workers cost nothing:
    # the pool's threads are started on demand.
    calls_per_uid: int = 16
    streams_per_uid: int = 4
    # Every other RPC (CreateSession, UpdateSessionPolicy, CloseSession, standing rules, GetStatus...)
    # holds a worker too, and those that name a path may wait on it for fork_server.wait_seconds (a
    # FUSE mount that never answers). 8 in progress at once covers a client's parallel session set-up
    # (and an agent that changes its policy while it lists), and 4 owners at 16 + 4 + 8 hold 112 of
    # the 128 workers: the first-slot share (12) and 4 more stay for everyone else.
    requests_per_uid: int = 8
    # Calls on a terminal (Exec with `terminal`: sandboxctl shell): each holds a pty of its session's
    # devpts and a relay in the daemon for as long as a person keeps it open, often idle for hours.
    terminals_per_uid: int = 8
    # Each keeps a daemon thread while it runs and up to background.BUFFER_BYTES of output until it
    # is forgotten: 16 per user is 64 MiB at most, whatever the user's sessions start.
    background_per_uid: int = 16
    # inotify watches one owner's git guards hold together (their sessions' directories); 0: no
    # budget. The daemon's default is a sixteenth of root's fs.inotify.max_user_watches (config).
    git_watches_per_uid: int = 0
    # inotify instances all git guards hold: one per owner for the first ones, then a shared one
    # (an overflow of a queue costs only the owners on it); 0: an eighth of root's
    # fs.inotify.max_user_instances (config).
    git_inotify_instances: int = 0
    reserved_workers: int = 0             # 0: a quarter of the workers, at least 1
    workers: int = 128                    # listen.workers: the pool the reserve is taken from

    def __post_init__(self) -> None:
        if self.reserved_workers == 0:
            object.__setattr__(self, "reserved_workers", max(1, self.workers // 4))
        if self.workers < 2:
            raise InvalidPolicy("listen.workers must be at least 2: one for running calls, one kept for short calls")
        if not 1 <= self.reserved_workers < self.workers:
            raise InvalidPolicy(f"quotas.reserved_workers ({self.reserved_workers}) must be at least 1 and below "
                                f"listen.workers ({self.workers}): raise listen.workers or lower the reserve")
        fair = FAIR_OWNERS * self.per_owner
        if fair > self.shared:
            raise InvalidPolicy(
                f"{FAIR_OWNERS} users at their quotas (quotas.calls_per_uid {self.calls_per_uid} + "
                f"quotas.streams_per_uid {self.streams_per_uid}, each) would hold {fair} long-lived slots, more "
                f"than the {self.shared} that listen.workers ({self.workers}) minus quotas.reserved_workers "
                f"({self.reserved_workers}) minus the first-slot share ({self.first_slot_share}) leave: everyone "
                f"else could be refused. Lower those quotas to {max(1, self.shared // FAIR_OWNERS)} slots per user "
                "together, or raise listen.workers")
        every = FAIR_OWNERS * (self.per_owner + self.requests_per_uid)
        if every > self.workers - self.first_slot_share:
            raise InvalidPolicy(
                f"{FAIR_OWNERS} users at all their quotas (quotas.calls_per_uid {self.calls_per_uid} + "
                f"quotas.streams_per_uid {self.streams_per_uid} + quotas.requests_per_uid {self.requests_per_uid}, "
                f"each) would hold {every} of the {self.workers} workers (listen.workers), reaching into the last "
                f"{self.first_slot_share} that the daemon keeps for users that hold none: everyone else could be "
                "refused. Lower quotas.requests_per_uid to "
                f"{max(1, (self.workers - self.first_slot_share) // FAIR_OWNERS - self.per_owner)}, or raise "
                "listen.workers")

    @property
    def long_lived_total(self) -> int:
        """The pool: slots for long-lived handlers, everyone's together."""
        return self.workers - self.reserved_workers

    @property
    def first_slot_share(self) -> int:
        """The last slots of the pool, kept for owners that hold none: an eighth, at least 1."""
        return max(1, self.long_lived_total // 8)

    @property
    def shared(self) -> int:
        """The slots an owner that already holds one may take."""
        return self.long_lived_total - self.first_slot_share

    @property
    def per_owner(self) -> int:
        return self.calls_per_uid + self.streams_per_uid
