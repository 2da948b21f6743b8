"""Helpers for the end-to-end tests of the ``sandboxd serve`` daemon (tests/test_daemon.py).

A real daemon is started as a subprocess on a Unix socket in a fresh directory
under /var/tmp, driven over gRPC exactly as a client would, and the host is
inspected from outside (/proc, mountinfo, cgroupfs) to check what the daemon
left behind. Nothing is mocked.

* :class:`Daemon` starts ``sandboxd serve``, waits for its "serving" log line
  and a passing health check, hands out stubs, and stops it;
  :class:`DaemonFactory` (behind the ``sandboxd_daemon`` fixtures of conftest.py)
  starts them in a base directory of their own and checks, once they are
  stopped, that they left no processes, cgroups or private sockets behind.
* :func:`plain_users` makes unprivileged users for the duration of a test.
* :func:`stand_in_daemon` serves a test's own servicer in this process (clients' tests).
* :func:`run_exec` runs one command and collects every response;
  :class:`ExecCall` drives an interactive call (stdin chunks, signals, cancel)
  through a queue-backed request iterator.
* :func:`run_client_as` runs a small client script as another uid: it imports
  grpc and sandboxd.v1 as root (a checkout plain users cannot read works too),
  then drops privileges, then connects.
* Host probes: :func:`descendants`, :func:`survivors`, :func:`sandbox_cgroups`,
  :func:`sandbox_links`, :func:`mount_count`, :func:`fd_count`.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import BASE_ENV, SANDBOXD
from sandboxd import defaults
from sandboxd.v1 import sandboxd_pb2 as pb
from sandboxd.v1 import sandboxd_pb2_grpc as pb_grpc

PYTHON = sys.executable                 # the venv's interpreter: it has grpc and sandboxd
SESSION_TITLE = b"sandboxd-session"     # the command line of a session's init
CALL_TITLE = b"sandboxd-call"           # the command line of a call's init
FORK_NAME = "sandboxd-fork"             # the fork server's comm
SAFETY_DEADLINE = 180.0                 # a gRPC deadline that only stops a hung test, never judges speed


# --------------------------------------------------------------------------- the daemon


def make_base_dir(prefix: str = "sbxd-") -> Path:
    """A fresh 0755 directory under /var/tmp (reachable by other uids, on the host's disk)."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/var/tmp"))
    os.chmod(path, 0o755)
    return path


@contextlib.contextmanager
def base_with_workspace(prefix: str) -> Iterator[Path]:
    """A fresh base directory (make_base_dir) holding ``ws``, a workspace every uid may write,
    removed after."""
    path = make_base_dir(prefix)
    ws = path / "ws"
    ws.mkdir()
    os.chmod(ws, 0o777)
    try:
        yield path
    finally:
        remove_tree(path)


def socket_in(base: Path) -> Path:
    """Where a test daemon's socket lives under ``base``: ``<base>/run/sandboxd.sock``. The socket's
    directory is the daemon's own (it keeps its private sockets there, hides it inside every sandbox
    and refuses workspaces in it), so nothing else of a test goes in it."""
    return base / "run" / "sandboxd.sock"


@contextlib.contextmanager
def stand_in_daemon(servicer: pb_grpc.SandboxServicer, socket_path: str | os.PathLike[str],
                    workers: int = 4) -> Iterator[str]:
    """A stand-in daemon in this process: ``servicer`` answering on a Unix socket at
    ``socket_path`` (in the test's own directory), stopped after. Yields the socket's path. For
    clients' tests that need a daemon to answer a given way (a refusal, an older daemon's RPCs)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers))
    pb_grpc.add_SandboxServicer_to_server(servicer, server)
    server.add_insecure_port(f"unix:{socket_path}")
    server.start()
    try:
        yield str(socket_path)
    finally:
        server.stop(None)


class Daemon:
    """One ``sandboxd serve`` process. Layout under ``base``: the socket in ``<base>/run/`` (see
    :func:`socket_in`), the state in ``<base>/state``, the log (stdout and stderr) in
    ``<base>/daemon-*.log``; workspaces belong in ``<base>/ws-*``.

    ``args`` are extra ``serve`` arguments; ``--socket``, ``--state-dir`` and ``--approval-timeout``
    are added unless ``args`` has them or ``default_flags`` is false (a config file gives them).
    ``socket`` is where the daemon will listen when ``args`` or a config file put it elsewhere;
    ``wrapper`` is an argv that execs the rest (systemd socket activation emulation);
    ``executable`` is the ``sandboxd`` to run (the installed /usr/bin/sandboxd for the package test);
    ``env`` is added to the small BASE_ENV.
    """

    def __init__(self, base: Path, *, args: Iterable[str] = (), executable: str = SANDBOXD,
                 wrapper: Sequence[str] = (), env: Mapping[str, str] | None = None,
                 pass_fds: Sequence[int] = (), socket: str | os.PathLike[str] | None = None,
                 default_flags: bool = True) -> None:
        self.base = base
        self.socket = str(socket if socket is not None else socket_in(base))
        self.private = Path(defaults.private_dir(self.socket))
        self.log_path = base / f"daemon-{uuid.uuid4().hex[:8]}.log"   # one per daemon, also on restarts
        self.args = list(args)
        self.executable = executable
        self.wrapper = list(wrapper)
        self.env = dict(env or {})
        self.pass_fds = tuple(pass_fds)
        self.default_flags = default_flags
        self.proc: subprocess.Popen[bytes] | None = None
        # What the daemon ran (for the leak check after it is gone): its process tree as last
        # seen, and the pids that name its sandbox cgroups (run-<pid>-...: the daemon, its fork server).
        self.family: dict[int, ProcInfo] = {}
        self.spawner_pids: set[int] = set()
        self.stopped_by_close: int | None = None     # the exit status when close() had to stop it
        self._channels: list[grpc.Channel] = []
        self._stub: pb_grpc.SandboxStub | None = None
        owner = _FACTORIES.get(base)
        if owner is not None:           # a restart in a fixture's base (Daemon(d.base)) is checked too
            owner.daemons.append(self)

    # -- lifecycle ------------------------------------------------------------------------------

    def command(self) -> list[str]:
        flags: list[str] = []
        if self.default_flags:
            if "--socket" not in self.args:
                flags += ["--socket", self.socket]
            if "--state-dir" not in self.args:
                flags += ["--state-dir", str(self.base / "state")]
            # A call held for approval by mistake fails in seconds instead of hanging a test.
            if "--approval-timeout" not in self.args:
                flags += ["--approval-timeout", "20"]
        return [*self.wrapper, self.executable, "serve", *flags, *self.args]

    def _spawn(self) -> subprocess.Popen[bytes]:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                         env={**BASE_ENV, **self.env}, pass_fds=self.pass_fds)
        return self.proc

    def start(self, within: float = float(os.environ.get("SANDBOXD_TEST_DAEMON_START", 60))) -> "Daemon":
        # SANDBOXD_TEST_DAEMON_START: packaging/vm/run-matrix raises it in an emulated (TCG) VM.
        proc = self._spawn()
        deadline = time.monotonic() + within
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"sandboxd serve exited with {proc.returncode} before serving:\n{self.log()}")
            if self.serving_logged() and os.path.exists(self.socket) and self._healthy():
                self.remember_family()
                return self
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"sandboxd serve did not become ready within {within}s:\n{self.log()}")
            time.sleep(0.05)

    def start_failure(self, within: float = 60.0) -> "StartFailure":
        """Start a daemon that must refuse to start: its exit status and log. Raises if it serves."""
        proc = self._spawn()
        try:
            status = proc.wait(within)
        except subprocess.TimeoutExpired:
            serving = self.serving_logged()
            self.kill()
            raise AssertionError(f"sandboxd serve still ran after {within}s (serving={serving}); "
                                 f"it should have refused to start:\n{self.log()}") from None
        return StartFailure(status, self.log())

    def remember_family(self) -> None:
        """Note the daemon's live process tree, for the leak check once it is gone."""
        if self.proc is None or self.proc.poll() is not None:
            return
        tree = descendants(self.pid)
        self.family.update(tree)
        self.spawner_pids.add(self.pid)
        self.spawner_pids.update(pid for pid, info in tree.items() if info.comm == FORK_NAME)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-5000:]
        except OSError:
            return ""

    def log_lines(self) -> list[dict[str, Any]]:
        lines = []
        for line in self.log().splitlines():
            try:
                lines.append(json.loads(line))
            except ValueError:
                continue
        return lines

    def serving_logged(self) -> bool:
        """Whether the "serving" line is out, in the JSON log format or the text one."""
        if any(line.startswith("sandboxd info: serving") for line in self.log().splitlines()):
            return True
        return any(line.get("msg") == "serving" for line in self.log_lines())

    def _healthy(self) -> bool:
        channel = grpc.insecure_channel("unix:" + self.socket)
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            return reply.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False
        finally:
            channel.close()

    def stop(self, signum: int = signal.SIGTERM, within: float = 60.0) -> int:
        """Send ``signum`` and wait for the exit; the exit status (negative: killed by a signal)."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.remember_family()
            self.proc.send_signal(signum)
        try:
            return self.proc.wait(within)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"sandboxd serve did not exit within {within}s of signal {signum}:\n{self.log()}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.remember_family()
            self.proc.kill()
            self.proc.wait()

    def close(self) -> None:
        """Clean-up: stop the daemon if it still runs (INT, then KILL). SIGINT stops at once; SIGTERM
        would drain first (drain.shutdown), waiting up to a minute for a call a test left running."""
        self.close_channels()
        if self.proc is not None and self.proc.poll() is None:
            self.remember_family()
            self.proc.send_signal(signal.SIGINT)
            try:
                self.stopped_by_close = self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()
                self.stopped_by_close = self.proc.returncode

    def leftovers(self, within: float = 10.0) -> list[str]:
        """What the stopped daemon left behind: processes of its tree, its sandbox cgroups, and
        (after a clean exit) its private sockets and network links. Empty when nothing."""
        assert self.proc is not None and self.proc.poll() is not None, "leftovers() is for a stopped daemon"
        found = []
        if self.stopped_by_close not in (None, 0):
            found.append(f"daemon {self.pid} exited with {self.stopped_by_close} on SIGTERM:\n{self.log()}")
        left = survivors(self.family, within)
        if left:
            found.append(f"processes of daemon {self.pid} still alive: {left}")
        deadline = time.monotonic() + within
        while True:
            cgroups = self.own_cgroups()
            if not cgroups or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if cgroups:
            found.append(f"sandbox cgroups of daemon {self.pid} left behind: {sorted(cgroups)}")
        if self.proc.returncode == 0:
            sockets = self.private_sockets()
            if sockets:
                found.append(f"private sockets of daemon {self.pid} left behind: {sockets}")
            links = self.own_links()          # after a SIGKILL, the next start sweeps them
            if links:
                found.append(f"isolated network links of daemon {self.pid} left behind: {sorted(links)}")
        return found

    def own_cgroups(self) -> set[str]:
        """The sandbox cgroups this daemon made (named ``run-<its pid or its fork server's>-...``):
        other daemons on the machine have their own."""
        prefixes = tuple(f"run-{pid}-" for pid in self.spawner_pids)
        return {path for path in sandbox_cgroups() if os.path.basename(path).startswith(prefixes)} if prefixes else set()

    def own_links(self) -> set[str]:
        """The isolated networks' host links this daemon made (its fork servers'): other daemons on
        the machine have their own."""
        return sandbox_links(*self.spawner_pids)

    def private_sockets(self) -> list[str]:
        """This daemon's backend socket and the relay sockets in its private directory."""
        found = []
        backend = self.private / f"grpc-{self.pid}.sock"
        if backend.exists():
            found.append(str(backend))
        relay = self.private / "relay"
        if relay.is_dir():
            found += [str(relay / name) for name in os.listdir(relay)]
        return found

    # -- clients --------------------------------------------------------------------------------

    def channel(self) -> grpc.Channel:
        channel = grpc.insecure_channel("unix:" + self.socket)
        self._channels.append(channel)
        return channel

    @property
    def stub(self) -> pb_grpc.SandboxStub:
        if self._stub is None:
            self._stub = pb_grpc.SandboxStub(self.channel())
        return self._stub

    def close_channels(self) -> None:
        for channel in self._channels:
            channel.close()
        self._channels.clear()
        self._stub = None

    # -- what it holds on the host -------------------------------------------------------------

    def fork_server_pid(self) -> int | None:
        for pid, info in descendants(self.pid).items():
            if info.ppid == self.pid and info.comm == FORK_NAME:
                return pid
        return None

    def session_inits(self) -> dict[int, "ProcInfo"]:
        return {pid: info for pid, info in descendants(self.pid).items() if info.cmdline == SESSION_TITLE}

    def call_inits(self) -> dict[int, "ProcInfo"]:
        return {pid: info for pid, info in descendants(self.pid).items() if info.cmdline == CALL_TITLE}


