"""A daemon SIGKILLed while a call runs; a new daemon on the same socket and state adopts it.

Real daemons (``sandboxd serve``), real sandboxes. With ``supervisor.survive_restart`` the fork
server is a surviving supervisor: the call keeps running across the gap, the new daemon attaches,
serves the same sandbox (a file the session left in its /tmp is still there), and writes the
call's end (exit 7, "done") to the audit log; a background process survives too and is listed
again, with its end and output. The control: with ``survive_restart = false`` the call dies with
the daemon and the next daemon rebuilds the session (its /tmp is empty). One daemon at a time:
a second daemon on the same socket is refused while one is attached, saying so.
"""

from __future__ import annotations

import json
import os
import select
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from conftest import pids_with_marker
from daemon_helpers import (Daemon, ExecCall, base_with_workspace, cgroup_mounts, create_session, exec_start, run_exec,
                            sandbox_cgroups, sandbox_links, socket_in, workspace_write)
from sandboxd import config
from sandboxd.v1 import sandboxd_pb2_grpc as pb_grpc
from sandboxd.v1 import sandboxd_pb2 as pb

pytestmark = pytest.mark.timeout(300)

SURVIVE = {"SANDBOXD_SUPERVISOR_SURVIVE_RESTART": "true"}
DIE = {"SANDBOXD_SUPERVISOR_SURVIVE_RESTART": "false"}


@pytest.fixture
def base() -> Iterator[Path]:
    with base_with_workspace("sbxadopt-") as path:
        yield path


def events(daemon: Daemon, session_id: str, kind: str) -> list[pb.Event]:
    reply = daemon.stub.QueryEvents(pb.QueryEventsRequest(session_id=session_id, types=[kind]), timeout=30)
    return list(reply.events)


def call_id_of(daemon: Daemon, session_id: str, shell: str) -> str:
    [started] = [e for e in events(daemon, session_id, "ToolInvocationStarted")
                 if json.loads(e.data_json)["arguments"]["argv"][-1] == shell]
    return started.call_id


def wait_for(what: str, check: "object", within: float = 60.0) -> None:
    deadline = time.monotonic() + within
    while not check():          # type: ignore[operator]
        assert time.monotonic() < deadline, f"{what}: not within {within} s"
        time.sleep(0.1)


def crash_with_a_call_running(base: Path, env: dict[str, str], marker: str) -> tuple[Daemon, pb.Session, str, str]:
    """A daemon with a session (a file left in its /tmp), a background process and a call running;
    SIGKILLed. (the dead daemon, the session, the call's shell string, the job's id)."""
    first = Daemon(base, env=env).start()
    session = create_session(first.stub, base / "ws", workspace_write())
    assert run_exec(first.stub, session.id, shell="echo kept > /tmp/adopt-mark").result.exit_code == 0
    job = first.stub.StartBackground(pb.StartBackgroundRequest(
        session_id=session.id, argv=["sh", "-c", f"echo bg-up; sleep 4; echo bg-done; : {marker}-job"]), timeout=60)
    shell = f"echo up; sleep 3; echo done; : {marker}-call; exit 7"
    call = ExecCall(first.stub, exec_start(session.id, shell=shell))
    call.wait_stdout(b"up")
    first.kill()
    call.close()
    return first, session, shell, job.id


