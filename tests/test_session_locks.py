"""One session's slow build or close holds no other session (issue 18 item 2: session state
under the session's own lock; the registry's lock only for its map).

In the daemon's own process (a real fork server, real sandboxes, a plain user's sessions), a
hook (service/sandbox_hooks.py, the way every per-sandbox service is wired) holds one
session's build, then one session's close, until the test lets it go. Meanwhile, from other
threads, another session is looked up, listed, has a command run in it start to end, has its
policy changed (a build of its own) and a new session is created and closed: each within a
bound. The held session is counted (quotas) but found by no one while it is being built.
Control: released, the held build finishes and its session is found and runs commands.

A hook that fails a build fails CreateSession with its error, and leaves nothing: what the
hooks before it served is closed, the sandbox is gone (no process of the user), the session is
not counted. Control: the same hooks without the failure build it, and CloseSession closes
what they served.

Through the daemon, a build that waits on a file system that never answers (issue 16's FUSE
mount, test_hung_fs): UpdateSessionPolicy naming a writable root on it is held until the fork
server's deadline, and meanwhile the same session is looked up and runs commands on its
current sandbox, and another session is created, runs a command and is closed.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from conftest import SLOW
from daemon_helpers import Daemon, PlainUser, run_client_as
from sandboxd.audit.store import open_in_state_dir
from sandboxd.errors import InvalidPolicy, NotFound
from sandboxd.policy import Limits
from sandboxd.policy.sandbox import ReadOnly, WorkspaceWrite
from sandboxd.service.callers import Caller, session_owner
from sandboxd.service.file_calls import run_in_session
from sandboxd.service.sandbox_hooks import Sandbox, SandboxHooks, Service
from sandboxd.service.sessions.registry import Session, SessionRegistry
from sandboxd.supervisor.fork_client import ForkServer
from test_hung_fs import WAIT_SECONDS, HungMount, owned_dir, processes_of
from test_hung_fs import daemon, hung, users  # noqa: F401 - pytest fixtures
from user_fuse import fuse_for_users  # noqa: F401 - a fixture

BOUND = 2.0 * SLOW        # what any one step of the other sessions may take while one is held
HOLD = 60.0               # how long a held hook waits for the test at most (then the test failed)
T = TypeVar("T")


class Holder(SandboxHooks):
    """Holds the build or the close of sessions whose workspace is ``workspace`` until ``release``."""

    def __init__(self) -> None:
        self.workspace = ""
        self.held_in = ""                 # "build" or "close": where the held session waits
        self.entered = threading.Event()
        self.release = threading.Event()

    def hold(self, workspace: str, where: str) -> None:
        self.workspace, self.held_in = workspace, where
        self.entered.clear()
        self.release.clear()

    def _maybe_hold(self, session: Session, where: str) -> None:
        if self.held_in == where and session.workspace == self.workspace:
            self.entered.set()
            assert self.release.wait(HOLD), f"the test never released the held {where}"

    def sandbox_ready(self, session: Session, sandbox: Sandbox) -> tuple[Service, ...]:
        self._maybe_hold(session, "build")
        return ()

    def session_closed(self, session: Session, stopping: bool) -> None:
        self._maybe_hold(session, "close")


class InProcess:
    def __init__(self, registry: SessionRegistry, fork: ForkServer, holder: Holder, owner: Caller,
                 base: Path, user: PlainUser) -> None:
        self.registry, self.fork, self.holder, self.owner, self.base, self.user = \
            registry, fork, holder, owner, base, user

    def workspace(self, name: str) -> str:
        path = self.base / name
        path.mkdir(mode=0o755)
        os.chown(path, self.user.uid, self.user.gid)
        return str(path)

    def create(self, workspace: str) -> Session:
        return self.registry.create(self.owner, workspace, WorkspaceWrite(), "never", Limits(), {})

    def echo(self, session: Session, text: str) -> bytes:
        info, out, _ = run_in_session(self.registry, self.fork, session, ["/bin/echo", text])
        assert info.exit_code == 0, info
        return out


@pytest.fixture
def in_process(plain_users: Callable[[int], list[PlainUser]], base_dir: Path) -> Iterator[InProcess]:
    (user,) = plain_users(1)
    fork = ForkServer.start()
    store = open_in_state_dir(str(base_dir / "state"))
    registry = SessionRegistry(fork, store)
    holder = Holder()
    registry.add_hooks(holder)
    try:
        yield InProcess(registry, fork, holder, session_owner(user.uid, user.gid, ""), base_dir, user)
    finally:
        holder.release.set()
        registry.close_all()
        fork.close()
        store.close()


def timed(step: Callable[[], T]) -> tuple[T, float]:
    started = time.monotonic()
    result = step()
    return result, time.monotonic() - started


def in_thread(work: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["result"] = work()
        except BaseException as error:  # noqa: BLE001 - the test looks at it
            outcome["error"] = error
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def others_go_on(env: InProcess, other: Session) -> dict[str, float]:
    """What another session does while one is held: each step's seconds."""
    seconds: dict[str, float] = {}
    _, seconds["get"] = timed(lambda: env.registry.get(env.owner, other.id))
    listed, seconds["list"] = timed(lambda: env.registry.list(env.owner))
    assert other.id in [s.id for s in listed]
    out, seconds["call"] = timed(lambda: env.echo(other, "other"))
    assert out == b"other\n"
    generation = other.generation
    _, seconds["policy change"] = timed(lambda: env.registry.update_policy(env.owner, other.id, ReadOnly(), None))
    assert other.generation == generation + 1
    assert env.echo(other, "rebuilt") == b"rebuilt\n"
    fresh, seconds["create"] = timed(lambda: env.create(env.workspace(f"fresh-{time.monotonic_ns()}")))
    assert env.echo(fresh, "fresh") == b"fresh\n"
    _, seconds["close"] = timed(lambda: env.registry.close(env.owner, fresh.id))
    env.registry.update_policy(env.owner, other.id, WorkspaceWrite(), None)
    return seconds