@dataclass(frozen=True)
class StartFailure:
    """A daemon that refused to start: its exit status and its log (stdout and stderr)."""
    returncode: int
    log: str


@dataclass(frozen=True)
class TlsListener:
    """The TCP listener's flags: address, server certificate and key, the CA of client certificates,
    and the uid:gid its callers act as."""
    address: str
    cert: Path
    key: Path
    client_ca: Path
    tcp_user: str | None = None

    def args(self) -> list[str]:
        args = ["--tcp", self.address, "--tls-cert", str(self.cert), "--tls-key", str(self.key),
                "--tls-client-ca", str(self.client_ca)]
        return args + (["--tcp-user", self.tcp_user] if self.tcp_user else [])


# The open factories by base directory: a Daemon made on one's base joins its list.
_FACTORIES: dict[Path, "DaemonFactory"] = {}


class DaemonFactory:
    """Starts the daemons of one test (or one module) in one base directory (``self.base``);
    :meth:`close` stops them, removes the directory, and fails if a daemon left session processes,
    sandbox cgroups or private sockets behind. Behind the ``sandboxd_daemon`` fixtures."""

    def __init__(self, prefix: str = "sbxd-") -> None:
        self.base = make_base_dir(prefix)
        self.daemons: list[Daemon] = []          # every Daemon made on this base, in order
        self._configs = 0
        _FACTORIES[self.base] = self

    def prepare(self, *, args: Iterable[str] = (), config: str | None = None, tls: TlsListener | None = None,
                env: Mapping[str, str] | None = None, executable: str = SANDBOXD, wrapper: Sequence[str] = (),
                pass_fds: Sequence[int] = (), socket: str | os.PathLike[str] | None = None,
                default_flags: bool = True) -> Daemon:
        """A daemon in this base, not started yet (see :class:`Daemon` for the options); ``config`` is
        the text of a config file written to ``<base>/sandboxd-<n>.toml`` and passed with --config."""
        extra = list(args)
        if config is not None:
            self._configs += 1
            path = self.base / f"sandboxd-{self._configs}.toml"
            path.write_text(config)
            extra = ["--config", str(path), *extra]
        if tls is not None:
            extra += tls.args()
        return Daemon(self.base, args=extra, executable=executable, wrapper=wrapper, env=env,
                      pass_fds=pass_fds, socket=socket, default_flags=default_flags)

    def __call__(self, *, within: float = 60.0, **options: Any) -> Daemon:
        """A started daemon (options as for :meth:`prepare`)."""
        return self.prepare(**options).start(within)

    def start_failure(self, *, within: float = 60.0, **options: Any) -> StartFailure:
        """Start a daemon that must refuse to start (options as for :meth:`prepare`): its exit status and log."""
        return self.prepare(**options).start_failure(within)

    def workspace(self, mode: int = 0o755) -> Path:
        """A fresh root-owned workspace ``<base>/ws-<random>`` (never in the socket's directory)."""
        path = self.base / f"ws-{uuid.uuid4().hex[:8]}"
        path.mkdir(mode=mode)
        os.chmod(path, mode)
        return path

    def close(self) -> None:
        _FACTORIES.pop(self.base, None)
        problems: list[str] = []
        started = [daemon for daemon in self.daemons if daemon.proc is not None]
        # Every daemon of the base stops before any is checked: daemons restarted in one base share
        # its private directory, so a stopped one's check must not see a running one's relay sockets.
        for daemon in started:
            daemon.close()
        for daemon in started:
            found = daemon.leftovers()
            if found:
                problems += found
                kill_procs(daemon.family)
                for path in daemon.own_cgroups():
                    with contextlib.suppress(OSError):
                        os.rmdir(path)
        release_review_stores(self.base)
        remove_tree(self.base)
        if problems:
            raise AssertionError("the daemon left things behind:\n" + "\n".join(problems))


