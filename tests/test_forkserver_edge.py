"""The fork server's edge: no request kills it, no deadline crashes its loop, its death fails
every waiter at once, and nothing waits with select() (descriptors past 1024 work)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import BASE_ENV
from sandboxd.errors import InvalidPolicy, SetupError
from sandboxd.policy import LaunchSpec, Limits, WorkspaceWrite
from sandboxd.service.calls import SessionCall
from sandboxd.supervisor import fork_protocol
from sandboxd.supervisor.fork_client import ForkServer
from sandboxd.supervisor.fork_protocol import check_timeout
from sandboxd.supervisor.fork_server import MAX_POLL_MS, poll_timeout_ms

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[1]
SANDBOXD = str(REPO / ".venv" / "bin" / "sandboxd")


@pytest.fixture
def server() -> Iterator[ForkServer]:
    fs = ForkServer.start()
    try:
        yield fs
    finally:
        fs.close()


def null_stdio() -> tuple[int, int, int]:
    fd = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    return fd, fd, fd


def launch_true(server: ForkServer, workspace: Path) -> int:
    stdio = null_stdio()
    try:
        call = server.launch(LaunchSpec(argv=("true",), workspace=str(workspace), env=dict(BASE_ENV)), stdio)
    finally:
        os.close(stdio[0])
    return server.wait(call).exit_code  # type: ignore[return-value]


def test_poll_timeout_never_raises_on_any_deadline() -> None:
    now = 1000.0
    for deadline in (now + 1e12, float("inf"), float("nan"), 1e300, now + MAX_POLL_MS):
        assert poll_timeout_ms(deadline, now) == MAX_POLL_MS, deadline
    assert poll_timeout_ms(None, now) == MAX_POLL_MS
    assert poll_timeout_ms(now - 5, now) == 0 and poll_timeout_ms(float("-inf"), now) == 0
    assert poll_timeout_ms(now + 0.0001, now) == 1 and poll_timeout_ms(now + 2.5, now) == 2500


def test_check_timeout_refuses_what_no_clock_holds() -> None:
    for bad in (1e12, float("inf"), float("nan"), -1, "10", True):
        with pytest.raises(InvalidPolicy, match="timeout_seconds"):
            check_timeout(bad)
    assert check_timeout(None) is None and check_timeout(0) is None
    assert check_timeout(7 * 24 * 3600) == 7 * 24 * 3600.0 and check_timeout(1) == 1.0
    with pytest.raises(InvalidPolicy, match="above its maximum"):
        Limits(timeout_seconds=1e12)


def spec_with(record: str, field: str, value: object) -> dict[str, object]:
    """A launch spec as the client sends it (its JSON), with one nested field of ``record`` changed."""
    spec = LaunchSpec(argv=("true",), workspace="/w", caller=(1000, 1000, ()))
    wire: dict[str, Any] = json.loads(fork_protocol.Launch(1, fork_protocol.spec_record(spec)).encode())["spec"]
    wire[record][field] = value
    return wire


def send_raw(server: ForkServer, message: object, fds: list[int] | None = None) -> None:
    """A request as the typed client would never send it: any JSON (or bytes), straight on the socket."""
    data = message if isinstance(message, bytes) else json.dumps(message).encode()
    fork_protocol.send(server._sock, data, fds)


def error_for(server: ForkServer, call_id: int) -> dict[str, object]:
    event = server._wait_event(call_id, (fork_protocol.Error,))
    assert isinstance(event, fork_protocol.Error)
    return event.error


def test_malformed_requests_get_error_answers_and_the_server_lives(server: ForkServer, workspace: Path) -> None:
    """Every request the codec cannot take as its record (a field of the wrong type, an unknown
    operation, the wrong number of descriptors, not JSON) is answered InvalidPolicy naming what is
    wrong, under its own id when it had one; the loop goes on, and launches still work (control)."""
    pid = server.pid
    stdio = null_stdio()
    try:
        bad_requests: list[tuple[dict[str, object], list[int], str]] = [
            ({"op": "launch", "spec": "not a spec"}, list(stdio),
             "field 'spec' must be an object of SpecRecord's fields"),
            ({"op": "launch", "spec": {"argv": 5}}, list(stdio), ""),
            ({"op": "launch"}, [], "takes 3 descriptors, got 0"),
            ({"op": "call", "session": 7, "argv": ["true"], "env": {}, "cwd": "/"}, list(stdio),
             "field 'session' must be str"),
            ({"op": "call", "session": "s", "argv": ["true", 5], "env": {}, "cwd": "/"}, list(stdio),
             "field 'argv' must be list[str]"),
            ({"op": "call", "session": "s", "argv": ["true"], "env": {"A": None}, "cwd": "/"}, list(stdio),
             "field 'env' must be dict[str, str]"),
            ({"op": "call", "session": "nope", "argv": ["true"], "env": {}, "cwd": "/"}, list(stdio),
             "no open session"),
            ({"op": "call", "session": "nope", "argv": ["true"], "env": {}, "cwd": "/", "timeout": True},
             list(stdio), "field 'timeout' must be float | None"),
            ({"op": "session_open", "session": ["x"], "spec": {}}, [], "field 'session' must be str"),
            ({"op": "session_open", "session": "s", "spec": {"argv": []}}, [], ""),
            ({"op": "session_close", "session": None}, [], "field 'session' must be str"),
            ({"op": "check_paths", "caller": [0, "root", []], "paths": ["/"]}, [],
             "field 'caller' must be an object of CallerRecord's fields"),
            ({"op": "check_paths", "caller": {"uid": 0, "gid": "root", "groups": []}, "paths": ["/"]}, [],
             "field 'caller.gid' must be int"),
            # The spec's nested fields, each checked and named by its path (the policy's modes too).
            ({"op": "launch", "spec": spec_with("policy", "network_mode", 7)}, list(stdio),
             "field 'spec.policy.network_mode' must be one of isolated, host, got 7"),
            ({"op": "session_open", "session": "s", "spec": spec_with("policy", "writable_roots", "/etc")}, [],
             "field 'spec.policy.writable_roots' must be list[str]"),
            ({"op": "session_open", "session": "s", "spec": spec_with("limits", "pids", "many")}, [],
             "field 'spec.limits.pids' must be int | None"),
            ({"op": "launch", "spec": spec_with("caller", "uid", None)}, list(stdio),
             "field 'spec.caller.uid' must be int"),
            ({"op": "explode"}, [], "unknown fork server operation 'explode'"),
        ]
        for number, (message, fds, says) in enumerate(bad_requests, start=10_000):
            send_raw(server, {**message, "id": number}, fds or None)
            error = error_for(server, number)
            assert error["kind"] in ("InvalidPolicy", "SetupError"), error
            assert says in str(error["detail"]), (message, error)
            assert server.pid == pid
        # Fields the client would never send: a time limit of 1e12 s, a signal beyond NSIG.
        spec = LaunchSpec(argv=("true",), workspace=str(workspace), env=dict(BASE_ENV))
        huge = json.loads(fork_protocol.Launch(1, fork_protocol.spec_record(spec)).encode())["spec"]
        huge["limits"]["timeout_seconds"] = 1e12
        with pytest.raises(InvalidPolicy, match="timeout_seconds"):
            server._expect(server._request(lambda call_id: fork_protocol.Launch(call_id, huge), list(stdio)),
                           fork_protocol.Started)
        server._send(fork_protocol.Signal(99999, 10 ** 9))
        assert "not a signal" in str(error_for(server, 99999)["detail"])
        # Not JSON, not an object, no integer id: answered with id 0.
        send_raw(server, b"\xff not json")
        send_raw(server, [1, 2])
        send_raw(server, {"op": "launch", "id": "seven"})
        send_raw(server, {"op": "ping", "id": True})
        for _ in range(4):
            assert error_for(server, 0)["kind"] == "InvalidPolicy"
    finally:
        os.close(stdio[0])
    assert os.path.exists(f"/proc/{pid}") and server.pid == pid
    assert launch_true(server, workspace) == 0          # the control: it still launches
    assert server.ping(10)


def test_deadlines_still_kill_on_time(server: ForkServer, workspace: Path) -> None:
    """The control for the clamped poll: a short time limit still ends a long command."""
    stdio = null_stdio()
    try:
        call = server.launch(LaunchSpec(argv=("sleep", "30"), workspace=str(workspace), env=dict(BASE_ENV),
                                        limits=Limits(timeout_seconds=0.5)), stdio)
    finally:
        os.close(stdio[0])
    info = server.wait(call)
    assert info.timed_out and info.shell_status == 124


def test_a_dead_fork_server_fails_every_waiter_and_restarts_in_place(server: ForkServer, workspace: Path) -> None:
    session = "s#1"
    server.open_session(session, LaunchSpec(argv=("sandboxd-session",), workspace=str(workspace),
                                            policy=WorkspaceWrite(), env=dict(BASE_ENV)))
    stdio = null_stdio()
    try:
        calls = [server.call(session, ["sleep", "300"], dict(BASE_ENV), str(workspace), None, stdio)[0]
                 for _ in range(3)]
    finally:
        os.close(stdio[0])
    errors: list[BaseException] = []

    def wait(call_id: int) -> None:
        try:
            server.wait(call_id)
        except BaseException as exc:  # noqa: BLE001 - collected for the assertion
            errors.append(exc)

    waiters = [threading.Thread(target=wait, args=(call,)) for call in calls]
    for thread in waiters:
        thread.start()
    old = server.pid
    os.kill(old, signal.SIGKILL)
    for thread in waiters:
        thread.join(30)
    assert not any(thread.is_alive() for thread in waiters), "a waiter hung on a dead fork server"
    assert len(errors) == 3 and all(isinstance(e, SetupError) and "fork server" in str(e) for e in errors), errors
    with pytest.raises(SetupError, match="fork server"):
        server.call(session, ["true"], dict(BASE_ENV), str(workspace), None, null_stdio())

    server.restart()
    assert server.pid != old and os.path.exists(f"/proc/{server.pid}")
    with pytest.raises(SetupError, match="fork server"):
        server.wait(calls[0])                             # asked of the dead one: fails at once
    assert launch_true(server, workspace) == 0


def test_session_call_output_reads_descriptors_past_1024() -> None:
    """The Exec output pump with pipes numbered above 1024 (select() raised ValueError there)."""
    filler = [os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC) for _ in range(1100)]
    try:
        out_r, out_w = os.pipe2(os.O_CLOEXEC)
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
        assert min(out_r, err_r) > 1024
        call = SessionCall.__new__(SessionCall)
        call.out_r, call.err_r = out_r, err_r
        call._fork = SimpleNamespace(handover_fd=-1)      # type: ignore[assignment]
        os.write(out_w, b"out")
        os.write(err_w, b"err")
        os.close(out_w)
        os.close(err_w)
        got = sorted(call.output())
        assert got == [(1, b"out"), (2, b"err")]
        os.close(out_r)
        os.close(err_r)
    finally:
        for fd in filler:
            os.close(fd)


def test_session_call_output_stops_when_the_daemon_hands_over() -> None:
    """A handover (ForkServer.detach) makes the output pump stop with HandedOver, though the call's
    pipes stay open (it runs on in the surviving supervisor); control: before it, output flows."""
    from sandboxd.supervisor.fork_client import HandedOver
    out_r, out_w = os.pipe2(os.O_CLOEXEC)
    err_r, err_w = os.pipe2(os.O_CLOEXEC)
    handover_r, handover_w = os.pipe2(os.O_CLOEXEC)
    try:
        call = SessionCall.__new__(SessionCall)
        call.out_r, call.err_r = out_r, err_r
        call._fork = SimpleNamespace(handover_fd=handover_r)   # type: ignore[assignment]
        os.write(out_w, b"out")
        pump = call.output()
        assert next(pump) == (1, b"out")
        os.write(handover_w, b"x")
        with pytest.raises(HandedOver):
            next(pump)
    finally:
        for fd in (out_r, out_w, err_r, err_w, handover_r, handover_w):
            os.close(fd)


def test_sandboxd_run_waits_on_a_pidfd_past_1024(workspace: Path) -> None:
    """`sandboxd run` waits on its sandbox's pidfd (SandboxProcess.wait): numbered past 1024 here."""
    filler = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        done = subprocess.run([SANDBOXD, "run", "--workspace", str(workspace), "--timeout", "20", "--",
                               "sh", "-c", "echo ran"], pass_fds=filler, capture_output=True, text=True,
                              env=BASE_ENV, timeout=60)
    finally:
        for fd in filler:
            os.close(fd)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "ran\n"


