"""Terminals (issue 17, item 2): Exec on a pty allocated inside the session, `sandboxctl shell`
and `sandboxctl exec -t`, driven as a person would (tmux on a private socket) and through the
API, against a real daemon and, for the kernel-facing part, on both call paths (the native
helper and the Python reference, as test_call_paths.py selects them)."""

from __future__ import annotations

import collections
import errno
import fcntl
import os
import queue
import shlex
import shutil
import signal
import socket
import struct
import subprocess
import termios
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from conftest import BASE_ENV, SLOW
from daemon_fixtures import REPO, base, client, daemon, ws  # noqa: F401 - pytest fixtures
from daemon_helpers import Daemon, DaemonFactory, PlainUser, run_client_as
from sandboxd.client import SandboxClient
from sandboxd.errors import InvalidPolicy, SetupError
from sandboxd.kernel import terminals
from sandboxd.policy import DangerFullAccess, LaunchSpec, Limits, WorkspaceWrite
from sandboxd.policy.limits import DEFAULT_PTYS
from sandboxd.service.terminal_call import receive_master
from sandboxd.supervisor.fork_client import ForkServer
from sandboxd.v1 import sandboxd_pb2 as pb
from test_call_paths import server, session  # noqa: F401 - pytest fixtures (both call paths)

pytestmark = pytest.mark.timeout(180)

SANDBOXCTL = str(REPO / ".venv" / "bin" / "sandboxctl")
WITHIN = 20 * SLOW

# Run inside the sandbox: what a terminal looks like from there, and TIOCSTI / TIOCLINUX tried on
# it, and TIOCSETD (a line discipline: N_TTY, which every pty has already; the filter cannot read
# the number, so it refuses them all).
PROBE = r"""
import errno, fcntl, os, struct, sys, termios
def attempt(request, argument):
    try:
        fcntl.ioctl(0, request, argument)
        return "allowed"
    except OSError as exc:
        return errno.errorcode[exc.errno]
print("tty", os.ttyname(0), os.ttyname(1), os.ttyname(2))
print("leader", os.getsid(0) == os.getpid(), os.tcgetpgrp(0) == os.getpgrp())
print("pts", sorted(os.listdir("/dev/pts")))
print("devpts", os.stat("/dev/pts").st_dev)
print("size", os.get_terminal_size(0).lines, os.get_terminal_size(0).columns)
print("winsz", attempt(termios.TIOCGWINSZ, bytes(8)) == "allowed")
print("sti", attempt(termios.TIOCSTI, b"x"))
print("linux", attempt(0x541C, bytes([2])))
print("setd", attempt(termios.TIOCSETD, struct.pack("i", 0)))
print("typed", sys.stdin.readline().strip())
"""


# -- the kernel-facing part, on both call paths (a fork server and a session of its own) ----------


def read_until_hangup(master: int) -> str:
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError as exc:                            # EIO: the call's tree is gone
            assert exc.errno == errno.EIO
            break
        if not data:
            break
        chunks.append(data)
    return b"".join(chunks).decode(errors="replace").replace("\r\n", "\n")


