"""service/network_questions without a daemon: a real ApprovalGate and EventStore, sessions made
in memory, the proxy's side played by hand (what on_answer receives). The end-to-end behaviour
is tests/test_network_questions.py's; here the bounds and the rule check, each with its control."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from sandboxd.audit.store import EventStore, EventType, SessionRow
from sandboxd.errors import InvalidPolicy, NotFound
from sandboxd.network.questions import Answer, Question
from sandboxd.policy import Limits, SandboxPolicy, WorkspaceWrite
from sandboxd.policy.decision import ApprovalPolicy
from sandboxd.service.approvals import ApprovalGate
from sandboxd.service.callers import Caller
from sandboxd.service.network_questions import NetworkQuestions, card, with_rule
from sandboxd.service.sessions.state import Session

HOST = "api.example.test"


class Answers:
    def __init__(self) -> None:
        self.got: list[tuple[Answer, str]] = []
        self.done = threading.Event()

    def __call__(self, answer: Answer, why: str = "") -> None:
        self.got.append((answer, why))
        self.done.set()


def _session(store: EventStore, approval: ApprovalPolicy = ApprovalPolicy.ON_REQUEST) -> Session:
    policy = WorkspaceWrite(network_access=True, allowed_domains=("other.example.test",), unlisted="ask")
    session = Session("sess_" + str(id(store) % 100000), Caller(uid=0, gid=0, pid=1, is_root=True), "/ws", policy,
                      approval, Limits(), {})
    store.save_session(SessionRow(session.id, 0, 0, "", "/ws", {}, str(approval), {}, {}, {}, 0.0, None))
    return session


def _question(path: str = "", method: str = "CONNECT", host: str = HOST) -> Question:
    return Question(host=host, port=443, method=method, path=path, scheme="https", proposal=host,
                    proposal_kind="domain", why=f"{host} is not among the allowed domains")


@pytest.fixture
def parts(tmp_path: Path) -> tuple[EventStore, ApprovalGate]:
    store = EventStore(str(tmp_path / "events.db"))
    return store, ApprovalGate(store)


def test_duplicates_share_one_question_and_the_cap_refuses_one_more(parts: tuple[EventStore, ApprovalGate]) -> None:
    store, gate = parts
    questions = NetworkQuestions(gate, store, per_session=2, timeout=300)
    session = _session(store)
    first, twin, second, over = Answers(), Answers(), Answers(), Answers()
    questions.ask(session, _question(), first)
    questions.ask(session, _question(), twin)                    # the same question: shared
    questions.ask(session, _question(host="b.example.test"), second)
    assert len(gate.pending(session.id)) == 2
    questions.ask(session, _question(host="c.example.test"), over)
    assert over.got and over.got[0][0] == Answer.DENY and "quotas.network_questions_per_session" in over.got[0][1]
    call_id = next(call_id for call_id, call, _ in gate.pending(session.id) if HOST in call.summary)
    gate.resolve(session.id, call_id, "allow_once")
    assert first.got == [(Answer.ALLOW_ONCE, "")] and twin.got == [(Answer.ALLOW_ONCE, "")]
    questions.ask(session, _question(host="c.example.test"), over)   # control: room again, asked
    assert len(gate.pending(session.id)) == 2 and len(over.got) == 1
    questions.close()


def test_an_unanswered_question_is_denied_after_the_timeout(parts: tuple[EventStore, ApprovalGate]) -> None:
    store, gate = parts
    questions = NetworkQuestions(gate, store, timeout=0.2)
    session = _session(store)
    answers = Answers()
    questions.ask(session, _question(), answers)
    assert answers.done.wait(30)
    assert answers.got[0][0] == Answer.DENY and "approvals.timeout_seconds" in answers.got[0][1]
    assert gate.pending(session.id) == []
    denied = [event for event in store.query(session_ids=[session.id]) if event.type == EventType.PERMISSION_DENIED]
    assert denied and denied[-1].data["by"] == "timeout"
    questions.close()


def test_approval_never_refuses_without_asking(parts: tuple[EventStore, ApprovalGate]) -> None:
    store, gate = parts
    questions = NetworkQuestions(gate, store)
    session = _session(store, ApprovalPolicy.NEVER)
    answers = Answers()
    questions.ask(session, _question(), answers)
    assert answers.got[0][0] == Answer.DENY and "never" in answers.got[0][1]
    assert gate.pending(session.id) == []


def test_allow_for_the_session_applies_the_rule_and_a_rule_must_cover_the_request(
        parts: tuple[EventStore, ApprovalGate]) -> None:
    store, gate = parts
    applied: list[SandboxPolicy] = []
    questions = NetworkQuestions(gate, store, apply_policy=lambda session, policy: applied.append(policy))
    session = _session(store)
    answers = Answers()
    questions.ask(session, _question(), answers)
    (call_id, call, reason), = gate.pending(session.id)
    assert (call.tool, reason) == ("network", "network_request") and gate.proposal(session.id, call_id) == HOST
    with pytest.raises(InvalidPolicy, match="does not cover"):
        gate.resolve(session.id, call_id, "allow_session", "elsewhere.test")
    assert answers.got == [] and gate.pending(session.id)         # still held
    # A rule with allow once or deny would be dropped unsaid (hostile review r7b L7): refused, still held.
    for decision in ("allow_once", "deny"):
        with pytest.raises(InvalidPolicy, match="only when allowing for the session"):
            gate.resolve(session.id, call_id, decision, "*.example.test")
    assert answers.got == [] and gate.pending(session.id) and not applied
    gate.resolve(session.id, call_id, "allow_session", "*.example.test")
    assert applied and "*.example.test" in applied[-1].allowed_domains
    assert answers.got == [(Answer.ALLOW_SESSION, "")]
    with pytest.raises(NotFound):
        gate.resolve(session.id, call_id, "deny")


def test_the_card_escapes_what_the_sandbox_chose() -> None:
    summary, arguments = card(Question(host=HOST, port=80, method="GET", path="/a\x1b[31mred\x07", scheme="http"))
    assert "\x1b" not in summary and "\x07" not in summary and "\x1b" not in str(arguments)
    assert "/a" in summary and "[31mred" in summary


def test_an_endpoint_rule_must_allow_the_held_method_and_path() -> None:
    policy = WorkspaceWrite(network_access=True, allowed_domains=(HOST,), unlisted="ask")
    held = Question(host=HOST, port=443, method="POST", path="/repos/a/issues/1", scheme="https")
    added = with_rule(policy, held, f"{HOST}=POST:/repos/*/issues/*")
    assert f"{HOST}=POST:/repos/*/issues/*" in added.allowed_endpoints
    with pytest.raises(InvalidPolicy):
        with_rule(policy, held, f"{HOST}=GET:/repos/*/issues/*")