@contextlib.contextmanager
def daemon_factory(prefix: str = "sbxd-") -> Iterator[DaemonFactory]:
    """A :class:`DaemonFactory`, closed (and checked) afterwards."""
    factory = DaemonFactory(prefix)
    try:
        yield factory
    finally:
        factory.close()


# --------------------------------------------------------------------------- sessions and calls


@contextlib.contextmanager
def running_daemon(prefix: str = "sbxd-") -> Iterator[Daemon]:
    """A started daemon in a fresh base directory; stopped, checked for leftovers and removed afterwards."""
    with daemon_factory(prefix) as factory:
        yield factory()


# --------------------------------------------------------------------------- test users


class PlainUser(NamedTuple):
    name: str
    uid: int
    gid: int


def owned_dir(path: Path, owner: PlainUser) -> Path:
    """A new directory ``path`` (0755) that ``owner`` owns: a plain user's workspace."""
    path.mkdir(mode=0o755)
    os.chown(path, owner.uid, owner.gid)
    return path


def _unclaimed_gid() -> int:
    """A gid no group has and no user has as its primary group. groupadd alone takes the lowest
    free group id, which a stale account (a user whose group went away) may still name as its
    primary: groupdel then refuses to remove the group this test made."""
    import grp
    taken = {g.gr_gid for g in grp.getgrall()} | {p.pw_gid for p in pwd.getpwall()}
    for gid in range(62000, 63000):
        if gid not in taken:
            return gid
    raise AssertionError("no unclaimed gid in 62000..62999")


