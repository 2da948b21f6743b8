"""danger-full-access for a non-root caller (issue 17, item 5), from the attacker's side.

A plain user the test creates (with a supplementary group of its own) creates a danger-full-access
session through the daemon's socket and runs commands and file tools in it. Each attack is made from
inside the command, against the real kernel, with a control that the same thing done with the
caller's own rights works: its commands have exactly the caller's uid, gid and groups and nothing
more (not root's files, not another user's, no capability, no_new_privs so a setuid binary elevates
nothing, no descriptor of the daemon, no signal or ptrace of the daemon or fork server); its tree
stays killable (a timeout or the session's close kills what it daemonized); its calls are audited;
root's danger-full-access still runs as root; an operator can turn it off."""

from __future__ import annotations

import grp
import json
import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest

from daemon_helpers import (
    Daemon, DaemonFactory, ExecCall, ProcInfo, close_quietly, exec_start, plain_users, proc_info, run_client_as, run_exec, scratch_group,
    survivors,
)
from conftest import SLOW
from sandboxd.v1 import sandboxd_pb2 as pb

FULL = pb.SandboxPolicy(mode=pb.SandboxPolicy.DANGER_FULL_ACCESS)
OPEN_FILES = 200          # the session's rlimit, as its commands must see it
CALL_TIMEOUT = 3.0        # the timed-out call's own limit

# Run inside the full-access command by the system's python3 (it needs nothing of sandboxd's).
PROBE = r'''
import ctypes, errno, json, os, socket, subprocess, sys
A = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
r = {}

def attempt(fn):
    try:
        fn()
        return "ok"
    except OSError as exc:
        return errno.errorcode.get(exc.errno, str(exc.errno))

def write(path):
    with open(path, "w") as f:
        f.write("x")

def ptrace_attach(pid):
    if libc.ptrace(16, pid, 0, 0) == 0:                      # PTRACE_ATTACH
        libc.ptrace(17, pid, 0, 0)                           # PTRACE_DETACH
        return "ok"
    return errno.errorcode[ctypes.get_errno()]

r["ids"] = [os.getuid(), os.geteuid(), os.getgid(), os.getegid(), sorted(os.getgroups())]
status = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
r["caps"] = {k: int(status[k], 16) for k in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")}
r["no_new_privs"] = int(status["NoNewPrivs"])
r["seccomp"] = int(status["Seccomp"])
r["securebits"] = libc.prctl(27, 0, 0, 0, 0)                  # PR_GET_SECUREBITS
fds = {}
for name in os.listdir("/proc/self/fd"):
    try:
        fds[name] = os.readlink("/proc/self/fd/" + name)
    except OSError:
        pass                                                  # the listing's own, closed by now
r["fds"] = fds
r["shadow"] = attempt(lambda: open("/etc/shadow").read())
r["root_write"] = attempt(lambda: write("/root/sbxt-full-access"))
r["other_user"] = attempt(lambda: open(A["other_secret"]).read())
r["group_file"] = attempt(lambda: open(A["group_file"]).read())
r["own_write"] = attempt(lambda: write(os.path.join(A["ws"], "probe-made")))
r["setuid_copy"] = subprocess.run([A["setuid_id"], "-u"], capture_output=True, text=True).stdout.strip()
for name in ("daemon", "fork_server"):
    pid = A[name]
    r["kill_" + name] = attempt(lambda: os.kill(pid, 0))
    r["ptrace_" + name] = ptrace_attach(pid)
    r["environ_" + name] = attempt(lambda: open("/proc/%d/environ" % pid, "rb").read())
child = subprocess.Popen(["sleep", "60"])
r["kill_own"] = attempt(lambda: os.kill(child.pid, 0))
r["ptrace_own"] = ptrace_attach(child.pid)
child.kill()
child.wait()
def connect(path):
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(path)
r["backend_socket"] = attempt(lambda: connect(A["backend"]))
r["front_socket"] = attempt(lambda: connect(A["front"]))
r["cgroup_escape"] = attempt(lambda: write(A["cgroup_procs"]))
print(json.dumps(r))
'''

