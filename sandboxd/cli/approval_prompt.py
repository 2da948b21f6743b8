"""Held calls answered by a person: in place by `sandboxctl exec`, and from a second terminal
by `sandboxctl approvals --follow`.

Both ask the daemon (ListPendingApprovals, ResolveApproval), which shows and lets answer only
the caller's own sessions' calls; `approvals --follow` also keeps to sessions the caller owns
(root sees everyone's sessions, but follows its own). On a terminal one key answers: y (allow
once), s (allow for the session: later calls of the same tool run without asking), n (deny).
The key is read from the terminal in non-canonical mode without echo, and it never reaches
the command (exec forwards stdin only when it is not a terminal).

What the caller chose (the command, the tool, the reason, a held call's ids) is shown through
``printable``: an escape sequence, a carriage return or a newline in a command cannot redraw
the prompt or forge a line, and when the summary shows less than the whole command (a `sh -c`
shown by its script, a command cut at 200 characters) the prompt adds the argv as it will run,
and the environment the call sets (policy.approval_card: both bounded, saying what is not shown).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import sys
import threading
import time
from collections.abc import Iterator

import grpc

from sandboxd.cli.held_output import SOFT_RESET, HeldOutput
from sandboxd.cli.keys import CTRL_C, CTRL_D, KeyReader, person_at_terminal
from sandboxd.client import SandboxClient
from sandboxd.policy import approval_card
from sandboxd.printable import printable
from sandboxd.v1 import sandboxd_pb2 as pb

ANSWERS = {"y": "allow_once", "s": "allow_session", "n": "deny"}
SAID = {"allow_once": "allowed once", "allow_session": "allowed for this session", "deny": "denied"}
POLL_SECONDS = 0.25              # how often held calls are looked for, and a prompt checks its call


def new_context_id() -> str:
    """The execution_context_id one `sandboxctl exec` tags its call with, to find it among the
    session's held calls (another client's calls in the same session are not its to answer)."""
    return f"sandboxctl-{os.getpid()}-{secrets.token_hex(4)}"


@contextlib.contextmanager
def asked_here(client: SandboxClient, session_id: str, ctl: str) -> Iterator[str]:
    """One of sandboxctl's other calls that can be held (write, read, ls, patch, start, ps, stop):
    the execution_context_id to tag it with, while its held call is asked about here as exec's is
    (on a terminal; otherwise one line says how to answer). Another client's calls are not shown."""
    context_id = new_context_id()
    with ExecApprovals(client, session_id, context_id, ctl, interactive=on_terminal()):
        yield context_id


def on_terminal() -> bool:
    """A person can be asked: stdin and stderr are a terminal (keys.person_at_terminal)."""
    return person_at_terminal()


def describe(session_id: str, held: pb.PendingApproval) -> str:
    """What a person needs to decide, then the keys."""
    return (f"\nsandboxctl: approval needed (session {printable(session_id)}, call {printable(held.call_id)})\n"
            f"  tool:    {printable(held.tool)}\n  command: {printable(held.summary)}\n"
            + _card(held) +
            f"  reason:  {printable(held.reason) or '-'}    risk: {printable(held.risk) or '-'}\n"
            f"  [y] once  [s] session  [n] deny ? ")


def _card(held: pb.PendingApproval) -> str:
    """The lines below the summary (policy.approval_card): the argv when the summary is not the
    whole command (what `y` runs, not an abridgement), and the environment the call sets."""
    return "".join(f"  {label + ':':<9}{text}\n" for label, text in approval_card.lines(held.summary,
                                                                                      held.arguments_json))


def hint(session_id: str, held: pb.PendingApproval, ctl: str) -> str:
    """Without a terminal: how to answer from elsewhere (paste as is)."""
    session_id, call_id = printable(session_id), printable(held.call_id)
    return (f"sandboxctl: waiting for approval ({printable(held.reason)}): {printable(held.summary)}\n"
            + _card(held) +
            f"  {ctl} approve {session_id} {call_id} [--session-wide]"
            f"  |  {ctl} deny {session_id} {call_id}\n")


def pending(client: SandboxClient, session_id: str, *, missing_ok: bool = True) -> list[pb.PendingApproval]:
    """The session's held calls; none once the session is gone (NOT_FOUND unless ``missing_ok``)."""
    try:
        return list(client.stub.ListPendingApprovals(pb.ListPendingApprovalsRequest(session_id=session_id)).approvals)
    except grpc.RpcError as error:
        if missing_ok and error.code() == grpc.StatusCode.NOT_FOUND:
            return []
        raise


def still_held(client: SandboxClient, session_id: str, call_id: str) -> bool:
    return any(held.call_id == call_id for held in pending(client, session_id))


def resolve(client: SandboxClient, session_id: str, call_id: str, decision: str) -> str | None:
    """The canonical decision, or None when the call is no longer waiting (answered elsewhere,
    timed out, its caller left)."""
    try:
        return str(client.stub.ResolveApproval(pb.ResolveApprovalRequest(
            session_id=session_id, call_id=call_id, decision=decision)).decision)
    except grpc.RpcError as error:
        if error.code() == grpc.StatusCode.NOT_FOUND:
            return None
        raise


