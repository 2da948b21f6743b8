"""A client in another language uses the proto as written: Node with @grpc/grpc-js and
@grpc/proto-loader (packaging/node-client/client.mjs) drives a real daemon."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

from daemon_helpers import DaemonFactory

REPO = Path(__file__).resolve().parents[1]
CLIENT = REPO / "packaging" / "node-client"


def _ensure_node_modules() -> None:
    if not (CLIENT / "node_modules" / "@grpc" / "grpc-js").is_dir():
        subprocess.run(["npm", "ci", "--no-audit", "--no-fund", "--silent"], cwd=CLIENT, check=True, timeout=300)


def test_node_client_runs_a_command_in_a_session(sandboxd_daemon: DaemonFactory) -> None:
    """Session created, stdin delivered, stdout/stderr/exit code and the caller's uid come back,
    session closed: all through the proto file as written, from another language."""
    assert shutil.which("node") and shutil.which("npm"), "node and npm are installed by packaging/setup.sh test"
    _ensure_node_modules()
    daemon = sandboxd_daemon()
    workspace = sandboxd_daemon.workspace()
    result = subprocess.run(["node", str(CLIENT / "client.mjs"), daemon.socket, str(workspace)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["stdout"] == "hello from node\n"
    assert out["stderr"] == f"from-node-{os.getuid()}\n"
    assert out["started_pid"] >= 2
    assert out["result"]["exit_code"] == 5 and out["result"]["shell_status"] == 5
    assert daemon.stop() == 0
