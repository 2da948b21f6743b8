"""ReadFile, WriteFile, ListDir through a real daemon: they run inside the session's sandbox, the
policy refuses up front with a reason, and the kernel refuses what slips past the policy's check."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from daemon_fixtures import base, client, daemon  # noqa: F401 - pytest fixtures
from daemon_helpers import Daemon, PlainUser, owned_dir, run_client_as
from sandboxd.client import SandboxClient, sandbox_policy
from sandboxd.policy.tools import Effect, WriteScope
from sandboxd.v1 import sandboxd_pb2 as pb


@pytest.fixture
def workspace(base: Path, request: pytest.FixtureRequest) -> Path:
    path = base / request.node.name.replace("[", "_").replace("]", "")
    path.mkdir()
    return path


def refused(call: object, code: grpc.StatusCode) -> str:
    with pytest.raises(grpc.RpcError) as info:
        call()  # type: ignore[operator]
    assert info.value.code() == code, info.value.details()
    return str(info.value.details())


def test_write_then_read_round_trip(client: SandboxClient, workspace: Path) -> None:
    """A write creates parents on request, lands atomically (no temporary file left), and reads back."""
    session = client.create_session(str(workspace))
    reply = client.stub.WriteFile(pb.WriteFileRequest(session_id=session.id, path="deep/er/f.txt",
                                                      data=b"payload\n", create_parents=True, mode=0o600))
    assert reply.bytes_written == 8
    assert (workspace / "deep/er/f.txt").read_bytes() == b"payload\n"
    assert stat.S_IMODE((workspace / "deep/er/f.txt").stat().st_mode) == 0o600
    assert sorted(p.name for p in (workspace / "deep/er").iterdir()) == ["f.txt"]
    assert client.stub.ReadFile(pb.ReadFileRequest(session_id=session.id, path="deep/er/f.txt")).data == b"payload\n"


def test_overwrite_keeps_the_mode_and_read_reports_truncation(client: SandboxClient, workspace: Path) -> None:
    (workspace / "x.sh").write_bytes(b"old")
    os.chmod(workspace / "x.sh", 0o755)
    session = client.create_session(str(workspace))
    client.stub.WriteFile(pb.WriteFileRequest(session_id=session.id, path="x.sh", data=b"0123456789"))
    assert stat.S_IMODE((workspace / "x.sh").stat().st_mode) == 0o755
    reply = client.stub.ReadFile(pb.ReadFileRequest(session_id=session.id, path="x.sh", max_bytes=4))
    assert reply.data == b"0123" and reply.truncated


def test_list_dir(client: SandboxClient, workspace: Path) -> None:
    (workspace / "a.txt").write_bytes(b"12345")
    (workspace / "sub").mkdir()
    (workspace / "ln").symlink_to("a.txt")
    session = client.create_session(str(workspace))
    entries = {e.name: e for e in client.stub.ListDir(pb.ListDirRequest(session_id=session.id)).entries}
    assert set(entries) == {"a.txt", "sub", "ln"}
    assert entries["a.txt"].type == "file" and entries["a.txt"].size == 5
    assert entries["sub"].type == "dir" and entries["ln"].type == "symlink"


def test_policy_refuses_writes_outside_with_a_reason(client: SandboxClient, workspace: Path, base: Path) -> None:
    outside = base / "outside-target"
    outside.mkdir(exist_ok=True)
    session = client.create_session(str(workspace))
    message = refused(lambda: client.stub.WriteFile(pb.WriteFileRequest(
        session_id=session.id, path=str(outside / "x"), data=b"x")), grpc.StatusCode.PERMISSION_DENIED)
    assert "outside the workspace" in message
    assert not (outside / "x").exists()
    (workspace / ".git" / "hooks").mkdir(parents=True)
    message = refused(lambda: client.stub.WriteFile(pb.WriteFileRequest(
        session_id=session.id, path=".git/hooks/pre-commit", data=b"x")), grpc.StatusCode.PERMISSION_DENIED)
    assert ".git/hooks" in message


def test_read_only_session_refuses_writes(client: SandboxClient, workspace: Path) -> None:
    session = client.create_session(str(workspace), policy=sandbox_policy("read-only"))
    message = refused(lambda: client.stub.WriteFile(pb.WriteFileRequest(
        session_id=session.id, path="f", data=b"x")), grpc.StatusCode.PERMISSION_DENIED)
    assert "read-only" in message
    assert not (workspace / "f").exists()


def test_kernel_refuses_what_the_policy_check_lets_through(client: SandboxClient, workspace: Path,
                                                            base: Path) -> None:
    """A symlink planted in the workspace points outside: the path looks inside, so the policy check
    passes, but the write happens in the sandbox, where the host is read-only."""
    outside = base / "outside-link-target"
    outside.mkdir(exist_ok=True)
    os.chmod(outside, 0o777)
    (workspace / "escape").symlink_to(outside)
    session = client.create_session(str(workspace))
    message = refused(lambda: client.stub.WriteFile(pb.WriteFileRequest(
        session_id=session.id, path="escape/x", data=b"x")), grpc.StatusCode.PERMISSION_DENIED)
    assert "refused by the kernel" in message
    assert list(outside.iterdir()) == []


def test_missing_file_is_not_found(client: SandboxClient, workspace: Path) -> None:
    session = client.create_session(str(workspace))
    refused(lambda: client.stub.ReadFile(pb.ReadFileRequest(session_id=session.id, path="nope")),
            grpc.StatusCode.NOT_FOUND)


def test_session_tmp_is_the_sandbox_one(client: SandboxClient, workspace: Path) -> None:
    """/tmp in a file tool is the session's private /tmp: a file written there is seen by Exec, not the host."""
    session = client.create_session(str(workspace))
    name = f"/tmp/sandboxd-file-tool-{os.getpid()}"
    client.stub.WriteFile(pb.WriteFileRequest(session_id=session.id, path=name, data=b"private"))
    assert not os.path.exists(name)
    assert client.exec(session.id, ["cat", name]).stdout == b"private"