@contextlib.contextmanager
def scratch_group(prefix: str) -> Iterator[str]:
    """A fresh group (``<prefix><random>``) with a gid nobody claims, removed afterwards; a failed
    removal says which account still holds it."""
    name = f"{prefix}{uuid.uuid4().hex[:8]}"
    added = subprocess.run(["groupadd", "-g", str(_unclaimed_gid()), name], capture_output=True, text=True,
                           timeout=60)
    if added.returncode != 0:
        raise AssertionError(f"groupadd {name} failed ({added.returncode}): {added.stderr.strip()}")
    try:
        yield name
    finally:
        removed = subprocess.run(["groupdel", name], capture_output=True, text=True, timeout=60)
        if removed.returncode != 0:
            raise AssertionError(f"groupdel {name} failed ({removed.returncode}): {removed.stderr.strip()}")


@contextlib.contextmanager
def plain_users(count: int = 1) -> Iterator[list[PlainUser]]:
    """``count`` fresh unprivileged users (``sbxt-<random>``, no home, no group of their own, no
    login shell), removed afterwards (after their processes, which a test must have ended)."""
    made: list[PlainUser] = []
    try:
        for _ in range(count):
            name = f"sbxt-{uuid.uuid4().hex[:10]}"
            added = subprocess.run(["useradd", "-M", "-N", "-s", "/usr/sbin/nologin", name],
                                   capture_output=True, text=True, timeout=60)
            if added.returncode != 0:
                raise AssertionError(f"useradd {name} failed ({added.returncode}): {added.stderr.strip()}")
            entry = pwd.getpwnam(name)
            made.append(PlainUser(name, entry.pw_uid, entry.pw_gid))
        yield list(made)
    finally:
        failed = []
        for user in made:
            deadline = time.monotonic() + 10
            while True:
                result = subprocess.run(["userdel", user.name], capture_output=True, text=True, timeout=60)
                if result.returncode == 0 or time.monotonic() > deadline:
                    break
                time.sleep(0.1)          # userdel refuses while a process of the user still exits
            if result.returncode != 0:
                failed.append(f"{user.name}: {result.stderr.strip()}")
        if failed:
            raise AssertionError(f"could not remove test users: {failed}")