ATTACK = r'''
SLOW = ARGS["slow"]   # an emulated guest is that much slower: deadlines scale with it
def session(ws, **kwargs):
    return stub.CreateSession(pb.CreateSessionRequest(
        workspace=ws, approval_policy=pb.NEVER, sandbox_policy=pb.SandboxPolicy(
            mode=pb.SandboxPolicy.DANGER_FULL_ACCESS), **kwargs), timeout=60 * SLOW)

import time
def call(session_id, argv, retried=False, **kwargs):
    out, err, result = b"", b"", None
    start = pb.ExecStart(session_id=session_id, argv=argv, **kwargs)
    deadline, began = 120 * SLOW, time.monotonic()
    try:
        for r in stub.Exec(iter([pb.ExecRequest(start=start)]), timeout=deadline):
            kind = r.WhichOneof("kind")
            if kind == "stdout":
                out += r.stdout
            elif kind == "stderr":
                err += r.stderr
            elif kind == "result":
                result = r.result
    except grpc.RpcError as error:
        took = time.monotonic() - began
        # grpc's deadline is on the wall clock: an emulated guest's wall clock can jump, and then a
        # deadline "passes" long before its time. Only that case is tried again (once, and said).
        if error.code() == grpc.StatusCode.DEADLINE_EXCEEDED and took < deadline / 2 and not retried:
            again = call(session_id, argv, retried=True, **kwargs)
            again["early_deadline_after"] = took
            return again
        return {"code": error.code().name, "details": error.details(), "seconds": took}
    return {"code": "OK", "out": out.decode(), "err": err.decode(), "exit": result.exit_code,
            "timed_out": result.timed_out, "seconds": time.monotonic() - began}

def tool(fn):
    try:
        return ["OK", fn()]
    except grpc.RpcError as error:
        return [error.code().name, error.details()]

ws = ARGS["ws"]
res = {"groups": sorted(os.getgroups())}
s = session(ws, limits=pb.Limits(open_files=ARGS["open_files"]))
res["session"] = s.id
res["probe"] = call(s.id, ["/usr/bin/python3", "-c", ARGS["probe"], json.dumps(ARGS)])
res["shell"] = call(s.id, ["sh", "-c", "cat /etc/shadow >/dev/null; echo cat=$?; touch /root/sbxt-fa; "
                                      "echo touch=$?; touch own-file; echo own=$?; echo nofile=$(ulimit -n); pwd"])
res["terminal"] = call(s.id, ["sh", "-c", "test -t 0 && test -t 1 && echo on-a-tty; id -u; "
                                         "python3 -c 'import os; print(os.getsid(0) == os.getppid(), os.tcgetpgrp(0) == os.getpgrp())'"],
                       terminal=pb.Terminal(rows=24, columns=80))
res["cwd_sub"] = call(s.id, ["pwd"], cwd=ws + "/sub")
res["cwd_link_to_root"] = call(s.id, ["pwd"], cwd=ws + "/to-root")
res["cwd_outside"] = call(s.id, ["pwd"], cwd="/root")
res["read_shadow"] = tool(lambda: stub.ReadFile(pb.ReadFileRequest(session_id=s.id, path="/etc/shadow"),
                                                timeout=60 * SLOW).data.decode())
res["read_own"] = tool(lambda: stub.ReadFile(pb.ReadFileRequest(session_id=s.id, path="own.txt"),
                                             timeout=60 * SLOW).data.decode())
res["write_root"] = tool(lambda: stub.WriteFile(pb.WriteFileRequest(session_id=s.id, path="/root/sbxt-fa-tool",
                                                                    data=b"x"), timeout=60 * SLOW).bytes_written)
res["write_own"] = tool(lambda: stub.WriteFile(pb.WriteFileRequest(session_id=s.id, path="tool-made",
                                                                   data=b"xyz"), timeout=60 * SLOW).bytes_written)
switched = stub.CreateSession(pb.CreateSessionRequest(workspace=ws, approval_policy=pb.NEVER), timeout=60 * SLOW)
res["switched_session"] = switched.id
stub.UpdateSessionPolicy(pb.UpdateSessionPolicyRequest(session_id=switched.id, sandbox_policy=pb.SandboxPolicy(
    mode=pb.SandboxPolicy.DANGER_FULL_ACCESS)), timeout=60 * SLOW)
res["switched"] = call(switched.id, ["sh", "-c", "id -u; grep -E 'CapBnd|NoNewPrivs' /proc/self/status"])
confined = stub.CreateSession(pb.CreateSessionRequest(workspace=ws, approval_policy=pb.NEVER), timeout=60 * SLOW)
res["confined_session"] = confined.id
lifetime = session(ws)
res["lifetime_session"] = lifetime.id
res["timeout"] = call(lifetime.id, ["sh", "-c", "setsid sh -c 'sleep 1000 & echo $! > timeout.pid'; "
                                                "while [ ! -s timeout.pid ]; do sleep 0.01; done; sleep 1000"],
                      timeout_seconds=ARGS["call_timeout"])
# A daemon closes its standard descriptors: the call (like ssh) ends when its output does.
res["background"] = call(lifetime.id, ["sh", "-c", "setsid sh -c 'sleep 1000 </dev/null >/dev/null 2>&1 & "
                                                   "echo $! > background.pid'; "
                                                   "while [ ! -s background.pid ]; do sleep 0.01; done"])
job = stub.StartBackground(pb.StartBackgroundRequest(session_id=lifetime.id, shell=(
    "setsid sh -c 'sleep 1000 </dev/null >/dev/null 2>&1 & echo $! > job.pid'; sleep 1000")), timeout=60 * SLOW)
deadline = time.monotonic() + 60
while not (os.path.exists(ws + "/job.pid") and open(ws + "/job.pid").read().strip()) and time.monotonic() < deadline:
    time.sleep(0.02)
stopped = stub.StopBackground(pb.StopBackgroundRequest(session_id=lifetime.id, id=job.id), timeout=60 * SLOW)
res["job_stopped"] = [stopped.running, stopped.result.signal]
print(json.dumps(res))
'''