def while_held(env: InProcess, other: Session, workspace: str, where: str, work: Callable[[], Any],
               check_held: Callable[[], None]) -> dict[str, Any]:
    """``work`` in a thread, held in its hook at ``where`` for ``workspace``'s session: meanwhile
    ``check_held()`` and another session's steps (each within BOUND). Returns work's outcome."""
    env.holder.hold(workspace, where)
    thread, outcome = in_thread(work)
    assert env.holder.entered.wait(30 * SLOW), outcome
    try:
        check_held()
        seconds = others_go_on(env, other)
        assert thread.is_alive(), f"the held {where} ended before it was released"
    finally:
        env.holder.release.set()
    thread.join(30 * SLOW)
    print(f"while a {where} is held: " + ", ".join(f"{step} {took * 1000:.1f} ms" for step, took in seconds.items()))
    assert max(seconds.values()) < BOUND, seconds
    assert "error" not in outcome, outcome
    return outcome


def test_a_held_build_or_close_holds_no_other_session(in_process: InProcess) -> None:
    env = in_process
    other = env.create(env.workspace("other"))
    count = env.registry.count()
    held_ws = env.workspace("held")

    def building() -> None:                                   # counted, found by no one
        assert env.registry.count() == count + 1
        assert all(s.workspace != held_ws for s in env.registry.list(env.owner))
    held = while_held(env, other, held_ws, "build", lambda: env.create(held_ws), building)["result"]
    assert env.registry.get(env.owner, held.id) is held      # control: released, it is a session
    assert env.echo(held, "held") == b"held\n"

    def closing() -> None:                                    # gone for everyone at once
        with pytest.raises(NotFound):
            env.registry.get(env.owner, held.id)
    while_held(env, other, held_ws, "close", lambda: env.registry.close(env.owner, held.id), closing)
    assert env.registry.count() == count


class Served:
    """A stand-in for a published port: it only records that it was closed."""

    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


class ServeThenFail(SandboxHooks):
    """Serves one thing per sandbox; then, for ``refuse``'s workspace, a later hook fails the build."""

    def __init__(self) -> None:
        self.served: list[Served] = []
        self.refuse = ""

    def sandbox_ready(self, session: Session, sandbox: Sandbox) -> tuple[Service, ...]:
        self.served.append(Served())
        return (self.served[-1],)


class Refuse(SandboxHooks):
    def __init__(self, by: ServeThenFail) -> None:
        self.by = by

    def sandbox_ready(self, session: Session, sandbox: Sandbox) -> tuple[Service, ...]:
        if session.workspace == self.by.refuse:
            raise InvalidPolicy("refused by the test's hook")
        return ()


