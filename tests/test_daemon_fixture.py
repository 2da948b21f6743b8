"""The one daemon fixture (conftest.py ``sandboxd_daemon``, daemon_helpers.DaemonFactory) and
``plain_users``: the layout they promise, and that the leak check finds what a daemon leaves behind
(planted for real: a bound socket, a cgroup directory, a live process), with a clean stop as control."""

from __future__ import annotations

import os
import pwd
import socket
import subprocess
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from daemon_helpers import DaemonFactory, PlainUser, create_session, proc_info, run_client_as, run_exec
from daemon_helpers import plain_users as make_plain_users
from sandboxd.v1 import sandboxd_pb2 as pb


def test_the_layout_keeps_workspaces_out_of_the_socket_directory(sandboxd_daemon: DaemonFactory) -> None:
    daemon = sandboxd_daemon()
    base = sandboxd_daemon.base
    assert Path(daemon.socket) == base / "run" / "sandboxd.sock"
    assert daemon.private == base / "run" / ".sandboxd-private" and daemon.private.is_dir()
    assert (base / "state" / "events.db").exists()
    workspace = sandboxd_daemon.workspace()
    assert workspace.parent == base and workspace.name.startswith("ws-")
    session = create_session(daemon.stub, workspace)
    assert run_exec(daemon.stub, session.id, ["sh", "-c", "echo hi > f; cat f"]).stdout == b"hi\n"
    assert (workspace / "f").read_text() == "hi\n"


def test_a_clean_stop_leaves_nothing_and_planted_leftovers_are_found(sandboxd_daemon: DaemonFactory) -> None:
    daemon = sandboxd_daemon()
    session = create_session(daemon.stub, sandboxd_daemon.workspace())
    assert run_exec(daemon.stub, session.id, ["echo", "x"]).stdout == b"x\n"
    assert daemon.session_inits()                         # a session process the stop must take down
    daemon.close_channels()
    assert daemon.stop() == 0
    assert daemon.leftovers(within=1) == []               # the control: a clean stop leaves nothing

    relay = daemon.private / "relay"
    relay.mkdir(exist_ok=True)
    planted_socket = socket.socket(socket.AF_UNIX)
    planted_socket.bind(str(relay / "planted.sock"))
    parent = Path(f"/sys/fs/cgroup/pids/sbxt-{uuid.uuid4().hex[:8]}")
    fork = min(pid for pid in daemon.spawner_pids if pid != daemon.pid)
    planted_cgroup = parent / f"run-{fork}-planted"
    sleeper = subprocess.Popen(["sleep", "300"])
    try:
        planted_cgroup.mkdir(parents=True)
        info = proc_info(sleeper.pid)
        assert info is not None
        daemon.family[sleeper.pid] = info                  # as if the daemon had started it
        found = "\n".join(daemon.leftovers(within=1))
        assert str(relay / "planted.sock") in found
        assert str(planted_cgroup) in found
        assert f"{sleeper.pid}:" in found or f"{sleeper.pid}," in found, found
    finally:
        sleeper.kill()
        sleeper.wait()
        del daemon.family[sleeper.pid]
        planted_socket.close()
        os.unlink(relay / "planted.sock")
        for path in (planted_cgroup, parent):
            if path.exists():
                path.rmdir()
    assert daemon.leftovers(within=1) == []


def test_a_refused_start_gives_the_status_and_the_log(sandboxd_daemon: DaemonFactory) -> None:
    refused = sandboxd_daemon.start_failure(args=["--tcp", "127.0.0.1:1"])
    assert refused.returncode == 2 and "needs all of --tcp" in refused.log, refused
    with pytest.raises(AssertionError, match="should have refused to start"):
        sandboxd_daemon.start_failure(within=3)            # this one starts: expecting a refusal fails


def test_plain_users_are_unprivileged_separate_and_removed(sandboxd_daemon: DaemonFactory) -> None:
    daemon = sandboxd_daemon()
    root_session = create_session(daemon.stub, sandboxd_daemon.workspace())
    with make_plain_users(2) as users:
        assert len({user.name for user in users}) == 2 and all(user.name.startswith("sbxt-") for user in users)
        for name, uid, gid in users:
            entry = pwd.getpwnam(name)
            assert (entry.pw_uid, entry.pw_gid) == (uid, gid) and uid != 0
            assert entry.pw_shell == "/usr/sbin/nologin" and not os.path.exists(entry.pw_dir)
        seen = run_client_as(users[0].uid, users[0].gid, daemon.socket, (
            "listed = [s.id for s in stub.ListSessions(pb.ListSessionsRequest()).sessions]\n"
            "print(json.dumps({'uid': os.getuid(), 'listed': listed}))\n"))
        assert seen == {"uid": users[0].uid, "listed": []}    # root's session stays root's
        listed = daemon.stub.ListSessions(pb.ListSessionsRequest()).sessions
        assert [s.id for s in listed] == [root_session.id]   # the control: root sees it
    for name, _, _ in users:
        with pytest.raises(KeyError):
            pwd.getpwnam(name)


def test_the_plain_users_fixture_hands_out_name_uid_gid(plain_users: Callable[[int], list[PlainUser]]) -> None:
    (name, uid, gid), = plain_users(1)
    assert pwd.getpwnam(name).pw_uid == uid and uid != 0 and isinstance(gid, int)
