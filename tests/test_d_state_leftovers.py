"""A user's D-state leftovers cost nobody else anything (issue 24, items 2 and 3).

The attacker, a plain user, mounts a FUSE file system of its own (fusermount3) whose server answers
INIT and then reads every request and answers none, and makes four danger-full-access calls that
each start ``stat`` on it in the background and time out a second later. The timeout SIGKILLs each
call's group, but a process waiting on a request its FUSE server has read cannot die: the ``stat``
processes stay in D state, and their groups cannot be removed, for as long as the attacker likes.

Before issue 24 the fork server emptied and removed those groups in its loop (up to 5 s emptying
plus 200 x 5 ms of rmdir per hierarchy, per call), so everybody's requests waited behind them, and a
replacement fork server's start-up sweep waited on them past the watchdog, which ended the daemon.
Now a group is signalled once and handed to the loop's ``Leftovers``, which removes it when its
``cgroup.events`` says it is empty (on cgroup v1 alone: a retry on the loop's timer).

- ``test_a_users_d_state_leftovers_stall_nobody_else``: meanwhile another plain user (the victim)
  creates sessions and runs commands: every one succeeds, while the leftovers are still there, and
  the watchdog (pinging every ``PING_TIMEOUT / 3``: a loop held longer than ``PING_TIMEOUT`` would
  be killed and replaced) never has to act. The control: the leftovers are real (the ``stat``
  processes are in D state in their groups) and go, with their groups, once the attacker's server
  goes. (Before: the watchdog killed the fork server twice and the daemon exited; with the default
  10 s ping the victim waited up to 17.9 s.)
- ``test_a_fork_server_crash_with_leftovers_is_survived``: the fork server is SIGKILLed while the
  leftovers are there; the daemon does not exit, its replacement serves the victim at once (the
  leftovers still there), and removes the dead server's groups once they empty. (Before: "cannot
  restart the fork server", the daemon exited.)

The pieces, on the real kernel: ``Leftovers`` with a D-state process in a v2 group (cgroup.events)
and in v1-only groups (the timer); a group made in another PID namespace is never swept (the
control: by its pid here it would be dead); a wait whose child answered while the loop was late is
answered, not expired blaming the caller's path; the watchdog gives a fork server that has not
answered anything since its start the start-up allowance, and kills one that answered and stopped.

The victim's latencies are printed (docs/hardening-round-4.md quotes them); nothing is asserted
about speed beyond what the watchdog itself enforces.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from cgroup_helpers import LeftoversLoop, private_base
from conftest import PY, REPO, SLOW, eventually
from daemon_helpers import Daemon, DaemonFactory, PlainUser, owned_dir, plain_users, run_client_as
from user_fuse import UserFuse, fuse_for_users  # noqa: F401 - a fixture

pytestmark = pytest.mark.timeout(int(600 * SLOW))

CALLS = 4                              # the four timed-out danger-full-access calls
CALL_TIMEOUT = 1.0 * SLOW
PING_TIMEOUT = 4.0 * SLOW               # the watchdog's bound: below one group's old emptying bound (5 s)
BOUND = 60.0 * SLOW                    # how long anything that must happen may take here (never a measure)
VICTIM_SECONDS = 12.0                  # how long the victim keeps creating sessions and running commands

# As the attacker: a danger-full-access session with limits (its groups in every hierarchy, as in
# the issue), then CALLS calls each leaving ``stat`` on the stuck mount behind when it times out.
ATTACK = r'''
import threading, time
limits = pb.Limits(pids=ARGS["pids"], memory_bytes=ARGS["memory"])
s = stub.CreateSession(pb.CreateSessionRequest(workspace=ARGS["ws"], approval_policy=pb.NEVER, limits=limits,
    sandbox_policy=pb.SandboxPolicy(mode=pb.SandboxPolicy.DANGER_FULL_ACCESS)), timeout=120)
results = [None] * ARGS["calls"]
def call(i):
    argv = ["sh", "-c", 'stat "$0" >/dev/null 2>&1 & exec sleep 600', ARGS["mount"] + f"/x{i}"]
    start = pb.ExecStart(session_id=s.id, argv=argv, timeout_seconds=ARGS["timeout"])
    began = time.monotonic()
    try:
        for r in stub.Exec(iter([pb.ExecRequest(start=start)]), timeout=300):
            if r.WhichOneof("kind") == "result":
                results[i] = {"timed_out": r.result.timed_out, "seconds": time.monotonic() - began}
    except grpc.RpcError as error:
        results[i] = {"error": error.code().name, "detail": error.details()}
threads = [threading.Thread(target=call, args=(i,)) for i in range(ARGS["calls"])]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(json.dumps({"session": s.id, "calls": results}))
'''

# As the victim: CreateSession + Exec + CloseSession rounds for ARGS["seconds"] (at least one);
# each round's seconds, or the error it got.
VICTIM = r'''
import time
rounds = []
began = time.monotonic()
while not rounds or time.monotonic() - began < ARGS["seconds"]:
    started = time.monotonic()
    entry = {"started": started}
    try:
        s = stub.CreateSession(pb.CreateSessionRequest(workspace=ARGS["ws"], approval_policy=pb.NEVER,
            sandbox_policy=pb.SandboxPolicy(mode=pb.SandboxPolicy.WORKSPACE_WRITE)), timeout=120)
        entry["create"] = time.monotonic() - started
        out, status = run(s.id, ["/bin/echo", "victim"])
        entry["exec"] = time.monotonic() - started - entry["create"]
        entry["ok"] = (out, status) == ("victim\n", 0)
        stub.CloseSession(pb.CloseSessionRequest(session_id=s.id), timeout=120)
    except grpc.RpcError as error:
        entry["error"] = error.code().name
        entry["detail"] = error.details()
    entry["ended"] = time.monotonic()
    rounds.append(entry)
print(json.dumps({"rounds": rounds}))
'''


@pytest.fixture(scope="module")
def users() -> Iterator[list[PlainUser]]:
    """Two plain users (attacker, victim), made here and removed afterwards."""
    with plain_users(2) as made:
        yield made


def victim_rounds(daemon: Daemon, victim: PlainUser, workspace: Path, seconds: float) -> list[dict[str, Any]]:
    rounds: list[dict[str, Any]] = run_client_as(victim.uid, victim.gid, daemon.socket, VICTIM,
                                                 {"ws": str(workspace), "seconds": seconds}, timeout=BOUND * 5)["rounds"]
    return rounds


def summary(rounds: list[dict[str, Any]]) -> str:
    """The rounds' CreateSession and Exec seconds: median and worst, and the failures."""
    def stats(key: str) -> str:
        values = sorted(entry[key] for entry in rounds if key in entry)
        return f"p50 {values[len(values) // 2]:.3f} s max {values[-1]:.3f} s" if values else "none"
    failed = Counter(f"{entry['error']}: {entry['detail']}" for entry in rounds if "error" in entry)
    return (f"{len(rounds)} rounds; CreateSession {stats('create')}; Exec {stats('exec')}"
            + (f"; {sum(failed.values())} failed: {failed.most_common(3)}" if failed else ""))