def test_a_failing_hook_fails_the_build_and_leaves_nothing(in_process: InProcess) -> None:
    env = in_process
    serving = ServeThenFail()
    env.registry.add_hooks(serving)
    env.registry.add_hooks(Refuse(serving))
    count, namespaces = env.registry.count(), env.registry.sandbox_namespaces()
    serving.refuse = env.workspace("refused")
    with pytest.raises(InvalidPolicy, match="refused by the test's hook"):
        env.create(serving.refuse)
    assert [s.closed for s in serving.served] == [True]          # what the hook before it served
    assert env.registry.count() == count and env.registry.sandbox_namespaces() == namespaces
    deadline = time.monotonic() + 10 * SLOW
    while processes_of(env.user.uid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert processes_of(env.user.uid) == []                       # its sandbox is gone
    # Control: without the refusal the same hooks build it; its service lives until CloseSession.
    session = env.create(env.workspace("served"))
    assert processes_of(env.user.uid), "a built sandbox has its init, as the user"    # what was looked for
    assert env.echo(session, "served") == b"served\n" and [s.closed for s in serving.served] == [True, False]
    env.registry.close(env.owner, session.id)
    assert [s.closed for s in serving.served] == [True, True]


# As the mounter of a FUSE file system that never answers: one session's policy change waits on
# it (its build), and meanwhile that session and another are used. Each step: [started, ended].
HELD_BUILD = r'''
import threading, time
def policy(**kw):
    return pb.SandboxPolicy(mode=pb.SandboxPolicy.WORKSPACE_WRITE, **kw)
def create(ws):
    return stub.CreateSession(pb.CreateSessionRequest(workspace=ws, sandbox_policy=policy(),
                                                      approval_policy=pb.NEVER), timeout=60)
def update(roots):
    return stub.UpdateSessionPolicy(pb.UpdateSessionPolicyRequest(
        session_id=session, sandbox_policy=policy(writable_roots=roots)), timeout=120)
session = create(ARGS["ws"]).id
held = {}
def held_update():
    held["started"] = time.monotonic()
    try:
        update([ARGS["hung"] + "/root"])
        held["code"] = "OK"
    except grpc.RpcError as error:
        held["code"], held["detail"] = error.code().name, error.details()
    held["ended"] = time.monotonic()
thread = threading.Thread(target=held_update)
thread.start()
time.sleep(0.5)                           # the update is in the daemon, held on the mount, by now
steps, seen = {}, {}
def step(name, fn):
    started = time.monotonic()
    result = fn()
    steps[name] = [started, time.monotonic()]
    return result
seen["same"] = step("GetSession (same session)", lambda: stub.GetSession(pb.GetSessionRequest(session_id=session),
                                                                        timeout=60)).sandbox_generation
seen["same_exec"] = step("Exec (same session)", lambda: run(session, ["/bin/echo", "same"]))
other = step("CreateSession (another)", lambda: create(ARGS["ws2"]))
seen["other_exec"] = step("Exec (another)", lambda: run(other.id, ["/bin/echo", "other"]))
step("CloseSession (another)", lambda: stub.CloseSession(pb.CloseSessionRequest(session_id=other.id), timeout=60))
step("ListSessions", lambda: stub.ListSessions(pb.ListSessionsRequest(), timeout=60))
thread.join()
seen["control"] = update([ARGS["root"]]).sandbox_generation       # a root it can use: a new generation
stub.CloseSession(pb.CloseSessionRequest(session_id=session), timeout=60)
print(json.dumps({"held": held, "steps": steps, "seen": seen}))
'''


def test_a_build_held_on_a_hung_file_system_holds_no_other_call(daemon: Daemon,  # noqa: F811
                                                                 users: list[PlainUser],  # noqa: F811
                                                                 hung: dict[str, HungMount]) -> None:  # noqa: F811
    user = users[0]                                          # the mounter: its own lookups hang there
    mount = hung["fusermount3"]
    found = run_client_as(user.uid, user.gid, daemon.socket, HELD_BUILD, {
        "hung": mount.path, "ws": str(owned_dir(daemon.base, user)), "ws2": str(owned_dir(daemon.base, user)),
        "root": str(owned_dir(daemon.base, user))}, timeout=300)
    held, steps, seen = found["held"], found["steps"], found["seen"]
    print(f"while a policy change waits {held['ended'] - held['started']:.2f} s on a hung mount: "
          + ", ".join(f"{name} {ended - started:.3f} s" for name, (started, ended) in steps.items()))
    assert held["code"] == "DEADLINE_EXCEEDED" and mount.path in held["detail"], held
    assert held["ended"] - held["started"] >= WAIT_SECONDS * 0.9, held
    for name, (started, ended) in steps.items():
        assert held["started"] < started and ended < held["ended"], (name, steps, held)  # all during the hang
        assert ended - started < 1.0 * SLOW, (name, steps)
    assert seen["same"] == 1 and seen["same_exec"] == ["same\n", 0], seen   # its current sandbox, unchanged
    assert seen["other_exec"] == ["other\n", 0], seen
    assert seen["control"] == 2, seen
