"""What `sandboxd mcp --gateway` costs (issue 28): latency per upstream call, memory per upstream
(not a test module: pytest does not collect it).

Latency, in the same run, alternating rounds, N calls each of a trivial tool (the hostile test
server's `echo`, tests/mcp_hostile_server.py), from a minimal JSON-RPC client over stdio (one line
out, one line in: no client library in the measurement):
- direct:    the upstream server run directly, no sandbox: the baseline;
- sandboxed: the same server under `sandboxd run` (its stdio through the sandbox, no gateway);
- gateway:   `upstream__echo` through `sandboxd mcp --gateway` (approval never): the gateway's
  Authorize and ReportToolResult on its own session, the upstream's stdio over its Exec call.
- exec:      the same server as one Exec call in a daemon session (as the gateway starts an
  upstream), spoken to in JSON lines over the Exec stream from a sync gRPC client: the daemon's
  stdio relay without the gateway;
- policy:    the gateway's two daemon round trips alone (Authorize, then ReportToolResult, as the
  gateway sends them, from a sync gRPC client on a session of the same daemon): the share of the
  policy engine and the audit log in the gateway's row.
The added latency is gateway minus direct (p50 and p90). Inside the gateway (its process started
through TIMED, which wraps the router's steps): the p50 of Authorize, the upstream's call
(Upstream.call_tool), ReportToolResult, and the whole of the gateway's handling of a call.

Memory: a gateway with 1 upstream, then one with 4 (each in its own session): the gateway
process's RSS, and the daemon's side (the daemon, its fork server, every session's processes:
PSS summed), per added upstream.

    .venv/bin/python tests/bench_mcp_gateway.py [CALLS]      (default 300)

Before/after a change: SANDBOXD_BENCH_GATEWAY_CODE=DIR runs the gateway (`sandboxd mcp`) from the
sandboxd package in DIR (say `git archive BASE sandboxd | tar -x -C DIR`) against the same daemon.
"""

from __future__ import annotations

import json
import os
import queue
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_mcp import percentiles  # noqa: E402
from conftest import PY, SANDBOXD  # noqa: E402
from daemon_helpers import Daemon, daemon_factory, descendants  # noqa: E402
from mcp_helpers import ENV as SANDBOXD_ENV, RawClient  # noqa: E402
from mcp_real_servers import gateway_file  # noqa: E402
from sandboxd.client import SandboxClient  # noqa: E402
from sandboxd.v1 import sandboxd_pb2 as pb  # noqa: E402

HOSTILE = str(Path(__file__).with_name("mcp_hostile_server.py"))
SITE_PACKAGES = str(next((Path(__file__).resolve().parents[1] / ".venv" / "lib").glob("python3*/site-packages")))
# The gateway's code from another tree, to compare a change with its base (the docstring).
GATEWAY_CODE = os.environ.get("SANDBOXD_BENCH_GATEWAY_CODE", "")
ENV = {**SANDBOXD_ENV, "PYTHONPATH": GATEWAY_CODE} if GATEWAY_CODE else SANDBOXD_ENV
SERVER_ENV = {**SANDBOXD_ENV, "PYTHONPATH": SITE_PACKAGES}


class EchoClient(RawClient):
    """An MCP stdio server spoken to in JSON lines, calling an `echo` tool."""

    def wait_for_tool(self, name: str, within: float = 120.0) -> None:
        deadline = time.monotonic() + within
        while True:
            listed = self.call("tools/list", {})["result"]["tools"]
            if any(tool["name"] == name for tool in listed):
                return
            assert time.monotonic() < deadline, f"{name} not listed: {[tool['name'] for tool in listed]}"
            time.sleep(0.2)

    def echo(self, tool: str, calls: int) -> list[float]:
        times = []
        for n in range(calls):
            started = time.perf_counter()
            answer = self.call("tools/call", {"name": tool, "arguments": {"text": f"ping {n}"}})
            times.append(time.perf_counter() - started)
            assert answer["result"]["content"][0]["text"] == f"ping {n}", answer
        return times