def test_a_call_running_when_the_daemon_is_sigkilled_finishes_and_reaches_the_audit_log(base: Path) -> None:
    marker = f"sbxadopt-{os.getpid()}-a"
    first, session, shell, job_id = crash_with_a_call_running(base, SURVIVE, marker)
    assert pids_with_marker(marker), "the call and the job run on without their daemon"
    started = time.monotonic()
    second = Daemon(base, env=SURVIVE).start()
    serving_after = time.monotonic() - started
    try:
        serving = next(line for line in second.log_lines() if line.get("msg") == "serving")
        assert serving["supervisor"] == "attached" and serving["adopted_sessions"] == 1
        assert serving["adopted_calls"] + serving["ended_calls_recorded"] == 2, serving
        # The same sandbox, not a rebuild: what the session left in its /tmp is there.
        again = run_exec(second.stub, session.id, shell="cat /tmp/adopt-mark")
        assert again.stdout == b"kept\n", again.describe()
        call_id = call_id_of(second, session.id, shell)

        def completed() -> list[dict[str, object]]:
            return [json.loads(e.data_json) for e in events(second, session.id, "ToolInvocationCompleted")
                    if e.call_id == call_id]
        wait_for("the adopted call's end in the audit log", completed)
        [end] = completed()
        assert end["exit_code"] == 7 and end["stdout_tail"] == "done\n" and end["adopted"] is True, end
        # The background process survived, is listed again, and its end and output are there.
        listed = second.stub.ListBackground(pb.ListBackgroundRequest(session_id=session.id), timeout=30)
        assert [job.id for job in listed.processes] == [job_id]

        def job_ended() -> bool:
            [job] = second.stub.ListBackground(pb.ListBackgroundRequest(session_id=session.id),
                                               timeout=30).processes
            return not job.running
        wait_for("the adopted background process's end", job_ended)
        output = b"".join(chunk.data for chunk in second.stub.ReadBackgroundOutput(
            pb.ReadBackgroundOutputRequest(session_id=session.id, id=job_id), timeout=30))
        assert output.endswith(b"bg-done\n"), output
        print(f"adopted across a SIGKILL: the new daemon served {serving_after:.3f} s after it was started; "
              f"the call ended {end['wall_seconds']} s after its start, exit 7")
    finally:
        second.stop(signal.SIGINT)
    assert not pids_with_marker(marker), "a stopped daemon (shutdown = stop) leaves nothing running"


def test_control_without_survival_the_call_dies_with_the_daemon(base: Path) -> None:
    marker = f"sbxadopt-{os.getpid()}-b"
    first, session, shell, _ = crash_with_a_call_running(base, DIE, marker)
    wait_for("the call to die with its daemon", lambda: not pids_with_marker(marker), 30)
    second = Daemon(base, env=DIE).start()
    try:
        again = run_exec(second.stub, session.id, shell="cat /tmp/adopt-mark")
        assert again.result.exit_code != 0, "a rebuilt sandbox has an empty /tmp"
        call_id = call_id_of(second, session.id, shell)
        assert not [e for e in events(second, session.id, "ToolInvocationCompleted") if e.call_id == call_id]
        assert not second.stub.ListBackground(pb.ListBackgroundRequest(session_id=session.id), timeout=30).processes
    finally:
        second.stop(signal.SIGINT)


def test_a_second_daemon_cannot_attach_while_one_is_attached(base: Path) -> None:
    first = Daemon(base, env=SURVIVE).start()
    try:
        refused = Daemon(base, env=SURVIVE).start_failure()
        assert refused.returncode == 1 and "another daemon is attached" in refused.log, refused.log
        with grpc.insecure_channel("unix:" + first.socket) as channel:     # the first serves on
            grpc.channel_ready_future(channel).result(timeout=30)
        session = create_session(first.stub, base / "ws", workspace_write())
        assert run_exec(first.stub, session.id, shell="echo fine").stdout == b"fine\n"
    finally:
        first.stop(signal.SIGINT)


