"""A call surviving a replacement of the daemon's pod (deployment marker: podman, an image build;
about two to four minutes): the DaemonSet's pod template (packaging/kubernetes/daemonset.yaml, its
ConfigMap included, through packaging/container/pod-from-manifest) played with `podman kube play`
from the image packaging/container/Containerfile builds; a call running in a session; the pod
REPLACED by `podman kube play --replace` of the same manifest (podman 4.3 removes the old pod at
once, SIGKILL, no preStop: what a failed liveness probe or an eviction does, harsher than a
DaemonSet rollout's drain); then the call completes, `sandboxctl call result` gives its exit and
tail with reason adopted, the session keeps working (the same sandbox: a file in its /tmp is still
there) and `sandboxctl audit verify` says whole. Control: ``supervisor.survive_restart = false``,
the call dies with the pod.

What stands in for a kubelet here, and why:
- hostPID: podman 4.3's kube play ignores it (4.5 honours it); the test's containers.conf makes the
  host's PID namespace every container's default (``pidns = "host"``), which is what the
  manifest's ``hostPID: true`` asks for (the test checks the manifest says so);
- the ConfigMap's ``supervisor.cgroup`` is a group of this test's (``<test root>/supervisor``, removed
  afterwards in every hierarchy), not the shipped ``/sandboxd.supervisor``, so that runs on one
  machine do not share it.
The new container's interpreter is another file (a new overlay mount) with the same bytes: the
attach check compares them by content (supervisor.attach_point)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import BASE_ENV, REPO
from daemon_helpers import cgroup_mounts
from script_modules import load_script
from test_pod_tenancy_podman import SANDBOXCTL, Node, Podman, podman_node

pytestmark = [pytest.mark.deployment, pytest.mark.timeout(1200)]

CONTAINER = REPO / "packaging" / "container"
MANIFEST = REPO / "packaging" / "kubernetes" / "daemonset.yaml"
SHIPPED_GROUP = 'cgroup = "/sandboxd.supervisor"'
# Runs well past the replacement (about 2-5 s here), so that the new daemon follows it to its end.
CALL_SECONDS = 20


def build_image(podman: Podman) -> str:
    """The image of packaging/container/Containerfile on the cached Debian 12 root (as
    packaging/container/build-and-run builds it); its name."""
    work = podman.work
    found = subprocess.run(
        ["bash", "-c", f'. {CONTAINER}/private-podman; private_work={work}; '
                       'cached_debian_root bookworm "$(dpkg --print-architecture)" >&2 && echo "$root_tarball"'],
        capture_output=True, text=True, env=BASE_ENV, timeout=1800)
    assert found.returncode == 0, f"no Debian root: {found.stderr[-2000:]}"
    base, image = "localhost/sandboxd-replace-base:bookworm", "localhost/sandboxd-replace:test"
    with open(found.stdout.strip(), "rb") as tarball:
        imported = subprocess.run([*podman.base, "import", "-", base], stdin=tarball, capture_output=True,
                                  env=podman.env, timeout=600)
    assert imported.returncode == 0, imported.stderr[-2000:]
    done = subprocess.run([*podman.base, "build", "--pull=never", "--build-arg", f"BASE={base}",
                           "--secret", "id=ca-bundle,src=/etc/ssl/certs/ca-certificates.crt",
                           "-f", str(CONTAINER / "Containerfile"), "-t", image, str(REPO)],
                          capture_output=True, text=True, env=podman.env, timeout=1800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    return image


def pod_yaml(podman: Podman, name: str, image: str, group: str, survive: bool) -> Path:
    """The DaemonSet's pod and ConfigMap as pod-from-manifest makes them, the supervisor's group
    this test's (and, for the control, no surviving supervisor)."""
    module = load_script(str(CONTAINER / "pod-from-manifest"), "pod_from_manifest")
    documents = [doc for doc in yaml.safe_load_all(MANIFEST.read_text()) if doc]
    workload = module.workload(documents)
    assert workload["spec"]["template"]["spec"]["hostPID"] is True     # what pidns = "host" stands in for
    pod = module.pod_from_manifest(workload, name=name, image=image, host_root=str(podman.work / f"host-{name}"),
                                   workspaces=str(podman.work / "ws"))
    [config] = module.config_maps(documents, pod)
    text = config["data"]["sandboxd.toml"]
    assert SHIPPED_GROUP in text, text
    text = text.replace(SHIPPED_GROUP, f'cgroup = "{group}"')
    if not survive:
        text = text.replace("[supervisor]\n", "[supervisor]\nsurvive_restart = false\n")
    config["data"]["sandboxd.toml"] = text
    path = podman.work / f"{name}.yaml"
    path.write_text(yaml.safe_dump_all([config, pod], sort_keys=False))
    return path


