"""WaitCall and `sandboxctl call result`: a call's outcome by its id, on a real daemon, after its
client's stream broke, after a daemon restart, and never for someone else."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
from pathlib import Path

import grpc
import pytest

from conftest import BASE_ENV
from daemon_helpers import Daemon, DaemonFactory, create_session, plain_users, rpc_error
from sandboxd.audit.store import EventStore
from sandboxd.service.call_results import TAIL_BYTES, CallResults
from sandboxd.v1 import sandboxd_pb2 as pb
from sandboxd.v1 import sandboxd_pb2_grpc as pb_grpc

REPO = Path(__file__).resolve().parents[1]
SANDBOXCTL = str(REPO / ".venv" / "bin" / "sandboxctl")
PYTHON = str(REPO / ".venv" / "bin" / "python")


def run_to_end(stub: pb_grpc.SandboxStub, session_id: str, shell: str) -> list[pb.ExecResponse]:
    start = pb.ExecStart(session_id=session_id, shell=shell, close_stdin=True)
    return list(stub.Exec(iter([pb.ExecRequest(start=start)])))


def wait_call(stub: pb_grpc.SandboxStub, session_id: str, call_id: str, timeout: float = 0) -> pb.WaitCallResponse:
    return stub.WaitCall(pb.WaitCallRequest(session_id=session_id, call_id=call_id, timeout_seconds=timeout))


class OpenExec:
    """An Exec whose request stream stays open until ``close_stdin``."""

    def __init__(self, stub: pb_grpc.SandboxStub, session_id: str, shell: str) -> None:
        self.requests: queue.Queue[pb.ExecRequest | None] = queue.Queue()
        self.requests.put(pb.ExecRequest(start=pb.ExecStart(session_id=session_id, shell=shell)))
        self.responses = stub.Exec(iter(self.requests.get, None))

    def close_stdin(self) -> None:
        self.requests.put(pb.ExecRequest(close_stdin=True))

    def rest(self) -> list[pb.ExecResponse]:
        out = list(self.responses)
        self.requests.put(None)
        return out


@pytest.fixture
def daemon(sandboxd_daemon: DaemonFactory) -> Daemon:
    return sandboxd_daemon()


@pytest.fixture
def session(daemon: Daemon, sandboxd_daemon: DaemonFactory) -> str:
    return create_session(daemon.stub, sandboxd_daemon.workspace()).id


def test_exec_names_its_call_and_wait_call_answers_with_its_end(daemon: Daemon, session: str) -> None:
    responses = run_to_end(daemon.stub, session, "echo out; echo err >&2; exit 3")
    call_id = responses[0].call_id
    assert responses[0].WhichOneof("kind") == "started_pid" and call_id.startswith("call_")
    assert all(not r.call_id for r in responses[1:])            # the first message only
    answer = wait_call(daemon.stub, session, call_id)
    assert answer.state == pb.CALL_STATE_FINISHED
    assert (answer.exit_code, answer.shell_status, answer.signal, answer.reason) == (3, 3, 0, "")
    assert (answer.stdout_tail, answer.stderr_tail) == (b"out\n", b"err\n")
    # `sandboxctl call result` prints the tails as they are and exits with the call's status.
    shown = subprocess.run([SANDBOXCTL, "--socket", daemon.socket, "call", "result", session, call_id],
                           capture_output=True, timeout=60, env=BASE_ENV)
    assert (shown.returncode, shown.stdout, shown.stderr) == (3, b"out\n", b"err\n")
    # A call it does not know, or one of another session: NOT_FOUND.
    assert rpc_error(lambda: wait_call(daemon.stub, session, "call_000000000000")).code() == grpc.StatusCode.NOT_FOUND
    unknown = subprocess.run([SANDBOXCTL, "--socket", daemon.socket, "call", "result", session, "call_nope"],
                             capture_output=True, text=True, timeout=60, env=BASE_ENV)
    assert unknown.returncode == 1 and "NOT_FOUND" in unknown.stderr


def test_wait_call_sees_a_running_call_then_its_end(daemon: Daemon, session: str) -> None:
    call = OpenExec(daemon.stub, session, "echo begun; cat > /dev/null; echo done")
    first = next(call.responses)
    assert next(call.responses).stdout == b"begun\n"
    running = wait_call(daemon.stub, session, first.call_id)
    assert running.state == pb.CALL_STATE_RUNNING and running.stdout_tail == b"begun\n"
    still = subprocess.run([SANDBOXCTL, "--socket", daemon.socket, "call", "result", session, first.call_id],
                           capture_output=True, timeout=60, env=BASE_ENV)
    assert still.returncode == 75 and b"still running" in still.stderr
    call.close_stdin()
    rest = call.rest()
    assert rest[-1].result.exit_code == 0
    finished = wait_call(daemon.stub, session, first.call_id, timeout=60)
    assert finished.state == pb.CALL_STATE_FINISHED and finished.stdout_tail == b"begun\ndone\n"


# A client that starts a call which waits for its stdin, prints its id once it ran, and then waits.
CLIENT = """
import sys
from sandboxd.client import SandboxClient
from sandboxd.v1 import sandboxd_pb2 as pb
import queue
requests = queue.Queue()
requests.put(pb.ExecRequest(start=pb.ExecStart(session_id=sys.argv[2], shell="echo partial; exec cat")))
with SandboxClient(sys.argv[1]) as client:
    for response in client.stub.Exec(iter(requests.get, None)):
        if response.call_id:
            print(response.call_id, flush=True)
        if response.stdout:
            print("output", flush=True)