def workspace_write(**kwargs: Any) -> pb.SandboxPolicy:
    return pb.SandboxPolicy(mode=pb.SandboxPolicy.WORKSPACE_WRITE, **kwargs)


def read_only(**kwargs: Any) -> pb.SandboxPolicy:
    return pb.SandboxPolicy(mode=pb.SandboxPolicy.READ_ONLY, **kwargs)


def create_session(stub: pb_grpc.SandboxStub, workspace: str | os.PathLike[str],
                   policy: pb.SandboxPolicy | None = None, **kwargs: Any) -> pb.Session:
    """A session; its approval policy is NEVER unless given (the tests of approvals give one),
    so that calls of the other tests are not held for a person."""
    kwargs.setdefault("approval_policy", pb.NEVER)
    request = pb.CreateSessionRequest(workspace=str(workspace), **kwargs)
    if policy is not None:
        request.sandbox_policy.CopyFrom(policy)
    return stub.CreateSession(request, timeout=SAFETY_DEADLINE)


def close_quietly(stub: pb_grpc.SandboxStub, session_id: str) -> None:
    """Clean-up: close a session, ignoring NOT_FOUND (already closed) and a stopped daemon."""
    try:
        stub.CloseSession(pb.CloseSessionRequest(session_id=session_id), timeout=30)
    except grpc.RpcError:
        pass


def rpc_error(fn: Callable[[], Any]) -> grpc.RpcError:
    """Call ``fn`` (which must fail with a gRPC status) and return the error."""
    try:
        result = fn()
        if isinstance(result, Iterator):              # a streaming call fails while it is read
            for _ in result:
                pass
    except grpc.RpcError as error:
        return error
    raise AssertionError("the call succeeded; a gRPC error status was expected")


@dataclass
class ExecOutcome:
    responses: list[pb.ExecResponse] = field(default_factory=list)

    @property
    def kinds(self) -> list[str]:
        return [r.WhichOneof("kind") for r in self.responses]

    @property
    def started_pid(self) -> int | None:
        for r in self.responses:
            if r.WhichOneof("kind") == "started_pid":
                return r.started_pid
        return None

    @property
    def stdout(self) -> bytes:
        return b"".join(r.stdout for r in self.responses if r.WhichOneof("kind") == "stdout")

    @property
    def stderr(self) -> bytes:
        return b"".join(r.stderr for r in self.responses if r.WhichOneof("kind") == "stderr")

    @property
    def result(self) -> pb.ExecResult | None:
        for r in self.responses:
            if r.WhichOneof("kind") == "result":
                return r.result
        return None

    def describe(self) -> str:
        return (f"kinds={self.kinds[:5]}...{self.kinds[-3:]} result={self.result}\n"
                f"stdout={self.stdout[-2000:]!r}\nstderr={self.stderr[-2000:]!r}")


