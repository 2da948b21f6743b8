"""Approvals a person answers (issue 17, item 3), against a real daemon: `sandboxctl exec` on a real
terminal (a pty) asks in place and reads one key; without a terminal it says how to answer;
`sandboxctl approvals --follow` shows and answers held calls from a second terminal, and only the
caller's own (user B never sees or answers user A's)."""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import BASE_ENV, SLOW
from daemon_fixtures import REPO, base, client  # noqa: F401 - pytest fixtures
from daemon_helpers import PYTHON, PlainUser, plain_users
from sandboxd.client import SandboxClient

SANDBOXCTL = str(REPO / ".venv" / "bin" / "sandboxctl")
HELD = ["--", "sh", "-c", "echo approved-run; exec true"]    # `exec`: no program it knows, so held
WAIT = 60 * SLOW


# A plain user cannot run the venv's interpreter (it lives under /root): start as root, import
# everything `sandboxctl` loads lazily, drop to the user, then run sandboxctl's main.
AS_USER = r"""
import os, sys, selectors, termios, json
import grpc, grpc._channel, grpc._common, grpc._utilities, grpc._interceptor, grpc._runtime_protos
import google.protobuf.json_format
import shutil, gettext, secrets, queue, threading, signal, errno, time
from sandboxd.cli import ctl, approval_prompt, env_args
ctl.build_parser().format_help()
uid, gid = int(sys.argv[1]), int(sys.argv[2])
os.setgroups([]); os.setgid(gid); os.setuid(uid)
sys.exit(ctl.main(sys.argv[3:]))
"""


def ctl_argv(base: Path, *args: str, user: PlainUser | None = None) -> list[str]:
    words = ["--socket", str(base / "run" / "sandboxd.sock"), *args]
    if user is None:
        return [SANDBOXCTL, *words]
    return [PYTHON, "-c", AS_USER, str(user.uid), str(user.gid), *words]


def ctl(base: Path, *args: str, user: PlainUser | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(ctl_argv(base, *args, user=user), capture_output=True, text=True, timeout=WAIT,
                          env=BASE_ENV, stdin=subprocess.DEVNULL, cwd="/")


def background(base: Path, *args: str, user: PlainUser | None = None) -> subprocess.Popen[str]:
    """A `sandboxctl` without a terminal (pipes), left running."""
    return subprocess.Popen(ctl_argv(base, *args, user=user), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=BASE_ENV, cwd="/")


class Terminal:
    """A `sandboxctl` on a pty of its own (stdin, stdout and stderr), as a person runs it."""

    def __init__(self, argv: list[str]) -> None:
        self.master, slave = os.openpty()
        self.proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env={**BASE_ENV, "TERM": "xterm"},
                                     start_new_session=True, cwd="/")
        os.close(slave)
        self.screen = ""

    def wait_for(self, text: str, count: int = 1) -> str:
        deadline = time.monotonic() + WAIT
        with selectors.DefaultSelector() as selector:
            selector.register(self.master, selectors.EVENT_READ)
            while self.screen.count(text) < count:
                assert time.monotonic() < deadline, f"never showed {text!r}: {self.screen!r}"
                if selector.select(0.2) and not self._read():
                    raise AssertionError(f"ended before showing {text!r}: {self.screen!r}")
        return self.screen

    def _read(self) -> bool:
        try:
            data = os.read(self.master, 4096)
        except OSError:                                   # EIO: every writer closed the pty
            return False
        self.screen += data.decode(errors="replace")
        return bool(data)

    def type(self, keys: str) -> None:
        os.write(self.master, keys.encode())

    def finish(self) -> tuple[int, str]:
        code = self.proc.wait(timeout=WAIT)
        while self._read():
            pass
        os.close(self.master)
        return code, self.screen

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=WAIT)
        try:
            os.close(self.master)
        except OSError:
            pass


def held_calls(base: Path, session_id: str, count: int = 1, user: PlainUser | None = None) -> list[str]:
    deadline = time.monotonic() + WAIT
    while len(listed := [line.split()[0] for line in ctl(base, "pending", session_id, user=user).stdout.splitlines()]) < count:
        assert time.monotonic() < deadline, "the call was never held"
        time.sleep(0.05)
    return listed


@pytest.fixture
def session_id(base: Path, client: SandboxClient) -> Iterator[str]:
    workspace = base / f"ask-{os.urandom(4).hex()}"
    workspace.mkdir()
    session = client.create_session(str(workspace), approval="on-request")
    yield session.id
    client.close_session(session.id)


def test_exec_asks_in_place_and_y_runs_it(base: Path, session_id: str) -> None:
    term = Terminal(ctl_argv(base, "exec", session_id, *HELD))
    try:
        screen = term.wait_for("[y] once  [s] session  [n] deny")
        assert "shell.exec" in screen and "Execute: echo approved-run; exec true" in screen
        assert "reason:  unknown_command" in screen and "risk:" in screen
        term.type("y")
        code, screen = term.finish()
    finally:
        term.stop()
    assert code == 0 and "allowed once" in screen and "approved-run" in screen, screen


def test_s_allows_the_session_so_the_next_call_is_not_held(base: Path, session_id: str) -> None:
    term = Terminal(ctl_argv(base, "exec", session_id, *HELD))
    try:
        term.wait_for("[n] deny")
        term.type("s")
        code, screen = term.finish()
    finally:
        term.stop()
    assert code == 0 and "allowed for this session" in screen and "approved-run" in screen, screen
    again = ctl(base, "exec", session_id, *HELD)           # no terminal: it would print a hint if held
    assert (again.returncode, again.stdout, again.stderr) == (0, "approved-run\n", "")
    granted = [json.loads(line)["data"]["by"] for line in ctl(
        base, "events", "--session", session_id, "--type", "PermissionGranted", "--json").stdout.splitlines()]
    assert granted == ["user", "session"]


