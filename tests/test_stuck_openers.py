"""A user's stuck path lookups are bounded per owner (round 4's second hostile pass, finding 6).

Every request naming a path (CreateSession's workspace, writable roots, allowed sockets; a standing
rule's workspace; a one-shot run) has it opened as its caller in a child of the fork server
(kernel.access.PendingOpen). On a FUSE mount of the caller's own whose server reads requests and
answers none (tests/user_fuse.py's ``stuck``), that child is SIGKILLed at ``wait_seconds`` and stays
in D state until the mount goes: a host pid, ~2 MB, a descriptor of the fork server each, and before
this in no cgroup. A flood of CreateSession on such a mount left them without bound (the pass: 48 in
60 s from one user, ~2,900 an hour; the fork server would run out of descriptors for everyone).

Now each owner may have at most ``fork_server.stuck_openers_per_uid`` openers alive
(supervisor/openers.py): past it, while some are stuck, its requests naming paths are refused at once
with RESOURCE_EXHAUSTED naming the stuck path; on cgroup v1 each opener sits in its owner's pids group.

- ``test_a_flood_of_lookups_on_a_stuck_mount_leaves_at_most_the_bound``: the attacker floods; its live
  openers never exceed the bound, the fork server's descriptors stay within it, the attacker is told
  why, and a bystander's CreateSession + Exec succeed meanwhile. The control (the bound set far above
  the flood): the same flood leaves more stuck openers than the bound, and the fork server holds a
  descriptor for each.
- ``test_a_burst_of_lookups_that_answer_waits_its_turn``: with a bound of 1, concurrent requests of one
  user whose paths answer all succeed (a burst waits for a slot, it is never refused).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from conftest import SLOW, eventually
from daemon_helpers import Daemon, DaemonFactory, PlainUser, owned_dir, plain_users, run_client_as
from user_fuse import UserFuse, fuse_for_users  # noqa: F401 - a fixture

pytestmark = pytest.mark.timeout(int(600 * SLOW))

BOUND = 3                               # fork_server.stuck_openers_per_uid in the bounded daemon
UNBOUNDED = 1000                        # the control's: far above anything the flood reaches
WAIT_SECONDS = 1.0 * SLOW               # fork_server.wait_seconds: each stuck lookup is given up on after it
THREADS = 6                             # the attacker's concurrent requests (quotas.requests_per_uid is 8)
FLOOD_SECONDS = 6.0 * SLOW
WITHIN = 60.0 * SLOW                    # how long what must happen may take here (never a measure)
SLACK_FDS = 4                           # the fork server's descriptors that come and go on their own

# As the attacker: THREADS threads of CreateSession on fresh paths under the stuck mount, for
# ARGS["seconds"]; the codes seen, and one detail per code.
FLOOD = r'''
import threading, time
codes, details = {}, {}
lock = threading.Lock()
def flood(i):
    j = 0
    began = time.monotonic()
    while time.monotonic() - began < ARGS["seconds"]:
        j += 1
        try:
            stub.CreateSession(pb.CreateSessionRequest(workspace=f"{ARGS['mount']}/w{i}-{j}", approval_policy=pb.NEVER,
                sandbox_policy=pb.SandboxPolicy(mode=pb.SandboxPolicy.WORKSPACE_WRITE)), timeout=120)
            code, detail = "OK", ""
        except grpc.RpcError as error:
            code, detail = error.code().name, error.details()
        with lock:
            codes[code] = codes.get(code, 0) + 1
            details.setdefault(code, detail)
        if code == "RESOURCE_EXHAUSTED":
            time.sleep(0.02)              # refused at once: no need to spin
threads = [threading.Thread(target=flood, args=(i,)) for i in range(ARGS["threads"])]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(json.dumps({"codes": codes, "details": details}))
'''

# As the victim: CreateSession + Exec + CloseSession, ARGS["rounds"] times; the failures.
VICTIM = r'''
failures = []
for _ in range(ARGS["rounds"]):
    try:
        s = stub.CreateSession(pb.CreateSessionRequest(workspace=ARGS["ws"], approval_policy=pb.NEVER,
            sandbox_policy=pb.SandboxPolicy(mode=pb.SandboxPolicy.WORKSPACE_WRITE)), timeout=120)
        out, status = run(s.id, ["/bin/echo", "victim"])
        if (out, status) != ("victim\n", 0):
            failures.append([out, status])
        stub.CloseSession(pb.CloseSessionRequest(session_id=s.id), timeout=120)
    except grpc.RpcError as error:
        failures.append([error.code().name, error.details()])
print(json.dumps({"failures": failures}))
'''

# As one user: ARGS["count"] CreateSession at once on its own (answering) workspace; the codes.
BURST = r'''
import threading
codes = []
def create():
    try:
        s = stub.CreateSession(pb.CreateSessionRequest(workspace=ARGS["ws"], approval_policy=pb.NEVER,
            sandbox_policy=pb.SandboxPolicy(mode=pb.SandboxPolicy.READ_ONLY)), timeout=120)
        codes.append("OK")
        stub.CloseSession(pb.CloseSessionRequest(session_id=s.id), timeout=120)
    except grpc.RpcError as error:
        codes.append(error.code().name + ": " + error.details())
threads = [threading.Thread(target=create) for _ in range(ARGS["count"])]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(json.dumps({"codes": codes}))
'''


@pytest.fixture(scope="module")
def users() -> Iterator[list[PlainUser]]:
    """Two plain users (attacker, victim), made here and removed afterwards."""
    with plain_users(2) as made:
        yield made


def openers_of(daemon: Daemon, uid: int) -> list[psutil.Process]:
    """The fork server's children running as ``uid``: its path openers (the attacker has no sandbox)."""
    fork = daemon.fork_server_pid()
    if fork is None:
        return []
    found = []
    for child in psutil.Process(fork).children():
        try:
            if child.uids().real == uid:
                found.append(child)
        except psutil.NoSuchProcess:
            pass
    return found


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def pidfds_on(pid: int, children: set[int]) -> int:
    """How many of process ``pid``'s descriptors are pidfds of ``children`` (fdinfo names a pidfd's process)."""
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fdinfo"):
        try:
            with open(f"/proc/{pid}/fdinfo/{fd}") as f:
                count += any(line.startswith("Pid:") and int(line.split()[1]) in children for line in f)
        except (OSError, ValueError):
            pass
    return count