def exec_start(session_id: str, argv: Iterable[str] | None = None, shell: str | None = None,
               **kwargs: Any) -> pb.ExecStart:
    start = pb.ExecStart(session_id=session_id, **kwargs)
    if argv is not None:
        start.argv.extend(argv)
    if shell is not None:
        start.shell = shell
    return start


def run_exec(stub: pb_grpc.SandboxStub, session_id: str, argv: Iterable[str] | None = None,
             shell: str | None = None, *, more: Iterable[pb.ExecRequest] = (), **kwargs: Any) -> ExecOutcome:
    """Run one command (the request stream ends after ``start`` and ``more``) and collect every response."""
    requests = [pb.ExecRequest(start=exec_start(session_id, argv, shell, **kwargs)), *more]
    outcome = ExecOutcome()
    for response in stub.Exec(iter(requests), timeout=SAFETY_DEADLINE):
        outcome.responses.append(response)
    return outcome


class ExecCall:
    """An interactive Exec: requests come from a queue, responses are read by a thread.

    Use as a context manager: leaving it ends the request stream and cancels the
    call if it still runs, so no gRPC thread is left blocked on the queue.
    """

    _END = object()
    # Calls whose request stream is still open. gRPC's thread that consumes a request stream stays
    # blocked on the queue until the stream ends, even after the call itself ended; such a thread
    # in the test process makes a later in-process fork (tests/test_trust_bundle.py's Spawner)
    # abort in gRPC's fork handler. conftest ends what a test left open, failed or not.
    _open: "set[ExecCall]" = set()

    def __init__(self, stub: pb_grpc.SandboxStub, start: pb.ExecStart) -> None:
        self._queue: queue.Queue[Any] = queue.Queue()
        self._queue.put(pb.ExecRequest(start=start))
        self._cond = threading.Condition()
        self.responses: list[pb.ExecResponse] = []
        self.error: grpc.RpcError | None = None
        self.done = False
        self.call = stub.Exec(self._requests(), timeout=SAFETY_DEADLINE)
        ExecCall._open.add(self)
        self._reader = threading.Thread(target=self._read, name="exec-reader", daemon=True)
        self._reader.start()

    def _requests(self) -> Iterator[pb.ExecRequest]:
        while True:
            item = self._queue.get()
            if item is self._END:
                return
            yield item

    def _read(self) -> None:
        try:
            for response in self.call:
                with self._cond:
                    self.responses.append(response)
                    self._cond.notify_all()
        except grpc.RpcError as error:
            with self._cond:
                self.error = error
        finally:
            with self._cond:
                self.done = True
                self._cond.notify_all()

    # -- requests -------------------------------------------------------------------------------

    def send_stdin(self, data: bytes) -> None:
        self._queue.put(pb.ExecRequest(stdin=data))

    def close_stdin(self) -> None:
        self._queue.put(pb.ExecRequest(close_stdin=True))

    def send_signal(self, signum: int) -> None:
        self._queue.put(pb.ExecRequest(signal=signum))

    def end_requests(self) -> None:
        self._queue.put(self._END)
        ExecCall._open.discard(self)

    @classmethod
    def end_left_open(cls) -> int:
        """End the request stream of every call a test left open (and cancel those still running):
        how many there were."""
        left = list(cls._open)
        for call in left:
            call.end_requests()
            if not call.done:
                call.call.cancel()
        return len(left)

    def cancel(self) -> None:
        self.call.cancel()

    # -- responses ------------------------------------------------------------------------------

    @property
    def outcome(self) -> ExecOutcome:
        with self._cond:
            return ExecOutcome(list(self.responses))

    def wait_for(self, predicate: Callable[[ExecOutcome], bool], within: float = 60.0) -> bool:
        """Wait until ``predicate(outcome)`` holds or the call ended; whether it holds."""
        deadline = time.monotonic() + within
        with self._cond:
            while True:
                if predicate(ExecOutcome(list(self.responses))):
                    return True
                left = deadline - time.monotonic()
                if self.done or left <= 0:
                    return False
                self._cond.wait(left)

    def wait_started(self, within: float = 60.0) -> int:
        if not self.wait_for(lambda o: o.started_pid is not None, within):
            raise AssertionError(f"the call never started: error={self.error!r} {self.outcome.describe()}")
        pid = self.outcome.started_pid
        assert pid is not None
        return pid

    def wait_stdout(self, needle: bytes, within: float = 60.0) -> bytes:
        if not self.wait_for(lambda o: needle in o.stdout, within):
            raise AssertionError(f"{needle!r} never appeared on stdout: error={self.error!r} {self.outcome.describe()}")
        return self.outcome.stdout

    def wait_done(self, within: float = 60.0) -> bool:
        """Wait for the call to end, however it ends; whether it did."""
        self._reader.join(within)
        return not self._reader.is_alive()

    def finish(self, within: float = 120.0) -> ExecOutcome:
        """Wait for the call to end (it must end by itself) and return what it sent; raises its error."""
        self._reader.join(within)
        if self._reader.is_alive():
            raise AssertionError(f"the call did not end within {within}s: {self.outcome.describe()}")
        self.end_requests()
        if self.error is not None:
            raise self.error
        return self.outcome

    def __enter__(self) -> "ExecCall":
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.end_requests()
        if not self.done:
            self.call.cancel()
        self._reader.join(30)


