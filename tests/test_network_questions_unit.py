"""service/network_questions without a daemon: a real ApprovalGate and EventStore, sessions made
in memory, the proxy's side played by hand (what on_answer receives). The end-to-end behaviour
is tests/test_network_questions.py's; here the bounds and the rule check, each with its control."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any
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


@pytest.fixture(autouse=True)
def closed_questions(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every NetworkQuestions a test makes is closed after it, its sweeper thread gone (as the
    daemon closes its own): a later test in this process counts sandboxd's threads."""
    made: list[NetworkQuestions] = []
    real_init = NetworkQuestions.__init__

    def init(self: NetworkQuestions, *args: Any, **kwargs: Any) -> None:
        real_init(self, *args, **kwargs)
        made.append(self)
    monkeypatch.setattr(NetworkQuestions, "__init__", init)
    yield
    for questions in made:
        questions.close()
        sweeper = questions._sweeper
        if sweeper is not None:
            sweeper.join(30)
            assert not sweeper.is_alive()


@pytest.fixture
def parts(tmp_path: Path) -> Iterator[tuple[EventStore, ApprovalGate]]:
    store = EventStore(str(tmp_path / "events.db"))
    try:
        yield store, ApprovalGate(store)
    finally:
        store.close()                                   # and its checkpointer thread


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
    assert first.got == [(Answer.ALLOW_ONCE, "")] and twin.got == []     # one answer, one connection
    call_id = next(call_id for call_id, call, _ in gate.pending(session.id) if HOST in call.summary)
    gate.resolve(session.id, call_id, "allow_once")                       # the twin's fresh question
    assert twin.got == [(Answer.ALLOW_ONCE, "")]
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
    questions = NetworkQuestions(gate, store, apply_policy=lambda session, change, who: applied.append(change(session.policy)))
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


# -- The walls of hostile review r7b (each proof of concept turned into the check that it holds) ----

def test_one_allow_once_releases_one_connection_and_the_others_stay_held(
        parts: tuple[EventStore, ApprovalGate]) -> None:
    """M1: 200 connections ask the same thing; one "allow once" lets the oldest through only."""
    store, gate = parts
    questions = NetworkQuestions(gate, store, per_session=2, timeout=300)
    session = _session(store)
    waiters = [Answers() for _ in range(200)]
    withdraw = [questions.ask(session, _question(), waiter) for waiter in waiters]
    (call_id, _, _), = gate.pending(session.id)
    gate.resolve(session.id, call_id, "allow_once")
    assert waiters[0].got == [(Answer.ALLOW_ONCE, "")]
    assert all(waiter.got == [] for waiter in waiters[1:])          # still held...
    (again, _, _), = gate.pending(session.id)                          # ...on one fresh question
    assert again != call_id
    withdraw[1]()                                                      # a withdrawn one is not answered
    gate.resolve(session.id, again, "allow_once")
    assert waiters[1].got == [] and waiters[2].got == [(Answer.ALLOW_ONCE, "")]
    assert all(waiter.got == [] for waiter in waiters[3:])
    # Control: allow for the session lets every waiter through (the policy now allows them all).
    (third, _, _), = gate.pending(session.id)
    questions._apply = lambda target, change, who: None                # noqa: SLF001 (no proxy here)
    gate.resolve(session.id, third, "allow_session")
    assert all(waiter.got == [(Answer.ALLOW_SESSION, "")] for waiter in waiters[3:])
    assert gate.pending(session.id) == []
    questions.close()


def test_a_question_about_another_port_gets_no_session_rule_and_the_card_says_so(
        parts: tuple[EventStore, ApprovalGate]) -> None:
    """M2: a domain answer to a question about host:31337 would allow every port: none is offered."""
    from sandboxd.policy.network_advice import propose

    store, gate = parts
    policy = WorkspaceWrite(network_access=True, allowed_domains=("other.example.test",), unlisted="ask")
    assert propose(HOST, 31337, "CONNECT", "", policy.network_rules) is None
    assert propose(HOST, 443, "CONNECT", "", policy.network_rules) is not None       # control: the web's ports
    held = Question(host=HOST, port=31337, method="CONNECT", path="", scheme="https", why="x")
    summary, _ = card(held)
    assert "no rule for the session is offered" in summary and "every port" in summary
    questions = NetworkQuestions(gate, store, apply_policy=lambda target, change, who: None)
    session = _session(store)
    answers = Answers()
    questions.ask(session, held, answers)
    (call_id, _, _), = gate.pending(session.id)
    with pytest.raises(InvalidPolicy, match="no proposal"):
        gate.resolve(session.id, call_id, "allow_session")
    assert answers.got == [] and session.policy.network_rules.allowed(HOST, 22) is False
    gate.resolve(session.id, call_id, "allow_once")
    assert answers.got == [(Answer.ALLOW_ONCE, "")]
    questions.close()


