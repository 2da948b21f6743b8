"""A file system that never answers stalls only the caller who named it (issue 16, part 2).

A plain user (the attacker) mounts a FUSE file system whose server never reads its device, so
every lookup under it waits forever: (a) with fusermount3, in the host's mount namespace, and (b)
in its own user and mount namespace (``unshare -Urm``), named from outside through
``/proc/PID/root/...``. It names a path under each mount in every field that takes one
(workspace, writable_roots, allowed_unix_sockets, AddStandingRule's workspace; a command's cwd
and the file tools through a symlink from its workspace), all at once. Meanwhile another plain
user (the victim) creates sessions and runs commands: each must finish in under a second. The
attacker gets DEADLINE_EXCEEDED naming the path after ``fork_server.wait_seconds``; once the
mounts are released nothing of it is left (processes, the fork server's descriptors).

The watchdog: a frozen fork server (SIGSTOP) turns health NOT_SERVING, is killed and replaced,
and the next CreateSession and Exec are served by the new one.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import PY, SLOW
from daemon_helpers import (Daemon, DaemonFactory, ExecCall, PlainUser, create_session, exec_start, plain_users,
                            run_client_as, run_exec, workspace_write)
from user_fuse import fuse_for_users  # noqa: F401 - a fixture

WAIT_SECONDS = 4.0                  # the daemon's fork_server.wait_seconds here
VICTIM_BOUND = 1.0 * SLOW           # the bound on the victim's CreateSession and Exec

# Run as the attacker: mount a FUSE file system and never read its device. argv: kind, mount point.
HOLDER = r'''
import array, ctypes, json, os, socket, subprocess, sys
kind, mountpoint = sys.argv[1], sys.argv[2]
if kind == "fusermount3":                 # what libfuse does: fusermount3 mounts, hands back the device
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    subprocess.run(["fusermount3", "-o", "fsname=hung,subtype=hung", "--", mountpoint], check=True,
                   env={"_FUSE_COMMFD": str(theirs.fileno()), "PATH": "/usr/bin:/bin"}, pass_fds=(theirs.fileno(),))
    fds = array.array("i")
    _, ancillary, _, _ = ours.recvmsg(1, socket.CMSG_SPACE(fds.itemsize))
    fds.frombytes(ancillary[0][2][:fds.itemsize])
    device, path = fds[0], mountpoint
else:                                     # in its own user and mount namespace: mount(2) itself
    device = os.open("/dev/fuse", os.O_RDWR)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(b"hung", mountpoint.encode(), b"fuse", 0,
                  f"fd={device},rootmode=40000,user_id=0,group_id=0".encode()) != 0:
        raise OSError(ctypes.get_errno(), "mount fuse")
    path = f"/proc/{os.getpid()}/root{mountpoint}"
print(json.dumps({"path": path}), flush=True)
sys.stdin.read()                          # holds the device, unread, until released
'''


@pytest.fixture(scope="module")
def users() -> Iterator[list[PlainUser]]:
    """Two plain users (attacker, victim), made here and removed afterwards."""
    with plain_users(2) as made:
        yield made


@pytest.fixture(scope="module")
def daemon(users: list[PlainUser], sandboxd_daemon_module: DaemonFactory) -> Daemon:
    """Stopped before the users are removed (it may hold their sessions)."""
    return sandboxd_daemon_module(config=f"[fork_server]\nwait_seconds = {WAIT_SECONDS}\n")


def owned_dir(base: Path, owner: PlainUser, name: str = "") -> Path:
    path = base / (name or f"d-{uuid.uuid4().hex[:8]}")
    path.mkdir(mode=0o755)
    os.chown(path, owner.uid, owner.gid)
    return path


class HungMount:
    """A FUSE mount of ``owner`` that never answers, held by a process of the owner until ``release``."""

    def __init__(self, kind: str, owner: PlainUser, base: Path) -> None:
        self.kind, self.owner = kind, owner
        mountpoint = owned_dir(base, owner, f"fuse-{kind}")
        argv = [PY, "-c", HOLDER, kind, str(mountpoint)]
        self.holder = subprocess.Popen(["unshare", "-Urm", *argv] if kind == "userns" else argv, user=owner.uid,
                                       group=owner.gid, extra_groups=[], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, cwd="/")
        assert self.holder.stdout is not None
        line = self.holder.stdout.readline()
        assert line, f"the {kind} FUSE mount failed (exit {self.holder.wait()})"
        self.path = json.loads(line)["path"]
        self.mountpoint = mountpoint

    def release(self) -> None:
        """The holder exits: its device closes, the kernel aborts the connection, and every lookup
        waiting on it fails; a fusermount3 mount is then unmounted (a namespace's goes with it)."""
        assert self.holder.stdin is not None
        self.holder.stdin.close()
        self.holder.wait(30)
        if self.kind == "fusermount3":
            subprocess.run(["fusermount3", "-u", "-z", str(self.mountpoint)], check=True, timeout=30)


@pytest.fixture(scope="module")
def hung(users: list[PlainUser], fuse_for_users: None,  # noqa: F811 - the fixture
         daemon: Daemon) -> Iterator[dict[str, HungMount]]:
    mounts: dict[str, HungMount] = {}
    try:
        for kind in ("fusermount3", "userns"):
            mounts[kind] = HungMount(kind, users[0], daemon.base)
        yield mounts
    finally:
        for mount in mounts.values():
            if mount.holder.poll() is None:
                mount.release()


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def processes_of(uid: int) -> list[int]:
    found = []
    for name in sorted(os.listdir("/proc"), key=lambda n: int(n) if n.isdigit() else 0):
        if name.isdigit():
            try:
                if os.stat(f"/proc/{name}").st_uid == uid:
                    found.append(int(name))
            except FileNotFoundError:
                pass
    return found


# Every field that names a path, for each hung mount, all at once; then a flag file for the victim.
ATTACK = r'''
import threading, time                    # loaded already (by grpc): the stdlib is root's, out of reach now
results = {}
def attempt(name, fn):
    started = time.monotonic()
    try:
        fn()
        results[name] = {"code": "OK"}
    except grpc.RpcError as error:
        results[name] = {"code": error.code().name, "detail": error.details()}
    results[name].update(started=started, ended=time.monotonic())
def policy(**kw):
    return pb.SandboxPolicy(mode=pb.SandboxPolicy.WORKSPACE_WRITE, **kw)
def create(ws, **kw):
    return stub.CreateSession(pb.CreateSessionRequest(workspace=ws, sandbox_policy=policy(**kw),
                                                      approval_policy=pb.NEVER), timeout=120)
calls, sessions = [], []
for kind, hung in ARGS["hung"].items():
    own = ARGS["own"][kind]
    os.symlink(hung, own + "/link")
    session = create(own)
    sessions.append(session.id)
    calls += [
        (kind + ":workspace", lambda hung=hung: create(hung + "/ws")),
        (kind + ":writable_roots", lambda hung=hung, own=own: create(own, writable_roots=[hung + "/root"])),
        (kind + ":allowed_unix_sockets", lambda hung=hung, own=own: create(own, allowed_unix_sockets=[hung + "/s"])),
        (kind + ":standing_rule", lambda hung=hung: stub.AddStandingRule(pb.StandingRule(workspace=hung + "/ws",
                                                                                          tool="fs.list"), timeout=120)),
        (kind + ":exec_cwd", lambda s=session, own=own: run_in(s.id, ["/bin/true"], own + "/link")),
        (kind + ":exec_program", lambda s=session, own=own: run_in(s.id, [own + "/link/program"], own)),
        (kind + ":list_dir", lambda s=session: stub.ListDir(pb.ListDirRequest(session_id=s.id, path="link/d"),
                                                            timeout=ARGS["tool_deadline"])),
        (kind + ":read_file", lambda s=session: stub.ReadFile(pb.ReadFileRequest(session_id=s.id, path="link/f"),
                                                              timeout=ARGS["tool_deadline"])),
        (kind + ":search", lambda s=session: stub.Search(pb.SearchRequest(session_id=s.id, pattern="x", path="link"),
                                                         timeout=ARGS["tool_deadline"])),
    ]
def run_in(session_id, argv, cwd):
    start = pb.ExecStart(session_id=session_id, argv=argv, cwd=cwd)
    for r in stub.Exec(iter([pb.ExecRequest(start=start)]), timeout=120):
        pass
threads = [threading.Thread(target=attempt, args=call) for call in calls]
for t in threads:
    t.start()
time.sleep(0.5)                           # every request is in the daemon by now
with open(ARGS["flag"], "w") as f:
    f.write(str(time.monotonic()))
for t in threads:
    t.join()
for session_id in sessions:                 # its file tools still hang: closing the session ends them
    stub.CloseSession(pb.CloseSessionRequest(session_id=session_id), timeout=120)
print(json.dumps(results))
'''

# The victim's sessions and commands while the attack hangs: each step's seconds.
VICTIM = r'''
import time
while not os.path.exists(ARGS["flag"]):
    time.sleep(0.02)
times = {"create": [], "exec": [], "window": [time.monotonic()]}
while time.monotonic() - times["window"][0] < ARGS["seconds"]:
    started = time.monotonic()
    s = stub.CreateSession(pb.CreateSessionRequest(workspace=ARGS["ws"], approval_policy=pb.NEVER,
        sandbox_policy=pb.SandboxPolicy(mode=pb.SandboxPolicy.WORKSPACE_WRITE)), timeout=120)
    created = time.monotonic()
    out, code = run(s.id, ["/bin/echo", "victim"])
    times["create"].append(created - started)
    times["exec"].append(time.monotonic() - created)
    assert (out, code) == ("victim\n", 0), (out, code)
    stub.CloseSession(pb.CloseSessionRequest(session_id=s.id), timeout=120)
times["window"].append(time.monotonic())
print(json.dumps(times))
'''


# Where a request gets something else than DEADLINE_EXCEEDED naming the path, and why.
PATH_FIELDS = ("workspace", "writable_roots", "allowed_unix_sockets", "standing_rule")
EXPECTED: dict[str, dict[str, str]] = {
    "fusermount3": {
        # The command's cwd is entered before the sandbox drops to the caller's uid: FUSE refuses
        # every uid but the mounter's (no allow_other), at once.
        "exec_cwd": "FAILED_PRECONDITION",
    },
    "userns": {
        # Writable roots under /proc are refused by the policy. (A workspace there is opened as the
        # caller, as every path is, and waits on the mount like the others: the daemon no longer
        # took its real path as root first, which read /proc/PID/root as "/" and named the host's X.)
        "writable_roots": "INVALID_ARGUMENT",
        # Inside the sandbox /proc is its own: the symlink's /proc/PID does not exist.
        "exec_cwd": "FAILED_PRECONDITION", "exec_program": "FAILED_PRECONDITION",
        "list_dir": "NOT_FOUND", "read_file": "NOT_FOUND", "search": "INVALID_ARGUMENT",
    },
}


def holders(hung: dict[str, HungMount]) -> list[int]:
    """The mounts' holder processes (unshare execs the holder: one process each)."""
    return sorted(m.holder.pid for m in hung.values())


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def test_a_hung_file_system_stalls_only_its_caller(daemon: Daemon, users: list[PlainUser],
                                                   hung: dict[str, HungMount]) -> None:
    attacker, victim = users
    fork_pid = daemon.fork_server_pid()
    assert fork_pid is not None
    fds_before = fd_count(fork_pid)
    own = {kind: str(owned_dir(daemon.base, attacker)) for kind in hung}
    flag = owned_dir(daemon.base, attacker) / "attacking"
    victim_ws = owned_dir(daemon.base, victim)
    # Control: the same requests on the attacker's own directories and socket work.
    control_ws = owned_dir(daemon.base, attacker)
    (control_ws / "marker").write_text("here\n")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(control_ws / "own.sock"))
    os.chown(control_ws / "own.sock", attacker.uid, attacker.gid)
    try:
        control = run_client_as(attacker.uid, attacker.gid, daemon.socket, r'''
p = pb.SandboxPolicy(mode=pb.SandboxPolicy.WORKSPACE_WRITE, writable_roots=[ARGS["root"]],
                     allowed_unix_sockets=[ARGS["ws"] + "/own.sock"])
s = stub.CreateSession(pb.CreateSessionRequest(workspace=ARGS["ws"], sandbox_policy=p, approval_policy=pb.NEVER))
rule = stub.AddStandingRule(pb.StandingRule(workspace=ARGS["ws"], tool="fs.list"))
listed = stub.ListDir(pb.ListDirRequest(session_id=s.id, path="."))
read = stub.ReadFile(pb.ReadFileRequest(session_id=s.id, path="marker"))
out, code = run(s.id, ["/bin/pwd"])
stub.CloseSession(pb.CloseSessionRequest(session_id=s.id))
print(json.dumps({"rule": rule.workspace, "listed": sorted(e.name for e in listed.entries),
                  "read": read.data.decode(), "pwd": out.strip()}))
''', {"ws": str(control_ws), "root": str(owned_dir(daemon.base, attacker))})
    finally:
        listener.close()
    assert control["rule"] == str(control_ws) and control["pwd"] == str(control_ws), control
    assert "marker" in control["listed"] and control["read"] == "here\n", control

    attack: dict[str, Any] = {}
    tool_deadline = WAIT_SECONDS + 2.0
    thread = threading.Thread(target=lambda: attack.update(run_client_as(
        attacker.uid, attacker.gid, daemon.socket, ATTACK,
        {"hung": {kind: m.path for kind, m in hung.items()}, "own": own, "flag": str(flag),
         "tool_deadline": tool_deadline})))
    thread.start()
    try:
        times = run_client_as(victim.uid, victim.gid, daemon.socket, VICTIM,
                              {"ws": str(victim_ws), "flag": str(flag), "seconds": WAIT_SECONDS / 2})
    finally:
        thread.join(180)
    steps = times["create"] + times["exec"]
    print(f"victim while the mounts hang: {len(times['create'])} CreateSession+Exec rounds; "
          f"CreateSession p50 {percentile(times['create'], 0.5):.3f} s max {max(times['create']):.3f} s; "
          f"Exec p50 {percentile(times['exec'], 0.5):.3f} s max {max(times['exec']):.3f} s")
    assert len(times["create"]) >= 2, times
    assert max(steps) < VICTIM_BOUND, times

    window_start, window_end = times["window"]
    for name, result in attack.items():
        kind, field = name.split(":")
        path = hung[kind].path
        if result["code"] == "DEADLINE_EXCEEDED" and field in PATH_FIELDS:
            # The victim's whole run fell inside this request's hang, which ended at the deadline.
            assert result["started"] < window_start and result["ended"] > window_end, (name, result, times)
            assert result["ended"] - result["started"] >= WAIT_SECONDS * 0.9, (name, result)
            assert path in result["detail"] and "does not answer" in result["detail"], (name, result)
        assert result["code"] == EXPECTED[kind].get(field, "DEADLINE_EXCEEDED"), (name, result)
    # A program on the mount holds its own start (execve waits on the lookup), never the fork server.
    assert "did not start within" in attack["fusermount3:exec_program"]["detail"], attack
    assert daemon.fork_server_pid() == fork_pid          # the watchdog had no reason to act

    # Every lookup given up on is gone already, although the mounts still hang: killed, and reaped.
    deadline = time.monotonic() + 20 * SLOW
    while (processes_of(attacker.uid) != holders(hung) or fd_count(fork_pid) > fds_before) and \
            time.monotonic() < deadline:
        time.sleep(0.1)
    assert processes_of(attacker.uid) == holders(hung), "the attacker's lookups left processes behind"
    assert fd_count(fork_pid) <= fds_before, os.listdir(f"/proc/{fork_pid}/fd")
    for mount in hung.values():
        mount.release()
    assert processes_of(attacker.uid) == []
    # Released, the same paths fail at once, as paths that cannot be used.
    after = run_client_as(attacker.uid, attacker.gid, daemon.socket, r'''
c = code(lambda: stub.CreateSession(pb.CreateSessionRequest(workspace=ARGS["ws"], approval_policy=pb.NEVER)))
print(json.dumps({"code": c}))
''', {"ws": hung["fusermount3"].path + "/ws"})
    assert after["code"] in ("INVALID_ARGUMENT", "PERMISSION_DENIED"), after


