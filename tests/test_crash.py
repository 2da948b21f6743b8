"""Crashes: the daemon or its fork server SIGKILLed while sessions run, and what is left after.

Each test builds the same scene on a real daemon: a session with a memory limit (so it has
cgroups), a session with an isolated network (a veth pair on the host), a session with a
background job, and a call running in the first. Then it kills one process with SIGKILL and
counts from the host what is left: processes (the daemon's descendants and anything carrying
the scene's marker), cgroups and veths named after the dead fork server, mounts, the daemon's
private socket. Zero, after the next start at the latest. Then sessions made before the crash
must still work, and their audit logs have no gap.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import kill_marked, pids_with_marker, wait_until_gone
from daemon_helpers import (Daemon, ExecCall, close_quietly, create_session, descendants, exec_start, kill_procs,
                            make_base_dir, mount_count, remove_tree, rpc_error, run_exec, sandbox_cgroups,
                            sandbox_links, survivors, workspace_write)
from sandboxd.v1 import sandboxd_pb2 as pb

pytestmark = pytest.mark.timeout(300)

HEALTH_SERVICES = ("", "sandboxd.v1.Sandbox")


@pytest.fixture
def base() -> Iterator[Path]:
    path = make_base_dir("sbxcrash-")
    try:
        yield path
    finally:
        remove_tree(path)


@pytest.fixture
def marker() -> str:
    return f"sbxcrash-{uuid.uuid4().hex[:12]}"


class Scene:
    """Sessions of every kind, a background job and a running call, all tagged with ``marker``."""

    def __init__(self, daemon: Daemon, base: Path, marker: str) -> None:
        self.daemon, self.marker = daemon, marker
        stub = daemon.stub
        self.workspaces = []
        for name in ("limited", "networked", "background"):
            path = base / f"ws-{name}"
            path.mkdir()
            os.chmod(path, 0o777)
            self.workspaces.append(path)
        self.limited = create_session(stub, self.workspaces[0], workspace_write(),
                                      limits=pb.Limits(memory_bytes=256 << 20, pids=256))
        self.networked = create_session(stub, self.workspaces[1], workspace_write(network_access=True))
        self.background = create_session(stub, self.workspaces[2], workspace_write())
        self.sessions = [self.limited, self.networked, self.background]
        stub.StartBackground(pb.StartBackgroundRequest(session_id=self.background.id,
                                                       argv=["sh", "-c", f"sleep 300; : {marker}-job"]), timeout=60)
        self.call = ExecCall(stub, exec_start(self.limited.id, ["sh", "-c", f"echo up; sleep 300; : {marker}-call"]))
        self.call.wait_stdout(b"up")
        self.fork_pid = daemon.fork_server_pid()
        assert self.fork_pid is not None
        self.processes = descendants(daemon.pid)
        assert len(pids_with_marker(marker)) >= 2, "the job and the call should carry the marker"
        assert self.cgroups(), "the memory-limited session should have cgroups named after the fork server"
        assert self.veths(), "the isolated network should have a veth named after the fork server"

    def cgroups(self) -> set[str]:
        """Cgroups of sandboxes made by this scene's fork server (others' tests run beside us)."""
        return {path for path in sandbox_cgroups() if os.path.basename(path).startswith(f"run-{self.fork_pid}-")}

    def veths(self) -> set[str]:
        """Isolated networks' links made by this scene's fork server (others' come and go beside us)."""
        return sandbox_links(self.fork_pid)

    def close(self) -> None:
        self.call.close()
        for session in self.sessions:
            close_quietly(self.daemon.stub, session.id)
        kill_procs(self.processes)
        kill_marked(self.marker)


def health(daemon: Daemon, service: str = "") -> int:
    channel = grpc.insecure_channel("unix:" + daemon.socket)
    try:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                         timeout=10).status
    except grpc.RpcError:
        return -1
    finally:
        channel.close()


class HealthWatch:
    """Every status the daemon's health Watch stream sends for ``service``, in order."""

    def __init__(self, daemon: Daemon, service: str) -> None:
        self.seen: list[int] = []
        self._channel = grpc.insecure_channel("unix:" + daemon.socket)
        self._stream = health_pb2_grpc.HealthStub(self._channel).Watch(
            health_pb2.HealthCheckRequest(service=service), timeout=240)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for reply in self._stream:
                self.seen.append(reply.status)
        except grpc.RpcError:
            pass

    def wait_for(self, statuses: list[int], within: float = 60.0) -> bool:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            if self.seen[-len(statuses):] == statuses or _contains(self.seen, statuses):
                return True
            time.sleep(0.02)
        return False

    def close(self) -> None:
        self._stream.cancel()
        self._channel.close()
        self._thread.join(10)


