"""The deployment as it runs: every Kubernetes manifest against the API's schemas (kubernetes-validate,
always), and, only with `-m deployment` (minutes each): the image built and the DaemonSet's pod played
with podman (packaging/container/build-and-run), the image built for arm64 under emulation, and the
Debian package installed, run, upgraded and purged in debootstrapped Debian 12 and 13 roots
(packaging/debian/install-in-roots)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from types import ModuleType
from typing import Any

import kubernetes_validate
import pytest
import yaml

from conftest import BASE_ENV, REPO
from script_modules import load_script

KUBERNETES = REPO / "packaging" / "kubernetes"
CONTAINER = REPO / "packaging" / "container"
VERSION = kubernetes_validate.latest_version()


def load_all(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def load(path: Path) -> dict[str, Any]:
    """The manifest's workload: its DaemonSet or SandboxTemplate."""
    return pod_from_manifest().workload(load_all(path))  # type: ignore[no-any-return]


def pod_from_manifest() -> ModuleType:
    """packaging/container/pod-from-manifest (a script without a .py suffix), as a module."""
    return load_script(str(CONTAINER / "pod-from-manifest"), "pod_from_manifest")


def invalid(doc: dict[str, Any]) -> str:
    """What the schemas of Kubernetes VERSION say against ``doc`` (strict: unknown fields are errors)."""
    try:
        kubernetes_validate.validate(doc, VERSION, strict=True)
    except kubernetes_validate.ValidationError as error:
        return f"{'.'.join(str(p) for p in error.path)}: {error.message}"
    return ""


def test_every_manifest_passes_the_api_schemas() -> None:
    """Every document of every manifest, strictly; except the Prometheus Operator's PodMonitor, a CRD
    kubernetes-validate has no schema for (test_packaging checks its fields against the DaemonSet's)."""
    kinds = []
    for path in sorted(KUBERNETES.glob("*.yaml")):
        for doc in load_all(path):
            kinds.append(doc["kind"])
            if doc["kind"] in ("PodMonitor", "SandboxTemplate"):
                with pytest.raises(kubernetes_validate.SchemaNotFoundError):
                    kubernetes_validate.validate(doc, VERSION, strict=True)
            else:
                assert invalid(doc) == "", (path.name, doc["kind"])
    assert sorted(kinds) == ["ConfigMap", "DaemonSet", "Namespace", "NetworkPolicy", "PodMonitor", "SandboxTemplate"]


def test_the_daemonset_and_the_pod_played_from_it_pass_the_api_schemas() -> None:
    daemonset = load(KUBERNETES / "daemonset.yaml")
    assert invalid(daemonset) == ""
    pod = pod_from_manifest().pod_from_manifest(daemonset, name="sandboxd-test", image="localhost/sandboxd:test",
                                                host_root="/tmp/host", workspaces="/var/tmp")
    assert invalid(pod) == ""
    spec = pod["spec"]
    assert spec["hostPID"] is True and spec["containers"][0]["securityContext"]["privileged"] is True
    assert spec["containers"][0]["livenessProbe"] == daemonset["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]
    # The workspaces volume is at the same path on both sides; the other hostPaths moved under host_root.
    volumes = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
    mounts = {m["name"]: m["mountPath"] for m in spec["containers"][0]["volumeMounts"]}
    assert volumes["workspaces"] == mounts["workspaces"] == "/var/tmp"
    assert volumes["socket"] == "/tmp/host/run/sandboxd" and mounts["socket"] == "/run/sandboxd"
    # The ConfigMap the pod mounts goes with it (podman kube play reads it from the same file).
    config_maps = pod_from_manifest().config_maps(load_all(KUBERNETES / "daemonset.yaml"), pod)
    assert [c["metadata"]["name"] for c in config_maps] == [v["configMap"]["name"] for v in spec["volumes"] if "configMap" in v]


def test_the_agent_sandbox_template_passes_the_api_schemas() -> None:
    """kubernetes-validate has no schema for agent-sandbox's CRD (SandboxTemplate): its podTemplate,
    a core/v1 PodTemplateSpec in the CRD, is checked as one (inside a v1 PodTemplate), and its
    metadata holds only what the CRD's podTemplate.metadata allows (labels, annotations)."""
    template = load(KUBERNETES / "agent-sandbox-template.yaml")
    assert (template["apiVersion"], template["kind"]) == ("extensions.agents.x-k8s.io/v1alpha1", "SandboxTemplate")
    assert set(template["spec"]) <= {"podTemplate", "networkPolicy", "networkPolicyManagement"}
    pod_template = template["spec"]["podTemplate"]
    assert set(pod_template["metadata"]) <= {"labels", "annotations"}
    assert invalid({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "sandboxd-agent"},
                    "template": pod_template}) == ""
    assert pod_template["spec"]["shareProcessNamespace"] is True       # the sidecar sees its callers
    pod = pod_from_manifest().pod_from_manifest(template, name="agent-test", image="localhost/sandboxd:test",
                                                idle=("agent",), host_root="/tmp/host")
    assert invalid(pod) == ""
    # podman 4.3 has no native sidecars: the sidecar runs as the pod's first container, and the
    # audit mount's subPathExpr is expanded into its hostPath, as a kubelet would.
    assert "initContainers" not in pod["spec"]
    assert [(c["name"], c.get("command"), c.get("restartPolicy")) for c in pod["spec"]["containers"]] == [
        ("sandboxd", None, None), ("agent", ["sleep", "infinity"], None)]
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["audit"]["hostPath"]["path"] == "/tmp/host/var/lib/sandboxd-agents/default_agent-test_podman"
    assert not [m for c in pod["spec"]["containers"] for m in c["volumeMounts"] if "subPathExpr" in m]
    env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
    assert (env["POD_NAMESPACE"], env["POD_NAME"]) == ({"name": "POD_NAMESPACE", "value": "default"},
                                                       {"name": "POD_NAME", "value": "agent-test"})