"""


def test_wait_call_after_its_client_was_killed(daemon: Daemon, session: str) -> None:
    client = subprocess.Popen([PYTHON, "-c", CLIENT, daemon.socket, session], stdout=subprocess.PIPE, text=True,
                              env={**BASE_ENV, "PYTHONPATH": str(REPO)})
    assert client.stdout is not None
    call_id = client.stdout.readline().strip()
    assert client.stdout.readline() == "output\n"               # it ran and wrote
    client.kill()
    client.wait()
    client.stdout.close()
    answer = wait_call(daemon.stub, session, call_id, timeout=60)
    # Exec's stream is the call's life: it ended when its client went (killed, or its stdin closed
    # first: `cat` then ends by itself), and the result says so.
    assert answer.state == pb.CALL_STATE_FINISHED and answer.reason == "client_gone", answer
    assert answer.stdout_tail == b"partial\n"
    assert daemon.stub.GetSession(pb.GetSessionRequest(session_id=session)).running_calls == 0


def test_wait_call_answers_after_a_daemon_restart(sandboxd_daemon: DaemonFactory, daemon: Daemon,
                                                  session: str) -> None:
    call_id = run_to_end(daemon.stub, session, "printf 'kept %s\\n' across; exit 7")[0].call_id
    assert daemon.stop() == 0
    again = Daemon(daemon.base).start()
    answer = wait_call(again.stub, session, call_id)
    assert (answer.state, answer.exit_code, answer.stdout_tail) == (pb.CALL_STATE_FINISHED, 7, b"kept across\n")
    # The control: a call id the first daemon never ran is not known to the second either.
    assert rpc_error(lambda: wait_call(again.stub, session, call_id[:-1] + "x")).code() == grpc.StatusCode.NOT_FOUND


def test_another_users_wait_call_is_refused(daemon: Daemon, session: str) -> None:
    call_id = run_to_end(daemon.stub, session, "echo secret")[0].call_id
    argv = [SANDBOXCTL, "--socket", daemon.socket, "call", "result", session, call_id]
    owner = subprocess.run(argv, capture_output=True, timeout=60, env=BASE_ENV)
    assert (owner.returncode, owner.stdout) == (0, b"secret\n")              # the control: root, its owner
    with plain_users(1) as (user,):
        def become() -> None:
            os.setgroups([])
            os.setresgid(user.gid, user.gid, user.gid)
            os.setresuid(user.uid, user.uid, user.uid)
        other = subprocess.run(argv, capture_output=True, timeout=60, env=BASE_ENV, preexec_fn=become)
    assert other.returncode == 1 and b"NOT_FOUND" in other.stderr and b"secret" not in other.stdout


def test_call_results_keep_the_tail_and_bound_what_they_hold(tmp_path: Path) -> None:
    """The unit: the last TAIL_BYTES per stream, whatever came before; a finished result goes to the
    store (and is found there); a wait for an unknown call answers None at once."""
    store = EventStore(str(tmp_path / "events.db"))
    try:
        results = CallResults(store)
        results.started("call_a", "s1", "uid 0")
        for _ in range(5):
            results.output("call_a", 1, b"x" * TAIL_BYTES)
        results.output("call_a", 1, b"end")
        results.output("call_a", 2, b"e" * (3 * TAIL_BYTES + 1))
        results.finished("call_a", 0, None, False)
        kept = CallResults(store).wait("call_a", 0)            # another instance: from the store
        assert kept is not None and kept.stdout_tail == b"x" * (TAIL_BYTES - 3) + b"end"
        assert len(kept.stderr_tail) == TAIL_BYTES
        assert results.wait("call_unknown", 10) is None
    finally:
        store.close()


def test_a_wait_while_the_result_is_being_stored_finds_it(tmp_path: Path) -> None:
    """The window CI once hit: the call has left the running ones and its row is not committed yet
    (the store is slow). A WaitCall then must get the result, not NOT_FOUND. The control: the same
    moment seen by another instance (the store only) finds nothing yet."""
    import threading

    class SlowStore(EventStore):
        def __init__(self, path: str) -> None:
            super().__init__(path)
            self.entered, self.go_on = threading.Event(), threading.Event()

        def save_call_result(self, row):  # type: ignore[no-untyped-def]
            self.entered.set()
            assert self.go_on.wait(30)
            return super().save_call_result(row)

    store = SlowStore(str(tmp_path / "events.db"))
    try:
        results = CallResults(store)
        results.started("call_a", "s1", "uid 0")
        results.output("call_a", 1, b"out")
        ender = threading.Thread(target=results.finished, args=("call_a", 3, None, False))
        ender.start()
        assert store.entered.wait(30)
        during = results.wait("call_a", 0)
        assert during is not None and (during.exit_code, during.stdout_tail) == (3, b"out")
        assert CallResults(store).wait("call_a", 0) is None          # the control: not in the store yet
        store.go_on.set()
        ender.join(30)
        after = CallResults(store).wait("call_a", 0)
        assert after is not None and after.exit_code == 3
        assert results.wait("call_a", 0) is not None
    finally:
        store.go_on.set()
        store.close()


def test_a_broken_exec_says_how_to_ask_and_the_answer_outlives_the_daemon(daemon: Daemon, session: str) -> None:
    """The whole story from a person's side: `sandboxctl exec` whose daemon stops mid-call prints
    the command that tells how the call ended, and that command answers on the next daemon."""
    piped = subprocess.Popen([SANDBOXCTL, "--socket", daemon.socket, "exec", session, "--", "sh", "-c",
                              "echo before; exec cat"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, env=BASE_ENV)
    assert piped.stdout is not None and piped.stderr is not None
    assert piped.stdout.readline() == b"before\n"
    assert daemon.stop(signal.SIGINT) == 0                      # a stop, not a drain: the call is killed
    assert piped.wait(timeout=60) == 1
    hint = piped.stderr.read().decode()
    assert "sandboxctl call result" in hint, hint
    asked = hint.split("`")[1].split()                          # sandboxctl call result SESSION CALL
    Daemon(daemon.base).start()
    answered = subprocess.run([SANDBOXCTL, "--socket", daemon.socket, *asked[1:]], capture_output=True, timeout=60,
                              env=BASE_ENV)
    assert answered.stdout == b"before\n" and b"daemon_stopped" in answered.stderr, answered
    # Killed by the stop (137), or `cat` ended first: the stop cuts its client's stream, which closes
    # its stdin, an instant before the kill. Either way the daemon's reason is told.
    assert answered.returncode in (0, 128 + signal.SIGKILL), answered
    assert piped.stdin is not None
    piped.stdin.close()


def test_the_store_keeps_an_owners_last_results_and_a_days(tmp_path: Path) -> None:
    from sandboxd.audit.store import CALL_RESULTS_KEEP_SECONDS, CALL_RESULTS_PER_OWNER, CallResultRow

    store = EventStore(str(tmp_path / "events.db"))
    try:
        def save(call_id: str, owner: str, at: float) -> None:
            store.save_call_result(CallResultRow(call_id, "s1", owner, 0, 0, False, 0, "", b"out", b"", at))
        save("call_old", "uid 2", 1000.0)
        for index in range(CALL_RESULTS_PER_OWNER + 6):
            save(f"call_{index}", "uid 1", 1000.0 + CALL_RESULTS_KEEP_SECONDS / 2 + index)
        assert store.call_result("call_0") is None and store.call_result("call_5") is None   # its oldest
        assert store.call_result("call_6") is not None                 # its last CALL_RESULTS_PER_OWNER
        assert store.call_result("call_old") is not None               # another owner's: not its to drop
        save("call_new", "uid 2", 1000.0 + CALL_RESULTS_KEEP_SECONDS + 1)
        assert store.call_result("call_old") is None                   # a day old: gone
    finally:
        store.close()
