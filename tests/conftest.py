"""Shared helpers for the sandboxd test suite.

Every enforcement test runs a real program inside a real sandbox through the
CLI (``sandboxd run ...``) and asserts on what that program saw or did, and,
where it matters, on the host state afterwards. Nothing is mocked.

Conventions:

* ``run_sbx([...command...], workspace=..., policy=...)`` runs one command in
  a sandbox and returns the ``CompletedProcess`` (text mode, captured).
* Policies are named by the ids in ``POLICY_ARGS``: ``read-only``,
  ``workspace-write``, ``workspace-write+network``, ``danger-full-access``.
* "Outside" targets live in a 0777 directory under /var/tmp, outside every
  writable root, so that only the sandbox (never file permissions) can be what
  stops a write. The host's /tmp is hidden inside the sandbox by a private
  tmpfs, so host-side helpers that must be visible inside live under /var/tmp.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:                                   # imported lazily: daemon_helpers imports this module
    from daemon_helpers import DaemonFactory, PlainUser

REPO = Path(__file__).resolve().parents[1]
_VENV_SANDBOXD = REPO / ".venv" / "bin" / "sandboxd"
SANDBOXD: str = str(_VENV_SANDBOXD) if _VENV_SANDBOXD.exists() else (shutil.which("sandboxd") or "sandboxd")

# The system interpreter: the same inside and outside, independent of pyenv shims.
PY = "/usr/bin/python3"

# How much slower than real hardware this machine runs: packaging/vm/guest-run sets 10 in an emulated
# (TCG) VM, where a Python start inside a sandbox takes a second or more. Tests whose command must
# get somewhere before a deadline they set (a --timeout, a call's timeout) scale that deadline by it;
# nothing is asserted about speed.
SLOW = float(os.environ.get("SANDBOXD_TEST_SLOW", "1"))

# Places every sandbox gets a private copy of (a tmpfs): a checkout there has a .venv the sandboxed
# commands of the tests cannot see, and a third of the suite would fail on ENOENT with no word why.
PRIVATE_IN_SANDBOXES = ("/tmp", "/dev/shm", "/run")


def pytest_configure(config: pytest.Config) -> None:
    for place in PRIVATE_IN_SANDBOXES:
        if REPO == Path(place) or Path(place) in REPO.parents:
            pytest.exit(f"this checkout is under {place}, which every sandbox replaces with a private one, so the "
                        f"tests' sandboxed commands cannot see its .venv: clone it elsewhere (/var/tmp, /opt, /srv)",
                        returncode=2)


# A suite started as a background job of a non-interactive shell (`setup.sh test &`, nohup) inherits
# SIGINT and SIGQUIT ignored (POSIX), and so would every process a test starts: the Ctrl-C tests'
# commands would never see theirs. What a test sends is meant to arrive: a handler here (Python's
# own, for SIGINT) is reset to the default in every child's exec.
for _signum in (signal.SIGINT, signal.SIGQUIT):
    if signal.getsignal(_signum) == signal.SIG_IGN:
        signal.signal(_signum, signal.default_int_handler if _signum == signal.SIGINT else signal.SIG_DFL)

STD_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# A small, fully known environment for the sandboxd CLI (and so for the command).
BASE_ENV: dict[str, str] = {"PATH": STD_PATH, "HOME": "/root", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
# The daemons the tests start keep the fork server of old, which dies with its daemon: most tests
# SIGKILL daemons and count what is left. tests/test_adopt.py runs the surviving supervisor
# (supervisor.survive_restart, true by default in a deployment) and its adoption by a new daemon.
BASE_ENV["SANDBOXD_SUPERVISOR_SURVIVE_RESTART"] = "false"
# SANDBOXD_TESTS_REVIEW=1: every daemon the tests start makes review sessions by default
# (review.default), to run the hostile-tenant suites in both modes (docs/testing.md).
if os.environ.get("SANDBOXD_TESTS_REVIEW") == "1":
    BASE_ENV["SANDBOXD_REVIEW_DEFAULT"] = "true"

POLICY_ARGS: dict[str, list[str]] = {
    "read-only": ["--sandbox", "read-only"],
    "workspace-write": ["--sandbox", "workspace-write"],
    # The host's network, asked for explicitly (the isolated default has tests of its own:
    # test_isolated_network.py builds a small world of namespaces for them).
    "workspace-write+network": ["--sandbox", "workspace-write", "--network=host"],
    "danger-full-access": ["--sandbox", "danger-full-access"],
}
CONFINED: list[str] = ["read-only", "workspace-write", "workspace-write+network"]
NO_NETWORK: list[str] = ["read-only", "workspace-write"]
WITH_NETWORK: list[str] = ["workspace-write+network", "danger-full-access"]
WRITABLE: list[str] = ["workspace-write", "workspace-write+network"]
ALL_POLICIES: list[str] = CONFINED + ["danger-full-access"]

EXIT_TIMEOUT = 124
EXIT_SETUP = 125

# Errors a write outside the writable areas may legitimately fail with
# (read-only mount: EROFS; Landlock or permission walls: EACCES / EPERM).
WRITE_DENIED = ("Read-only file system", "Permission denied", "Operation not permitted")
WRITE_DENIED_ERRNOS = ("EROFS", "EACCES", "EPERM")


def run_sbx(command: Sequence[str], *, workspace: str | os.PathLike[str] | None = None,
            policy: str = "workspace-write", options: Sequence[str] = (),
            env: dict[str, str] | None = None, timeout: float = 60, pass_fds: Sequence[int] = (),
            input: str | None = None, cwd: str | os.PathLike[str] | None = None,
            ) -> subprocess.CompletedProcess[str]:
    """Run ``command`` inside ``sandboxd run`` and return the finished process (text, captured)."""
    args = [SANDBOXD, "run", *POLICY_ARGS[policy]]
    if workspace is not None:
        args += ["--workspace", str(workspace)]
    args += [*options, "--", *command]
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout,
                          env=BASE_ENV if env is None else env, pass_fds=tuple(pass_fds),
                          input=input if input is not None else "", cwd=cwd)


def sbx_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 60,
            cwd: str | os.PathLike[str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run the ``sandboxd`` executable with raw arguments."""
    return subprocess.run([SANDBOXD, *args], capture_output=True, text=True, timeout=timeout,
                          env=BASE_ENV if env is None else env, cwd=cwd, input="")


