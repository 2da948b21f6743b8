"""`sandboxctl` against a real daemon: every subcommand, as a user would type it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import BASE_ENV, SANDBOXD
from daemon_fixtures import REPO, base, client  # noqa: F401 - pytest fixtures
from daemon_helpers import PYTHON, PlainUser
from sandboxd.client import SandboxClient
from sandboxd.v1 import sandboxd_pb2 as pb

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


def test_patch_hint_names_every_change_git_would_make(base: Path) -> None:
    """Round 10's hostile pass: `sandboxctl patch`'s line for a person read "Patch: innocent.txt"
    for a patch that also renamed victim.txt away and made script.sh executable (git-format parts
    without ---/+++ headers). Now it names each, and the reply lists each."""
    workspace = base / "ctl-patch-hint"
    workspace.mkdir()
    for name, text in (("innocent.txt", "hello\n"), ("victim.txt", "keep me\n"), ("script.sh", "echo hi\n")):
        (workspace / name).write_text(text)
    os.chmod(workspace / "script.sh", 0o644)
    session_id = ctl(base, "session", "create", str(workspace), "--approval", "always").stdout.strip()
    diff = ("diff --git a/innocent.txt b/innocent.txt\n--- a/innocent.txt\n+++ b/innocent.txt\n@@ -1 +1 @@\n"
            "-hello\n+hello world\ndiff --git a/victim.txt b/moved-away.txt\nsimilarity index 100%\n"
            "rename from victim.txt\nrename to moved-away.txt\ndiff --git a/script.sh b/script.sh\n"
            "old mode 100644\nnew mode 100755\n")
    held = subprocess.Popen([SANDBOXCTL, "--socket", str(base / "run" / "sandboxd.sock"), "patch", session_id],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert held.stdin is not None and held.stderr is not None
    held.stdin.write(diff)
    held.stdin.close()
    notice = held.stderr.readline()
    while " approve " not in notice.splitlines()[-1]:
        notice += held.stderr.readline()
    assert ("Patch: innocent.txt: modified; victim.txt: renamed to moved-away.txt; moved-away.txt: renamed from "
            "victim.txt; script.sh: made executable") in notice, notice
    call_id = notice.split(" approve ")[-1].split()[1]
    assert ctl(base, "approve", session_id, call_id).returncode == 0
    assert held.wait(timeout=60) == 0 and held.stdout is not None
    out = held.stdout.read()
    held.stdout.close()
    held.stderr.close()
    assert out.splitlines() == [
        "modified\tinnocent.txt", "renamed to moved-away.txt\tvictim.txt", "renamed from victim.txt\tmoved-away.txt",
        "made executable\tscript.sh"], out
    assert not (workspace / "victim.txt").exists() and os.stat(workspace / "script.sh").st_mode & 0o100


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
                             "sh", "-c", "echo approved-run; exec true"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 30
    while not (listed := ctl(base, "pending", session_id).stdout.split()):
        assert time.monotonic() < deadline, "the call was never held"
        time.sleep(0.05)
    call_id = listed[0]
    assert "Execute: echo approved-run; exec true" in ctl(base, "pending", session_id).stdout
    notice = held.stderr.readline()                               # sandboxctl exec says how to answer:
    while " approve " not in notice.splitlines()[-1]:             # the card's lines (argv), then the commands
        notice += held.stderr.readline()
    assert "  argv:    sh -c 'echo approved-run; exec true'\n" in notice, notice
    # The socket came from --socket (not the default): the hint names it, so it can be pasted as is.
    socket_option = f"--socket {base / 'run' / 'sandboxd.sock'}"
    assert f"sandboxctl {socket_option} approve {session_id} {call_id}" in notice and "unknown_command" in notice
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


# Runs a command where nothing serves on the default socket: /run/sandboxd behind an empty tmpfs.
HIDE_DEFAULT_DAEMON = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                       '[ ! -d /run/sandboxd ] || mount -t tmpfs tmpfs /run/sandboxd || exit 99; exec "$@"', "sh"]


def ctl_env(*args: str, env: dict[str, str], stdin: str = "",
            without_default_daemon: bool = False) -> subprocess.CompletedProcess[str]:
    """sandboxctl without --socket, under the given environment; ``without_default_daemon``: where no
    daemon serves on the default socket, whatever serves there on this machine."""
    return subprocess.run([*(HIDE_DEFAULT_DAEMON if without_default_daemon else []), SANDBOXCTL, *args],
                          input=stdin, capture_output=True, text=True, timeout=60,
                          env={"PATH": os.environ["PATH"], **env})


def test_socket_from_the_environment(base: Path, session_id: str) -> None:
    socket = str(base / "run" / "sandboxd.sock")
    listed = ctl_env("session", "list", env={"SANDBOXD_SOCKET": socket})
    assert listed.returncode == 0 and session_id in listed.stdout, listed.stderr
    # The flag wins over the environment.
    flagged = ctl_env("--socket", socket, "session", "list", env={"SANDBOXD_SOCKET": str(base / "nowhere.sock")})
    assert flagged.returncode == 0 and session_id in flagged.stdout, flagged.stderr
    # Control: neither names the test daemon, so the default socket is used. Another daemon may serve
    # there (the README's `setup.sh serve`): it is hidden, in a mount namespace of this call's own.
    default = ctl_env("session", "list", env={"SANDBOXD_SOCKET": ""}, without_default_daemon=True)
    assert default.returncode == 1 and session_id not in default.stdout
    assert "cannot reach sandboxd at /run/sandboxd/sandboxd.sock" in default.stderr, default.stderr
    # From $SANDBOXD_SOCKET, the approval hint needs no --socket: the same environment answers it
    # (test_approvals_and_events_from_the_shell is the control: from --socket, the hint names it).
    workspace = base / "ctl-env-approval"
    workspace.mkdir()
    held_session = ctl(base, "session", "create", str(workspace), "--approval", "always").stdout.strip()
    held = subprocess.Popen([SANDBOXCTL, "exec", held_session, "--", "true"], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={"PATH": os.environ["PATH"], "SANDBOXD_SOCKET": socket})
    assert held.stderr is not None
    notice = "".join(held.stderr.readline() for _ in range(3))           # the summary, the cwd, how to answer
    call_id = ctl(base, "pending", held_session).stdout.split()[0]
    assert f"  sandboxctl approve {held_session} {call_id}" in notice and "--socket" not in notice, notice
    ctl(base, "deny", held_session, call_id)
    assert held.wait(timeout=60) == 1
    ctl(base, "session", "close", held_session)


def test_connection_errors_say_what_to_do(base: Path, tmp_path: Path,
                                          plain_users: Callable[[int], list[PlainUser]]) -> None:
    missing = str(tmp_path / "no-daemon.sock")
    result = ctl_env("status", env={"SANDBOXD_SOCKET": missing})
    assert result.returncode == 1 and result.stderr.count("\n") == 1, result.stderr
    assert f"cannot reach sandboxd at {missing}: is `sandboxd serve` running?" in result.stderr
    assert "SANDBOXD_SOCKET" in result.stderr and "Traceback" not in result.stderr
    # A plain user on the root-only test socket is refused by the socket's mode: said as such.
    socket = base / "run" / "sandboxd.sock"
    (user,) = plain_users(1)
    # sandboxctl's own main(), imported as root (the venv is root's) and run as the plain user.
    as_user = [PYTHON, "-c", "import os, shutil, sys; from grpc_health.v1 import health_pb2_grpc; "
               "from sandboxd.cli import ctl; os.setgroups([]); "
               f"os.setgid({user.gid}); os.setuid({user.uid}); sys.exit(ctl.main(sys.argv[1:]))",
               "--socket", str(socket), "status"]
    mode = socket.stat().st_mode & 0o7777
    os.chmod(socket, 0o600)
    try:
        refused = subprocess.run(as_user, capture_output=True, text=True, timeout=60, cwd="/")
    finally:
        os.chmod(socket, mode)
    assert refused.returncode == 1 and refused.stderr.count("\n") == 1, refused.stderr
    assert "you are not allowed on this socket" in refused.stderr, refused.stderr
    # Control: the same user on the socket as the daemon made it (open to every user) gets through.
    allowed = subprocess.run(as_user, capture_output=True, text=True, timeout=60, cwd="/")
    assert allowed.returncode == 0 and "health: SERVING" in allowed.stdout, allowed.stderr


def test_stdin_is_forwarded(base: Path, session_id: str) -> None:
    piped = ctl(base, "exec", session_id, "--", "cat", stdin="hi\nthere\n")
    assert (piped.returncode, piped.stdout) == (0, "hi\nthere\n"), piped.stderr
    counted = ctl(base, "exec", session_id, "--", "wc", "-c", stdin="x" * 300_000)
    assert counted.stdout.strip() == "300000", counted.stderr
    # Control: empty stdin is an empty stdin, the command still ends.
    assert ctl(base, "exec", session_id, "--", "cat").stdout == ""


def test_ctrl_c_interrupts_the_remote_command(base: Path, session_id: str, client: SandboxClient) -> None:
    running = subprocess.Popen([SANDBOXCTL, "--socket", str(base / "run" / "sandboxd.sock"), "exec", session_id,
                                "--", "sh", "-c", "trap 'echo got-int; exit 9' INT; echo ready; "
                                "while :; do sleep 0.1; done"],
                               stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert running.stdout is not None and running.stdout.readline() == "ready\n"
    running.send_signal(signal.SIGINT)
    out, err = running.communicate(timeout=60)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    # The remote shell got the SIGINT (its trap ran) and its status is sandboxctl's.
    assert (running.returncode, out) == (9, "got-int\n"), err
    assert client.get_session(session_id).running_calls == 0


def test_broken_pipe_is_quiet(base: Path, session_id: str) -> None:
    for _ in range(3):
        ctl(base, "exec", session_id, "--", "true")
    socket = str(base / "run" / "sandboxd.sock")
    pipeline = subprocess.run(f"{SANDBOXCTL} --socket {socket} events | head -n 1; echo \"${{PIPESTATUS[0]}}\"",
                              shell=True, executable="/bin/bash", capture_output=True, text=True, timeout=60)
    lines = pipeline.stdout.splitlines()
    assert len(lines) == 2 and lines[1] in ("0", "141"), pipeline
    assert "Traceback" not in pipeline.stderr and "BrokenPipe" not in pipeline.stderr, pipeline.stderr
    # `status | head -n 1`: its output is small enough to sit in stdout's buffer until the end.
    status = subprocess.run(f"{SANDBOXCTL} --socket {socket} status | (sleep 0.2; head -n 1); "
                            "echo \"${PIPESTATUS[0]}\"", shell=True, executable="/bin/bash",
                            capture_output=True, text=True, timeout=60)
    assert status.stdout.splitlines()[0] == "health: SERVING" and status.stdout.splitlines()[1] in ("0", "141")
    assert status.stderr == "", status.stderr
    # Control: unpiped, every line arrives.
    assert len(ctl(base, "events").stdout.splitlines()) > 3


def test_ctrl_c_ends_events_follow_quietly(base: Path) -> None:
    following = subprocess.Popen([SANDBOXCTL, "--socket", str(base / "run" / "sandboxd.sock"), "events", "-f"],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert following.stdout is not None
    ctl(base, "status")
    following.stdout.readline()     # it is following
    following.send_signal(signal.SIGINT)
    _, err = following.communicate(timeout=60)
    assert (following.returncode, err) == (130, "")


def test_list_status_and_events_tell_the_truth(base: Path, client: SandboxClient) -> None:
    workspace = base / "ctl-truth"
    workspace.mkdir()
    session_id = ctl(base, "session", "create", str(workspace), "--sandbox", "read-only",
                     "--approval", "never").stdout.strip()
    line = next(row for row in ctl(base, "session", "list").stdout.splitlines() if row.startswith(session_id))
    assert "read-only no-network" in line and "approval=never" in line and "running=0" in line, line
    ctl(base, "exec", session_id, "--", "sh", "-c", "exit 3")
    ctl(base, "exec", session_id, "--", "sh", "-c", "kill -KILL $$")
    ended = ctl(base, "events", "--session", session_id, "--type", "ToolInvocationCompleted").stdout.splitlines()
    assert len(ended) == 2 and "status=3" in ended[0] and "signal" not in ended[0], ended
    assert "status=137" in ended[1] and "signal=9" in ended[1], ended
    # The uptime is the daemon process's, not the time since the status module was first imported.
    # Read between two readings of its age: `status` may take seconds on a loaded machine.
    pid = client.stub.GetStatus(pb.GetStatusRequest()).pid

    def age() -> int:
        return int(subprocess.run(["ps", "-o", "etimes=", "-p", str(pid)], capture_output=True, text=True).stdout)
    before = age()
    up = int(ctl(base, "status").stdout.split(" up ")[1].split()[0])
    after = age()
    assert before - 1 <= up <= after + 1, (before, up, after)
    ctl(base, "session", "close", session_id)


def test_second_serve_on_a_busy_socket(base: Path, tmp_path: Path) -> None:
    socket = str(base / "run" / "sandboxd.sock")
    second = subprocess.run([SANDBOXD, "serve", "--socket", socket, "--state-dir", str(tmp_path / "state")],
                            capture_output=True, text=True, timeout=120, env=BASE_ENV)
    assert second.returncode == 1 and second.stderr == (
        f"sandboxd serve: another daemon is serving {socket}: stop it first, or serve on another socket (--socket)\n")
    # Control: the first daemon still answers on it.
    assert ctl(base, "status").returncode == 0


def test_a_rule_without_session_wide_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Hostile review r7b L7: `approve --rule X` alone allowed once and dropped the rule unsaid.
    Refused before any daemon is asked (this socket does not exist)."""
    from sandboxd.cli import ctl

    socket = str(tmp_path / "none.sock")
    with pytest.raises(SystemExit) as refused:
        ctl.main(["--socket", socket, "approve", "sess_x", "call_x", "--rule", "api.example.test"])
    assert refused.value.code == 2 and "add --session-wide" in capsys.readouterr().err
    # Control: with --session-wide it goes on to ask the daemon (here: none at that socket).
    assert ctl.main(["--socket", socket, "approve", "sess_x", "call_x", "--session-wide", "--rule",
                     "api.example.test"]) == 1
    assert "add --session-wide" not in capsys.readouterr().err


