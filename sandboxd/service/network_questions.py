"""The daemon's end of ``unlisted = ask`` (issue 26 item 3): a session's egress proxy holds a
connection or request its rules do not list and asks (network.questions); here each question
becomes a held call of tool ``network``, reason ``network_request``, in the approval gate, shown
and answered like any other (ListPendingApprovals, ResolveApproval: `sandboxctl approve|deny`,
`approvals --follow`, MCP elicitation).

- The card shows host, port, method, path and the proposal (policy.network_advice), each through
  ``printable``; never headers or body (the proxy never hands them over).
- The card's summary is bounded like a command's: method and host first, the path cut to
  ``PATH_CHARS`` with how much was cut; a question about a port other than 80/443 says that no
  session rule is offered (policy.network_advice: an allowed domain would allow every port).
- allow_once lets exactly one held connection or request through (the oldest of those that asked
  the same question); the others stay held on a fresh question. allow_session first adds the
  proposal, or the person's own ``rule`` (ResolveApprovalRequest.rule) when it covers the held
  request, to the session's policy through sessions.network_live.apply_network_policy (computed
  under the session's build_lock from the policy then current, so a concurrent owner's change is
  kept; audited PolicyChanged, ``by: approval``, by_uid the answering caller), then lets every
  waiter through; deny refuses them, and is remembered for the session (``DENIED_PER_SESSION``
  host/port/method/path, oldest forgotten first): the same question is then refused unasked.
- Under approval policy ``never`` nobody is asked: refused at once.
- When the session's running commands all belong to one execution context (one `sandboxctl
  exec`, one MCP tool call) and no background process runs (sessions.state.only_context), the
  question carries its execution_context_id, so that client asks in place (cli.approval_prompt.ExecApprovals, mcp.binding's elicitation); otherwise it is answered
  through `approvals` / `approve` (a sandbox's connection names no command).
- Bounds: at most ``per_session`` questions of a session wait at once (quotas.
  network_questions_per_session); one more is refused at once with a 403 saying so. A question
  equal to one waiting (host, port, method, path, scheme) shares it. A question nobody answers in
  ``timeout`` seconds (approvals.timeout_seconds) is denied, by one thread for the whole daemon.
  A question outlives its client (design §6.2): withdrawing only stops its answer going there.

``ask`` runs on a worker of the proxy's loop (network.questions): the audit writes happen there,
never on the relay loop; refusals nobody's call asked for are ``note``d (counted once the owner's
audit budget is spent).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
import weakref
from collections import OrderedDict
from typing import Any, Callable

from sandboxd.audit.store import EventStore, EventType
from sandboxd.errors import Exhausted, InvalidPolicy
from sandboxd.network.questions import Answer, Ask, OnAnswer, Question, Withdraw
from sandboxd.policy.decision import ApprovalPolicy, Reason
from sandboxd.policy.domains import allowed_domain, domain_matches
from sandboxd.policy.approval_card import bounded
from sandboxd.policy.network import normalize_path, parse_endpoint
from sandboxd.policy.network_advice import WEB_PORTS
from sandboxd.policy.sandbox import SandboxPolicy
from sandboxd.policy.tools import Category, Effect, Risk
from sandboxd.printable import printable
from sandboxd.service.approvals import ALLOW_ONCE, ALLOW_SESSION, DENY, ApprovalGate, ToolCall
from sandboxd.service.callers import Caller, acted_by
from sandboxd.service.sessions.state import Session

log = logging.getLogger("sandboxd")
TOOL = "network"
REASON = Reason.NETWORK_REQUEST
DEFAULT_PER_SESSION = 16
DEFAULT_TIMEOUT = 300.0
DENIED_PER_SESSION = 256                # denials remembered per session (the oldest forgotten first)
# Bounds of what a card shows of the sandbox's choices (like a command's card, approval_card):
# the method and host come first and always fit on an 80-column terminal.
PATH_CHARS = 160
METHOD_CHARS = 24
PROPOSAL_CHARS = 200
ANSWERS = {ALLOW_ONCE: Answer.ALLOW_ONCE, ALLOW_SESSION: Answer.ALLOW_SESSION, DENY: Answer.DENY}
# The new policy from the one current when the change is made (under the session's build_lock).
Change = Callable[[SandboxPolicy], SandboxPolicy]
ApplyPolicy = Callable[[Session, Change, "Caller | None"], None]
_DeniedKey = tuple[str, int, str, str]


def apply_live(session: Session, change: Change, who: Caller | None) -> None:
    """The session's running proxy takes ``change`` of its current policy now, audited as ``who``'s."""
    from sandboxd.service.sessions.network_live import apply_network_policy

    apply_network_policy(session, change, by="approval", caller=who)


def card(question: Question) -> tuple[str, dict[str, Any]]:
    """The held call's one-line summary and arguments: what the person reads, all escaped and
    bounded (method and host first)."""
    path = bounded(question.path, PATH_CHARS)
    summary = (f"network: {bounded(question.method, METHOD_CHARS)} {printable(question.scheme)}://"
               f"{printable(question.host)}:{question.port}{path}")
    if question.proposal:
        summary += f" (for the session: {bounded(question.proposal, PROPOSAL_CHARS)})"
    elif question.port not in WEB_PORTS:
        summary += (f" (port {question.port}: no rule for the session is offered, an allowed domain would allow "
                    "every port: allow once or deny)")
    arguments = {"host": printable(question.host), "port": question.port,
                 "method": bounded(question.method, METHOD_CHARS), "path": path,
                 "scheme": printable(question.scheme), "proposal": bounded(question.proposal, PROPOSAL_CHARS),
                 "proposal_kind": printable(question.proposal_kind), "why": bounded(question.why, PROPOSAL_CHARS)}
    return summary, arguments


def with_rule(policy: SandboxPolicy, question: Question, rule: str) -> SandboxPolicy:
    """``policy`` plus ``rule`` (an allowed_domains entry, or an allowed_endpoints one: HOST=...),
    which must let the held request through; InvalidPolicy saying why not otherwise."""
    rule = rule.strip()
    if "=" in rule:
        endpoint = parse_endpoint(rule)
        path = normalize_path(question.path) if question.path else None
        if (not domain_matches(question.host, endpoint.host) or path is None
                or not endpoint.allows(question.method, path)):
            raise InvalidPolicy(f"rule {printable(rule[:200])!r} does not cover the held request "
                                f"({printable(question.method)} {printable(question.host)}"
                                f"{printable(question.path)}): give one that does, or leave it empty for the proposal")
        if endpoint.text() in policy.allowed_endpoints:
            return policy
        added = policy.replace(allowed_endpoints=policy.allowed_endpoints + (endpoint.text(),))
    else:
        domain = allowed_domain(rule)
        if not domain_matches(question.host, domain):
            raise InvalidPolicy(f"rule {printable(rule[:200])!r} does not cover {printable(question.host)}: give an "
                                "allowed domain that does, or leave it empty for the proposal")
        if domain in policy.allowed_domains:
            return policy
        added = policy.replace(allowed_domains=policy.allowed_domains + (domain,))
    # The new entry must leave the held request allowed: an endpoint rule only narrows a host that
    # is allowed already (a domain question's answer is a domain).
    if not added.network_rules.allowed(question.host, question.port):
        raise InvalidPolicy(f"rule {printable(rule[:200])!r} does not allow {printable(question.host)}: "
                            "for an unlisted host give an allowed domain")
    return added


class _Held:
    """One question waiting for a person, shared by every held connection that asked it."""

    def __init__(self, session: Session, question: Question, deadline: float) -> None:
        self.session, self.question, self.deadline = session, question, deadline
        self.call_id = ""
        self.waiters: dict[int, OnAnswer] = {}
        self.done = False


class NetworkQuestions:
    """The asker of every session of one daemon (``ask_for(session)`` is what its proxy gets)."""

    def __init__(self, gate: ApprovalGate, store: EventStore, *, per_session: int = DEFAULT_PER_SESSION,
                 timeout: float = DEFAULT_TIMEOUT, apply_policy: ApplyPolicy = apply_live) -> None:
        self._gate, self._store = gate, store
        self._per_session, self._timeout, self._apply = per_session, timeout, apply_policy
        self._lock = threading.Condition()
        self._held: dict[tuple[str, Question], _Held] = {}
        self._count: dict[str, int] = {}                 # session id -> questions waiting
        self._deadlines: list[tuple[float, int, _Held]] = []
        # What the person denied, per session (dropped with the session object).
        self._denied: "weakref.WeakKeyDictionary[Session, OrderedDict[_DeniedKey, None]]" = (
            weakref.WeakKeyDictionary())
        self._ids = itertools.count()
        self._sweeper: threading.Thread | None = None
        self._closed = False

    def ask_for(self, session: Session) -> Ask:
        return lambda question, on_answer: self.ask(session, question, on_answer)

    # -- asking (on a worker of the proxy's loop) ------------------------------------------------

    def ask(self, session: Session, question: Question, on_answer: OnAnswer) -> Withdraw:
        with session.lock:
            approval = session.approval
        if approval == ApprovalPolicy.NEVER:
            self._refused(session, question, "approval policy never: nobody is asked, so unlisted = ask refuses")
            on_answer(Answer.DENY, "sandboxd: refused: the session's approval policy is never, so nobody is asked")
            return _nothing
        key = (session.id, question)
        waiter = next(self._ids)
        with self._lock:
            denied = _denied_key(question) in self._denied.get(session, ())
            shared = self._held.get(key)
            if not denied and shared is not None and not shared.done:  # the same question: it shares the answer
                shared.waiters[waiter] = on_answer
                return lambda: self._withdraw(key, waiter)
        if denied:
            why = "sandboxd: refused: denied earlier by the person for this session"
            self._refused(session, question, why)
            on_answer(Answer.DENY, why)
            return _nothing
        with self._lock:
            held: _Held | None = None
            if self._count.get(session.id, 0) >= self._per_session:
                full = True
            else:
                full = False
                held = _Held(session, question, time.monotonic() + self._timeout)
                held.waiters[waiter] = on_answer
                self._held[key] = held
                self._count[session.id] = self._count.get(session.id, 0) + 1
        if full:
            why = (f"sandboxd: {self._per_session} network questions of this session wait for an answer, the most "
                   "quotas.network_questions_per_session allows: answer those first")
            self._refused(session, question, why)
            on_answer(Answer.DENY, why)
            return _nothing
        assert held is not None
        self._post(held)
        return lambda: self._withdraw(key, waiter)

    def _post(self, held: _Held) -> None:
        """Put ``held`` (registered, not yet shown) before a person: a held call of the gate."""
        session, question = held.session, held.question
        summary, arguments = card(question)
        # Shown where the command that asked waits (`sandboxctl exec` in place, an MCP elicitation)
        # when the session runs commands of one execution context only; else by approvals/approve.
        call = ToolCall(tool=TOOL, effect=Effect.NETWORK, category=Category.EXTERNAL, arguments=arguments,
                        summary=summary, risk=Risk.MEDIUM, execution_context_id=session.only_context())
        try:
            held.call_id = self._gate.hold(session, call, REASON, proposal=question.proposal,
                                           on_decision=lambda decision, rule, by, who: self._decided(
                                               held, decision, rule, by, who),
                                           data={"proposal": printable(question.proposal)})
        except Exhausted as exc:
            self._finish(held, Answer.DENY, f"sandboxd: refused: {exc}")
            return
        except BaseException:
            self._finish(held, Answer.DENY, "sandboxd: refused: the question could not be recorded")
            raise
        with self._lock:
            if not held.done:
                heapq.heappush(self._deadlines, (held.deadline, next(self._ids), held))
                self._start_sweeper()
                self._lock.notify_all()

    def _withdraw(self, key: tuple[str, Question], waiter: int) -> None:
        with self._lock:                                # the question stays for the person (design §6.2)
            held = self._held.get(key)
            if held is not None:
                held.waiters.pop(waiter, None)

    def _refused(self, session: Session, question: Question, why: str) -> None:
        summary, arguments = card(question)
        self._store.note(session.id, [(EventType.PERMISSION_DENIED, "", TOOL, {
            "reason": REASON, "by": "sandbox", "summary": summary, "arguments": arguments, "detail": why,
            "message": f"network: denied by the sandbox ({REASON}): {summary}: {why}"})])

    # -- answers ---------------------------------------------------------------------------------

    def _decided(self, held: _Held, decision: str, rule: str, by: str, who: Caller | None = None) -> None:
        """The gate's callback (ResolveApproval's thread; "cancelled" when the session closed;
        ``who`` answered). A rule that does not cover the question raises, leaving it held."""
        question, session = held.question, held.session
        base = {"effect": Effect.NETWORK, "risk": Risk.MEDIUM, "summary": card(question)[0], "reason": REASON}
        if decision == ALLOW_SESSION:
            wanted = rule or question.proposal
            if not wanted:
                raise InvalidPolicy("this question has no proposal: give the rule to add, or allow it once")
            with session.lock:
                with_rule(session.policy, question, wanted)    # refused here, before any change, if it does not cover
            self._apply(session, lambda current: with_rule(current, question, wanted), who)
        if decision == DENY:
            if by == "user":
                self._remember_denial(session, question)
            self._store.append(session.id, EventType.PERMISSION_DENIED, call_id=held.call_id, tool=TOOL,
                               data={**base, "by": by, "detail": "", "message": f"network: denied by {by}"})
            self._finish(held, Answer.DENY, "sandboxd: refused when asked" if by == "user" else
                         "sandboxd: refused: the session closed")
            return
        self._store.append(session.id, EventType.PERMISSION_GRANTED, call_id=held.call_id, tool=TOOL,
                           data={**base, "by": "user", "decision": decision,
                                 **(acted_by(who) if who is not None else {})})
        self._finish(held, ANSWERS[decision], "")

    def _remember_denial(self, session: Session, question: Question) -> None:
        with self._lock:
            denied = self._denied.setdefault(session, OrderedDict())
            denied[_denied_key(question)] = None
            denied.move_to_end(_denied_key(question))
            while len(denied) > DENIED_PER_SESSION:
                denied.popitem(last=False)

    def _finish(self, held: _Held, answer: Answer, why: str) -> None:
        """Answer ``held``'s waiters: all of them, except for allow_once, which lets the oldest
        through only; the others stay held on a fresh question (one answer, one connection)."""
        again: _Held | None = None
        with self._lock:
            if held.done:
                return
            held.done = True
            waiters = list(held.waiters.items())
            held.waiters.clear()
            key = (held.session.id, held.question)
            if self._held.get(key) is held:
                del self._held[key]
            if answer == Answer.ALLOW_ONCE and len(waiters) > 1:
                waiters, rest = waiters[:1], waiters[1:]
                again = _Held(held.session, held.question, time.monotonic() + self._timeout)
                again.waiters.update(rest)
                self._held[key] = again                 # counted as the one it replaces
            else:
                left = self._count.get(held.session.id, 1) - 1
                if left > 0:
                    self._count[held.session.id] = left
                else:
                    self._count.pop(held.session.id, None)
        for _, on_answer in waiters:
            on_answer(answer, why)
        if again is not None:
            try:
                self._post(again)                       # a failure denies the rest (_post): the answer stands
            except Exception:  # noqa: BLE001
                log.exception("asking again about a network question's other connections")

    # -- the timeout ------------------------------------------------------------------------------

    def _start_sweeper(self) -> None:
        """The lock is held."""
        if self._sweeper is None:
            self._sweeper = threading.Thread(target=self._sweep, name="sandboxd-network-questions", daemon=True)
            self._sweeper.start()

    def _sweep(self) -> None:
        while True:
            with self._lock:
                while not self._closed and (not self._deadlines or self._deadlines[0][0] > time.monotonic()):
                    self._lock.wait(None if not self._deadlines else self._deadlines[0][0] - time.monotonic())
                if self._closed:
                    return
                _, _, held = heapq.heappop(self._deadlines)
            if held.done:
                continue
            if not self._gate.claim(held.session.id, held.call_id):
                with self._lock:                        # being answered now; if that answer fails, again later
                    if not held.done:
                        heapq.heappush(self._deadlines, (time.monotonic() + 1.0, next(self._ids), held))
                continue
            try:
                self._store.append(held.session.id, EventType.PERMISSION_DENIED, call_id=held.call_id, tool=TOOL,
                                   data={"effect": Effect.NETWORK, "risk": Risk.MEDIUM, "summary": card(held.question)[0],
                                         "reason": REASON, "by": "timeout",
                                         "detail": f"no answer within {self._timeout:g} s",
                                         "message": "network: denied by timeout"})
            except Exception:  # noqa: BLE001 (the refusal goes out whether or not it is recorded)
                log.exception("recording a network question's timeout")
            self._finish(held, Answer.DENY, f"sandboxd: refused: no answer within {self._timeout:g} s "
                                             "(approvals.timeout_seconds)")

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify_all()


def _denied_key(question: Question) -> _DeniedKey:
    return (question.host, question.port, question.method, question.path)


def _nothing() -> None:
    """The withdraw of a question answered at once."""


__all__ = ["NetworkQuestions", "card", "with_rule"]