def _run_as(uid_gid: tuple[int, int], *argv: str) -> subprocess.CompletedProcess[str]:
    """``argv`` run on the host as the plain user, directly (no sandboxd): the control."""
    uid, gid = uid_gid
    return subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", *argv],
                          capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def world(sandboxd_daemon_module: DaemonFactory) -> Iterator[dict[str, Any]]:
    """A daemon; the plain user ``alice`` (in a group of its own making) who attacks from its
    full-access session, and ``bob`` whose private file it goes for."""
    base = sandboxd_daemon_module.base
    with scratch_group("sbxf-") as group, scratch_group("sbxf-a") as admins, plain_users(2) as (alice, bob):
        gid = grp.getgrnam(group).gr_gid
        daemon = sandboxd_daemon_module(config=f'[listen]\nadmin_group = "{admins}"\n')
        ws = base / "alice-ws"
        (ws / "sub").mkdir(parents=True)
        (ws / "own.txt").write_text("alice's own")
        (ws / "to-root").symlink_to("/root")
        for path in (ws, ws / "sub", ws / "own.txt", ws / "to-root"):
            os.lchown(path, alice.uid, alice.gid)
        os.chmod(ws, 0o700)
        bob_dir = base / "bob-private"
        bob_dir.mkdir(mode=0o700)
        (bob_dir / "secret").write_text("bob's")
        for path in (bob_dir, bob_dir / "secret"):
            os.chown(path, bob.uid, bob.gid)
        group_file = base / "group-only"
        group_file.write_text("for the group")
        os.chown(group_file, 0, gid)
        os.chmod(group_file, 0o640)
        setuid_id = base / "setuid-id"
        shutil.copy(shutil.which("id") or "/usr/bin/id", setuid_id)
        os.chmod(setuid_id, 0o4755)
        args = {"ws": str(ws), "other_secret": str(bob_dir / "secret"), "group_file": str(group_file),
                "setuid_id": str(setuid_id), "daemon": daemon.pid, "fork_server": daemon.fork_server_pid(),
                "backend": daemon.private_sockets()[0], "front": str(daemon.socket),
                "cgroup_procs": _a_root_cgroup_procs(), "probe": PROBE, "open_files": OPEN_FILES,
                "call_timeout": CALL_TIMEOUT, "groups": [gid], "slow": SLOW}
        seen = run_client_as(alice.uid, alice.gid, str(daemon.socket), ATTACK, args, timeout=180 * SLOW)
        try:
            yield {"daemon": daemon, "alice": alice, "bob": bob, "gid": gid, "ws": ws, "seen": seen,
                   "setuid_id": setuid_id, "args": args, "admin_gid": grp.getgrnam(admins).gr_gid}
        finally:
            for key in ("session", "lifetime_session", "switched_session", "confined_session"):
                if key in seen:
                    close_quietly(daemon.stub, seen[key])
            _kill_pid_files(ws)