def terminal_call(server: ForkServer, session: str, argv: list[str], cwd: str,  # noqa: F811
                  size: tuple[int, int] = (24, 80)) -> tuple[int, int]:
    """Start a terminal call as the daemon does; (call id, its master)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    try:
        fd = theirs.fileno()
        call_id, _ = server.call(session, argv, {**BASE_ENV, "TERM": "xterm"}, cwd, None, (fd, fd, fd), terminal=size)
        theirs.close()
        return call_id, receive_master(ours)
    finally:
        theirs.close()
        ours.close()


def test_the_terminal_is_the_sessions_own_and_refuses_tiocsti(server: ForkServer, session: str,  # noqa: F811
                                                              workspace: Path) -> None:
    """The command leads its own session with the pty as controlling terminal on 0, 1 and 2; the pty
    is /dev/pts/0 of the session's devpts (the host's terminals are not there, though the host has
    one open right now); TIOCSTI, TIOCLINUX and TIOCSETD fail with EPERM while another ioctl on the
    same terminal works; typed input reaches the command. Control: TIOCSETD to N_TTY on one of the
    host's ptys, outside any sandbox, works (the EPERM inside is the filter's)."""
    host_ptys = [os.openpty(), os.openpty()]              # the control: the host has ptys open right now
    try:
        assert len(os.listdir("/dev/pts")) >= 3
        fcntl.ioctl(host_ptys[0][1], termios.TIOCSETD, struct.pack("i", 0))     # N_TTY: allowed on the host
        call_id, master = terminal_call(server, session, ["python3", "-c", PROBE], str(workspace), (33, 101))
        try:
            os.write(master, b"typed here\n")
            output = read_until_hangup(master)
        finally:
            os.close(master)
        info = server.wait(call_id)
    finally:
        for pair in host_ptys:
            for fd in pair:
                os.close(fd)
    lines = dict(line.split(" ", 1) for line in output.splitlines() if line.split(" ", 1)[0] in
                 ("tty", "leader", "pts", "devpts", "size", "winsz", "sti", "linux", "setd", "typed"))
    assert int(lines.pop("devpts", "0")) not in (0, os.stat("/dev/pts").st_dev), output   # another devpts
    assert info.exit_code == 0, output
    assert lines == {"tty": "/dev/pts/0 /dev/pts/0 /dev/pts/0", "leader": "True True", "pts": "['0', 'ptmx']",
                     "size": "33 101", "winsz": "True", "sti": "EPERM", "linux": "EPERM", "setd": "EPERM",
                     "typed": "typed here"}, output


@pytest.mark.parametrize("size", [(0, 80), (24, 1001), (True, 80)])
def test_the_fork_server_refuses_a_bad_terminal(server: ForkServer, session: str, workspace: Path,  # noqa: F811
                                                size: tuple[int, int]) -> None:
    """Checked again at the fork server's edge (the daemon checks first): nothing starts."""
    with pytest.raises(InvalidPolicy, match="a terminal is \\[rows, columns\\], each 1 to 1000"):
        terminal_call(server, session, ["true"], str(workspace), size)


def test_full_access_sessions_get_a_terminal_too(server: ForkServer, workspace: Path) -> None:  # noqa: F811
    """danger-full-access has no devpts of its own (it is the host as it is): its terminal comes
    from the host's, still with the command as session leader and TIOCSTI refused."""
    name = f"full-{os.urandom(4).hex()}"
    server.open_session(name, LaunchSpec(argv=("true",), workspace=str(workspace), env=dict(BASE_ENV),
                                         policy=DangerFullAccess()))
    try:
        call_id, master = terminal_call(server, name, ["python3", "-c", PROBE], str(workspace), (20, 60))
        try:
            os.write(master, b"full\n")
            output = read_until_hangup(master)
        finally:
            os.close(master)
        assert server.wait(call_id).exit_code == 0, output
    finally:
        server.close_session(name)
    for line in ("leader True True", "size 20 60", "winsz True", "sti EPERM", "linux EPERM", "typed full",
                 "setd allowed"):                         # the host as it is: its own user may (not confined)
        assert line in output.splitlines(), output


def test_resize_reaches_a_full_screen_program(server: ForkServer, session: str, workspace: Path) -> None:  # noqa: F811
    """TIOCSWINSZ on the master (what a resize message does) sends SIGWINCH to the program, which
    reads the new size."""
    waits = ("import os, signal\nsignal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGWINCH})\n"
             "print('ready', *os.get_terminal_size(0), flush=True)\nsignal.sigwait({signal.SIGWINCH})\n"
             "print('resized', *os.get_terminal_size(0), flush=True)\n")
    call_id, master = terminal_call(server, session, ["python3", "-c", waits], str(workspace), (24, 80))
    try:
        seen = b""
        while b"ready" not in seen:
            seen += os.read(master, 4096)
        terminals.set_size(master, 50, 132)
        output = seen.decode() + read_until_hangup(master)
    finally:
        os.close(master)
    assert server.wait(call_id).exit_code == 0, output
    assert "ready 80 24" in output and "resized 132 50" in output, output


