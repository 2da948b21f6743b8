"""Set-id files, command identity, standing rules per owner, and the audit store's permissions
(issue 10, parts 3, 4 and 8).

* No command in a confined policy can make a set-uid or set-gid file or give a file a
  capability, whoever it runs as (uid 0 on a root-owned workspace, or a plain user), through
  every way in: ``sandboxd run`` (the Python sequence), a session call on the native helper
  and on the Python path, and a daemon session's Exec; WriteFile refuses a set-id mode and
  ApplyPatch cannot make one. The host is checked afterwards; chmod 755, mkdir and plain
  file creation keep working, and danger-full-access is unchanged (the control that shows
  the probe can succeed).
* A root caller's session commands run as the workspace's owner.
* A standing rule is its maker's: another user's rule on a shared workspace never answers for
  this user's session; each sees (and removes) only its own, root sees everyone's.
* The event store, its WAL and SHM are 0600 and the state directory 0700 after a daemon has
  served calls, even when an older sandboxd left them readable; old rules keep their owner.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import sqlite3
import stat
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from conftest import BASE_ENV, PY, run_sbx
from daemon_helpers import (
    Daemon,
    PlainUser,
    close_quietly,
    create_session,
    daemon_factory,
    make_base_dir,
    plain_users,
    read_only,
    remove_tree,
    rpc_error,
    run_client_as,
    run_exec,
    workspace_write,
)
from sandboxd.audit.store import MIGRATIONS, PERMISSION_NAMESPACE
from sandboxd.policy import LaunchSpec, ReadOnly, WorkspaceWrite
from sandboxd.supervisor.fork_client import ForkServer
from sandboxd.v1 import sandboxd_pb2 as pb

pytestmark = [pytest.mark.timeout(240),
              pytest.mark.skipif(platform.machine() != "x86_64",
                                 reason="the probe calls creat/fchmodat/fchmodat2/openat2 by x86_64 number")]

# Run inside the sandbox with the system python3: tries every way to a set-id file or a file
# capability in DIR, and the legitimate controls, and prints {attempt: "ok" | errno name}.
PROBE = r'''
import ctypes, errno, json, os, shutil, stat, struct, subprocess, sys
os.chdir(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
AT_FDCWD = -100
res = {"uid": os.getuid()}

def attempt(name, fn):
    try:
        fn()
        res[name] = "ok"
    except OSError as e:
        res[name] = errno.errorcode.get(e.errno, str(e.errno))

def raw(number, *args):
    if libc.syscall(number, *args) < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))

def command(name, argv):
    program = shutil.which(argv[0], path="/usr/sbin:/usr/bin:/sbin:/bin")
    if program is None:                          # setcap is optional: setxattr above is the kernel's test
        res[name] = "absent"
        return
    done = subprocess.run([program, *argv[1:]], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    res[name] = "ok" if done.returncode == 0 else "failed"

shutil.copy("/bin/true", "prog")
# Controls: what a build does every day.
attempt("control chmod 755", lambda: os.chmod("prog", 0o755))
attempt("control mkdir", lambda: os.mkdir("plain-dir", 0o755))
attempt("control create 644", lambda: os.close(os.open("plain-file", os.O_CREAT | os.O_WRONLY, 0o644)))
attempt("control sticky dir", lambda: os.chmod("plain-dir", 0o1777))
# Set-id modes, every call that sets or creates one.
attempt("chmod 4755", lambda: os.chmod("prog", 0o4755))
attempt("chmod 2755", lambda: os.chmod("prog", 0o2755))
fd = os.open("prog", os.O_RDONLY)
attempt("fchmod 4755", lambda: os.fchmod(fd, 0o4755))
os.close(fd)
attempt("fchmodat 6755", lambda: raw(268, AT_FDCWD, b"prog", 0o6755))
attempt("fchmodat2 4755", lambda: raw(452, AT_FDCWD, b"prog", 0o4755, 0))
attempt("open O_CREAT 4755", lambda: os.close(os.open("o-suid", os.O_CREAT | os.O_WRONLY, 0o4755)))
attempt("open O_CREAT 2755", lambda: os.close(os.open("o-sgid", os.O_CREAT | os.O_WRONLY, 0o2755)))
attempt("open O_TMPFILE 4755", lambda: os.close(os.open(".", os.O_TMPFILE | os.O_WRONLY, 0o4755)))
attempt("creat 4755", lambda: raw(85, b"c-suid", 0o4755))
how = ctypes.create_string_buffer(struct.pack("QQQ", os.O_CREAT | os.O_WRONLY, 0o4755, 0))
attempt("openat2 4755", lambda: raw(437, AT_FDCWD, b"o2-suid", how, 24))
attempt("mkdir 2755", lambda: os.mkdir("d-sgid", 0o2755))
attempt("mknod 4755", lambda: os.mknod("n-suid", stat.S_IFREG | 0o4755))
# A file capability (VFS_CAP_REVISION_2, effective, cap_net_raw permitted): needs CAP_SETFCAP.
cap = struct.pack("<IIIII", 0x02000001, 1 << 13, 0, 0, 0)
attempt("setxattr security.capability", lambda: os.setxattr("prog", "security.capability", cap))
command("chmod u+s", ["chmod", "u+s", "prog"])
command("chmod g+s", ["chmod", "g+s", "prog"])
command("install -m 4755", ["install", "-m", "4755", "/bin/true", "installed"])
command("setcap", ["setcap", "cap_net_raw+ep", "prog"])
print(json.dumps(res))
'''

CONTROLS = ("control chmod 755", "control mkdir", "control create 644", "control sticky dir")
REFUSED = {"chmod 4755": "EPERM", "chmod 2755": "EPERM", "fchmod 4755": "EPERM", "fchmodat 6755": "EPERM",
           "fchmodat2 4755": "EPERM", "open O_CREAT 4755": "EPERM", "open O_CREAT 2755": "EPERM",
           "open O_TMPFILE 4755": "EPERM", "creat 4755": "EPERM", "openat2 4755": "ENOSYS",
           "mkdir 2755": "EPERM", "mknod 4755": "EPERM", "setxattr security.capability": "EPERM",
           "chmod u+s": "failed", "chmod g+s": "failed", "install -m 4755": "failed", "setcap": "failed"}


def assert_refused(result: dict[str, object], uid: int) -> None:
    assert result["uid"] == uid, result
    for name in CONTROLS:
        assert result[name] == "ok", (name, result)
    wrong = {name: result[name] for name, expected in REFUSED.items()
             if result[name] != expected and not (name == "setcap" and result[name] == "absent")}
    assert result["chmod u+s"] != "absent" and result["install -m 4755"] != "absent", result
    assert not wrong, f"set-id or capability not refused: {wrong}\n{result}"


def assert_no_setid_on_host(root: Path) -> None:
    """Nothing under ``root`` has a set-id bit or a file capability, seen from the host."""
    found = []
    for where, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(where, name)
            st = os.lstat(path)
            if st.st_mode & (stat.S_ISUID | stat.S_ISGID):
                found.append(f"{path} {stat.filemode(st.st_mode)}")
            if not stat.S_ISLNK(st.st_mode) and "security.capability" in os.listxattr(path):
                found.append(f"{path} has a file capability")
    assert not found, found


def parse_probe(out: str) -> dict[str, object]:
    return json.loads(out.strip().splitlines()[-1])


# --------------------------------------------------------------------------- users and workspaces


@pytest.fixture(scope="module")
def users() -> Iterator[list[PlainUser]]:
    """Two plain users (sbxt-<random>), removed afterwards."""
    with plain_users(2) as made:
        yield made


@pytest.fixture(scope="module")
def base() -> Iterator[Path]:
    path = make_base_dir("sbxt-setid-")
    try:
        yield path
    finally:
        remove_tree(path)


def owned_dir(base: Path, uid: int, gid: int, mode: int = 0o755) -> Path:
    path = base / f"ws-{uuid.uuid4().hex[:8]}"
    path.mkdir()
    os.chmod(path, mode)
    os.chown(path, uid, gid)
    return path


# --------------------------------------------------------------------------- sandboxd run


@pytest.mark.parametrize("owner", ["root", "user"])
def test_sandboxd_run_refuses_setid_files_and_capabilities(owner: str, users: list[PlainUser],
                                                           base: Path) -> None:
    uid, gid = (0, 0) if owner == "root" else (users[0].uid, users[0].gid)
    ws = owned_dir(base, uid, gid)
    done = run_sbx([PY, "-c", PROBE, str(ws)], workspace=ws)
    assert done.returncode == 0, done.stderr
    assert_refused(parse_probe(done.stdout), uid)
    assert_no_setid_on_host(ws)


def test_sandboxd_run_read_only_refuses_setid_in_its_tmp(base: Path) -> None:
    ws = owned_dir(base, 0, 0)
    done = run_sbx([PY, "-c", PROBE, "/tmp"], workspace=ws, policy="read-only")
    assert done.returncode == 0, done.stderr
    assert_refused(parse_probe(done.stdout), 0)


@pytest.mark.parametrize("owner", ["root", "user"])
def test_danger_full_access_is_unchanged(owner: str, users: list[PlainUser], base: Path) -> None:
    """The control: without the confined filter the same probe makes a set-uid file."""
    uid, gid = (0, 0) if owner == "root" else (users[0].uid, users[0].gid)
    ws = owned_dir(base, uid, gid)
    done = run_sbx([PY, "-c", PROBE, str(ws)], workspace=ws, policy="danger-full-access")
    assert done.returncode == 0, done.stderr
    result = parse_probe(done.stdout)
    assert result["uid"] == uid and result["chmod 4755"] == "ok" and result["chmod u+s"] == "ok", result
    assert result["open O_CREAT 4755"] == "ok" and result["mkdir 2755"] == "ok", result
    assert os.stat(ws / "prog").st_mode & stat.S_ISUID
    shutil.rmtree(ws)


# --------------------------------------------------------------------------- session calls, both paths


from test_call_paths import run as call  # noqa: E402 - one call in a session, its output and ExitInfo
from test_call_paths import server  # noqa: E402, F401 - a fork server per call path (native, python)


@pytest.mark.parametrize("owner", ["root", "user"])
def test_session_calls_refuse_setid_on_both_paths(server: ForkServer, owner: str, users: list[PlainUser],
                                                  base: Path) -> None:
    uid, gid = (0, 0) if owner == "root" else (users[0].uid, users[0].gid)
    ws = owned_dir(base, uid, gid)
    name = f"setid-{uuid.uuid4().hex[:8]}"
    server.open_session(name, LaunchSpec(argv=("true",), workspace=str(ws), env=dict(BASE_ENV),
                                         policy=WorkspaceWrite(), user=None if owner == "root" else (uid, gid)))
    try:
        out, _info = call(server, name, [PY, "-c", PROBE, str(ws)], str(ws))
        assert_refused(parse_probe(out), uid)
    finally:
        server.close_session(name)
    assert_no_setid_on_host(ws)


def test_read_only_session_calls_refuse_setid_in_tmp(server: ForkServer, base: Path) -> None:
    ws = owned_dir(base, 0, 0)
    name = f"setid-{uuid.uuid4().hex[:8]}"
    server.open_session(name, LaunchSpec(argv=("true",), workspace=str(ws), env=dict(BASE_ENV), policy=ReadOnly()))
    try:
        out, _info = call(server, name, [PY, "-c", PROBE, "/tmp"], str(ws))
        assert_refused(parse_probe(out), 0)
    finally:
        server.close_session(name)


# --------------------------------------------------------------------------- the daemon


OLD_RULE_UID = 4242


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    """A daemon whose state directory an older sandboxd left 0755, with a 0644 schema-1 store
    holding one standing rule (by_uid OLD_RULE_UID)."""
    with daemon_factory("sbxt-setid-d-") as factory:
        prepare_old_store(factory.base / "state")
        yield factory()


def prepare_old_store(state: Path) -> None:
    state.mkdir(mode=0o755)
    os.chmod(state, 0o755)
    db = sqlite3.connect(state / "events.db", isolation_level=None)
    db.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
    for statement in MIGRATIONS[0].split(";"):
        if statement.strip():
            db.execute(statement)
    db.execute("INSERT INTO schema_version (version) VALUES (1)")
    db.execute("INSERT INTO memory (namespace, workspace, key, value, created_at) VALUES (?, ?, ?, ?, ?)",
               (PERMISSION_NAMESPACE, "/old/workspace", "allow:fs.read",
                json.dumps({"tool": "fs.read", "by_uid": OLD_RULE_UID}), 1.0))
    db.close()
    os.chmod(state / "events.db", 0o644)


@pytest.fixture
def sessions(daemon: Daemon) -> Iterator[list[str]]:
    ids: list[str] = []
    yield ids
    for session_id in ids:
        close_quietly(daemon.stub, session_id)


def test_daemon_exec_as_root_on_a_root_workspace_refuses_setid(daemon: Daemon, sessions: list[str]) -> None:
    stub = daemon.stub
    ws = owned_dir(daemon.base, 0, 0)
    for policy, where in ((workspace_write(), str(ws)), (read_only(), "/tmp")):
        session = create_session(stub, ws, policy)
        sessions.append(session.id)
        out = run_exec(stub, session.id, [PY, "-c", PROBE, where])
        assert out.result is not None and out.result.exit_code == 0, out.describe()
        assert_refused(parse_probe(out.stdout.decode()), 0)
    assert_no_setid_on_host(ws)


def test_write_file_and_apply_patch_cannot_make_setid_files(daemon: Daemon, sessions: list[str]) -> None:
    stub = daemon.stub
    ws = owned_dir(daemon.base, 0, 0)
    session = create_session(stub, ws, workspace_write())
    sessions.append(session.id)
    for mode in (0o4755, 0o2755, 0o6700):
        error = rpc_error(lambda: stub.WriteFile(pb.WriteFileRequest(session_id=session.id, path="w", data=b"x",
                                                                     mode=mode)))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "set-uid or set-gid" in error.details()
    assert not (ws / "w").exists()
    stub.WriteFile(pb.WriteFileRequest(session_id=session.id, path="w", data=b"x", mode=0o755))   # control
    assert stat.S_IMODE(os.stat(ws / "w").st_mode) == 0o755
    patch = ("diff --git a/p b/p\nnew file mode 104755\n--- /dev/null\n+++ b/p\n@@ -0,0 +1 @@\n+echo hi\n"
             "diff --git a/w b/w\nold mode 100755\nnew mode 106755\n")
    applied = stub.ApplyPatch(pb.ApplyPatchRequest(session_id=session.id, patch=patch))
    # the card and the reply say what git makes of 104755: an executable, no set-id bit
    assert [(f.path, f.action) for f in applied.files] == [("p", "created executable"), ("w", "rewritten as it is")]
    # git keeps only the executable bit of a mode: 0755 both, never a set-id bit.
    assert stat.S_IMODE(os.stat(ws / "p").st_mode) == 0o755 and stat.S_IMODE(os.stat(ws / "w").st_mode) == 0o755
    assert_no_setid_on_host(ws)


# Run as a plain user: its own session on its own workspace, the probe through Exec.
USER_PROBE_CLIENT = r'''
session = stub.CreateSession(pb.CreateSessionRequest(workspace=ARGS["ws"], approval_policy=pb.NEVER,
    sandbox_policy=pb.SandboxPolicy(mode=pb.SandboxPolicy.WORKSPACE_WRITE)))
out, exit_code = run(session.id, [ARGS["py"], "-c", ARGS["probe"], ARGS["ws"]])
stub.CloseSession(pb.CloseSessionRequest(session_id=session.id))
print(json.dumps({"out": out, "exit": exit_code}))
'''


def test_daemon_exec_as_a_plain_user_refuses_setid(daemon: Daemon, users: list[PlainUser]) -> None:
    user = users[0]
    ws = owned_dir(daemon.base, user.uid, user.gid)
    res = run_client_as(user.uid, user.gid, daemon.socket, USER_PROBE_CLIENT,
                        {"ws": str(ws), "py": PY, "probe": PROBE})
    assert res["exit"] == 0, res
    assert_refused(parse_probe(res["out"]), user.uid)
    assert_no_setid_on_host(ws)


def test_a_root_callers_session_runs_as_the_workspace_owner(daemon: Daemon, users: list[PlainUser],
                                                            sessions: list[str]) -> None:
    stub, user = daemon.stub, users[0]
    theirs = owned_dir(daemon.base, user.uid, user.gid)
    session = create_session(stub, theirs, workspace_write())
    sessions.append(session.id)
    out = run_exec(stub, session.id, ["sh", "-c", "id -u; touch made"])
    assert out.stdout.decode().split() == [str(user.uid)], out.describe()
    assert os.stat(theirs / "made").st_uid == user.uid
    for policy in (read_only(),):
        other = create_session(stub, theirs, policy)
        sessions.append(other.id)
        assert run_exec(stub, other.id, ["id", "-u"]).stdout.decode().strip() == str(user.uid)
    mine = owned_dir(daemon.base, 0, 0)                       # root's own workspace: still uid 0
    own = create_session(stub, mine, workspace_write())
    sessions.append(own.id)
    assert run_exec(stub, own.id, ["id", "-u"]).stdout.decode().strip() == "0"
    danger = create_session(stub, theirs, pb.SandboxPolicy(mode=pb.SandboxPolicy.DANGER_FULL_ACCESS))
    sessions.append(danger.id)                                # unchanged: root's own uid
    assert run_exec(stub, danger.id, ["id", "-u"]).stdout.decode().strip() == "0"


# --------------------------------------------------------------------------- standing rules


ADD_RULE_CLIENT = r'''
rule = stub.AddStandingRule(pb.StandingRule(workspace=ARGS["ws"], tool="fs.list"))
listed = [(r.workspace, r.tool, r.owner_uid) for r in stub.ListStandingRules(pb.ListStandingRulesRequest()).rules]
print(json.dumps({"owner": rule.owner_uid, "listed": listed}))
'''

# A's session (ALWAYS asks) on the shared workspace: is a ListDir held for A, or answered by a rule?
ASK_CLIENT = r'''
import threading, time
session = stub.CreateSession(pb.CreateSessionRequest(workspace=ARGS["ws"], approval_policy=pb.ALWAYS,
    sandbox_policy=pb.SandboxPolicy(mode=pb.SandboxPolicy.WORKSPACE_WRITE)))
res = {}

def listdir():
    res["list"] = code(lambda: stub.ListDir(pb.ListDirRequest(session_id=session.id), timeout=60))

def held():
    reader = threading.Thread(target=listdir)
    reader.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and "list" not in res:
        pending = stub.ListPendingApprovals(pb.ListPendingApprovalsRequest(session_id=session.id)).approvals
        if pending:
            stub.ResolveApproval(pb.ResolveApprovalRequest(session_id=session.id, call_id=pending[0].call_id,
                                                           decision="deny"))
            reader.join()
            return True
        time.sleep(0.05)
    reader.join()
    return False

def granted_by():
    events = stub.QueryEvents(pb.QueryEventsRequest(session_id=session.id, types=["PermissionGranted"])).events
    return json.loads(events[-1].data_json)["by"] if events else None

res["asked_with_b_rule"] = held()
res["list_with_b_rule"] = res.pop("list")
res["a_sees"] = [(r.workspace, r.tool) for r in stub.ListStandingRules(pb.ListStandingRulesRequest()).rules]
res["a_removes_b_rule"] = code(lambda: stub.RemoveStandingRule(pb.StandingRule(
    workspace=ARGS["ws"], tool="fs.list", owner_uid=ARGS["b_uid"])))
res["a_removes_own_missing"] = stub.RemoveStandingRule(pb.StandingRule(workspace=ARGS["ws"], tool="fs.list")).removed
res["a_adds_for_b"] = code(lambda: stub.AddStandingRule(pb.StandingRule(
    workspace=ARGS["ws"], tool="fs.list", owner_uid=ARGS["b_uid"])))
stub.AddStandingRule(pb.StandingRule(workspace=ARGS["ws"], tool="fs.list"))
res["asked_with_own_rule"] = held()
res["list_with_own_rule"] = res.pop("list")
res["granted_by"] = granted_by()
stub.CloseSession(pb.CloseSessionRequest(session_id=session.id))
print(json.dumps(res))
'''


def test_standing_rules_belong_to_their_maker(daemon: Daemon, users: list[PlainUser]) -> None:
    a, b = users
    stub = daemon.stub
    shared = owned_dir(daemon.base, 0, 0, mode=0o777)        # both may write it
    added = run_client_as(b.uid, b.gid, daemon.socket, ADD_RULE_CLIENT, {"ws": str(shared)})
    assert added["owner"] == b.uid and added["listed"] == [[str(shared), "fs.list", b.uid]], added

    res = run_client_as(a.uid, a.gid, daemon.socket, ASK_CLIENT, {"ws": str(shared), "b_uid": b.uid})
    # B's rule does not answer for A: A is asked (and the denied call fails).
    assert res["asked_with_b_rule"] is True and res["list_with_b_rule"] == "PERMISSION_DENIED", res
    assert res["a_sees"] == [], res                            # B's rule is not A's to see
    assert res["a_removes_b_rule"] == "PERMISSION_DENIED", res
    assert res["a_removes_own_missing"] is False, res
    assert res["a_adds_for_b"] == "INVALID_ARGUMENT", res
    # A's own rule answers for A.
    assert res["asked_with_own_rule"] is False and res["list_with_own_rule"] == "OK", res
    assert res["granted_by"] == "workspace_rule", res

    # B still has its rule and sees only its own; root (an administrator) sees both, with owners.
    again = run_client_as(b.uid, b.gid, daemon.socket, ADD_RULE_CLIENT, {"ws": str(shared)})
    assert again["listed"] == [[str(shared), "fs.list", b.uid]], again
    everyone = {(r.workspace, r.tool, r.owner_uid) for r in
                stub.ListStandingRules(pb.ListStandingRulesRequest(workspace=str(shared))).rules}
    assert everyone == {(str(shared), "fs.list", a.uid), (str(shared), "fs.list", b.uid)}
    # Root removes B's by naming its owner; A's stays.
    assert stub.RemoveStandingRule(pb.StandingRule(workspace=str(shared), tool="fs.list", owner_uid=b.uid)).removed
    left = [(r.tool, r.owner_uid) for r in
            stub.ListStandingRules(pb.ListStandingRulesRequest(workspace=str(shared))).rules]
    assert left == [("fs.list", a.uid)]


def test_rules_from_an_older_store_keep_their_owner(daemon: Daemon) -> None:
    rules = [(r.workspace, r.tool, r.owner_uid) for r in daemon.stub.ListStandingRules(
        pb.ListStandingRulesRequest(workspace="/old/workspace")).rules]
    assert rules == [("/old/workspace", "fs.read", OLD_RULE_UID)]


# --------------------------------------------------------------------------- the store's files


def test_store_files_are_private_after_serving(daemon: Daemon, sessions: list[str]) -> None:
    ws = owned_dir(daemon.base, 0, 0)
    session = create_session(daemon.stub, ws, workspace_write())
    sessions.append(session.id)
    assert run_exec(daemon.stub, session.id, ["true"]).result.exit_code == 0
    state = daemon.base / "state"
    assert stat.S_IMODE(os.stat(state).st_mode) == 0o700
    for name in ("events.db", "events.db-wal", "events.db-shm"):
        st = os.stat(state / name)
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == 0, (name, oct(st.st_mode))


def test_a_new_store_is_private_from_its_first_write(tmp_path: Path) -> None:
    from sandboxd.audit.store import EventStore

    previous = os.umask(0o022)                         # the usual umask: sqlite would make 0644 files
    try:
        store = EventStore(str(tmp_path / "s" / "events.db"))
        store.append("s1", "SessionCreated", data={"argv": ["secret"]})
        modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "s").iterdir()}
        store.close()
    finally:
        os.umask(previous)
    assert modes == {"events.db": 0o600, "events.db-wal": 0o600, "events.db-shm": 0o600}, modes


def test_a_state_directory_of_another_user_is_refused(users: list[PlainUser]) -> None:
    """Its owner could swap the audit log under the daemon: the daemon refuses to start and says why."""
    with daemon_factory("sbxt-setid-s-") as factory:
        state = factory.base / "state"
        state.mkdir(mode=0o700)
        os.chown(state, users[0].uid, users[0].gid)
        failure = factory.start_failure()
        assert failure.returncode != 0 and "chown it or use another --state-dir" in failure.log, failure.log
        assert not (state / "events.db").exists()