def stuck_processes(uid: int) -> list[psutil.Process]:
    """The attacker's ``stat`` processes (each left by a timed-out call)."""
    found = []
    for process in psutil.process_iter(["name", "uids"]):
        if process.info["name"] == "stat" and process.info["uids"] and process.info["uids"].real == uid:
            found.append(process)
    return found


def in_disk_sleep(processes: list[psutil.Process]) -> bool:
    try:
        return all(process.status() == psutil.STATUS_DISK_SLEEP for process in processes)
    except psutil.NoSuchProcess:
        return False


def groups_of(processes: list[psutil.Process]) -> set[Path]:
    """The sandbox cgroup directories (``run-*`` and what is inside) that hold ``processes``, in
    every hierarchy (/proc/PID/cgroup: a path per hierarchy, below its mount)."""
    from sandboxd.kernel.cgroups import hierarchies

    h = hierarchies()
    mounts = {name: point for name, (point, _) in h.v1.items()}
    found = set()
    for process in processes:
        for line in Path(f"/proc/{process.pid}/cgroup").read_text().splitlines():
            _, names, path = line.split(":", 2)
            if "/run-" not in path:
                continue
            if names == "" and h.unified:
                found.add(Path(h.unified) / path.lstrip("/"))
            for name in names.split(","):
                if name in mounts:
                    found.add(Path(mounts[name]) / path.lstrip("/"))
    return found


