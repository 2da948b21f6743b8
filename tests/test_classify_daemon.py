"""Round 4's second hostile pass, finding 1, through a real daemon: commands the classifier used to
call read-only ran other programs or wrote outside the workspace without anyone being asked,
under on-request (the default of sandboxctl and sandboxd mcp). As a plain user (the victim's
own agent is the attacker), in a danger-full-access session and in a workspace-write one:

* each command of the finding is now held (unknown_command) and, denied, leaves no file;
* the control that it is an attack: answered allow_once, the same command does make its file;
* the control that nothing else changed: a truly read-only command runs without asking, and
  `touch` outside the workspace is held as destructive_effect, as before.

The held call's card carries the environment the call sets (finding 2a): `arguments_json` and the
audit event hold BASH_ENV, its value included.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from daemon_fixtures import base, daemon  # noqa: F401 - pytest fixtures
from daemon_helpers import Daemon, PlainUser, owned_dir, plain_users, run_client_as
from sandboxd.v1 import sandboxd_pb2 as pb

pytestmark = pytest.mark.timeout(600)

CASES = r'''
import threading, time
session = stub.CreateSession(pb.CreateSessionRequest(workspace=ARGS["ws"], approval_policy=pb.ON_REQUEST,
                                                     sandbox_policy=pb.SandboxPolicy(mode=ARGS["mode"])))
results = []
for case in ARGS["cases"]:
    box = {}
    def go():
        start = pb.ExecStart(session_id=session.id, argv=case["argv"], env_overlay=case.get("env", {}))
        if case.get("terminal"):
            start.terminal.CopyFrom(pb.Terminal(rows=24, columns=80))
        try:
            for reply in stub.Exec(iter([pb.ExecRequest(start=start)]), timeout=180):
                if reply.WhichOneof("kind") == "result":
                    box["code"] = reply.result.exit_code
        except grpc.RpcError as error:
            box["error"] = error.code().name
    worker = threading.Thread(target=go)
    worker.start()
    held, deadline = None, time.monotonic() + 120
    while worker.is_alive() and time.monotonic() < deadline:
        pending = stub.ListPendingApprovals(pb.ListPendingApprovalsRequest(session_id=session.id)).approvals
        if pending:
            held = pending[0]
            break
        time.sleep(0.05)
    if held is not None:
        stub.ResolveApproval(pb.ResolveApprovalRequest(session_id=session.id, call_id=held.call_id,
                                                       decision=case["answer"]))
    worker.join(180)
    results.append({"held": held is not None, "reason": held.reason if held else "",
                    "arguments": json.loads(held.arguments_json) if held else None, **box,
                    "made": os.path.exists(case["made"]) if case.get("made") else None})
events = [json.loads(event.data_json) for event in stub.QueryEvents(pb.QueryEventsRequest(
    session_id=session.id, types=["PermissionRequested"])).events]
stub.CloseSession(pb.CloseSessionRequest(session_id=session.id))
print(json.dumps({"results": results, "requested": events}))
'''


@pytest.fixture(scope="module")
def victim() -> Iterator[PlainUser]:
    with plain_users(1) as made:
        yield made[0]


def preload_library(directory: Path, user: PlainUser, made: Path) -> Path:
    """A library whose constructor makes ``made``: what LD_PRELOAD would load into `ls`."""
    source = directory / "pre.c"
    source.write_text('#include <fcntl.h>\n#include <unistd.h>\n__attribute__((constructor)) static void ran(void) '
                      f'{{ int fd = open("{made}", O_WRONLY | O_CREAT, 0644); if (fd >= 0) close(fd); }}\n')
    library = directory / "pre.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    os.chown(library, user.uid, user.gid)
    return library


def script(path: Path, user: PlainUser, body: str) -> Path:
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    os.chown(path, user.uid, user.gid)
    return path


def run_cases(daemon: Daemon, user: PlainUser, ws: Path, mode: int,  # noqa: F811
              cases: list[dict[str, Any]]) -> dict[str, Any]:
    return run_client_as(user.uid, user.gid, daemon.socket, CASES, {"ws": str(ws), "mode": mode, "cases": cases},
                         timeout=600)


def attack_and_control(argv: list[str], made: Path, env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """The attack, denied; then the same, allowed once (the control: it does make its file)."""
    case = {"argv": argv, "env": env or {}, "made": str(made)}
    return [{**case, "answer": "deny"}, {**case, "answer": "allow_once"}]


def test_danger_full_access_on_request_asks_before_the_findings_commands(daemon: Daemon, base: Path,  # noqa: F811
                                                                          victim: PlainUser) -> None:
    home = owned_dir(base / f"home-{os.urandom(3).hex()}", victim)    # outside the workspace, the victim's
    ws = owned_dir(base / f"ws-{os.urandom(3).hex()}", victim)
    compressor = script(ws / "x.sh", victim, f"touch {home}/PWNED_sort; exec cat")
    library = preload_library(ws, victim, home / "PWNED_preload")
    cases = [
        {"argv": ["touch", f"{home}/PWNED_control"], "answer": "deny", "made": f"{home}/PWNED_control"},
        *attack_and_control(["sed", "-n", f"e touch {home}/PWNED_sed", "/etc/hostname"], home / "PWNED_sed"),
        *attack_and_control(["sort", f"--compress-program={compressor}", "-S", "1K", "-T", str(home),
                             "/etc/services"], home / "PWNED_sort"),
        *attack_and_control(["git", "--no-pager", "diff", "--no-index", f"--output={home}/PWNED_gitdiff",
                             "/etc/hostname", "/etc/hosts"], home / "PWNED_gitdiff"),
        *attack_and_control(["ls"], home / "PWNED_preload", {"LD_PRELOAD": str(library)}),
        {"argv": ["sed", "-n", "1p", "/etc/hostname"], "answer": "deny"},
        {"argv": ["ls", "-la"], "answer": "deny"},
    ]
    results = run_cases(daemon, victim, ws, pb.SandboxPolicy.DANGER_FULL_ACCESS, cases)["results"]
    control, *attacks, read, listing = results
    assert (control["held"], control["reason"], control["made"]) == (True, "destructive_effect", False), control
    for denied, allowed in zip(attacks[::2], attacks[1::2], strict=True):
        assert (denied["held"], denied["reason"], denied["made"]) == (True, "unknown_command", False), denied
        assert (allowed["held"], allowed["made"]) == (True, True), allowed          # the attack is real
    for ran in (read, listing):
        assert (ran["held"], ran.get("code")) == (False, 0), ran                    # read-only: not asked


def test_workspace_write_on_request_asks_before_sed_e_and_shows_the_environment(daemon: Daemon, base: Path,  # noqa: F811
                                                                                victim: PlainUser) -> None:
    ws = owned_dir(base / f"ws-{os.urandom(3).hex()}", victim)
    bash_env = script(ws / "env.sh", victim, f"touch {ws}/PWNED_bash_env")
    sed = ["sed", "-n", '1e python3 -c "open(chr(112)+chr(119),chr(119))"', "/etc/hostname"]
    cases = [
        {"argv": ["python3", "-c", "open('made_by_python', 'w')"], "answer": "deny", "made": f"{ws}/made_by_python"},
        *attack_and_control(sed, ws / "pw"),
        *attack_and_control(["bash", "-c", "ls"], ws / "PWNED_bash_env", {"BASH_ENV": str(bash_env)}),
        {"argv": ["sed", "-n", "1p", "/etc/hostname"], "answer": "deny"},
        {"argv": ["/bin/sh", "-c", "ls -la && cat /etc/hostname | wc -l"], "answer": "deny"},
    ]
    reply = run_cases(daemon, victim, ws, pb.SandboxPolicy.WORKSPACE_WRITE, cases)
    control, sed_denied, sed_allowed, env_denied, env_allowed, read, script_read = reply["results"]
    assert (control["held"], control["reason"], control["made"]) == (True, "unknown_command", False), control
    for denied, allowed in ((sed_denied, sed_allowed), (env_denied, env_allowed)):
        assert (denied["held"], denied["reason"], denied["made"]) == (True, "unknown_command", False), denied
        assert (allowed["held"], allowed["made"]) == (True, True), allowed
    for ran in (read, script_read):
        assert (ran["held"], ran.get("code")) == (False, 0), ran
    # Finding 2a: the environment is part of the held call: in its card's arguments and in the audit.
    assert env_denied["arguments"] == {"argv": ["bash", "-c", "ls"], "cwd": str(ws), "env": {"BASH_ENV": str(bash_env)}}
    requested = [event for event in reply["requested"] if event["arguments"]["argv"] == ["bash", "-c", "ls"]]
    assert len(requested) == 2 and all(event["arguments"]["env"] == {"BASH_ENV": str(bash_env)} for event in requested)
    assert all("BASH_ENV" in event["note"] for event in requested), requested
    assert "env" not in sed_denied["arguments"]                                   # none set: none shown
    assert json.dumps(sed_denied["arguments"]["argv"]) == json.dumps(sed)


def test_the_third_pass_builtins_and_terminals_are_asked(daemon: Daemon, base: Path,  # noqa: F811
                                                         victim: PlainUser) -> None:
    """Round 4's third hostile pass: bash's `test -v` evaluated a subscript's `$(...)` (read-only
    by the name `test`), and a terminal call's keystrokes drove git's pager into `!cmd`. Both are
    asked now; allowed once, the builtin does make its file (the attack is real); `ls` without a
    terminal is still not asked."""
    ws = owned_dir(base / f"ws-{os.urandom(3).hex()}", victim)
    cases = [
        *attack_and_control(["bash", "-c", f"test -v 'a[$(touch {ws}/PWNED_test_v)]'"], ws / "PWNED_test_v"),
        {"argv": ["ls"], "terminal": True, "answer": "deny"},
        {"argv": ["ls"], "answer": "deny"},
    ]
    denied, allowed, on_terminal, plain = run_cases(daemon, victim, ws, pb.SandboxPolicy.WORKSPACE_WRITE,
                                                    cases)["results"]
    assert (denied["held"], denied["reason"], denied["made"]) == (True, "unknown_command", False), denied
    assert (allowed["held"], allowed["made"]) == (True, True), allowed
    assert (on_terminal["held"], on_terminal["reason"]) == (True, "unknown_command"), on_terminal
    assert on_terminal["arguments"]["cwd"] == str(ws)                  # the card's cwd line comes from here
    assert (plain["held"], plain.get("code")) == (False, 0), plain
