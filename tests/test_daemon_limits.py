"""The daemon end to end with limits: serve, a session with a memory and a pids limit and an isolated
network, exec (limits enforced, usage numbers right), close (nothing left). The matrix runner
(packaging/vm/run-matrix) runs this on every kernel: it is what the first limited call of a user
goes through, whichever cgroup layout the machine has.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import PY
from daemon_fixtures import daemon, stub, ws  # noqa: F401 - pytest fixtures
from daemon_helpers import close_quietly, create_session, run_exec, sandbox_cgroups, workspace_write
from sandboxd.kernel.netns import LINK_PREFIX
from sandboxd.v1 import sandboxd_pb2 as pb
from sandboxd.v1 import sandboxd_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(300)

MEMORY = 128 << 20
PIDS = 32

# Touches argv[1] MiB page by page, then burns argv[2] seconds of CPU; prints ALIVE.
WORK = ("import sys, time\n"
        "b = bytearray(int(sys.argv[1]) << 20)\n"
        "for i in range(0, len(b), 4096): b[i] = 1\n"
        "t = time.process_time()\n"
        "while time.process_time() - t < float(sys.argv[2]): pass\n"
        "print('ALIVE', flush=True)\n")

FORKS = ("import os, time\n"
         "n = 0\n"
         "try:\n"
         "    for _ in range(100):\n"
         "        if os.fork() == 0:\n"
         "            time.sleep(5); os._exit(0)\n"
         "        n += 1\n"
         "    print('FORKED', n)\n"
         "except OSError as e:\n"
         "    print('FORK-FAILED', e.errno, n)\n")


def sandbox_links() -> set[str]:
    return {n for n in os.listdir("/sys/class/net") if n.startswith(LINK_PREFIX)}


@pytest.fixture
def limited(stub: pb_grpc.SandboxStub, ws: Path) -> Iterator[pb.Session]:
    before = sandbox_cgroups()
    s = create_session(stub, ws, workspace_write(network_access=True),
                       limits=pb.Limits(memory_bytes=MEMORY, pids=PIDS))
    try:
        yield s
    finally:
        close_quietly(stub, s.id)
    assert sandbox_cgroups() <= before                   # the session's groups went with it


def test_a_limited_networked_session_enforces_and_reports(stub: pb_grpc.SandboxStub, limited: pb.Session) -> None:
    # usage numbers: 48 MiB touched and 0.3 s of CPU are what ExecResult says
    out = run_exec(stub, limited.id, [PY, "-c", WORK, "48", "0.3"])
    assert out.stdout == b"ALIVE\n" and out.result.exit_code == 0, out.describe()
    assert (48 << 20) <= out.result.peak_memory_bytes <= MEMORY, out.result
    assert not out.result.oom_killed, out.result
    # at least what it burned; at most what the CPUs could give it (seconds, not another unit)
    assert 0.25 <= out.result.cpu_seconds <= out.result.wall_seconds * (os.cpu_count() or 1), out.result

    # memory: above the limit the allocation is killed, and the session lives on
    out = run_exec(stub, limited.id, [PY, "-c", WORK, "512", "0"])
    assert b"ALIVE" not in out.stdout and out.result.shell_status != 0, out.describe()
    assert out.result.oom_killed, out.describe()                  # and the caller is told why
    after = run_exec(stub, limited.id, ["true"]).result
    assert after.exit_code == 0 and not after.oom_killed, after  # the next call is not blamed

    # pids: the tree cannot grow past the limit (EAGAIN), counting the session's own processes
    out = run_exec(stub, limited.id, [PY, "-c", FORKS])
    words = out.stdout.split()
    assert words[:2] == [b"FORK-FAILED", b"11"] and int(words[2]) < PIDS, out.describe()

    # network: the session has a namespace of its own, with its own link, not the host's
    out = run_exec(stub, limited.id, ["sh", "-c", "ls /sys/class/net"])
    inside = set(out.stdout.decode().split())
    assert out.result.exit_code == 0 and "lo" in inside, out.describe()
    assert not inside & (set(os.listdir("/sys/class/net")) - {"lo", "eth0"}), inside
    assert sandbox_links(), "an isolated network has a host-side link while the session lives"


def test_closing_the_session_removes_its_groups_and_link(stub: pb_grpc.SandboxStub, ws: Path) -> None:
    cgroups_before, links_before = sandbox_cgroups(), sandbox_links()
    s = create_session(stub, ws, workspace_write(network_access=True), limits=pb.Limits(memory_bytes=MEMORY, pids=PIDS))
    try:
        assert run_exec(stub, s.id, ["true"]).result.exit_code == 0
        assert sandbox_cgroups() - cgroups_before, "a limited session has cgroups of its own"
    finally:
        stub.CloseSession(pb.CloseSessionRequest(session_id=s.id), timeout=60)
    assert sandbox_cgroups() <= cgroups_before
    assert sandbox_links() <= links_before


def test_the_daemon_refuses_to_start_where_limits_cannot_be_applied(tmp_path: Path) -> None:
    """The start-up self-test builds a limited sandbox: with every cgroup hierarchy read-only the daemon
    stops at start-up with the fix, instead of failing a user's first limited call. (Control: every
    other daemon of these tests starts.)"""
    import subprocess

    from conftest import BASE_ENV, SANDBOXD

    script = ("awk '$9 ~ /^cgroup/ {print $5}' /proc/self/mountinfo | while read m; do "
              "mount -o remount,bind,ro \"$m\" || exit 9; done; exec \"$0\" serve --socket \"$1\" --state-dir \"$2\"")
    env = dict(BASE_ENV, PATH="/usr/sbin:/usr/bin:/sbin:/bin")
    result = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, SANDBOXD,
                             str(tmp_path / "sock"), str(tmp_path / "state")],
                            capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "cannot build a sandbox" in result.stderr and "cgroup" in result.stderr, result.stderr
    assert not (tmp_path / "sock").exists()