# --------------------------------------------------------------------------- other clients


_CLIENT_PRELUDE = r'''
import json, os, sys
import grpc
import grpc._channel, grpc._common, grpc._utilities, grpc._interceptor, grpc._runtime_protos  # noqa: F401
from sandboxd.v1 import sandboxd_pb2 as pb, sandboxd_pb2_grpc as pb_grpc
ARGS = json.loads(sys.argv[1])
os.setgroups(ARGS.get("groups", []))   # supplementary groups: none unless the test gives some
os.setgid(ARGS["gid"])
os.setuid(ARGS["uid"])
channel = grpc.insecure_channel("unix:" + ARGS["socket"])
stub = pb_grpc.SandboxStub(channel)

def code(fn):
    try:
        fn()
        return "OK"
    except grpc.RpcError as error:
        return error.code().name

def run(session_id, argv):
    out, result = b"", None
    start = pb.ExecStart(session_id=session_id, argv=argv)
    for r in stub.Exec(iter([pb.ExecRequest(start=start)]), timeout=120):
        if r.WhichOneof("kind") == "stdout":
            out += r.stdout
        elif r.WhichOneof("kind") == "result":
            result = r.result
    return out.decode(), result.exit_code
'''


def run_client_as(uid: int, gid: int, socket_path: str, body: str, args: dict[str, Any] | None = None,
                  timeout: float = 180) -> dict[str, Any]:
    """Run ``body`` (after a prelude that imports as root, drops to uid/gid, and makes ``stub``)
    in a fresh interpreter; ``body`` must ``print(json.dumps(...))`` one object as its last line."""
    payload = json.dumps({"uid": uid, "gid": gid, "socket": socket_path, **(args or {})})
    proc = subprocess.run([PYTHON, "-c", _CLIENT_PRELUDE + body, payload], capture_output=True, text=True,
                          timeout=timeout, env=BASE_ENV, cwd="/")
    if proc.returncode != 0 or not proc.stdout.strip():
        raise AssertionError(f"client as uid {uid} failed: exit={proc.returncode}\n"
                             f"stdout={proc.stdout[-3000:]}\nstderr={proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def start_client_as(uid: int, gid: int, socket_path: str, body: str,
                    args: dict[str, Any] | None = None) -> subprocess.Popen[str]:
    """``run_client_as``'s client, left running: for a client process the test kills, or whose
    lines it reads as they come (stdout is a text pipe)."""
    payload = json.dumps({"uid": uid, "gid": gid, "socket": socket_path, **(args or {})})
    return subprocess.Popen([PYTHON, "-c", _CLIENT_PRELUDE + body, payload], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=BASE_ENV, cwd="/")


# --------------------------------------------------------------------------- host probes


@dataclass(frozen=True)
class ProcInfo:
    ppid: int
    starttime: int
    comm: str
    cmdline: bytes


def proc_info(pid: int) -> ProcInfo | None:
    """A live (non-zombie) process's parent, start time, name and command line (NULs stripped at the end)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
    except OSError:
        return None
    comm = raw[raw.index(b"(") + 1: raw.rindex(b")")].decode(errors="replace")
    fields = raw.rsplit(b")", 1)[1].split()
    if fields[0] in (b"Z", b"X"):
        return None
    return ProcInfo(ppid=int(fields[1]), starttime=int(fields[19]), comm=comm, cmdline=cmdline.rstrip(b"\0"))


def all_processes() -> dict[int, ProcInfo]:
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            info = proc_info(int(entry))
            if info is not None:
                found[int(entry)] = info
    return found


def descendants(root: int) -> dict[int, ProcInfo]:
    """Every live descendant of ``root`` (not ``root`` itself), as the host sees them."""
    procs = all_processes()
    children: dict[int, list[int]] = {}
    for pid, info in procs.items():
        children.setdefault(info.ppid, []).append(pid)
    found: dict[int, ProcInfo] = {}
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop()
        if pid in found:
            continue
        found[pid] = procs[pid]
        todo.extend(children.get(pid, []))
    return found


def survivors(procs: dict[int, ProcInfo], within: float = 10.0) -> dict[int, ProcInfo]:
    """Poll until none of ``procs`` (same pid and start time) is alive; the ones still alive."""
    deadline = time.monotonic() + within
    while True:
        left = {}
        for pid, info in procs.items():
            now = proc_info(pid)
            if now is not None and now.starttime == info.starttime:
                left[pid] = now
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def kill_procs(procs: dict[int, ProcInfo]) -> None:
    """Clean-up: SIGKILL whatever of ``procs`` is still the same process."""
    for pid, info in procs.items():
        now = proc_info(pid)
        if now is not None and now.starttime == info.starttime:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


CGROUP_ROOTS = ("/sys/fs/cgroup/unified/sandboxd", "/sys/fs/cgroup/pids", "/sys/fs/cgroup/memory",
                "/sys/fs/cgroup/sandboxd")


def sandbox_cgroups() -> set[str]:
    """Every cgroup directory named like a sandbox's (``run-*``) under the hierarchies sandboxd uses."""
    found = set()
    for root in CGROUP_ROOTS:
        if not os.path.isdir(root):
            continue
        for dirpath, dirnames, _ in os.walk(root):
            for name in dirnames:
                if name.startswith("run-"):
                    found.add(os.path.join(dirpath, name))
    return found


