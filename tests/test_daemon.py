"""End to end: the ``sandboxd serve`` daemon, driven over gRPC on its Unix socket.

One daemon per module (tests that kill a daemon start their own), real
sessions, real commands in real kernel sandboxes, and the host inspected from
outside afterwards (/proc, mountinfo, cgroupfs). Helpers: tests/daemon_helpers.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import stat
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from conftest import BASE_ENV, PY, kill_marked, make_dir, pids_with_marker, wait_until_gone
from daemon_helpers import (
    PYTHON,
    Daemon,
    ExecCall,
    close_quietly,
    create_session,
    descendants,
    exec_start,
    fd_count,
    kill_procs,
    mount_count,
    proc_info,
    read_only,
    remove_tree,
    running_daemon,
    rpc_error,
    run_client_as,
    run_exec,
    sandbox_cgroups,
    survivors,
    workspace_write,
)
from daemon_fixtures import daemon, stub, ws  # noqa: F401 - pytest fixtures
from sandboxd.v1 import sandboxd_pb2 as pb
from sandboxd.v1 import sandboxd_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(240)

NOBODY = 65534

# Prints the errno name of a failed append to argv[1], or WROTE.
TRY_WRITE = ("import errno, sys\n"
             "try:\n"
             "    open(sys.argv[1], 'a').write('x')\n"
             "    print('WROTE')\n"
             "except OSError as e:\n"
             "    print(errno.errorcode[e.errno])\n")
DENIED = ("EROFS", "EACCES", "EPERM")


# --------------------------------------------------------------------------- fixtures


@pytest.fixture
def outside(daemon: Daemon) -> Iterator[Path]:
    """A 0777 directory outside every writable root with a 0666 target.txt: only the sandbox can stop a write."""
    path = make_dir(daemon.base / f"outside-{uuid.uuid4().hex[:8]}", 0o777)
    (path / "target.txt").write_text("original\n")
    os.chmod(path / "target.txt", 0o666)
    try:
        yield path
    finally:
        remove_tree(path)


@pytest.fixture
def sessions(stub: pb_grpc.SandboxStub) -> Iterator[list[str]]:
    """Session ids to close at the end of the test (whatever happened)."""
    ids: list[str] = []
    try:
        yield ids
    finally:
        for session_id in ids:
            close_quietly(stub, session_id)


@pytest.fixture
def session(stub: pb_grpc.SandboxStub, ws: Path, sessions: list[str]) -> pb.Session:
    """A WORKSPACE_WRITE session (no network) on ``ws``."""
    s = create_session(stub, ws, workspace_write())
    sessions.append(s.id)
    return s


@pytest.fixture
def sleep_marker() -> Iterator[str]:
    """A unique extra `sleep` operand (sleep sums them): `sleep 300 MARKER` is findable on the host."""
    marker = f"0.{uuid.uuid4().int % 10**15:015d}1"
    try:
        yield marker
    finally:
        kill_marked(marker)


def wait_marker_appears(marker: str, within: float = 30.0) -> list[int]:
    deadline = time.monotonic() + within
    while True:
        found = pids_with_marker(marker)
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.02)


def sleepers(marker: str) -> list[int]:
    """The host pids of `sleep ... MARKER` processes (not of shells whose script mentions it)."""
    found = []
    for pid in pids_with_marker(marker):
        info = proc_info(pid)
        if info is not None and info.cmdline.split(b"\0")[0] in (b"sleep", b"/usr/bin/sleep", b"/bin/sleep"):
            found.append(pid)
    return found


def poll(predicate, within: float = 10.0, step: float = 0.05) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + within
    while True:
        if predicate():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(step)


def sh(stub: pb_grpc.SandboxStub, session_id: str, script: str, **kwargs):  # type: ignore[no-untyped-def]
    return run_exec(stub, session_id, shell=script, **kwargs)


def try_write(stub: pb_grpc.SandboxStub, session_id: str, path: Path | str) -> str:
    outcome = run_exec(stub, session_id, [PY, "-c", TRY_WRITE, str(path)])
    assert outcome.result is not None and outcome.result.exit_code == 0, outcome.describe()
    return outcome.stdout.decode().strip()


# --------------------------------------------------------------------------- the server itself


def test_serving_log_health_and_reflection(daemon: Daemon) -> None:
    first = daemon.log_lines()[0]
    assert first["msg"] == "serving" and first["socket"] == daemon.socket and first["pid"] == daemon.pid, first
    assert stat.S_ISSOCK(os.stat(daemon.socket).st_mode)
    assert stat.S_IMODE(os.stat(daemon.socket).st_mode) == 0o666     # every local user may connect
    assert stat.S_IMODE(os.stat(daemon.private).st_mode) == 0o700

    channel = daemon.channel()
    health = health_pb2_grpc.HealthStub(channel)
    assert health.Check(health_pb2.HealthCheckRequest(service="")).status == health_pb2.HealthCheckResponse.SERVING
    assert health.Check(health_pb2.HealthCheckRequest(service="sandboxd.v1.Sandbox")).status \
        == health_pb2.HealthCheckResponse.SERVING

    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    replies = list(reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    names = {s.name for s in replies[0].list_services_response.service}
    assert "sandboxd.v1.Sandbox" in names and "grpc.health.v1.Health" in names, names


# --------------------------------------------------------------------------- sessions


def test_session_lifecycle(stub: pb_grpc.SandboxStub, ws: Path, sessions: list[str]) -> None:
    before = time.time()
    s = create_session(stub, ws, workspace_write(), approval_policy=pb.NEVER,
                       limits=pb.Limits(timeout_seconds=30, pids=100), labels={"team": "e2e", "n": "1"})
    sessions.append(s.id)
    assert s.id and s.owner_uid == 0 and s.owner_gid == 0
    assert s.workspace == str(ws) and s.sandbox_generation == 1 and s.running_calls == 0
    assert s.sandbox_policy.mode == pb.SandboxPolicy.WORKSPACE_WRITE and not s.sandbox_policy.network_access
    assert s.approval_policy == pb.NEVER
    assert s.limits.timeout_seconds == 30 and s.limits.pids == 100
    assert dict(s.labels) == {"team": "e2e", "n": "1"}
    assert before - 1 <= s.created_at <= time.time() + 1

    got = stub.GetSession(pb.GetSessionRequest(session_id=s.id))
    assert got == s
    other = create_session(stub, ws, read_only())
    sessions.append(other.id)
    assert other.id != s.id
    listed = {x.id: x for x in stub.ListSessions(pb.ListSessionsRequest()).sessions}
    assert {s.id, other.id} <= set(listed)
    assert listed[other.id].sandbox_policy.mode == pb.SandboxPolicy.READ_ONLY

    stub.CloseSession(pb.CloseSessionRequest(session_id=s.id))
    assert rpc_error(lambda: stub.GetSession(pb.GetSessionRequest(session_id=s.id))).code() \
        == grpc.StatusCode.NOT_FOUND
    assert rpc_error(lambda: stub.CloseSession(pb.CloseSessionRequest(session_id=s.id))).code() \
        == grpc.StatusCode.NOT_FOUND
    assert rpc_error(lambda: run_exec(stub, s.id, ["true"])).code() == grpc.StatusCode.NOT_FOUND
    ids = {x.id for x in stub.ListSessions(pb.ListSessionsRequest()).sessions}
    assert s.id not in ids and other.id in ids


def test_workspace_is_resolved(stub: pb_grpc.SandboxStub, ws: Path, sessions: list[str]) -> None:
    link = ws.parent / f"{ws.name}-link"
    link.symlink_to(ws)
    try:
        s = create_session(stub, link)
        sessions.append(s.id)
        assert s.workspace == str(ws)
        assert s.sandbox_policy.mode == pb.SandboxPolicy.WORKSPACE_WRITE   # MODE_UNSPECIFIED is the default
        out = run_exec(stub, s.id, ["pwd"])
        assert out.stdout.decode().strip() == str(ws), out.describe()
    finally:
        link.unlink()


@pytest.mark.parametrize("case", ["relative", "missing", "not-a-directory", "root-writable",
                                  "writable-root-missing", "writable-root-relative"])
def test_invalid_create_requests(stub: pb_grpc.SandboxStub, ws: Path, case: str) -> None:
    (ws / "file").write_text("x")
    workspace, policy, mention = {
        "relative": ("some/dir", workspace_write(), "some/dir"),
        "missing": (str(ws / "nope"), workspace_write(), str(ws / "nope")),
        "not-a-directory": (str(ws / "file"), workspace_write(), str(ws / "file")),
        "root-writable": ("/", workspace_write(), "'/'"),
        "writable-root-missing": (str(ws), workspace_write(writable_roots=[str(ws / "gone")]), str(ws / "gone")),
        "writable-root-relative": (str(ws), workspace_write(writable_roots=["rel/root"]), "rel/root"),
    }[case]
    before = {s.id for s in stub.ListSessions(pb.ListSessionsRequest()).sessions}
    error = rpc_error(lambda: create_session(stub, workspace, policy))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (error.code(), error.details())
    assert mention in error.details(), error.details()
    assert "Traceback" not in error.details()
    assert {s.id for s in stub.ListSessions(pb.ListSessionsRequest()).sessions} == before


def test_read_only_session_on_root_runs_or_is_refused_clearly(stub: pb_grpc.SandboxStub,
                                                              sessions: list[str]) -> None:
    """A READ_ONLY session on / writes nothing: either it works, or it is refused as bad input
    (INVALID_ARGUMENT) - not a kernel failure about /proc/self/mem."""
    try:
        s = create_session(stub, "/", read_only())
    except grpc.RpcError as error:
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (error.code(), error.details())
        return
    sessions.append(s.id)
    out = run_exec(stub, s.id, ["readlink", "/proc/self/ns/pid"])
    assert out.result.exit_code == 0, out.describe()
    assert out.stdout.decode().strip() != os.readlink("/proc/self/ns/pid")   # its own /proc, not the host's


def test_unknown_session_is_not_found(stub: pb_grpc.SandboxStub) -> None:
    sid = "0123456789abcdef"
    calls = {
        "get": lambda: stub.GetSession(pb.GetSessionRequest(session_id=sid)),
        "close": lambda: stub.CloseSession(pb.CloseSessionRequest(session_id=sid)),
        "update": lambda: stub.UpdateSessionPolicy(pb.UpdateSessionPolicyRequest(session_id=sid,
                                                                                 approval_policy=pb.NEVER)),
        "exec": lambda: run_exec(stub, sid, ["true"]),
    }
    for name, call in calls.items():
        error = rpc_error(call)
        assert error.code() == grpc.StatusCode.NOT_FOUND, (name, error.code(), error.details())


# --------------------------------------------------------------------------- exec basics


def test_exec_stream_order_and_result(stub: pb_grpc.SandboxStub, session: pb.Session) -> None:
    # Each piece is written only after the client saw the previous one, so the order is the command's.
    script = "echo one; read a; echo two >&2; read b; echo three; exit 3"
    with ExecCall(stub, exec_start(session.id, shell=script)) as call:
        call.wait_stdout(b"one\n")
        call.send_stdin(b"\n")
        assert call.wait_for(lambda o: o.stderr == b"two\n"), call.outcome.describe()
        call.send_stdin(b"\n")
        out = call.finish()
    kinds = out.kinds
    assert kinds[0] == "started_pid" and kinds[-1] == "result", kinds
    assert kinds.count("started_pid") == 1 and kinds.count("result") == 1, kinds
    assert out.started_pid is not None and out.started_pid >= 2      # pid 1 is the session's init
    assert [(k, getattr(r, k)) for r, k in zip(out.responses, kinds) if k in ("stdout", "stderr")] == [
        ("stdout", b"one\n"), ("stderr", b"two\n"), ("stdout", b"three\n")]
    result = out.result
    assert result.exit_code == 3 and result.shell_status == 3 and result.signal == 0
    assert not result.timed_out and not result.output_truncated
    assert result.wall_seconds > 0


def test_exec_output_chunks_arrive_in_order(stub: pb_grpc.SandboxStub, session: pb.Session) -> None:
    out = sh(stub, session.id, "seq 1 300000; seq 1 100000 >&2")
    assert out.stdout == "".join(f"{i}\n" for i in range(1, 300001)).encode()
    assert out.stderr == "".join(f"{i}\n" for i in range(1, 100001)).encode()
    assert out.kinds.count("stdout") > 1                              # it really came in several chunks
    assert out.result.exit_code == 0


def test_exec_reports_cpu_and_memory(stub: pb_grpc.SandboxStub, session: pb.Session) -> None:
    code = ("import time\nb = bytearray(100 << 20)\nfor i in range(0, len(b), 4096): b[i] = 1\n"
            "t = time.process_time()\nwhile time.process_time() - t < 0.3: pass\nprint('done')")
    out = run_exec(stub, session.id, [PY, "-c", code])
    assert out.stdout == b"done\n" and out.result.exit_code == 0, out.describe()
    assert out.result.cpu_seconds >= 0.25, out.result
    assert out.result.peak_memory_bytes >= 100 << 20, out.result


def test_exec_first_request_must_be_start(stub: pb_grpc.SandboxStub, session: pb.Session) -> None:
    for requests in ([pb.ExecRequest(stdin=b"data")], [pb.ExecRequest(signal=15)], []):
        error = rpc_error(lambda: list(stub.Exec(iter(requests), timeout=60)))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (requests, error.code(), error.details())
        assert "start" in error.details(), error.details()


def test_exec_needs_exactly_one_of_argv_and_shell(stub: pb_grpc.SandboxStub, session: pb.Session) -> None:
    for start in (exec_start(session.id), exec_start(session.id, ["echo", "x"], "echo y")):
        error = rpc_error(lambda: list(stub.Exec(iter([pb.ExecRequest(start=start)]), timeout=60)))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (error.code(), error.details())


def test_exec_missing_program(stub: pb_grpc.SandboxStub, session: pb.Session) -> None:
    error = rpc_error(lambda: run_exec(stub, session.id, ["no-such-program-xyz"]))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION, (error.code(), error.details())
    assert "exec" in error.details() and "ENOENT" in error.details(), error.details()
    # The session is still usable afterwards.
    assert run_exec(stub, session.id, ["true"]).result.exit_code == 0


def test_exec_cwd(stub: pb_grpc.SandboxStub, session: pb.Session, ws: Path) -> None:
    make_dir(ws / "sub" / "dir")
    out = run_exec(stub, session.id, ["pwd"], cwd=str(ws / "sub" / "dir"))
    assert out.stdout.decode().strip() == str(ws / "sub" / "dir"), out.describe()
    assert run_exec(stub, session.id, ["pwd"]).stdout.decode().strip() == str(ws)
    for bad in ("/etc", "sub/dir", str(ws / ".." / "elsewhere"), str(ws.parent)):
        error = rpc_error(lambda: run_exec(stub, session.id, ["pwd"], cwd=bad))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (bad, error.code(), error.details())
        assert "cwd" in error.details(), error.details()


def test_exec_environment(stub: pb_grpc.SandboxStub, session: pb.Session) -> None:
    default = run_exec(stub, session.id, ["/usr/bin/env"])
    keys = {line.split("=", 1)[0] for line in default.stdout.decode().splitlines()}
    assert keys == {"PATH", "HOME", "LANG", "TERM"}, default.describe()     # service.environment's defaults
    given = run_exec(stub, session.id, ["/usr/bin/env"], env={"FOO": "bar baz", "PATH": "/usr/bin:/bin"})
    assert sorted(given.stdout.decode().splitlines()) == ["FOO=bar baz", "PATH=/usr/bin:/bin"], given.describe()


# --------------------------------------------------------------------------- persistence


def test_tmp_persists_within_a_session_only(stub: pb_grpc.SandboxStub, ws: Path, sessions: list[str]) -> None:
    token = uuid.uuid4().hex
    first = create_session(stub, ws)
    sessions.append(first.id)
    assert sh(stub, first.id, f"echo {token} > /tmp/persist.txt").result.exit_code == 0
    again = run_exec(stub, first.id, ["cat", "/tmp/persist.txt"])
    assert again.result.exit_code == 0 and again.stdout.decode().strip() == token, again.describe()
    assert not os.path.exists("/tmp/persist.txt") or token not in Path("/tmp/persist.txt").read_text()

    second = create_session(stub, ws)
    sessions.append(second.id)
    assert run_exec(stub, second.id, ["cat", "/tmp/persist.txt"]).result.exit_code != 0

    stub.CloseSession(pb.CloseSessionRequest(session_id=first.id))
    third = create_session(stub, ws)
    sessions.append(third.id)
    gone = run_exec(stub, third.id, ["cat", "/tmp/persist.txt"])
    assert gone.result.exit_code != 0 and token.encode() not in gone.stdout, gone.describe()


# --------------------------------------------------------------------------- enforcement


def test_workspace_write_enforcement(stub: pb_grpc.SandboxStub, session: pb.Session, ws: Path,
                                     outside: Path) -> None:
    assert try_write(stub, session.id, ws / "made-inside.txt") == "WROTE"
    assert (ws / "made-inside.txt").read_text() == "x"
    for target in (outside / "target.txt", outside / "new.txt", "/etc/sbx-test-should-not-exist"):
        assert try_write(stub, session.id, target) in DENIED, target
    assert (outside / "target.txt").read_text() == "original\n"
    assert not (outside / "new.txt").exists()
    assert not os.path.exists("/etc/sbx-test-should-not-exist")


def test_read_only_session(stub: pb_grpc.SandboxStub, ws: Path, sessions: list[str]) -> None:
    s = create_session(stub, ws, read_only())
    sessions.append(s.id)
    assert try_write(stub, s.id, ws / "nope.txt") in DENIED
    assert not (ws / "nope.txt").exists()
    assert try_write(stub, s.id, "/tmp/scratch.txt") == "WROTE"        # its private /tmp stays writable


def test_process_hardening_and_isolation(stub: pb_grpc.SandboxStub, session: pb.Session,
                                         sleep_marker: str) -> None:
    host = subprocess.Popen(["sleep", "300", sleep_marker])
    try:
        status = run_exec(stub, session.id, ["cat", "/proc/self/status"]).stdout.decode()
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        for cap in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
            assert int(fields[cap].strip(), 16) == 0, (cap, fields[cap])
        assert fields["NoNewPrivs"].strip() == "1" and fields["Seccomp"].strip() == "2"

        links = run_exec(stub, session.id, ["ip", "-o", "link"])
        names = [line.split(":")[1].strip() for line in links.stdout.decode().splitlines()]
        assert names == ["lo"], links.describe()

        listing = run_exec(stub, session.id, [PY, "-c", (
            "import json, os\nout = {}\nfor p in os.listdir('/proc'):\n    if p.isdigit():\n"
            "        try: out[p] = open(f'/proc/{p}/cmdline', 'rb').read().decode(errors='replace')\n"
            "        except OSError: pass\nprint(json.dumps(out))")])
        seen = json.loads(listing.stdout)
        assert any("import json" in cmd for cmd in seen.values()), seen     # it does see itself
        assert not any(sleep_marker in cmd for cmd in seen.values()), seen
        assert str(host.pid) not in seen or sleep_marker not in seen[str(host.pid)]
    finally:
        host.kill()
        host.wait()


def test_network_access_is_the_hosts_only_when_asked(stub: pb_grpc.SandboxStub, ws: Path,
                                                     sessions: list[str]) -> None:
    host_ns = os.readlink("/proc/self/ns/net")
    without = create_session(stub, ws, workspace_write())
    isolated = create_session(stub, ws, workspace_write(network_access=True))
    host = create_session(stub, ws, workspace_write(network_access=True, network_mode="host"))
    sessions.extend([without.id, isolated.id, host.id])
    assert isolated.sandbox_policy.network_access and isolated.sandbox_policy.network_mode == "isolated"
    assert host.sandbox_policy.network_mode == "host"
    netns_of = {s.id: run_exec(stub, s.id, ["readlink", "/proc/self/ns/net"]).stdout.decode().strip()
                for s in (without, isolated, host)}
    assert netns_of[without.id] != host_ns and netns_of[isolated.id] != host_ns and netns_of[host.id] == host_ns
    # The isolated one has a way out (eth0 with a default route); the other has only loopback.
    routes = run_exec(stub, isolated.id, ["cat", "/proc/net/route"]).stdout.decode()
    assert "eth0\t00000000" in routes
    assert run_exec(stub, without.id, ["cat", "/proc/net/route"]).stdout.decode().count("\n") <= 1


def test_writable_roots_and_protected_subpaths(stub: pb_grpc.SandboxStub, ws: Path, outside: Path,
                                               sessions: list[str]) -> None:
    extra = make_dir(outside / "extra", 0o777)
    make_dir(ws / ".git" / "hooks")
    make_dir(ws / "secret")
    default = create_session(stub, ws, workspace_write(writable_roots=[str(extra)]))
    sessions.append(default.id)
    assert str(extra) in default.sandbox_policy.writable_roots
    assert try_write(stub, default.id, extra / "ok.txt") == "WROTE"
    assert (extra / "ok.txt").exists()
    assert try_write(stub, default.id, ws / ".git" / "hooks" / "pre-commit") in DENIED
    assert try_write(stub, default.id, ws / "secret" / "a") == "WROTE"

    custom = create_session(stub, ws, workspace_write(protected_subpaths=["secret"],
                                                      no_default_protected_subpaths=True))
    sessions.append(custom.id)
    assert list(custom.sandbox_policy.protected_subpaths) == ["secret"]
    assert try_write(stub, custom.id, ws / "secret" / "b") in DENIED
    assert try_write(stub, custom.id, ws / ".git" / "hooks" / "pre-commit") == "WROTE"
    assert not (ws / "secret" / "b").exists()


def test_session_memory_limit(stub: pb_grpc.SandboxStub, ws: Path, sessions: list[str]) -> None:
    s = create_session(stub, ws, limits=pb.Limits(memory_bytes=64 << 20))
    sessions.append(s.id)
    out = run_exec(stub, s.id, [PY, "-c", "b = bytearray(256 << 20)\nprint('allocated')"])
    assert b"allocated" not in out.stdout and out.result.shell_status != 0, out.describe()
    assert run_exec(stub, s.id, ["true"]).result.exit_code == 0                 # the session survives


# --------------------------------------------------------------------------- ending calls


BACKGROUND = "(setsid sleep 300 {m} > /dev/null 2>&1 &); echo ready"


def test_timeout_kills_the_whole_tree(stub: pb_grpc.SandboxStub, session: pb.Session, sleep_marker: str) -> None:
    script = BACKGROUND.format(m=sleep_marker) + f"; sleep 300 {sleep_marker}"
    with ExecCall(stub, exec_start(session.id, shell=script, timeout_seconds=2)) as call:
        call.wait_stdout(b"ready")
        assert wait_marker_appears(sleep_marker), "the background sleep never showed up on the host"
        out = call.finish()
    result = out.result
    assert result.timed_out and result.shell_status == 124, out.describe()
    assert result.wall_seconds >= 1.5
    assert wait_until_gone(sleep_marker, within=10) == []


def test_session_timeout_limit_applies(stub: pb_grpc.SandboxStub, ws: Path, sessions: list[str]) -> None:
    s = create_session(stub, ws, limits=pb.Limits(timeout_seconds=1))
    sessions.append(s.id)
    out = run_exec(stub, s.id, ["sleep", "300"])
    assert out.result.timed_out and out.result.shell_status == 124, out.describe()
    longer = run_exec(stub, s.id, ["sh", "-c", "sleep 1.5; echo finished"], timeout_seconds=60)  # per-call override
    assert not longer.result.timed_out and longer.stdout == b"finished\n", longer.describe()


def test_normal_exit_kills_leftovers(stub: pb_grpc.SandboxStub, session: pb.Session, sleep_marker: str) -> None:
    with ExecCall(stub, exec_start(session.id, shell=BACKGROUND.format(m=sleep_marker) + "; read go")) as call:
        call.wait_stdout(b"ready")
        assert wait_marker_appears(sleep_marker), "the background sleep never showed up on the host"
        call.send_stdin(b"go\n")
        out = call.finish()
    assert out.result.exit_code == 0 and not out.result.timed_out, out.describe()
    assert wait_until_gone(sleep_marker, within=10) == []


def test_cancel_kills_the_whole_tree(stub: pb_grpc.SandboxStub, session: pb.Session, sleep_marker: str) -> None:
    script = BACKGROUND.format(m=sleep_marker) + f"; sleep 300 {sleep_marker}"
    with ExecCall(stub, exec_start(session.id, shell=script)) as call:
        call.wait_stdout(b"ready")
        assert wait_marker_appears(sleep_marker)
        assert poll(lambda: len(sleepers(sleep_marker)) == 2, within=10), sleepers(sleep_marker)  # bg and fg
        call.cancel()
        with pytest.raises(grpc.RpcError) as raised:
            call.finish()
        assert raised.value.code() == grpc.StatusCode.CANCELLED
    assert wait_until_gone(sleep_marker, within=10) == []
    assert poll(lambda: stub.GetSession(pb.GetSessionRequest(session_id=session.id)).running_calls == 0)
    assert run_exec(stub, session.id, ["echo", "alive"]).stdout == b"alive\n"


CLIENT_THEN_BLOCK = r'''
import os, sys, time
import grpc
from sandboxd.v1 import sandboxd_pb2 as pb, sandboxd_pb2_grpc as pb_grpc
stub = pb_grpc.SandboxStub(grpc.insecure_channel("unix:" + sys.argv[1]))
start = pb.ExecStart(session_id=sys.argv[2], argv=["sleep", "300", os.environ["MARK"]])
def requests():
    yield pb.ExecRequest(start=start)
    time.sleep(3600)
for response in stub.Exec(requests()):
    if response.WhichOneof("kind") == "started_pid":
        print("started", flush=True)
'''


def test_client_disconnect_kills_the_tree(daemon: Daemon, stub: pb_grpc.SandboxStub, session: pb.Session,
                                          sleep_marker: str) -> None:
    client = subprocess.Popen([PYTHON, "-c", CLIENT_THEN_BLOCK, daemon.socket, session.id],
                              stdout=subprocess.PIPE, env={**BASE_ENV, "MARK": sleep_marker})
    try:
        assert client.stdout is not None
        assert client.stdout.readline() == b"started\n"
        assert wait_marker_appears(sleep_marker)
        client.kill()
        client.wait()
        assert wait_until_gone(sleep_marker, within=10) == []
        assert poll(lambda: stub.GetSession(pb.GetSessionRequest(session_id=session.id)).running_calls == 0)
    finally:
        client.kill()
        client.wait()


def test_signal_kills_the_command(stub: pb_grpc.SandboxStub, session: pb.Session, sleep_marker: str) -> None:
    with ExecCall(stub, exec_start(session.id, ["sleep", "300", sleep_marker])) as call:
        call.wait_started()
        assert wait_marker_appears(sleep_marker)
        call.send_signal(signal.SIGTERM)
        out = call.finish()
    assert out.result.signal == signal.SIGTERM and out.result.shell_status == 128 + signal.SIGTERM, out.describe()
    assert not out.result.timed_out
    assert wait_until_gone(sleep_marker, within=10) == []


def test_signal_reaches_the_command_s_handler(stub: pb_grpc.SandboxStub, session: pb.Session) -> None:
    script = "trap 'echo got-term; exit 7' TERM; echo ready; while :; do sleep 0.1; done"
    with ExecCall(stub, exec_start(session.id, shell=script)) as call:
        call.wait_stdout(b"ready")
        call.send_signal(signal.SIGTERM)
        out = call.finish()
    assert out.result.exit_code == 7 and out.result.signal == 0 and out.result.shell_status == 7, out.describe()
    assert b"got-term" in out.stdout


# --------------------------------------------------------------------------- stdin and output


def test_stdin_streams_interactively(stub: pb_grpc.SandboxStub, session: pb.Session) -> None:
    with ExecCall(stub, exec_start(session.id, ["cat"])) as call:
        call.wait_started()
        call.send_stdin(b"hello\n")
        call.wait_stdout(b"hello\n", within=30)
        call.send_stdin(b"world\n")
        call.wait_stdout(b"hello\nworld\n", within=30)
        assert not call.done                        # cat is still waiting for more
        call.close_stdin()
        out = call.finish()
    assert out.stdout == b"hello\nworld\n" and out.result.exit_code == 0, out.describe()


def test_initial_stdin_and_close(stub: pb_grpc.SandboxStub, session: pb.Session) -> None:
    data = os.urandom(300_000)
    with ExecCall(stub, exec_start(session.id, ["sha256sum"], stdin=data, close_stdin=True)) as call:
        out = call.finish()                         # ends although the request stream is still open
    assert out.stdout.split()[0].decode() == hashlib.sha256(data).hexdigest(), out.describe()
    assert out.result.exit_code == 0


def test_output_limit(stub: pb_grpc.SandboxStub, session: pb.Session) -> None:
    out = sh(stub, session.id, "head -c 1000000 /dev/zero; head -c 1000000 /dev/zero >&2; echo end >&2",
             output_limit_bytes=1000)
    assert len(out.stdout) + len(out.stderr) <= 1000, (len(out.stdout), len(out.stderr))
    assert len(out.stdout) + len(out.stderr) > 0
    assert out.result.output_truncated and out.result.exit_code == 0, out.describe()

    small = sh(stub, session.id, "head -c 500 /dev/zero", output_limit_bytes=1000)
    assert len(small.stdout) == 500 and not small.result.output_truncated


def test_large_output_streams_completely(stub: pb_grpc.SandboxStub, session: pb.Session) -> None:
    size = 100_000_000
    started = time.monotonic()
    received = 0
    result = None
    for response in stub.Exec(iter([pb.ExecRequest(start=exec_start(
            session.id, ["head", "-c", str(size), "/dev/zero"], output_limit_bytes=2 * size))]), timeout=180):
        kind = response.WhichOneof("kind")
        if kind == "stdout":
            received += len(response.stdout)
        elif kind == "result":
            result = response.result
    seconds = time.monotonic() - started
    print(f"\n100 MB through Exec: {seconds:.2f} s, {size / seconds / 1e6:.1f} MB/s")
    assert received == size
    assert result is not None and result.exit_code == 0 and not result.output_truncated, result


def test_concurrent_calls_in_one_session(stub: pb_grpc.SandboxStub, session: pb.Session) -> None:
    with ExecCall(stub, exec_start(session.id, shell="read x; echo A$x")) as waiting:
        waiting.wait_started()
        assert stub.GetSession(pb.GetSessionRequest(session_id=session.id)).running_calls == 1
        other = run_exec(stub, session.id, ["echo", "B"])        # not queued behind the first call
        assert other.stdout == b"B\n" and other.result.exit_code == 0
        assert not waiting.done
        waiting.send_stdin(b"1\n")
        out = waiting.finish()
    assert out.stdout == b"A1\n", out.describe()
    assert poll(lambda: stub.GetSession(pb.GetSessionRequest(session_id=session.id)).running_calls == 0)


# --------------------------------------------------------------------------- policy updates


def update(stub: pb_grpc.SandboxStub, session_id: str, policy: pb.SandboxPolicy | None = None,
           approval: int = pb.APPROVAL_POLICY_UNSPECIFIED) -> pb.Session:
    request = pb.UpdateSessionPolicyRequest(session_id=session_id, approval_policy=approval)
    if policy is not None:
        request.sandbox_policy.CopyFrom(policy)
    return stub.UpdateSessionPolicy(request)


def test_update_sandbox_policy(stub: pb_grpc.SandboxStub, session: pb.Session, ws: Path) -> None:
    assert try_write(stub, session.id, ws / "a.txt") == "WROTE"
    ro = update(stub, session.id, read_only())
    assert ro.sandbox_generation == 2 and ro.sandbox_policy.mode == pb.SandboxPolicy.READ_ONLY
    assert try_write(stub, session.id, ws / "b.txt") in DENIED
    assert not (ws / "b.txt").exists()
    back = update(stub, session.id, workspace_write())
    assert back.sandbox_generation == 3 and back.sandbox_policy.mode == pb.SandboxPolicy.WORKSPACE_WRITE
    assert try_write(stub, session.id, ws / "c.txt") == "WROTE"
    assert stub.GetSession(pb.GetSessionRequest(session_id=session.id)).sandbox_generation == 3


def test_update_approval_only_keeps_the_sandbox(stub: pb_grpc.SandboxStub, session: pb.Session) -> None:
    assert sh(stub, session.id, "echo kept > /tmp/kept").result.exit_code == 0
    updated = update(stub, session.id, approval=pb.ON_REQUEST)
    assert updated.approval_policy == pb.ON_REQUEST and updated.sandbox_generation == 1
    assert updated.sandbox_policy.mode == pb.SandboxPolicy.WORKSPACE_WRITE
    # `cat` only reads, so on-request lets it run without asking.
    assert run_exec(stub, session.id, ["cat", "/tmp/kept"]).stdout == b"kept\n"    # same sandbox, same /tmp
    again = update(stub, session.id, workspace_write())                           # the same policy: no rebuild
    assert again.sandbox_generation == 1 and again.approval_policy == pb.ON_REQUEST


def test_update_with_a_bad_policy_changes_nothing(stub: pb_grpc.SandboxStub, session: pb.Session,
                                                  ws: Path) -> None:
    error = rpc_error(lambda: update(stub, session.id, workspace_write(writable_roots=[str(ws / "missing")])))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and str(ws / "missing") in error.details()
    now = stub.GetSession(pb.GetSessionRequest(session_id=session.id))
    assert now.sandbox_generation == 1 and not now.sandbox_policy.writable_roots
    assert try_write(stub, session.id, ws / "still.txt") == "WROTE"


def test_running_call_keeps_its_sandbox_across_an_update(daemon: Daemon, stub: pb_grpc.SandboxStub,
                                                         session: pb.Session, ws: Path) -> None:
    inits_before = len(daemon.session_inits())
    with ExecCall(stub, exec_start(session.id, shell=f"read go; touch {ws}/during && echo touched")) as call:
        call.wait_started()
        updated = update(stub, session.id, read_only())
        assert updated.sandbox_generation == 2
        assert try_write(stub, session.id, ws / "after.txt") in DENIED          # new calls: the new sandbox
        assert poll(lambda: len(daemon.session_inits()) == inits_before + 1), daemon.session_inits()  # old one kept
        call.send_stdin(b"go\n")
        out = call.finish()
    assert out.result.exit_code == 0 and out.stdout == b"touched\n", out.describe()
    assert (ws / "during").exists() and not (ws / "after.txt").exists()
    # Its last call ended: the old generation's sandbox is released.
    assert poll(lambda: len(daemon.session_inits()) == inits_before), daemon.session_inits()


# --------------------------------------------------------------------------- other users


NOBODY_CLIENT = r'''
res = {}
ids = lambda: sorted(s.id for s in stub.ListSessions(pb.ListSessionsRequest()).sessions)
res["list_before"] = ids()
rid = ARGS["root_session"]
res["get_root"] = code(lambda: stub.GetSession(pb.GetSessionRequest(session_id=rid)))
res["close_root"] = code(lambda: stub.CloseSession(pb.CloseSessionRequest(session_id=rid)))
res["update_root"] = code(lambda: stub.UpdateSessionPolicy(pb.UpdateSessionPolicyRequest(
    session_id=rid, approval_policy=pb.NEVER)))
res["exec_root"] = code(lambda: run(rid, ["true"]))
res["create_in_root_dir"] = code(lambda: stub.CreateSession(pb.CreateSessionRequest(workspace=ARGS["root_dir"])))
res["danger"] = code(lambda: stub.CloseSession(pb.CloseSessionRequest(session_id=stub.CreateSession(
    pb.CreateSessionRequest(workspace=ARGS["own_dir"], sandbox_policy=pb.SandboxPolicy(
        mode=pb.SandboxPolicy.DANGER_FULL_ACCESS))).id)))
res["writable_root_of_root"] = code(lambda: stub.CreateSession(pb.CreateSessionRequest(
    workspace=ARGS["own_dir"], sandbox_policy=pb.SandboxPolicy(mode=pb.SandboxPolicy.WORKSPACE_WRITE,
                                                             writable_roots=[ARGS["root_dir"]]))))
res["list_after_refusals"] = ids()
mine = []
for ws in (ARGS["open_dir"], ARGS["own_dir"]):
    s = stub.CreateSession(pb.CreateSessionRequest(workspace=ws, approval_policy=pb.NEVER))
    out, ec = run(s.id, ["sh", "-c", "id -u; id -g; touch made-by-me && echo ok"])
    mine.append({"id": s.id, "owner_uid": s.owner_uid, "owner_gid": s.owner_gid, "out": out, "exit": ec})
res["mine"] = mine
res["list_end"] = ids()
print(json.dumps(res))
'''


def test_peer_credentials_isolate_users(daemon: Daemon, stub: pb_grpc.SandboxStub, ws: Path,
                                        sessions: list[str]) -> None:
    root_session = create_session(stub, ws)
    sessions.append(root_session.id)
    open_dir = make_dir(ws / "open", 0o777)
    own_dir = make_dir(ws / "nobody")
    os.chown(own_dir, NOBODY, NOBODY)
    res = run_client_as(NOBODY, NOBODY, daemon.socket, NOBODY_CLIENT, {
        "root_session": root_session.id, "root_dir": str(ws), "open_dir": str(open_dir), "own_dir": str(own_dir)})
    sessions.extend(m["id"] for m in res["mine"])

    assert res["list_before"] == []
    for key in ("get_root", "close_root", "update_root", "exec_root"):
        assert res[key] == "NOT_FOUND", (key, res[key])
    assert res["create_in_root_dir"] == "PERMISSION_DENIED"
    assert res["danger"] == "OK"          # as itself, with its own rights (tests/test_full_access_users.py)
    assert res["writable_root_of_root"] == "PERMISSION_DENIED"
    assert res["list_after_refusals"] == []
    for mine in res["mine"]:
        assert mine["owner_uid"] == NOBODY and mine["owner_gid"] == NOBODY, mine
        assert mine["exit"] == 0 and mine["out"].split() == [str(NOBODY), str(NOBODY), "ok"], mine
    assert res["list_end"] == sorted(m["id"] for m in res["mine"])
    assert os.stat(open_dir / "made-by-me").st_uid == NOBODY
    assert os.stat(own_dir / "made-by-me").st_uid == NOBODY

    # Root's session is untouched, and root (an admin) sees and may use everyone's.
    assert stub.GetSession(pb.GetSessionRequest(session_id=root_session.id)).approval_policy == pb.NEVER
    listed = {s.id: s for s in stub.ListSessions(pb.ListSessionsRequest()).sessions}
    for mine in res["mine"]:
        assert listed[mine["id"]].owner_uid == NOBODY
        out = run_exec(stub, mine["id"], ["id", "-u"])             # still runs as the session's owner
        assert out.stdout.decode().strip() == str(NOBODY), out.describe()


# --------------------------------------------------------------------------- leaks


@pytest.mark.timeout(900)      # 1,005 sessions: over the module's 240 s on this 2-core machine under others' load
def test_no_leaks_over_many_sessions(daemon: Daemon, stub: pb_grpc.SandboxStub, ws: Path) -> None:
    fork_pid = daemon.fork_server_pid()
    assert fork_pid is not None
    prefix = f"run-{fork_pid}-"
    limits = pb.Limits(pids=256, memory_bytes=256 << 20)          # so that every session gets cgroups

    def cycle() -> bool:
        s = create_session(stub, ws, limits=limits)
        ours = any(os.path.basename(p).startswith(prefix) for p in sandbox_cgroups())
        try:
            out = run_exec(stub, s.id, ["true"])
            assert out.result is not None and out.result.exit_code == 0, out.describe()
        finally:
            stub.CloseSession(pb.CloseSessionRequest(session_id=s.id))
        return ours

    for _ in range(5):                                            # warm up thread pools, caches, relays
        cycle()
    open_sessions = {s.id for s in stub.ListSessions(pb.ListSessionsRequest()).sessions}
    base = {"daemon fds": fd_count(daemon.pid), "fork server fds": fd_count(fork_pid), "mounts": mount_count(),
            "session inits": len(daemon.session_inits())}
    assert poll(lambda: len(daemon.session_inits()) == len(open_sessions)), (daemon.session_inits(), open_sessions)
    base["session inits"] = len(open_sessions)
    cgroups_before = sandbox_cgroups()
    relays_before = len(os.listdir(daemon.private / "relay")) if (daemon.private / "relay").is_dir() else 0

    seen_cgroup = False
    for _ in range(1000):                                         # the "1,000 sessions"
        seen_cgroup |= cycle()
    assert seen_cgroup, "no run-* cgroup of this daemon ever existed: the cgroup count below checks nothing"

    def now() -> dict[str, int]:
        return {"daemon fds": fd_count(daemon.pid), "fork server fds": fd_count(fork_pid), "mounts": mount_count(),
                "session inits": len(daemon.session_inits())}
    slack = {"daemon fds": 8, "fork server fds": 2, "mounts": 2, "session inits": 0}
    assert poll(lambda: all(now()[k] <= base[k] + slack[k] for k in base), within=10), (base, now())
    assert daemon.call_inits() == {}
    assert poll(lambda: not {p for p in sandbox_cgroups() - cgroups_before
                             if os.path.basename(p).startswith(prefix)}, within=10), \
        sorted(sandbox_cgroups() - cgroups_before)[:10]
    if (daemon.private / "relay").is_dir():
        assert poll(lambda: len(os.listdir(daemon.private / "relay")) <= relays_before + 2, within=10)
    assert {s.id for s in stub.ListSessions(pb.ListSessionsRequest()).sessions} == open_sessions


# --------------------------------------------------------------------------- stopping the daemon


@pytest.fixture
def own_daemon() -> Iterator[Daemon]:
    """A daemon of its own, for tests that stop or kill it."""
    with running_daemon("sbxd-own-") as d:
        yield d


def busy_daemon(d: Daemon, marker: str) -> tuple[ExecCall, dict]:
    """Two sessions, one running `sleep 300 MARKER`; returns the call and the daemon's process tree."""
    workspace = make_dir(d.base / "ws")
    stub = d.stub
    busy = create_session(stub, workspace)
    create_session(stub, workspace, read_only())
    call = ExecCall(pb_grpc.SandboxStub(d.channel()), exec_start(busy.id, ["sleep", "300", marker]))
    call.wait_started()
    assert wait_marker_appears(marker)
    tree = descendants(d.pid)
    assert len([p for p in tree.values() if p.cmdline == b"sandboxd-session"]) == 2, tree
    assert any(p.cmdline == b"sandboxd-call" for p in tree.values()), tree
    return call, tree


