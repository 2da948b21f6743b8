"""The pod of a caller, from its /proc/PID/cgroup (kernel.pod_cgroups): kubelet's spellings for
both cgroup drivers, v1 and v2, generated; and the paths a hostile pod or node user can make."""

from __future__ import annotations

import itertools
import random
import uuid

import pytest

from sandboxd.kernel.pod_cgroups import CgroupRefused, PodCgroup, hierarchy_ids, pod_of

V1_CONTROLLERS = ("cpu,cpuacct", "memory", "pids", "blkio", "devices", "freezer", "name=systemd")
V2_IDS = frozenset({"0"})
V1_IDS = frozenset(str(n) for n in range(1, len(V1_CONTROLLERS) + 1))
HYBRID_IDS = V1_IDS | V2_IDS
QOS = ("", "burstable", "besteffort")
CONTAINERS = {"cgroupfs": "0123456789abcdef" * 4, "systemd": "cri-containerd-" + "ab" * 32 + ".scope"}


def pod_path(driver: str, qos: str, uid: str, root: str = "") -> str:
    """The pod cgroup kubelet makes for ``uid`` (kubelet's own naming, written out independently)."""
    if driver == "cgroupfs":
        return f"{root}/kubepods" + (f"/{qos}" if qos else "") + f"/pod{uid}"
    escaped = uid.replace("-", "_")
    if qos:
        return f"{root}/kubepods.slice/kubepods-{qos}.slice/kubepods-{qos}-pod{escaped}.slice"
    return f"{root}/kubepods.slice/kubepods-pod{escaped}.slice"


def v2_text(path: str) -> str:
    return f"0::{path}\n"


def v1_text(path: str, hybrid: bool = False) -> str:
    lines = [f"{n}:{c}:{path}" for n, c in zip(range(len(V1_CONTROLLERS), 0, -1), reversed(V1_CONTROLLERS), strict=True)]
    if hybrid:
        lines.append("0::/")
    return "\n".join(lines) + "\n"


