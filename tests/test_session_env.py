"""A session's commands' environment (issue 17, item 4), through `sandboxctl` and the API against a
real daemon: what the caller names passes, nothing else does; PATH keeps only the directories the
sandbox has; HOME is private and writable; old clients' `env` is exactly theirs; the bounds."""

from __future__ import annotations

import os
import pwd
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from conftest import BASE_ENV, SLOW
from daemon_fixtures import REPO, base, client  # noqa: F401 - pytest fixtures
from daemon_helpers import PlainUser, plain_users, rpc_error
from sandboxd.client import SandboxClient, sandbox_policy
from sandboxd.policy.limits import MAX_CALLER_PATH_BYTES, MAX_ENV_VALUE, MAX_PATH_ENTRIES, MAX_SESSION_ENV_ENTRIES
from sandboxd.service.environment import SANDBOX_HOME
from sandboxd.v1 import sandboxd_pb2 as pb

SANDBOXCTL = str(REPO / ".venv" / "bin" / "sandboxctl")
VENV_BIN = str(REPO / ".venv" / "bin")


def ctl(base: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([SANDBOXCTL, "--socket", str(base / "run" / "sandboxd.sock"), *args],
                          capture_output=True, text=True, timeout=60, env=env or BASE_ENV, stdin=subprocess.DEVNULL)


def workspace(base: Path) -> Path:
    path = base / f"env-{uuid.uuid4().hex[:8]}"
    path.mkdir()
    return path


def environ_of(output: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in output.splitlines() if "=" in line)


def test_only_named_variables_pass(base: Path, client: SandboxClient) -> None:
    """A secret in the client's environment stays out; what --env, --env-file and the session's
    env name is in, each layer over the one before; LANG passes, TERM is dumb off a terminal."""
    ws = workspace(base)
    env_file = ws / "session.env"
    env_file.write_text("# the session's\n\nFROM_FILE='quoted value'\nexport SHARED=session\nLAYER=file\n")
    created = ctl(base, "session", "create", str(ws), "--approval", "never", "--env-file", str(env_file),
                  "--env", "LAYER=session-flag")
    assert created.returncode == 0, created.stderr
    session_id = created.stdout.strip()
    client_env = {**BASE_ENV, "AWS_SECRET_ACCESS_KEY": "hunter2-secret", "LANG": "en_US.UTF-8", "TERM": "xterm",
                  "PASS_ME": "by-name"}
    run = ctl(base, "exec", session_id, "--env", "SHARED=exec", "--env", "PASS_ME", "--", "/usr/bin/env",
              env=client_env)
    assert run.returncode == 0, run.stderr
    inside = environ_of(run.stdout)
    assert "AWS_SECRET_ACCESS_KEY" not in inside and "hunter2-secret" not in run.stdout
    assert inside["PASS_ME"] == "by-name"                       # named (bare --env NAME): passed on purpose
    assert inside["FROM_FILE"] == "quoted value" and inside["LAYER"] == "session-flag"
    assert inside["SHARED"] == "exec"                           # the exec's own --env wins over the session's
    assert (inside["LANG"], inside["TERM"], inside["HOME"]) == ("en_US.UTF-8", "dumb", SANDBOX_HOME)
    # The session says which variables it sets, never their values; nor does its audit log.
    session = client.get_session(session_id)
    assert list(session.env_names) == ["FROM_FILE", "LAYER", "SHARED"]
    events = ctl(base, "events", "--session", session_id, "--json").stdout
    assert "quoted value" not in events and "FROM_FILE" in events
    ctl(base, "session", "close", session_id)


def test_path_keeps_the_directories_the_sandbox_has(base: Path, client: SandboxClient) -> None:
    """The caller's PATH, filtered inside the sandbox: the venv's bin (visible) stays, so `pytest`
    is found; a host directory the sandbox hides (the host's /tmp: the session has its own), a
    missing one and relative entries go. Control: without the caller's PATH, `pytest` is not found."""
    ws = workspace(base)
    (ws / "tools").mkdir()
    host_tmp_dir = Path("/tmp") / f"sbxt-path-{uuid.uuid4().hex[:8]}"
    host_tmp_dir.mkdir()
    try:
        session_id = ctl(base, "session", "create", str(ws), "--approval", "never").stdout.strip()
        path = ":".join([str(host_tmp_dir), "/no/such/dir", "relative/bin", "", VENV_BIN, f"{ws}/tools", "/usr/bin",
                         "/bin", "/usr/bin/"])
        env = {**BASE_ENV, "PATH": path}
        shown = ctl(base, "exec", session_id, "--", "/bin/sh", "-c", 'echo "$PATH"', env=env)
        assert shown.stdout.strip() == f"{VENV_BIN}:{ws}/tools:/usr/bin:/bin", shown.stderr
        found = ctl(base, "exec", session_id, "--", "pytest", "--version", env=env)
        assert found.returncode == 0 and "pytest" in (found.stdout + found.stderr), found.stderr
        without = ctl(base, "exec", session_id, "--", "pytest", "--version", env={**BASE_ENV, "PATH": "/usr/bin:/bin"})
        assert without.returncode != 0 and "pytest" not in without.stdout
        # A directory made after the first look (a venv's bin) is found once it exists.
        later = ws / "later" / "bin"
        env = {**BASE_ENV, "PATH": f"{later}:/usr/bin:/bin"}
        assert ctl(base, "exec", session_id, "--", "/bin/sh", "-c", 'echo "$PATH"', env=env).stdout.strip() == "/usr/bin:/bin"
        later.mkdir(parents=True)
        deadline = time.monotonic() + 60 * SLOW
        while (seen := ctl(base, "exec", session_id, "--", "/bin/sh", "-c", 'echo "$PATH"', env=env).stdout.strip()) != (
                f"{later}:/usr/bin:/bin"):
            assert time.monotonic() < deadline, f"{later} never joined PATH: {seen}"
            time.sleep(0.5)
        ctl(base, "session", "close", session_id)
    finally:
        host_tmp_dir.rmdir()


HOME_SCRIPT = 'echo "$HOME"; id -u; stat -c "%a %u" "$HOME"; echo mine > "$HOME/.note" && cat "$HOME/.note"'


@pytest.fixture(scope="module")
def plain() -> Iterator[PlainUser]:
    with plain_users(1) as (user,):
        yield user


@pytest.mark.parametrize("mode", ["read-only", "workspace-write"])
@pytest.mark.parametrize("owner", ["root", "plain"])
def test_home_is_private_and_writable(base: Path, client: SandboxClient, plain: PlainUser, mode: str,
                                      owner: str) -> None:
    """HOME is a 0700 directory of the command's user (root's, or a plain user's: the workspace's
    owner), writable, in every confined policy; not the host's home; private to the session
    (another session does not see what this one left there); made again in a rebuilt sandbox."""
    spaces = [workspace(base) for _ in range(2)]
    uid = 0 if owner == "root" else plain.uid
    for space in spaces:
        os.chown(space, uid, 0 if owner == "root" else plain.gid)
    sessions = [client.create_session(str(space), policy=sandbox_policy(mode), approval="never") for space in spaces]
    first = client.exec(sessions[0].id, ["/bin/sh", "-c", HOME_SCRIPT], caller_env=pb.CallerEnvironment(path="/usr/bin:/bin"))
    assert first.stdout.decode().split() == [SANDBOX_HOME, str(uid), "700", str(uid), "mine"], first.stderr
    assert not os.path.exists(f"{SANDBOX_HOME}/.note") and SANDBOX_HOME != os.path.expanduser("~")
    second = client.exec(sessions[1].id, ["/bin/sh", "-c", 'ls -A "$HOME"; echo end'])
    assert second.stdout.decode().split() == ["end"], second.stderr         # empty: its own HOME
    # A policy change builds a new sandbox (a new private /tmp): HOME is made again there.
    client.update_policy(sessions[0].id, policy=sandbox_policy("read-only" if mode != "read-only" else "workspace-write"))
    rebuilt = client.exec(sessions[0].id, ["/bin/sh", "-c", HOME_SCRIPT], caller_env=pb.CallerEnvironment(path="/usr/bin:/bin"))
    assert rebuilt.stdout.decode().split() == [SANDBOX_HOME, str(uid), "700", str(uid), "mine"], rebuilt.stderr
    for session in sessions:
        client.close_session(session.id)


def test_danger_full_access_home_is_the_owners(base: Path, client: SandboxClient) -> None:
    """No private /tmp there: HOME is the owner's own (root's here), never a name in the shared /tmp."""
    session = client.create_session(str(workspace(base)), policy=sandbox_policy("danger-full-access"), approval="never")
    shown = client.exec(session.id, ["/bin/sh", "-c", 'echo "$HOME"'])
    assert shown.stdout.decode().strip() == pwd.getpwuid(0).pw_dir
    client.close_session(session.id)


def test_old_clients_env_is_exactly_theirs(base: Path, client: SandboxClient) -> None:
    """ExecStart.env keeps its meaning (older clients, an MCP shell tool's env): exactly those
    variables, no defaults, no session env. Mixing it with the new fields is refused."""
    session = client.create_session(str(workspace(base)), approval="never", env={"SESSION_ONLY": "1"})
    exact = client.exec(session.id, ["/usr/bin/env"], env={"ONLY": "this"})
    assert exact.stdout.decode() == "ONLY=this\n", exact.stderr
    layered = environ_of(client.exec(session.id, ["/usr/bin/env"], env_overlay={"MINE": "2"}).stdout.decode())
    assert layered["SESSION_ONLY"] == "1" and layered["MINE"] == "2" and layered["PATH"] == "/usr/local/bin:/usr/bin:/bin"
    mixed = rpc_error(lambda: client.exec(session.id, ["true"], env={"A": "1"}, env_overlay={"B": "2"}))
    assert mixed.code() == grpc.StatusCode.INVALID_ARGUMENT and "not both" in (mixed.details() or "")
    client.close_session(session.id)


@pytest.mark.parametrize(("env", "code", "needle"), [
    ({f"V{i}": "x" for i in range(MAX_SESSION_ENV_ENTRIES + 1)}, grpc.StatusCode.RESOURCE_EXHAUSTED, "the limit is 256"),
    ({"BIG": "x" * (MAX_ENV_VALUE + 1)}, grpc.StatusCode.INVALID_ARGUMENT, "32768"),
    ({f"V{i}": "x" * 30000 for i in range(3)}, grpc.StatusCode.RESOURCE_EXHAUSTED, "65536"),
    ({"A=B": "1"}, grpc.StatusCode.INVALID_ARGUMENT, "no '='"),
    ({"NUL": "a\0b"}, grpc.StatusCode.INVALID_ARGUMENT, "NUL"),
])
def test_session_env_is_bounded(base: Path, client: SandboxClient, env: dict[str, str], code: grpc.StatusCode,
                                needle: str) -> None:
    error = rpc_error(lambda: client.create_session(str(workspace(base)), env=env))
    assert error.code() == code and needle in (error.details() or ""), error.details()


def test_caller_path_is_bounded(base: Path, client: SandboxClient) -> None:
    session = client.create_session(str(workspace(base)), approval="never")
    long_path = ":".join(["/usr/bin"] * (MAX_PATH_ENTRIES + 1))
    error = rpc_error(lambda: client.exec(session.id, ["true"], caller_env=pb.CallerEnvironment(path=long_path)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "the limit is 256" in (error.details() or "")
    huge_path = "/" + "x" * MAX_CALLER_PATH_BYTES                 # one entry, past the byte limit
    error = rpc_error(lambda: client.exec(session.id, ["true"], caller_env=pb.CallerEnvironment(path=huge_path)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert f"the limit is {MAX_CALLER_PATH_BYTES}" in (error.details() or ""), error.details()
    client.close_session(session.id)


def test_bad_env_file_line_is_named(base: Path, tmp_path: Path, client: SandboxClient) -> None:
    bad = tmp_path / "bad.env"
    bad.write_text("GOOD=1\n# fine\nthis is not an assignment\n")
    run = ctl(base, "exec", "no-such-session", "--env-file", str(bad), "--", "true")
    assert run.returncode == 2 and f"{bad}:3: expected KEY=VALUE" in run.stderr, run.stderr
    missing = ctl(base, "exec", "no-such-session", "--env", "SBXT_UNSET_VARIABLE", "--", "true")
    assert missing.returncode == 2 and "SBXT_UNSET_VARIABLE: no such variable" in missing.stderr