def test_sigint_stops_everything(own_daemon: Daemon, sleep_marker: str) -> None:
    """SIGINT stops at once, whatever runs (SIGTERM drains first: tests/test_drain.py)."""
    call, tree = busy_daemon(own_daemon, sleep_marker)
    backend = [n for n in os.listdir(own_daemon.private) if n.endswith(".sock")]
    assert backend, os.listdir(own_daemon.private)
    try:
        assert own_daemon.stop(signal.SIGINT) == 0, own_daemon.log()
        assert not os.path.exists(own_daemon.socket)
        assert not [n for n in os.listdir(own_daemon.private) if n.endswith(".sock")]
        assert wait_until_gone(sleep_marker, within=10) == []
        assert survivors(tree) == {}
        assert any(line.get("msg") == "stopped" for line in own_daemon.log_lines()), own_daemon.log()
        assert call.wait_done(30), "the running Exec never ended"
    finally:
        call.close()
        kill_procs(tree)


def test_sigkill_takes_every_sandbox_down(own_daemon: Daemon, sleep_marker: str) -> None:
    call, tree = busy_daemon(own_daemon, sleep_marker)
    try:
        assert own_daemon.stop(signal.SIGKILL) == -signal.SIGKILL
        assert wait_until_gone(sleep_marker, within=10) == []
        left = survivors(tree)
        assert left == {}, left
        assert call.wait_done(30), "the running Exec never ended"
    finally:
        call.close()
        kill_procs(tree)
    # A new daemon can take over the same socket path (the old one left its socket file behind).
    # The killed daemon's sessions are resumed from the event store: listed, their sandboxes
    # rebuilt by their next call.
    again = Daemon(own_daemon.base)
    try:
        again.start()
        resumed = again.stub.ListSessions(pb.ListSessionsRequest()).sessions
        assert resumed and not any(x.sandbox_ready for x in resumed), resumed
        s = create_session(again.stub, own_daemon.base / "ws")
        assert run_exec(again.stub, s.id, ["echo", "back"]).stdout == b"back\n"
        assert run_exec(again.stub, resumed[0].id, ["echo", "resumed"]).stdout == b"resumed\n"
        listed = {x.id: x for x in again.stub.ListSessions(pb.ListSessionsRequest()).sessions}
        assert set(listed) == {s.id} | {x.id for x in resumed} and listed[resumed[0].id].sandbox_ready
    finally:
        again.close()