def test_a_request_too_large_for_the_socket_is_refused_before_sending(server: ForkServer, workspace: Path) -> None:
    """Thousands of writable roots (or a huge environment) used to fail as "the fork server has
    exited (Message too long)" while it had not: now the request is refused with its size and the
    limit, and the server goes on serving. A large request that fits goes through (control)."""
    stdio = null_stdio()
    try:
        # Control: 300 KB of arguments, past the socket's default 208 KiB buffer (the policy's list
        # limits keep env and roots smaller; argv is bounded by its entry count, not its bytes).
        argv = ("true", *(f"{i:05d}" + "x" * 51 for i in range(5000)))
        call = server.launch(LaunchSpec(argv=argv, workspace=str(workspace), env=dict(BASE_ENV)), stdio)
        assert server.wait(call).exit_code == 0
    finally:
        os.close(stdio[0])
    # Past the limit (1 MiB): refused here, whatever the request (the policy's own per-list limits
    # may refuse such a session earlier; the fork server's internal path check has none).
    with pytest.raises(InvalidPolicy) as refused:
        server.check_paths((65534, 65534, ()), [f"{workspace}/{'r' * 200}-{i}" for i in range(6000)])
    message = str(refused.value)
    assert "too large for the fork server" in message and "writable roots" in message, message
    size, limit = [int(word) for word in message.replace(",", " ").split() if word.isdigit()][:2]
    assert size > limit > 300_000, message
    assert server.ping(10) and launch_true(server, workspace) == 0