def test_the_validation_can_fail() -> None:
    """Control: a field of the wrong type and a field the API does not have are both found."""
    daemonset = load(KUBERNETES / "daemonset.yaml")
    daemonset["spec"]["template"]["spec"]["hostPID"] = "yes"
    assert "hostPID" in invalid(daemonset)
    daemonset = load(KUBERNETES / "daemonset.yaml")
    daemonset["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}
    assert invalid(daemonset) != ""


# ---- the deployment, run ------------------------------------------------------------------------

CHECKS = ["image-arch", "no-compiler", "image-commands", "image-otlp", "pod-running", "privileged", "host-pid", "host-paths", "liveness-probe", "status-from-host",
          "session-from-host", "workspace-write", "write-outside-fails", "no-capabilities", "network-isolated",
          "pid-namespace", "conformance", "agent-sidecar"]
PHASES = ["tools", "rootfs", "import", "build", "image", "play", "checks", "conformance", "agent-template", "cleanup"]


@pytest.mark.deployment
@pytest.mark.timeout(1800)
def test_the_image_builds_and_the_daemonset_pod_runs_and_holds() -> None:
    """packaging/container/build-and-run end to end: each phase and each check it prints holds, and
    it leaves no podman state behind (its work directory is gone)."""
    # What podman makes outside its store on first use: gone again afterwards if it was not there before.
    shared = [Path(p) for p in ("/dev/shm/libpod_lock", "/run/libpod", "/run/containers", "/var/lib/containers",
                                "/etc/cni/net.d/cni.lock", "/var/lib/cni")]
    absent = [path for path in shared if not path.exists()]
    done = subprocess.run([str(CONTAINER / "build-and-run")], capture_output=True, text=True, timeout=1750,
                          env={**BASE_ENV, "HOME": "/root"})
    print("\n".join(line for line in done.stdout.splitlines()
                    if line.startswith(("phase ", "check ", "conformance: FAIL", "conformance: held"))))
    phases = dict(re.findall(r"^phase (\S+) \d+ (\S+)", done.stdout, re.MULTILINE))
    checks = dict(re.findall(r"^check (\S+) (\S+)", done.stdout, re.MULTILINE))
    assert phases == dict.fromkeys(PHASES, "ok"), done.stdout[-4000:] + done.stderr[-4000:]
    assert checks == dict.fromkeys(CHECKS, "ok"), done.stdout[-4000:] + done.stderr[-4000:]
    assert done.returncode == 0
    conformance = next(line for line in done.stdout.splitlines() if line.startswith("check conformance"))
    assert re.search(r"held (\d+)/80", conformance)
    work = re.search(r"(/var/tmp/sandboxd-deploy\.\w+)", done.stdout)
    assert work and not Path(work.group(1)).exists()
    assert [path for path in absent if path.exists()] == []


# In a pod without a cgroup namespace the runtime bind-mounts the container's own group over the
# hierarchy's mount point; /proc/self/cgroup still names the group from the hierarchy's root.
CONTAINER_LAYOUT = r"""
import os, subprocess, sys
from sandboxd.kernel import cgroups
point, own = sys.argv[1], sys.argv[2]
group = os.path.join(point, own.lstrip("/"), sys.argv[3])
with open(os.path.join(group, "cgroup.procs"), "w") as f:
    f.write(str(os.getpid()))
subprocess.run(["mount", "--make-rprivate", "/"], check=True)
subprocess.run(["mount", "--bind", group, point], check=True)
h = cgroups.detect()
found = h.v1.get("memory", (None, None))[1] if h.v1 else h.unified_own
print(found, os.path.isdir(os.path.join(point, found.lstrip("/"))))
"""


def test_the_daemon_finds_its_group_where_a_container_runtime_mounts_it(tmp_path: Path) -> None:
    """Found by running the pod: cgroups.detect() gives our group relative to the mount (mountinfo's
    root), so <mount>/<own> is the container's group itself, not a path that does not exist."""
    from sandboxd.kernel import cgroups

    h = cgroups.detect()
    point, own = h.v1["memory"] if "memory" in h.v1 else (h.unified, h.unified_own)
    assert point is not None
    name = f"sandboxd-layout-{tmp_path.name}"[:60]
    group = Path(point) / own.lstrip("/") / name
    group.mkdir()
    try:
        done = subprocess.run(["unshare", "--mount", "--", str(REPO / ".venv" / "bin" / "python"), "-c",
                               CONTAINER_LAYOUT, point, own, name],
                              capture_output=True, text=True, timeout=60, env=BASE_ENV, cwd=REPO)
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == ["/", "True"]           # the mount itself is our group
    finally:
        group.rmdir()


# ---- the Debian package on the releases it supports -------------------------------------------------

RELEASE_CHECKS = ["install", "version", "otlp", "doctor", "daemon", "status", "session", "upgrade", "served-through-upgrade",
                  "restart", "prune", "rtupdate", "purge"]


@pytest.mark.deployment
@pytest.mark.timeout(3600)
def test_the_package_installs_runs_upgrades_and_purges_on_debian_12_and_13() -> None:
    """packaging/debian/install-in-roots: lintian finds no error; in a debootstrapped Debian 12
    (Python 3.11) and 13 (Python 3.13) root each, run with podman, every check holds (install with
    apt-get, doctor, a session, an upgrade while the daemon serves, the restart onto the new venv,
    the old venv pruned, the rtupdate hook, a purge that leaves nothing); the wheelhouse alone
    resolves for Ubuntu 24.04's Python 3.12; and no work directory is left."""
    shared = [Path(p) for p in ("/dev/shm/libpod_lock", "/run/libpod", "/run/containers", "/var/lib/containers",
                                "/etc/cni/net.d/cni.lock", "/var/lib/cni")]
    absent = [path for path in shared if not path.exists()]
    done = subprocess.run([str(REPO / "packaging" / "debian" / "install-in-roots")], capture_output=True, text=True,
                          timeout=3500, env={**BASE_ENV, "HOME": "/root"})
    print("\n".join(line for line in done.stdout.splitlines() if line.startswith(("phase ", "check "))))
    phases = dict(re.findall(r"^phase (\S+) \d+ (\S+)", done.stdout, re.MULTILINE))
    checks = dict(re.findall(r"^check (\S+) (\S+)", done.stdout, re.MULTILINE))
    assert phases == dict.fromkeys(["tools", "build", "lintian", "bookworm-root", "bookworm", "trixie-root", "trixie",
                                    "other-pythons", "cleanup"], "ok"), done.stdout[-4000:] + done.stderr[-4000:]
    wanted = {f"{suite}-{name}" for suite in ("bookworm", "trixie") for name in RELEASE_CHECKS}
    wanted |= {"lintian-errors", "ubuntu-24.04-python3.12-wheels"}
    assert checks == dict.fromkeys(wanted, "ok"), done.stdout[-4000:] + done.stderr[-4000:]
    assert re.search(r"check bookworm-install ok .*Python 3\.11", done.stdout)
    assert re.search(r"check trixie-install ok .*Python 3\.13", done.stdout)
    assert done.returncode == 0
    work = re.search(r"(/var/tmp/sandboxd-debroots\.\w+)", done.stdout)
    assert work and not Path(work.group(1)).exists()
    assert [path for path in absent if path.exists()] == []


@pytest.mark.deployment
@pytest.mark.timeout(5400)
def test_the_image_builds_for_arm64() -> None:
    """packaging/container/build-and-run --arch arm64: the multi-stage image builds from an arm64
    Debian root (under qemu-user on an amd64 machine), is arm64, has no compiler, and its commands run."""
    if not Path("/proc/sys/fs/binfmt_misc").exists() and "binfmt_misc" not in Path("/proc/filesystems").read_text():
        pytest.skip("the kernel has no binfmt_misc: no way to run arm64 programs here")
    done = subprocess.run([str(CONTAINER / "build-and-run"), "--arch", "arm64"], capture_output=True, text=True,
                          timeout=5300, env={**BASE_ENV, "HOME": "/root"})
    print("\n".join(line for line in done.stdout.splitlines() if line.startswith(("phase ", "check "))))
    phases = dict(re.findall(r"^phase (\S+) \d+ (\S+)", done.stdout, re.MULTILINE))
    checks = dict(re.findall(r"^check (\S+) (\S+)", done.stdout, re.MULTILINE))
    assert phases == dict.fromkeys(["tools", "rootfs", "import", "build", "image", "cleanup"], "ok"), \
        done.stdout[-4000:] + done.stderr[-4000:]
    assert checks == dict.fromkeys(["image-arch", "no-compiler", "image-commands", "image-otlp"], "ok")
    assert "linux/arm64, aarch64" in done.stdout and done.returncode == 0