def py(code: str, *args: str) -> list[str]:
    """The argv that runs ``code`` with the system python3 (inside or outside)."""
    return [PY, "-c", code, *args]


def describe(result: subprocess.CompletedProcess[str]) -> str:
    """A compact dump of a finished run for assertion messages."""
    return f"exit={result.returncode}\nstdout={result.stdout[-3000:]!r}\nstderr={result.stderr[-3000:]!r}"


def make_dir(path: Path, mode: int = 0o755) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, mode)
    return path


def readable_copy_of_sandboxd(base: Path) -> Path:
    """``base``/code holding a copy of the sandboxd package every user can read: what a plain
    user's rootless `sandboxd run` imports (PYTHONPATH), the checkout and its venv may be root's."""
    code = make_dir(base / "code")
    shutil.copytree(REPO / "sandboxd", code / "sandboxd", ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(["chmod", "-R", "a+rX", str(code)], check=True)
    return code


# --------------------------------------------------------------------------- directories


@pytest.fixture(scope="module", autouse=True)
def _exec_streams_ended() -> Iterator[None]:
    """After each module, the request stream of every daemon_helpers.ExecCall it left open is ended
    (a failed test skips its close): a gRPC thread left blocked on one makes a later in-process fork
    abort (see ExecCall._open)."""
    yield
    import sys
    helpers = sys.modules.get("daemon_helpers")
    if helpers is not None:
        helpers.ExecCall.end_left_open()


@pytest.fixture
def base_dir() -> Iterator[Path]:
    """A fresh 0755 directory under /var/tmp (same filesystem as the host root), removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="sbxtest-", dir="/var/tmp"))
    os.chmod(path, 0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def workspace(base_dir: Path) -> Path:
    """An empty workspace directory (owned by root, 0755) under /var/tmp."""
    return make_dir(base_dir / "ws")


@pytest.fixture
def outside(base_dir: Path) -> Path:
    """A 0777 directory outside every writable root, holding a 0666 ``target.txt``."""
    path = make_dir(base_dir / "outside", 0o777)
    target = path / "target.txt"
    target.write_text("original\n")
    os.chmod(target, 0o666)
    return path


@pytest.fixture
def tmp_workspace(tmp_path: Path) -> Path:
    """A workspace under the host's /tmp (hidden inside the sandbox unless bind-mounted)."""
    return make_dir(tmp_path / "ws")


# --------------------------------------------------------------------------- host processes


@pytest.fixture
def marker() -> str:
    """A unique string to tag processes started inside a sandbox, so the host can look for them."""
    return f"sbxmark-{uuid.uuid4().hex}"


def pids_with_marker(marker: str) -> list[int]:
    """Host pids whose command line contains ``marker`` (excluding this test process)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{entry}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except OSError:
            continue
        if marker.encode() in cmdline and state != b"Z":
            found.append(int(entry))
    return found


def eventually(condition: Callable[[], object], within: float) -> bool:
    """Poll ``condition`` every 50 ms until it holds (True) or ``within`` seconds pass (False): for
    what the kernel or a daemon does asynchronously. A bound, never a measure."""
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def wait_until_gone(marker: str, within: float = 2.0) -> list[int]:
    """Poll until no host process carries ``marker``; return the survivors (empty when all are gone)."""
    deadline = time.monotonic() + within
    while True:
        left = pids_with_marker(marker)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.02)


def kill_marked(marker: str) -> None:
    """Clean-up: SIGKILL whatever still carries ``marker`` (only after a failed assertion)."""
    for pid in pids_with_marker(marker):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture
def host_sleeper() -> Iterator[subprocess.Popen[bytes]]:
    """A host ``sleep`` process the sandbox must neither see nor kill."""
    proc = subprocess.Popen(["sleep", "300"])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture
def tcp_listener() -> Iterator[socket.socket]:
    """A host TCP socket listening on 127.0.0.1 on an ephemeral port (backlog only, no accept thread)."""
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    srv.setblocking(False)
    try:
        yield srv
    finally:
        srv.close()


def accepted_connections(srv: socket.socket) -> int:
    """How many connections are waiting in a non-blocking listener's backlog (accepts and closes them)."""
    count = 0
    while True:
        try:
            conn, _ = srv.accept()
        except (BlockingIOError, InterruptedError):
            return count
        conn.close()
        count += 1


@pytest.fixture
def git_workspace(workspace: Path) -> Path:
    """A workspace that is a git repository made on the host (config + sample hooks), one file staged-ready."""
    git_env = {**BASE_ENV, "GIT_CONFIG_NOSYSTEM": "1"}
    subprocess.run(["git", "init", "-q", str(workspace)], check=True, env=git_env)
    subprocess.run(["git", "-C", str(workspace), "config", "user.email", "test@example.invalid"], check=True,
                   env=git_env)
    subprocess.run(["git", "-C", str(workspace), "config", "user.name", "sandboxd test"], check=True, env=git_env)
    (workspace / ".git" / "hooks").mkdir(exist_ok=True)
    (workspace / "file.txt").write_text("hello\n")
    return workspace


# --------------------------------------------------------------------------- daemons and users


@pytest.fixture
def sandboxd_daemon() -> Iterator[DaemonFactory]:
    """The one way a test starts ``sandboxd serve``: ``sandboxd_daemon(**options)`` returns a started
    daemon_helpers.Daemon, ``sandboxd_daemon.start_failure(**options)`` the exit status and log of one
    that must refuse to start, ``sandboxd_daemon.prepare(**options)`` one not started yet.

    Per test: a base directory under /var/tmp (``sandboxd_daemon.base``) with the socket in
    ``<base>/run/``, the state in ``<base>/state``, workspaces from ``sandboxd_daemon.workspace()``.
    Options (daemon_helpers.DaemonFactory.prepare): ``args``, ``config`` (file text), ``tls``
    (daemon_helpers.TlsListener), ``env``, ``executable``, ``wrapper``, ``pass_fds``, ``socket``,
    ``default_flags``. Afterwards every daemon is stopped, the directory removed, and the test fails
    if a daemon left session processes, sandbox cgroups or private sockets behind."""
    from daemon_helpers import daemon_factory

    with daemon_factory() as factory:
        yield factory


@pytest.fixture(scope="module")
def sandboxd_daemon_module() -> Iterator[DaemonFactory]:
    """``sandboxd_daemon`` for a whole module (a daemon start costs about a second): behind the
    module-scoped ``daemon``/``stub``/``client`` fixtures of daemon_fixtures.py."""
    from daemon_helpers import daemon_factory

    with daemon_factory("sbxd-mod-") as factory:
        yield factory


@pytest.fixture
def plain_users() -> Iterator[Callable[[int], list[PlainUser]]]:
    """``plain_users(n)``: n fresh unprivileged users, each a (name, uid, gid), removed (userdel)
    afterwards; daemon_helpers.run_client_as runs a client as one of them."""
    import contextlib

    from daemon_helpers import plain_users as make_users

    with contextlib.ExitStack() as stack:
        yield lambda count=1: stack.enter_context(make_users(count))
