"""Resource limits: timeout, memory, pids, CPU time, open files (each with a control under the limit)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from conftest import ALL_POLICIES, CONFINED, EXIT_TIMEOUT, describe, py, run_sbx

# Allocates and touches argv[1] MiB; prints ALIVE if it survived.
ALLOCATE = r"""
import sys
try:
    block = b'x' * (int(sys.argv[1]) << 20)
except MemoryError:
    print('MemoryError', flush=True)
    sys.exit(3)
print('ALIVE', len(block) >> 20, flush=True)
"""


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_memory_limit_kills_or_refuses_large_allocation(policy: str, workspace: Path) -> None:
    """Allocating 256M under --memory 64M gets the process OOM-killed (137) or a MemoryError, never success."""
    result = run_sbx(py(ALLOCATE, "256"), workspace=workspace, policy=policy, options=("--memory", "64M"))
    assert "ALIVE" not in result.stdout, describe(result)
    assert result.returncode == 137 or (result.returncode == 3 and "MemoryError" in result.stdout), describe(result)


@pytest.mark.parametrize("policy", ["workspace-write", "danger-full-access"])
def test_memory_limit_allows_allocation_below_it(policy: str, workspace: Path) -> None:
    """Control: 16M under --memory 64M works."""
    result = run_sbx(py(ALLOCATE, "16"), workspace=workspace, policy=policy, options=("--memory", "64M"))
    assert result.returncode == 0 and "ALIVE 16" in result.stdout, describe(result)


def test_memory_limit_covers_the_whole_tree(workspace: Path) -> None:
    """Two processes of 40M each do not both fit in --memory 64M: the limit is on the tree, not per process."""
    script = r"""
import os, sys, time
if os.fork() == 0:
    block = b'x' * (40 << 20)
    time.sleep(2)
    os._exit(0)
time.sleep(0.3)
block = b'y' * (40 << 20)
_, status = os.wait()
print('child', 'killed' if os.WIFSIGNALED(status) else 'ok', flush=True)
print('parent ALIVE', flush=True)
"""
    result = run_sbx(py(script), workspace=workspace, options=("--memory", "64M"))
    both_survived = result.returncode == 0 and "child ok" in result.stdout and "parent ALIVE" in result.stdout
    assert not both_survived, describe(result)


PIDS = r"""
import os, signal, sys, time
children = []
try:
    for _ in range(int(sys.argv[1])):
        pid = os.fork()
        if pid == 0:
            time.sleep(30)
            os._exit(0)
        children.append(pid)
except OSError as e:
    print('FORK-FAILED', e.errno, len(children))
else:
    print('FORKED', len(children))