def wait_for(condition: Any) -> bool:
    return eventually(condition, BOUND)


class Attack:
    """The attacker's stuck mount and its CALLS timed-out calls, each leaving ``stat`` behind in D state."""

    def __init__(self, daemon: Daemon, attacker: PlainUser, base: Path) -> None:
        self.attacker, self.daemon = attacker, daemon
        self.mount = UserFuse("stuck", attacker.uid, attacker.gid, base / "fuse-attacker")
        self.workspace = owned_dir(base / "ws-attacker", attacker)
        self.result: dict[str, Any] = {}
        self._thread = threading.Thread(target=lambda: self.result.update(run_client_as(
            attacker.uid, attacker.gid, daemon.socket, ATTACK,
            {"ws": str(self.workspace), "mount": str(self.mount.mountpoint), "calls": CALLS, "timeout": CALL_TIMEOUT,
             "pids": 64, "memory": 256 << 20}, timeout=BOUND * 5)), daemon=True)

    def start(self) -> None:
        """Start the calls; return once each has reached the mount (its lookup read, never answered)."""
        self._thread.start()
        for _ in range(CALLS):
            if self.mount.swallowed() is None:
                self._thread.join(BOUND)
                raise AssertionError(f"a call never reached the stuck mount: {self.result}\n{self.daemon.log()}")

    def join(self) -> None:
        self._thread.join(BOUND * 5)
        assert not self._thread.is_alive(), "the attacker's calls never ended"

    def leftovers(self) -> list[psutil.Process]:
        return stuck_processes(self.attacker.uid)

    def release(self) -> None:
        self.mount.release()


@pytest.fixture
def attack_scene(users: list[PlainUser], fuse_for_users: None,  # noqa: F811 - the fixture
                 sandboxd_daemon: DaemonFactory) -> Iterator[tuple[DaemonFactory, list[PlainUser]]]:
    yield sandboxd_daemon, users


def test_a_users_d_state_leftovers_stall_nobody_else(attack_scene: tuple[DaemonFactory, list[PlainUser]]) -> None:
    factory, (attacker, victim) = attack_scene
    daemon = factory(config=f"[fork_server]\nping_timeout_seconds = {PING_TIMEOUT}\n")
    victim_ws = owned_dir(factory.base / "ws-victim", victim)
    fork = daemon.fork_server_pid()
    quiet = victim_rounds(daemon, victim, victim_ws, 3.0)
    assert all(entry.get("ok") for entry in quiet), summary(quiet)       # the victim's rounds work at all

    attack = Attack(daemon, attacker, factory.base)
    try:
        attack.start()
        during = victim_rounds(daemon, victim, victim_ws, VICTIM_SECONDS)
        attack.join()
        print(f"\nvictim, quiet: {summary(quiet)}\nvictim, during the attack: {summary(during)}\n"
              f"attacker's calls: {attack.result.get('calls')}")
        # The control: the attack did what it does. Each call timed out, and what it left is stuck
        # in D state, in its groups, after the victim's last round.
        calls = attack.result["calls"]
        assert [call.get("timed_out") for call in calls] == [True] * CALLS, calls
        left = attack.leftovers()
        assert len(left) == CALLS and in_disk_sleep(left), [(p.pid, p.status()) for p in left]
        groups = groups_of(left)
        assert groups and all(group.is_dir() for group in groups), groups

        # Nobody else paid for them: every round of the victim's succeeded, the fork server is the
        # one it was (the watchdog never found its loop held past PING_TIMEOUT).
        assert all(entry.get("ok") for entry in during), summary(during)
        assert daemon.fork_server_pid() == fork, daemon.log()
        assert "did not answer a ping" not in daemon.log()

        # The leftovers go, with their groups, once the attacker's server goes: the loop removed
        # them when their cgroup.events said they were empty (or its timer found them so).
        attack.release()
        assert wait_for(lambda: not attack.leftovers()), attack.leftovers()
        assert wait_for(lambda: not any(group.exists() for group in groups)), \
            [group for group in groups if group.exists()]
        after = victim_rounds(daemon, victim, victim_ws, 1.0)
        assert all(entry.get("ok") for entry in after), summary(after)
    finally:
        attack.release()