def _a_root_cgroup_procs() -> str:
    """A cgroup.procs outside every sandbox group (the root of a hierarchy): where a command that
    wants to outlive its session would move itself."""
    for candidate in ("/sys/fs/cgroup/cgroup.procs", "/sys/fs/cgroup/pids/cgroup.procs",
                      "/sys/fs/cgroup/memory/cgroup.procs"):
        if os.path.exists(candidate):
            return candidate
    pytest.skip("no cgroup file system mounted at /sys/fs/cgroup")


def _kill_pid_files(ws: Path) -> None:
    for name in ("timeout.pid", "background.pid", "job.pid", "running.pid"):
        try:
            pid = int((ws / name).read_text())
            if proc_info(pid) is not None and proc_info(pid).comm == "sleep":  # type: ignore[union-attr]
                os.kill(pid, 9)
        except (OSError, ValueError):
            pass


def _sleeping(pid: int) -> "ProcInfo | None":
    """``pid`` once it is the ``sleep`` it was forked to exec (``$!`` is the pid before the exec)."""
    deadline = time.monotonic() + 30 * SLOW
    while True:
        info = proc_info(pid)
        if info is None or info.comm == "sleep" or time.monotonic() > deadline:
            return info if info is not None and info.comm == "sleep" else None
        time.sleep(0.01)


def _probe(world: dict[str, Any]) -> dict[str, Any]:
    call = world["seen"]["probe"]
    assert call["code"] == "OK" and call["exit"] == 0, call
    return json.loads(call["out"])  # type: ignore[no-any-return]


def test_commands_run_as_the_caller_with_its_own_groups(world: dict[str, Any]) -> None:
    alice, gid, seen = world["alice"], world["gid"], world["seen"]
    probe = _probe(world)
    assert seen["groups"] == [gid]                                 # the client's own groups ...
    assert probe["ids"] == [alice.uid, alice.uid, alice.gid, alice.gid, sorted({alice.gid, gid})], probe  # the same
    assert probe["group_file"] == "ok"                             # a file only that group may read
    assert probe["own_write"] == "ok"                              # the caller's own files are writable


def test_a_terminal_call_runs_as_the_caller_on_its_own_terminal(world: dict[str, Any]) -> None:
    """exec -t / sandboxctl shell in a non-root full-access session: the terminal is opened by the
    command's own process after it became the caller (the host's devpts), and it leads its session."""
    call = world["seen"]["terminal"]
    assert call["code"] == "OK" and call["exit"] == 0, call
    assert call["out"].split() == ["on-a-tty", str(world["alice"].uid), "True", "True"], call


def test_no_capability_no_new_privs_securebits_locked(world: dict[str, Any]) -> None:
    probe = _probe(world)
    assert probe["caps"] == {"CapInh": 0, "CapPrm": 0, "CapEff": 0, "CapBnd": 0, "CapAmb": 0}, probe
    assert probe["no_new_privs"] == 1
    assert probe["seccomp"] == 2                                   # the unconfined filter (no TIOCSTI)
    # NOROOT, NO_CAP_AMBIENT_RAISE, each locked, and KEEP_CAPS locked off (kernel/caps.py)
    assert probe["securebits"] == 0b11100011, probe


def test_setuid_binaries_do_not_elevate(world: dict[str, Any]) -> None:
    alice = world["alice"]
    # Control: the same setuid copy, run by the same user directly on the host, is root.
    direct = _run_as((alice.uid, alice.gid), str(world["setuid_id"]), "-u")
    assert direct.stdout.strip() == "0", direct
    assert _probe(world)["setuid_copy"] == str(alice.uid)


