"""supervisor.cgroup from inside a container without a cgroup namespace (kernel.supervisor_cgroup),
on the real kernel: a process is put in a "container" group (``<test>/ctr`` in every hierarchy)
and given the view a runtime gives such a container (each hierarchy's /sys/fs/cgroup/<name> a
bind mount of its own group, in a mount namespace of its own). ``move_self`` then takes it out of
the container's group in every hierarchy, into ``<test>/supervisor``, and kernel.cgroups names
groups below that. The control: the same move written through the container's own mounts (what
the visible /sys/fs/cgroup offers) lands inside the container's group, where the runtime's kill
reaches it. The whole run on the host (mounts that show the roots) is test_adopt's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from daemon_helpers import cgroup_mounts

CONTAINER_VIEW = r'''
import json, os, sys
from sandboxd.kernel import cgroups, mounts, namespaces, supervisor_cgroup

test, how, staged = sys.argv[1], sys.argv[2], sys.argv[3]
own = supervisor_cgroup.own_hierarchies()
roots = {names: supervisor_cgroup.root_mount(names) for names in own}
for names in own:                                   # into the "container" group, every hierarchy
    with open(os.path.join(roots[names], test.lstrip("/"), "ctr", "cgroup.procs"), "w") as f:
        f.write("0")
# The runtime's view: /sys/fs/cgroup/<x> a bind mount of the container's own group.
namespaces.unshare(namespaces.CLONE_NEWNS)
mounts.mount(None, "/", None, mounts.MS_REC | mounts.MS_PRIVATE)
mounts.mount("tmpfs", staged, "tmpfs", 0, "size=64k")
points = {}
for names in own:
    point = os.path.join(staged, names.replace("name=", "").replace(",", "+") or "unified")
    os.mkdir(point)
    mounts.bind(os.path.join(roots[names], test.lstrip("/"), "ctr"), point, recursive=False)
    points[names] = point
mounts.mount(staged, "/sys/fs/cgroup", None, mounts.MS_BIND | mounts.MS_REC)
assert all(supervisor_cgroup.root_mount(names) is None for names in own)   # no root in view
if how == "move_self":
    supervisor_cgroup.move_self(test + "/supervisor")
else:                                               # the control: through the container's own mounts
    for names in own:
        group = os.path.join("/sys/fs/cgroup", os.path.basename(points[names]), test.lstrip("/"), "supervisor")
        os.makedirs(group, exist_ok=True)
        if "cpuset" in names.split(","):
            supervisor_cgroup._inherit_cpuset(os.path.join("/sys/fs/cgroup", os.path.basename(points[names])),
                                              test + "/supervisor")
        with open(os.path.join(group, "cgroup.procs"), "w") as f:
            f.write("0")
h = cgroups.detect()
print(json.dumps({"cgroup": open("/proc/self/cgroup").read().splitlines(),
                  "v1_memory": h.v1.get("memory"), "unified": [h.unified, h.unified_own]}))
'''


@pytest.fixture
def test_group() -> Iterator[str]:
    """``/<name>`` with a ``ctr`` group below it in every hierarchy (a v1 cpuset one given its
    parent's cpus and mems); removed afterwards, every level."""
    from sandboxd.kernel import supervisor_cgroup

    name = f"/sbxsupcg-{uuid.uuid4().hex[:8]}"
    for names in supervisor_cgroup.own_hierarchies():
        root = supervisor_cgroup.root_mount(names)
        if root is None:
            pytest.fail(f"no mount shows the root of the {names or 'v2'} hierarchy on this host")
        os.makedirs(os.path.join(root, name.lstrip("/"), "ctr"))
        if "cpuset" in names.split(","):
            supervisor_cgroup._inherit_cpuset(root, name + "/ctr")     # noqa: SLF001
    try:
        yield name
    finally:
        for mount in cgroup_mounts():
            top = mount / name.lstrip("/")
            for directory in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
                directory.rmdir()
            if top.exists():
                top.rmdir()


def in_container_view(test: str, how: str, staged: Path) -> dict[str, object]:
    """What the script above prints, run in a process of its own (``staged``: an empty directory it mounts on)."""
    staged.mkdir()
    done = subprocess.run([sys.executable, "-c", CONTAINER_VIEW, test, how, str(staged)], capture_output=True,
                          text=True, timeout=60, cwd=str(Path(__file__).parent.parent))
    assert done.returncode == 0, done.stderr[-3000:]
    found: dict[str, object] = json.loads(done.stdout)
    return found


def test_the_supervisor_leaves_the_containers_group_in_every_hierarchy(test_group: str, tmp_path: Path) -> None:
    seen = in_container_view(test_group, "move_self", tmp_path / "view")
    lines = seen["cgroup"]
    assert isinstance(lines, list) and lines
    assert all(line.split(":", 2)[2] == f"{test_group}/supervisor" for line in lines), lines
    # kernel.cgroups then puts sandboxes below the supervisor's group, outside the container's.
    memory = seen["v1_memory"]
    if memory is not None:
        assert isinstance(memory, list) and memory[1] == f"{test_group}/supervisor", memory
    assert seen["unified"] == ["/sys/fs/cgroup/unified", f"{test_group}/supervisor"], seen["unified"]


def test_control_through_the_containers_own_mounts_it_stays_inside(test_group: str, tmp_path: Path) -> None:
    seen = in_container_view(test_group, "control", tmp_path / "view")
    lines = seen["cgroup"]
    assert isinstance(lines, list) and lines
    assert all(line.split(":", 2)[2].startswith(f"{test_group}/ctr/") for line in lines), lines