for pid in children:                     # leave nothing behind (danger-full-access keeps background jobs)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
"""


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_pids_limit_makes_fork_fail_with_eagain(policy: str, workspace: Path) -> None:
    """With --pids 10 the 10th+ process cannot be created: fork fails with EAGAIN (11) before 10 children."""
    result = run_sbx(py(PIDS, "40"), workspace=workspace, policy=policy, options=("--pids", "10"), timeout=60)
    words = result.stdout.split()
    assert words[:2] == ["FORK-FAILED", "11"], describe(result)
    assert int(words[2]) < 10


def test_a_command_that_cannot_even_start_at_its_pids_limit_is_told_which_limits(workspace: Path) -> None:
    """With --pids 1 init fills the limit, so the command itself cannot be forked: setup fails with
    the limits to raise named (a daemon's call gets RESOURCE_EXHAUSTED with it: test_daemon_limits).
    Control: with --pids 2 the same command runs."""
    full = run_sbx(["true"], workspace=workspace, policy="read-only", options=("--pids", "1"), timeout=60)
    assert full.returncode == 125 and "EAGAIN" in full.stderr, describe(full)
    assert "--pids" in full.stderr and "limits.owner_pids" in full.stderr, describe(full)
    fits = run_sbx(["true"], workspace=workspace, policy="read-only", options=("--pids", "2"), timeout=60)
    assert fits.returncode == 0, describe(fits)


def test_pids_without_limit_allow_many(workspace: Path) -> None:
    """Control: without --pids the same program makes 40 children."""
    result = run_sbx(py(PIDS, "40"), workspace=workspace)
    assert result.stdout.split() == ["FORKED", "40"], describe(result)


@pytest.mark.parametrize("policy", ["read-only", "workspace-write", "danger-full-access"])
def test_cpu_seconds_limit(policy: str, workspace: Path) -> None:
    """A busy loop under --cpu-seconds 1 is stopped by SIGXCPU (152) or SIGKILL (137) within a few seconds."""
    started = time.monotonic()
    result = run_sbx(py("while True: pass"), workspace=workspace, policy=policy, options=("--cpu-seconds", "1"),
                     timeout=30)
    elapsed = time.monotonic() - started
    assert result.returncode in (152, 137), describe(result)
    assert elapsed >= 1  # it ran until its CPU time was used up


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_open_files_limit(policy: str, workspace: Path) -> None:
    """--open-files 32 sets RLIMIT_NOFILE to 32; opening more descriptors fails with EMFILE."""
    script = r"""
import errno, os, resource
print('limit', *resource.getrlimit(resource.RLIMIT_NOFILE))
fds = []
try:
    for _ in range(100):
        fds.append(os.open('/dev/null', os.O_RDONLY))
    print('opened all')
except OSError as e:
    print('stopped', errno.errorcode[e.errno], len(fds))
"""
    result = run_sbx(py(script), workspace=workspace, policy=policy, options=("--open-files", "32"))
    assert result.returncode == 0, describe(result)
    lines = result.stdout.splitlines()
    assert lines[0] == "limit 32 32", describe(result)
    assert lines[1].startswith("stopped EMFILE") and int(lines[1].split()[2]) < 32, describe(result)


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_timeout_exits_124_promptly(policy: str, workspace: Path) -> None:
    """--timeout 1 on `sleep 30` ends after about a second with exit 124 and a stderr note."""
    started = time.monotonic()
    result = run_sbx(["sh", "-c", "sleep 30; echo FINISHED"], workspace=workspace, policy=policy,
                     options=("--timeout", "1"), timeout=40)
    elapsed = time.monotonic() - started
    assert result.returncode == EXIT_TIMEOUT, describe(result)
    assert "FINISHED" not in result.stdout
    assert elapsed >= 0.9, elapsed  # not before the deadline; the upper side is proven by exit 124
    assert "timed out" in result.stderr


@pytest.mark.parametrize("policy", CONFINED)
def test_timeout_not_hit_keeps_exit_status(policy: str, workspace: Path) -> None:
    """A command that finishes before its timeout keeps its own exit status."""
    result = run_sbx(["sh", "-c", "exit 7"], workspace=workspace, policy=policy, options=("--timeout", "20"))
    assert result.returncode == 7, describe(result)


def test_timeout_ignores_sigterm_handlers(workspace: Path) -> None:
    """A command that traps and ignores SIGTERM is still stopped at the timeout."""
    started = time.monotonic()
    result = run_sbx(["sh", "-c", "trap '' TERM INT HUP; sleep 30"], workspace=workspace,
                     options=("--timeout", "1"), timeout=40)
    assert result.returncode == EXIT_TIMEOUT, describe(result)
    assert time.monotonic() - started >= 1


def test_oom_kill_is_reported(workspace: Path) -> None:
    """The kernel's OOM kill under --memory is said on stderr (cgroup memory.events / memory.oom_control)."""
    result = run_sbx(py(ALLOCATE, "256"), workspace=workspace, options=("--memory", "64M"))
    assert result.returncode == 137, describe(result)
    assert "memory limit" in result.stderr, describe(result)
    control = run_sbx(py(ALLOCATE, "16"), workspace=workspace, options=("--memory", "64M"))
    assert control.returncode == 0 and "memory limit" not in control.stderr, describe(control)


def test_usage_numbers_are_right_under_limits(workspace: Path) -> None:
    """ExitInfo (what ExecResult carries): 48 MiB touched and 0.3 s of CPU under a memory and a pids limit."""
    import os

    from sandboxd.policy import LaunchSpec, Limits, WorkspaceWrite
    from sandboxd.supervisor.spawner import Spawner

    code = ("import time\nb = bytearray(48 << 20)\nfor i in range(0, len(b), 4096): b[i] = 1\n"
            "t = time.process_time()\nwhile time.process_time() - t < 0.3: pass\n")
    null = os.open(os.devnull, os.O_RDWR)
    try:
        proc = Spawner().launch(LaunchSpec(argv=("/usr/bin/python3", "-c", code), workspace=str(workspace),
                                           policy=WorkspaceWrite(), limits=Limits(memory_bytes=128 << 20, pids=32),
                                           env={"PATH": "/usr/bin:/bin"}), stdio=(null, null, null))
        proc.wait_started()
        info = proc.wait(60)
    finally:
        os.close(null)
    assert info.exit_code == 0, info
    assert (48 << 20) <= info.peak_memory_bytes <= (128 << 20), info
    # at least what it burned; at most what the CPUs could give it (seconds, not another unit)
    assert 0.25 <= info.cpu_seconds <= info.wall_seconds * (os.cpu_count() or 1), info
    assert not info.oom_killed


def test_doctor_fails_when_a_limit_cannot_be_applied() -> None:
    """With every cgroup hierarchy read-only (a container without a writable cgroupfs), the doctor's limited
    session fails, it says so with the fix, and never claims everything is here."""
    from conftest import BASE_ENV, SANDBOXD
    import subprocess

    script = ("awk '$9 ~ /^cgroup/ {print $5}' /proc/self/mountinfo | while read m; do "
              "mount -o remount,bind,ro \"$m\" || exit 9; done; exec \"$0\" doctor")
    env = dict(BASE_ENV, PATH="/usr/sbin:/usr/bin:/sbin:/bin")
    result = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, SANDBOXD],
                            capture_output=True, text=True, timeout=180, env=env)
    assert result.returncode == 1, describe(result)
    assert "FAIL  limits: a session with --memory 64M --pids 16 could not be built" in result.stdout, describe(result)
    assert "fix:" in result.stdout.split("FAIL  limits")[1].split("\n")[1], describe(result)
    assert "everything enforcement needs is here" not in result.stdout
    assert "ok    sandbox:" in result.stdout                    # control: what needs no cgroup still works


