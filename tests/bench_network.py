"""The network part of tests/benchmark.py (not a test module: pytest does not collect it).

- Session creation (and close) with an isolated network, next to network off, through the fork
  server (what the daemon's CreateSession/CloseSession do besides gRPC).
- HTTP requests per second from inside a sandbox to a server in a "gateway" namespace (the
  test world of tests/test_isolated_network.py): directly over the isolated network, and
  through the domain proxy (--allow-domain). One `sandboxd run` makes the requests in a loop,
  one connection each.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import tempfile
import textwrap
import time
from typing import Any

from sandboxd.policy import LaunchSpec, WorkspaceWrite
from sandboxd.supervisor.fork_client import ForkServer

LOOP = textwrap.dedent('''
    import json, sys, time, urllib.request
    opener = urllib.request.build_opener() if sys.argv[1] == "proxy" else urllib.request.build_opener(
        urllib.request.ProxyHandler({}))
    count, started = int(sys.argv[2]), time.monotonic()
    for _ in range(count):
        assert opener.open("http://internet.test:8080/", timeout=10).read() == b"hello from internet"
    print(json.dumps({"per_s": count / (time.monotonic() - started)}))
''')


def session_times(runs: int, network: bool) -> dict[str, float]:
    workspace = tempfile.mkdtemp(prefix="sandboxd-bench-net-", dir="/var/tmp")
    fs = ForkServer.start()
    opens, closes = [], []
    try:
        for n in range(runs + 3):
            spec = LaunchSpec(argv=("true",), workspace=workspace, policy=WorkspaceWrite(network_access=network))
            start = time.perf_counter()
            fs.open_session(f"b{n}", spec)
            middle = time.perf_counter()
            fs.close_session(f"b{n}")
            end = time.perf_counter()
            if n >= 3:
                opens.append(middle - start)
                closes.append(end - middle)
    finally:
        fs.close()
        os.rmdir(workspace)
    return {"open_median_ms": statistics.median(opens) * 1000, "close_median_ms": statistics.median(closes) * 1000,
            "n": runs}


def request_rate(sandboxd: str, python: str, mode: str, count: int, dns: str) -> float:
    workspace = tempfile.mkdtemp(prefix="sandboxd-bench-net-", dir="/var/tmp")
    try:
        extra = ["--allow-domain", "internet.test"] if mode == "proxy" else []
        result = subprocess.run([sandboxd, "run", "--workspace", workspace, "--network", "--dns", dns, *extra, "--",
                                 python, "-c", LOOP, mode, str(count)], capture_output=True, text=True, timeout=300)
        if result.returncode != 0:
            raise RuntimeError(result.stderr[-2000:])
        return float(json.loads(result.stdout.strip().splitlines()[-1])["per_s"])
    finally:
        os.rmdir(workspace)


def run_network_section(*, runs: int, requests: int, sandboxd: str) -> dict[str, Any]:
    from test_isolated_network import DNS, PY, World

    off = session_times(runs, network=False)
    isolated = session_times(runs, network=True)
    print(f"session open / close through the fork server, network off: {off['open_median_ms']:.1f} / "
          f"{off['close_median_ms']:.1f} ms; isolated network: {isolated['open_median_ms']:.1f} / "
          f"{isolated['close_median_ms']:.1f} ms (median of {runs})")
    world = World()
    try:
        world.build()
        direct = request_rate(sandboxd, PY, "direct", requests, DNS)
        proxied = request_rate(sandboxd, PY, "proxy", requests, DNS)
    finally:
        world.teardown()
    print(f"HTTP requests from a sandbox to the test world's server, one connection each ({requests}): "
          f"{direct:.0f}/s over the isolated network, {proxied:.0f}/s through the domain proxy")
    return {"sessions_network_off": off, "sessions_isolated": isolated, "requests_direct_per_s": direct,
            "requests_proxy_per_s": proxied}