def test_a_fork_server_crash_with_leftovers_is_survived(attack_scene: tuple[DaemonFactory, list[PlainUser]]) -> None:
    factory, (attacker, victim) = attack_scene
    daemon = factory()                                     # the default watchdog (10 s), as deployed
    victim_ws = owned_dir(factory.base / "ws-victim", victim)
    attack = Attack(daemon, attacker, factory.base)
    try:
        attack.start()
        attack.join()
        left = attack.leftovers()
        assert len(left) == CALLS and in_disk_sleep(left), [(p.pid, p.status()) for p in left]
        groups = groups_of(left)
        assert groups, "the leftovers are in no sandbox group"
        dead = daemon.fork_server_pid()
        assert dead is not None

        os.kill(dead, signal.SIGKILL)
        killed = time.monotonic()
        served = None
        while served is None and time.monotonic() - killed < BOUND:
            rounds = victim_rounds(daemon, victim, victim_ws, 0.0)
            if rounds[0].get("ok"):
                served = rounds[0]["ended"] - killed
            else:
                time.sleep(0.05)
        print(f"\nthe victim served again {served} s after the fork server was killed; log:\n{daemon.log()[-3000:]}")
        assert served is not None, daemon.log()
        # The daemon lives on with a replacement, which served while the leftovers were still there.
        assert daemon.proc is not None and daemon.proc.poll() is None, daemon.log()
        assert daemon.fork_server_pid() not in (None, dead)
        assert "cannot restart the fork server" not in daemon.log()
        assert any(line.get("msg") == "fork server restarted" for line in daemon.log_lines()), daemon.log()
        assert in_disk_sleep(attack.leftovers()) and all(group.is_dir() for group in groups), groups

        # The replacement's sweep took the dead server's groups: removed once they emptied.
        attack.release()
        assert wait_for(lambda: not attack.leftovers()), attack.leftovers()
        assert wait_for(lambda: not any(group.exists() for group in groups)), \
            [group for group in groups if group.exists()]
    finally:
        attack.release()


# -- the pieces, on the real kernel ---------------------------------------------------------------


class StuckInGroup:
    """``stat`` of a plain user on its own stuck FUSE mount, moved into ``groups`` first: in D state
    once SIGKILLed, until the mount's server goes."""

    def __init__(self, user: PlainUser, base: Path, groups: list[Path]) -> None:
        self.mount = UserFuse("stuck", user.uid, user.gid, base / f"fuse-{uuid.uuid4().hex[:6]}")
        # Joins the groups itself before it looks up (a cgroup.procs write needs root: done from here).
        self.process = subprocess.Popen(["sh", "-c", 'read line; exec stat "$0"', str(self.mount.mountpoint / "x")],
                                        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                        user=user.uid, group=user.gid, extra_groups=[])
        for group in groups:
            (group / "cgroup.procs").write_text(str(self.process.pid))
        assert self.process.stdin is not None
        self.process.stdin.write(b"go\n")
        self.process.stdin.close()
        assert self.mount.swallowed() is not None, "the lookup never reached the stuck mount"

    def stuck(self) -> bool:
        return in_disk_sleep([psutil.Process(self.process.pid)])

    def release(self) -> None:
        self.mount.release()
        self.process.kill()
        self.process.wait(BOUND)


@pytest.fixture
def fuse_user(users: list[PlainUser], fuse_for_users: None) -> PlainUser:  # noqa: F811 - the fixture
    return users[0]


