"""Other paths to a hide_home session's owner's home (launcher/homes.py, rootfs step 7b), on the real kernel:
a home the user does not own, one that cannot be hidden, the owner's process outside seen through /proc, the
same directory by another mount. From the hostile pass 9b (its findings 1 and 4); each has its control.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from daemon_helpers import Daemon, DaemonFactory, PlainUser, close_quietly, plain_users, run_client_as
from daemon_fixtures import daemon  # noqa: F401
from sandboxd.launcher.homes import other_mounts
from sandboxd.v1 import sandboxd_pb2 as pb

pytestmark = pytest.mark.timeout(300)

KEY = "sbxt-h9b-secret-key\n"


class Home(NamedTuple):
    user: PlainUser
    home: Path
    workspace: Path


def _make_home(path: Path, user: PlainUser, owner_uid: int) -> None:
    subprocess.run(["usermod", "-d", str(path), user.name], check=True, capture_output=True)
    (path / ".ssh").mkdir(parents=True)
    (path / ".ssh" / "id_rsa").write_text(KEY)
    (path / "project").mkdir()
    os.chown(path, owner_uid, user.gid if owner_uid else 0)
    for entry in (path / ".ssh", path / ".ssh" / "id_rsa", path / "project"):
        os.chown(entry, user.uid, user.gid)
    os.chmod(path, 0o700 if owner_uid else 0o755)
    os.chmod(path / ".ssh", 0o700)
    os.chmod(path / ".ssh" / "id_rsa", 0o600)


@pytest.fixture(scope="module")
def home(sandboxd_daemon_module: DaemonFactory, daemon: Daemon) -> Iterator[Home]:  # noqa: F811
    with plain_users(1) as (user,):
        path = sandboxd_daemon_module.base / f"home-{user.name}"
        _make_home(path, user, user.uid)
        try:
            yield Home(user, path, path / "project")
        finally:
            for session in daemon.stub.ListSessions(pb.ListSessionsRequest(), timeout=60).sessions:
                close_quietly(daemon.stub, session.id)


PROBE = r'''
home, ws, outside = ARGS["home"], ARGS["ws"], ARGS["outside"]
policy = pb.SandboxPolicy(mode=pb.SandboxPolicy.WORKSPACE_WRITE, hide_home=ARGS["hide"])
try:
    s = stub.CreateSession(pb.CreateSessionRequest(workspace=ws, sandbox_policy=policy, approval_policy=pb.NEVER),
                           timeout=120)
except grpc.RpcError as error:          # a refusal (INVALID_ARGUMENT, with a message) is a safe answer
    print(json.dumps({"error": [error.code().name, error.details()]}))
    raise SystemExit(0)
out = {"hide": s.sandbox_policy.hide_home,
       "direct": run(s.id, ["cat", home + "/.ssh/id_rsa"]),
       "proc_root": run(s.id, ["cat", "/proc/%d/root%s/.ssh/id_rsa" % (outside, home)]),
       "proc_cwd": run(s.id, ["cat", "/proc/%d/cwd/.ssh/id_rsa" % outside]),
       "pids": run(s.id, ["sh", "-c", "ls /proc | grep -c '^[0-9]'"])}
stub.CloseSession(pb.CloseSessionRequest(session_id=s.id), timeout=60)
print(json.dumps(out))
'''


def _outside_process(home: Home) -> subprocess.Popen[bytes]:
    """A process of the user's own outside any sandbox (their shell, their `sandboxd mcp --gateway`), cwd in the home."""
    return subprocess.Popen(["sleep", "300"], cwd=home.home, user=home.user.uid, group=home.user.gid,
                            extra_groups=[], stdin=subprocess.DEVNULL)


def _probe(home: Home, daemon: Daemon, hide: bool, outside: int) -> dict[str, Any]:  # noqa: F811
    return run_client_as(home.user.uid, home.user.gid, daemon.socket, PROBE,
                         {"home": str(home.home), "ws": str(home.workspace), "outside": outside, "hide": hide})


def test_proc_of_the_owners_outside_process_does_not_show_the_hidden_home(home: Home, daemon: Daemon) -> None:  # noqa: F811
    sleeper = _outside_process(home)
    try:
        control = _probe(home, daemon, False, sleeper.pid)
        hidden = _probe(home, daemon, True, sleeper.pid)
    finally:
        sleeper.kill()
        sleeper.wait()
    assert control["direct"] == [KEY, 0], control            # control: without hide_home the key reads
    assert hidden["hide"] is True and hidden["direct"][1] != 0, hidden   # the wall holds by the direct path
    for path in ("proc_root", "proc_cwd"):
        out, status = hidden[path]
        assert status != 0 and "sbxt-h9b" not in out, (path, hidden)


