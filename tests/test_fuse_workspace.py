"""A workspace on a FUSE mount that root cannot read is refused saying why (issue 24, item 7).

A plain user's FUSE mount without ``allow_other`` (sshfs, rclone, a user's own server) answers
only that user: root gets EACCES. A sandbox is set up as root before it drops to the caller's
uid, so it cannot use such a directory. Before, CreateSession failed with FAILED_PRECONDITION and
"the fork server could not handle the request (PermissionError: [Errno 13] Permission denied)";
now it is INVALID_ARGUMENT naming the path, its file system and the fix. The controls: the mount
works for its user, refuses root, and the same request on a local directory succeeds.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from daemon_helpers import DaemonFactory, PlainUser, plain_users, run_client_as
from user_fuse import UserFuse, fuse_for_users  # noqa: F401 - a fixture

ATTEMPTS = r'''
def attempt(workspace, roots):
    try:
        s = stub.CreateSession(pb.CreateSessionRequest(workspace=workspace, approval_policy=pb.NEVER,
            sandbox_policy=pb.SandboxPolicy(mode=pb.SandboxPolicy.WORKSPACE_WRITE, writable_roots=roots)), timeout=60)
        out = run(s.id, ["/bin/pwd"])
        stub.CloseSession(pb.CloseSessionRequest(session_id=s.id), timeout=60)
        return {"code": "OK", "out": out}
    except grpc.RpcError as error:
        return {"code": error.code().name, "detail": error.details()}
print(json.dumps({"listed": os.listdir(ARGS["mount"]),
                  "workspace": attempt(ARGS["mount"], []),
                  "root": attempt(ARGS["local"], [ARGS["mount"]]),
                  "local": attempt(ARGS["local"], [])}))
'''


@pytest.fixture
def user() -> Iterator[PlainUser]:
    with plain_users(1) as (made,):
        yield made


def test_a_workspace_root_cannot_read_is_refused_saying_why(sandboxd_daemon: DaemonFactory, user: PlainUser,
                                                           fuse_for_users: None) -> None:  # noqa: F811
    daemon = sandboxd_daemon()
    home = sandboxd_daemon.base / "home"
    home.mkdir()
    os.chown(home, user.uid, user.gid)
    local = home / "project"
    local.mkdir()
    os.chown(local, user.uid, user.gid)
    mount = UserFuse("answering", user.uid, user.gid, home / "remote")
    try:
        with pytest.raises(PermissionError):
            os.stat(mount.mountpoint / ".")                # the control: root is refused by the mount
        seen = run_client_as(user.uid, user.gid, daemon.socket, ATTEMPTS,
                             {"mount": str(mount.mountpoint), "local": str(local)})
    finally:
        mount.release()
    assert seen["listed"] == [], seen                      # the control: the mount works for its user
    assert seen["local"] == {"code": "OK", "out": [f"{local}\n", 0]}, seen
    for what, key in (("workspace", "workspace"), ("writable root", "root")):
        result = seen[key]
        assert result["code"] == "INVALID_ARGUMENT", result
        detail = result["detail"]
        assert detail.startswith(f"{what} '{mount.mountpoint}' is on a file system (fuse.answering) that refuses "
                                 "root"), detail
        assert "allow_other" in detail and "PermissionError" not in detail, detail
    assert Path(mount.mountpoint).is_dir()