class ExecApprovals:
    """While `sandboxctl exec` (or another call, asked_here) waits, find its own call (by its
    execution_context_id) among the session's held calls and, on a terminal, ask in place;
    otherwise say once how to answer.
    ``output``: the command's way to this terminal, held while a card is up (cli.held_output)."""

    def __init__(self, client: SandboxClient, session_id: str, context_id: str, ctl: str,
                 interactive: bool, output: HeldOutput | None = None) -> None:
        self._client, self._session_id, self._context_id = client, session_id, context_id
        self._ctl, self._interactive = ctl, interactive
        self.output = output if output is not None else HeldOutput()
        self._keys = KeyReader(sys.stdin.fileno()) if interactive else None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="sandboxctl-approvals", daemon=True)

    def __enter__(self) -> "ExecApprovals":
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()
        # A card still up ends within POLL_SECONDS now; then (or if it hangs in a call to the
        # daemon) the command's last output, held meanwhile, is written before this process ends.
        self._thread.join(timeout=10 * POLL_SECONDS)
        self.output.release()

    def stop(self) -> None:
        """The call runs (or ended): stop looking, and give the terminal back as it was."""
        self._done.set()
        if self._keys is not None:
            self._keys.restore()

    def _watch(self) -> None:
        """Each held call of this context, once: the command's own, then (while it runs without a
        terminal of its own) the network questions its connections raise (service.network_questions)."""
        shown: set[str] = set()
        try:
            while not self._done.wait(POLL_SECONDS):
                mine = [held for held in pending(self._client, self._session_id)
                        if held.execution_context_id == self._context_id]
                shown &= {held.call_id for held in mine}       # only those still held: bounded
                fresh = [held for held in mine if held.call_id not in shown]
                if fresh:
                    shown.add(fresh[0].call_id)
                    self._answer(fresh[0])
        except grpc.RpcError:
            return                                            # the Exec stream reports the daemon's state

    def _answer(self, held: pb.PendingApproval) -> None:
        if self._keys is None:
            _say(hint(self._session_id, held, self._ctl))
            return
        last_check = [time.monotonic()]

        def keep_waiting() -> bool:
            if self._done.is_set():
                return False
            if time.monotonic() - last_check[0] < 2 * POLL_SECONDS:
                return True
            last_check[0] = time.monotonic()
            return still_held(self._client, self._session_id, held.call_id)

        # The command runs on (a network question) and writes to this terminal: none of its bytes
        # may come after the card until it is answered, and none from before may restyle it.
        with self.output.holding():
            key = self._keys.read(SOFT_RESET + describe(self._session_id, held), "ysn", keep_waiting=keep_waiting)
            if key is None:
                _say("(answered elsewhere)\n" if not self._done.is_set() else "\n")
                return
            decision = ANSWERS.get(key, "deny")               # Ctrl-C / Ctrl-D at the prompt: deny
            _say(f"{SAID[decision]}\n")                      # before: the answer may end this process
            if resolve(self._client, self._session_id, held.call_id, decision) is None:
                _say("(too late: it was answered elsewhere)\n")


def _say(text: str) -> None:
    sys.stderr.write(text)
    sys.stderr.flush()


def follow(client: SandboxClient, *, session_id: str = "", as_json: bool = False,
           interactive: bool = False, once: bool = False) -> int:
    """`sandboxctl approvals --follow`: every held call of the caller's own sessions, those held
    now first, then each as it appears. On a terminal each is answered with one key (Ctrl-C quits
    and leaves it held); otherwise each is printed once, one line (or one JSON object) each.
    ``once`` (no --follow): print those held now and return."""
    keys = KeyReader(sys.stdin.fileno()) if interactive else None
    seen: set[tuple[str, str]] = set()
    me = os.getuid()
    if session_id:
        pending(client, session_id, missing_ok=False)         # a session the caller may not see: say so
    while True:
        if session_id:
            sessions = [session_id]
        else:
            sessions = [s.id for s in client.list_sessions() if s.owner_uid == me]
        current = [(sid, held) for sid in sessions for held in pending(client, sid)]
        fresh = [(sid, held) for sid, held in current if (sid, held.call_id) not in seen]
        seen = {(sid, held.call_id) for sid, held in current}   # only what is held now: bounded
        for sid, held in fresh:
            if once or keys is None:
                _print_held(sid, held, as_json)
            else:
                _ask(client, keys, sid, held)
        if once:
            return 0
        if not fresh:
            time.sleep(POLL_SECONDS)


def _print_held(session_id: str, held: pb.PendingApproval, as_json: bool) -> None:
    if as_json:
        from google.protobuf.json_format import MessageToDict

        print(json.dumps({"session_id": session_id, **MessageToDict(held, preserving_proto_field_name=True)}),
              flush=True)
    else:
        print(held_line(held, session_id), flush=True)


def held_line(held: pb.PendingApproval, session_id: str = "") -> str:
    """One held call on one line: `approvals` (with its session) and `pending` (without); the
    card's other lines follow on it (``  argv: ...  env: ...``)."""
    session = f"{printable(session_id)} " if session_id else ""
    extra = "".join(f"  {label}: {text}" for label, text in approval_card.lines(held.summary, held.arguments_json))
    return (f"{session}{printable(held.call_id)}  {printable(held.tool):<14} risk={printable(held.risk):<6} "
            f"reason={printable(held.reason):<20} {printable(held.summary)}{extra}")


def _ask(client: SandboxClient, keys: KeyReader, session_id: str, held: pb.PendingApproval) -> None:
    last_check = [time.monotonic()]

    def keep_waiting() -> bool:
        if time.monotonic() - last_check[0] < 2 * POLL_SECONDS:
            return True
        last_check[0] = time.monotonic()
        return still_held(client, session_id, held.call_id)

    key = keys.read(describe(session_id, held), "ysn", keep_waiting=keep_waiting)
    if key == CTRL_C:
        _say("\n")
        raise KeyboardInterrupt
    if key == CTRL_D:                                         # no more input: leave the rest held
        _say("(left held)\n")
        raise SystemExit(0)
    if key is None:
        _say("(answered elsewhere)\n")
        return
    _say(f"{SAID[ANSWERS[key]]}\n")
    if resolve(client, session_id, held.call_id, ANSWERS[key]) is None:
        _say("(too late: it was answered elsewhere)\n")
