"""Helpers for the end-to-end tests of the ``sandboxd serve`` daemon (tests/test_daemon.py).

A real daemon is started as a subprocess on a Unix socket in a fresh directory
under /var/tmp, driven over gRPC exactly as a client would, and the host is
inspected from outside (/proc, mountinfo, cgroupfs) to check what the daemon
left behind. Nothing is mocked.

* :class:`Daemon` starts ``sandboxd serve``, waits for its "serving" log line
  and a passing health check, hands out stubs, and stops it.
* :func:`run_exec` runs one command and collects every response;
  :class:`ExecCall` drives an interactive call (stdin chunks, signals, cancel)
  through a queue-backed request iterator.
* :func:`run_client_as` runs a small client script as another uid: it imports
  grpc and sandboxd.v1 as root (the interpreter lives under /root/.pyenv,
  unreadable to other uids), then drops privileges, then connects.
* Host probes: :func:`descendants`, :func:`survivors`, :func:`sandbox_cgroups`,
  :func:`mount_count`, :func:`fd_count`.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import BASE_ENV, SANDBOXD
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


class Daemon:
    """One ``sandboxd serve`` process on ``<base>/sandboxd.sock``, logging to ``<base>/daemon-*.log``."""

    def __init__(self, base: Path, *, args: Iterable[str] = ()) -> None:
        self.base = base
        self.socket = str(base / "sandboxd.sock")
        self.private = base / ".sandboxd-private"
        self.log_path = base / f"daemon-{uuid.uuid4().hex[:8]}.log"   # one per daemon, also on restarts
        self.args = list(args)
        self.proc: subprocess.Popen[bytes] | None = None
        self._channels: list[grpc.Channel] = []
        self._stub: pb_grpc.SandboxStub | None = None

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self, within: float = float(os.environ.get("SANDBOXD_TEST_DAEMON_START", 60))) -> "Daemon":
        # SANDBOXD_TEST_DAEMON_START: packaging/vm/run-matrix raises it in an emulated (TCG) VM.
        with open(self.log_path, "ab") as log:
            state = [] if "--state-dir" in self.args else ["--state-dir", str(self.base / "state")]
            # A call held for approval by mistake fails in seconds instead of hanging a test.
            state += [] if "--approval-timeout" in self.args else ["--approval-timeout", "20"]
            self.proc = subprocess.Popen([SANDBOXD, "serve", "--socket", self.socket, *state, *self.args],
                                         stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=BASE_ENV)
        deadline = time.monotonic() + within
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sandboxd serve exited with {self.proc.returncode} before serving:\n{self.log()}")
            if self.serving_logged() and os.path.exists(self.socket) and self._healthy():
                return self
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"sandboxd serve did not become ready within {within}s:\n{self.log()}")
            time.sleep(0.05)

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
            self.proc.send_signal(signum)
        try:
            return self.proc.wait(within)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"sandboxd serve did not exit within {within}s of signal {signum}:\n{self.log()}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def close(self) -> None:
        """Clean-up: stop the daemon if it still runs (TERM, then KILL) and remove its directory."""
        self.close_channels()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()

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


# --------------------------------------------------------------------------- sessions and calls


@contextlib.contextmanager
def running_daemon(prefix: str = "sbxd-") -> Iterator[Daemon]:
    """A started daemon in a fresh base directory; stopped and cleaned up afterwards."""
    base = make_base_dir(prefix)
    d = Daemon(base)
    try:
        d.start()
        yield d
    finally:
        d.close()
        remove_tree(base)


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

    def __init__(self, stub: pb_grpc.SandboxStub, start: pb.ExecStart) -> None:
        self._queue: queue.Queue[Any] = queue.Queue()
        self._queue.put(pb.ExecRequest(start=start))
        self._cond = threading.Condition()
        self.responses: list[pb.ExecResponse] = []
        self.error: grpc.RpcError | None = None
        self.done = False
        self.call = stub.Exec(self._requests(), timeout=SAFETY_DEADLINE)
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
os.setgroups([])
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


def mount_count() -> int:
    with open("/proc/self/mountinfo") as f:
        return sum(1 for _ in f)


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
