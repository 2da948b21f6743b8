"""cgroup v2 the way systemd and container runtimes expect (sandboxd/kernel/cgroups.py).

Each test builds the situation a deployment has, with real cgroups, and runs a real
`sandboxd run` in it: a systemd unit with Delegate=yes (its group marked with the
trusted.delegate xattr, processes in it), a group that is not delegated, a container with
a private cgroup namespace, and root outside systemd. They need the memory and pids
controllers on cgroup v2 (Debian 12+, Ubuntu 24.04, Kubernetes nodes); packaging/vm/run-matrix
runs them on those kernels. This project's CI host has them on cgroup v1 only, where
tests/test_limits.py covers the limits themselves.
"""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from cgroup_helpers import read, v2_slice
from conftest import BASE_ENV, SANDBOXD, describe, py

from sandboxd.kernel import cgroups

H = cgroups.detect()
pytestmark = pytest.mark.skipif(
    not H.unified or not {"memory", "pids"} <= H.unified_controllers,
    reason="cgroup v2 offers no memory+pids controllers to this process (they are on cgroup v1 here)")
MOUNT = H.unified or "/sys/fs/cgroup"

ALLOCATE = ("import sys\n"
            "b = bytearray(int(sys.argv[1]) << 20)\n"
            "for i in range(0, len(b), 4096): b[i] = 1\n"
            "print('ALIVE', flush=True)\n")