def test_ctrl_c_interrupts_the_foreground_command(server: ForkServer, session: str,  # noqa: F811
                                                  workspace: Path) -> None:
    """^C typed into the terminal is SIGINT to its foreground process group (the line discipline
    in the session, not a signal from the daemon)."""
    call_id, master = terminal_call(server, session, ["sh", "-c", "echo go; exec sleep 60"], str(workspace))
    try:
        seen = b""
        while b"go" not in seen:
            seen += os.read(master, 4096)
        os.write(master, b"\x03")                         # to sh or the sleep it became: either dies of it
        read_until_hangup(master)
    finally:
        os.close(master)
    assert server.wait(call_id).signal == signal.SIGINT


# -- through the daemon: the API, and sandboxctl as a person types it (tmux) ---------------------


class Tmux:
    """A tmux server on a private socket (never anyone else's), one window running a command."""

    def __init__(self, directory: Path, command: str, width: int = 100, height: int = 30) -> None:
        self.socket = str(directory / f"tmux-{os.urandom(3).hex()}.sock")
        self.run("new-session", "-d", "-s", "t", "-x", str(width), "-y", str(height),
                 f"{command}; echo EXIT=$?; sleep 600")

    def run(self, *args: str) -> str:
        return subprocess.run(["tmux", "-S", self.socket, *args], check=True, capture_output=True, text=True,
                              timeout=30, env={**BASE_ENV, "TERM": "xterm-256color"}).stdout

    def keys(self, *keys: str) -> None:
        self.run("send-keys", "-t", "t", *keys)

    def type(self, line: str) -> None:
        self.run("send-keys", "-t", "t", "-l", line)
        self.keys("Enter")

    def screen(self) -> str:
        return self.run("capture-pane", "-p", "-t", "t")

    def expect(self, found: Callable[[str], bool] | str, within: float = WITHIN) -> str:
        test = (lambda text: found in text) if isinstance(found, str) else found
        deadline = time.monotonic() + within
        while not test(screen := self.screen()):
            assert time.monotonic() < deadline, f"not on the screen within {within} s:\n{screen}"
            time.sleep(0.05)
        return screen

    def close(self) -> None:
        subprocess.run(["tmux", "-S", self.socket, "kill-server"], capture_output=True, timeout=30)
        Path(self.socket).unlink(missing_ok=True)


@pytest.fixture
def tmux(base: Path) -> Iterator[Callable[[str], Tmux]]:  # noqa: F811
    assert shutil.which("tmux"), "tmux is installed by packaging/setup.sh test"
    opened: list[Tmux] = []

    def start(command: str) -> Tmux:
        opened.append(Tmux(base, command))
        return opened[-1]

    yield start
    for each in opened:
        each.close()


def ctl_command(daemon: Daemon, *args: str) -> str:  # noqa: F811
    return shlex.join([SANDBOXCTL, "--socket", daemon.socket, *args])


def open_session(client: SandboxClient, workspace: Path) -> str:  # noqa: F811
    return client.create_session(str(workspace), approval="never").id


def test_a_person_uses_sandboxctl_shell(daemon: Daemon, client: SandboxClient, ws: Path,  # noqa: F811
                                        tmux: Callable[[str], Tmux]) -> None:
    """In the workspace, a Python REPL, a `read` prompt, Ctrl-C on a running command, a resize
    seen by `stty size`, and the shell's exit status as sandboxctl's."""
    session_id = open_session(client, ws)
    term = tmux(ctl_command(daemon, "shell", session_id))
    term.expect("@sandbox:")                              # bash's prompt: user@host:cwd
    term.type("pwd; tty")
    term.expect(f"{ws}\n/dev/pts/0")
    term.type("python3 -q")
    term.expect(lambda text: text.rstrip().endswith(">>>"))
    term.type("6*7")
    term.expect("\n42\n>>>")
    term.keys("C-d")
    term.type('read -p "name? " who; echo "hello $who"')
    term.expect(lambda text: text.rstrip().endswith("name?"))
    term.type("Ada")
    term.expect("hello Ada")
    term.type("sleep 600; echo NOT-INTERRUPTED | tr A-Z a-z")
    time.sleep(0.3)
    term.keys("C-c")
    term.type("echo after-interrupt")
    screen = term.expect(lambda text: "\nafter-interrupt" in text)
    assert "not-interrupted" not in screen
    term.run("resize-window", "-t", "t", "-x", "77", "-y", "19")
    term.type("stty size")
    term.expect("\n19 77\n")
    term.type("exit 3")
    term.expect("EXIT=3")