def health(daemon: Daemon) -> int:
    channel = grpc.insecure_channel("unix:" + daemon.socket)
    try:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status
    except grpc.RpcError:
        return -1
    finally:
        channel.close()


def test_the_watchdog_replaces_a_frozen_fork_server(sandboxd_daemon: DaemonFactory) -> None:
    ping_timeout = 1.5 * SLOW
    daemon = sandboxd_daemon(config=f"[fork_server]\nping_timeout_seconds = {ping_timeout}\n")
    ws = sandboxd_daemon.workspace()
    stub = daemon.stub
    session = create_session(stub, ws, workspace_write())
    assert run_exec(stub, session.id, ["/bin/echo", "before"]).stdout == b"before\n"
    frozen = daemon.fork_server_pid()
    assert frozen is not None
    running = ExecCall(stub, exec_start(session.id, ["/bin/sleep", "60"]))
    running.wait_started()
    os.kill(frozen, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 4 * ping_timeout + 10 * SLOW
        seen = []
        while time.monotonic() < deadline:
            seen.append(health(daemon))
            if seen[-1] == health_pb2.HealthCheckResponse.NOT_SERVING:
                break
            time.sleep(0.05)
        assert seen[-1] == health_pb2.HealthCheckResponse.NOT_SERVING, seen
        while time.monotonic() < deadline + 30 * SLOW and (
                health(daemon) != health_pb2.HealthCheckResponse.SERVING or daemon.fork_server_pid() in (None, frozen)):
            time.sleep(0.05)
        fresh = daemon.fork_server_pid()
        assert fresh not in (None, frozen), daemon.log()
    finally:
        try:
            os.kill(frozen, signal.SIGCONT)                  # harmless if it is gone, as it must be
        except ProcessLookupError:
            pass
    assert not os.path.exists(f"/proc/{frozen}") or open(f"/proc/{frozen}/stat").read().split(")")[1].split()[0] == "Z"
    assert any("did not answer a ping" in str(line.get("msg")) for line in daemon.log_lines()), daemon.log()
    # A call running in the frozen server died with it: it ends at once with an error that says so.
    assert running.wait_done(30 * SLOW), running.outcome.describe()
    running.close()
    assert running.error is not None and running.error.code() == grpc.StatusCode.FAILED_PRECONDITION, \
        (running.error, running.outcome.describe())
    assert "fork server" in (running.error.details() or ""), running.error
    # The new fork server serves the old session (resumed on its next call) and a new one.
    assert run_exec(stub, session.id, ["/bin/echo", "after"]).stdout == b"after\n"
    other = create_session(stub, sandboxd_daemon.workspace(), workspace_write())
    assert run_exec(stub, other.id, ["/bin/echo", "new"]).stdout == b"new\n"