def test_a_supervisor_no_daemon_attaches_to_stops_everything_after_its_orphan_timeout(base: Path) -> None:
    """SIGKILLed daemon, no successor: after ``supervisor.orphan_seconds`` the supervisor stops the
    call, the session's sandbox, its isolated network and its cgroups, and exits; nothing is left
    (processes, cgroups, links, mounts, the attach socket). The next daemon starts a fresh one."""
    marker = f"sbxadopt-{os.getpid()}-d"
    first = Daemon(base, env={**SURVIVE, "SANDBOXD_SUPERVISOR_ORPHAN_SECONDS": "2"}).start()
    serving = next(line for line in first.log_lines() if line.get("msg") == "serving")
    supervisor = serving["fork_server_pid"]
    session = create_session(first.stub, base / "ws", workspace_write(network_access=True),
                             limits=pb.Limits(memory_bytes=256 << 20, pids=256))
    call = ExecCall(first.stub, exec_start(session.id, shell=f"echo up; sleep 300; : {marker}"))
    call.wait_stdout(b"up")
    groups = {path for path in sandbox_cgroups() if os.path.basename(path).startswith(f"run-{supervisor}-")}
    assert groups and sandbox_links(supervisor), "the session should have cgroups and a link of the supervisor's"
    pidfd = os.pidfd_open(supervisor)
    try:
        first.kill()
        call.close()
        assert pids_with_marker(marker), "the call runs on without its daemon"
        waiter = select.poll()
        waiter.register(pidfd, select.POLLIN)
        assert waiter.poll(60_000), "the supervisor did not stop within 60 s of its 2 s orphan timeout"
    finally:
        os.close(pidfd)
    wait_for("the call to go", lambda: not pids_with_marker(marker), 10)
    wait_for("the cgroups to go", lambda: not any(os.path.isdir(group) for group in groups), 10)
    wait_for("the links to go", lambda: not sandbox_links(supervisor), 10)
    with open("/proc/self/mountinfo") as mounts:
        assert str(base) not in mounts.read()
    assert not (first.private / "supervisor.sock").exists()
    second = Daemon(base, env=SURVIVE).start()
    try:
        assert next(line for line in second.log_lines() if line.get("msg") == "serving")["supervisor"] == "started"
        assert run_exec(second.stub, session.id, shell="echo rebuilt").stdout == b"rebuilt\n"
    finally:
        second.stop(signal.SIGINT)


def test_a_handover_leaves_the_running_call_to_the_next_daemon(base: Path) -> None:
    """Daemon.stop(hand_over=True) (what track drain's shutdown = "drain" ends with): the daemon
    exits without killing anything (ForkServer.detach); its call in flight writes no end of its own;
    the next daemon (a real ``sandboxd serve``) adopts the session and the call and records its end."""
    from sandboxd.service.daemon import Daemon as InProcessDaemon

    marker = f"sbxadopt-{os.getpid()}-h"
    settings = config.load(None, environ={}, flags={"listen.socket": str(socket_in(base)),
                                                    "state.dir": str(base / "state"),
                                                    "approvals.timeout_seconds": 20.0})
    first = InProcessDaemon(settings)
    assert first.start() is None
    serving = threading.Thread(target=first.serve, name="test-serve")
    serving.start()
    shell = f"echo up; sleep 3; echo done; : {marker}; exit 7"
    try:
        with grpc.insecure_channel(f"unix:{socket_in(base)}") as channel:
            stub = pb_grpc.SandboxStub(channel)
            session = create_session(stub, base / "ws", workspace_write())
            assert run_exec(stub, session.id, shell="echo kept > /tmp/adopt-mark").result.exit_code == 0
            call = ExecCall(stub, exec_start(session.id, shell=shell))
            call.wait_stdout(b"up")
            first.request_stop()
            serving.join(60)
            supervisor = first._started().fork.pid
            first.stop(hand_over=True)
            call.close()
    finally:
        first.request_stop()
        serving.join(60)
        first.stop()
        first.close()
    assert pids_with_marker(marker), "the call was killed by the handover"
    second = Daemon(base, env=SURVIVE).start()
    try:
        serving_line = next(line for line in second.log_lines() if line.get("msg") == "serving")
        assert serving_line["supervisor"] == "attached" and serving_line["fork_server_pid"] == supervisor
        assert run_exec(second.stub, session.id, shell="cat /tmp/adopt-mark").stdout == b"kept\n"
        call_id = call_id_of(second, session.id, shell)

        def ends() -> list[pb.Event]:
            return [e for kind in ("ToolInvocationCompleted", "ToolInvocationFailed")
                    for e in events(second, session.id, kind) if e.call_id == call_id]
        wait_for("the handed-over call's end in the audit log", ends)
        [end] = ends()
        data = json.loads(end.data_json)
        assert end.type == "ToolInvocationCompleted" and data["exit_code"] == 7 and data["stdout_tail"] == "done\n"
    finally:
        second.stop(signal.SIGINT)
    try:
        os.waitpid(supervisor, 0)                     # it was this process's child: its zombie
    except ChildProcessError:
        pass


