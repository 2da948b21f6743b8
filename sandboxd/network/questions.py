"""What the egress proxy asks when ``unlisted = ask`` (design §4.5, §6): the contract between the
proxy (network layer, on the relay loop) and whoever answers for the session (the daemon's
``service/network_questions.py``). The network layer cannot import the service: it is handed an
``Ask`` callable.

``ask(question, on_answer) -> withdraw``: called on one of the proxy loop's worker threads (never
the loop itself, so the asker may write its audit record), and must return promptly: the answer
comes later. ``on_answer(answer, why="")`` may be called once, from any thread (the proxy posts it
back to its loop); ``why`` says, for the sandbox's 403, why a DENY was not a person's (the cap of
questions, the approval policy ``never``, the timeout). ``withdraw()`` tells the
asker the held work is gone (the client left, the proxy closed) and no answer is wanted any more
(the asker may still keep the question for the person: design §6.2, a held question outlives its
client)."""

from __future__ import annotations

from typing import Callable, ClassVar, Protocol

from sandboxd._record import Choice, Record


class Answer(Choice):
    """A person's answer to a network question: this connection or request only, a rule added to
    the session's policy (live), or a refusal."""

    ALLOW_ONCE: ClassVar[Answer]
    ALLOW_SESSION: ClassVar[Answer]
    DENY: ClassVar[Answer]


Answer.define(ALLOW_ONCE="allow_once", ALLOW_SESSION="allow_session", DENY="deny")


class Question(Record):
    """A held connection or request, as a person is asked about it: never its headers or body.
    ``method`` is "CONNECT" and ``path`` "" for a tunnel (CONNECT, SOCKS5, a transparent
    connection); ``scheme`` is "https" or "http". ``proposal`` is the advisor's rule text
    (policy.network_advice.propose; "" when it has none) and ``proposal_kind`` "domain" or
    "endpoint"; ``why`` says, for a person, what the lists lack."""

    host: str
    port: int
    method: str
    path: str
    scheme: str
    proposal: str = ""
    proposal_kind: str = ""
    why: str = ""


class OnAnswer(Protocol):
    def __call__(self, answer: Answer, why: str = "") -> None: ...


Withdraw = Callable[[], None]
Ask = Callable[[Question, OnAnswer], Withdraw]
