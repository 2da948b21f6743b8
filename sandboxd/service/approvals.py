"""The approval gate: every tool call passes here, built-in or external, and every decision
becomes an event before anything is done about it.

Flow for one call (see sandboxd.policy.decision for the decision itself):

  decide ─ DeniedBySandbox ──────────────────────────────► PermissionDenied (by sandbox)
         ─ NeedsApproval ─ remembered (session or rule) ──► PermissionGranted (by session/rule)
                         ─ otherwise ─ PermissionRequested, hold the call until
                                       ResolveApproval / the timeout / the caller leaves
                                       ─ allow_once / allow_session ► PermissionGranted (by user)
                                       ─ deny / timeout / gone ─────► PermissionDenied
         ─ Allowed ───────────────────────────────────────► PermissionGranted (by policy)
  granted ─ ToolInvocationStarted (in the same transaction) ─ run ─ ToolInvocationCompleted | Failed

A denied call is never invoked. A granted call is not revoked later: changing the
policy affects the next decision, not one already made.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

from sandboxd._record import Record
from sandboxd.audit.store import PERMISSION_NAMESPACE, EventStore, EventType
from sandboxd.errors import InvalidPolicy, NotFound, PermissionDenied
from sandboxd.policy.decision import Verdict, decide
from sandboxd.policy.sandbox import SandboxPolicy
from sandboxd.policy.tools import Risk
from sandboxd.service.sessions.registry import Session
from sandboxd.supervisor.fork_client import HandedOver

if TYPE_CHECKING:
    from sandboxd.service.callers import Caller
    from sandboxd.service.metrics import Metrics

log = logging.getLogger("sandboxd")
ALLOW_ONCE, ALLOW_SESSION, DENY = "allow_once", "allow_session", "deny"
DECISION_ALIASES = {
    "allow_once": ALLOW_ONCE, "allow": ALLOW_ONCE, "ok": ALLOW_ONCE, "approve": ALLOW_ONCE,
    "allow_session": ALLOW_SESSION, "session": ALLOW_SESSION, "always": ALLOW_SESSION,
    "deny": DENY, "reject": DENY, "cancel": DENY,
}
DEFAULT_APPROVAL_TIMEOUT = 300.0


def parse_decision(text: str) -> str:
    decision = DECISION_ALIASES.get(text.strip().lower())
    if decision is None:
        raise InvalidPolicy(f"unknown approval decision {text!r}: use allow_once (allow, ok, approve), "
                            "allow_session (session, always) or deny (reject, cancel)")
    return decision


class ToolCall(Record):
    """One call, as the gate sees it."""

    tool: str
    effect: str | None                    # None: the tool declared none (an unknown command)
    category: str
    arguments: dict[str, Any]             # JSON
    summary: str
    risk: str = Risk.HIGH
    execution_context_id: str = ""
    mcp_server: str = ""
    untrusted_mcp: bool = False
    note: str = ""                        # why the effect is what it is (a destructive write's path)
    # An external tool that runs in another session of the caller's (AuthorizeRequest.runs_in_session_id:
    # an MCP gateway's upstream server): its id, and its sandbox, which the effect is judged against
    # (None: the session's own). The approval policy, permission mode, rules and audit stay the session's.
    runs_in_session: str = ""
    runs_in_policy: SandboxPolicy | None = None


class Granted:
    """A call that may run. Exactly one end event is appended, whichever of ``completed`` or
    ``failed`` comes first (a second is ignored)."""

    def __init__(self, store: EventStore, session_id: str, call_id: str, tool: str, granted_by: str = "policy",
                 reason: str | None = None, metrics: "Metrics | None" = None) -> None:
        self._store, self.session_id, self.call_id, self.tool = store, session_id, call_id, tool
        self.granted_by, self.reason = granted_by, reason
        self._metrics = metrics
        self._ended = False
        self._lock = threading.Lock()

    def completed(self, result: dict[str, Any] | None = None) -> None:
        self._end(EventType.TOOL_COMPLETED, result or {})

    def failed(self, error: BaseException | str) -> None:
        text = str(error) if not isinstance(error, str) else error
        self._end(EventType.TOOL_FAILED, {"error": text, "kind": type(error).__name__ if not isinstance(error, str)
                                          else "reported"})

    def _end(self, kind: str, data: dict[str, Any]) -> None:
        with self._lock:
            if self._ended:
                return
            self._ended = True
        self._store.append(self.session_id, kind, call_id=self.call_id, tool=self.tool, data=data)
        outcome = "completed" if kind == EventType.TOOL_COMPLETED else "failed"
        if self._metrics is not None:
            self._metrics.call_ended(self.tool, outcome, data if outcome == "completed" else None)
        log.debug("tool call ended", extra={"fields": {"session_id": self.session_id, "call_id": self.call_id,
                                                       "tool": self.tool, "outcome": outcome}})

    def __enter__(self) -> "Granted":
        return self

    def __exit__(self, kind: object, error: BaseException | None, _tb: object) -> None:
        if isinstance(error, HandedOver):
            return                                # it runs on: the next daemon records its end (handover.adopt)
        if error is not None:
            self.failed(error)
        else:
            self.completed()


# A held call answered by callback (``ApprovalGate.hold``): (decision, rule, by, who answered: None
# for the daemon). It may refuse the answer (InvalidPolicy: a rule that does not cover the call),
# which leaves the call held.
OnDecision = Callable[[str, str, str, "Caller | None"], None]


class _Pending:
    def __init__(self, session_id: str, call_id: str, call: ToolCall, reason: str | None,
                 proposal: str = "", on_decision: OnDecision | None = None) -> None:
        self.session_id, self.call_id, self.call, self.reason = session_id, call_id, call, reason
        self.proposal, self.on_decision = proposal, on_decision
        self.answered = threading.Event()
        self.answer: str | None = None


class ApprovalGate:
    def __init__(self, store: EventStore, *, timeout: float = DEFAULT_APPROVAL_TIMEOUT,
                 metrics: "Metrics | None" = None) -> None:
        self._store = store
        self.timeout = timeout
        self._metrics = metrics
        self._lock = threading.Lock()
        self._pending: dict[tuple[str, str], _Pending] = {}
        self._session_allowed: set[tuple[str, str]] = set()

    # -- the decision ----------------------------------------------------------------------------

    def authorize(self, session: Session, call: ToolCall, *, call_id: str = "",
                  still_wanted: Callable[[], bool] = lambda: True) -> Granted:
        """Decide, record, and (if needed) wait for a person. Returns a Granted the caller must
        end; raises PermissionDenied (after recording it) otherwise. Exhausted before anything
        is decided or recorded when the store will not take this owner's events (its audit budget
        is spent, or the disk is nearly full): a call that cannot be recorded does not start."""
        self._store.admit(session.owner.uid, session.owner.principal)
        call_id = call_id or "call_" + secrets.token_hex(6)
        sandbox = call.runs_in_policy if call.runs_in_policy is not None else session.policy
        decision = decide(call.effect, call.tool, sandbox, session.approval, category=call.category,
                          untrusted_mcp=call.untrusted_mcp, rules=session.rules)
        if self._metrics is not None:
            self._metrics.decisions.labels(decision.verdict, decision.reason or "").inc()
        if log.isEnabledFor(logging.DEBUG):             # per call: only when asked (log.level = "debug")
            log.debug("decision", extra={"fields": {"session_id": session.id, "call_id": call_id, "tool": call.tool,
                                                    "verdict": decision.verdict, "reason": decision.reason}})
        base: dict[str, Any] = {"effect": call.effect or "unknown-command", "risk": call.risk,
                                "summary": call.summary, "execution_context_id": call.execution_context_id}
        if call.note:
            base["note"] = call.note
        if call.mcp_server:
            base["mcp_server"] = call.mcp_server
        if call.runs_in_session:
            base["runs_in_session"] = call.runs_in_session
        if decision.verdict == Verdict.DENIED_BY_SANDBOX:
            detail = f"{decision.detail}; {call.note}" if call.note else decision.detail
            if call.runs_in_session:
                detail += f" (the sandbox of session {call.runs_in_session}, where it runs)"
            self._deny(session, call_id, call, decision.reason, "sandbox", detail, base)
        granted_by = "policy"
        if decision.verdict == Verdict.NEEDS_APPROVAL:
            granted_by = self._remembered(session, call.tool) or self._ask(session, call_id, call, decision.reason,
                                                                            base, still_wanted)
        self._store.append_many(session.id, [
            (EventType.PERMISSION_GRANTED, call_id, call.tool, {**base, "by": granted_by, "reason": decision.reason}),
            (EventType.TOOL_STARTED, call_id, call.tool, {"arguments": call.arguments}),
        ])
        return Granted(self._store, session.id, call_id, call.tool, granted_by, decision.reason, self._metrics)

    def _remembered(self, session: Session, tool: str) -> str | None:
        with self._lock:
            if (session.id, tool) in self._session_allowed:
                return "session"
        # Only the session owner's own standing rules count: a rule another user added on a
        # shared directory must not answer for this owner.
        if self._store.has_memory(PERMISSION_NAMESPACE, session.workspace, rule_key(tool),
                                  owner_uid=session.owner.uid, owner_principal=session.owner.principal):
            return "workspace_rule"
        return None

    def _ask(self, session: Session, call_id: str, call: ToolCall, reason: str | None, base: dict[str, Any],
             still_wanted: Callable[[], bool]) -> str:
        pending = _Pending(session.id, call_id, call, reason)
        with self._lock:
            self._pending[(session.id, call_id)] = pending
        try:
            self._store.append(session.id, EventType.PERMISSION_REQUESTED, call_id=call_id, tool=call.tool,
                               data={**base, "reason": reason, "arguments": call.arguments})
            deadline = time.monotonic() + self.timeout
            while not pending.answered.wait(min(0.25, max(0.0, deadline - time.monotonic()))):
                if time.monotonic() >= deadline:
                    self._deny(session, call_id, call, reason, "timeout",
                               f"no answer within {self.timeout:g} s", base)
                if not still_wanted():
                    self._deny(session, call_id, call, reason, "cancelled", "the caller went away", base)
        finally:
            with self._lock:
                self._pending.pop((session.id, call_id), None)
        if pending.answer == DENY:
            self._deny(session, call_id, call, reason, "user", "", base)
        if pending.answer == ALLOW_SESSION:
            with self._lock:
                self._session_allowed.add((session.id, call.tool))
        return "user"

    def _deny(self, session: Session, call_id: str, call: ToolCall, reason: str | None, by: str, detail: str,
              base: dict[str, Any]) -> None:
        error = PermissionDenied(call_id, call.tool, reason, by, detail)
        if self._metrics is not None:
            self._metrics.call_ended(call.tool, f"denied_by_{by}")
        log.debug("tool call denied", extra={"fields": {"session_id": session.id, "call_id": call_id,
                                                        "tool": call.tool, "by": by, "reason": reason}})
        self._store.append(session.id, EventType.PERMISSION_DENIED, call_id=call_id, tool=call.tool,
                           data={**base, "reason": reason, "by": by, "detail": detail, "message": str(error)})
        raise error

    # -- held without a thread (network questions) -----------------------------------------------

    def hold(self, session: Session, call: ToolCall, reason: str, *, proposal: str, on_decision: OnDecision,
             data: dict[str, Any]) -> str:
        """Hold ``call`` for a person with no thread waiting: PermissionRequested is recorded
        (``data`` added to it) and the call is listed and answered like any other, but its answer
        goes to ``on_decision`` (from ResolveApproval's thread; ``claim`` for a timeout). Returns
        its call id. Exhausted when the store will not take this owner's events."""
        self._store.admit(session.owner.uid, session.owner.principal)
        call_id = "call_" + secrets.token_hex(6)
        pending = _Pending(session.id, call_id, call, reason, proposal, on_decision)
        with self._lock:
            self._pending[(session.id, call_id)] = pending
        try:
            self._store.append(session.id, EventType.PERMISSION_REQUESTED, call_id=call_id, tool=call.tool,
                               data={"effect": call.effect or "unknown-command", "risk": call.risk,
                                     "summary": call.summary, "execution_context_id": call.execution_context_id,
                                     "reason": reason, "arguments": call.arguments, **data})
        except BaseException:
            with self._lock:
                self._pending.pop((session.id, call_id), None)
            raise
        return call_id

    def claim(self, session_id: str, call_id: str) -> bool:
        """Take a held call out of everyone's reach, unanswered (its holder answers it itself: a
        timeout); False when it was answered or taken already."""
        with self._lock:
            pending = self._pending.get((session_id, call_id))
            if pending is None or pending.answered.is_set():
                return False
            pending.answered.set()
            del self._pending[(session_id, call_id)]
        return True

    # -- answers ---------------------------------------------------------------------------------

    def resolve(self, session_id: str, call_id: str, decision_text: str, rule: str = "",
                who: "Caller | None" = None) -> str:
        """Answer a held call; returns the canonical decision. ``rule``: for a network question
        allowed for the session, the rule to add instead of its proposal; ``who``: the caller
        answering (recorded by a network question's callback)."""
        decision = parse_decision(decision_text)
        with self._lock:
            pending = self._pending.get((session_id, call_id))
            if pending is None or pending.answered.is_set():
                raise NotFound(f"no call {call_id!r} waiting for approval in session {session_id!r}")
            if pending.on_decision is None and rule:
                raise InvalidPolicy("rule answers a network question only (reason network_request): leave it empty")
            if rule and decision != "allow_session":
                # Allowed once or denied, the rule would be dropped unsaid: the person meant to add it.
                raise InvalidPolicy(f"a rule is added only when allowing for the session: decision allow_session, "
                                    f"not {decision}")
            pending.answer = decision
            pending.answered.set()
        if pending.on_decision is not None:
            try:
                pending.on_decision(decision, rule, "user", who)
            except BaseException:
                pending.answer = None
                pending.answered.clear()                # refused (a rule that does not cover it): still held
                raise
            with self._lock:
                self._pending.pop((session_id, call_id), None)
        return decision

    def pending(self, session_id: str) -> list[tuple[str, ToolCall, str | None]]:
        """(call id, call, reason) of each call held for approval in the session."""
        with self._lock:
            return [(p.call_id, p.call, p.reason) for (sid, _), p in self._pending.items() if sid == session_id]

    def proposal(self, session_id: str, call_id: str) -> str:
        """A held network question's proposal ("" for any other call)."""
        with self._lock:
            pending = self._pending.get((session_id, call_id))
            return pending.proposal if pending is not None else ""

    def forget_session(self, session_id: str) -> None:
        """The session closed: its remembered approvals go, and held calls are denied."""
        with self._lock:
            self._session_allowed = {entry for entry in self._session_allowed if entry[0] != session_id}
            held = [p for (sid, _), p in self._pending.items() if sid == session_id]
        for pending in held:
            if pending.on_decision is not None:
                if self.claim(session_id, pending.call_id):
                    pending.on_decision(DENY, "", "cancelled", None)
                continue
            pending.answer = DENY
            pending.answered.set()


def rule_key(tool: str) -> str:
    """The key of a standing "always allow TOOL in this workspace" rule (permission namespace);
    each owner has its own, which applies only to that owner's sessions."""
    return f"allow:{tool}"

