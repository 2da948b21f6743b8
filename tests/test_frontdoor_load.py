"""The front door under a flood of idle connections from one local user (a real daemon, real users).

One plain user opens 3,000 connections to the public socket and keeps them open. The door must
serve its first ``quotas.connections_per_uid`` (64) and close every other one at once, with one
thread for all of them (the daemon's thread count stays flat) and a bounded number of file
descriptors, while another user's Exec keeps working; once the flood is gone, the daemon's
descriptors are back where they were.
"""

from __future__ import annotations

import os
import pwd
import subprocess
import sys
from collections.abc import Callable, Iterator

import pytest

from conftest import eventually
from daemon_helpers import Daemon, fd_count, make_base_dir, remove_tree, run_client_as, running_daemon

pytestmark = pytest.mark.timeout(240)

FLOOD = 3000
QUOTA = 64                      # quotas.connections_per_uid's default
FDS_PER_CONNECTION = 7          # accepted socket, backend socket, two pipes, the gRPC server's end

# As root: room for FLOOD descriptors; then as uid/gid: connect FLOOD times and keep them all.
# Each connection ends up readable: the gRPC server's greeting (SETTINGS) on a served one, EOF
# on one the door closed. Prints "closed served", then waits for a line on stdin.
FLOOD_CLIENT = r"""
import os, resource, select, socket, sys, time
public, uid, gid, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
resource.setrlimit(resource.RLIMIT_NOFILE, (count + 256, count + 256))
os.setgroups([])
os.setgid(gid)
os.setuid(uid)
socks = []
for _ in range(count):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(public)
    socks.append(s)
poller = select.poll()
waiting = {s.fileno(): s for s in socks}
for fd in waiting:
    poller.register(fd, select.POLLIN)
deadline = time.monotonic() + 60
while waiting and time.monotonic() < deadline:
    for fd, _ in poller.poll(1000):
        poller.unregister(fd)
        del waiting[fd]
closed = 0
for s in socks:
    try:
        closed += s.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        pass
    except ConnectionResetError:
        closed += 1
print(closed, count - closed, flush=True)
sys.stdin.readline()
"""

# Another user's whole round: a session, an Exec, the session closed.
EXEC_CLIENT = r"""
session = stub.CreateSession(pb.CreateSessionRequest(workspace=ARGS["ws"], approval_policy=pb.NEVER), timeout=120)
out, exit_code = run(session.id, ["id", "-u"])
stub.CloseSession(pb.CloseSessionRequest(session_id=session.id), timeout=60)
print(json.dumps({"out": out, "exit": exit_code}))
"""


def wait_for(condition: Callable[[], bool], within: float = 15.0) -> bool:
    return eventually(condition, within)


def threads_of(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


@pytest.fixture
def two_users() -> Iterator[list[tuple[int, int]]]:
    """Two plain local users (useradd), as (uid, gid); removed afterwards."""
    names = [f"sbxt-{os.urandom(4).hex()}" for _ in range(2)]
    made = []
    try:
        for name in names:
            subprocess.run(["useradd", "-M", "-N", "-s", "/usr/sbin/nologin", name], check=True)
            made.append(name)
        yield [(pwd.getpwnam(name).pw_uid, pwd.getpwnam(name).pw_gid) for name in names]
    finally:
        for name in made:
            subprocess.run(["userdel", name], check=True)


def test_one_users_flood_of_idle_connections_leaves_everyone_else_served(two_users: list[tuple[int, int]]) -> None:
    (flooder, flooder_gid), (other, other_gid) = two_users
    workspace = make_base_dir("sbxt-ws-")
    os.chown(workspace, other, other_gid)
    flood: subprocess.Popen[str] | None = None
    try:
        with running_daemon() as daemon:
            pid = daemon.pid

            def other_users_exec() -> None:
                res = run_client_as(other, other_gid, daemon.socket, EXEC_CLIENT, {"ws": str(workspace)})
                assert res == {"out": f"{other}\n", "exit": 0}, res

            other_users_exec()  # warm: what the first session and call create once
            threads_before, fds_before = threads_of(pid), fd_count(pid)

            flood = subprocess.Popen([sys.executable, "-c", FLOOD_CLIENT, daemon.socket, str(flooder),
                                      str(flooder_gid), str(FLOOD)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd="/")
            assert flood.stdout is not None
            closed, served = map(int, flood.stdout.readline().split())
            assert (closed, served) == (FLOOD - QUOTA, QUOTA)
            threads_during, fds_during = threads_of(pid), fd_count(pid)
            print(f"\n[frontdoor] {FLOOD} connections by one uid: {served} served, {closed} closed; daemon threads "
                  f"{threads_before} -> {threads_during}, fds {fds_before} -> {fds_during}")
            # One thread for the door whatever the number of connections (it had two per connection).
            assert threads_during <= threads_before + 2, (threads_before, threads_during)
            assert fds_during <= fds_before + QUOTA * FDS_PER_CONNECTION + 16, (fds_before, fds_during)

            # Meanwhile, another user is served as usual.
            other_users_exec()
            assert threads_of(pid) <= threads_before + 2

            flood.communicate("\n", timeout=60)
            flood = None
            assert wait_for(lambda: fd_count(pid) <= fds_before), (fds_before, fd_count(pid))
            assert threads_of(pid) <= threads_before + 2
            other_users_exec()
    finally:
        if flood is not None:
            flood.kill()
            flood.wait()
        remove_tree(workspace)


def test_the_quota_comes_from_the_configuration_file(two_users: list[tuple[int, int]]) -> None:
    (flooder, flooder_gid), _ = two_users
    base = make_base_dir()
    config = base / "sandboxd.toml"
    config.write_text("[quotas]\nconnections_per_uid = 5\n")
    daemon = Daemon(base, args=["--config", str(config)])
    try:
        daemon.start()
        flood = subprocess.run([sys.executable, "-c", FLOOD_CLIENT, daemon.socket, str(flooder), str(flooder_gid),
                                "20"], input="\n", capture_output=True, text=True, timeout=120, cwd="/")
        assert flood.stdout.split() == ["15", "5"], flood.stderr
        assert "has 5 connections open" in daemon.log_path.read_text()
    finally:
        daemon.close()
        remove_tree(base)
