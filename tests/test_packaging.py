"""Packaging that cannot run here (a container image, Kubernetes manifests, a GitHub action) is
checked statically; the CI-runner recipe runs for real."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from conftest import BASE_ENV, PY, REPO, SANDBOXD
from test_isolated_network import INTERNET, World, world  # noqa: F401 (the fixture)

pytestmark = pytest.mark.timeout(120)
PACKAGING = REPO / "packaging"


def test_the_image_runs_what_the_readme_runs() -> None:
    recipe = (PACKAGING / "container" / "Containerfile").read_text()
    lines = [line for line in recipe.splitlines() if line and not line.startswith("#")]
    # A Debian base, by default from a registry; BASE names a local one (packaging/container/build-and-run).
    assert lines[0].startswith("ARG BASE=debian:") and lines[1] == "FROM ${BASE}"
    run = recipe.split("\nRUN ", 1)[1].split("\n\n")[0]                         # the RUN instruction
    assert "/opt/sandboxd/packaging/setup.sh install" in run                  # the README's own set-up
    entry = json.loads(next(line for line in lines if line.startswith("ENTRYPOINT")).split(None, 1)[1])
    assert entry == ["/opt/sandboxd/.venv/bin/sandboxd", "serve"]
    setup = (PACKAGING / "setup.sh").read_text()
    assert 'exec "$venv/bin/sandboxd" serve "$@"' in setup                     # what `setup.sh serve` runs
    assert 'venv="$repo/.venv"' in setup and "--privileged" in recipe


def setup_install(bin_dir: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(PACKAGING / "setup.sh"), "install"], capture_output=True, text=True, timeout=600,
                          env={**BASE_ENV, "SANDBOXD_BIN_DIR": str(bin_dir)})


def test_setup_install_mode_installs_and_runs_nothing(base_dir: Path) -> None:
    result = setup_install(base_dir / "bin")
    assert result.returncode == 0, result.stderr
    assert "installed; the daemon:" in result.stderr


def test_setup_puts_the_commands_on_path_and_never_clobbers(base_dir: Path) -> None:
    """The README's commands run by name after set-up (symlinks to the venv's, in /usr/local/bin by
    default; a directory of the test's here); a second run changes nothing; a file of the same name
    that is not this checkout's link stays, and set-up says so."""
    bin_dir = base_dir / "bin"
    first = setup_install(bin_dir)
    assert first.returncode == 0, first.stderr
    for name in ("sandboxd", "sandboxctl"):
        assert os.readlink(bin_dir / name) == str(REPO / ".venv" / "bin" / name)
        assert f"{name} is on PATH" in first.stderr
    found = subprocess.run(["sandboxd", "version"], capture_output=True, text=True, timeout=60,
                           env={**BASE_ENV, "PATH": f"{bin_dir}:{BASE_ENV['PATH']}"})
    assert found.returncode == 0 and found.stdout.startswith("sandboxd "), found.stderr
    again = setup_install(bin_dir)
    assert again.returncode == 0 and "on PATH" not in again.stderr and "left as it is" not in again.stderr
    (bin_dir / "sandboxctl").unlink()
    (bin_dir / "sandboxctl").write_text("#!/bin/sh\necho someone else's\n")
    os.symlink("/nonexistent/.venv/bin/sandboxd", bin_dir / "stale")
    os.replace(bin_dir / "stale", bin_dir / "sandboxd")
    third = setup_install(bin_dir)
    assert third.returncode == 0, third.stderr
    assert f"{bin_dir}/sandboxctl exists and is not a link to" in third.stderr and "left as it is" in third.stderr
    assert (bin_dir / "sandboxctl").read_text() == "#!/bin/sh\necho someone else's\n"
    assert "which is gone" in third.stderr                                    # a dangling link is replaced
    assert os.readlink(bin_dir / "sandboxd") == str(REPO / ".venv" / "bin" / "sandboxd")