def pids_group_of(pid: int) -> str | None:
    """The v1 pids cgroup of ``pid`` (None where pids is not a v1 hierarchy)."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, names, path = line.split(":", 2)
        if "pids" in names.split(","):
            return path
    return None


@pytest.mark.parametrize("bound", [BOUND, UNBOUNDED], ids=["bounded", "control-unbounded"])
def test_a_flood_of_lookups_on_a_stuck_mount_leaves_at_most_the_bound(
        bound: int, users: list[PlainUser], fuse_for_users: None,  # noqa: F811 - the fixture
        sandboxd_daemon: DaemonFactory) -> None:
    from sandboxd.kernel import cgroups

    attacker, victim = users
    daemon = sandboxd_daemon(config=f"[fork_server]\nwait_seconds = {WAIT_SECONDS}\n"
                                    f"stuck_openers_per_uid = {bound}\n")
    victim_ws = owned_dir(sandboxd_daemon.base / "ws-victim", victim)
    fork = daemon.fork_server_pid()
    assert fork is not None
    quiet = run_client_as(victim.uid, victim.gid, daemon.socket, VICTIM, {"ws": str(victim_ws), "rounds": 1})
    assert quiet["failures"] == [], quiet
    fds_before = fd_count(fork)

    mount = UserFuse("stuck", attacker.uid, attacker.gid, sandboxd_daemon.base / "fuse-attacker")
    try:
        most = [0, 0]                       # the most openers, and the fork server's pidfds of them, seen
        flooding = threading.Event()
        flooding.set()

        def sample() -> None:
            while flooding.is_set():
                openers = {p.pid for p in openers_of(daemon, attacker.uid)}
                most[0] = max(most[0], len(openers))
                most[1] = max(most[1], pidfds_on(fork, openers))
                time.sleep(0.05)
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        result: dict[str, Any] = {}
        attack = threading.Thread(target=lambda: result.update(run_client_as(
            attacker.uid, attacker.gid, daemon.socket, FLOOD,
            {"mount": str(mount.mountpoint), "threads": THREADS, "seconds": FLOOD_SECONDS}, timeout=WITHIN * 5)),
            daemon=True)
        attack.start()
        assert mount.swallowed() is not None, "the flood never reached the stuck mount"
        during = run_client_as(victim.uid, victim.gid, daemon.socket, VICTIM, {"ws": str(victim_ws), "rounds": 3})
        attack.join(WITHIN * 5)
        assert not attack.is_alive(), "the flood never ended"
        left = openers_of(daemon, attacker.uid)
        fds_after = fd_count(fork)
        flooding.clear()
        sampler.join()
        print(f"\nbound {bound}: attacker's codes {result['codes']}; openers at the end {len(left)}, at most "
              f"{most[0]} (the fork server's pidfds of them: at most {most[1]}); fork server descriptors {fds_before} "
              f"before, {fds_after} after")

        # The attack did what it does: lookups stuck in D state, SIGKILLed and still there.
        assert result["codes"].get("DEADLINE_EXCEEDED", 0) >= 1, result
        assert left and all(p.status() == psutil.STATUS_DISK_SLEEP for p in left), [(p.pid, p.status()) for p in left]
        # A bystander is served throughout.
        assert during["failures"] == [], during
        # The fork server holds a pidfd for each (and, while it opens, its socket).
        assert most[1] >= 1 and pidfds_on(fork, {p.pid for p in left}) == len(left), most
        if bound == UNBOUNDED:
            # The control: without the bound the stuck openers pile up past it, a descriptor each.
            assert len(left) > BOUND and fds_after > fds_before + 2 * BOUND + SLACK_FDS, (len(left), fds_after)
        else:
            assert most[0] <= bound and most[1] <= bound and len(left) <= bound, (most, len(left))
            assert fds_after <= fds_before + 2 * bound + SLACK_FDS, (fds_before, fds_after)
            refused = result["details"].get("RESOURCE_EXHAUSTED", "")
            assert str(mount.mountpoint) in refused and "does not answer" in refused and \
                "fork_server.stuck_openers_per_uid" in refused, result
            # Each counts against its owner's pids share where that is a v1 group (a move through
            # ``tasks``, no grace period); on v2 the bound alone holds.
            if cgroups.where("pids") == "v1":
                groups = {pids_group_of(p.pid) for p in left}
                assert all(group and f"/{cgroups.OWNER_PREFIX}uid-{attacker.uid}" in group for group in groups), groups

        # Once the mount goes, so do they, and the fork server's descriptors with them.
        mount.release()
        assert eventually(lambda: not openers_of(daemon, attacker.uid), WITHIN), openers_of(daemon, attacker.uid)
        assert eventually(lambda: fd_count(fork) <= fds_before + SLACK_FDS, WITHIN), (fds_before, fd_count(fork))
        after = run_client_as(victim.uid, victim.gid, daemon.socket, VICTIM, {"ws": str(victim_ws), "rounds": 1})
        assert after["failures"] == [], after
    finally:
        mount.release()


def test_a_burst_of_lookups_that_answer_waits_its_turn(users: list[PlainUser],
                                                       sandboxd_daemon: DaemonFactory) -> None:
    """A bound of 1 and eight concurrent CreateSession of one user: each waits for the one slot, none is
    refused (nothing of that user is stuck)."""
    user = users[1]
    daemon = sandboxd_daemon(config="[fork_server]\nstuck_openers_per_uid = 1\n")
    ws = owned_dir(sandboxd_daemon.base / "ws-burst", user)
    result = run_client_as(user.uid, user.gid, daemon.socket, BURST, {"ws": str(ws), "count": 8})
    assert result["codes"] == ["OK"] * 8, result
