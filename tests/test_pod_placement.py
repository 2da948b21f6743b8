"""Work charged to the pod that asked (limits.charge_pods; kernel.pod_placement, service.pod_sessions),
on the real kernel with a fake pod of the test's own: a kubelet's layout (``.../kubepods/burstable/
pod<uid>/<container>``) in each hierarchy that has memory or pids (v1 here, v2 in the matrix guests),
a "container" process holding it, the pod capped at 600 MiB. An agent process in the container
creates a session:

- its sandbox's groups are leaves ``sandboxd-*`` of the pod's group, beside the container;
- memory its command touches is charged to the pod (its usage rises by it), not to the daemon's base
  group (control: that one stays small);
- it is held to the pod's limit: 1 GiB is refused naming the pod's group, the default is capped to
  600 MiB (control: a caller outside the pod gets the daemon's layout and its full default);
- closing it removes its leaf; a SIGKILLed fork server's empty leaves in the pod go when the pod's
  next session is placed (control: a live creator's stay); and when the pod's container processes are all gone, the daemon
  closes the pod's other session and removes its leaf, so the pod's group can be removed as a
  kubelet would (control: while the container lives, the session stays open).
A caller may not name a pod itself (the label is the daemon's).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from cgroup_helpers import read, remove_group, v2_slice
from conftest import BASE_ENV, PY, SLOW
from daemon_helpers import (_CLIENT_PRELUDE, PYTHON, Daemon, DaemonFactory, close_quietly, create_session,
                            rpc_error, run_exec, workspace_write)
from sandboxd.kernel import cgroups, creators, pod_placement
from sandboxd.service.sessions.placement import LABEL
from sandboxd.v1 import sandboxd_pb2 as pb

pytestmark = pytest.mark.timeout(300)

POD_CAP = 600 << 20
CONFIG = "[limits]\ncharge_pods = true\n"
HOLD = ("import os, sys, time\n"
        "b = bytearray(int(sys.argv[1]) << 20)\n"
        "for i in range(0, len(b), 4096): b[i] = 1\n"
        "print('HELD', flush=True)\n"
        "while not os.path.exists(sys.argv[2]): time.sleep(0.05)\n")


@dataclass
class FakePod:
    pods: dict[str, Path] = field(default_factory=dict)          # hierarchy key -> the pod's group
    containers: dict[str, Path] = field(default_factory=dict)    # hierarchy key -> the container's group
    memory: tuple[Path, str] = (Path("/"), "")                   # (the group memory is accounted in, v1/v2)

    def join(self) -> list[str]:
        """An argv prefix that moves itself into the container's groups, then execs the rest."""
        return ["sh", "-c", 'for g in $0; do echo $$ > "$g/cgroup.procs" || exit 9; done; exec "$@"',
                " ".join(str(c) for c in self.containers.values())]

    def usage(self) -> int:
        group, version = self.memory
        return int(read(group / ("memory.current" if version == "v2" else "memory.usage_in_bytes")))

    def leaves(self) -> list[Path]:
        return sorted(leaf for pod in self.pods.values() for leaf in pod.glob(pod_placement.PLACED_PREFIX + "*"))


@contextlib.contextmanager
def fake_pod() -> Iterator[FakePod]:
    """A kubelet's pod layout of the test's own, in v2 (with controllers handed down when v2 has
    memory and pids) and in each v1 hierarchy of memory and pids that v2 does not have; the pod's
    memory capped at POD_CAP. Killed and removed afterwards."""
    h = cgroups.detect()
    tag, uid, ctr = f"sbxt-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex, uuid.uuid4().hex
    pod = FakePod()
    with contextlib.ExitStack() as stack:
        v2_memory = {"memory", "pids"} <= h.unified_controllers
        if h.unified:
            if v2_memory:
                top = stack.enter_context(v2_slice(h.unified))
            else:
                top = Path(h.unified, tag)
                top.mkdir()
                stack.callback(remove_group, top)
            control = read(top / "cgroup.subtree_control")
            group = top
            for name in ("kubepods", "burstable", f"pod{uid}"):
                group = group / name
                group.mkdir()
                if control:
                    (group / "cgroup.subtree_control").write_text(" ".join("+" + c for c in control.split()))
            pod.pods[pod_placement.UNIFIED] = group
            if v2_memory:
                pod.memory = (group, "v2")
        for controller in ("memory", "pids"):
            if v2_memory or controller not in h.v1:
                continue
            point, own = h.v1[controller]
            top = Path(point, own.lstrip("/"), tag)
            top.mkdir()
            stack.callback(remove_group, top)
            group = top / "kubepods" / "burstable" / f"pod{uid}"
            group.mkdir(parents=True)
            pod.pods[controller] = group
            if controller == "memory":
                pod.memory = (group, "v1")
        assert pod.memory[1], "no hierarchy accounts memory here"
        group, version = pod.memory
        (group / ("memory.max" if version == "v2" else "memory.limit_in_bytes")).write_text(str(POD_CAP))
        for key, group in pod.pods.items():
            pod.containers[key] = group / ctr
            pod.containers[key].mkdir()
        yield pod