def test_exec_t_runs_one_command_on_a_terminal(daemon: Daemon, client: SandboxClient, ws: Path,  # noqa: F811
                                               tmux: Callable[[str], Tmux]) -> None:
    """`exec -t`: the command sees a terminal of the local size and TERM; its status passes through.
    Without a local terminal, `shell` and `exec -t` say so in one line and exit 2."""
    session_id = open_session(client, ws)
    probe = "test -t 0 && test -t 1 && echo on-a-tty; tput lines; tput cols; echo TERM=$TERM; exit 5"
    term = tmux(ctl_command(daemon, "exec", "-t", session_id, "--", "sh", "-c", probe))
    term.expect("EXIT=5")
    assert "on-a-tty\n30\n100\nTERM=tmux-256color" in term.screen()   # the local TERM (tmux sets it)
    for args in (["shell", session_id], ["exec", "-t", session_id, "--", "true"]):
        refused = subprocess.run([SANDBOXCTL, "--socket", daemon.socket, *args], stdin=subprocess.DEVNULL,
                                 capture_output=True, text=True, timeout=60)
        assert refused.returncode == 2 and refused.stdout == "", refused
        assert len(refused.stderr.splitlines()) == 1 and "needs a terminal" in refused.stderr


def exec_t_on_a_pty(daemon: Daemon, session_id: str, size: tuple[int, int] | None) -> tuple[int, str]:  # noqa: F811
    """`sandboxctl exec -t SESSION -- stty size` on a fresh pty of ``size`` (None: as a new pty is, 0x0,
    the size CI's `script` and some `docker exec -t` report): its exit status and what it printed."""
    master, slave = os.openpty()
    try:
        if size is not None:
            terminals.set_size(master, *size)
        assert terminals.get_size(slave) == (size or (0, 0))
        ctl = subprocess.Popen([SANDBOXCTL, "--socket", daemon.socket, "exec", "-t", session_id, "--", "stty", "size"],
                               stdin=slave, stdout=slave, stderr=slave, start_new_session=True)
        os.close(slave)
        slave = -1
        output = read_until_hangup(master)
        return ctl.wait(timeout=WITHIN), output
    finally:
        os.close(master)
        if slave >= 0:
            os.close(slave)


def test_a_terminal_of_unknown_size_is_24_by_80(daemon: Daemon, client: SandboxClient, ws: Path) -> None:  # noqa: F811
    """A local terminal that reports 0x0 (unknown) got INVALID_ARGUMENT: now the command gets 24 rows
    and 80 columns, from `sandboxctl exec -t` and over the API (0 is proto3's unset). The control: a
    terminal that knows its size passes it on."""
    session_id = open_session(client, ws)
    status, output = exec_t_on_a_pty(daemon, session_id, None)
    assert status == 0 and "24 80" in output, (status, output)
    status, output = exec_t_on_a_pty(daemon, session_id, (30, 100))
    assert status == 0 and "30 100" in output, (status, output)
    for terminal in (pb.Terminal(), pb.Terminal(rows=0, columns=0, term="vt100"), pb.Terminal(rows=0, columns=132)):
        output, result = exec_on_terminal(client, pb.ExecStart(session_id=session_id, argv=["stty", "size"],
                                                               terminal=terminal))
        assert result.exit_code == 0 and output.strip() == f"24 {terminal.columns or 80}", (terminal, output)


