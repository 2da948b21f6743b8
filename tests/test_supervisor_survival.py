"""The surviving supervisor, from its client's side: a real fork server started with ``survive``,
real sessions and calls, the client gone (detach, as a handover or a dead daemon leaves it) and a
new client attached (ForkServer.attach), as a new daemon does.

What must hold: the sandboxes and calls run on while no daemon is attached; a call that writes
more than its pipe holds neither blocks nor gets SIGPIPE (its output is drained into a bounded
tail); the next client is told every session (the same sandbox: the same init, a file in its /tmp
still there), every call still running and every end it missed, with the tails; the ends reach
the audit log and CallResults (handover.adopt); one attacher at a time, root running sandboxd's
interpreter only (the controls: the same attach succeeds for the right peer); alone past
``orphan_seconds`` it stops everything and leaves nothing.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import BASE_ENV
from daemon_helpers import base_with_workspace, plain_users, sandbox_cgroups
from sandboxd.audit.store import EventStore, EventType
from sandboxd.errors import WrongState
from sandboxd.policy import LaunchSpec, Limits, WorkspaceWrite
from sandboxd.service.handover.adopt import Adopter
from sandboxd.service.handover.tags import call_tag
from sandboxd.service.call_results import FINISHED, CallResults
from sandboxd.supervisor.fork_client import Adoption, ForkServer
from sandboxd.supervisor.tails import TAIL_BYTES

pytestmark = pytest.mark.timeout(240)

SESSION = "5e55101d#1"          # a sandbox's name as the daemon makes it (ID#GENERATION)


@pytest.fixture
def base() -> Iterator[Path]:
    with base_with_workspace("sbxsurvive-") as path:
        (path / "private").mkdir(mode=0o700)
        yield path


def spec(base: Path, **limits: int) -> LaunchSpec:
    return LaunchSpec(argv=("sandboxd-session",), workspace=str(base / "ws"), policy=WorkspaceWrite(),
                      env=dict(BASE_ENV), limits=Limits(**limits) if limits else Limits())


def start(base: Path, orphan_seconds: float = 120.0) -> ForkServer:
    """A surviving supervisor, serving: ForkServer.start returns once the process is spawned, and a
    test that detaches at once would otherwise look for the attach socket before the server (its
    imports slow on a loaded machine) has bound it."""
    server = ForkServer.start(survive=str(base / "private" / "supervisor.sock"), orphan_seconds=orphan_seconds)
    assert server.ping(60), "the supervisor did not answer a ping within 60 s"
    return server


def attach(base: Path) -> "tuple[ForkServer, Adoption]":
    attached = ForkServer.attach(str(base / "private" / "supervisor.sock"))
    assert attached is not None, "nobody listened on the attach socket"
    return attached


def run(server: ForkServer, session: str, command: str, tag: str = "") -> tuple[int, int, int]:
    """Start ``sh -c command`` with its output on fresh pipes (their read ends also tapped):
    (call id, stdout's read end, stderr's read end), the read ends the caller's."""
    null = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    out_r, out_w = os.pipe2(os.O_CLOEXEC)
    err_r, err_w = os.pipe2(os.O_CLOEXEC)
    try:
        call_id, _ = server.call(session, ["sh", "-c", command], dict(BASE_ENV), "/", None, (null, out_w, err_w),
                                 tag=tag, taps=(out_r, err_r))
    finally:
        for fd in (null, out_w, err_w):
            os.close(fd)
    return call_id, out_r, err_r


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_for(what: str, check: "object", within: float = 60.0) -> None:
    deadline = time.monotonic() + within
    while not check():          # type: ignore[operator]
        assert time.monotonic() < deadline, f"{what}: not within {within} s"
        time.sleep(0.05)


