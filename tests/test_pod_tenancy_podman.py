"""Tenancy by pod with real pods (deployment marker: podman; about a minute): a daemon pod (the
daemon in a privileged container with the host's PID and cgroup namespaces, as the DaemonSet runs
it) and two agent pods, each running its agent as root, their cgroups where podman puts a pod
given kubelet's cgroup parent (``<test root>/kubepods/...pod<UID>/<pod id>/libpod-<container>``).

Under ``tenancy.mode = "pod"`` neither agent sees or touches the other's sessions, each has its own
session quota, and danger-full-access is refused; control: the same pods against the daemon under
uid tenancy share root (see each other's sessions, pass the quota, get danger-full-access).

The containers run on the host's root file system (podman --rootfs /:O, an overlay: nothing is
written to the host), so no image has to be built: the daemon and the agents are this checkout's.
All podman state lives in a temporary directory (--root, --runroot, --tmpdir, a containers.conf of
its own), as in packaging/container/build-and-run; the pods' cgroups are below a parent named for
the test, removed afterwards in every hierarchy."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import BASE_ENV, REPO, SANDBOXD
from daemon_helpers import cgroup_mounts
from pod_world import AGENT, refused
from test_pod_tenancy import FULL, create, ids, listed, touch_attempts

pytestmark = [pytest.mark.deployment, pytest.mark.timeout(900)]

SANDBOXCTL = str(REPO / ".venv" / "bin" / "sandboxctl")
SHARED_STATE = [Path(p) for p in ("/dev/shm/libpod_lock", "/run/libpod", "/run/containers", "/var/lib/containers",
                                  "/etc/cni/net.d/cni.lock", "/var/lib/cni")]


class Podman:
    """podman with every bit of its state in ``work``."""

    def __init__(self, work: Path, pidns: str = "private") -> None:
        self.work = work
        nofile = os.sysconf("SC_OPEN_MAX")
        # pidns: every container's default PID namespace ("host": what a pod's hostPID asks for,
        # which podman 4.3's kube play ignores).
        (work / "containers.conf").write_text(
            f'[containers]\npidns = "{pidns}"\ndefault_ulimits = ["nofile={nofile}:{nofile}", "nproc=32768:32768"]\n'
            f'[engine]\nruntime = "runc"\ncgroup_manager = "cgroupfs"\nevents_logger = "file"\n'
            f'events_logfile_path = "{work}/events.log"\n')
        self.env = {**BASE_ENV, "CONTAINERS_CONF": str(work / "containers.conf")}
        self.base = ["podman", "--root", str(work / "storage"), "--runroot", str(work / "runroot"),
                     "--tmpdir", str(work / "tmp")]

    def __call__(self, *args: str, input: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
        done = subprocess.run([*self.base, *args], capture_output=True, text=True, env=self.env, input=input,
                              timeout=300)
        if check:
            assert done.returncode == 0, f"podman {' '.join(args)}: {done.stderr[-2000:]}"
        return done

    def host_rootfs_run(self, *options: str, command: list[str], input: str | None = None,
                        check: bool = True) -> subprocess.CompletedProcess[str]:
        """A container on the host's root file system (overlaid), ``work`` bound at its own path."""
        return self("run", *options, "-v", f"{self.work}:{self.work}", "--rootfs", "/:O", *command,
                    input=input, check=check)


def remove_cgroups(name: str) -> list[str]:
    """rmdir every cgroup below /<name> in every hierarchy (the pods are gone: they are empty);
    what could not be removed."""
    left = []
    for mount in cgroup_mounts():
        top = mount / name
        if not top.exists():
            continue
        for directory, _, _ in sorted(os.walk(top), key=lambda entry: -entry[0].count("/")):
            with contextlib.suppress(OSError):
                os.rmdir(directory)
        if top.exists():
            left.append(str(top))
    return left