def exec_on_terminal(client: SandboxClient, start: pb.ExecStart,  # noqa: F811
                     inputs: tuple[pb.ExecRequest, ...] = ()) -> tuple[str, pb.ExecResult]:
    """One Exec with a terminal over the API; ``inputs`` follow the start, then the stream stays
    open until the result (a terminal's input may come any time)."""
    requests: queue.Queue[pb.ExecRequest | None] = queue.Queue()
    for request in (pb.ExecRequest(start=start), *inputs):
        requests.put(request)

    def stream() -> Iterator[pb.ExecRequest]:
        while (request := requests.get()) is not None:
            yield request

    output, result = b"", None
    try:
        for response in client.stub.Exec(stream(), timeout=WITHIN * 3):
            if response.WhichOneof("kind") == "stdout":
                output += response.stdout
            elif response.WhichOneof("kind") == "result":
                result = response.result
    finally:
        requests.put(None)
    assert result is not None
    return output.decode(errors="replace").replace("\r\n", "\n"), result


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def fd_kinds(pid: int) -> "collections.Counter[str]":
    """What ``pid`` holds, by kind (``socket``, ``pipe``, ``/dev/ptmx``, an anonymous inode's type,
    a file's path), less the audit store's database files: SQLite opens its journal and shared
    memory when it needs them, which is no terminal call's doing."""
    kinds: collections.Counter[str] = collections.Counter()
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{name}")
        except FileNotFoundError:
            continue                                   # closed while listed
        kind = target.split(":[", 1)[0] if ":[" in target else target
        if not kind.endswith((".db", ".db-wal", ".db-shm", ".sqlite", "-journal")):
            kinds[kind] += 1
    return kinds


def test_nothing_is_left_after_a_terminal_call(daemon: Daemon, client: SandboxClient, ws: Path) -> None:  # noqa: F811
    """The daemon and the fork server hold as many descriptors after terminal calls as before (the
    master, the channel, the wake-up pipe all closed), including a call timed out, a client gone
    mid-call, a call whose child keeps the terminal open past its command's end, and the output limit."""
    session_id = open_session(client, ws)
    warm = pb.ExecStart(session_id=session_id, argv=["true"], terminal=pb.Terminal(rows=24, columns=80))
    exec_on_terminal(client, warm)
    fork_pid = daemon.fork_server_pid()
    assert fork_pid is not None
    before = (fd_kinds(daemon.pid), fd_kinds(fork_pid))
    # A background child holding the terminal dies with the call (its tree is killed), so the relay ends.
    output, result = exec_on_terminal(client, pb.ExecStart(
        session_id=session_id, shell="(sleep 600 &); echo left-a-child",
        terminal=pb.Terminal(rows=24, columns=80)))
    assert "left-a-child" in output and result.exit_code == 0
    output, result = exec_on_terminal(client, pb.ExecStart(
        session_id=session_id, argv=["sh", "-c", "yes | head -c 300000"], output_limit_bytes=1000,
        terminal=pb.Terminal(rows=24, columns=80)))
    assert result.output_truncated and len(output) <= 1000
    output, result = exec_on_terminal(client, pb.ExecStart(
        session_id=session_id, argv=["sleep", "600"], timeout_seconds=1, terminal=pb.Terminal(rows=24, columns=80)))
    assert result.timed_out
    gone = client.stub.Exec(iter([pb.ExecRequest(start=pb.ExecStart(
        session_id=session_id, argv=["sleep", "600"], terminal=pb.Terminal(rows=24, columns=80)))]))
    assert next(gone).WhichOneof("kind") == "started_pid"
    assert daemon.call_inits()                            # the control: the call runs
    gone.cancel()                                         # the client goes away: the call's tree is killed
    deadline = time.monotonic() + WITHIN
    while (after := (fd_kinds(daemon.pid), fd_kinds(fork_pid))) != before and time.monotonic() < deadline:
        time.sleep(0.05)                                  # the stdin feeder ends with the stream
    assert after == before, (f"daemon: {after[0] - before[0]} more, {before[0] - after[0]} fewer; "
                             f"fork server: {after[1] - before[1]} more, {before[1] - after[1]} fewer")
    assert not daemon.call_inits()


@pytest.mark.parametrize("terminal, fix", [
    (pb.Terminal(rows=1001, columns=80), "rows and columns from 1 to 1000"),
    (pb.Terminal(rows=24, columns=5000), "rows and columns from 1 to 1000"),
    (pb.Terminal(rows=24, columns=80, term="xterm; rm -rf /"), "terminal type name"),
])
def test_bad_terminals_are_invalid_argument(client: SandboxClient, ws: Path, terminal: pb.Terminal,  # noqa: F811
                                            fix: str) -> None:
    session_id = open_session(client, ws)
    with pytest.raises(grpc.RpcError) as raised:
        exec_on_terminal(client, pb.ExecStart(session_id=session_id, argv=["true"], terminal=terminal))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT and fix in (raised.value.details() or "")