# `sandboxd mcp` with the gateway's steps timed, their medians (ms) written to argv[1] at exit.
TIMED = r"""
import atexit, json, statistics, sys, time
from sandboxd.mcp.gateway import authorize, router, upstream
times = {}
def timed(name, fn):
    async def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return await fn(*args, **kwargs)
        finally:
            times.setdefault(name, []).append(time.perf_counter() - started)
    return wrapper
authorize.authorize = timed("authorize", authorize.authorize)
authorize.report = timed("report", authorize.report)
upstream.Upstream.call_tool = timed("upstream_call", upstream.Upstream.call_tool)
router.Gateway.call_tool = timed("gateway_call", router.Gateway.call_tool)
out = sys.argv.pop(1)
atexit.register(lambda: open(out, "w").write(json.dumps(
    {name: round(statistics.median(values) * 1000, 3) for name, values in times.items()})))
sys.argv[0] = "sandboxd"
from sandboxd.cli.main import entry
entry()
"""


def gateway(daemon: Daemon, base: Path, names: list[str], timings: Path | None = None) -> tuple[EchoClient, Path]:
    """`sandboxd mcp --gateway` with one hostile-server upstream per name (echo trusted and read-only)."""
    upstreams: dict[str, dict[str, object]] = {}
    for name in names:
        workspace = base / f"ws-{name}"
        workspace.mkdir(exist_ok=True)
        upstreams[name] = {"command": [PY, HOSTILE], "workspace": str(workspace), "trusted": True,
                           "env": {"PYTHONPATH": SITE_PACKAGES}, "tools": {"echo": {"effect": "read-only"}}}
    config = base / f"gateway-{len(names)}.toml"
    config.write_text(gateway_file(upstreams))
    own = base / "ws-gateway"
    own.mkdir(exist_ok=True)
    program = [SANDBOXD] if timings is None else [sys.executable, "-c", TIMED, str(timings)]
    client = EchoClient([*program, "mcp", "--socket", daemon.socket, "--workspace", str(own), "--approval", "never",
                        "--gateway", str(config)], ENV)
    for name in names:
        client.wait_for_tool(f"{name}__echo")
    return client, config


class ExecClient(EchoClient):
    """The server as one long Exec call in a session of its own, JSON lines over the Exec stream."""

    def __init__(self, daemon: Daemon, workspace: Path) -> None:
        self.client = SandboxClient(daemon.socket)
        self.session = self.client.create_session(str(workspace), approval="never")
        self.requests: queue.Queue[pb.ExecRequest | None] = queue.Queue()
        self.requests.put(pb.ExecRequest(start=pb.ExecStart(
            session_id=self.session.id, argv=[PY, HOSTILE], env_overlay={"PYTHONPATH": SITE_PACKAGES},
            timeout_seconds=0, output_limit_bytes=1 << 62)))
        self.lines: queue.Queue[bytes] = queue.Queue()
        self.stream = self.client.stub.Exec(iter(self.requests.get, None))
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        self.ids = 0
        self.initialize()

    def _read(self) -> None:
        pending = b""
        for response in self.stream:
            if response.HasField("stdout"):
                pending += response.stdout
                *whole, pending = pending.split(b"\n")
                for line in whole:
                    self.lines.put(line)

    def send(self, message: dict[str, Any]) -> None:
        self.requests.put(pb.ExecRequest(stdin=(json.dumps(message) + "\n").encode()))

    def receive(self) -> bytes:
        return self.lines.get(timeout=60)

    def close(self) -> None:
        self.requests.put(pb.ExecRequest(close_stdin=True))
        self.requests.put(None)
        self.reader.join(60)
        self.client.close_session(self.session.id)
        self.client.close()


class PolicyOnly:
    """Authorize + ReportToolResult of an upstream tool, as the gateway sends them, on a session of its own."""

    def __init__(self, daemon: Daemon, workspace: Path) -> None:
        self.client = SandboxClient(daemon.socket)
        self.session = self.client.create_session(str(workspace), approval="never")

    def round_trips(self, calls: int) -> list[float]:
        times = []
        for n in range(calls):
            started = time.perf_counter()
            answer = self.client.stub.Authorize(pb.AuthorizeRequest(
                session_id=self.session.id, tool="upstream__echo", effect=pb.EFFECT_READ_ONLY, mcp_server="upstream",
                server_trusted=True, arguments_json=json.dumps({"text": f"ping {n}"}), risk="low",
                execution_context_id=f"bench-{n}"))
            self.client.stub.ReportToolResult(pb.ReportToolResultRequest(
                session_id=self.session.id, call_id=answer.call_id, ok=True,
                result_json=json.dumps({"content_bytes": 60, "is_error": False})))
            times.append(time.perf_counter() - started)
            assert answer.allowed, answer
        return times

    def close(self) -> None:
        self.client.close_session(self.session.id)
        self.client.close()


