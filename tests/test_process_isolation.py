"""Process isolation: namespaces, host processes, PID 1, leftovers, environment, descriptors, sessions."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import subprocess
import termios
import time
from pathlib import Path

import pytest

from conftest import (
    ALL_POLICIES,
    BASE_ENV,
    CONFINED,
    EXIT_TIMEOUT,
    SLOW,
    POLICY_ARGS,
    SANDBOXD,
    describe,
    kill_marked,
    pids_with_marker,
    py,
    run_sbx,
    wait_until_gone,
)

NAMESPACES = ("mnt", "pid", "ipc", "uts", "cgroup", "net")


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_namespaces(policy: str, workspace: Path) -> None:
    """Confined policies get new mnt/pid/ipc/uts/cgroup namespaces and a new net ns unless --network;
    danger-full-access shares all of the host's."""
    script = "import json, os\nprint(json.dumps({n: os.readlink('/proc/self/ns/' + n) for n in %r}))" % (
        NAMESPACES,)
    result = run_sbx(py(script), workspace=workspace, policy=policy)
    assert result.returncode == 0, describe(result)
    inside = json.loads(result.stdout)
    host = {n: os.readlink(f"/proc/self/ns/{n}") for n in NAMESPACES}
    for name in NAMESPACES:
        if policy == "danger-full-access" or (name == "net" and policy == "workspace-write+network"):
            assert inside[name] == host[name], f"{name} should be the host's"
        else:
            assert inside[name] != host[name], f"{name} namespace is shared with the host"


@pytest.mark.parametrize("policy", CONFINED)
def test_host_process_invisible_and_unkillable(policy: str, workspace: Path,
                                               host_sleeper: subprocess.Popen[bytes]) -> None:
    """A host process is absent from /proc, kill -0 and kill -9 fail, kill(-1, SIGKILL) spares it."""
    pid = host_sleeper.pid
    script = f"""
import errno, os, signal
print('exists', os.path.exists('/proc/{pid}'))
for sig in (0, signal.SIGKILL):
    try:
        os.kill({pid}, sig); print('kill', sig, 'OK')
    except OSError as e:
        print('kill', sig, errno.errorcode[e.errno])
try:
    os.kill(-1, signal.SIGKILL)
except OSError as e:
    print('kill -1', errno.errorcode[e.errno])
"""
    result = run_sbx(py(script), workspace=workspace, policy=policy)
    assert "exists False" in result.stdout, describe(result)
    assert "kill 0 ESRCH" in result.stdout and "kill 9 ESRCH" in result.stdout, describe(result)
    time.sleep(0.05)
    assert host_sleeper.poll() is None, "the host process was killed from inside the sandbox"


def test_danger_full_access_sees_host_pids(workspace: Path, host_sleeper: subprocess.Popen[bytes]) -> None:
    """Control: danger-full-access shares the host PID namespace (sees and may signal the host process)."""
    pid = host_sleeper.pid
    result = run_sbx(["sh", "-c", f"test -e /proc/{pid} && kill -0 {pid} && echo SEEN"], workspace=workspace,
                     policy="danger-full-access")
    assert result.returncode == 0 and result.stdout == "SEEN\n", describe(result)


@pytest.mark.parametrize("policy", CONFINED)
def test_pid1_is_sandboxd_init_and_reaps_orphans(policy: str, workspace: Path) -> None:
    """PID 1 inside is sandboxd's init and it reaps orphans: no zombie remains after a double fork."""
    script = r"""
import os, time
if os.fork() == 0:
    if os.fork() == 0:
        os._exit(0)          # the grandchild: orphaned to PID 1, exits at once
    os._exit(0)
os.wait()
time.sleep(0.3)
zombies = []
for p in os.listdir('/proc'):
    if p.isdigit():
        try:
            state = open(f'/proc/{p}/stat').read().rsplit(')', 1)[1].split()[0]
        except OSError:
            continue
        if state == 'Z':
            zombies.append(p)
print('comm', open('/proc/1/comm').read().strip())
print('ppid', os.getppid())
print('zombies', len(zombies))
"""
    result = run_sbx(py(script), workspace=workspace, policy=policy)
    assert result.returncode == 0, describe(result)
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    assert lines["comm"].startswith("sandboxd"), describe(result)
    assert lines["ppid"] == "1"
    assert lines["zombies"] == "0", describe(result)


# A command that double-forks a daemon (new session, reparented to init), waits until it runs, then either
# exits or sleeps. The daemon carries MARKER-daemon in its command line; the command itself does not.
DAEMON = r"""
import os, sys, time
marker, then = sys.argv[1], sys.argv[2]
tag = (marker + '-daemon').encode()
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv('/usr/bin/python3', ['/usr/bin/python3', '-c', 'import time; time.sleep(120)', tag.decode()])
    os._exit(0)
os.wait()
for _ in range(500):
    found = False
    for p in os.listdir('/proc'):
        if p.isdigit():
            try:
                found = found or tag in open(f'/proc/{p}/cmdline', 'rb').read()
            except OSError:
                pass
    if found:
        break
    time.sleep(0.01)
print('DAEMON-RUNNING' if found else 'DAEMON-MISSING', flush=True)
if then == 'sleep':
    time.sleep(60)
"""


