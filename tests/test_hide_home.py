"""A daemon session whose policy hides its owner's home (SandboxPolicy.hide_home), on the real kernel.

A daemon session shows the host's root read-only, the owner's home with it: an MCP server run in a
session of its user's (`sandboxd mcp --gateway`) could read ~/.ssh/id_rsa. With ``hide_home`` the
home is covered by an empty, read-only directory (launcher.rootfs step 7b, as `sandboxd run`
does): the key is unreadable by its absolute path, the home lists nothing of its own, a write there
fails and reaches nothing, while the workspace and a writable root inside it stay visible and
writable. The control:
the same user's session without it reads the key. The setting survives an UpdateSessionPolicy that
leaves it out and in a permission mode's session; danger-full-access with it is refused;
`sandboxctl session create --hide-home` and sandboxd.mcp.daemon.SessionSpec(hide_home=True) set it.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import grpc
import pytest

from conftest import BASE_ENV, REPO
from daemon_helpers import (Daemon, DaemonFactory, PlainUser, close_quietly, plain_users, rpc_error, run_client_as,
                            run_exec)
from daemon_fixtures import daemon  # noqa: F401  (the module's daemon)
from sandboxd.v1 import sandboxd_pb2 as pb

pytestmark = pytest.mark.timeout(300)

SANDBOXCTL = str(REPO / ".venv" / "bin" / "sandboxctl")
KEY = "-----BEGIN OPENSSH PRIVATE KEY-----\nsbxt-hide-home-secret\n-----END OPENSSH PRIVATE KEY-----\n"


class Home(NamedTuple):
    user: PlainUser
    home: Path              # the user's home in the user database: ~/.ssh/id_rsa, ~/.bashrc, ~/project, ~/notes
    workspace: Path         # ~/project


@pytest.fixture(scope="module")
def home(sandboxd_daemon_module: DaemonFactory, daemon: Daemon) -> Iterator[Home]:  # noqa: F811
    """A plain user whose home (in the module's base, 0700 as homes are) holds a private key, a
    .bashrc and the workspace."""
    with plain_users(1) as (user,):
        path = sandboxd_daemon_module.base / f"home-{user.name}"
        subprocess.run(["usermod", "-d", str(path), user.name], check=True, capture_output=True)
        (path / ".ssh").mkdir(parents=True)
        (path / ".ssh" / "id_rsa").write_text(KEY)
        (path / ".bashrc").write_text("# the user's own\n")
        (path / "project").mkdir()
        (path / "notes").mkdir()
        for entry in (path, path / ".ssh", path / ".ssh" / "id_rsa", path / ".bashrc", path / "project",
                      path / "notes"):
            os.chown(entry, user.uid, user.gid)
        os.chmod(path, 0o700)
        os.chmod(path / ".ssh", 0o700)
        os.chmod(path / ".ssh" / "id_rsa", 0o600)
        try:
            yield Home(user, path, path / "project")
        finally:
            for session in daemon.stub.ListSessions(pb.ListSessionsRequest(), timeout=60).sessions:
                close_quietly(daemon.stub, session.id)          # before userdel: their sandboxes go


# As the user: a session with hide_home and one without (the control), the same probes in each,
# then an update that leaves hide_home out, and danger-full-access with it.
PROBES = r'''
home, ws = ARGS["home"], ARGS["ws"]

def session(hide):
    policy = pb.SandboxPolicy(mode=pb.SandboxPolicy.WORKSPACE_WRITE, hide_home=hide, writable_roots=[home + "/notes"])
    return stub.CreateSession(pb.CreateSessionRequest(workspace=ws, sandbox_policy=policy,
                                                      approval_policy=pb.NEVER), timeout=120)

def probes(sid):
    return {"key": run(sid, ["cat", home + "/.ssh/id_rsa"]),
            "bashrc": run(sid, ["cat", home + "/.bashrc"]),
            "listing": run(sid, ["ls", "-A", home]),
            "plant": run(sid, ["sh", "-c", "echo planted >> " + home + "/.bashrc"]),
            "write": run(sid, ["sh", "-c", "echo written > " + ws + "/out && cat " + ws + "/out"]),
            "root": run(sid, ["sh", "-c", "echo noted > " + home + "/notes/n && cat " + home + "/notes/n"]),
            "home_var": run(sid, ["sh", "-c", "echo $HOME"])}

hidden, shown = session(True), session(False)
out = {"created_hide": hidden.sandbox_policy.hide_home, "hidden": probes(hidden.id), "shown": probes(shown.id)}
updated = stub.UpdateSessionPolicy(pb.UpdateSessionPolicyRequest(
    session_id=hidden.id, sandbox_policy=pb.SandboxPolicy(mode=pb.SandboxPolicy.WORKSPACE_WRITE)), timeout=120)
out["updated_hide"] = updated.sandbox_policy.hide_home
out["updated_generation"] = updated.sandbox_generation
out["after_update"] = run(hidden.id, ["cat", home + "/.ssh/id_rsa"])
def full_access():
    stub.UpdateSessionPolicy(pb.UpdateSessionPolicyRequest(
        session_id=hidden.id, sandbox_policy=pb.SandboxPolicy(mode=pb.SandboxPolicy.DANGER_FULL_ACCESS)), timeout=60)
def create_full():
    stub.CreateSession(pb.CreateSessionRequest(workspace=ws, approval_policy=pb.NEVER,
        sandbox_policy=pb.SandboxPolicy(mode=pb.SandboxPolicy.DANGER_FULL_ACCESS, hide_home=True)), timeout=60)
errors = {}
for name, fn in (("update_full", full_access), ("create_full", create_full)):
    try:
        fn()
        errors[name] = ["OK", ""]
    except grpc.RpcError as error:
        errors[name] = [error.code().name, error.details()]
out["errors"] = errors
moded = stub.CreateSession(pb.CreateSessionRequest(workspace=ws, permission_mode="full",
    sandbox_policy=pb.SandboxPolicy(hide_home=True)), timeout=120)
out["mode_hide"] = moded.sandbox_policy.hide_home
out["mode_key"] = run(moded.id, ["cat", home + "/.ssh/id_rsa"])
for sid in (hidden.id, shown.id, moded.id):
    stub.CloseSession(pb.CloseSessionRequest(session_id=sid), timeout=60)
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def seen(home: Home, daemon: Daemon) -> dict[str, Any]:  # noqa: F811
    return run_client_as(home.user.uid, home.user.gid, daemon.socket, PROBES,
                         {"home": str(home.home), "ws": str(home.workspace)})


def test_the_control_reads_the_key_without_hide_home(seen: dict[str, Any]) -> None:
    """Without hide_home the attack works: the user's session reads its key and lists its home."""
    assert seen["shown"]["key"] == [KEY, 0], seen["shown"]
    assert {".ssh", ".bashrc", "project", "notes"} <= set(seen["shown"]["listing"][0].split()), seen["shown"]


def test_hide_home_hides_the_key_and_the_dotfiles(seen: dict[str, Any]) -> None:
    assert seen["created_hide"] is True
    out, status = seen["hidden"]["key"]
    assert status != 0 and "sbxt-hide-home-secret" not in out, seen["hidden"]
    assert seen["hidden"]["bashrc"][1] != 0, seen["hidden"]
    listing, status = seen["hidden"]["listing"]
    assert status == 0 and listing.split() == ["notes", "project"], seen["hidden"]   # the roots' mount points alone


def test_the_hidden_home_is_read_only_and_the_host_home_untouched(seen: dict[str, Any], home: Home) -> None:
    assert seen["hidden"]["plant"][1] != 0, seen["hidden"]
    assert (home.home / ".bashrc").read_text() == "# the user's own\n"
    assert (home.home / ".ssh" / "id_rsa").read_text() == KEY


def test_the_workspace_and_roots_inside_the_hidden_home_stay_writable(seen: dict[str, Any], home: Home) -> None:
    assert seen["hidden"]["write"] == ["written\n", 0], seen["hidden"]
    assert (home.workspace / "out").read_text() == "written\n"
    assert seen["hidden"]["root"] == ["noted\n", 0], seen["hidden"]
    assert (home.home / "notes" / "n").read_text() == "noted\n"
    assert seen["hidden"]["home_var"] == ["/tmp/sandboxd-home\n", 0], seen["hidden"]


def test_an_update_that_leaves_it_out_keeps_it(seen: dict[str, Any]) -> None:
    """A policy change rebuilds the sandbox (a new generation) and the home stays hidden."""
    assert seen["updated_hide"] is True and seen["updated_generation"] >= 1, seen
    out, status = seen["after_update"]
    assert status != 0 and "sbxt-hide-home-secret" not in out, seen


def test_danger_full_access_with_hide_home_is_refused(seen: dict[str, Any]) -> None:
    for name in ("update_full", "create_full"):
        code, details = seen["errors"][name]
        assert code == "INVALID_ARGUMENT" and "hide" in details and "Traceback" not in details, (name, details)


def test_sandboxctl_create_hide_home(home: Home, daemon: Daemon) -> None:  # noqa: F811
    def ctl(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([SANDBOXCTL, "--socket", str(daemon.socket), *args], capture_output=True, text=True,
                              timeout=120, env=BASE_ENV, cwd="/", user=home.user.uid, group=home.user.gid,
                              extra_groups=[])

    created = ctl("session", "create", str(home.workspace), "--hide-home", "--approval", "never")
    assert created.returncode == 0, created.stderr
    session_id = created.stdout.strip()
    shown = ctl("session", "show", session_id, "--json")
    assert json.loads(shown.stdout)["sandbox_policy"].get("hide_home") is True, shown.stdout
    assert "hide-home" in ctl("session", "show", session_id).stdout
    key = ctl("exec", session_id, "--", "cat", str(home.home / ".ssh" / "id_rsa"))
    assert key.returncode != 0 and "sbxt-hide-home-secret" not in key.stdout, (key.stdout, key.stderr)
    assert ctl("session", "close", session_id).returncode == 0


def test_a_permission_mode_session_keeps_hide_home(seen: dict[str, Any]) -> None:
    """A permission mode stands for its own sandbox axis (policy.decision.axes_for): hide_home is kept in it."""
    assert seen["mode_hide"] is True, seen
    out, status = seen["mode_key"]
    assert status != 0 and "sbxt-hide-home-secret" not in out, seen


def test_the_mcp_session_spec_asks_for_it() -> None:
    """What `sandboxd mcp --gateway` sets for its upstreams' sessions reaches the request."""
    from sandboxd.mcp.daemon import SessionSpec

    assert SessionSpec("/w", hide_home=True, network_policy=pb.SandboxPolicy()).request().sandbox_policy.hide_home
    assert not SessionSpec("/w").request().sandbox_policy.hide_home


def test_a_root_callers_session_hides_the_workspace_owners_home(home: Home, daemon: Daemon) -> None:  # noqa: F811
    """Root's session on a user's checkout runs its commands as that user: hide_home covers that user's
    home too (control: without it, the command reads the key)."""
    def key_as_seen(hide: bool) -> tuple[str, int]:
        session = daemon.stub.CreateSession(pb.CreateSessionRequest(
            workspace=str(home.workspace), approval_policy=pb.NEVER,
            sandbox_policy=pb.SandboxPolicy(mode=pb.SandboxPolicy.WORKSPACE_WRITE, hide_home=hide)), timeout=120)
        try:
            outcome = run_exec(daemon.stub, session.id, ["cat", str(home.home / ".ssh" / "id_rsa")])
            assert outcome.result is not None, outcome.kinds
            return outcome.stdout.decode(), outcome.result.exit_code
        finally:
            close_quietly(daemon.stub, session.id)

    assert key_as_seen(False) == (KEY, 0)
    out, status = key_as_seen(True)
    assert status != 0 and "sbxt-hide-home-secret" not in out, out


def test_a_workspace_that_holds_the_home_is_refused(home: Home, daemon: Daemon) -> None:  # noqa: F811
    """The home as the workspace would be attached over its cover, keys and all: INVALID_ARGUMENT
    saying so, not a session that claims to hide it."""
    error = rpc_error(lambda: daemon.stub.CreateSession(pb.CreateSessionRequest(
        workspace=str(home.home), approval_policy=pb.NEVER,
        sandbox_policy=pb.SandboxPolicy(mode=pb.SandboxPolicy.WORKSPACE_WRITE, hide_home=True)), timeout=120))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    assert "holds the home" in (error.details() or ""), error.details()
    assert not [s for s in daemon.stub.ListSessions(pb.ListSessionsRequest(), timeout=60).sessions
                if s.workspace == str(home.home)]