class DaemonPod:
    def __init__(self, podman: Podman, name: str) -> None:
        self.podman, self.name, self.container = podman, name, f"{name}-sandboxd"
        self.socket = str(podman.work / f"host-{name}" / "run" / "sandboxd" / "sandboxd.sock")

    def play(self, path: Path, *, replace: bool = False) -> float:
        """``podman kube play [--replace]``, then until the daemon serves; the seconds it took."""
        started = time.monotonic()
        self.podman("kube", "play", *(["--replace"] if replace else []), str(path))
        while time.monotonic() < started + 180:
            if self.ctl("status", check=False, timeout=30).returncode == 0:
                return time.monotonic() - started
            restarts = self.podman("inspect", self.container, "--format", "{{.RestartCount}}", check=False).stdout
            if restarts.strip() not in ("", "0"):           # it failed to start (the pod restarts it)
                break
            time.sleep(0.2)
        raise AssertionError("the daemon pod did not serve: " + self.logs()[-3000:])

    def ctl(self, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        done = subprocess.run([SANDBOXCTL, "--socket", self.socket, *args], capture_output=True, text=True,
                              env=BASE_ENV, timeout=timeout)
        if check:
            assert done.returncode == 0, f"sandboxctl {' '.join(args)}: {done.stdout[-1000:]} {done.stderr[-2000:]}"
        return done

    def logs(self) -> str:
        done = self.podman("logs", self.container, check=False)
        return done.stdout + done.stderr

    def serving(self) -> dict[str, Any]:
        for line in self.logs().splitlines():
            if line.startswith("{") and json.loads(line).get("msg") == "serving":
                found: dict[str, Any] = json.loads(line)
                return found
        raise AssertionError("no serving line: " + self.logs()[-2000:])

    def remove(self, supervisor: int) -> None:
        """The pod removed, then its supervisor (holding no session by now) stopped by its pid, as
        an operator would after the last daemon: a SIGINT stop of the daemon would stop it too, but
        podman then restarts the container (restartPolicy Always), whose daemon starts another."""
        self.podman("pod", "rm", "-f", "-t", "5", self.name)
        if alive(supervisor):
            os.kill(supervisor, signal.SIGTERM)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def pids_with(marker: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        found.append(int(entry))
            except OSError:
                pass
    return found


def wait_for(what: str, condition: Any, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def node_and_image() -> Iterator[tuple[Node, str]]:
    """A private podman whose containers default to the host's PID namespace, and the image built in it."""
    with podman_node(pidns="host") as node:
        (node.podman.work / "ws").mkdir(mode=0o755)
        started = time.monotonic()
        image = build_image(node.podman)
        print(f"\nfigure image build (s): {time.monotonic() - started:.2f}")
        yield node, image


@pytest.mark.parametrize("survive", [True, False], ids=["surviving-supervisor", "control-no-survival"])
def test_a_call_outlives_a_kube_play_replacement_of_the_daemon_pod(node_and_image: tuple[Node, str],
                                                                    survive: bool) -> None:
    figures: dict[str, float] = {}
    node, image = node_and_image
    name = f"sandboxd-{uuid.uuid4().hex[:6]}"
    node.pods.append(name)
    try:
        replace_with_a_call_running(node, image, name, survive, figures)
    finally:
        if name in node.pods:                 # failed half-way: nothing of it may outlive the test
            node.podman("pod", "rm", "-f", "-t", "0", name, check=False)
            node.pods.remove(name)
        kill_group(node.root)
    print("\n".join(f"figure {key}: {value:.2f}" for key, value in figures.items()))


def kill_group(root: str) -> None:
    """SIGKILL every process left in this test's cgroups (a surviving supervisor a failed run left,
    its sandboxes), by pid: nothing else is in them."""
    for mount in cgroup_mounts():
        top = mount / root.lstrip("/")
        for procs in top.rglob("cgroup.procs") if top.exists() else []:
            for pid in procs.read_text().split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)


def replace_with_a_call_running(node: Node, image: str, name: str, survive: bool, figures: dict[str, float]) -> None:
    podman = node.podman
    path = pod_yaml(podman, name, image, f"{node.root}/supervisor", survive)
    daemon = DaemonPod(podman, name)
    figures["kube play to serving (s)"] = daemon.play(path)
    first = daemon.serving()
    assert first["supervisor"] == ("started" if survive else "dies with the daemon"), first
    supervisor = first["fork_server_pid"]
    with open(f"/proc/{supervisor}/cgroup") as own:
        placement = own.read()
    if survive:                       # in the test's group in every hierarchy, none of the pod's
        assert all(line.split(":", 2)[2] == f"{node.root}/supervisor" for line in placement.splitlines()), placement
    workspace = podman.work / "ws" / name
    workspace.mkdir(mode=0o755)
    session = daemon.ctl("session", "create", "--approval", "never", str(workspace)).stdout.split()[0]
    assert daemon.ctl("exec", session, "--", "sh", "-c", "echo kept > /tmp/before").returncode == 0
    marker = f"replace-{uuid.uuid4().hex[:8]}"
    call = subprocess.Popen([SANDBOXCTL, "--socket", daemon.socket, "exec", session, "--", "sh", "-c",
                             f"echo up; sleep {CALL_SECONDS}; echo done; : {marker}; exit 7"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=BASE_ENV)
    try:
        assert call.stdout is not None and call.stdout.readline() == "up\n"
        started = time.monotonic()
        figures["kube play --replace to serving (s)"] = daemon.play(path, replace=True)
        _, stderr = call.communicate(timeout=60)
    finally:
        if call.poll() is None:
            call.kill()
            call.wait()
    assert call.returncode != 0, "the client's stream should have broken with the old pod"
    found = re.search(r"sandboxctl call result \S+ (\S+)`", stderr)
    assert found, stderr
    call_id = found.group(1)
    second = daemon.serving()
    if not survive:
        wait_for("the call to die with the pod", lambda: not pids_with(marker), 30)
        assert not alive(supervisor)
        assert second["supervisor"] == "dies with the daemon", second
        result = daemon.ctl("call", "result", session, call_id, check=False)
        assert result.returncode != 7 and "done" not in result.stdout, (result.stdout, result.stderr)
        figures["control: call result exit"] = result.returncode
        print(f"\ncontrol: sandboxctl call result: exit {result.returncode}, {result.stderr.strip()}")
    else:
        assert alive(supervisor) and pids_with(marker), "the supervisor or the call died with the old pod"
        assert second["supervisor"] == "attached" and second["fork_server_pid"] == supervisor, second
        assert second["adopted_sessions"] == 1 and second["adopted_calls"] == 1, second
        result = daemon.ctl("call", "result", "--wait", "60", session, call_id, check=False)
        figures["replacement to the call's result (s)"] = time.monotonic() - started
        # The tail is what no client saw: "up" reached the first client before the old pod went.
        assert result.returncode == 7 and result.stdout == "done\n", (result.returncode, result.stdout)
        assert "adopted" in result.stderr, result.stderr
        ends = daemon.ctl("events", "--session", session, "--type", "ToolInvocationCompleted", "--json").stdout
        mine = [json.loads(line) for line in ends.splitlines() if call_id in line]
        assert len(mine) == 1, ends                  # its end is in the audit log, once
        kept = daemon.ctl("exec", session, "--", "sh", "-c", "cat /tmp/before; echo after")
        assert kept.stdout == "kept\nafter\n", kept.stdout
    verify = daemon.ctl("audit", "verify")
    assert verify.stdout.startswith("whole"), verify.stdout
    print(f"\naudit verify: {verify.stdout.strip()}")
    daemon.ctl("session", "close", session)
    daemon.remove(supervisor)
    node.pods.remove(name)
    wait_for("the supervisor to stop", lambda: not alive(supervisor), 30)