def test_a_detached_supervisor_keeps_everything_and_hands_it_to_the_next_client(base: Path) -> None:
    server = start(base)
    try:
        built = server.open_session(SESSION, spec(base))
        marked, out_r, err_r = run(server, SESSION, "echo kept > /tmp/adopt-mark")
        assert server.wait(marked).exit_code == 0
        for fd in (out_r, err_r):
            os.close(fd)
        # More than a pipe holds, nobody reading: it blocks while its daemon lives, then is drained.
        chatty, chatty_out, chatty_err = run(server, SESSION, "head -c 1048576 /dev/zero; echo done; "
                                             f"touch {base}/ws/chatty-done; echo oops >&2; exit 7",
                                             call_tag("call_chatty", "shell.exec"))
        sleeper, sleeper_out, sleeper_err = run(server, SESSION, "echo up; exec sleep 300",
                                                call_tag("call_sleeper", "shell.exec"))
        assert os.read(sleeper_out, 16) == b"up\n"
    finally:
        server.detach()                              # the daemon goes: its pipes' ends with it
    for fd in (chatty_out, chatty_err, sleeper_out, sleeper_err):
        os.close(fd)
    assert alive(server.pid), "the supervisor died with its client"
    wait_for("the chatty call's end (drained by the supervisor)", lambda: (base / "ws" / "chatty-done").exists())

    fresh, adoption = attach(base)
    try:
        assert fresh.pid == server.pid
        held = adoption.sessions[SESSION]
        assert (held.init_pid, held.workspace) == (built.init_pid, built.workspace), "not the same sandbox"
        ends = {ended.call: ended for ended in adoption.ended}
        running = {call.call: call for call in adoption.running}
        assert set(running) | set(ends) >= {chatty, sleeper} and sleeper in running
        assert running[sleeper].tag == call_tag("call_sleeper", "shell.exec") and running[sleeper].pid > 0
        chatty_end = ends.get(chatty) or fresh.wait_held(chatty)
        assert chatty_end.exit_code == 7, "the command got SIGPIPE or was killed: " + repr(chatty_end)
        stdout = chatty_end.stdout_tail.encode("latin-1")
        assert stdout.endswith(b"done\n") and len(stdout) == TAIL_BYTES, len(stdout)
        assert chatty_end.dropped == (1 << 20) + 5 - TAIL_BYTES
        assert chatty_end.stderr_tail == "oops\n"
        # The same sandbox serves the new client: what the first one left in its /tmp is there.
        again, again_out, again_err = run(fresh, SESSION, "cat /tmp/adopt-mark")
        assert fresh.wait(again).exit_code == 0 and os.read(again_out, 64) == b"kept\n"
        for fd in (again_out, again_err):
            os.close(fd)
        # One daemon at a time: a second attacher is refused while this one is attached.
        with pytest.raises(WrongState, match="another daemon is attached"):
            ForkServer.attach(str(base / "private" / "supervisor.sock"))
        # The missed ends reach the audit log and CallResults, as the daemon records them.
        store = EventStore(str(base / "events.db"))
        results = CallResults(None)
        try:
            adopted = Adopter(None, fresh, store, results).adopt(  # type: ignore[arg-type]
                Adoption({}, (), (chatty_end.replace(session=SESSION),)))
            assert adopted.calls_ended == 1
            [event] = store.query(session_ids=[SESSION.split("#")[0]], types=[EventType.TOOL_COMPLETED])
            assert event.call_id == "call_chatty" and event.data["exit_code"] == 7 and event.data["adopted"]
            assert event.data["stdout_tail"].endswith("done\n") and event.data["stderr_tail"] == "oops\n"
            result = results.wait("call_chatty", 0)
            assert result is not None and result.state == FINISHED and result.exit_code == 7
            assert result.stdout_tail.endswith(b"done\n")
        finally:
            store.close()
        fresh.cancel(sleeper)
        assert fresh.wait_held(sleeper).signal == signal.SIGKILL
    finally:
        fresh.close()
    wait_for("close() to stop the supervisor and its sandboxes",
             lambda: not alive(server.pid) and not alive(built.init_pid), 10)
    assert not (base / "private" / "supervisor.sock").exists()


def _attach_script(path: str) -> str:
    return (f"import socket, sys\nsys.path[:0] = {sys.path!r}\n"
            "from sandboxd.supervisor import fork_protocol as p\n"
            "s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)\n"
            f"s.connect({path!r})\n"
            "try:\n    s.send(p.Attach(1).encode())\nexcept OSError:\n    pass\n"
            "m, fds = p.receive(s, p.events(), p.receive_buffer())\n"
            "print(type(m).__name__, getattr(m, 'error', ''))\n")


