"""A session's OOM kills, read from a descriptor held open (kernel/oom_counter.py): the same count
as ``CgroupSet.oom_kills`` through a real kernel OOM kill, reported to the call it hit and not to
the next one, the session's init spared. Each call holds its own counter (and pidfd) only while it
runs: an open session holds no descriptor but its intake socket (spawner.SessionSandbox), and
nothing is left when a call has been collected or the session closed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from conftest import BASE_ENV, PY
from sandboxd.kernel.oom_counter import OomCounter
from sandboxd.kernel.process import COMMAND_OOM_SCORE_ADJ
from sandboxd.launcher.native_call import helper_path
from sandboxd.policy import LaunchSpec, Limits, WorkspaceWrite
from sandboxd.supervisor.spawner import Spawner

pytestmark = pytest.mark.timeout(120)

# The hog must be most of the group when it is killed: with 64 MiB, the session's init and the page
# cache of the Python it loaded were about half of it, and under load, when the hog's 20-odd MiB
# were not enough to free, the kernel went on to kill the init (a second OOM kill).
LIMIT = 256 << 20
HOG = "b = bytearray(1024 << 20); b[::4096] = b'x' * len(b[::4096]); print('ALIVE')"


def session_init_adj(pid: int) -> str:
    with open(f"/proc/{pid}/oom_score_adj") as f:
        return f.read().strip()


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_a_held_counter_counts_the_kernels_oom_kills(workspace: Path, native: bool) -> None:
    spawner = Spawner(native_helper=helper_path() if native else None)
    before = open_fds()
    session = spawner.open_session(LaunchSpec(argv=("true",), workspace=str(workspace), env=dict(BASE_ENV),
                                              policy=WorkspaceWrite(), limits=Limits(memory_bytes=LIMIT)))
    # The session holds its intake socket and nothing else: a descriptor per open session would be
    # copied into, and closed again by, every helper the fork server spawns.
    assert len(open_fds() - before) == 1
    null = os.open("/dev/null", os.O_RDWR)
    try:
        assert session.cgroup is not None and session.cgroup.memory_dir, "no memory cgroup on this machine"
        counter = OomCounter(session.cgroup)                         # held across the kill, as a call holds its own
        assert counter.oom_kills() == session.cgroup.oom_kills() == 0
        idle = open_fds()

        def call(argv: tuple[str, ...]) -> tuple[int | None, bool]:
            proc = spawner.launch_call(session, argv, dict(BASE_ENV), str(workspace), stdio=(null, null, null))
            proc.wait_started()
            info = proc.wait(timeout=60)
            assert open_fds() == idle, "a call's counter or pidfd outlived it"
            return info.exit_code, info.oom_killed

        assert call(("true",)) == (0, False)                         # control: nothing killed, nothing said
        exit_code, oom_killed = call((PY, "-c", HOG))
        assert exit_code is None and oom_killed                      # the kernel killed it, and the call says so
        # The held descriptor reads fresh contents: the same count as a fresh open of the file.
        assert counter.oom_kills() == session.cgroup.oom_kills() >= 1
        # The session lives on: a command goes before its init (a second kill before the first one's
        # memory was freed took the init here under load, and the session with it).
        assert session.init_pid is not None and session_init_adj(session.init_pid) == "0"
        assert call(("true",)) == (0, False)                         # the next call is not blamed
        assert call(("sh", "-c", f'test "$(cat /proc/self/oom_score_adj)" = {COMMAND_OOM_SCORE_ADJ}')) == (0, False)
        counter.close()
    finally:
        os.close(null)
        session.close()
    assert open_fds() <= before                                      # nothing of the session is left