def test_root_and_other_users_files_stay_closed(world: dict[str, Any]) -> None:
    probe, shell = _probe(world), world["seen"]["shell"]
    assert probe["shadow"] == "EACCES" and probe["root_write"] == "EACCES", probe
    assert probe["other_user"] == "EACCES", probe
    assert shell["code"] == "OK", shell
    lines = shell["out"].split()
    assert "cat=1" in lines and "touch=1" in lines and "own=0" in lines, shell
    assert not os.path.exists("/root/sbxt-fa") and not os.path.exists("/root/sbxt-full-access")
    assert (world["ws"] / "own-file").stat().st_uid == world["alice"].uid


def test_the_daemon_and_fork_server_cannot_be_signalled_or_traced(world: dict[str, Any]) -> None:
    probe = _probe(world)
    assert probe["kill_own"] == "ok" and probe["ptrace_own"] == "ok", probe        # the control
    for name in ("daemon", "fork_server"):
        assert probe["kill_" + name] == "EPERM", probe
        assert probe["ptrace_" + name] == "EPERM", probe
        assert probe["environ_" + name] == "EACCES", probe


def test_no_descriptor_of_the_daemon_and_only_its_own_sockets(world: dict[str, Any]) -> None:
    probe = _probe(world)
    assert sorted(probe["fds"]) == ["0", "1", "2"], probe["fds"]
    # The daemon's socket is reached as the caller, through its front door; the private backend
    # behind it (which trusts its peer) is not reachable at all.
    assert probe["front_socket"] == "ok" and probe["backend_socket"] == "EACCES", probe
    assert probe["cgroup_escape"] == "EACCES", probe


def test_cwd_and_rlimits_are_the_sessions(world: dict[str, Any]) -> None:
    seen, ws = world["seen"], world["ws"]
    assert seen["cwd_sub"]["out"].strip() == f"{ws}/sub", seen["cwd_sub"]
    assert f"nofile={OPEN_FILES}" in seen["shell"]["out"].split(), seen["shell"]
    assert seen["cwd_outside"]["code"] == "INVALID_ARGUMENT", seen["cwd_outside"]
    # Inside the workspace by path, /root by the caller's own symlink: entered as the caller, refused.
    escape = seen["cwd_link_to_root"]
    assert escape["code"] != "OK" or escape["exit"] != 0, escape
    assert "EACCES" in json.dumps(escape) or "ermission denied" in json.dumps(escape), escape


def test_file_tools_have_the_callers_rights(world: dict[str, Any]) -> None:
    seen, ws = world["seen"], world["ws"]
    assert seen["read_own"] == ["OK", "alice's own"], seen["read_own"]
    assert seen["write_own"] == ["OK", 3] and (ws / "tool-made").stat().st_uid == world["alice"].uid
    assert seen["read_shadow"][0] == "PERMISSION_DENIED", seen["read_shadow"]
    assert seen["write_root"][0] == "PERMISSION_DENIED", seen["write_root"]
    assert not os.path.exists("/root/sbxt-fa-tool")


def test_a_timeout_kills_what_the_call_daemonized(world: dict[str, Any]) -> None:
    timed = world["seen"]["timeout"]
    assert timed["code"] == "OK" and timed["timed_out"], timed
    pid = int((world["ws"] / "timeout.pid").read_text())
    info = proc_info(pid)
    assert info is None or not survivors({pid: info}), f"the daemonized sleep {pid} outlived its call's timeout"


def test_stopping_a_background_process_kills_what_it_daemonized(world: dict[str, Any]) -> None:
    stopped = world["seen"]["job_stopped"]
    assert stopped[0] is False and stopped[1] in (9, 15), stopped
    pid = int((world["ws"] / "job.pid").read_text())
    info = proc_info(pid)
    assert info is None or not survivors({pid: info}), f"the daemonized sleep {pid} outlived StopBackground"