class Node:
    """A daemon pod and agent pods, all of this test's."""

    def __init__(self, podman: Podman, root: str) -> None:
        self.podman = podman
        self.root = root                       # the test's cgroup parent: tenancy.cgroup_root
        self.socket = str(podman.work / "sock" / "sandboxd.sock")
        self.pods: list[str] = []
        self.daemons = 0

    def start_daemon(self, mode: str, sessions: int, cgroupns: str = "host") -> str:
        """The daemon pod (a new one each time), serving; its container's name."""
        self.daemons += 1
        work = self.podman.work
        config = work / f"sandboxd-{self.daemons}.toml"
        config.write_text(f'[listen]\nsocket = "{self.socket}"\n[state]\ndir = "{work}/state-{self.daemons}"\n'
                          f'[tenancy]\nmode = "{mode}"\ncgroup_root = "{self.root}"\n'
                          f'[quotas]\nsessions_per_uid = {sessions}\n')
        pod = f"sandboxd-{self.daemons}"
        self.podman("pod", "create", "--name", pod, "--network", "none")
        self.pods.append(pod)
        container = f"{pod}-sandboxd"
        # The DaemonSet's privileges: privileged, the host's PID namespace (hostPID); its cgroup
        # namespace as the runtime gives it (containerd on cgroup v2: one of its own, "private").
        self.podman.host_rootfs_run("-d", "--name", container, "--pod", pod, "--pid", "host", "--cgroupns", cgroupns,
                                    "--privileged", command=[SANDBOXD, "serve", "--config", str(config)])
        for _ in range(600):
            if os.path.exists(self.socket) and self.status_ok():
                return container
            time.sleep(0.1)
        raise AssertionError("the daemon pod did not serve: " + self.podman("logs", container, check=False).stderr[-2000:])

    def status_ok(self) -> bool:
        return subprocess.run([SANDBOXCTL, "--socket", self.socket, "status"],
                              capture_output=True, env=BASE_ENV, timeout=60).returncode == 0

    def stop_daemon(self, container: str) -> None:
        self.podman("pod", "rm", "-f", "-t", "10", container.removesuffix("-sandboxd"))
        self.pods.remove(container.removesuffix("-sandboxd"))
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket)

    def agent_pod(self, parent: str) -> "AgentPod":
        name = f"agent-{len(self.pods)}-{uuid.uuid4().hex[:6]}"
        self.podman("pod", "create", "--name", name, "--network", "none", "--cgroup-parent", f"{self.root}/{parent}")
        self.pods.append(name)
        return AgentPod(self, name)


class AgentPod:
    def __init__(self, node: Node, name: str) -> None:
        self.node, self.name = node, name

    def call(self, *calls: dict[str, Any]) -> list[dict[str, Any]]:
        """Each call made by a root agent in this pod (a container of its own, default privileges)."""
        done = self.node.podman.host_rootfs_run("--rm", "-i", "--pod", self.name, "--user", "0:0",
                                                command=[sys.executable, "-c", AGENT, "-", self.node.socket],
                                                input=json.dumps(list(calls)))
        answers: list[dict[str, Any]] = json.loads(done.stdout)
        return answers


@contextlib.contextmanager
def podman_node(pidns: str = "private") -> Iterator[Node]:
    if shutil.which("podman") is None or shutil.which("runc") is None:
        pytest.fail("podman and runc are needed (packaging/container/build-and-run installs them)")
    absent = [path for path in SHARED_STATE if not path.exists()]
    work = Path(tempfile.mkdtemp(prefix="sandboxd-pods.", dir="/var/tmp"))
    work.chmod(0o755)
    for sub in ("sock", "tmp"):
        (work / sub).mkdir()
    podman = Podman(work, pidns)
    node = Node(podman, f"/sbxt-pods-{uuid.uuid4().hex[:8]}")
    try:
        yield node
    finally:
        for pod in list(node.pods):
            podman("pod", "rm", "-f", "-t", "5", pod, check=False)
        podman("system", "reset", "-f", check=False)
        with open("/proc/self/mounts") as f:
            for mount in sorted((line.split()[1] for line in f if line.split()[1].startswith(str(work))), reverse=True):
                subprocess.run(["umount", "-l", mount], check=False)
        shutil.rmtree(work, ignore_errors=True)
        for path in absent:
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
        left = remove_cgroups(node.root.lstrip("/"))
        assert not left and not work.exists(), f"left behind: {left} {work if work.exists() else ''}"