@pytest.mark.parametrize("where", ["v2: cgroup.events", "v1 alone: the timer", "v1 beside an empty v2 group"])
def test_leftovers_signal_once_and_remove_the_group_when_it_empties(where: str, fuse_user: PlainUser,
                                                                   base_dir: Path) -> None:
    """``Leftovers.dispose`` SIGKILLs what is in a group and returns; a process stuck in D state in
    it keeps the group while the loop goes on turning (the fork server's loop serves everyone
    meanwhile); once the process goes, the loop removes the group (v2: on its cgroup.events; v1
    alone: on a timer). Before, the loop emptied and removed it in place (``kill``: 5 s; ``remove``:
    200 x 5 ms a group), and gave up with the group still there. The third case is a confined
    sandbox's group where v2 has no controller: its processes join only the v1 groups that limit
    them (``limiting_dirs``), so ``cgroup.kill`` of the empty v2 group alone would miss them."""
    from sandboxd.kernel import cgroups

    name = cgroups.group_name(f"t-{uuid.uuid4().hex[:6]}")
    hierarchies = {"v2": ["v2"], "v1 alone": ["v1 memory", "v1 pids"]}.get(where.split(":")[0],
                                                                           ["v2", "v1 memory", "v1 pids"])
    with contextlib.ExitStack() as stack:
        made = [stack.enter_context(private_base(hierarchy)) / name for hierarchy in hierarchies]
        for path in made:
            path.mkdir()
        group = cgroups.CgroupSet(name)
        group.dirs = [str(path) for path in made]
        group.unified_dir = str(made[0]) if hierarchies[0] == "v2" else None
        joined = made[1:] if len(made) == 3 else made
        stuck = StuckInGroup(fuse_user, base_dir, joined)
        stack.callback(stuck.release)
        loop = LeftoversLoop()
        loop.leftovers.dispose(group, True, None)
        assert wait_for(stuck.stuck), "SIGKILLed on a read request: D state"   # the control: it cannot die
        for _ in range(20):
            loop.turn(0.05)
        assert len(loop.leftovers) == 1 and all(path.is_dir() for path in joined)   # (an empty one may go)
        stuck.release()
        assert loop.run_until_empty(), "the loop did not remove the group once it emptied"
        assert not any(path.exists() for path in made)


def test_a_descriptor_number_reused_while_a_child_is_reaped_stays_watched() -> None:
    """Reaping a session's init closes its pidfd and hands the session's group to the leftovers,
    which open its cgroup.events: the lowest free number, often the pidfd's own. The loop must take
    the pidfd out of its poller before that (it did after, by number: the group's events were never
    heard again and the group stayed, intermittently, in the attack test). Here the number is reused
    for sure (the control), and the group is still removed when it empties."""
    from sandboxd.kernel import cgroups
    from sandboxd.supervisor.waits import Orphans

    loop = LeftoversLoop()
    orphans = Orphans(loop.poller)
    with private_base("v2") as base:
        path = base / cgroups.group_name(f"t-{uuid.uuid4().hex[:6]}")
        path.mkdir()
        sleeper = subprocess.Popen(["sleep", "300"])
        try:
            (path / "cgroup.procs").write_text(str(sleeper.pid))
            group = cgroups.CgroupSet(path.name)
            group.dirs, group.unified_dir = [str(path)], str(path)
            group.nested = True                           # a call's group in its session's: jobs stay in it
            child_r, child_w = os.pipe()                  # stands in for a pidfd: readable when "gone"
            handed: list[int] = []

            def reap() -> bool:
                if not handed:
                    handed.append(-1)
                    return False                          # Orphans.add tries once at once
                os.close(child_r)
                loop.leftovers.dispose(group, False, None)  # its background jobs live on
                handed.append(child_r)
                return True
            orphans.add(child_r, reap)
            os.write(child_w, b"x")
            for fd, _ in loop.poller.poll(int(BOUND * 1000)):
                orphans.ready(fd)
            os.close(child_w)
            assert handed == [-1, child_r] and child_r in loop.leftovers._by_events, "the number was not reused"
            sleeper.kill()
            sleeper.wait()
            deadline = time.monotonic() + BOUND
            while len(loop.leftovers) and time.monotonic() < deadline:   # no timer: its events alone
                for fd, _ in loop.poller.poll(100):
                    orphans.ready(fd)
                    loop.leftovers.ready(fd)
            assert not len(loop.leftovers) and not path.exists(), "the group's events went unheard"
        finally:
            sleeper.kill()
            sleeper.wait()