def test_background_jobs_live_until_the_session_closes(world: dict[str, Any]) -> None:
    daemon: Daemon = world["daemon"]
    background = world["seen"]["background"]
    assert background["code"] == "OK" and background["exit"] == 0, background
    pid = int((world["ws"] / "background.pid").read_text())
    info = _sleeping(pid)
    assert info is not None, "the control: a background job outlives its call"
    # And a call still running at the close, with a daemon of its own: both end with the session.
    with ExecCall(daemon.stub, exec_start(world["seen"]["lifetime_session"], ["sh", "-c", (
            "setsid sh -c 'sleep 1000 </dev/null >/dev/null 2>&1 & echo $! > running.pid'; "
            "while [ ! -s running.pid ]; do sleep 0.01; done; echo ready; exec sleep 1000")])) as running:
        running.wait_stdout(b"ready")
        running_pid = int((world["ws"] / "running.pid").read_text())
        running_info = _sleeping(running_pid)
        assert running_info is not None, "the control: the running call's daemon runs"
        daemon.stub.CloseSession(pb.CloseSessionRequest(session_id=world["seen"]["lifetime_session"]), timeout=60)
        assert running.wait_done(), "the running call did not end when its session closed"
    assert not survivors({pid: info, running_pid: running_info}), "a daemonized sleep outlived its session"


def test_calls_are_audited_as_any_call(world: dict[str, Any]) -> None:
    daemon: Daemon = world["daemon"]
    events = daemon.stub.QueryEvents(pb.QueryEventsRequest(session_id=world["seen"]["session"], page_size=1000),
                                     timeout=60).events
    created = [e for e in events if e.type == "SessionCreated"]
    assert created and json.loads(created[0].data_json)["owner_uid"] == world["alice"].uid
    started = [json.loads(e.data_json) for e in events if e.type == "ToolInvocationStarted"]
    assert any("cat /etc/shadow" in json.dumps(data) for data in started), started
    assert len([e for e in events if e.type in ("ToolInvocationCompleted", "ToolInvocationFailed")]) >= 5


def test_root_full_access_still_runs_as_root(world: dict[str, Any]) -> None:
    daemon: Daemon = world["daemon"]
    session = daemon.stub.CreateSession(pb.CreateSessionRequest(
        workspace=str(world["ws"]), approval_policy=pb.NEVER, sandbox_policy=FULL), timeout=60)
    try:
        outcome = run_exec(daemon.stub, session.id, ["sh", "-c", "id -u; grep CapEff /proc/self/status; "
                                                                  "cat /etc/shadow >/dev/null && echo shadow=ok"])
    finally:
        close_quietly(daemon.stub, session.id)
    out = outcome.stdout.decode().split()
    assert out[0] == "0" and "shadow=ok" in out, out
    assert int(out[out.index("CapEff:") + 1], 16) != 0, out


ADMIN = r'''
def update(**kwargs):
    try:
        stub.UpdateSessionPolicy(pb.UpdateSessionPolicyRequest(session_id=ARGS["session"], **kwargs), timeout=60)
        return ["OK", ""]
    except grpc.RpcError as error:
        return [error.code().name, error.details()]
print(json.dumps({"full": update(sandbox_policy=pb.SandboxPolicy(mode=pb.SandboxPolicy.DANGER_FULL_ACCESS)),
                  "approval": update(approval_policy=pb.ALWAYS)}))
'''


def test_a_session_switched_to_full_access_runs_as_its_owner(world: dict[str, Any]) -> None:
    switched = world["seen"]["switched"]
    assert switched["code"] == "OK", switched
    out = switched["out"].split()
    assert out[0] == str(world["alice"].uid) and out[out.index("CapBnd:") + 1] == "0000000000000000", out
    assert out[out.index("NoNewPrivs:") + 1] == "1", out


def test_an_administrator_cannot_make_another_users_session_full_access(world: dict[str, Any]) -> None:
    """The admin group manages everyone's sessions (the control: it changes the approval policy of
    the user's session), but must not get to run commands on the host as that user."""
    daemon: Daemon = world["daemon"]
    bob = world["bob"]
    seen = run_client_as(bob.uid, bob.gid, str(daemon.socket), ADMIN,
                         {"session": world["seen"]["confined_session"], "groups": [world["admin_gid"]]})
    assert seen["approval"] == ["OK", ""], seen
    assert seen["full"][0] == "PERMISSION_DENIED" and "only the session's owner" in seen["full"][1], seen
    session = daemon.stub.GetSession(pb.GetSessionRequest(session_id=world["seen"]["confined_session"]), timeout=60)
    assert session.sandbox_policy.mode == pb.SandboxPolicy.WORKSPACE_WRITE


