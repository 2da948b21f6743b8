"""What the person approves is what runs (round 4's second hostile pass, finding 2).

(a) The environment a call sets is on every card: `BASH_ENV` turned `bash -c ls` into a script of
the agent's while the card read `Execute: ls`. Now sandboxctl's in-place prompt (on a real pty,
tmux), its hint, `approvals` (text and JSON) and the MCP elicitation show `env: BASH_ENV=...`;
denied, nothing runs; the control: allowed once, the variable's script does run.
(b) The MCP elicitation and hint showed only the summary, cut at 200 characters: a
`sh -c "pytest ... ; python3 -c ..."` ran a tail nobody saw. Now they add the whole command
(policy.approval_card, bounded) as sandboxctl's prompt does; the control: the summary alone
hides the tail, and allowed once, the tail runs.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import subprocess
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import mcp_types as types
import pytest
from hypothesis import given
from hypothesis import strategies as st

from conftest import BASE_ENV
from daemon_fixtures import base, client, daemon, ws  # noqa: F401 - pytest fixtures
from daemon_helpers import Daemon
from mcp_helpers import decide, mcp_client
from sandboxd.cli.approval_prompt import describe
from sandboxd.client import SandboxClient
from sandboxd.policy import approval_card
from sandboxd.policy.tools import SUMMARY_CHARS, summary_of
from sandboxd.printable import printable
from sandboxd.v1 import sandboxd_pb2 as pb
from test_printable import acted_on, joined, wait_held
from test_terminals import SANDBOXCTL, Tmux, tmux  # noqa: F401 - tmux: a pytest fixture

pytestmark = pytest.mark.timeout(300)
WAIT = 60.0

# -- the card's lines, alone ------------------------------------------------------------------------


def test_the_card_adds_the_environment_and_the_whole_command_only_when_needed() -> None:
    plain = json.dumps({"argv": ["ls", "-la"]})
    assert approval_card.lines("Execute: ls -la", plain) == []
    env = json.dumps({"argv": ["bash", "-c", "ls"], "env": {"LANG": "C", "BASH_ENV": "/ws/x y.sh"}})
    assert approval_card.lines("Execute: bash -c ls", env) == [("env", "BASH_ENV='/ws/x y.sh' LANG=C")]
    shell = json.dumps({"argv": ["/bin/sh", "-c", "ls\x1b[2K"]})
    assert approval_card.lines("Execute: ls\x1b[2K", shell) == [("argv", "/bin/sh -c 'ls\\x1b[2K'")]
    for bad in ("", "[]", "{", json.dumps({"argv": [1, 2]}), json.dumps({"env": "x"})):
        assert approval_card.lines("Execute: x", bad) == []


def test_the_card_lists_every_change_of_a_patch_when_the_summary_is_cut() -> None:
    """A patch's summary names each path and what git does there; cut at SUMMARY_CHARS, the card's
    ``changes`` line shows the rest (a rename or a new executable after many innocent edits), escaped."""
    changes = [f"f{n}.txt: modified" for n in range(40)] + ["victim\x1b[2K.txt: renamed to gone.txt"]
    call = json.dumps({"paths": ["/ws/x"], "changes": changes})
    summary = summary_of("patch.apply", path="; ".join(changes))
    assert "victim" not in summary
    [(label, text)] = approval_card.lines(summary, call)
    assert label == "changes" and text.endswith("victim\\x1b[2K.txt: renamed to gone.txt")
    short = ["a.txt: modified"]
    assert approval_card.lines(summary_of("patch.apply", path=short[0]), json.dumps({"changes": short})) == []


def test_the_card_shows_an_external_tools_arguments_escaped_and_bounded() -> None:
    call = json.dumps({"arguments": {"repo": "acme/site\x1b[2J", "pr": 7}})
    # JSON's escape of the ESC, itself shown escaped (a backslash is written twice): nothing raw.
    assert approval_card.lines("github__merge", call) == [("arguments", '{"repo": "acme/site\\\\u001b[2J", "pr": 7}')]
    assert approval_card.lines("github__list", json.dumps({"arguments": {}})) == []
    huge = approval_card.lines("fs__write", json.dumps({"arguments": {"content": "x" * 100_000}}))
    assert huge[0][0] == "arguments" and "characters not shown" in huge[0][1]
    assert len(huge[0][1]) < approval_card.ARGUMENTS_CHARS + 200
    # Arguments the gateway could record only the start of: the card says so, and shows no "end".
    head = '{"a":"\x1b' + "x" * (approval_card.RECORDED_ARGUMENTS_CHARS - 7)
    cut = approval_card.lines("fs__write", json.dumps({"arguments": {"truncated": True, "bytes": 99999,
                                                                      "sha256": "0" * 64, "head": head}}))
    assert cut[0][1].startswith("[99999 bytes of arguments: only the first 4,093 characters are shown")  # ESC: 4
    assert "\x1b" not in cut[0][1] and cut[0][1].endswith("x ...")
    # Only that exact form: the same keys with a shorter head are the model's own arguments, shown
    # as such (tests/test_mcp_gateway_hostile.py: they once hid what ran).
    forged = approval_card.lines("fs__write", json.dumps({"arguments": {"truncated": True, "bytes": 99999,
                                                                         "sha256": "0" * 64, "head": head[:-1]}}))
    assert "only the first" not in forged[0][1] and '"truncated": true' in forged[0][1]


def test_the_card_says_where_a_command_runs_escaped() -> None:
    """`./test.sh` in vendor/pkg is another script than the workspace's own: the card names the
    directory (round 4's third hostile pass approved an agent's script that way)."""
    call = json.dumps({"argv": ["./test.sh"], "cwd": "/ws/vendor/pkg"})
    assert approval_card.lines("Execute: ./test.sh", call) == [("cwd", "/ws/vendor/pkg")]
    hostile = json.dumps({"argv": ["ls"], "cwd": "/ws/\x1b[2J\u202e" + "d" * 3000})
    (label, text), = approval_card.lines("Execute: ls", hostile)
    assert label == "cwd" and not [char for char in text if acted_on(char)]
    assert text.startswith("/ws/\\x1b[2J") and "characters not shown" in text and len(text) < 1200


@given(st.text(min_size=1, max_size=3000), st.integers(40, 2000))
def test_a_bounded_part_is_escaped_bounded_and_says_what_it_leaves_out(text: str, limit: int) -> None:
    shown = approval_card.bounded(text, limit)
    assert not [char for char in shown if acted_on(char)]
    if len(printable(text)) <= limit:
        assert shown == printable(text)
    else:
        head, marker = shown.split(" ... [", 1)
        hidden = int(marker.split(" of ")[0].replace(",", ""))
        assert f" of {len(text):,} characters not shown: approve only what you have read] ... " in shown
        assert len(head) <= limit and len(shown) <= limit + 120 and hidden > 0
        assert printable(text).startswith(head)


def test_unknown_variables_come_first_and_what_does_not_fit_is_named() -> None:
    """A known variable's long value cannot push LD_PRELOAD (after it in the alphabet) off the card,
    and what does not fit is said."""
    line = approval_card.environment({"env": {"LANG": "C" * 5000, "LD_PRELOAD": "/ws/x.so"}})
    assert line == "LD_PRELOAD=/ws/x.so [1 more, values not shown: LANG]", line
    many = approval_card.environment({"env": {f"V{i:04d}": "v" * 100 for i in range(1000)}})
    assert many.startswith("V0000=vvv") and "[9" in many and "more, values not shown: V00" in many
    assert "characters not shown: approve only what you have read" in many
    assert len(many) < approval_card.ENV_CHARS + approval_card.ENV_CHARS // 2 + 200, len(many)


def test_a_file_writes_card_says_how_much_and_the_mode_given() -> None:
    assert approval_card.lines("Write: /ws/run.sh", json.dumps({"paths": ["/ws/run.sh"], "bytes": 19})) == [
        ("writes", "19 bytes")]
    given = json.dumps({"paths": ["/ws/run.sh"], "bytes": 1 << 20, "mode": 0o755})
    assert approval_card.lines("Write: /ws/run.sh", given) == [("writes", "1,048,576 bytes, mode 0755")]
    # Only a number is a size or a mode: anything else is no line (the card never shows a forged text).
    for odd in ({"bytes": "19\x1b[2J"}, {"bytes": True}, {"paths": ["/ws/a"]}):
        assert approval_card.lines("Write: /ws/a", json.dumps(odd)) == []
    assert approval_card.lines("Write: /ws/a", json.dumps({"bytes": 3, "mode": "0755"})) == [("writes", "3 bytes")]


def test_a_held_stop_names_what_it_stops_and_a_held_write_its_size_and_mode(client: SandboxClient,  # noqa: F811
                                                                             ws: Path) -> None:  # noqa: F811
    """Round 10's hostile pass: a held StopBackground showed "command: monitor.stop" (which process?),
    and a held WriteFile neither its size nor that it makes the file executable."""
    session_id = client.create_session(str(ws), approval="never").id
    try:
        name = "database\x1b[2J (keep running!)"
        job = client.start_background(session_id, ["sleep", "300"], name=name)
        client.update_policy(session_id, approval="always")
        calls: list[tuple[Callable[[], object], str, str]] = [
            (lambda: client.stop_background(session_id, job.id), f"Stop: {job.id} ({name}: sleep 300)",
             f"  command: Stop: {job.id} (database\\x1b[2J (keep running!): sleep 300)\n"),
            (lambda: client.write_file(session_id, "run.sh", b"#!/bin/sh\nexit 0\n", mode=0o755),
             f"Write: {ws}/run.sh", "  writes:  17 bytes, mode 0755\n"),
            (lambda: client.write_file(session_id, "notes.txt", b"x" * 5000), f"Write: {ws}/notes.txt",
             "  writes:  5,000 bytes\n")]
        for call, summary, card_line in calls:
            with ThreadPoolExecutor(1) as pool:
                running = pool.submit(call)
                held = wait_held(client, session_id)
                shown = describe(session_id, held)
                client.stub.ResolveApproval(pb.ResolveApprovalRequest(session_id=session_id, call_id=held.call_id,
                                                                      decision="deny"))
                with pytest.raises(grpc.RpcError) as denied:
                    running.result(timeout=WAIT)
            assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert held.summary == summary and card_line in shown, shown
            assert not [char for char in shown if acted_on(char) and char != "\n"], shown
        client.update_policy(session_id, approval="never")
        assert [listed.running for listed in client.list_background(session_id)] == [True]   # denied: runs on
        assert not (ws / "run.sh").exists()
    finally:
        client.close_session(session_id)


# -- (a) the environment, where a person reads it ---------------------------------------------------------


def bash_env_attack(ws: Path) -> tuple[Path, Path]:
    script = ws / "x.sh"
    script.write_text(f"touch {ws}/PWNED_bash_env\n")
    return script, ws / "PWNED_bash_env"


def test_the_in_place_prompt_shows_the_environment_on_a_real_terminal(daemon: Daemon, client: SandboxClient,  # noqa: F811
                                                                      ws: Path,  # noqa: F811
                                                                      tmux: Callable[[str], Tmux]) -> None:  # noqa: F811
    script, made = bash_env_attack(ws)
    session_id = client.create_session(str(ws), approval="on-request").id
    try:
        command = shlex.join([SANDBOXCTL, "--socket", daemon.socket, "exec", "--env", f"BASH_ENV={script}",
                              session_id, "--", "bash", "-c", "ls"])
        term = tmux(command)
        term.expect("[n] deny ?", within=WAIT)
        screen = joined(term)
        assert ["  command: Execute: ls", "  argv:    bash -c ls", f"  env:     BASH_ENV={script}"] == [
            line for line in screen.splitlines() if line.startswith(("  command:", "  argv:", "  env:"))], screen
        term.keys("n")
        term.expect("EXIT=1", within=WAIT)
        assert not made.exists()

        again = tmux(command)                                     # the control: allowed, the script runs
        again.expect("[n] deny ?", within=WAIT)
        assert f"  env:     BASH_ENV={script}" in joined(again).splitlines()
        again.keys("y")
        again.expect("EXIT=0", within=WAIT)
        assert made.exists()
    finally:
        client.close_session(session_id)


def stderr_shows(process: "subprocess.Popen[str]", text: str) -> bool:
    """Whether ``process``'s stderr shows ``text`` within WAIT (read a byte at a time, so that
    nothing after it is taken from a later communicate())."""
    assert process.stderr is not None
    seen, deadline = "", time.monotonic() + WAIT
    fd = process.stderr.fileno()
    os.set_blocking(fd, False)
    try:
        while text not in seen and time.monotonic() < deadline:
            try:
                chunk = os.read(fd, 1)
            except BlockingIOError:
                time.sleep(0.02)
                continue
            if not chunk:
                break
            seen += chunk.decode(errors="replace")
    finally:
        os.set_blocking(fd, True)
    return text in seen


def test_the_hint_and_approvals_listing_show_the_environment(daemon: Daemon, client: SandboxClient,  # noqa: F811
                                                             ws: Path) -> None:  # noqa: F811
    script, made = bash_env_attack(ws)
    session_id = client.create_session(str(ws), approval="on-request").id
    held_call = subprocess.Popen([SANDBOXCTL, "--socket", daemon.socket, "exec", "--env", f"BASH_ENV={script}",
                                  session_id, "--", "bash", "-c", "ls"], stdin=subprocess.DEVNULL,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=BASE_ENV, cwd="/")
    try:
        held = wait_held(client, session_id)
        assert held.summary == "Execute: ls" and json.loads(held.arguments_json)["env"] == {
            "BASH_ENV": str(script)}
        listing = subprocess.run([SANDBOXCTL, "--socket", daemon.socket, "approvals"], capture_output=True,
                                 text=True, timeout=60, env=BASE_ENV, check=True).stdout
        [line] = [line for line in listing.splitlines() if held.call_id in line]
        assert line.endswith(f"Execute: ls  argv: bash -c ls  cwd: {ws}  env: BASH_ENV={script}"), line
        as_json = subprocess.run([SANDBOXCTL, "--socket", daemon.socket, "approvals", "--json"], capture_output=True,
                                 text=True, timeout=60, env=BASE_ENV, check=True).stdout
        [entry] = [json.loads(line) for line in as_json.splitlines() if held.call_id in line]
        assert json.loads(entry["arguments_json"])["env"] == {"BASH_ENV": str(script)}
        # The hint is sandboxctl's to print once it sees its call held: wait for it before the
        # answer (under load the answer could come first, and a resolved call asks nobody).
        assert stderr_shows(held_call, f"  env:     BASH_ENV={script}\n"), "sandboxctl printed no hint"
        client.stub.ResolveApproval(pb.ResolveApprovalRequest(session_id=session_id, call_id=held.call_id,
                                                              decision="deny"))
        _, err = held_call.communicate(timeout=WAIT)
        assert "denied by user" in err, err
        assert not made.exists()
    finally:
        held_call.kill()
        client.close_session(session_id)


def test_the_mcp_elicitation_shows_the_environment(daemon: Daemon, client: SandboxClient,  # noqa: F811
                                                   ws: Path) -> None:  # noqa: F811
    script, made = bash_env_attack(ws)
    asked: list[types.ElicitRequestParams] = []

    async def scenario() -> None:
        async with mcp_client(daemon.socket, ws, elicitation=decide(["deny", "allow_once"], asked)) as mcp:
            await mcp.call_tool("shell", {"command": "bash -c ls", "env": {"BASH_ENV": str(script)}})
            assert not made.exists()
            await mcp.call_tool("shell", {"command": "bash -c ls", "env": {"BASH_ENV": str(script)}})

    asyncio.run(scenario())
    assert len(asked) == 2, asked
    for question in asked:
        assert f"env: BASH_ENV={script}" in question.message.splitlines(), question.message
    assert made.exists()                              # the control: the allowed call ran the variable's script


# -- (b) the whole command in the MCP elicitation and hint ------------------------------------------------

HIDDEN_TAIL = "pytest -q tests/unit " + "--tb=short " * 16 + "; python3 -c 'open(\"HIDDEN_TAIL_RAN\",\"w\")'"


def test_the_mcp_elicitation_shows_the_tail_the_summary_cuts(daemon: Daemon, client: SandboxClient,  # noqa: F811
                                                            ws: Path) -> None:  # noqa: F811
    summary = summary_of("shell.exec", ["/bin/sh", "-c", HIDDEN_TAIL])
    assert len(summary) <= SUMMARY_CHARS and "HIDDEN_TAIL_RAN" not in summary    # the control: the cut hides it
    asked: list[types.ElicitRequestParams] = []

    async def scenario() -> None:
        async with mcp_client(daemon.socket, ws, elicitation=decide(["deny", "allow_once"], asked)) as mcp:
            await mcp.call_tool("shell", {"command": HIDDEN_TAIL})
            assert not (ws / "HIDDEN_TAIL_RAN").exists()
            await mcp.call_tool("shell", {"command": HIDDEN_TAIL})

    asyncio.run(scenario())
    assert len(asked) == 2
    for question in asked:
        lines = question.message.splitlines()
        assert lines[1] == printable(summary), lines
        assert lines[2] == f"argv: {shlex.join(['/bin/sh', '-c', HIDDEN_TAIL])}", lines
    assert (ws / "HIDDEN_TAIL_RAN").exists()             # the control: allowed once, the tail ran


def test_the_mcp_hint_shows_the_tail_the_summary_cuts(daemon: Daemon, client: SandboxClient,  # noqa: F811
                                                     ws: Path) -> None:  # noqa: F811
    """A client without elicitation: the progress hint (also written on stderr) names the tail."""
    hints: list[str] = []

    async def scenario() -> None:
        async def on_progress(_done: float, _total: float | None, message: str | None) -> None:
            hints.append(message or "")
        async with mcp_client(daemon.socket, ws) as mcp:
            call = asyncio.ensure_future(mcp.call_tool("shell", {"command": HIDDEN_TAIL}, progress_callback=on_progress))
            deadline = time.monotonic() + WAIT
            while not hints:
                assert time.monotonic() < deadline, "no hint"
                await asyncio.sleep(0.05)
            answer = hints[0].split("`")[-2].split()                  # its own `sandboxctl deny S C`
            await asyncio.to_thread(subprocess.run, [SANDBOXCTL, "--socket", daemon.socket, *answer[1:]],
                                    timeout=60, check=True, capture_output=True)
            await call

    asyncio.run(scenario())
    assert f"; argv: {shlex.join(['/bin/sh', '-c', HIDDEN_TAIL])};" in hints[0], hints[0]
    assert not [char for char in hints[0] if acted_on(char)]
    assert not (ws / "HIDDEN_TAIL_RAN").exists()


def test_a_huge_command_is_shown_bounded_and_says_so(daemon: Daemon, client: SandboxClient,  # noqa: F811
                                                     ws: Path) -> None:  # noqa: F811
    """100,000 characters of padding between a harmless start and the tail: the card shows the
    start, the end and how much it leaves out, in a few kilobytes."""
    command = "true " + "x" * 100_000 + " ; python3 -c 'open(\"HIDDEN_TAIL_RAN\",\"w\")'"
    asked: list[types.ElicitRequestParams] = []

    async def scenario() -> None:
        async with mcp_client(daemon.socket, ws, elicitation=decide(["deny"], asked)) as mcp:
            await mcp.call_tool("shell", {"command": command})

    asyncio.run(scenario())
    [question] = asked
    argv_line = question.message.splitlines()[2]
    whole = shlex.join(["/bin/sh", "-c", command])
    assert argv_line.startswith("argv: /bin/sh -c 'true xxx") and argv_line.endswith(whole[-200:]), argv_line[-300:]
    assert "characters not shown: approve only what you have read" in argv_line
    assert len(question.message) < approval_card.COMMAND_CHARS + 1000
    assert not (ws / "HIDDEN_TAIL_RAN").exists()