def _contains(seen: list[int], wanted: list[int]) -> bool:
    """``wanted`` appears in ``seen`` in order (not necessarily adjacent)."""
    position = 0
    for status in seen:
        if position < len(wanted) and status == wanted[position]:
            position += 1
    return position == len(wanted)


def sequences(daemon: Daemon, session_id: str) -> list[int]:
    events, token = [], ""
    while True:
        reply = daemon.stub.QueryEvents(pb.QueryEventsRequest(session_id=session_id, page_size=1000,
                                                              page_token=token), timeout=60)
        events.extend(reply.events)
        token = reply.next_page_token
        if not token:
            return [event.sequence for event in events]


def assert_resumes(daemon: Daemon, scene: Scene) -> None:
    """Every session made before the crash runs a command again, the isolated one still on its
    own network, and each audit log counts 1, 2, 3 ... without a gap."""
    for session in scene.sessions:
        outcome = run_exec(daemon.stub, session.id, ["sh", "-c", "echo resumed; cat /proc/self/cgroup >/dev/null"])
        assert outcome.result is not None and outcome.result.exit_code == 0, outcome.describe()
        assert outcome.stdout == b"resumed\n"
    links = run_exec(daemon.stub, scene.networked.id, ["cat", "/proc/net/dev"])
    assert b"eth0" in links.stdout, links.describe()                         # rebuilt with its isolated link
    for session in scene.sessions:
        found = sequences(daemon, session.id)
        assert found == list(range(1, len(found) + 1)) and len(found) >= 2, (session.id, found)


def test_fork_server_sigkill_is_noticed_and_restarted_in_place(base: Path, marker: str) -> None:
    daemon = Daemon(base).start()
    scene = None
    watches: list[HealthWatch] = []
    try:
        mounts_before = mount_count()
        daemon.stub.ListSessions(pb.ListSessionsRequest(), timeout=60)   # its connection counts in the baseline
        fds_before = daemon_fds(daemon)
        scene = Scene(daemon, base, marker)
        watches = [HealthWatch(daemon, service) for service in HEALTH_SERVICES]
        assert all(w.wait_for([health_pb2.HealthCheckResponse.SERVING]) for w in watches)

        os.kill(scene.fork_pid, signal.SIGKILL)

        # Health: NOT_SERVING the moment it died, then SERVING again once it was restarted.
        for w in watches:
            assert w.wait_for([health_pb2.HealthCheckResponse.NOT_SERVING, health_pb2.HealthCheckResponse.SERVING]), \
                (w.seen, daemon.log())
        # The call that ran fails with a status naming the cause (never hangs, never INTERNAL).
        assert scene.call.wait_done(60), "the running call hung after its fork server died"
        assert scene.call.error is not None, scene.call.outcome.describe()
        assert scene.call.error.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAVAILABLE)
        assert "fork server" in (scene.call.error.details() or "")
        # The daemon itself lives on, with a new fork server.
        assert daemon.proc is not None and daemon.proc.poll() is None
        new_fork = daemon.fork_server_pid()
        assert new_fork is not None and new_fork != scene.fork_pid
        assert health(daemon) == health_pb2.HealthCheckResponse.SERVING
        assert any(line.get("msg") == "fork server died" or str(line.get("msg", "")).startswith("fork server died")
                   for line in daemon.log_lines()), daemon.log()

        # Nothing of the old fork server's sandboxes is left: processes, cgroups, veths, mounts.
        old = {pid: info for pid, info in scene.processes.items() if pid != new_fork}
        assert survivors(old) == {}, survivors(old, 0)
        assert wait_until_gone(marker, 10) == []
        assert scene.cgroups() == set()
        assert scene.veths() == set()
        assert mount_count() == mounts_before

        assert_resumes(daemon, scene)
        # Sockets and other descriptors: the dead server's socket pair end, the sandboxes' pipes
        # and services are all closed once the sessions are.
        for w in watches:
            w.close()
        watches = []
        scene.close()
        assert wait_for_fds(daemon, fds_before) == fds_before
    finally:
        for w in watches:
            w.close()
        if scene is not None:
            scene.close()
        daemon.close()