def test_only_root_running_sandboxds_interpreter_may_attach(base: Path) -> None:
    """A plain user cannot reach the socket (a 0700 directory of root's) and, given the way
    (the control: the directory opened), is refused by the peer check; root running another
    executable is refused too (a copy of the interpreter one byte longer: the check compares the
    file's bytes, so that a replaced pod's new container, whose interpreter is another file with
    the same bytes, may attach: tests/test_attach_point.py); the same script as root with
    sandboxd's interpreter is taken."""
    server = start(base)
    path = str(base / "private" / "supervisor.sock")
    copied = base / "other-python"
    shutil.copy2(os.path.realpath("/proc/self/exe"), copied)
    with open(copied, "ab") as longer:
        longer.write(b"\0")
    try:
        server.detach()
        with plain_users(1) as [user]:
            def as_user() -> subprocess.CompletedProcess[str]:
                return subprocess.run([sys.executable, "-c", _attach_script(path)], capture_output=True, text=True,
                                      timeout=60, user=user.uid, group=user.gid, extra_groups=[], env=BASE_ENV)
            blocked = as_user()
            assert blocked.returncode != 0 and "PermissionError" in blocked.stderr, blocked
            os.chmod(base / "private", 0o755)
            os.chmod(path, 0o666)
            reached = as_user()
            assert reached.stdout.startswith("Error") and "only root's sandboxd may" in reached.stdout, reached
        other = subprocess.run([str(copied), "-c", _attach_script(path)], capture_output=True, text=True,
                               timeout=60, env=BASE_ENV)
        assert other.stdout.startswith("Error") and "interpreter" in other.stdout, other
        control = subprocess.run([sys.executable, "-c", _attach_script(path)], capture_output=True, text=True,
                                 timeout=60, env=BASE_ENV)
        assert control.stdout.startswith("Attached"), control
    finally:
        fresh, _ = attach(base)
        fresh.close()
    wait_for("the supervisor to stop", lambda: not alive(server.pid), 10)


def test_alone_past_its_orphan_timeout_it_stops_everything(base: Path) -> None:
    server = start(base, orphan_seconds=1.0)
    built = server.open_session(SESSION, spec(base, memory_bytes=256 << 20, pids=64))
    call, out_r, err_r = run(server, SESSION, "exec sleep 300")
    pid = server.pid
    groups = {path for path in sandbox_cgroups() if os.path.basename(path).startswith(f"run-{pid}-")}
    assert groups, "the limited session should have cgroups named after the supervisor"
    pidfd = os.pidfd_open(pid)
    server.detach()
    for fd in (out_r, err_r):
        os.close(fd)
    try:
        waiter = select.poll()
        waiter.register(pidfd, select.POLLIN)
        assert waiter.poll(60_000), "the supervisor did not stop within 60 s of its 1 s orphan timeout"
    finally:
        os.close(pidfd)
    wait_for("the session's init to go", lambda: not alive(built.init_pid), 10)
    wait_for("the sandbox cgroups to go", lambda: not any(os.path.isdir(group) for group in groups), 10)
    assert not (base / "private" / "supervisor.sock").exists()
    assert ForkServer.attach(str(base / "private" / "supervisor.sock")) is None
    assert call > 0


def test_a_fork_server_that_does_not_survive_dies_with_its_client(base: Path) -> None:
    """The control for all of the above: without ``survive`` the end of the client's connection
    (close or detach alike) kills the sandbox, and there is nothing to attach to."""
    server = ForkServer.start()
    built = server.open_session(SESSION, spec(base))
    assert not server.survives
    server.detach()
    wait_for("the fork server and its sandbox to go", lambda: not alive(server.pid) and not alive(built.init_pid), 10)
    assert ForkServer.attach(str(base / "private" / "supervisor.sock")) is None


def test_a_malformed_attach_answer_is_refused(base: Path) -> None:
    """A peer that answers Attach with something that is not the protocol's: SetupError, nothing adopted."""
    from sandboxd.errors import SetupError
    path = str(base / "private" / "fake.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(1)
    try:
        import threading

        def serve() -> None:
            conn, _ = listener.accept()
            conn.recv(4096)
            conn.send(b'{"event": "held_call", "id": 1, "call": "nine"}')
            conn.close()
        thread = threading.Thread(target=serve)
        thread.start()
        with pytest.raises(SetupError, match="malformed"):
            ForkServer.attach(path)
        thread.join(10)
    finally:
        listener.close()


def test_a_dead_supervisor_is_replaced_by_a_surviving_one_at_the_same_place(base: Path) -> None:
    """The daemon's restart of a dead fork server (ForkServer.restart) starts a surviving one again,
    listening where the dead one did (its stale socket file replaced), and serving at once."""
    server = start(base)
    old = server.pid
    try:
        os.kill(old, signal.SIGKILL)
        wait_for("the supervisor to die", lambda: not alive(old), 10)
        server.restart()
        assert server.survives and server.pid != old
        assert server.ping(30)
        with pytest.raises(WrongState, match="another daemon is attached"):
            ForkServer.attach(str(base / "private" / "supervisor.sock"))
    finally:
        server.close()
    wait_for("the new supervisor to stop", lambda: not alive(server.pid), 10)