def test_allow_for_the_session_keeps_an_owner_change_made_meanwhile(parts: tuple[EventStore, ApprovalGate]) -> None:
    """M3: the rule is added to the policy current under the build lock, not to one read before."""
    store, gate = parts
    session = _session(store)
    session.policy = WorkspaceWrite(network_access=True, allowed_domains=("other.example.test", "pypi.org"),
                                    unlisted="ask")

    def apply(target: Session, change: "object", who: "Caller | None") -> None:
        narrowed = WorkspaceWrite(network_access=True, allowed_domains=("other.example.test",), unlisted="refuse")
        with target.lock:
            target.policy = narrowed                                   # the owner's change lands first
        with target.lock:
            target.policy = change(target.policy)  # type: ignore[operator]

    questions = NetworkQuestions(gate, store, apply_policy=apply)
    questions.ask(session, _question(), Answers())
    (call_id, _, _), = gate.pending(session.id)
    gate.resolve(session.id, call_id, "allow_session")
    assert "pypi.org" not in session.policy.allowed_domains           # the owner's removal stands
    assert str(session.policy.network_rules.unlisted) == "refuse"
    assert HOST in session.policy.allowed_domains                      # and the answer's rule is added
    questions.close()


def test_a_denied_question_is_refused_unasked_for_the_rest_of_the_session(
        parts: tuple[EventStore, ApprovalGate]) -> None:
    """M4: the person said no once: the same question does not come back."""
    from sandboxd.service import network_questions

    store, gate = parts
    questions = NetworkQuestions(gate, store, per_session=16, timeout=300)
    session = _session(store)
    first = Answers()
    questions.ask(session, _question("/x", "GET"), first)
    (call_id, _, _), = gate.pending(session.id)
    gate.resolve(session.id, call_id, "deny")
    for _ in range(50):
        again = Answers()
        questions.ask(session, _question("/x", "GET"), again)
        assert again.got and again.got[0][0] == Answer.DENY and "denied earlier by the person" in again.got[0][1]
        assert gate.pending(session.id) == []
    other = Answers()                                                  # control: another path is asked
    questions.ask(session, _question("/y", "GET"), other)
    assert other.got == [] and len(gate.pending(session.id)) == 1
    # Bounded: past DENIED_PER_SESSION denials, the oldest is forgotten (asked again).
    for n in range(network_questions.DENIED_PER_SESSION):
        questions._remember_denial(session, _question(f"/n{n}", "GET"))   # noqa: SLF001
    asked = Answers()
    questions.ask(session, _question("/x", "GET"), asked)
    assert asked.got == [] and len(gate.pending(session.id)) == 2
    questions.close()


def test_a_long_path_leaves_the_method_and_host_on_the_card() -> None:
    """M6: an 8 KB path is cut on the card; the method and host stay on an 80x24 screen."""
    import json

    from sandboxd.cli.approval_prompt import describe, held_line
    from sandboxd.v1 import sandboxd_pb2 as pb

    tail = "/repos/me/project/issues/comments"
    path = "/gists/" + "a" * (8000 - len(tail)) + tail
    summary, arguments = card(Question(host="api.github.com", port=443, method="POST", path=path, scheme="https"))
    assert len(summary) < 400 and summary.startswith("network: POST https://api.github.com:443/gists/")
    assert "characters not shown" in summary and "/issues/comments" in summary
    held = pb.PendingApproval(call_id="call_1", tool="network", summary=summary, reason="network_request",
                              risk="medium", arguments_json=json.dumps(arguments))
    for shown in (describe("sess_x", held), held_line(held, "sess_x")):
        rows: list[str] = []
        for line in shown.split("\n"):
            rows += [line[i:i + 80] for i in range(0, max(len(line), 1), 80)]
        screen = "".join(rows[-23:])                                   # still on screen (wrapped)
        assert "POST" in screen and "api.github.com" in screen and "gists" in screen
    short, _ = card(Question(host="api.github.com", port=443, method="POST", path="/gists", scheme="https"))
    assert short == "network: POST https://api.github.com:443/gists"                 # control: a short one whole