DENIED = r'''
def create(policy):
    try:
        s = stub.CreateSession(pb.CreateSessionRequest(workspace=ARGS["ws"], approval_policy=pb.NEVER,
                               sandbox_policy=pb.SandboxPolicy(mode=policy)), timeout=60)
        stub.CloseSession(pb.CloseSessionRequest(session_id=s.id), timeout=60)
        return ["OK", ""]
    except grpc.RpcError as error:
        return [error.code().name, error.details()]
print(json.dumps({"full": create(pb.SandboxPolicy.DANGER_FULL_ACCESS),
                  "workspace_write": create(pb.SandboxPolicy.WORKSPACE_WRITE)}))
'''


def test_an_operator_can_turn_it_off(sandboxd_daemon: DaemonFactory) -> None:
    daemon = sandboxd_daemon(config="[policy]\nallow_user_full_access = false\n")
    with plain_users(1) as (carol,):
        ws = sandboxd_daemon.workspace()
        os.chown(ws, carol.uid, carol.gid)
        seen = run_client_as(carol.uid, carol.gid, str(daemon.socket), DENIED, {"ws": str(ws)})
    assert seen["full"][0] == "PERMISSION_DENIED" and "policy.allow_user_full_access" in seen["full"][1], seen
    assert seen["workspace_write"] == ["OK", ""], seen                       # the control
    root = daemon.stub.CreateSession(pb.CreateSessionRequest(workspace=str(ws), approval_policy=pb.NEVER,
                                                             sandbox_policy=FULL), timeout=60)
    close_quietly(daemon.stub, root.id)                                      # root still may


def test_the_front_door_sees_the_caller_not_root(world: dict[str, Any]) -> None:
    """Through the daemon's socket, a full-access command is its caller: it sees its own sessions
    and not root's, like any process of that user."""
    daemon: Daemon = world["daemon"]
    root_session = daemon.stub.CreateSession(pb.CreateSessionRequest(
        workspace=str(world["ws"]), approval_policy=pb.NEVER), timeout=60)
    try:
        lister = ("import grpc, sys; from sandboxd.v1 import sandboxd_pb2 as pb, sandboxd_pb2_grpc as g; "
                  "s = g.SandboxStub(grpc.insecure_channel('unix:' + sys.argv[1])); "
                  "print(' '.join(x.id for x in s.ListSessions(pb.ListSessionsRequest(), timeout=60).sessions))")
        outcome = run_exec(daemon.stub, world["seen"]["session"], ["/usr/bin/python3", "-c", lister,
                                                                   str(daemon.socket)], env=_python_path())
    finally:
        close_quietly(daemon.stub, root_session.id)
    listed = outcome.stdout.decode().split()
    assert world["seen"]["session"] in listed, outcome.describe()            # its own: the control
    assert root_session.id not in listed, listed



def _python_path() -> dict[str, str]:
    """An environment in which the system's python3 imports grpc and sandboxd from this checkout
    (the venv's own interpreter may sit where a plain user cannot run it)."""
    import grpc

    import sandboxd
    paths = [str(Path(grpc.__file__).parents[1]), str(Path(sandboxd.__file__).parents[1])]
    return {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "PYTHONPATH": ":".join(paths)}


def test_a_session_group_takes_its_calls_groups_with_it() -> None:
    """The fork server's last resort (a session closed or swept with a call's group still in it):
    killing and removing the session's group covers the groups nested in it, on v1 too, where no
    cgroup.kill does it for us. The control: the process really ran in the nested group."""
    from sandboxd.kernel import cgroups

    session = cgroups.CgroupSet.create(f"run-{os.getpid()}-full-access-{uuid.uuid4().hex[:6]}",
                                       memory_bytes=None, pids=64)
    made = list(session.dirs)
    try:
        call = session.child("call-1")
        made += call.dirs
        sleeper = subprocess.Popen(["sleep", "1000"])
        try:
            cgroups.join(call.dirs, sleeper.pid)
            assert call.pids() == {sleeper.pid} and sleeper.pid in session.pids()
            session.kill()
            assert sleeper.wait(timeout=30) == -9
        finally:
            sleeper.kill()
            sleeper.wait()
    finally:
        session.remove()
    assert made and not any(os.path.exists(path) for path in made), made