def agent_creates_session(daemon: Daemon, pod: FakePod, workspace: Path, **limits: int) -> dict[str, str]:
    """A process in the pod's container creates a session; its id (or the refusal's code and details)."""
    body = ("request = pb.CreateSessionRequest(workspace=ARGS['ws'], approval_policy=pb.NEVER, "
            "limits=pb.Limits(**ARGS['limits']))\n"
            "request.sandbox_policy.mode = pb.SandboxPolicy.WORKSPACE_WRITE\n"
            "try:\n"
            "    s = stub.CreateSession(request, timeout=120)\n"
            "    print(json.dumps({'id': s.id, 'memory': s.limits.memory_bytes}))\n"
            "except grpc.RpcError as e:\n"
            "    print(json.dumps({'code': e.code().name, 'details': e.details()}))\n")
    payload = json.dumps({"uid": 0, "gid": 0, "socket": daemon.socket, "ws": str(workspace), "limits": limits})
    proc = subprocess.run([*pod.join(), PYTHON, "-c", _CLIENT_PRELUDE + "import json\n" + body, payload],
                          capture_output=True, text=True, timeout=180, env=BASE_ENV, cwd="/")
    assert proc.returncode == 0 and proc.stdout.strip(), (proc.returncode, proc.stdout, proc.stderr)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def until(done: "Callable[[], bool]", within: float = 60.0 * SLOW) -> bool:
    """Whether ``done()`` holds within ``within`` seconds (asked every 50 ms)."""
    deadline = time.monotonic() + within
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def base_usage() -> int:
    """Memory charged to the daemon's base group (its sandboxes' parent) in this test's process's group."""
    h = cgroups.detect()
    if "memory" in h.unified_controllers and h.unified:
        path = Path(h.unified, h.unified_own.lstrip("/"), cgroups.BASE_NAME, "memory.current")
    else:
        point, own = h.v1["memory"]
        path = Path(point, own.lstrip("/"), cgroups.BASE_NAME, "memory.usage_in_bytes")
    return int(read(path)) if path.exists() else 0


def test_pod_groups_are_recognised_by_a_kubelets_names() -> None:
    assert pod_placement.pod_of({"unified": "/kubepods.slice/kubepods-burstable.slice/"
                               "kubepods-burstable-pod1a2b_3c.slice/cri-containerd-ab.scope"}) == {
        "unified": "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1a2b_3c.slice"}
    assert pod_placement.pod_of({"memory": "/kubepods/besteffort/pod1a2b-3c/ab12"}) == {
        "memory": "/kubepods/besteffort/pod1a2b-3c"}
    # control: not pods, so never placed by their cgroup
    for path in ("/user.slice/user-1000.slice/session-3.scope", "/system.slice/sandboxd.service",
                 "/pod1234/x", "/kubepods/burstable/pod12", "/"):
        assert pod_placement.pod_of({"unified": path}) is None, path
    with pytest.raises(ValueError):
        pod_placement.check_placement({"unified": "/kubepods/burstable/pod12/../../etc"})


def test_a_pods_session_is_charged_to_the_pod_held_to_its_limit_and_swept_with_it(
        sandboxd_daemon: DaemonFactory) -> None:
    with fake_pod() as pod:
        container = subprocess.Popen([*pod.join(), "sleep", "600"], env=BASE_ENV)
        daemon = sandboxd_daemon(config=CONFIG)
        opened: list[str] = []
        try:
            check_pod_sessions(sandboxd_daemon, daemon, pod, container, opened)
        finally:
            container.kill()
            container.wait()
            for session_id in opened:
                close_quietly(daemon.stub, session_id)
            daemon.close()