def daemon_fds(daemon: Daemon) -> dict[str, int]:
    """The daemon's descriptors by kind (socket, pipe, anon_inode:[pidfd] ...)."""
    kinds: dict[str, int] = {}
    for fd in os.listdir(f"/proc/{daemon.pid}/fd"):
        try:
            target = os.readlink(f"/proc/{daemon.pid}/fd/{fd}")
        except OSError:
            continue
        kind = target.split(":", 1)[0] if ":" in target and not target.startswith("/") else "file"
        kind = target if kind == "anon_inode" else kind
        kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


def wait_for_fds(daemon: Daemon, wanted: dict[str, int], within: float = 15.0) -> dict[str, int]:
    """The daemon's descriptors once they are back to ``wanted`` (connections wind down in the
    background), or as they are after ``within`` seconds."""
    deadline = time.monotonic() + within
    while True:
        now = daemon_fds(daemon)
        if now == wanted or time.monotonic() > deadline:
            return now
        time.sleep(0.1)


def test_daemon_sigkill_leaves_nothing_after_the_next_start(base: Path, marker: str) -> None:
    daemon = Daemon(base).start()
    scene = None
    restarted: Daemon | None = None
    try:
        mounts_before = mount_count()
        scene = Scene(daemon, base, marker)
        dead_pid = daemon.pid
        private_socket = daemon.private / f"grpc-{dead_pid}.sock"
        assert private_socket.exists()
        relays = daemon.private / "relay"
        dead_relays = {(entry.name, entry.stat().st_ino) for entry in relays.iterdir()}
        assert dead_relays, "the test's own connection should have a relay file"

        daemon.kill()                                          # SIGKILL

        # Whatever outlives the daemon dies with it: the fork server (parent-death signal),
        # every session and call and background job inside.
        assert survivors(scene.processes) == {}, survivors(scene.processes, 0)
        assert wait_until_gone(marker, 10) == []
        assert mount_count() == mounts_before

        restarted = Daemon(base).start()
        # The next start sweeps the rest: cgroups, veths, the dead daemon's private socket.
        assert scene.cgroups() == set(), scene.cgroups()
        assert scene.veths() == set()
        assert not private_socket.exists()
        assert not dead_relays & {(entry.name, entry.stat().st_ino) for entry in relays.iterdir()}
        assert (restarted.private / f"grpc-{restarted.pid}.sock").exists()
        serving = [line for line in restarted.log_lines() if line.get("msg") == "serving"]
        assert serving and serving[-1]["sessions_resumed"] == 3 and serving[-1]["stale_sockets_removed"] == 1

        scene.daemon = restarted
        assert_resumes(restarted, scene)
        assert mount_count() == mounts_before
    finally:
        if scene is not None:
            if restarted is not None:
                scene.daemon = restarted
            scene.close()
        daemon.close()
        if restarted is not None:
            restarted.close()


def test_huge_time_limits_are_refused_and_the_fork_server_lives(base: Path) -> None:
    daemon = Daemon(base).start()
    try:
        fork = daemon.fork_server_pid()
        workspace = base / "ws"
        workspace.mkdir()
        session = create_session(daemon.stub, workspace, workspace_write())
        for value in (1e12, float("inf"), float("nan"), -1.0):
            error = rpc_error(lambda: run_exec(daemon.stub, session.id, ["true"], timeout_seconds=value))
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (value, error)
            assert "timeout_seconds" in (error.details() or "")
        for value in (1e12, float("inf")):        # (NaN and negatives read as 0 there: no limit)
            error = rpc_error(lambda: create_session(daemon.stub, workspace, workspace_write(),
                                                     limits=pb.Limits(timeout_seconds=value)))
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (value, error)
            assert "timeout_seconds" in (error.details() or "")
        # The control: the maximum (a week) is allowed, and runs.
        week = create_session(daemon.stub, workspace, workspace_write(),
                              limits=pb.Limits(timeout_seconds=7 * 24 * 3600))
        outcome = run_exec(daemon.stub, week.id, ["echo", "ok"], timeout_seconds=7 * 24 * 3600)
        assert outcome.result is not None and outcome.stdout == b"ok\n", outcome.describe()
        assert daemon.fork_server_pid() == fork
        outcome = run_exec(daemon.stub, session.id, ["echo", "still"])
        assert outcome.stdout == b"still\n", outcome.describe()
    finally:
        daemon.close()