def test_a_sweep_never_takes_a_group_made_in_another_pid_namespace(base_dir: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Two daemons sharing a cgroup base, one in a container's PID namespace: a group's pid says
    nothing outside the namespace it was made in. A process in a fresh PID namespace (pid 1 there)
    makes a sandbox group as a fork server would, and lives in it: our sweep leaves it, process and
    all. The control: judged by its pid here, as before, it is dead (no pid 1 of ours started then)."""
    from sandboxd.kernel import cgroups, creators

    ready = base_dir / "made"
    where = "v1 memory" if "memory" in cgroups.hierarchies().v1 else "v2"
    with private_base(where) as base:
        monkeypatch.setattr(cgroups, "_sweep_bases", lambda _h: [str(base)])
        maker = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", PY, "-c", r'''
import os, sys, time
sys.path.insert(0, sys.argv[3])
from sandboxd.kernel import cgroups
group = os.path.join(sys.argv[1], cgroups.group_name("t-1"))
os.mkdir(group)
with open(os.path.join(group, "cgroup.procs"), "w") as f:
    f.write(str(os.getpid()))
with open(sys.argv[2], "w") as f:
    f.write(group)
time.sleep(600)
''', str(base), str(ready), str(REPO)])
        try:
            assert wait_for(lambda: ready.exists() and ready.read_text()), "the namespaced maker made no group"
            group = ready.read_text()
            creator = cgroups._creator_of(os.path.basename(group))
            assert creator is not None and creator[0] == 1, group
            ours = os.stat("/proc/self/ns/pid").st_ino
            assert creator[2] != ours
            assert creators.provably_dead((creator[0], creator[1], ours), ours), "the control: by pid here, dead"
            assert cgroups.stale_groups() == []
            assert (Path(group) / "cgroup.procs").read_text().split(), "its process was killed"
        finally:
            maker.kill()
            maker.wait(BOUND)


def test_a_late_loop_never_blames_a_path_that_answered() -> None:
    """A request's wait past its deadline whose child answered meanwhile (the loop was busy: the
    answer is in its pipe) is answered as ready, not expired with DeadlineExceeded blaming the
    caller's path, as a victim's CreateSession was while the loop emptied another user's groups.
    The control: a wait whose child has not answered is expired."""
    import select

    from sandboxd.supervisor.waits import Waits

    poller = select.poll()
    waits = Waits(poller)
    outcome: list[str] = []
    failures: list[BaseException] = []
    answered_r, answered_w = os.pipe()
    silent_r, silent_w = os.pipe()
    try:
        os.write(answered_w, b"done")
        past = time.monotonic() - 1
        waits.add(answered_r, 1, past, lambda: outcome.append("answered") or True,
                  lambda: outcome.append("answered expired"))
        waits.add(silent_r, 2, past, lambda: outcome.append("silent") or True,
                  lambda: outcome.append("silent expired"))
        waits.expire(time.monotonic(), lambda _id, exc: failures.append(exc))
        assert sorted(outcome) == ["answered", "silent expired"] and not failures and len(waits) == 0
    finally:
        for fd in (answered_r, answered_w, silent_r, silent_w):
            os.close(fd)


def test_the_watchdog_tells_a_starting_fork_server_from_a_hung_one() -> None:
    """A fork server that has answered nothing since it started is starting (a fresh interpreter on
    a loaded machine, what a predecessor left to sweep): a missed ping does not count yet. Once it
    has answered, a missed ping is a hung loop: killed (the control)."""
    from sandboxd.service.watchdog import Watchdog
    from sandboxd.supervisor.fork_client import ForkServer

    server = ForkServer.start()
    hung: list[bool] = []
    try:
        os.kill(server.pid, signal.SIGSTOP)               # before it has answered anything
        watchdog = Watchdog(server, 0.5, lambda: hung.append(True))
        assert watchdog.check() and not hung, "a starting fork server was taken for a hung one"
        assert psutil.Process(server.pid).status() == psutil.STATUS_STOPPED
        os.kill(server.pid, signal.SIGCONT)
        assert server.ping(BOUND) and server.answered
        os.kill(server.pid, signal.SIGSTOP)
        assert not watchdog.check() and hung == [True]
        assert wait_for(lambda: psutil.Process(server.pid).status() == psutil.STATUS_ZOMBIE)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(server.pid, signal.SIGKILL)
        server.close()