SWAP_ATTACK = r'''
ws, root, victim = ARGS["ws"], ARGS["root"], ARGS["victim"]
policy = pb.SandboxPolicy(mode=pb.SandboxPolicy.WORKSPACE_WRITE, writable_roots=[root])
session = stub.CreateSession(pb.CreateSessionRequest(workspace=ws, sandbox_policy=policy,
                                                     approval_policy=pb.NEVER), timeout=120).id

def write(path):
    try:
        stub.WriteFile(pb.WriteFileRequest(session_id=session, path=path, data=b"x"), timeout=120)
        return ["OK", ""]
    except grpc.RpcError as error:
        return [error.code().name, error.details()]

def command(argv):
    try:
        return ["OK", run(session, argv)[1]]
    except grpc.RpcError as error:
        return [error.code().name, error.details()]

before = {"root": write(root + "/before"), "victim": write(victim + "/before")}
os.rename(root, root + ".old")                  # the attack: the root's name now leads to the victim's
os.symlink(victim, root)
after = {"root": write(root + "/after"), "victim": write(victim + "/after"),
         "touch_root": command(["touch", root + "/touched"]), "touch_victim": command(["touch", victim + "/touched"])}
stub.CloseSession(pb.CloseSessionRequest(session_id=session), timeout=120)
print(json.dumps({"before": before, "after": after}))
'''


def test_a_root_swapped_for_a_symlink_moves_nothing_the_daemon_judges(
        daemon: Daemon, plain_users: Callable[[int], list[PlainUser]]) -> None:
    """The daemon judges a session's writes on what the fork server built (the real paths of its
    workspace and roots, resolved as the owner by descriptor), never on the policy's names looked up
    again as root. A plain user whose writable root is swapped for a symlink to a directory of
    root's after the session was created: writes there (WriteFile, and `touch` in Exec) are still
    outside the roots (refused by the policy, before anything runs); the root's name is still the
    root to the policy. Control: the swap is real: a lookup of
    the root as root now lands in the victim's directory, and a write scope built from that lookup
    (what the daemon did before) would let the write through as inside the roots."""
    (user,) = plain_users(1)
    home = owned_dir(daemon.base / f"facts-{user.name}", user)
    ws, root = owned_dir(home / "ws", user), owned_dir(home / "root", user)
    victim = daemon.base / f"victim-{user.name}"
    victim.mkdir(mode=0o755)
    result = run_client_as(user.uid, user.gid, str(daemon.socket), SWAP_ATTACK,
                           {"ws": str(ws), "root": str(root), "victim": str(victim)})
    before, after = result["before"], result["after"]
    assert before["root"] == ["OK", ""] and before["victim"][0] == "PERMISSION_DENIED", result
    assert "outside the workspace and the writable roots" in before["victim"][1], result
    # The control: a lookup as root of the root's name finds the victim's directory now, and a scope
    # built on it takes the victim's directory for a writable root.
    assert os.path.realpath(root) == str(victim)
    assert WriteScope(roots=(str(ws), os.path.realpath(root))).effect_of([str(victim / "after")])[0] == \
        Effect.WORKSPACE_WRITE
    # The wall: refused by the policy as outside the roots (not run and refused by the kernel).
    for key in ("victim", "touch_victim"):
        assert after[key][0] == "PERMISSION_DENIED" and "outside the workspace" in after[key][1], (key, result)
    assert list(victim.iterdir()) == []
    # The root's name is still the root to the policy (allowed without asking); where it leads is
    # the kernel's to say in the sandbox (the moved directory while its bind stays, else read-only).
    assert after["touch_root"][0] == "OK", result
    assert after["root"][0] == "OK" or "refused by the kernel" in after["root"][1], result
    assert "before" in {p.name for p in (home / "root.old").iterdir()}