def test_a_planted_symlink_is_refused_by_the_walk_made_as_the_caller(server: ForkServer, base_dir: Path,
                                                                     outside: Path) -> None:
    """Through the fork server the walk along a writable root's path (is a symlink in it planted
    inside a writable area?) runs in the child that opened the paths, as the caller, off the
    loop: it still refuses a root through a symlink planted in the workspace; the target itself
    given directly is fine (control)."""
    ws = base_dir / "caller-ws"
    ws.mkdir(mode=0o777)
    os.chmod(ws, 0o777)
    (ws / "planted").symlink_to(outside)
    nobody = (65534, 65534, ())

    def launch(root: str) -> int:
        stdio = null_stdio()
        try:
            call = server.launch(LaunchSpec(argv=("true",), workspace=str(ws), env=dict(BASE_ENV), caller=nobody,
                                            user=(65534, 65534), policy=WorkspaceWrite(writable_roots=(root,))), stdio)
        finally:
            os.close(stdio[0])
        return server.wait(call).exit_code  # type: ignore[return-value]

    assert launch(str(outside)) == 0
    with pytest.raises(InvalidPolicy, match="planted") as refused:
        launch(f"{ws}/planted")
    assert f"{ws}/planted" in str(refused.value) and "symlink" in str(refused.value)