def test_a_home_the_user_does_not_own_is_hidden(sandboxd_daemon_module: DaemonFactory,
                                                           daemon: Daemon) -> None:  # noqa: F811
    """A home directory owned by root (sftp-chroot style, /home/u root:root 0755, the user's files
    inside theirs): hide_home must hide it, or refuse with a message, not silently show it."""
    with plain_users(1) as (user,):
        path = sandboxd_daemon_module.base / f"roothome-{user.name}"
        _make_home(path, user, 0)
        h = Home(user, path, path / "project")
        shown = _probe(h, daemon, False, os.getpid())
        out = _probe(h, daemon, True, os.getpid())
    assert shown["direct"] == [KEY, 0], shown                       # control: without hide_home the key reads
    assert out["hide"] is True, out                                 # hidden whoever owns the directory
    text, status = out["direct"]
    assert status != 0 and "sbxt-h9b" not in text, out


@pytest.mark.parametrize("where", ["missing", "root"])
def test_a_home_that_cannot_be_hidden_is_refused(where: str, sandboxd_daemon_module: DaemonFactory,
                                                 daemon: Daemon) -> None:  # noqa: F811
    """A home that does not exist, or is "/": hide_home is refused with a message, never reported
    true while nothing is hidden; without hide_home the same session is made (the control)."""
    with plain_users(1) as (user,):
        workspace = sandboxd_daemon_module.base / f"ws-{user.name}"
        workspace.mkdir()
        os.chown(workspace, user.uid, user.gid)
        home = "/" if where == "root" else str(sandboxd_daemon_module.base / f"gone-{user.name}")
        subprocess.run(["usermod", "-d", home, user.name], check=True, capture_output=True)
        args = {"home": home, "ws": str(workspace), "outside": os.getpid()}
        control = run_client_as(user.uid, user.gid, daemon.socket, PROBE, {**args, "hide": False})
        refused = run_client_as(user.uid, user.gid, daemon.socket, PROBE, {**args, "hide": True})
    assert control.get("hide") is False, control
    assert refused.get("error", [""])[0] == "INVALID_ARGUMENT", refused
    assert "hide_home" in refused["error"][1] and "home" in refused["error"][1], refused


def test_the_home_by_another_mount_of_its_directory_is_hidden(sandboxd_daemon_module: DaemonFactory,
                                                              daemon: Daemon) -> None:  # noqa: F811
    """/home bind-mounted from /var/home (fstab `bind`, an image-based distro's layout), or one btrfs
    subvolume mounted twice: the user database names /home/u, the same directory is also at
    /var/home/u. hide_home covers /home/u only (its realpath): the other mount still shows the key."""
    with plain_users(1) as (user,):
        homes = sandboxd_daemon_module.base / f"homes-{user.name}"
        alias = sandboxd_daemon_module.base / f"var-homes-{user.name}"
        homes.mkdir()
        alias.mkdir()
        os.chmod(homes, 0o755)
        os.chmod(alias, 0o755)
        path = homes / "u"
        _make_home(path, user, user.uid)
        subprocess.run(["mount", "--bind", str(homes), str(alias)], check=True)
        try:
            h = Home(user, path, path / "project")
            out = _probe(h, daemon, True, os.getpid())
            by_alias = PROBE.replace('"direct": run(s.id, ["cat", home + "/.ssh/id_rsa"])',
                                     '"direct": run(s.id, ["cat", ARGS["alias"] + "/u/.ssh/id_rsa"])')
            args = {"home": str(path), "ws": str(path / "project"), "outside": os.getpid(), "alias": str(alias)}
            shown = run_client_as(user.uid, user.gid, daemon.socket, by_alias, {**args, "hide": False})
            other = run_client_as(user.uid, user.gid, daemon.socket, by_alias, {**args, "hide": True})
        finally:
            subprocess.run(["umount", str(alias)], check=True)
    assert shown["direct"] == [KEY, 0], shown               # control: the alias shows the key without hide_home
    assert out["direct"][1] != 0, out                      # the home by its own path
    text, status = other["direct"]
    assert status != 0 and "sbxt-h9b" not in text, other


def test_other_mounts_reads_the_mount_table(tmp_path: Path) -> None:
    """launcher.homes.other_mounts on a written table: a bind of /var/home at /home (escaped names),
    one btrfs subvolume mounted twice; another filesystem's mount of the same path is not an alias."""
    table = tmp_path / "mountinfo"
    table.write_text(
        "1 0 8:1 / / rw - ext4 /dev/sda1 rw\n"
        "2 1 8:2 / /var rw - ext4 /dev/sda2 rw\n"
        "3 1 8:2 /home /home rw - ext4 /dev/sda2 rw\n"
        "4 1 8:2 /home/u /srv/my\\040u rw - ext4 /dev/sda2 rw\n"
        "5 1 0:40 /@home /data rw - btrfs /dev/sdb rw\n"
        "6 1 0:40 / /pool rw - btrfs /dev/sdb rw\n"
        "7 1 8:3 /home /elsewhere rw - ext4 /dev/sda3 rw\n")
    assert other_mounts("/home/u", str(table)) == ("/var/home/u", "/srv/my u")
    assert other_mounts("/data/v", str(table)) == ("/pool/@home/v",)
    assert other_mounts("/nowhere/u", str(tmp_path / "gone")) == ()