def _limits(pid: int) -> tuple[int, int]:
    with open(f"/proc/{pid}/limits") as f:
        for line in f:
            if line.startswith("Max open files"):
                soft, hard = line.split()[3:5]
                return int(soft), int(hard)
    raise AssertionError("no open-files line")


def test_a_thousand_sessions_push_fds_past_1024_and_exec_still_works(base: Path) -> None:
    """Started with systemd's default soft limit (1024): the daemon raises it, the fork server's
    descriptors go past 1024, and Exec (poll, not select) still works in both."""
    count = 1100
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 4 * count:
        pytest.skip(f"the hard RLIMIT_NOFILE ({hard}) is below what {count} sessions need")
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))
    try:
        daemon = Daemon(base, env={"SANDBOXD_QUOTAS_ROOT_SESSIONS": str(count)}).start()   # root's own quota
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    stub = daemon.stub
    ids: list[str] = []
    try:
        fork = daemon.fork_server_pid()
        assert fork is not None
        assert _limits(daemon.pid) == (hard, hard) and _limits(fork) == (hard, hard)
        workspace = base / "ws"
        workspace.mkdir()
        started = time.monotonic()
        for _ in range(count):
            ids.append(create_session(stub, workspace).id)
        created = time.monotonic() - started
        fds = [int(fd) for fd in os.listdir(f"/proc/{fork}/fd")]
        assert max(fds) > 1024, max(fds)
        outcome = run_exec(stub, ids[-1], ["echo", "far"])
        assert outcome.stdout == b"far\n", outcome.describe()
        outcome = run_exec(stub, ids[0], ["echo", "near"])
        assert outcome.stdout == b"near\n", outcome.describe()
        assert daemon.fork_server_pid() == fork
        started = time.monotonic()
        for session_id in ids:
            stub.CloseSession(pb.CloseSessionRequest(session_id=session_id), timeout=60)
        closed = time.monotonic() - started
        ids.clear()
        print(f"{count} sessions: created in {created:.1f} s, closed in {closed:.1f} s")
        assert len(os.listdir(f"/proc/{fork}/fd")) < 64
    finally:
        for session_id in ids:
            close_quietly(stub, session_id)
        daemon.close()