@pytest.mark.parametrize("key", ["n", "\x03"])                # n, or Ctrl-C at the prompt
def test_n_denies_with_the_typed_reason(base: Path, session_id: str, key: str) -> None:
    term = Terminal(ctl_argv(base, "exec", session_id, *HELD))
    try:
        term.wait_for("[n] deny")
        term.type("x")                                       # not an answer: ignored, still asking
        term.type(key)
        code, screen = term.finish()
    finally:
        term.stop()
    assert code == 1 and "denied\r\n" in screen and "PERMISSION_DENIED" in screen, screen
    assert "denied by user (unknown_command)" in screen and "approved-run\r\n" not in screen
    assert "? denied" in screen                              # the keys typed were not echoed


def test_without_a_terminal_it_says_how_to_answer(base: Path, session_id: str) -> None:
    held = background(base, "exec", session_id, *HELD)
    try:
        [call_id] = held_calls(base, session_id)
        assert held.stderr is not None
        hint = "".join(held.stderr.readline() for _ in range(4))     # the summary, the argv, the cwd, how to answer
        assert "waiting for approval (unknown_command)" in hint and f"approve {session_id} {call_id}" in hint
        assert "\n  argv:    sh -c 'echo approved-run; exec true'\n" in hint, hint
        listed = [json.loads(line) for line in ctl(base, "approvals", "--json").stdout.splitlines()]
        assert {"session_id": session_id, "call_id": call_id} in [
            {"session_id": item["session_id"], "call_id": item["call_id"]} for item in listed]
        assert ctl(base, "deny", session_id, call_id).returncode == 0
        _, err = held.communicate(timeout=WAIT)
    finally:
        held.kill()
    assert held.returncode == 1 and "[y] once" not in err and "denied by user" in err


def test_follow_answers_calls_of_another_terminal(base: Path, session_id: str) -> None:
    """Held before it started (y), and held while it runs (n), each answered with one key."""
    first = background(base, "exec", session_id, *HELD)
    follower = None
    try:
        held_calls(base, session_id)
        follower = Terminal(ctl_argv(base, "approvals", "--follow"))
        follower.wait_for("[y] once  [s] session  [n] deny")
        follower.type("y")
        out, _ = first.communicate(timeout=WAIT)
        assert (first.returncode, out) == (0, "approved-run\n")
        second = background(base, "exec", session_id, "--", "sh", "-c", "echo second; exec true")
        follower.wait_for("[y] once  [s] session  [n] deny", count=2)
        assert "Execute: echo second; exec true" in follower.screen
        follower.type("n")
        _, err = second.communicate(timeout=WAIT)
        assert second.returncode == 1 and "denied by user" in err
        follower.wait_for("denied")
    finally:
        first.kill()
        if follower is not None:
            follower.stop()


def test_follow_without_a_terminal_prints_one_line_each(base: Path, session_id: str) -> None:
    follower = background(base, "approvals", "--follow", "--json")
    held = background(base, "exec", session_id, *HELD)
    try:
        assert follower.stdout is not None
        shown = json.loads(follower.stdout.readline())
        [call_id] = held_calls(base, session_id)
        assert (shown["session_id"], shown["call_id"], shown["reason"]) == (session_id, call_id, "unknown_command")
        assert ctl(base, "approve", session_id, call_id).returncode == 0      # it only shows; this answers
        assert held.wait(timeout=WAIT) == 0
    finally:
        follower.kill()
        follower.wait(timeout=WAIT)
        held.kill()


def test_user_b_never_sees_or_answers_user_a(base: Path, client: SandboxClient) -> None:
    with plain_users(2) as (alice, bob):
        sessions, calls, execs = {}, {}, []
        follower = None
        try:
            for user in (alice, bob):
                workspace = base / f"ask-{user.name}"
                workspace.mkdir()
                os.chown(workspace, user.uid, user.gid)
                created = ctl(base, "session", "create", str(workspace), user=user)
                assert created.returncode == 0, created.stderr
                sessions[user.name] = created.stdout.strip()
                execs.append(background(base, "exec", sessions[user.name], *HELD, user=user))
                [calls[user.name]] = held_calls(base, sessions[user.name], user=user)
            a_session, a_call, b_call = sessions[alice.name], calls[alice.name], calls[bob.name]
            # B lists its own held call (the control), never A's.
            listed = ctl(base, "approvals", user=bob).stdout
            assert b_call in listed and a_call not in listed and a_session not in listed
            for attempt in (("approvals", "--session", a_session), ("approve", a_session, a_call),
                            ("deny", a_session, a_call)):
                refused = ctl(base, *attempt, user=bob)
                assert refused.returncode == 1 and "NOT_FOUND" in refused.stderr, refused
            # B's follower on a terminal: asked about B's call only; y answers it, A's stays held.
            follower = Terminal(ctl_argv(base, "approvals", "--follow", user=bob))
            follower.wait_for("[n] deny")
            follower.type("y")
            out, _ = execs[1].communicate(timeout=WAIT)
            assert (execs[1].returncode, out) == (0, "approved-run\n")
            follower.wait_for("allowed once")
            assert a_call not in follower.screen and a_session not in follower.screen
            assert ctl(base, "pending", a_session, user=alice).stdout.split()[0] == a_call
            assert ctl(base, "approve", a_session, a_call, user=alice).returncode == 0     # A can
            out, _ = execs[0].communicate(timeout=WAIT)
            assert (execs[0].returncode, out) == (0, "approved-run\n")
        finally:
            if follower is not None:
                follower.stop()
            for proc in execs:
                proc.kill()
                proc.wait(timeout=WAIT)
            for session in sessions.values():
                client.close_session(session)