def cgroup_mounts() -> list[Path]:
    """Every cgroup hierarchy's mount point (v1 and v2)."""
    with open("/proc/self/mounts") as f:
        return [Path(line.split()[1]) for line in f if line.split()[2] in ("cgroup", "cgroup2")]


def sandbox_links(*creators: int) -> set[str]:
    """The host-side links of isolated networks that ``creators`` made (pids in this PID namespace: a
    daemon's fork server, a `sandboxd run`): kernel.netns names each link's creator in its alias
    (kernel.netns.link_creator). Other daemons and runs on the machine have links of their own, so
    there is no "every sandbox link" here."""
    from sandboxd.kernel.netns import LINK_PREFIX, link_creator

    namespace = os.stat("/proc/self/ns/pid").st_ino
    found = set()
    for name in os.listdir("/sys/class/net"):
        creator = link_creator(name) if name.startswith(LINK_PREFIX) else None
        if creator is not None and creator[0] in creators and creator[2] == namespace:
            found.add(name)
    return found


def free_pool(blocks: int = 1) -> str:
    """An address pool of ``blocks`` /30s (a power of two) that no address or route of this host is in
    now, away from the default pool's first blocks (which the machine's other daemons take): a pool
    of the caller's own. (Another run may pick the same one meanwhile: the kernel's claim of each block,
    kernel.netns._claim_block, still gives each network its own.)"""
    import ipaddress
    import random

    size = 4 * blocks
    addresses = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True, check=True).stdout
    routes = subprocess.run(["ip", "-4", "route", "show", "table", "all"], capture_output=True, text=True,
                            check=True).stdout
    taken = [ipaddress.ip_network(word, strict=False) for line in (addresses + routes).splitlines()
             for word in line.split() if word[:1].isdigit() and word.count(".") == 3]
    prefix = 33 - size.bit_length()                             # 4 addresses: a /30
    while True:
        pool = ipaddress.ip_network(f"10.233.{random.randrange(128, 256)}.{random.randrange(0, 256, size)}/{prefix}")
        if not any(pool.overlaps(network) for network in taken):
            return str(pool)


def mount_count() -> int:
    """The host's mounts, but for those other test runs on the machine make and remove meanwhile, which
    no daemon makes: named network namespaces (`ip netns add`, /run/netns), FUSE mounts and the tmpfs of
    tests/test_git_walk.py (source ``sbxtest-*``); and review sessions' stores (source
    ``sandboxd-review``), which any other daemon on the machine mounts as its users work: the
    callers count direct sessions' mounts (review tests check their stores by path)."""
    count = 0
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            point, (fstype, source) = fields[4], fields[fields.index("-") + 1:][:2]
            if not (point.startswith("/run/netns/") or fstype.startswith("fuse") or source.startswith("sbxtest-")
                    or (fstype, source) == ("tmpfs", "sandboxd-review")):
                count += 1
    return count


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def release_review_stores(base: Path) -> None:
    """Unmount the review stores (kernel.review_space: tmpfs mounts in the host's namespace, which
    no directory removal takes away) of the change sets the daemons under ``base`` kept."""
    from sandboxd.kernel import review_space

    prefix = f"{base}/"
    with open("/proc/self/mountinfo") as mounts:
        points = [line.split()[4] for line in mounts if f" - tmpfs {review_space.SOURCE} " in line]
    for point in sorted((p for p in points if p.startswith(prefix)), reverse=True):
        with contextlib.suppress(OSError):
            review_space.release(point.replace("\\040", " "))