def test_each_sessions_terminals_are_its_own(client: SandboxClient, base: Path,  # noqa: F811
                                             plain_users: Callable[[int], list[PlainUser]]) -> None:
    """Two users' sessions, each with a terminal open at once: each command runs as its user on a
    /dev/pts/0 that user owns, in a devpts that shows no other terminal (the other session's,
    the host's). The control: the first session's terminal is really open meanwhile (it answers)."""
    first, second = plain_users(2)
    sessions = []
    for user in (first, second):
        workspace = base / f"tty-{user.name}"
        workspace.mkdir()
        os.chown(workspace, user.uid, user.gid)
        sessions.append(open_session(client, workspace))
    held: queue.Queue[pb.ExecRequest | None] = queue.Queue()
    held.put(pb.ExecRequest(start=pb.ExecStart(session_id=sessions[0], terminal=pb.Terminal(rows=24, columns=80),
                                               shell="stat -c 'first %U' /dev/pts/0; read line; echo got $line")))
    seen: list[bytes] = []

    def hold() -> None:
        def stream() -> Iterator[pb.ExecRequest]:
            while (request := held.get()) is not None:
                yield request
        for response in client.stub.Exec(stream(), timeout=WITHIN * 3):
            seen.append(response.stdout)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        deadline = time.monotonic() + WITHIN
        while f"first {first.name}" not in b"".join(seen).decode():
            assert time.monotonic() < deadline, b"".join(seen)
            time.sleep(0.05)
        output, result = exec_on_terminal(client, pb.ExecStart(
            session_id=sessions[1], terminal=pb.Terminal(rows=24, columns=80),
            shell="id -un; tty; stat -c %U /dev/pts/0; ls /dev/pts"))
        assert result.exit_code == 0 and output.split() == [second.name, "/dev/pts/0", second.name, "0", "ptmx"]
        held.put(pb.ExecRequest(stdin=b"still-open\n"))
        holder.join(WITHIN)
        assert "got still-open" in b"".join(seen).decode()
    finally:
        held.put(None)
        holder.join(WITHIN)
        for session_id in sessions:                       # their processes run as the users, removed next
            client.close_session(session_id)


# -- bounded terminals (issue 24, part 4): each session's devpts holds limits.session_ptys ---------

# Run in a sandbox: open terminals until the kernel refuses one, say how many and why, then hold
# them (a background job, or a call the test ends by closing its stdin).
HOARD = r"""
import errno, os, sys, time
held = []
while True:
    try:
        held.append(os.openpty())
    except OSError as exc:
        print("held", len(held), errno.errorcode[exc.errno], len(os.listdir("/dev/pts")) - 1, flush=True)
        break
sys.stdin.read() if sys.argv[1:] == ["until-eof"] else time.sleep(600)
"""


def hoard(server: ForkServer, session: str, workspace: Path) -> tuple[int, str, int]:  # noqa: F811
    """Start HOARD in ``session`` on the fork server: (its call, what it says, its stdin's write end)."""
    stdin_r, stdin_w = os.pipe()
    out_r, out_w = os.pipe()
    try:
        call_id, _ = server.call(session, ["python3", "-c", HOARD, "until-eof"], dict(BASE_ENV), str(workspace), None,
                                 (stdin_r, out_w, out_w))
    finally:
        os.close(stdin_r)
        os.close(out_w)
    with os.fdopen(out_r) as output:
        line = output.readline().strip()
    return call_id, line, stdin_w