def load_yaml(path: Path) -> list[dict]:  # type: ignore[type-arg]
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def test_the_daemonset() -> None:
    (ds,) = load_yaml(PACKAGING / "kubernetes" / "daemonset.yaml")
    assert (ds["apiVersion"], ds["kind"]) == ("apps/v1", "DaemonSet")
    pod = ds["spec"]["template"]
    assert ds["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert pod["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    (container,) = pod["spec"]["containers"]
    assert container["securityContext"]["privileged"] is True and container["resources"]["requests"]
    assert "--metrics" in container["args"]
    port = container["args"][container["args"].index("--metrics") + 1].rsplit(":", 1)[1]
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == port
    probe = container["livenessProbe"]["exec"]["command"]
    assert probe[0].endswith("sandboxctl") and probe[-1] == "status"
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert mounts["socket"] == "/run/sandboxd" and volumes["socket"]["hostPath"]["path"] == "/run/sandboxd"
    # The arguments are ones the daemon accepts.
    from sandboxd.cli.serve import parser
    parser().parse_args(container["args"])


def test_the_agent_sandbox_template() -> None:
    (template,) = load_yaml(PACKAGING / "kubernetes" / "agent-sandbox-template.yaml")
    assert (template["apiVersion"], template["kind"]) == ("extensions.agents.x-k8s.io/v1alpha1", "SandboxTemplate")
    containers = {c["name"]: c for c in template["spec"]["podTemplate"]["spec"]["containers"]}
    sidecar, agent = containers["sandboxd"], containers["agent"]
    socket_dir = {m["mountPath"] for m in sidecar["volumeMounts"]} & {m["mountPath"] for m in agent["volumeMounts"]}
    assert "/run/sandboxd" in socket_dir and "/workspace" in socket_dir       # the agent reaches the socket
    assert {"name": "SANDBOXD_SOCKET", "value": "/run/sandboxd/sandboxd.sock"} in agent["env"]
    from sandboxd.cli.serve import parser
    parser().parse_args(sidecar["args"])


def test_the_github_action_runs_the_recipe() -> None:
    (action,) = load_yaml(PACKAGING / "github-action" / "action.yml")
    assert action["runs"]["using"] == "composite" and set(action["inputs"]) == {"run", "build-dir", "allow-domains"}
    scripts = " ".join(step["run"] for step in action["runs"]["steps"])
    assert "setup.sh\" install" in scripts and "ci/sandboxed-step" in scripts


@pytest.fixture
def checkout(base_dir: Path) -> Path:
    path = base_dir / "checkout"
    (path / "src").mkdir(parents=True)
    (path / "src" / "main.txt").write_text("source\n")
    return path


def step(checkout: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(PACKAGING / "ci" / "sandboxed-step"), *args], cwd=checkout, capture_output=True,
                          text=True, timeout=120, env={**BASE_ENV, "SANDBOXD": SANDBOXD})


def test_a_ci_step_writes_only_its_build_directory(checkout: Path) -> None:
    result = step(checkout, "--", "/bin/sh", "-c",
                  "cp src/main.txt build/out.txt && echo built; echo x > src/main.txt; echo src=$?; "
                  "echo x > /tmp/scratch && echo tmp-ok")
    assert result.returncode == 0, result.stderr
    assert "built" in result.stdout and "tmp-ok" in result.stdout
    assert "src=" in result.stdout and "src=0" not in result.stdout                  # the write to src/ failed
    assert (checkout / "build" / "out.txt").read_text() == "source\n"
    assert (checkout / "src" / "main.txt").read_text() == "source\n"               # the checkout stayed as it was