def test_a_session_refused_at_its_paths_leaves_its_name_free(server: ForkServer, base_dir: Path) -> None:
    """The paths are opened off the loop, before the build: a refusal there must not leave the
    session's name taken (the daemon opens a session again under the same name)."""
    ws = base_dir / "caller-ws"
    ws.mkdir(mode=0o777)
    os.chmod(ws, 0o777)
    nobody = (65534, 65534, ())
    missing = LaunchSpec(argv=("true",), workspace=str(ws), caller=nobody, user=(65534, 65534),
                         policy=WorkspaceWrite(writable_roots=(f"{ws}/missing",)))
    with pytest.raises(InvalidPolicy, match="does not exist"):
        server.open_session("again", missing)
    (ws / "missing").mkdir(mode=0o777)
    os.chmod(ws / "missing", 0o777)
    info = server.open_session("again", missing)
    assert info.init_pid > 0 and info.workspace == str(ws)
    server.close_session("again")


def test_ping_says_whether_the_server_answers_in_time(server: ForkServer) -> None:
    """The watchdog's probe: a stopped server does not answer (False, after the timeout, never
    later), the same server continued does (control)."""
    assert server.ping(10)
    os.kill(server.pid, signal.SIGSTOP)
    try:
        assert not server.ping(0.3)
    finally:
        os.kill(server.pid, signal.SIGCONT)
    assert server.ping(10)


def test_the_fork_server_never_runs_code_from_the_daemons_working_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`python -m` puts the working directory first on sys.path: a `sandboxd` package planted
    where root started the daemon (a user's directory) would run as the root fork server. It is
    started with -P; the control shows the same plant runs under a plain `python -m`."""
    planted = tmp_path / "sandboxd" / "supervisor"
    planted.mkdir(parents=True)
    for package in (tmp_path / "sandboxd", planted):
        (package / "__init__.py").write_text("")
    marker = tmp_path / "ran"
    (planted / "fork_server.py").write_text(f"open({str(marker)!r}, 'w').write('planted code ran')\n")
    monkeypatch.chdir(tmp_path)
    fs = ForkServer.start()
    try:
        assert fs.ping(30), "the fork server does not answer"
    finally:
        fs.close()
    assert not marker.exists()
    # Control: the same interpreter and environment without -P imports the plant.
    subprocess.run([sys.executable, "-m", "sandboxd.supervisor.fork_server", "0"], cwd=tmp_path,
                   env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}, capture_output=True, timeout=60)
    assert marker.read_text() == "planted code ran"
