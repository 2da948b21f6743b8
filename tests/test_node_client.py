"""A client in another language uses the proto as written: Node with @grpc/grpc-js and
@grpc/proto-loader (packaging/node-client/client.mjs) drives a real daemon."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CLIENT = REPO / "packaging" / "node-client"
SANDBOXD = str(REPO / ".venv" / "bin" / "sandboxd")


def _ensure_node_modules() -> None:
    if not (CLIENT / "node_modules" / "@grpc" / "grpc-js").is_dir():
        subprocess.run(["npm", "ci", "--no-audit", "--no-fund", "--silent"], cwd=CLIENT, check=True, timeout=300)


def test_node_client_runs_a_command_in_a_session() -> None:
    """Session created, stdin delivered, stdout/stderr/exit code and the caller's uid come back,
    session closed: all through the proto file as written, from another language."""
    assert shutil.which("node") and shutil.which("npm"), "node and npm are installed by packaging/setup.sh test"
    _ensure_node_modules()
    base = Path(tempfile.mkdtemp(dir="/var/tmp", prefix="sandboxd-node-"))
    workspace = base / "ws"
    workspace.mkdir()
    socket_path = base / "sandboxd.sock"
    daemon = subprocess.Popen([SANDBOXD, "serve", "--socket", str(socket_path), "--state-dir", str(socket_path.parent / "state")], stderr=subprocess.PIPE, text=True)
    try:
        assert daemon.stderr is not None and '"serving"' in daemon.stderr.readline()
        result = subprocess.run(["node", str(CLIENT / "client.mjs"), str(socket_path), str(workspace)],
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        out = json.loads(result.stdout)
        assert out["stdout"] == "hello from node\n"
        assert out["stderr"] == f"from-node-{os.getuid()}\n"
        assert out["started_pid"] >= 2
        assert out["result"]["exit_code"] == 5 and out["result"]["shell_status"] == 5
    finally:
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(timeout=20)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()
        time.sleep(0.1)
        shutil.rmtree(base, ignore_errors=True)
    assert daemon.returncode == 0