def latency(daemon: Daemon, base: Path, calls: int, rounds: int = 6) -> dict[str, Any]:
    sandbox_ws = base / "ws-sandboxed"
    sandbox_ws.mkdir()
    direct = EchoClient([PY, HOSTILE], SERVER_ENV)
    sandboxed = EchoClient([SANDBOXD, "run", "--workspace", str(sandbox_ws), "--env", f"PYTHONPATH={SITE_PACKAGES}",
                           "--", PY, HOSTILE], ENV)
    through, _ = gateway(daemon, base, ["upstream"])
    timings = base / "inside.json"
    timed, _ = gateway(daemon, base, ["timed"], timings)
    for name in ("ws-policy", "ws-exec"):
        (base / name).mkdir()
    policy = PolicyOnly(daemon, base / "ws-policy")
    relay = ExecClient(daemon, base / "ws-exec")
    runs: dict[str, list[float]] = {"direct": [], "sandboxed": [], "exec": [], "gateway": [], "policy": []}
    try:
        direct.echo("echo", 20)                                          # warm every path first
        sandboxed.echo("echo", 20)
        through.echo("upstream__echo", 20)
        timed.echo("timed__echo", 20)
        relay.echo("echo", 20)
        policy.round_trips(20)
        for _ in range(rounds):
            runs["direct"] += direct.echo("echo", calls // rounds)
            runs["sandboxed"] += sandboxed.echo("echo", calls // rounds)
            runs["gateway"] += through.echo("upstream__echo", calls // rounds)
            timed.echo("timed__echo", calls // rounds)
            runs["exec"] += relay.echo("echo", calls // rounds)
            runs["policy"] += policy.round_trips(calls // rounds)
    finally:
        for client in (direct, sandboxed, through, timed, relay):
            client.close()
        policy.close()
    report: dict[str, Any] = {name: percentiles(times) for name, times in runs.items()}
    for name in ("sandboxed", "exec", "gateway"):
        report[name]["added_p50_ms"] = round(report[name]["p50_ms"] - report["direct"]["p50_ms"], 3)
        report[name]["added_p90_ms"] = round(report[name]["p90_ms"] - report["direct"]["p90_ms"], 3)
    report["inside_the_gateway_p50_ms"] = json.loads(timings.read_text())
    return report


def daemon_side_pss(daemon: Daemon) -> int:
    """PSS of the daemon and every process below it (fork server, sessions, calls, upstream servers)."""
    total = 0
    for pid in [daemon.pid, *descendants(daemon.pid)]:
        try:
            total += psutil.Process(pid).memory_full_info().pss
        except psutil.Error:
            continue
    return total


def memory(daemon: Daemon, base: Path) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    for count in (1, 4):
        names = [f"mem{count}-{n}" for n in range(count)]
        client, _ = gateway(daemon, base, names)
        try:
            time.sleep(1.0)                                             # let start-up garbage settle
            figures[f"{count}_upstreams"] = {
                "gateway_rss_kib": psutil.Process(client.server.pid).memory_info().rss // 1024,
                "daemon_side_pss_kib": daemon_side_pss(daemon) // 1024,
            }
        finally:
            client.close()
    one, four = figures["1_upstreams"], figures["4_upstreams"]
    figures["per_added_upstream"] = {
        "gateway_rss_kib": (four["gateway_rss_kib"] - one["gateway_rss_kib"]) // 3,
        "daemon_side_pss_kib": (four["daemon_side_pss_kib"] - one["daemon_side_pss_kib"]) // 3,
    }
    return figures


def main() -> None:
    calls = int(sys.argv[1]) if len(sys.argv) > 1 else 300
    with daemon_factory("sbxd-bench-gateway-") as factory:
        daemon = factory()
        base = factory.base
        report = {"latency": latency(daemon, base, calls), "memory": memory(daemon, base),
                  "load": os.getloadavg()[0]}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