def test_a_sessions_devpts_holds_its_limit_and_no_more(server: ForkServer, session: str,  # noqa: F811
                                                       workspace: Path) -> None:
    """A confined command opens terminals until it fails: it gets ENOSPC inside its own sandbox once
    its devpts holds Limits.ptys (policy.limits.DEFAULT_PTYS, 8), and a terminal call into that session
    meanwhile fails at its `open terminal` step with ENOSPC (the daemon says which limit). Control: a
    session given a wider limit holds that many, so the number is the devpts' max=, not another limit."""
    call_id, line, stdin_w = hoard(server, session, workspace)
    try:
        assert line == f"held {DEFAULT_PTYS} ENOSPC {DEFAULT_PTYS}", line
        with pytest.raises(SetupError) as full:
            terminal_call(server, session, ["true"], str(workspace))
        assert (full.value.step, full.value.errno) == ("open terminal", errno.ENOSPC), full.value
    finally:
        os.close(stdin_w)
    assert server.wait(call_id).exit_code == 0
    call_id, master = terminal_call(server, session, ["tty"], str(workspace))    # released: there is room again
    try:
        assert read_until_hangup(master).strip().startswith("/dev/pts/")
    finally:
        os.close(master)
    server.wait(call_id)
    wider = f"wide-{os.urandom(4).hex()}"
    server.open_session(wider, LaunchSpec(argv=("true",), workspace=str(workspace), env=dict(BASE_ENV),
                                          policy=WorkspaceWrite(), limits=Limits(ptys=3 * DEFAULT_PTYS)))
    try:
        call_id, line, stdin_w = hoard(server, wider, workspace)
        os.close(stdin_w)
        assert line == f"held {3 * DEFAULT_PTYS} ENOSPC {3 * DEFAULT_PTYS}", line
        server.wait(call_id)
    finally:
        server.close_session(wider)


ATTACKER = r'''
import time
session = stub.CreateSession(pb.CreateSessionRequest(workspace=ARGS["ws"], approval_policy=pb.NEVER), timeout=120).id
job = stub.StartBackground(pb.StartBackgroundRequest(session_id=session, argv=["python3", "-c", ARGS["hoard"]]),
                           timeout=120)
said = b""
for chunk in stub.ReadBackgroundOutput(pb.ReadBackgroundOutputRequest(session_id=session, id=job.id, follow=True),
                                       timeout=120):
    said += chunk.data
    if b"\n" in said:
        break
own = pb.ExecStart(session_id=session, argv=["tty"], terminal=pb.Terminal(rows=24, columns=80))
try:
    list(stub.Exec(iter([pb.ExecRequest(start=own)]), timeout=120))
    own_terminal = ["OK", ""]
except grpc.RpcError as error:
    own_terminal = [error.code().name, error.details()]
print(json.dumps({"session": session, "said": said.decode().strip(), "own_terminal": own_terminal}))
'''

VICTIM_SHELL = r'''
session = stub.CreateSession(pb.CreateSessionRequest(workspace=ARGS["ws"], approval_policy=pb.NEVER), timeout=120).id
start = pb.ExecStart(session_id=session, shell="tty; echo served", terminal=pb.Terminal(rows=24, columns=80))
output, result = b"", None
for response in stub.Exec(iter([pb.ExecRequest(start=start)]), timeout=120):
    if response.WhichOneof("kind") == "stdout":
        output += response.stdout
    elif response.WhichOneof("kind") == "result":
        result = response.result.exit_code
stub.CloseSession(pb.CloseSessionRequest(session_id=session), timeout=120)
print(json.dumps({"output": output.decode().split(), "exit": result}))
'''


def pty_attack(daemon: Daemon, attacker: PlainUser, victim: PlainUser) -> tuple[dict[str, Any], dict[str, Any]]:
    """The attacker's sandbox hoards terminals (a background job keeps them); then the victim opens
    a terminal in a session of its own. (What each saw.)"""
    workspaces = {}
    for user in (attacker, victim):
        workspaces[user.name] = daemon.base / f"tty-{user.name}-{os.urandom(3).hex()}"
        workspaces[user.name].mkdir()
        os.chown(workspaces[user.name], user.uid, user.gid)
    attack = run_client_as(attacker.uid, attacker.gid, daemon.socket, ATTACKER,
                           {"ws": str(workspaces[attacker.name]), "hoard": HOARD})
    try:
        served = run_client_as(victim.uid, victim.gid, daemon.socket, VICTIM_SHELL, {"ws": str(workspaces[victim.name])})
    finally:
        daemon.stub.CloseSession(pb.CloseSessionRequest(session_id=attack["session"]), timeout=60)
    return attack, served


