"""VerifyAudit: the audit chain checked by the daemon, for `sandboxctl audit verify`.

Who may verify what: an administrator (local root, the admin group) the node's whole chain,
which holds every owner's events; any caller one session it may read (its own stream: each event's
hash and its link to the one before it in the session, with nothing missing), the same visibility
as QueryEvents. The node's chain is not shown to owners because proving it whole means reading
other owners' events.

Bounded: the verifier reads through a read-only connection of its own (a WAL reader: appends never
wait for it, nor it for them), in chunks, sleeping YIELD_SECONDS between chunks so the daemon's
other threads keep the interpreter; one verification per owner at a time and MAX_RUNNING in the
whole daemon, the last of them kept for administrators (RESOURCE_EXHAUSTED past either, saying
which), and it stops when its caller leaves (checked between chunks of events and of checkpoints).
A session's verify reads that session's events and the newest checkpoint only (one signature
check), not the node's checkpoint history: a tenant's tiny session costs what it holds.
It runs on the RPC's own worker thread, which the caller's request quota already counts.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from sandboxd.audit.integrity.verify import CHUNK, Report, Verifier, open_read_only
from sandboxd.audit.store import EventStore, owner_key
from sandboxd.errors import DeadlineExceeded, Exhausted, Forbidden
from sandboxd.service.callers import Caller
from sandboxd.service.sessions.registry import SessionRegistry
from sandboxd.v1 import sandboxd_pb2 as pb

MAX_RUNNING = 3
ADMIN_RESERVED = 1          # of MAX_RUNNING, only an administrator's verification may take
YIELD_SECONDS = 0.002


class AuditVerification:
    def __init__(self, registry: SessionRegistry, *, chunk: int = CHUNK) -> None:
        self._registry, self._chunk = registry, chunk
        self._store: EventStore = registry.store
        self._lock = threading.Lock()
        self._owners: set[str] = set()

    def verify(self, who: Caller, request: pb.VerifyAuditRequest, active: Callable[[], bool]) -> pb.VerifyAuditResponse:
        if not request.session_id and not who.is_admin:
            raise Forbidden("verifying the whole node's audit chain is for administrators (root or the admin "
                            "group): it reads every owner's events; name one of your sessions (session_id) instead")
        session_id = ""
        if request.session_id:
            session_id = (self._registry.visible_ids(who, request.session_id) or [request.session_id])[0]
        owner = owner_key(who.uid, who.principal)
        with self._lock:
            if owner in self._owners:
                raise Exhausted(f"{owner} has an audit verification under way: wait for its answer")
            # The last slot is kept for administrators: tenants looping on their own sessions
            # never shut out the node's whole-chain verify.
            limit = MAX_RUNNING if who.is_admin else MAX_RUNNING - ADMIN_RESERVED
            if len(self._owners) >= limit:
                raise Exhausted(f"{len(self._owners)} audit verifications are under way on this daemon"
                                f"{'' if who.is_admin else ' (the last slot is kept for administrators)'}: retry in a "
                                "moment")
            self._owners.add(owner)
        try:
            report = self._run(session_id, active)
        finally:
            with self._lock:
                self._owners.discard(owner)
        return _to_proto(report)

    def _run(self, session_id: str, active: Callable[[], bool]) -> Report:
        def between_chunks() -> None:
            if not active():
                raise DeadlineExceeded("the caller left before the audit verification finished")
            time.sleep(YIELD_SECONDS)

        db = open_read_only(self._store.path, live=True)
        try:
            verifier = Verifier(db, self._store.signing_key, pinned=True, chunk=self._chunk,
                                between_chunks=between_chunks)
            return verifier.verify_session(session_id) if session_id else verifier.verify()
        finally:
            db.close()


def _to_proto(report: Report) -> pb.VerifyAuditResponse:
    checkpoint, problem = report.last_checkpoint, report.problem
    return pb.VerifyAuditResponse(
        whole=report.whole, summary=report.text(), events=report.events, head_id=report.head_id,
        head_hash=report.head_hash.hex(), last_checkpoint_id=checkpoint.id if checkpoint else 0,
        last_checkpoint_event_id=checkpoint.last_event_id if checkpoint else 0, key_id=report.key_id,
        pruned=report.pruned, problem_kind=problem.kind if problem else "",
        problem_event_id=problem.event_id if problem else 0, problem_checkpoint_id=problem.checkpoint_id if problem else 0,
        problem=problem.detail if problem else "", seconds=report.seconds)