@pytest.mark.parametrize("policy", CONFINED)
def test_double_forked_daemon_dies_when_command_exits(policy: str, workspace: Path, marker: str) -> None:
    """Everything in a confined sandbox is killed when the command exits, double-forked daemons included."""
    try:
        result = run_sbx(py(DAEMON, marker, "exit"), workspace=workspace, policy=policy)
        assert result.returncode == 0 and "DAEMON-RUNNING" in result.stdout, describe(result)
        assert wait_until_gone(marker + "-daemon") == [], "the daemon outlived the sandbox"
    finally:
        kill_marked(marker)


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_double_forked_daemon_dies_on_timeout(policy: str, workspace: Path, marker: str) -> None:
    """On timeout the whole tree is killed (exit 124), including a setsid'd daemon, under every policy."""
    try:
        started = time.monotonic()
        timeout = 1.5 * SLOW                     # time for the daemon to start and say so first
        result = run_sbx(py(DAEMON, marker, "sleep"), workspace=workspace, policy=policy,
                         options=("--timeout", str(timeout)))
        elapsed = time.monotonic() - started
        assert result.returncode == EXIT_TIMEOUT, describe(result)
        assert "DAEMON-RUNNING" in result.stdout, describe(result)
        assert elapsed >= timeout  # killed at the deadline, not before
        assert wait_until_gone(marker + "-daemon") == [], "the daemon outlived the timeout"
        assert pids_with_marker(marker) == []
    finally:
        kill_marked(marker)


# --------------------------------------------------------------------------- environment

ENV_PRINT = ["/usr/bin/env", "-0"]


def parse_env0(text: str) -> dict[str, str]:
    return dict(item.split("=", 1) for item in text.split("\0") if item)


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_environment_is_named_variables_plus_env(policy: str, workspace: Path) -> None:
    """Without --clear-env the command sees PATH and the locale of the caller's environment, HOME,
    USER and LOGNAME of its user (root: the workspace is root's), what --pass-env names, and --env
    (which overrides); nothing else of the caller's (sandboxd/cli/run_env.py)."""
    caller = {**BASE_ENV, "SBX_KEEP": "kept value", "SBX_OVERRIDE": "old", "SBX_ODD": "a=b c\td",
              "SBX_NOT_NAMED": "secret"}
    result = run_sbx(ENV_PRINT, workspace=workspace, policy=policy, env=caller,
                     options=("--pass-env", "SBX_KEEP", "--pass-env", "SBX_ODD", "--pass-env", "SBX_OVERRIDE",
                              "--env", "SBX_OVERRIDE=new", "--env", "SBX_ADDED=x=y", "--env", "SBX_EMPTY="))
    assert result.returncode == 0, describe(result)
    # sandboxd's own SANDBOXD_* settings of the test daemons are the CLI's, never the command's.
    caller_own = {name: value for name, value in BASE_ENV.items() if not name.startswith("SANDBOXD_")}
    expected = {**caller_own, "USER": "root", "LOGNAME": "root", "SBX_KEEP": "kept value", "SBX_ODD": "a=b c\td",
                "SBX_OVERRIDE": "new", "SBX_ADDED": "x=y", "SBX_EMPTY": "",
                # HOME: a new one in the private /tmp, unless unconfined (run_env.PRIVATE_HOME).
                "HOME": "/root" if policy == "danger-full-access" else "/tmp/home"}
    assert parse_env0(result.stdout) == expected


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_clear_env_leaves_only_env(policy: str, workspace: Path) -> None:
    """With --clear-env the command sees only the --env variables."""
    caller = {**BASE_ENV, "SBX_CANARY": "must-not-pass"}
    result = run_sbx(ENV_PRINT, workspace=workspace, policy=policy, env=caller,
                     options=("--clear-env", "--env", "A=1", "--env", "B=two words"))
    assert result.returncode == 0, describe(result)
    assert parse_env0(result.stdout) == {"A": "1", "B": "two words"}


@pytest.mark.parametrize("policy", CONFINED)
def test_canary_never_visible_in_any_proc_environ(policy: str, workspace: Path) -> None:
    """A caller variable not passed (--clear-env) appears in no /proc/*/environ, /proc/1/environ included."""
    canary = "sbx-canary-7f3a9c"
    caller = {**BASE_ENV, "SBX_CANARY": canary}
    script = r"""
import os
canary = open('canary', 'rb').read()  # from a file: never on any command line
leaks, readable = [], []
for p in ['self', '1'] + [p for p in os.listdir('/proc') if p.isdigit()]:
    for name in ('environ', 'cmdline'):
        try:
            data = open(f'/proc/{p}/{name}', 'rb').read()
        except OSError:
            continue
        readable.append(f'{p}/{name}')
        if canary in data:
            leaks.append(f'{p}/{name}')
print('leaks', leaks)
print('pid1-environ-readable', '1/environ' in readable)
print('env-has-canary', any(canary in v.encode() for v in os.environ.values()))
"""
    (workspace / "canary").write_text(canary)
    result = run_sbx(py(script), workspace=workspace, policy=policy, env=caller, options=("--clear-env",))
    assert result.returncode == 0, describe(result)
    assert "leaks []" in result.stdout, describe(result)
    assert "env-has-canary False" in result.stdout, describe(result)