def ctl_stdin_closed(base: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """sandboxctl with file descriptor 0 closed (`exec 0<&-`), not /dev/null: Python's sys.stdin is None."""
    return subprocess.run(["sh", "-c", 'exec 0<&-; exec "$@"', "sh", SANDBOXCTL, "--socket",
                           str(base / "run" / "sandboxd.sock"), *args], capture_output=True, text=True, timeout=60)


def test_a_closed_stdin_is_no_terminal_and_no_traceback(base: Path, session_id: str) -> None:
    # Control: the shell's `exec 0<&-` really closes it (Python then has no sys.stdin at all).
    closed = subprocess.run(["sh", "-c", 'exec 0<&-; exec "$@"', "sh", PYTHON, "-c", "import sys; print(sys.stdin)"],
                            capture_output=True, text=True, timeout=60)
    assert closed.stdout == "None\n", closed
    assert ctl(base, "write", session_id, "f.txt", stdin="one\n").returncode == 0
    job = ctl(base, "start", session_id, "--", "sleep", "300").stdout.strip()
    assert job
    for args, out in [(("read", session_id, "f.txt"), "one\n"), (("ls", session_id), "f.txt"),
                      (("ps", session_id), job), (("exec", session_id, "--", "cat"), ""),
                      (("exec", session_id, "--", "echo", "ran"), "ran\n"),
                      (("start", session_id, "--", "true"), ""), (("stop", session_id, job), "stopped")]:
        run = ctl_stdin_closed(base, *args)
        assert run.returncode == 0 and out in run.stdout and run.stderr == "", (args, run)
    # write and patch take their data on stdin: without one, one line says so (a usage error, exit 2).
    for args, said in [(("write", session_id, "g.txt"), "write: the file's bytes go on stdin, which is closed"),
                       (("patch", session_id), "patch: the unified diff goes on stdin, which is closed")]:
        run = ctl_stdin_closed(base, *args)
        assert (run.returncode, run.stdout) == (2, "") and run.stderr.startswith(f"sandboxctl: {said}"), run
        assert len(run.stderr.splitlines()) == 1, run.stderr
    assert ctl(base, "read", session_id, "g.txt").returncode == 1        # nothing was written


def test_a_patch_that_is_not_utf8_says_what_to_give(base: Path, session_id: str) -> None:
    assert ctl(base, "write", session_id, "f.txt", stdin="x\n").returncode == 0
    diff = b"--- a/f.txt\n+++ b/f.txt\n@@ -1 +1 @@\n-x\n+\xff\xfe\n"
    run = subprocess.run([SANDBOXCTL, "--socket", str(base / "run" / "sandboxd.sock"), "patch", session_id],
                         input=diff, capture_output=True, timeout=60)
    assert run.returncode == 2 and run.stderr.decode() == (
        "sandboxctl: patch: the diff on stdin is not UTF-8 text (byte 40): give a unified diff in UTF-8 "
        "(a file that is not text: sandboxctl write SESSION PATH < FILE)\n"), run
    assert ctl(base, "read", session_id, "f.txt").stdout == "x\n"
    # Control: the same diff in UTF-8 applies.
    assert ctl(base, "patch", session_id, stdin=diff.replace(b"\xff\xfe", b"y").decode()).returncode == 0
    assert ctl(base, "read", session_id, "f.txt").stdout == "y\n"