def test_an_answer_by_another_caller_is_recorded_as_theirs(parts: tuple[EventStore, ApprovalGate]) -> None:
    """L1: root answering a user's question is recorded with root's uid, not the owner's."""
    store, gate = parts
    seen: list[Caller | None] = []
    questions = NetworkQuestions(gate, store, apply_policy=lambda target, change, who: seen.append(who))
    session = _session(store)
    session.owner = Caller(uid=1234, gid=1234, pid=1)
    admin = Caller(uid=0, gid=0, pid=2, is_root=True)
    questions.ask(session, _question(), Answers())
    (call_id, _, _), = gate.pending(session.id)
    gate.resolve(session.id, call_id, "allow_session", who=admin)
    assert seen == [admin]
    granted = [event for event in store.query(session_ids=[session.id]) if event.type == EventType.PERMISSION_GRANTED]
    assert granted and granted[-1].data["by_uid"] == 0
    questions.close()


def test_a_question_names_a_context_only_when_its_command_runs_alone(parts: tuple[EventStore, ApprovalGate]) -> None:
    """A network question goes to the one client whose command runs (its execution context); an
    untagged command or a background process running beside it (either may be the one asking)
    makes it nobody's in particular ("": answered through `approvals`). Control: alone, it is named."""
    from sandboxd.service.background import BackgroundJob
    from sandboxd.supervisor.spawner import ExitInfo

    store, _gate = parts
    session = _session(store)
    with session.running_in("mcp-a"):
        alone = session.only_context()
        with session.running_in(""):
            beside_untagged = session.only_context()
        job = BackgroundJob(session, "server", ["server"])
        with session.lock:
            session.jobs[job.id] = job
        beside_job = session.only_context()
        job.finish(ExitInfo(exit_code=0, signal=None, timed_out=False, wall_seconds=0.0, cpu_seconds=None,
                            peak_memory_bytes=None, oom_killed=False))
        after_job = session.only_context()
    assert (alone, beside_untagged, beside_job, after_job) == ("mcp-a", "", "", "mcp-a")
    assert session.only_context() == "" and session.exec_contexts == {}


def test_a_call_a_new_daemon_adopted_counts_as_untagged_while_it_runs(parts: tuple[EventStore, ApprovalGate]) -> None:
    """After a handover the adopted command's client is gone with the old daemon: while it runs, a
    network question (its connection's, as likely as anyone's) is not put to the one new client's
    context. Control: before the adoption, and once the adopted call ended, that client is named."""
    from sandboxd.service.call_results import CallResults
    from sandboxd.service.handover.adopt import Adopter
    from sandboxd.service.handover.tags import call_tag
    from sandboxd.supervisor.fork_client import Adoption
    from sandboxd.supervisor.fork_protocol import CallEnded, HeldCall

    store, _gate = parts
    session = _session(store)
    name = f"{session.id}#1"
    ended = threading.Event()

    class Registry:                                   # the parts of SessionRegistry adoption uses
        def find(self, session_id: str) -> Session | None:
            return session if session_id == session.id else None

        def adopt_sandbox(self, *_args: object) -> bool:
            return True

        def adopt_call(self, *_args: object) -> None: ...

        def call_ended(self, _session: Session) -> None: ...

        def end_call(self, _session: Session, _generation: int) -> None:
            ended.set()

    class Fork:                                       # the supervisor: the adopted call ends when told
        def __init__(self) -> None:
            self.end = threading.Event()

        def wait_held(self, call: int) -> CallEnded:
            assert self.end.wait(60)
            return CallEnded(call, 0, None, False, 0.1, None, None, False, call=call, session=name,
                             started_at=0.0, tag=call_tag("call_adopted", "shell.exec"))

    fork = Fork()
    adopter = Adopter(Registry(), fork, store, CallResults(None))
    with session.running_in("sandboxctl-new"):
        before = session.only_context()
        adopter.adopt(Adoption(sessions={name: object()}, running=(HeldCall(
            7, call=7, session=name, pid=100, inner_pid=101, started_at=0.0, tag=call_tag("call_adopted", "shell.exec")),), ended=()))
        while_adopted = session.only_context()
        fork.end.set()
        assert ended.wait(60)
        after = session.only_context()
    assert (before, while_adopted, after) == ("sandboxctl-new", "", "sandboxctl-new")
    assert session.exec_contexts == {}
