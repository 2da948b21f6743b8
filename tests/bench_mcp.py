"""The latency `sandboxd mcp` adds to a shell command (not a test module: pytest does not collect it).

On one warm session of one daemon, in the same run, N calls each of:
- direct:  the daemon's Exec RPC (sandboxd.client, `sh -c true`), the baseline;
- mcp-raw: `tools/call shell` through `sandboxd mcp` over stdio, from a minimal JSON-RPC client
  (one line out, one line in): what the MCP server itself adds;
- mcp-sdk: the same call from the official MCP Python SDK client (its own overhead included).
The session is attached with --session, so all three run the same command in the same sandbox.
Prints p50/p90 (ms) and the added latency (mcp p50 - direct p50) as JSON.

    .venv/bin/python tests/bench_mcp.py [CALLS]      (default 300)
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from daemon_helpers import daemon_factory  # noqa: E402
from mcp_helpers import ENV, RawClient, mcp_client, server_params  # noqa: E402
from sandboxd.client import SandboxClient  # noqa: E402


def percentiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {"p50_ms": round(statistics.median(ordered) * 1000, 3),
            "p90_ms": round(ordered[int(len(ordered) * 0.9) - 1] * 1000, 3), "calls": len(ordered)}


def direct(client: SandboxClient, session_id: str, calls: int) -> list[float]:
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        outcome = client.exec(session_id, shell="true")
        times.append(time.perf_counter() - started)
        assert outcome.result.exit_code == 0
    return times


def raw_shell(raw: RawClient, calls: int) -> list[float]:
    """`tools/call shell` of `sandboxd mcp` in JSON lines: no client library in the measurement."""
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        answer = raw.call("tools/call", {"name": "shell", "arguments": {"command": "true"}})
        times.append(time.perf_counter() - started)
        assert answer["result"]["structuredContent"]["exit_code"] == 0, answer
    return times


async def sdk_shell(mcp: Any, calls: int) -> list[float]:
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        result = await mcp.call_tool("shell", {"command": "true"})
        times.append(time.perf_counter() - started)
        assert isinstance(result.structured_content, dict) and result.structured_content["exit_code"] == 0
    return times


async def measure(socket: str, workspace: str, client: SandboxClient, session_id: str, calls: int,
                  rounds: int = 6) -> dict[str, list[float]]:
    """The three ways in alternating rounds, so a busy moment of the machine hits them alike."""
    runs: dict[str, list[float]] = {"direct": [], "mcp-raw": [], "mcp-sdk": []}
    params = server_params(socket, workspace, "--session", session_id)
    raw = RawClient([params.command, *params.args], ENV)
    try:
        async with mcp_client(socket, workspace, "--session", session_id) as mcp:
            direct(client, session_id, 20)                              # warm every path first
            raw_shell(raw, 20)
            await sdk_shell(mcp, 20)
            for _ in range(rounds):
                runs["direct"] += direct(client, session_id, calls // rounds)
                runs["mcp-raw"] += raw_shell(raw, calls // rounds)
                runs["mcp-sdk"] += await sdk_shell(mcp, calls // rounds)
    finally:
        raw.close()
    return runs


def main() -> None:
    calls = int(sys.argv[1]) if len(sys.argv) > 1 else 300
    with daemon_factory("sbxd-bench-mcp-") as factory:
        daemon = factory()
        workspace = str(factory.workspace())
        with SandboxClient(daemon.socket) as client:
            session = client.create_session(workspace, approval="never")
            runs = asyncio.run(measure(daemon.socket, workspace, client, session.id, calls))
            client.close_session(session.id)
    report: dict[str, Any] = {name: percentiles(times) for name, times in runs.items()}
    for name in ("mcp-raw", "mcp-sdk"):
        report[name]["added_p50_ms"] = round(report[name]["p50_ms"] - report["direct"]["p50_ms"], 3)
        report[name]["added_p90_ms"] = round(report[name]["p90_ms"] - report["direct"]["p90_ms"], 3)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