def test_two_root_agent_pods_against_a_daemon_pod() -> None:
    figures: dict[str, float] = {}
    with podman_node() as node:
        started = time.monotonic()
        # The node's cgroup namespace, said outright. In one of its own (containerd on cgroup v2)
        # the daemon joins PID 1's on the front door's thread (tests/test_pod_cgroups.py shows the
        # join); not here: this machine's PID 1 refuses /proc/1/ns/* even to root.
        daemon = node.start_daemon("pod", sessions=2, cgroupns="host")
        figures["daemon pod serving (s)"] = time.monotonic() - started
        uid_a, uid_b = str(uuid.uuid4()), str(uuid.uuid4())
        a = node.agent_pod(f"kubepods/besteffort/pod{uid_a}")
        b = node.agent_pod(f"kubepods/pod{uid_b}")          # (podman's cgroupfs manager refuses systemd's .slice names)
        ws_a, ws_b = node.podman.work / "ws-a", node.podman.work / "ws-b"
        ws_a.mkdir(mode=0o755)
        ws_b.mkdir(mode=0o755)

        started = time.monotonic()
        made_a = a.call(create(ws_a), create(ws_a), create(ws_a), create(ws_a, FULL))
        figures["agent A: 4 calls in a fresh container (s)"] = time.monotonic() - started
        assert "ok" in made_a[0] and "ok" in made_a[1], made_a
        assert refused(made_a[2], "RESOURCE_EXHAUSTED", f"pod:{uid_a}", "quotas.sessions_per_uid"), made_a[2]
        assert refused(made_a[3], "PERMISSION_DENIED", "pod", "danger-full-access"), made_a[3]
        made_b = b.call(create(ws_b), create(ws_b), create(ws_b, FULL))
        assert "ok" in made_b[0] and "ok" in made_b[1], made_b                 # A's two did not spend B's quota
        assert refused(made_b[2], "PERMISSION_DENIED", "pod", "danger-full-access"), made_b[2]
        sessions_a = {made_a[0]["ok"]["id"], made_a[1]["ok"]["id"]}
        sessions_b = {made_b[0]["ok"]["id"], made_b[1]["ok"]["id"]}
        sb = made_b[0]["ok"]["id"]

        seen_a, run_a, *touches = a.call(listed(), {"rpc": "Run", "request": {
            "session_id": made_a[0]["ok"]["id"], "argv": ["id", "-u"]}}, *touch_attempts(sb))
        assert ids(seen_a) == sessions_a
        assert any(chunk.get("stdout") for chunk in run_a["ok"]), run_a                # its own session works
        assert all(refused(answer, "NOT_FOUND") for answer in touches), touches
        [seen_b] = b.call(listed())
        assert ids(seen_b) == sessions_b
        # The node's root (this test, on the host, in no pod) sees every session.
        listing = node_sessions(node)
        assert {listing[s] for s in sessions_a} == {f"uid=0 pod:{uid_a}"}, listing          # whose, as the admin reads it
        assert {listing[s] for s in sessions_b} == {f"uid=0 pod:{uid_b}"}, listing
        close_all(node, set(listing))
        node.stop_daemon(daemon)

        # Control: the same pods against the daemon under uid tenancy share root.
        daemon = node.start_daemon("uid", sessions=1)
        [made_b] = b.call(create(ws_b))
        seen, extra, full = a.call(listed(), create(ws_a), create(ws_a, FULL))
        assert made_b["ok"]["id"] in ids(seen)
        assert "ok" in extra and "ok" in full, (extra, full)
        close_all(node, set(node_sessions(node)))
        node.stop_daemon(daemon)
    print("\n" + "\n".join(f"figure {name}: {value:.2f}" for name, value in figures.items()))


def node_sessions(node: Node) -> dict[str, str]:
    """``sandboxctl session list`` of the node's root: session -> its owner column(s)."""
    done = subprocess.run([SANDBOXCTL, "--socket", node.socket, "session", "list"],
                          capture_output=True, text=True, env=BASE_ENV, timeout=60)
    assert done.returncode == 0, done.stderr
    listing = {}
    for line in done.stdout.splitlines():
        if line.strip():
            session, owner, _ = line.split("  ", 2)
            listing[session] = owner
    return listing


def close_all(node: Node, sessions: set[str]) -> None:
    for session in sessions:
        subprocess.run([SANDBOXCTL, "--socket", node.socket, "session", "close",
                        session], capture_output=True, env=BASE_ENV, timeout=60)