def check_pod_sessions(factory: DaemonFactory, daemon: Daemon, pod: FakePod, container: subprocess.Popen[bytes],
                       opened: list[str]) -> None:
    stub = daemon.stub
    ws = factory.workspace()

    refused = agent_creates_session(daemon, pod, ws, memory_bytes=1 << 30)
    assert refused.get("code") == "INVALID_ARGUMENT", refused
    memory_key = pod_placement.UNIFIED if pod.memory[1] == "v2" else "memory"     # where the pod's cap is
    pod_path = os.path.dirname(pod_placement.caller_groups(container.pid)[memory_key])
    assert pod_path in refused["details"] and str(POD_CAP) in refused["details"], refused

    made = agent_creates_session(daemon, pod, ws)
    assert "id" in made, made
    opened.append(made["id"])
    assert int(made["memory"]) == POD_CAP, made              # the default, capped to the pod's limit
    leaves = pod.leaves()                                  # one leaf per hierarchy, beside the container
    assert len({leaf.name for leaf in leaves}) == 1 and leaves[0].name.startswith("sandboxd-run-"), leaves
    assert {leaf.parent for leaf in leaves} == set(pod.pods.values()), leaves
    group, version = pod.memory
    assert read(group / leaves[0].name / ("memory.max" if version == "v2" else "memory.limit_in_bytes")) == str(POD_CAP)

    # control: a caller outside the pod (this test) gets the daemon's own layout and its full default
    outside = create_session(stub, ws, workspace_write())
    opened.append(outside.id)
    assert outside.limits.memory_bytes > POD_CAP and LABEL not in outside.labels
    assert pod.leaves() == leaves

    # its memory is the pod's: 200 MiB held in the session shows in the pod's usage, not the daemon's base
    release = ws / "release"
    before_pod, before_base = pod.usage(), base_usage()
    done: dict[str, object] = {}
    call = threading.Thread(target=lambda: done.update(out=run_exec(stub, made["id"], [PY, "-c", HOLD, "200",
                                                                                          str(release)])))
    call.start()
    try:
        deadline = time.monotonic() + 120 * SLOW
        while pod.usage() < before_pod + (190 << 20) and time.monotonic() < deadline and call.is_alive():
            time.sleep(0.05)
        held_pod, held_base = pod.usage(), base_usage()
    finally:
        release.touch()
        call.join(120)
    assert held_pod >= before_pod + (190 << 20), (before_pod, held_pod, done)
    assert held_base < before_base + (50 << 20), (before_base, held_base)      # control: not the daemon's
    assert b"HELD" in done["out"].stdout, done["out"].describe()              # type: ignore[attr-defined]

    # closed: its leaf goes
    stub.CloseSession(pb.CloseSessionRequest(session_id=made["id"]))
    assert until(lambda: not pod.leaves()), pod.leaves()

    # a caller may not name a pod itself
    error = rpc_error(lambda: create_session(stub, ws, workspace_write(), labels={LABEL: json.dumps(
        {memory_key: pod_path})}))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and LABEL in error.details(), error

    # a SIGKILLed predecessor's empty leaves go when the pod's next session is placed; a live creator's stay
    tag = creators.creator_tag()
    pid, start, namespace = tag.split("-")
    dead = f"{pod_placement.PLACED_PREFIX}run-{pid}-{int(start) + 1}-{namespace}-1-aaaaaa"
    live = f"{pod_placement.PLACED_PREFIX}run-{tag}-1-bbbbbb"
    for group in pod.pods.values():
        (group / dead).mkdir()
        (group / live).mkdir()

    # the pod ends: its session is closed and its leaf removed, so the kubelet's rmdir works
    second = agent_creates_session(daemon, pod, ws)
    assert "id" in second, second
    opened.append(second["id"])
    names = {leaf.name for leaf in pod.leaves()}
    assert dead not in names and live in names, names
    for group in pod.pods.values():
        (group / live).rmdir()
    assert len({leaf.name for leaf in pod.leaves()}) == 1
    time.sleep(3 * 2.0)                                   # control: a few sweeps with the container alive
    assert stub.GetSession(pb.GetSessionRequest(session_id=second["id"])).sandbox_ready
    container.kill()
    container.wait()
    killed_at = time.monotonic()
    assert until(lambda: not pod.leaves()), pod.leaves()
    freed_after = time.monotonic() - killed_at
    sessions = stub.ListSessions(pb.ListSessionsRequest(include_closed=True)).sessions
    closed = [s for s in sessions if s.id == second["id"]]
    assert closed and closed[0].closed_at, closed
    for group in pod.pods.values():                       # what a kubelet does next
        (group / next(iter(pod.containers.values())).name).rmdir()
        group.rmdir()
    print(f"pod group free {freed_after:.2f}s after its last container process ended")
