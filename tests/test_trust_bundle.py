"""The CA bundle inside a sandbox (rootfs step 8e), on the real kernel: with LaunchSpec.trust_pem the
system bundle a client reads by default holds the host's certificates and the extra one, cannot be
written, and curl and `openssl verify` with no option of ours trust a server that CA signed; without
it (the control) the certificate is absent and the same server is refused. The order of the step is
tests/test_setup_order.py's; the path through `sandboxd run` (root and rootless), with the proxy's
session CA, is tests/test_run_credentials.py's."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import BASE_ENV
from interception_helpers import API, UpstreamCA
from sandboxd.errors import InvalidPolicy
from sandboxd.launcher import plan as launch_plan
from sandboxd.launcher import trust_bundle
from sandboxd.policy import LaunchSpec, WorkspaceWrite

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="builds sandboxes as root")

# Run inside the sandbox: a TLS server on the sandbox's own loopback with the test CA's leaf, then
# what a client sees of the system bundle. Prints one JSON line.
INSIDE = r"""
import errno, json, os, socket, ssl, subprocess, sys, threading
bundle, port = sys.argv[1], 8443
context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
context.load_cert_chain("chain.pem")
listener = socket.create_server(("127.0.0.1", port))
def serve():
    while True:
        raw, _ = listener.accept()
        try:
            with context.wrap_socket(raw, server_side=True) as conn:
                conn.recv(65536)
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nConnection: close\r\n\r\nhello")
        except (OSError, ssl.SSLError):
            pass
threading.Thread(target=serve, daemon=True).start()
result = {"tail": open(bundle).read()[-4096:]}
try:
    with open(bundle, "a") as f:
        f.write("x")
    result["write"] = "written"
except OSError as exc:
    result["write"] = errno.errorcode[exc.errno]
try:
    os.chmod(bundle, 0o666)
    result["chmod"] = "changed"
except OSError as exc:
    result["chmod"] = errno.errorcode[exc.errno]
env = {"PATH": os.environ["PATH"]}                  # no SSL_CERT_FILE, CURL_CA_BUNDLE: the system's own
curl = subprocess.run(["curl", "-sS", "--resolve", f"{sys.argv[2]}:{port}:127.0.0.1", f"https://{sys.argv[2]}:{port}/"],
                      capture_output=True, text=True, env=env)
result["curl"] = [curl.returncode, curl.stdout]
verify = subprocess.run(["openssl", "verify", "leaf.pem"], capture_output=True, text=True, env=env)
result["verify"] = verify.returncode
print(json.dumps(result))
"""


@pytest.fixture(scope="module")
def ca() -> UpstreamCA:
    return UpstreamCA()


def run_inside(workspace: Path, ca: UpstreamCA, trust_pem: str) -> dict[str, object]:
    (workspace / "chain.pem").write_bytes(ca.leaf_pem + ca.leaf_key_pem)
    (workspace / "leaf.pem").write_bytes(ca.leaf_pem)
    (workspace / "inside.py").write_text(INSIDE)
    bundle = trust_bundle.host_bundle_path()
    assert bundle is not None, "the host has no CA bundle: packaging/setup.sh installs ca-certificates"
    out = workspace.parent / f"out-{len(trust_pem)}"
    # The Spawner forks: in a process of its own, not pytest's, where an earlier module's gRPC
    # threads (a client's request-stream consumer) would make gRPC's fork handling abort the run.
    launched = subprocess.run(
        [sys.executable, "-c", LAUNCH, json.dumps({"argv": ["python3", "inside.py", bundle, API], "workspace": str(workspace),
                                                  "env": dict(BASE_ENV), "trust_pem": trust_pem, "out": str(out)})],
        capture_output=True, text=True, timeout=180, cwd=str(REPO))
    assert launched.returncode == 0, (launched.stdout, launched.stderr, out.read_text() if out.exists() else "")
    return json.loads(out.read_text())


REPO = Path(__file__).resolve().parents[1]
# One launch through the Spawner (what the tests above check), printed status: 0 if the command did.
LAUNCH = r"""
import json, os, sys
from sandboxd.policy import LaunchSpec, WorkspaceWrite
from sandboxd.supervisor.spawner import Spawner
args = json.loads(sys.argv[1])
spec = LaunchSpec(argv=tuple(args["argv"]), workspace=args["workspace"], env=args["env"], policy=WorkspaceWrite(),
                  trust_pem=args["trust_pem"])
with open(os.devnull, "rb") as stdin, open(args["out"], "wb") as stdout:
    status = Spawner().launch(spec, (stdin.fileno(), stdout.fileno(), 2)).wait(120)
print(status)
sys.exit(0 if status.shell_status == 0 else 1)
"""


def test_the_system_bundle_trusts_the_extra_certificate_and_cannot_be_written(tmp_path: Path, ca: UpstreamCA) -> None:
    workspace = tmp_path / "ws"
    workspace.mkdir()
    seen = run_inside(workspace, ca, ca.pem)
    assert str(seen["tail"]).endswith(ca.pem)
    assert seen["write"] in ("EROFS", "EACCES") and seen["chmod"] in ("EROFS", "EPERM"), seen
    assert seen["curl"] == [0, "hello"], seen
    assert seen["verify"] == 0, seen


def test_without_trust_pem_the_certificate_is_absent_and_the_server_refused(tmp_path: Path,
                                                                            ca: UpstreamCA) -> None:
    workspace = tmp_path / "ws"
    workspace.mkdir()
    seen = run_inside(workspace, ca, "")
    assert ca.pem not in str(seen["tail"])
    assert seen["curl"][0] == 60, seen                   # curl: "SSL certificate problem"
    assert seen["verify"] != 0, seen


def test_a_host_without_a_bundle_is_refused_before_the_build(tmp_path: Path, ca: UpstreamCA,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trust_bundle, "host_bundle_path", lambda: None)
    spec = LaunchSpec(argv=("true",), workspace=str(tmp_path), policy=WorkspaceWrite(), trust_pem=ca.pem)
    with pytest.raises(InvalidPolicy, match="no CA bundle .*install the system's CA certificates"):
        launch_plan.prepare(spec)


def test_a_bundle_that_cannot_be_written_names_the_step_errno_and_path(tmp_path: Path) -> None:
    """What step 8e's write reports (launcher.rootfs: a SetupError, shown as one line by the launch):
    a host bundle over the limit (EFBIG, naming the bundle), and a target it cannot create
    (EEXIST, naming the target)."""
    from sandboxd.errors import SetupError
    from sandboxd.kernel.syscalls import Syscalls

    source = tmp_path / "bundle.pem"
    source.write_text("x" * 100)
    with pytest.raises(SetupError) as big:
        Syscalls.write_concatenated(str(tmp_path / "out"), str(source), "", 0o444, limit=99, step="write the trust bundle")
    assert (big.value.step, big.value.errno, big.value.path) == ("write the trust bundle", errno.EFBIG, str(source))
    Syscalls.write_concatenated(str(tmp_path / "out"), str(source), "extra", 0o444, limit=100, step="write the trust bundle")
    assert (tmp_path / "out").read_text() == "x" * 100 + "\nextra"
    with pytest.raises(SetupError) as taken:
        Syscalls.write_concatenated(str(tmp_path / "out"), str(source), "", 0o444, limit=100, step="write the trust bundle")
    assert (taken.value.errno, taken.value.path) == (errno.EEXIST, str(tmp_path / "out"))