def in_group(group: Path, *argv: str, timeout: float = 120, popen: bool = False):  # type: ignore[no-untyped-def]
    """Run argv as a process of ``group`` (it moves itself there before exec); once sandboxd has made
    the group hand controllers down, into its leaf (as another process of the same unit)."""
    if (group / "sandboxd-supervisor").is_dir():
        group = group / "sandboxd-supervisor"
    command = ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(group), *argv]
    if popen:
        return subprocess.Popen(command, env=BASE_ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.run(command, env=BASE_ENV, capture_output=True, text=True, timeout=timeout)


def sbx(*args: str) -> list[str]:
    return [SANDBOXD, "run", "--sandbox", "workspace-write", "--workspace", "/tmp", *args]


@pytest.fixture
def slice_() -> Iterator[Path]:
    with v2_slice(MOUNT) as group:
        yield group


def unit(slice_: Path, delegated: bool) -> Path:
    group = slice_ / "agent.service"
    group.mkdir()
    if delegated:
        os.setxattr(group, "trusted.delegate", b"1")      # what systemd sets for Delegate=yes
    return group


def test_delegated_unit_gets_sessions_below_it_and_its_processes_move_to_a_leaf(slice_: Path) -> None:
    group = unit(slice_, delegated=True)
    slice_control = read(slice_ / "cgroup.subtree_control")
    proc = in_group(group, *sbx("--memory", "64M", "--pids", "32", "--", "sleep", "3"), popen=True)
    try:
        deadline = time.monotonic() + 60
        while not list(group.glob("sandboxd/run-*")) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        runs = list(group.glob("sandboxd/run-*"))
        assert len(runs) == 1, (proc.poll(), proc.stderr.read() if proc.poll() is not None else "")
        assert read(runs[0] / "memory.max") == str(64 << 20)
        assert read(runs[0] / "pids.max") == "32"
        # the no-internal-process rule: `sandboxd run` itself moved to the leaf, the unit holds none
        assert str(proc.pid) in read(group / "sandboxd-supervisor" / "cgroup.procs").split()
        assert read(group / "cgroup.procs") == ""
        assert {"memory", "pids", "cpu"} <= set(read(group / "cgroup.subtree_control").split())
    finally:
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert read(slice_ / "cgroup.subtree_control") == slice_control    # nothing written above the unit
    assert not (group / "sandboxd").exists()                            # what it created, it removed


def test_limits_hold_in_a_delegated_unit(slice_: Path) -> None:
    group = unit(slice_, delegated=True)
    over = in_group(group, *sbx("--memory", "64M", "--", *py(ALLOCATE, "256")))
    assert over.returncode == 137 and "ALIVE" not in over.stdout, describe(over)
    assert "memory limit" in over.stderr, describe(over)          # oom_killed, reported
    under = in_group(group, *sbx("--memory", "64M", "--", *py(ALLOCATE, "16")))
    assert under.returncode == 0 and "ALIVE" in under.stdout, describe(under)


def test_a_busy_group_that_is_not_delegated_is_refused_with_the_fix(slice_: Path) -> None:
    group = unit(slice_, delegated=False)
    bystander = in_group(group, "sleep", "60", popen=True)        # someone else's process in the group
    try:
        time.sleep(0.2)
        result = in_group(group, *sbx("--memory", "64M", "--", "true"))
        assert result.returncode == 125, describe(result)
        assert "Delegate=yes" in result.stderr, describe(result)
        assert str(bystander.pid) in read(group / "cgroup.procs").split()     # nobody was moved
        assert not (group / "sandboxd-supervisor").exists()
    finally:
        bystander.kill()
        bystander.wait()
    # control: the same command without limits (the default ones turned off) needs no controller and runs
    result = in_group(group, *sbx("--no-default-limits", "--", "true"))
    assert result.returncode == 0, describe(result)


def test_private_cgroup_namespace_uses_its_root(slice_: Path) -> None:
    """A container: its own cgroup namespace and cgroup2 mount, its processes in the namespace root."""
    container = slice_ / "container"
    container.mkdir()
    # the host's cgroup2 mount is replaced by one of the new namespace (mounting over it is EBUSY)
    script = (f'umount {MOUNT} && mount -t cgroup2 cgroup2 {MOUNT} && grep "^0::" /proc/self/cgroup && '
              'exec "$@"')
    over = in_group(container, "unshare", "--mount", "--cgroup", "sh", "-c", script, "sh",
                    *sbx("--memory", "64M", "--pids", "32", "--", *py(ALLOCATE, "256")))
    assert over.stdout.startswith("0::/\n"), describe(over)     # inside, its group is the root
    assert over.returncode == 137 and "ALIVE" not in over.stdout, describe(over)
    under = in_group(container, "unshare", "--mount", "--cgroup", "sh", "-c", script, "sh",
                     *sbx("--memory", "64M", "--pids", "32", "--", *py(ALLOCATE, "16")))
    assert under.returncode == 0 and "ALIVE" in under.stdout, describe(under)
    assert (container / "sandboxd-supervisor").is_dir()          # the namespace root's processes moved
    assert not list(container.glob("sandboxd/run-*"))


def test_root_outside_systemd_creates_what_it_needs_and_removes_it() -> None:
    """`sandboxd run` in the root group (no systemd: a VM's init, a plain container host)."""
    root = Path(MOUNT)
    if read(Path("/proc/1/cgroup")).strip() != "0::/":
        pytest.skip("needs a machine whose init runs in the root cgroup (a VM guest, a container host "
                    "without systemd); here it does not")
    base = root / "sandboxd"
    if base.exists():
        # An earlier module's in-process spawner (this test process's) leaves it, empty, until its exit.
        try:
            base.rmdir()
        except OSError:
            pytest.skip("a sandboxd daemon uses the root's base group right now")

    def from_the_root_group() -> None:
        # This test process may sit in a leaf sandboxd made for it (sandboxd-supervisor): the command
        # under test starts where a root shell of such a machine starts.
        with open(root / "cgroup.procs", "w") as f:
            f.write("0")

    result = subprocess.run(sbx("--memory", "64M", "--pids", "32", "--", "true"), env=BASE_ENV,
                            capture_output=True, text=True, timeout=120, preexec_fn=from_the_root_group)
    assert result.returncode == 0, describe(result)
    assert not (root / "sandboxd").exists()


def test_a_unit_whose_parent_hands_down_no_memory_controller_is_refused_with_the_fix(slice_: Path) -> None:
    """Delegated, but the slice above enables nothing for it: the limit is refused before anything runs,
    naming the group and the fix (sandboxd never writes above its own group to enable it)."""
    bare = slice_ / "bare.slice"
    bare.mkdir()                                  # its subtree_control stays empty
    group = unit(bare, delegated=True)
    result = in_group(group, *sbx("--memory", "64M", "--", "true"))
    assert result.returncode == 125, describe(result)
    assert "cannot hand down the memory controller" in result.stderr and "Delegate=yes" in result.stderr, \
        describe(result)
    assert read(bare / "cgroup.subtree_control") == ""                   # nothing written above the unit
    control = in_group(group, *sbx("--no-default-limits", "--", "true"))
    assert control.returncode == 0, describe(control)
