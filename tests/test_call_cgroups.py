"""A session call is in every group that limits it, on both call paths, and the limits hold for its
whole tree; it joins them without the kernel's global cgroup lock (kernel/cgroups.join).

A write to ``cgroup.procs`` takes ``cgroup_threadgroup_rwsem`` for writing, which waits for an RCU
grace period after a quiet moment (10 to 25 ms here: the largest part of a call an agent makes now
and then). A single-threaded process moves its one thread through a v1 group's ``tasks`` instead,
which the kernel does without that lock; v2 has no such move across groups. A v2 group with no
controller (memory and pids are v1's here) limits nothing: it is there to kill the session in one
write, and a confined call's tree is in the session's PID namespace, so calls do not join it
(CgroupSet.limiting_dirs). The figures: docs/performance.md, "Session calls and the cgroup join".
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import BASE_ENV, PY
from sandboxd.kernel import cgroups
from sandboxd.launcher.native_call import helper_path
from sandboxd.policy import LaunchSpec, Limits, WorkspaceWrite
from sandboxd.supervisor.spawner import SandboxProcess, SessionSandbox, Spawner

pytestmark = pytest.mark.timeout(120)

FORKS = 48
# Forks as many sleepers as it can (up to FORKS) and prints how many it got: the pids limit's
# EAGAIN stops it. The supervisor kills the sleepers when it exits (nothing outlives a call).
FORK_COUNTER = (f"import os, time\nn = 0\nfor _ in range({FORKS}):\n    try:\n        pid = os.fork()\n"
                "    except OSError:\n        break\n    if pid == 0:\n        time.sleep(60)\n        os._exit(0)\n"
                "    n += 1\nprint(n, flush=True)\n")


def members(group: str) -> set[int]:
    with open(os.path.join(group, "cgroup.procs")) as f:
        return {int(pid) for pid in f.read().split()}


def children(pid: int) -> set[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return {int(child) for child in f.read().split()}


def open_session(spawner: Spawner, workspace: Path, pids: int | None) -> SessionSandbox:
    return spawner.open_session(LaunchSpec(argv=("true",), workspace=str(workspace), env=dict(BASE_ENV),
                                           policy=WorkspaceWrite(), limits=Limits(memory_bytes=256 << 20, pids=pids)))


def call(spawner: Spawner, session: SessionSandbox, workspace: Path, argv: tuple[str, ...],
         stdout: int) -> SandboxProcess:
    null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    try:
        proc = spawner.launch_call(session, argv, dict(BASE_ENV), str(workspace), stdio=(null, stdout, null))
    finally:
        os.close(null)
    proc.wait_started()
    return proc


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_a_call_is_in_each_group_that_limits_it_and_in_no_other(workspace: Path, native: bool) -> None:
    spawner = Spawner(native_helper=helper_path() if native else None)
    session = open_session(spawner, workspace, pids=64)
    try:
        group = session.cgroup
        assert group is not None and group.memory_dir, "no memory cgroup on this machine"
        before = {path: members(path) for path in group.dirs}
        null = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
        proc = call(spawner, session, workspace, ("sleep", "60"), null)
        os.close(null)
        try:
            command = children(proc.pid)
            assert len(command) == 1
            for path in group.dirs:
                joined = members(path) - before[path]
                if path in group.limiting_dirs():
                    assert joined == {proc.pid} | command, path      # the supervisor, and the command it forked
                else:                                                # only a v2 group that limits nothing
                    assert path == group.unified_dir and not group.unified_limits
                    assert joined == set(), path
        finally:
            proc.stop()
            proc.wait(timeout=30)
    finally:
        session.close()


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_the_pids_limit_holds_for_a_calls_whole_tree(workspace: Path, native: bool) -> None:
    spawner = Spawner(native_helper=helper_path() if native else None)

    def forks(pids: int | None) -> int:
        session = open_session(spawner, workspace, pids)
        read_end, write_end = os.pipe2(os.O_CLOEXEC)
        try:
            proc = call(spawner, session, workspace, (PY, "-c", FORK_COUNTER), write_end)
            os.close(write_end)
            write_end = -1
            info = proc.wait(timeout=60)
            assert info.exit_code == 0, info
            return int(os.read(read_end, 100))
        finally:
            os.close(read_end)
            if write_end >= 0:
                os.close(write_end)
            session.close()

    assert forks(None) == FORKS                                  # control: without a pids limit, every fork works
    assert forks(16) < 16                                        # the session's 16 tasks, init and supervisor among them


def test_a_single_threaded_caller_moves_through_tasks_where_there_is_one(tmp_path: Path) -> None:
    """Which file gets the write, on stand-in directories (regular files record it): a v1 group's
    ``tasks`` for a single-threaded caller moving itself, ``cgroup.procs`` for a v2 group, for
    another pid, and for a caller with threads (moving one thread would leave the others out)."""
    v1, v2 = tmp_path / "v1", tmp_path / "v2"
    for group, files in ((v1, ("tasks", "cgroup.procs")), (v2, ("cgroup.procs",))):
        group.mkdir()
        for name in files:
            (group / name).write_text("")

    def written() -> dict[str, str]:
        found = {f"{group.name}/{name.name}": name.read_text() for group in (v1, v2) for name in group.iterdir()}
        for group in (v1, v2):
            for name in group.iterdir():
                name.write_text("")
        return found

    def in_child(join: Callable[[], None]) -> None:
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                join()
            except BaseException:  # noqa: BLE001 - the exit status says it
                code = 1
            os._exit(code)
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0

    in_child(lambda: cgroups.join([str(v1), str(v2)]))           # a forked child: one thread
    assert written() == {"v1/tasks": "0", "v1/cgroup.procs": "", "v2/cgroup.procs": "0"}
    in_child(lambda: cgroups.join([str(v1), str(v2)], pid=1234))
    assert written() == {"v1/tasks": "", "v1/cgroup.procs": "1234", "v2/cgroup.procs": "1234"}

    def with_a_thread() -> None:
        stop = threading.Event()
        thread = threading.Thread(target=stop.wait)
        thread.start()
        try:
            cgroups.join([str(v1), str(v2)])
        finally:
            stop.set()
            thread.join()
    in_child(with_a_thread)
    assert written() == {"v1/tasks": "", "v1/cgroup.procs": "0", "v2/cgroup.procs": "0"}


def test_a_confined_run_joins_the_groups_that_limit_it_and_waits_for_no_warmup(tmp_path: Path) -> None:
    """`sandboxd run` as root: its command is in the run's own v1 memory and pids groups, under the
    pids limit asked, and not in the run's v2 group when that group has no controller (its PID
    namespace bounds it); with nothing to join through cgroup.procs, no warm-up is started for it.
    A danger-full-access run (no PID namespace) still joins every group."""
    import subprocess
    import time

    from daemon_helpers import descendants
    from sandboxd.cli import run as cli_run
    from sandboxd.policy import DangerFullAccess

    workspace = tmp_path / "ws"
    workspace.mkdir()
    v2_limits = "v2" in (cgroups.where("memory"), cgroups.where("pids"))
    confined = LaunchSpec(argv=("true",), workspace=str(workspace), policy=WorkspaceWrite())
    assert cli_run._waits_to_join(confined) is v2_limits
    assert cli_run._waits_to_join(confined.replace(policy=DangerFullAccess())) is True
    repo = Path(__file__).resolve().parents[1]
    runner = subprocess.Popen([PY, str(repo / "packaging" / "bin" / "sandboxd"), "run", "--workspace", str(workspace),
                               "--pids", "77", "--", "sleep", "30"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, env={**BASE_ENV, "PYTHONPATH": str(repo)})
    try:
        deadline, command = time.monotonic() + 60, 0
        while not command and time.monotonic() < deadline:
            command = next((pid for pid, info in descendants(runner.pid).items()
                            if info.cmdline == b"sleep\x0030"), 0)
            time.sleep(0.05)
        assert command, "the run's command never started"
        groups = dict(line.split(":", 2)[1:] for line in Path(f"/proc/{command}/cgroup").read_text().splitlines())
        runner_groups = dict(line.split(":", 2)[1:] for line in
                             Path(f"/proc/{runner.pid}/cgroup").read_text().splitlines())
        if cgroups.where("pids") == "v1":
            assert "/sandboxd/" in groups["pids"] and groups["pids"] != runner_groups["pids"], groups
            assert Path(f"/sys/fs/cgroup/pids{groups['pids']}/pids.max").read_text().strip() == "77"
        if cgroups.where("memory") == "v1":
            assert "/sandboxd/" in groups["memory"], groups
        if "" in groups and not v2_limits:                          # a v2 group with no controller: not joined
            assert groups[""] == runner_groups[""], groups
    finally:
        runner.terminate()
        runner.wait(timeout=60)
