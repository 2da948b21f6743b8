"""`sandboxd mcp` from the MCP TypeScript SDK (@modelcontextprotocol/sdk from npm, pinned by
packaging/mcp-client-ts/package-lock.json): the tool list, a command over stdio, and the
kernel's wall around it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

from daemon_fixtures import daemon, ws  # noqa: F401 - pytest fixtures
from daemon_helpers import Daemon
from mcp_helpers import ENV, SANDBOXD

REPO = Path(__file__).resolve().parents[1]
CLIENT = REPO / "packaging" / "mcp-client-ts"


def test_typescript_sdk_lists_tools_and_runs_a_command(daemon: Daemon, ws: Path) -> None:
    assert shutil.which("node") and shutil.which("npm"), "node and npm are installed by packaging/setup.sh test"
    if not (CLIENT / "node_modules" / "@modelcontextprotocol" / "sdk").is_dir():
        subprocess.run(["npm", "ci", "--no-audit", "--no-fund", "--silent"], cwd=CLIENT, check=True, timeout=300)
    done = subprocess.run(["node", str(CLIENT / "client.mjs"), SANDBOXD, daemon.socket, str(ws)],
                          capture_output=True, text=True, timeout=120, env=ENV, cwd=CLIENT)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["tools"][:3] == ["shell", "read_file", "write_file"] and "stop_process" in out["tools"]
    assert out["shellSchema"]["required"] == ["command"]
    result = out["result"]
    assert not result.get("isError")
    status = result["structuredContent"]
    assert (status["exit_code"], status["stdout"]) == (4, f"from-typescript\n{os.getuid()}\n")
    assert result["content"][0]["text"].startswith("exit status 4")
    # Streamed as progress before the result (the SDK may hand a notification read together with the
    # result to its error handler instead: client.mjs keeps those as "late").
    assert "from-typescript\n" in "".join(out["progress"] + out["late"]), out
    assert out["outside"]["exit_code"] != 0 and "Read-only file system" in out["outside"]["stderr"], out["outside"]
    assert not os.path.exists("/etc/mcp-ts-probe")
    assert out["inside"]["stdout"] == "x\n" and (ws / "ts-probe").read_text() == "x\n"