def test_a_run_gets_the_default_limits_under_the_host_wide_caps(workspace: Path, plain_users) -> None:  # type: ignore[no-untyped-def]
    """`sandboxd run` with no limit given: a fork bomb of a plain user stops at the default 1024 tasks
    (EAGAIN), its groups carry the default limits, and the parent group of all sandboxes the host-wide
    caps. Control: --pids above the default lets the same command fork past 1024. Run in a parent group
    of its own (cgroup_helpers.own_parent), so the caps it writes are its own, not every sandboxd's."""
    import os
    import subprocess

    from cgroup_helpers import HOLDING_FORKS, forked, own_parent, wait_for
    from conftest import BASE_ENV, SANDBOXD
    from sandboxd.kernel import host_limits

    (user,) = plain_users(1)
    os.chown(workspace, user.uid, user.gid)
    ceiling = host_limits.default_ceiling()

    def bomb(parent, tag: str, *options: str) -> "tuple[subprocess.Popen[str], Path, Path]":  # type: ignore[no-untyped-def]
        count, release = workspace / f"count-{tag}", workspace / f"release-{tag}"
        argv = [*parent.wrapper, SANDBOXD, "run", "--workspace", str(workspace), "--user", f"{user.uid}:{user.gid}",
                *options, "--", *py(HOLDING_FORKS, "1500", str(count), str(release))]
        return (subprocess.Popen(argv, env=BASE_ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True),
                count, release)

    with own_parent() as parent:
        proc, count, release = bomb(parent, "default")
        try:
            wait_for(count)
            assert parent.cap("pids") == str(ceiling.pids)
            assert parent.cap("memory") == str(ceiling.memory_bytes)
            assert parent.sandbox_limits("pids") == ["1024"]
            assert parent.sandbox_limits("memory") == [str(host_limits.default_memory())]
        finally:
            release.touch()
            out, err = proc.communicate(timeout=120)
        made, errno = forked(out)
        assert errno == 11 and 1000 <= made < 1024, (out, err)          # EAGAIN at the default wall

        proc, count, release = bomb(parent, "raised", "--pids", "1100")   # control: a flag raises it
        release.touch()
        out, err = proc.communicate(timeout=120)
        made, errno = forked(out)
        assert errno == 11 and 1024 < made < 1100, (out, err)


def test_the_v2_path_writes_the_caps_on_the_base_group(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the caps go on cgroup v2 (the matrix guests run the real thing: the two tests above and
    test_daemon_limits.py put their parent in a delegated v2 unit there): a directory laid out like a v2
    group stands in for the mount, so this host (memory and pids on v1) runs the v2 code path too. It
    checks which files are written, not that the kernel enforces them. Also an owner's group below
    the base: the controllers handed down once more, the owner's caps on it, the sandbox inside."""
    from sandboxd.kernel import cgroups
    from sandboxd.kernel.host_limits import Ceiling, OwnerShare

    base = tmp_path / cgroups.BASE_NAME
    owner = base / (cgroups.OWNER_PREFIX + "uid-1000")
    for group in (tmp_path, base, owner):              # the kernel makes these files in every new group
        group.mkdir(exist_ok=True)
        (group / "cgroup.controllers").write_text("cpu memory pids\n")
        (group / "cgroup.subtree_control").write_text("")
    monkeypatch.setattr(cgroups, "_hierarchies", cgroups.Hierarchies(
        str(tmp_path), "/", frozenset({"cpu", "memory", "pids"}), {}))
    monkeypatch.setattr(cgroups, "_prepared", set())
    monkeypatch.setattr(cgroups, "_capped", {})
    cgroups.CgroupSet.create("run-1-1-aa", memory_bytes=64 << 20, pids=32,
                                     ceiling=Ceiling(pids=128, memory_bytes=256 << 20))
    assert (base / "pids.max").read_text() == "128" and (base / "memory.max").read_text() == str(256 << 20)
    assert (base / "run-1-1-aa" / "pids.max").read_text() == "32"
    assert (base / "run-1-1-aa" / "memory.max").read_text() == str(64 << 20)
    assert (base / "cgroup.subtree_control").read_text() == "+cpu +memory +pids"
    # a launch without caps (the restarted fork server's self-test) leaves them as they are
    (base / "pids.max").write_text("max")
    cgroups.CgroupSet.create("run-1-2-bb", memory_bytes=64 << 20, pids=32)
    assert (base / "pids.max").read_text() == "max"

    cgroups.CgroupSet.create("run-1-3-cc", memory_bytes=64 << 20, pids=32,
                             owner=OwnerShare("uid-1000", pids=100, memory_bytes=None))
    assert (owner / "cgroup.subtree_control").read_text() == "+cpu +memory +pids"
    assert (owner / "pids.max").read_text() == "100" and not (owner / "memory.max").exists()   # none asked
    assert (owner / "run-1-3-cc" / "pids.max").read_text() == "32"
