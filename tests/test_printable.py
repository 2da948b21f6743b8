"""Every string a caller chooses is shown escaped (issue 24, item 5).

`sandboxd.printable.printable` first, on its own: property-based (hypothesis), nothing it returns
is a character a terminal or a log reader acts on or that hides from the eye, and it is one to
one (its output decodes back, so two strings never look the same); with a control each time (the
raw string fails the first check, an escaper that leaves the backslash alone fails the second).

Then the issue's attacks where a person reads them, on real terminals (tmux on a private socket,
as tests/test_terminals.py drives them) against a real daemon, each beside its control (the same
string printed raw, as sandboxctl printed it before, does rewrite the screen or forge the line):
a command with CR + `ESC[2K` + `ESC[8m` that would show `Execute: ls -la` at `sandboxctl exec`'s
in-place prompt and at `approvals --follow`; a newline in a plain user's command that would forge
a `PermissionGranted ... by=user` line for another session in root's `sandboxctl events`; a
directory a plain user's sandbox names that would forge a daemon log line; and the MCP
elicitation and hint a client shows its user.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shlex
import subprocess
import sys
import time
import unicodedata
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mcp_types as types
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from conftest import BASE_ENV
from daemon_fixtures import base, client, daemon, ws  # noqa: F401 - pytest fixtures
from daemon_helpers import Daemon, DaemonFactory, PlainUser, plain_users, run_client_as
from mcp_helpers import decide, mcp_client
from sandboxd.client import SandboxClient
from sandboxd.printable import printable
from sandboxd.service.server import JsonLogFormatter, TextLogFormatter
from sandboxd.v1 import sandboxd_pb2 as pb
from test_terminals import SANDBOXCTL, Tmux, tmux  # noqa: F401 - tmux: a pytest fixture

pytestmark = pytest.mark.timeout(240)

# -- the function ---------------------------------------------------------------------------------

# Unicode's Default_Ignorable_Code_Point (DerivedCoreProperties.txt, Unicode 15.1), written out
# here again rather than read from the module under test.
DEFAULT_IGNORABLE = [(0x00AD, 0x00AD), (0x034F, 0x034F), (0x061C, 0x061C), (0x115F, 0x1160), (0x17B4, 0x17B5),
                     (0x180B, 0x180F), (0x200B, 0x200F), (0x202A, 0x202E), (0x2060, 0x206F), (0x3164, 0x3164),
                     (0xFE00, 0xFE0F), (0xFEFF, 0xFEFF), (0xFFA0, 0xFFA0), (0xFFF0, 0xFFF8), (0x1BCA0, 0x1BCA3),
                     (0x1D173, 0x1D17A), (0xE0000, 0xE0FFF)]
# What the issue names, and its neighbours: C0 (ESC, CR, LF, TAB, BEL, BS, NUL), DEL, C1 (CSI,
# OSC, NEL), no-break space, soft hyphen, the Arabic letter mark, zero-width characters, LRM/RLM,
# the line and paragraph separators, the bidi embeddings, overrides and isolates, a Hangul filler,
# a variation selector, the byte-order mark, private use, a lone surrogate (a non-UTF-8 byte of a
# file name), tag characters, and the backslash that makes escapes unambiguous.
DANGEROUS = ("\x00\x07\x08\t\n\x0b\x0c\r\x1b\x7f\x80\x85\x90\x9b\x9c\x9d\x9f\xa0\xad\u061c\u200b\u200c\u200d"
             "\u200e\u200f\u2028\u2029\u202a\u202b\u202c\u202d\u202e\u2060\u2066\u2067\u2068\u2069\u3000\u3164"
             "\ufe0f\ufeff\ue000\udc80\U000e0001\U000e0041\U000e0100\\")
TEXTS = st.text(alphabet=st.characters(exclude_categories=()) | st.sampled_from(DANGEROUS))


def acted_on(char: str) -> bool:
    """A character a terminal or log reader would act on, or that a person could not see: any
    control, format, surrogate, private-use or unassigned one (C*), any separator but the space
    (Z*), and what Unicode draws as nothing."""
    category = unicodedata.category(char)
    return (category.startswith("C") or (category.startswith("Z") and char != " ")
            or any(first <= ord(char) <= last for first, last in DEFAULT_IGNORABLE))


def decode(shown: str) -> str:
    """The inverse of printable, written here from its documented escapes."""
    out, i = [], 0
    while i < len(shown):
        char = shown[i]
        if char != "\\":
            out.append(char)
            i += 1
            continue
        kind = shown[i + 1]
        if kind in "\\nrt":
            out.append({"\\": "\\", "n": "\n", "r": "\r", "t": "\t"}[kind])
            i += 2
            continue
        width = {"x": 2, "u": 4, "U": 8}[kind]
        digits = shown[i + 2:i + 2 + width]
        assert len(digits) == width and all(d in "0123456789abcdef" for d in digits), shown[i:]
        out.append(chr(int(digits, 16)))
        i += 2 + width
    return "".join(out)


@given(TEXTS)
def test_nothing_shown_is_acted_on(text: str) -> None:
    shown = printable(text)
    assert [char for char in shown if acted_on(char)] == [], repr(shown)
    assert shown.isprintable()


@given(TEXTS)
@example("\\x1b")
@example("a\\\\nb")
def test_what_is_shown_decodes_back(text: str) -> None:
    """One to one: the rendering decodes back to the string (so no two strings share it)."""
    assert decode(printable(text)) == text


@given(TEXTS, TEXTS)
@example("\x1b", "\\x1b")
@example("\n", "\\n")
@example("\\", "\\\\")
@example("\u202e", "\\u202e")
def test_two_strings_never_look_the_same(first: str, second: str) -> None:
    assert (printable(first) == printable(second)) == (first == second)


def test_the_escapes_as_a_person_reads_them() -> None:
    assert printable("x\r\x1b[2Kls -la\x1b[8m") == "x\\r\\x1b[2Kls -la\\x1b[8m"
    assert printable("a\nb\tc\\d") == "a\\nb\\tc\\\\d"
    assert printable("\u202eexe.txt\u2066\u200e\u061c") == "\\u202eexe.txt\\u2066\\u200e\\u061c"
    assert printable("\x9b2J\x7f\x00\xa0\xad") == "\\x9b2J\\x7f\\x00\\xa0\\xad"
    assert printable("\U000e0041\udc80\u3164") == "\\U000e0041\\udc80\\u3164"
    for kept in ("ls -la", "Execute: pytest -q 'a b'", "/home/josé/日本/файл.txt", "😀", ""):
        assert printable(kept) == kept


def test_controls_the_checks_can_fail() -> None:
    """The raw string fails the first property, and an escaper that leaves the backslash alone
    (Python's repr without its quotes, say) fails the second."""
    assert all(acted_on(char) for char in DANGEROUS if char != "\\")

    def naive(text: str) -> str:
        return "".join(char if char.isprintable() else printable(char) for char in text)
    assert naive("\x1b") == naive("\\x1b") and printable("\x1b") != printable("\\x1b")


def test_a_log_record_is_one_line_whatever_it_quotes() -> None:
    """The daemon's text log line: a caller's string in the message or a field cannot start a line
    or act on the terminal; the JSON line holds it exactly, escaped by json.dumps."""
    forged = "/ws/x\nsandboxd error: forged\x1b[2K\r\u202e"
    record = logging.LogRecord("sandboxd", logging.WARNING, __file__, 1, "session %s: removed %s", ("s1", forged),
                               None)
    record.fields = {"path": forged}
    text = TextLogFormatter().format(record)
    assert len(text.splitlines()) == 1 and not [char for char in text if acted_on(char)], text
    assert text == (f"sandboxd warning: session s1: removed {printable(forged)} (path={printable(forged)})")
    line = JsonLogFormatter().format(record)
    assert line.isascii() and line.isprintable() and json.loads(line)["path"] == forged
    raw = logging.Formatter("sandboxd %(levelname)s: %(message)s").format(record)   # the control
    assert "sandboxd error: forged\x1b[2K\r\u202e" in raw.split("\n")


# -- the attacks, where a person reads them --------------------------------------------------------

WAIT = 60.0
# The script of `sh -c`: it writes a file, and after a comment redraws its own line so that the
# prompt's command line reads `Execute: ls -la`, then hides whatever follows.
PROMPT_ATTACK = "python3 -c \"open('pwned', 'w').write('ran')\" #\r\x1b[2K  command: Execute: ls -la\x1b[8m"
FAKE_LINE = "  command: Execute: ls -la"


def joined(term: Tmux, *, attributes: bool = False) -> str:
    """The screen with wrapped lines joined (and with -e, the attributes as escape sequences)."""
    return term.run("capture-pane", "-p", "-J", *(["-e"] if attributes else []), "-t", "t")


def show_raw(directory: Path, text: str) -> str:
    """A shell command that writes ``text`` to the terminal as it is, then waits: the controls."""
    path = directory / f"raw-{os.urandom(3).hex()}.json"
    path.write_text(json.dumps(text))
    return shlex.join([sys.executable, "-c", "import json, sys, time; sys.stderr.write(json.load(open(sys.argv[1]))); "
                       "sys.stderr.flush(); time.sleep(600)", str(path)])


def old_prompt(held: pb.PendingApproval) -> str:
    """The in-place prompt as sandboxctl wrote it before, the summary raw (the control)."""
    return (f"\nsandboxctl: approval needed (session s, call {held.call_id})\n"
            f"  tool:    {held.tool}\n  command: {held.summary}\n"
            f"  reason:  {held.reason or '-'}    risk: {held.risk or '-'}\n"
            f"  [y] once  [s] session  [n] deny ? ")


def wait_held(client: SandboxClient, session_id: str) -> pb.PendingApproval:  # noqa: F811
    deadline = time.monotonic() + WAIT
    while not (held := list(client.stub.ListPendingApprovals(pb.ListPendingApprovalsRequest(
            session_id=session_id)).approvals)):
        assert time.monotonic() < deadline, "the call was never held"
        time.sleep(0.05)
    return held[0]


def assert_real_command_shown(screen: str, styled: str) -> None:
    assert f"command: Execute: {printable(PROMPT_ATTACK)}" in screen, screen
    assert f"argv:    {printable(shlex.join(['sh', '-c', PROMPT_ATTACK]))}" in screen, screen
    assert FAKE_LINE not in screen.splitlines(), screen
    assert "[y] once  [s] session  [n] deny ?" in screen
    assert "\x1b[8m" not in styled and ";8m" not in styled, styled          # nothing hidden


def test_the_in_place_prompt_shows_the_real_command(daemon: Daemon, client: SandboxClient, ws: Path,  # noqa: F811
                                                    tmux: Callable[[str], Tmux]) -> None:  # noqa: F811
    session_id = client.create_session(str(ws), approval="on-request").id
    try:
        command = shlex.join([SANDBOXCTL, "--socket", daemon.socket, "exec", session_id, "--", "sh", "-c",
                              PROMPT_ATTACK])
        term = tmux(command)
        term.expect("[n] deny ?", within=WAIT)
        assert_real_command_shown(joined(term), joined(term, attributes=True))
        held = wait_held(client, session_id)
        term.keys("n")
        term.expect("EXIT=1", within=WAIT)
        assert not (ws / "pwned").exists()

        control = tmux(show_raw(ws.parent, old_prompt(held)))
        screen = control.expect("[n] deny ?", within=WAIT)
        assert FAKE_LINE in joined(control).splitlines() and "python3" not in screen, screen
        assert "\x1b[8m" in joined(control, attributes=True)                   # the rest of it hidden
    finally:
        client.close_session(session_id)


def test_approvals_follow_shows_the_real_command(daemon: Daemon, client: SandboxClient, ws: Path,  # noqa: F811
                                                 tmux: Callable[[str], Tmux]) -> None:  # noqa: F811
    session_id = client.create_session(str(ws), approval="on-request").id
    held_call = subprocess.Popen([SANDBOXCTL, "--socket", daemon.socket, "exec", session_id, "--", "sh", "-c",
                                  PROMPT_ATTACK], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, env=BASE_ENV, cwd="/")
    try:
        held = wait_held(client, session_id)
        assert held.summary == f"Execute: {PROMPT_ATTACK}"                  # the store holds it as sent
        # Without a terminal, the in-place hint says it in one escaped line too: read before the call
        # is answered elsewhere (exec looks for its held call every 0.25 s; the answer can come first).
        assert held_call.stderr is not None
        with ThreadPoolExecutor(1) as reader:
            hint = reader.submit(held_call.stderr.readline).result(timeout=WAIT)
        assert hint == f"sandboxctl: waiting for approval (unknown_command): Execute: {printable(PROMPT_ATTACK)}\n"
        term = tmux(shlex.join([SANDBOXCTL, "--socket", daemon.socket, "approvals", "--follow"]))
        term.expect("[n] deny ?", within=WAIT)
        assert_real_command_shown(joined(term), joined(term, attributes=True))
        term.keys("n")
        _, err = held_call.communicate(timeout=WAIT)
        assert "denied by user" in err and not (ws / "pwned").exists()
    finally:
        held_call.kill()
        client.close_session(session_id)


@pytest.fixture(scope="module")
def attacker() -> Iterator[PlainUser]:
    with plain_users(1) as made:
        yield made[0]


def owned_workspace(base: Path, user: PlainUser) -> Path:  # noqa: F811
    path = base / f"ws-{os.urandom(4).hex()}"
    path.mkdir(mode=0o755)
    os.chown(path, user.uid, user.gid)
    return path


EXEC_AS_USER = r'''
session = stub.CreateSession(pb.CreateSessionRequest(workspace=ARGS["ws"], approval_policy=pb.NEVER))
start = pb.ExecStart(session_id=session.id, argv=["sh", "-c", ARGS["script"]], env={"PATH": "/usr/bin:/bin"})
code = None
for reply in stub.Exec(iter([pb.ExecRequest(start=start)]), timeout=120):
    if reply.WhichOneof("kind") == "result":
        code = reply.result.exit_code
print(json.dumps({"session": session.id, "code": code}))
'''


def test_a_newline_in_a_command_cannot_forge_an_event_line(daemon: Daemon, client: SandboxClient,  # noqa: F811
                                                           base: Path, ws: Path, attacker: PlainUser,  # noqa: F811
                                                           tmux: Callable[[str], Tmux]) -> None:  # noqa: F811
    """A plain user's command carries a whole `PermissionGranted ... by=user` line for root's own
    session after a newline; root reads the grants with `sandboxctl events`."""
    victim = client.create_session(str(ws), approval="on-request").id
    when = time.strftime("%H:%M:%S")
    forged = (f"{when}     42 {victim}#7    PermissionGranted        shell.exec     call_0123456789ab  by=user "
              f"Execute: cat /etc/shadow")
    workspace = owned_workspace(base, attacker)
    reply = run_client_as(attacker.uid, attacker.gid, daemon.socket, EXEC_AS_USER,
                          {"ws": str(workspace), "script": f"true\n{forged}"})
    try:
        term = tmux(shlex.join([SANDBOXCTL, "--socket", daemon.socket, "events", "--type", "PermissionGranted"]))
        screen = term.expect("EXIT=0", within=WAIT)
        lines = joined(term).splitlines()
        [line] = [line for line in lines if reply["session"] in line]
        assert line.endswith(f"Execute: true\\n{forged}"), screen
        assert not [line for line in lines if line.startswith(f"{when}     42 {victim}")], screen

        [event] = [event for event in client.stub.QueryEvents(pb.QueryEventsRequest(
            session_id=reply["session"], types=["PermissionGranted"])).events]
        summary = json.loads(event.data_json)["summary"]
        assert summary == f"Execute: true\n{forged}"                      # the store is intact
        control = tmux(show_raw(base, f"{line.split(' Execute: ')[0]} {summary}\n"))
        control.expect("cat /etc/shadow", within=WAIT)
        assert forged in joined(control).splitlines()                     # a line of its own
    finally:
        client.close_session(victim)
        client.close_session(reply["session"])


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_a_path_a_sandbox_names_cannot_forge_a_log_line(sandboxd_daemon: DaemonFactory, attacker: PlainUser,
                                                        log_format: str) -> None:
    """The git guard logs the repository it neutralised; a plain user's sandbox names that
    directory with a newline, a log line of its own and an escape sequence."""
    logging_daemon = sandboxd_daemon(args=["--log-format", log_format])
    forged = "sandboxd error: fork server died: every sandbox died with it (forged)"
    script = ('d="$(printf "repo\\n%s\\033[2K" "$FORGED")" && mkdir -p "$d/.git" && '
              'printf "[core]\\n\\tfsmonitor = touch /tmp/never\\n" > "$d/.git/config" && '
              'printf "ref: refs/heads/main\\n" > "$d/.git/HEAD"')
    workspace = owned_workspace(sandboxd_daemon.base, attacker)
    body = EXEC_AS_USER.replace('{"PATH": "/usr/bin:/bin"}', '{"PATH": "/usr/bin:/bin", "FORGED": ARGS["forged"]}')
    reply = run_client_as(attacker.uid, attacker.gid, logging_daemon.socket, body,
                          {"ws": str(workspace), "script": script, "forged": forged})
    assert reply["code"] == 0, reply
    logging_daemon.stub.CloseSession(pb.CloseSessionRequest(session_id=reply["session"]), timeout=WAIT)
    deadline = time.monotonic() + WAIT
    while not (logged := [line for line in logging_daemon.log().splitlines() if "(forged)" in line]):
        assert time.monotonic() < deadline, logging_daemon.log()
        time.sleep(0.1)
    [line] = logged                                                        # one line, whatever it quotes
    assert not [char for char in line if acted_on(char)], line
    raw = (f"session {reply['session']}: git guard: removed config-key 'core.fsmonitor' in "
           f"{workspace}/repo\n{forged}\x1b[2K/.git")
    if log_format == "text":
        assert line == f"sandboxd warning: {printable(raw)}"
        shown_raw = decode(line)
    else:
        assert json.loads(line)["msg"] == raw                               # held exactly, inside its quotes
        shown_raw = f"sandboxd warning: {json.loads(line)['msg']}"
    # The control: the message printed raw starts a line that reads as the daemon's own.
    assert f"{forged}\x1b[2K/.git" in shown_raw.split("\n")


def test_the_mcp_elicitation_and_hint_show_the_command_escaped(daemon: Daemon, client: SandboxClient,  # noqa: F811
                                                               ws: Path) -> None:  # noqa: F811
    """What an MCP client shows its user: the elicitation's message, and the progress hint (the
    same text `sandboxd mcp` writes on stderr) when the client cannot elicit."""
    command = f"echo hi\r\x1b[2Kecho harmless\u202e\nsandboxd: all good{chr(0x1b)}[8m"
    asked: list[types.ElicitRequestParams] = []
    hints: list[str] = []

    async def scenario() -> None:
        async with mcp_client(daemon.socket, ws, "--approval", "always", elicitation=decide(["deny"], asked)) as mcp:
            await mcp.call_tool("shell", {"command": command})

        async def on_progress(_done: float, _total: float | None, message: str | None) -> None:
            hints.append(message or "")
        async with mcp_client(daemon.socket, ws, "--approval", "always") as mcp:
            call = asyncio.ensure_future(mcp.call_tool("shell", {"command": command}, progress_callback=on_progress))
            deadline = time.monotonic() + WAIT
            while not hints:
                assert time.monotonic() < deadline, "no hint"
                await asyncio.sleep(0.05)
            answer = hints[0].split("`")[3].split()                 # the hint's own `sandboxctl deny ...`
            await asyncio.to_thread(subprocess.run, [SANDBOXCTL, "--socket", daemon.socket, *answer[1:]],
                                    timeout=60, check=True, capture_output=True)
            await call

    asyncio.run(scenario())
    [question] = asked
    message = question.message
    session_id = message.splitlines()[-1].split()[1].rstrip(",")            # "Session S, call C."
    [event] = client.stub.QueryEvents(pb.QueryEventsRequest(session_id=session_id,
                                                            types=["PermissionRequested"])).events
    summary = json.loads(event.data_json)["summary"]
    assert summary.endswith(command) and [char for char in summary if acted_on(char)]  # the control: it came raw
    assert message.splitlines()[1] == printable(summary), message
    # The summary shows the script alone: the argv follows, as sandboxctl's prompt adds it.
    assert message.splitlines()[2] == f"argv: {printable(shlex.join(['/bin/sh', '-c', command]))}", message
    assert message.splitlines()[3].startswith("cwd: /"), message
    assert len(message.splitlines()) == 5 and not [char for char in message if acted_on(char) and char != "\n"]
    assert f": {printable(summary)};" in hints[0] and not [char for char in hints[0] if acted_on(char)], hints[0]