# --------------------------------------------------------------------------- descriptors


FD_LIST = "import os\nprint(' '.join(sorted(os.listdir('/proc/self/fd'), key=int)))"


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_only_stdio_descriptors_are_inherited(policy: str, workspace: Path, tmp_path: Path) -> None:
    """Extra descriptors of the caller (a file and a pipe, passed to sandboxd) are not inherited."""
    secret = tmp_path / "secret.txt"
    secret.write_text("secret\n")
    fd = os.open(secret, os.O_RDONLY)
    read_end, write_end = os.pipe()
    # The lowest free descriptors from 57 up, taken atomically: dup2 onto a fixed number could
    # take one another thread of this process was opening (EBUSY) or using.
    high_file, high_pipe = fcntl.fcntl(fd, fcntl.F_DUPFD, 57), fcntl.fcntl(write_end, fcntl.F_DUPFD, 57)
    try:
        result = run_sbx(py(FD_LIST), workspace=workspace, policy=policy, pass_fds=(high_file, high_pipe))
    finally:
        for d in (fd, read_end, write_end, high_file, high_pipe):
            os.close(d)
    assert result.returncode == 0, describe(result)
    fds = [int(x) for x in result.stdout.split()]
    assert fds[:3] == [0, 1, 2], fds
    assert len(fds) <= 4, f"descriptors beyond 0,1,2 (+ the one listdir uses): {fds}"


def test_control_pass_fds_reach_a_plain_child(tmp_path: Path) -> None:
    """Control: the same pass_fds do reach a plain (unsandboxed) child, so the test above can fail."""
    fd = os.open(tmp_path, os.O_RDONLY)
    try:
        os.dup2(fd, 57)
        result = subprocess.run(py(FD_LIST), capture_output=True, text=True, pass_fds=(57,), env=BASE_ENV)
    finally:
        os.close(fd)
        os.close(57)
    assert "57" in result.stdout.split()


# --------------------------------------------------------------------------- sessions and terminals

TTY_PROBE = r"""
import ctypes, errno, os
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
buf = ctypes.create_string_buffer(b'#')
for request in (0x5412, 0xFFFFFFFF00005412):
    r = libc.syscall(ctypes.c_long(16), ctypes.c_ulong(0), ctypes.c_ulong(request), buf)
    print('tiocsti', hex(request), r, errno.errorcode.get(ctypes.get_errno()) if r == -1 else 'OK')
try:
    os.close(os.open('/dev/tty', os.O_RDWR)); print('devtty OK')
except OSError as e:
    print('devtty', errno.errorcode[e.errno])
print('session-leader', os.getsid(0) == os.getpid())
print('stdin-is-tty', os.isatty(0))
"""


def run_with_controlling_tty(argv: list[str]) -> tuple[subprocess.CompletedProcess[str], bytes]:
    """Run ``argv`` with a fresh pty as its stdin *and controlling terminal*; return the run and what the pty got."""
    master, slave = pty.openpty()

    def become_tty_owner() -> None:
        os.setsid()
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    try:
        result = subprocess.run(argv, stdin=slave, capture_output=True, text=True, timeout=60, env=BASE_ENV,
                                preexec_fn=become_tty_owner)
        os.close(slave)
        slave = -1
        os.set_blocking(master, False)
        try:
            injected = os.read(master, 100)
        except OSError:
            injected = b""
        return result, injected
    finally:
        if slave >= 0:
            os.close(slave)
        os.close(master)


def test_control_tiocsti_works_on_a_controlling_tty() -> None:
    """Control: outside any sandbox the same probe can push input into its controlling terminal."""
    result, injected = run_with_controlling_tty(py(TTY_PROBE))
    assert "tiocsti 0x5412 0 OK" in result.stdout, describe(result)
    assert "devtty OK" in result.stdout and b"#" in injected


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_no_controlling_terminal_and_no_tiocsti(policy: str, workspace: Path) -> None:
    """Even when sandboxd runs on a terminal, the command is a session leader without a controlling tty,
    and TIOCSTI into that terminal fails with EPERM (also with garbage in the upper 32 bits)."""
    argv = [SANDBOXD, "run", *POLICY_ARGS[policy], "--workspace", str(workspace), "--", *py(TTY_PROBE)]
    result, injected = run_with_controlling_tty(argv)
    assert result.returncode == 0, describe(result)
    assert "tiocsti 0x5412 -1 EPERM" in result.stdout, describe(result)
    assert "tiocsti 0xffffffff00005412 -1 EPERM" in result.stdout, describe(result)
    assert "devtty ENXIO" in result.stdout, describe(result)
    assert "session-leader True" in result.stdout and "stdin-is-tty True" in result.stdout
    assert b"#" not in injected, "input was injected into the caller's terminal"