@pytest.fixture
def sweep_base(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Where the sweep looks, for this test only: a private group in the hierarchy the test names
    (cgroup_helpers.private_base), so no other sandboxd on the machine sweeps what the test plants."""
    from cgroup_helpers import private_base
    from sandboxd.kernel import cgroups

    where = getattr(request, "param", None) or ("v1 memory" if "memory" in cgroups.hierarchies().v1 else "v2")
    with private_base(where) as base:
        monkeypatch.setattr(cgroups, "_sweep_bases", lambda _h: [str(base)])
        yield str(base)


def _named_for(pid: int, start: int, namespace: int, suffix: str) -> str:
    """A sandbox group's name as a creator ``pid`` (started at ``start``, in PID namespace
    ``namespace``) writes it (cgroups.group_name)."""
    return f"run-{pid}-{start}-{namespace}-1-{suffix}"


@pytest.mark.parametrize("level", ["base", "owner"])
@pytest.mark.parametrize("sweep_base", ["v1 memory", "v2"], indirect=True)
def test_sweep_kills_and_removes_groups_of_dead_owners_only(sweep_base: str, level: str) -> None:
    """A group named after a dead creator is emptied (its process killed) and removed by the fork
    server's leftovers; one named after a live creator is left alone, process and all (the control),
    and so are one named after the same dead pid in another PID namespace (whose pids say nothing
    here: another daemon's, in a container sharing the cgroup base) and one an older sandboxd named
    by pid alone. Also in an owner's group (``<base>/owner-<key>/``), which the sweep removes once it
    is empty, not before."""
    from cgroup_helpers import LeftoversLoop
    from sandboxd.kernel import cgroups

    base = sweep_base
    suffix = uuid.uuid4().hex[:8]
    owner = os.path.join(base, f"{cgroups.OWNER_PREFIX}uid-{suffix}")
    parent = owner if level == "owner" else base
    os.makedirs(parent, exist_ok=True)
    namespace = os.stat("/proc/self/ns/pid").st_ino
    dead = dead_pid()
    stale = os.path.join(parent, _named_for(dead, 1, namespace, suffix))
    live = os.path.join(parent, cgroups.group_name(f"1-{suffix}"))
    elsewhere = os.path.join(parent, _named_for(dead, 1, namespace + 1, suffix))
    older = os.path.join(parent, f"run-{dead}-1-{suffix}")
    sleepers = []
    try:
        for path in (stale, live, elsewhere, older):
            os.mkdir(path)
            sleeper = subprocess.Popen(["sleep", "300"])
            sleepers.append(sleeper)
            with open(os.path.join(path, "cgroup.procs"), "w") as f:
                f.write(str(sleeper.pid))
        found = cgroups.stale_groups()
        assert stale in [path for group in found for path in group.dirs]
        assert not {live, elsewhere, older} & {path for group in found for path in group.dirs}
        loop = LeftoversLoop()
        for group in found:
            if stale in group.dirs:
                loop.leftovers.dispose(group, True, None)
        assert loop.run_until_empty()
        assert sleepers[0].wait(10) == -signal.SIGKILL
        assert not os.path.exists(stale)
        for sleeper, path in zip(sleepers[1:], (live, elsewhere, older), strict=True):
            assert sleeper.poll() is None and os.path.isdir(path), path
        if level == "owner":
            assert os.path.isdir(owner)                       # still holds the other groups
            for sleeper in sleepers[1:]:
                sleeper.kill()
                sleeper.wait()
            for path in (elsewhere, older):
                os.rmdir(path)
            live_group = cgroups.CgroupSet(os.path.basename(live))
            live_group.dirs = [live]
            assert live_group.try_remove()                    # the creator's own removal takes the empty owner group
            assert not os.path.exists(live) and not os.path.exists(owner)
            os.makedirs(owner)
            cgroups.stale_groups()                            # and the sweep one a killed daemon left empty
            assert not os.path.exists(owner)
    finally:
        for sleeper in sleepers:
            sleeper.kill()
            sleeper.wait()
        for path in (stale, live, elsewhere, older, owner):
            for _ in range(100):
                try:
                    os.rmdir(path)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.02)


def test_a_fork_server_that_keeps_dying_ends_the_daemon_non_zero(base: Path) -> None:
    """Restarting in place is for a one-off death: past MAX_FORK_RESTARTS deaths in a minute the
    daemon exits with status 1 (systemd's Restart=on-failure takes over), never SERVING while
    every call fails. Until then, each death is followed by a working fork server."""
    from sandboxd.service.server import MAX_FORK_RESTARTS

    daemon = Daemon(base).start()
    try:
        workspace = base / "ws"
        workspace.mkdir()
        session = create_session(daemon.stub, workspace, workspace_write())
        for death in range(MAX_FORK_RESTARTS + 1):
            fork = daemon.fork_server_pid()
            assert fork is not None, daemon.log()
            held = descendants(daemon.pid)
            os.kill(fork, signal.SIGKILL)
            if death == MAX_FORK_RESTARTS:
                break
            deadline = time.monotonic() + 60
            while daemon.fork_server_pid() in (None, fork) or health(daemon) != health_pb2.HealthCheckResponse.SERVING:
                assert time.monotonic() < deadline, daemon.log()
                time.sleep(0.05)
            outcome = run_exec(daemon.stub, session.id, ["echo", str(death)])
            assert outcome.stdout == f"{death}\n".encode(), outcome.describe()
        assert daemon.proc is not None and daemon.proc.wait(60) == 1, daemon.log()
        assert "cannot restart the fork server" in daemon.log()
        assert survivors(held) == {}
        assert not (daemon.private / f"grpc-{daemon.pid}.sock").exists()
    finally:
        daemon.close()


def dead_pid() -> int:
    gone = subprocess.Popen(["true"])
    gone.wait()
    return gone.pid                                      # a pid that no longer runs


@contextlib.contextmanager
def self_test_workspaces(held_by: int) -> Iterator[dict[str, Path]]:
    """Self-test workspaces as daemons leave them in /var/tmp, removed afterwards if still there:
    "dead": a SIGKILLed daemon's (made long ago, nobody holds it), although its name has a live pid
    (this test's: pids are reused); "held": a live daemon's, locked (flock, by this test), named
    after ``held_by``; "fresh": one made an instant ago and not locked yet."""
    import fcntl

    from sandboxd.service.server import SELF_TEST_DIR, SELF_TEST_LOCK_GRACE, SELF_TEST_PREFIX

    tag = uuid.uuid4().hex[:6]
    paths = {"dead": Path(SELF_TEST_DIR, f"{SELF_TEST_PREFIX}{os.getpid()}-{tag}d"),
             "held": Path(SELF_TEST_DIR, f"{SELF_TEST_PREFIX}{held_by}-{tag}h"),
             "fresh": Path(SELF_TEST_DIR, f"{SELF_TEST_PREFIX}{dead_pid()}-{tag}f")}
    for path in paths.values():
        path.mkdir(mode=0o700)
    long_ago = time.time() - 2 * SELF_TEST_LOCK_GRACE
    for name in ("dead", "held"):
        os.utime(paths[name], (long_ago, long_ago))
    lock = os.open(paths["held"], os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield paths
    finally:
        os.close(lock)
        for path in paths.values():
            if path.exists():
                path.rmdir()


def test_a_self_test_workspace_of_a_killed_daemon_is_removed_at_the_next_start(base: Path) -> None:
    """A daemon SIGKILLed during its start-up self-test leaves its empty workspace in /var/tmp (the
    ``finally`` never runs): the next start removes those nobody holds, and only those, whatever
    pid their names have."""
    with self_test_workspaces(held_by=dead_pid()) as paths:
        daemon = Daemon(base).start()
        daemon.close()
        assert not paths["dead"].exists()
        assert paths["held"].exists() and paths["fresh"].exists()


SWEEP_IN_ANOTHER_PID_NAMESPACE = """
import json, os, sys
from sandboxd.service.server import _sweep_self_test_workspaces
paths, held_by = json.loads(sys.argv[1]), int(sys.argv[2])
seen = os.path.exists(f"/proc/{held_by}")
_sweep_self_test_workspaces()
print(json.dumps({"pid": os.getpid(), "holder_seen": seen, "kept": {k: os.path.isdir(v) for k, v in paths.items()}}))
"""


def test_a_daemon_in_another_pid_namespace_keeps_a_live_daemons_self_test_workspace() -> None:
    """A daemon in a container (a PID namespace of its own, /var/tmp shared) sweeps the self-test
    workspaces: a live daemon's (this test's, here) is locked, so it stays, although its pid is not
    there (the old judgement, by /proc/PID, removed it mid-test); a dead daemon's goes (the control)."""
    import json

    with self_test_workspaces(held_by=os.getpid()) as paths:
        done = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c",
                               SWEEP_IN_ANOTHER_PID_NAMESPACE, json.dumps({k: str(v) for k, v in paths.items()}),
                               str(os.getpid())], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        seen = json.loads(done.stdout)
        assert seen["pid"] == 1 and seen["holder_seen"] is False           # another PID namespace
        assert seen["kept"] == {"dead": False, "held": True, "fresh": True}, seen
        assert paths["held"].exists()


def test_a_zombie_or_a_reused_pid_is_a_dead_creator(sweep_base: str) -> None:
    """A SIGKILLed daemon's fork server is a zombie for a while (its new parent reaps it later): the
    groups named after it are stale, not alive (before, the next daemon's start-up sweep skipped
    them, and nothing swept again). So are a creator's whose pid now names a process started at
    another time. A live creator's group stays (the control)."""
    from sandboxd.kernel import cgroups, creators

    base = sweep_base
    zombie = subprocess.Popen(["true"])
    deadline = time.monotonic() + 10
    while not open(f"/proc/{zombie.pid}/stat").read().rpartition(")")[2].split()[0] == "Z":
        assert time.monotonic() < deadline, "the child did not exit"
        time.sleep(0.01)
    suffix = uuid.uuid4().hex[:8]
    namespace = os.stat("/proc/self/ns/pid").st_ino
    me = os.getpid()
    started = creators.start_time(me)
    assert started is not None and creators.start_time(zombie.pid) is None
    os.makedirs(base, exist_ok=True)
    stale = os.path.join(base, _named_for(zombie.pid, 1, namespace, suffix))
    reused = os.path.join(base, _named_for(me, started + 1, namespace, suffix))
    live = os.path.join(base, _named_for(me, started, namespace, suffix))
    try:
        for path in (stale, reused, live):
            os.mkdir(path)
        found = {path for group in cgroups.stale_groups() for path in group.dirs}
        assert {stale, reused} <= found and live not in found
    finally:
        zombie.wait()
        for path in (stale, reused, live):
            with contextlib.suppress(FileNotFoundError):
                os.rmdir(path)