# A way out is an answer from the far end, not a connect: with --allow-domain the sandbox's ports 80
# and 443 are captured by its egress proxy (network.transparent), which accepts any connection and
# then judges the name it carries (an address is none: refused).
REACH_PROBE = textwrap.dedent('''
    import os, socket, sys
    try:
        with socket.create_connection((sys.argv[1], 80), timeout=5) as s:
            s.sendall(b"GET / HTTP/1.1\\r\\nHost: " + sys.argv[1].encode() + b"\\r\\nConnection: close\\r\\n\\r\\n")
            reply = b""
            try:
                while chunk := s.recv(4096):
                    reply += chunk
            except OSError:
                pass
        print("answered" if b"far end" in reply else "no answer: %r" % reply[:40])
    except OSError as e:
        print(type(e).__name__)
    print("proxy=" + os.environ.get("HTTPS_PROXY", ""))
''')


@pytest.fixture(scope="module")
def far_end(world: World) -> Iterator[list[str]]:
    """An HTTP server on port 80 of the test world's internet address: each connection it accepted
    (its peer), answered with ``far end``."""
    from tls_world import inside

    with inside(world.gw):
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((INTERNET, 80))
    listener.listen(8)
    peers: list[str] = []

    def serve() -> None:
        while True:
            try:
                conn, peer = listener.accept()
            except OSError:
                return
            peers.append(peer[0])
            with conn:
                conn.settimeout(10)
                try:
                    conn.recv(4096)
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 7\r\nConnection: close\r\n\r\nfar end")
                except OSError:
                    pass
    threading.Thread(target=serve, daemon=True).start()
    yield peers
    listener.close()


@pytest.mark.timeout(400)                 # the world's lock may wait for another test run's
def test_a_ci_step_has_no_network_unless_registries_are_named(checkout: Path, far_end: list[str]) -> None:
    # Control: a sandbox whose network is not walled in reaches the far end, and the probe says so.
    open_network = subprocess.run([SANDBOXD, "run", "--workspace", str(checkout), "--network", "--", PY, "-c",
                                   REACH_PROBE, INTERNET], capture_output=True, text=True, timeout=120, env=BASE_ENV)
    assert open_network.stdout.startswith("answered\n"), (open_network.stdout, open_network.stderr)
    assert len(far_end) == 1
    offline = step(checkout, "--", PY, "-c", REACH_PROBE, INTERNET)
    assert offline.returncode == 0 and "answered" not in offline.stdout and "proxy=\n" in offline.stdout + "\n"
    registry = step(checkout, "--allow-domain", "pypi.org", "--", PY, "-c", REACH_PROBE, INTERNET)
    assert registry.returncode == 0, registry.stderr
    # Only the proxy is a way out, on the sandbox's own loopback (egress_proxy.PROXY_ADDRESS); the
    # connection to port 80 it captured carried no allowed name, so nothing went further.
    assert "answered" not in registry.stdout and "proxy=http://127.0.0.1:3128\n" in registry.stdout
    assert len(far_end) == 1, far_end                   # nothing of the steps' reached it


def test_a_ci_step_gets_only_the_variables_it_names(checkout: Path) -> None:
    show = ["--", PY, "-c", "import os; print(os.environ.get('CI'), os.environ.get('GITHUB_TOKEN'))"]
    env = {**BASE_ENV, "SANDBOXD": SANDBOXD, "CI": "true", "GITHUB_TOKEN": "ghs-secret"}
    plain = subprocess.run([str(PACKAGING / "ci" / "sandboxed-step"), *show], cwd=checkout, capture_output=True,
                           text=True, timeout=120, env=env)
    named = subprocess.run([str(PACKAGING / "ci" / "sandboxed-step"), "--pass-env", "CI", *show], cwd=checkout,
                           capture_output=True, text=True, timeout=120, env=env)
    assert (plain.returncode, plain.stdout) == (0, "None None\n"), plain.stderr
    assert (named.returncode, named.stdout) == (0, "true None\n"), named.stderr


def test_a_bad_recipe_call_says_what_to_fix(checkout: Path) -> None:
    result = step(checkout, "--sideways")
    assert result.returncode == 125 and "unknown option --sideways" in result.stderr
    assert os.path.isdir(checkout)