def test_one_sandbox_cannot_take_another_users_terminals(sandboxd_daemon: DaemonFactory,
                                                         plain_users: Callable[[int], list[PlainUser]]) -> None:
    """The attack of issue 24 (a confined command opened every pty the kernel's pool for devpts
    instances holds, 3,071, and another user's `sandboxctl shell` failed with ENOSPC): the command
    now gets ENOSPC in its own sandbox at limits.session_ptys (8 by default), its owner's next
    terminal there is refused with RESOURCE_EXHAUSTED naming the key, and the victim's terminal works
    while the attacker holds its 8. Control: with the key raised to 64 the same command holds 64, so
    it is the key that stops it (each one came out of the kernel-wide pool)."""
    attacker, victim = plain_users(2)
    attack, served = pty_attack(sandboxd_daemon(), attacker, victim)
    assert attack["said"] == f"held {DEFAULT_PTYS} ENOSPC {DEFAULT_PTYS}", attack
    code, details = attack["own_terminal"]
    assert code == "RESOURCE_EXHAUSTED" and "limits.session_ptys" in details and f"({DEFAULT_PTYS}," in details, attack
    assert served == {"output": ["/dev/pts/0", "served"], "exit": 0}, served
    control = sandboxd_daemon(config="[limits]\nsession_ptys = 64\n",
                              socket=sandboxd_daemon.base / "control" / "sandboxd.sock")
    wider, served = pty_attack(control, attacker, victim)
    assert wider["said"] == "held 64 ENOSPC 64", wider
    assert served == {"output": ["/dev/pts/0", "served"], "exit": 0}, served


TWO_TERMINALS = r'''
import threading, time
session = stub.CreateSession(pb.CreateSessionRequest(workspace=ARGS["ws"], approval_policy=pb.NEVER), timeout=120).id
release = threading.Event()
def held_requests():
    yield pb.ExecRequest(start=pb.ExecStart(session_id=session, shell="echo holding; read line",
                                            terminal=pb.Terminal(rows=24, columns=80)))
    release.wait()
    yield pb.ExecRequest(stdin=b"done\n")
first = stub.Exec(held_requests(), timeout=120)
said = b""
for response in first:
    said += response.stdout
    if b"holding" in said:
        break
def attempt(start):
    try:
        return [r.result.exit_code for r in stub.Exec(iter([pb.ExecRequest(start=start)]), timeout=120)
                if r.WhichOneof("kind") == "result"]
    except grpc.RpcError as error:
        return [error.code().name, error.details()]
second = attempt(pb.ExecStart(session_id=session, argv=["true"], terminal=pb.Terminal(rows=24, columns=80)))
plain = attempt(pb.ExecStart(session_id=session, argv=["true"]))
release.set()
list(first)
after = attempt(pb.ExecStart(session_id=session, argv=["true"], terminal=pb.Terminal(rows=24, columns=80)))
stub.CloseSession(pb.CloseSessionRequest(session_id=session), timeout=120)
print(json.dumps({"second": second, "plain": plain, "after": after}))
'''


def test_terminal_calls_are_counted_per_owner(sandboxd_daemon: DaemonFactory,
                                              plain_users: Callable[[int], list[PlainUser]]) -> None:
    """quotas.terminals_per_uid (1 here): with one terminal call open, the owner's next is refused
    naming the key, while a call without a terminal runs (control) and, once the first ended, a
    terminal call runs again."""
    daemon = sandboxd_daemon(config="[quotas]\nterminals_per_uid = 1\n")
    (user,) = plain_users(1)
    ws = daemon.base / f"term-{user.name}"
    ws.mkdir()
    os.chown(ws, user.uid, user.gid)
    seen = run_client_as(user.uid, user.gid, daemon.socket, TWO_TERMINALS, {"ws": str(ws)})
    code, details = seen["second"]
    assert code == "RESOURCE_EXHAUSTED" and "quotas.terminals_per_uid" in details, seen
    assert seen["plain"] == [0] and seen["after"] == [0], seen
