"""`sandboxctl` against a real daemon: every subcommand, as a user would type it."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from daemon_fixtures import REPO, base, client  # noqa: F401 - pytest fixtures
from sandboxd.client import SandboxClient

SANDBOXCTL = str(REPO / ".venv" / "bin" / "sandboxctl")


def ctl(base: Path, *args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run([SANDBOXCTL, "--socket", str(base / "run" / "sandboxd.sock"), *args], input=stdin,
                          capture_output=True, text=True, timeout=60)


@pytest.fixture
def session_id(client: SandboxClient, base: Path, request: pytest.FixtureRequest) -> str:
    workspace = base / f"ctl-{request.node.name}"
    workspace.mkdir()
    created = ctl(base, "session", "create", str(workspace), "--approval", "never")
    assert created.returncode == 0, created.stderr
    return created.stdout.strip()


def test_session_and_exec(base: Path, session_id: str) -> None:
    assert session_id in ctl(base, "session", "list").stdout
    run = ctl(base, "exec", session_id, "--", "sh", "-c", "echo out; echo err >&2; exit 7")
    assert (run.returncode, run.stdout, run.stderr) == (7, "out\n", "err\n")
    assert "generation=2" in ctl(base, "session", "policy", session_id, "--sandbox", "read-only").stdout
    assert ctl(base, "exec", session_id, "--", "touch", "x").returncode != 0
    assert ctl(base, "session", "close", session_id).returncode == 0
    gone = ctl(base, "exec", session_id, "--", "true")
    assert gone.returncode == 1 and "NOT_FOUND" in gone.stderr


def test_write_read_ls_patch(base: Path, session_id: str) -> None:
    assert ctl(base, "write", session_id, "dir/f.txt", "--parents", stdin="one\ntwo\n").stdout.strip() == "8"
    assert ctl(base, "read", session_id, "dir/f.txt").stdout == "one\ntwo\n"
    assert "f.txt" in ctl(base, "ls", session_id, "dir").stdout
    diff = "--- a/dir/f.txt\n+++ b/dir/f.txt\n@@ -1,2 +1,2 @@\n one\n-two\n+TWO\n"
    patched = ctl(base, "patch", session_id, stdin=diff)
    assert patched.returncode == 0 and patched.stdout == "modified\tdir/f.txt\n", patched.stderr
    assert ctl(base, "read", session_id, "dir/f.txt").stdout == "one\nTWO\n"
    refused = ctl(base, "write", session_id, "/etc/sandboxctl-test", stdin="x")
    assert refused.returncode == 1 and "PERMISSION_DENIED" in refused.stderr


def test_background_start_ps_logs_stop(base: Path, session_id: str) -> None:
    job = ctl(base, "start", session_id, "--name", "ticker", "--", "sh", "-c", "echo started; sleep 300").stdout.strip()
    assert job
    listed = ctl(base, "ps", session_id).stdout
    assert job in listed and "running" in listed and "ticker" in listed
    stopped = ctl(base, "stop", session_id, job)
    assert stopped.returncode == 0 and "stopped (137)" in stopped.stdout
    assert ctl(base, "logs", session_id, job).stdout == "started\n"


def test_approvals_and_events_from_the_shell(base: Path, client: SandboxClient) -> None:
    workspace = base / "ctl-approvals"
    workspace.mkdir()
    session_id = ctl(base, "session", "create", str(workspace), "--approval", "on-request").stdout.strip()
    held = subprocess.Popen([SANDBOXCTL, "--socket", str(base / "run" / "sandboxd.sock"), "exec", session_id, "--",
                             "sh", "-c", "echo approved-run; true"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 30
    while not (listed := ctl(base, "pending", session_id).stdout.split()):
        assert time.monotonic() < deadline, "the call was never held"
        time.sleep(0.05)
    call_id = listed[0]
    assert "Execute: echo approved-run; true" in ctl(base, "pending", session_id).stdout
    notice = held.stderr.readline() + held.stderr.readline()     # sandboxctl exec says how to answer
    assert f"sandboxctl approve {session_id} {call_id}" in notice and "unknown_command" in notice
    assert ctl(base, "approve", session_id, call_id, "--session-wide").stdout.split() == [call_id, "allow_session"]
    out, _ = held.communicate(timeout=60)
    assert (held.returncode, out) == (0, "approved-run\n")
    lines = [json.loads(line) for line in ctl(base, "events", "--session", session_id, "--json").stdout.splitlines()]
    assert [e["type"] for e in lines] == ["SessionCreated", "PermissionRequested", "PermissionGranted",
                                         "ToolInvocationStarted", "ToolInvocationCompleted"]
    assert lines[2]["data"]["by"] == "user" and lines[1]["call_id"] == call_id
    human = ctl(base, "events", "--session", session_id, "--type", "PermissionRequested").stdout
    assert "PermissionRequested" in human and "reason=unknown_command" in human and len(human.splitlines()) == 1
    # deny: the command never runs, sandboxctl says why.
    ctl(base, "session", "policy", session_id, "--approval", "always")
    denied = subprocess.Popen([SANDBOXCTL, "--socket", str(base / "run" / "sandboxd.sock"), "read", session_id, "x"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while not (listed := ctl(base, "pending", session_id).stdout.split()):
        assert time.monotonic() < deadline + 30, "the read was never held"
        time.sleep(0.05)
    ctl(base, "deny", session_id, listed[0])
    _, err = denied.communicate(timeout=60)
    assert denied.returncode == 1 and "PERMISSION_DENIED" in err and "denied by user" in err
    # Standing rules.
    assert ctl(base, "rules", "add", str(workspace), "fs.read").returncode == 0
    assert ctl(base, "rules", "list", str(workspace)).stdout.split() == [str(workspace), "fs.read"]
    assert ctl(base, "rules", "remove", str(workspace), "fs.read").returncode == 0
    assert ctl(base, "rules", "remove", str(workspace), "fs.read").returncode == 2
    ctl(base, "session", "close", session_id)


def test_status(base: Path, client: SandboxClient) -> None:
    result = ctl(base, "status")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for expected in ("health: SERVING", "version: sandboxd ", "landlock: ABI ", "seccomp: user_notif",
                     "cgroup.memory: ", "nftables: present", "call_helper: built", "sessions: "):
        assert expected in out, out
    # The caller's quotas, the front door's connections among them (this call's own connection counts).
    assert "quotas (yours/limit): sessions " in out and "connections 1/256" in out, out