def uids(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    made = [str(uuid.UUID(int=rng.getrandbits(128), version=4)) for _ in range(count)]
    return made + ["".join(rng.choice("0123456789abcdef") for _ in range(32))]      # a static pod's


@pytest.mark.parametrize("driver,qos", list(itertools.product(("cgroupfs", "systemd"), QOS)))
def test_kubelet_paths_name_their_pod_v1_v2_and_hybrid(driver: str, qos: str) -> None:
    for uid in uids(8, hash((driver, qos)) & 0xFFFF):
        pod = pod_path(driver, qos, uid)
        container = f"{pod}/{CONTAINERS[driver]}"
        expected = PodCgroup(uid=uid, pod_path=pod, cgroup_path=container)
        assert pod_of(v2_text(container), V2_IDS) == expected
        assert pod_of(v1_text(container), V1_IDS) == expected
        assert pod_of(v1_text(container, hybrid=True), HYBRID_IDS) == expected
        # A process in the pod cgroup itself (v1 allows it) is that pod's too.
        assert pod_of(v2_text(pod), V2_IDS) == PodCgroup(uid=uid, pod_path=pod, cgroup_path=pod)


def test_hybrid_prefers_the_v2_line_when_it_names_the_pod() -> None:
    uid = uids(1, 7)[0]
    pod = pod_path("systemd", "burstable", uid)
    text = v1_text(f"{pod}/v1-container").replace("0::/\n", "") + f"0::{pod}/v2-container\n"
    assert pod_of(text, HYBRID_IDS) == PodCgroup(uid=uid, pod_path=pod, cgroup_path=f"{pod}/v2-container")


def test_a_configured_cgroup_root_anchors_kubepods() -> None:
    uid = uids(1, 3)[0]
    inside = pod_path("cgroupfs", "besteffort", uid, root="/kubelet") + "/c"
    assert pod_of(v2_text(inside), V2_IDS, root="/kubelet").uid == uid
    # The same path under the default root is no pod; a kubepods at the top is none under /kubelet.
    assert pod_of(v2_text(inside), V2_IDS) is None
    assert pod_of(v2_text(pod_path("cgroupfs", "", uid) + "/c"), V2_IDS, root="/kubelet") is None


@pytest.mark.parametrize("path", ["/", "/user.slice/user-1000.slice/session-3.scope", "/system.slice/kubelet.service",
                                  "/system.slice/containerd.service", "/kubepodsX/pod" + "a" * 32,
                                  "/machine.slice/libpod-" + "ab" * 32 + ".scope"])
def test_node_processes_are_in_no_pod(path: str) -> None:
    assert pod_of(v2_text(path), V2_IDS) is None
    assert pod_of(v1_text(path), V1_IDS) is None


def test_kubepods_somewhere_else_is_no_pod() -> None:
    """A node user's delegated systemd subtree (or any cgroup not at the root) may be named kubepods."""
    uid = uids(1, 11)[0]
    for prefix in ("/user.slice/user-1000.slice/user@1000.service", "/sbx-test", "/kubepods-not"):
        assert pod_of(v2_text(pod_path("cgroupfs", "", uid, root=prefix) + "/c"), V2_IDS) is None
        assert pod_of(v2_text(pod_path("systemd", "burstable", uid, root=prefix) + "/c"), V2_IDS) is None


def test_a_pod_naming_another_pod_in_its_own_subtree_stays_itself() -> None:
    """With a delegated (writable) subtree a pod can make cgroups below its container named like
    another pod's; the pod is read only at kubelet's depth."""
    mine, theirs = uids(2, 5)[:2]
    for driver, qos in itertools.product(("cgroupfs", "systemd"), QOS):
        own = pod_path(driver, qos, mine)
        for forged in (pod_path("cgroupfs", "", theirs), pod_path("systemd", "burstable", theirs),
                       f"/pod{theirs}", f"/kubepods-pod{theirs.replace('-', '_')}.slice"):
            path = f"{own}/{CONTAINERS[driver]}{forged}/leaf"
            assert pod_of(v2_text(path), V2_IDS) == PodCgroup(uid=mine, pod_path=own, cgroup_path=path)


@pytest.mark.parametrize("below", [
    "/kubepods", "/kubepods/burstable", "/kubepods/guaranteed/pod{uid}/c", "/kubepods/pod/c",
    "/kubepods/podnot-a-uid/c", "/kubepods/pod{UID}/c", "/kubepods/burstable/burstable/pod{uid}/c",
    "/kubepods.slice", "/kubepods.slice/kubepods-burstable.slice",
    "/kubepods.slice/kubepods-pod{uid}.slice/c",                    # dashes, not systemd's underscores
    "/kubepods.slice/kubepods-besteffort.slice/kubepods-burstable-pod{uid_}.slice/c",
    "/kubepods.slice/kubepods-pod{uid_}/c", "/kubepods.slice/kubepods-pod{uid_}x.slice/c",
    "/kubepods/pod{uid}\x1b[2J/c",
])
def test_below_kubepods_but_in_no_pod_is_refused(below: str) -> None:
    uid = uids(1, 13)[0]
    path = below.format(uid=uid, UID=uid.upper(), uid_=uid.replace("-", "_"))
    with pytest.raises(CgroupRefused, match="below kubepods") as caught:
        pod_of(v2_text(path), V2_IDS)
    assert "\x1b" not in str(caught.value)          # shown escaped


def test_a_line_break_in_a_cgroup_name_cannot_forge_a_line() -> None:
    """/proc/PID/cgroup prints names raw: a sub-cgroup named "x\\n0::/kubepods/pod<other>/c" reads as a
    second line. Every hierarchy must appear exactly once, as in the daemon's own."""
    mine, theirs = uids(2, 17)[:2]
    own = pod_path("cgroupfs", "burstable", mine) + "/ctr"
    forged = f"x\n0::{pod_path('cgroupfs', '', theirs)}/c"
    for text, ids in ((v2_text(own + "/" + forged), V2_IDS),
                      (v1_text(own + "/" + forged.replace("0::", "3:memory:")), V1_IDS),
                      (v2_text(own + "/x\n99:memory:/y"), V2_IDS),                  # a hierarchy that does not exist
                      ("", V2_IDS), ("0::/\n", HYBRID_IDS), ("garbage\n", V2_IDS)):
        with pytest.raises(CgroupRefused, match="one line per cgroup hierarchy"):
            pod_of(text, ids)


def test_pods_disagreeing_between_hierarchies_are_refused() -> None:
    first, second = uids(2, 19)[:2]
    text = (f"2:memory:{pod_path('cgroupfs', '', first)}/c\n"
            f"1:pids:{pod_path('cgroupfs', '', second)}/c\n")
    with pytest.raises(CgroupRefused, match="2 different pods"):
        pod_of(text, frozenset({"1", "2"}))


def test_outside_the_daemons_cgroup_namespace_is_refused_saying_so() -> None:
    uid = uids(1, 23)[0]
    with pytest.raises(CgroupRefused, match="cgroup namespace"):
        pod_of(v2_text("/../.." + pod_path("systemd", "", uid) + "/c"), V2_IDS)


def test_hierarchy_ids_of_the_daemons_own_list() -> None:
    assert hierarchy_ids(v1_text("/", hybrid=True)) == HYBRID_IDS
    assert hierarchy_ids(v2_text("/")) == V2_IDS


# In a cgroup namespace rooted at its own cgroup (argv[1], joined first), a thread reads its
# parent's (argv[2]) cgroup, joins the parent's cgroup namespace, and reads it again.
JOIN = r"""
import json, os, subprocess, sys, threading
with open(sys.argv[1] + "/cgroup.procs", "w") as f:
    f.write("0")
from sandboxd.kernel.namespaces import CLONE_NEWCGROUP, unshare
from sandboxd.kernel.pod_cgroups import join_node_cgroup_namespace, read_cgroups
unshare(CLONE_NEWCGROUP)
seen = {}
def look():
    seen["before"] = read_cgroups(int(sys.argv[2]))
    seen["joined"] = join_node_cgroup_namespace(int(sys.argv[2]))
    seen["after"] = read_cgroups(int(sys.argv[2]))
    seen["again"] = join_node_cgroup_namespace(int(sys.argv[2]))
thread = threading.Thread(target=look)
thread.start()
thread.join()
seen["main thread"] = read_cgroups(int(sys.argv[2]))
print(json.dumps(seen))
"""


def test_a_daemon_in_a_cgroup_namespace_of_its_own_reads_the_nodes_paths_after_joining() -> None:
    """A container's own cgroup namespace (containerd on cgroup v2) shows other cgroups as "/.."
    paths, which name no pod; the front door's thread joins the node's (here: this test's) and
    reads the real path. Control: before joining, and on another thread, the "/.." form."""
    import json
    import subprocess
    import sys

    from pod_world import cgroup2_mount

    mount = cgroup2_mount()
    if mount is None:
        pytest.skip("no cgroup2 hierarchy mounted: no cgroup namespace to root there")
    top = mount / f"sbxt-cgns-{uuid.uuid4().hex[:8]}"
    inside, outside = top / "daemon", top / "node"
    inside.mkdir(parents=True)
    outside.mkdir()
    node = subprocess.Popen(["sleep", "60"])
    try:
        (outside / "cgroup.procs").write_text(str(node.pid))
        done = subprocess.run([sys.executable, "-c", JOIN, str(inside), str(node.pid)], capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        seen = json.loads(done.stdout)
        v2 = lambda text: next(line[3:] for line in text.splitlines() if line.startswith("0::"))  # noqa: E731
        assert v2(seen["before"]) == "/../node" and v2(seen["main thread"]) == "/../node"
        assert seen["joined"] is True and seen["again"] is False
        assert v2(seen["after"]) == f"/{top.name}/node"
    finally:
        node.kill()
        node.wait()
        for group in (inside, outside, top):
            group.rmdir()