@pytest.mark.parametrize("own_group", [True, False], ids=["own-cgroup", "control-daemons-cgroup"])
def test_a_supervisor_in_its_own_cgroup_survives_the_kill_of_the_daemons_group(base: Path, own_group: bool) -> None:
    """What a container runtime does to a replaced daemon pod: every process of the daemon's
    cgroup killed at once (cgroup.kill). With ``supervisor.cgroup`` the supervisor (and the sandboxes
    below it) are elsewhere: the call runs on and the next daemon adopts it. The control: in the
    daemon's group (no ``supervisor.cgroup``) the same kill takes the supervisor and the call."""
    from sandboxd.kernel import cgroups

    unified = cgroups.detect().unified
    if unified is None:
        pytest.skip("no cgroup2 file system is mounted (cgroup.kill)")
    name = f"sbxadopt-{uuid.uuid4().hex[:10]}"
    daemon_group = Path(unified) / f"{name}-daemon"
    daemon_group.mkdir()
    # Two levels deep, as a pod's own group would be (a v1 cpuset group needs each level's cpus and mems).
    env = {**SURVIVE, **({"SANDBOXD_SUPERVISOR_CGROUP": f"/{name}-supervisor/node"} if own_group else {})}
    wrapper = ["sh", "-c", f'echo $$ > {daemon_group}/cgroup.procs && exec "$@"', "sh"]
    marker = f"{name}-call"
    second = None
    try:
        first = Daemon(base, env=env, wrapper=wrapper).start()
        supervisor = next(line for line in first.log_lines() if line.get("msg") == "serving")["fork_server_pid"]
        with open(f"/proc/{supervisor}/cgroup") as own:
            lines = own.read().splitlines()
        placed = [line for line in lines if line.startswith("0::")]
        assert placed == [f"0::/{name}-supervisor/node" if own_group else f"0::/{name}-daemon"], placed
        if own_group:                 # and in every v1 hierarchy (runc kills a v1 container's by devices)
            assert all(line.split(":", 2)[2] == f"/{name}-supervisor/node" for line in lines), lines
        session = create_session(first.stub, base / "ws", workspace_write())
        shell = f"echo up; sleep 3; echo done; : {marker}; exit 7"
        call = ExecCall(first.stub, exec_start(session.id, shell=shell))
        call.wait_stdout(b"up")
        (daemon_group / "cgroup.kill").write_text("1")
        assert first.proc is not None and first.proc.wait(30) == -9
        call.close()
        if not own_group:
            wait_for("the call to die with the daemon's group", lambda: not pids_with_marker(marker), 30)
            return
        assert pids_with_marker(marker), "the call died with the daemon's group"
        second = Daemon(base, env=env).start()
        assert next(line for line in second.log_lines() if line.get("msg") == "serving")["supervisor"] == "attached"
        call_id = call_id_of(second, session.id, shell)

        def completed() -> list[pb.Event]:
            return [e for e in events(second, session.id, "ToolInvocationCompleted") if e.call_id == call_id]
        wait_for("the adopted call's end in the audit log", completed)
        assert json.loads(completed()[0].data_json)["exit_code"] == 7
    finally:
        if second is not None:
            second.stop(signal.SIGINT)
        for group in [*(mount / f"{name}-supervisor" for mount in cgroup_mounts()), daemon_group]:
            wait_for(f"{group} to empty", lambda group=group: not _group_procs(group), 30)
            for directory in sorted((p for p in group.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
                directory.rmdir()
            if group.exists():
                group.rmdir()


def _group_procs(group: Path) -> list[str]:
    found: list[str] = []
    if not group.exists():
        return found
    for procs in group.rglob("cgroup.procs"):
        found += procs.read_text().split()
    return found
