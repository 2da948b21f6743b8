"""The network part of tests/benchmark.py (not a test module: pytest does not collect it).

- Session creation (and close) with an isolated network, next to network off, through the fork
  server (what the daemon's CreateSession/CloseSession do besides gRPC).
- HTTP requests per second from inside a sandbox to a server in a "gateway" namespace (the
  test world of tests/test_isolated_network.py): directly over the isolated network, and
  through the domain proxy (--allow-domain). One `sandboxd run` makes the requests in a loop,
  one connection each.
- The intercepting proxy (issue 26), against the TLS world of tests/tls_world.py, the egress proxy
  in a process of its own (as in the daemon, one relay loop): the latency a request through it
  adds, to an intercepted host (TLS ended by the session's CA, a credential swapped in) and to a
  tunnelled one (an allowed domain, bytes relayed), against the same request sent directly, p50
  and p99, on one kept-alive connection and with a new connection (and TLS handshake) each; and the
  proxy's memory per open idle connection of each kind (its VmRSS with N connections held open,
  less before, over N; median of 3 rounds, each a fresh proxy).

Run alone: ``.venv/bin/python tests/bench_network.py [--requests N] [--connections N] [--rounds N]
[--json FILE]`` (root; the intercepting proxy's section only), or as part of tests/benchmark.py.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import textwrap
import time
from typing import Any

import socket
import ssl
import sys
from pathlib import Path

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
    interception = run_interception_section(requests=requests, connections=200, rounds=3)
    return {"sessions_network_off": off, "sessions_isolated": isolated, "requests_direct_per_s": direct,
            "requests_proxy_per_s": proxied, "interception": interception}


# The egress proxy alone in a process (argv: tunnel|intercept, the world's CA file, its resolver, the
# file to write the session CA's certificate to): prints its port and the phantom, serves until
# stdin closes. Connections from this process's namespace, as test_egress_rules.py's.
PROXY = textwrap.dedent('''
    import os, sys
    from sandboxd.network.credentials import Credential, CredentialSet, Secret, new_phantom
    from sandboxd.network.egress_proxy import EgressProxy
    from sandboxd.network.interception.ca import SessionCA
    from sandboxd.network.interception.intercepted import Interceptor
    from sandboxd.network.interception.upstream_tls import upstream_context
    from sandboxd.network.tcp_relay import listen_tcp
    from sandboxd.policy.network import NetworkRules, parse_credential
    mode, ca_file, resolver, session_ca_file = sys.argv[1:5]
    session_ca = SessionCA.generate("bench0123456789")
    open(session_ca_file, "wb").write(session_ca.cert_pem())
    spec = parse_credential("TOKEN=https://api.test.example")
    phantom = new_phantom()
    rules = (NetworkRules(domains=("api.test.example",)) if mode == "tunnel" else NetworkRules(credentials=(spec,)))
    credentials = CredentialSet([Credential(spec, Secret(b"ghs_benchSECRET"), phantom)])
    listener = listen_tcp("127.0.0.1", 0, step="bench proxy")
    netns = os.open("/proc/self/ns/net", os.O_RDONLY)
    proxy = EgressProxy(listener, rules, netns_fd=netns, resolvers=[resolver], connections=100000,
                        on_denied=lambda where, why: print("proxy refused", where, why, file=sys.stderr),
                        interceptor=Interceptor(session_ca, upstream_context(open(ca_file).read())),
                        credentials=credentials).start()
    print(listener.getsockname()[1], phantom, flush=True)
    sys.stdin.read()
    proxy.close()
''')


class Proxy:
    """The egress proxy's process for one mode; ``rss_kib()`` reads its VmRSS."""

    def __init__(self, mode: str, world: Any) -> None:
        self.session_ca = Path(world.base) / f"session-ca-{mode}.pem"
        repo = Path(__file__).resolve().parents[1]
        self.process = subprocess.Popen([sys.executable, "-c", PROXY, mode, str(world.ca_file), world.resolvers[0],
                                         str(self.session_ca)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        text=True, cwd=repo, env={**os.environ, "PYTHONPATH": str(repo)})
        assert self.process.stdout is not None
        port, self.phantom = self.process.stdout.readline().split()
        self.port = int(port)

    def rss_kib(self) -> int:
        with open(f"/proc/{self.process.pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait(30)


def read_response(sock: ssl.SSLSocket) -> bytes:
    """One HTTP/1.1 response with a Content-Length (what the world's /bench answers)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed after {data[:200]!r}")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        body += sock.recv(65536)
    return head


class Client:
    """TLS connections to api.test.example directly, through a CONNECT tunnel, or intercepted."""

    def __init__(self, mode: str, world: Any, proxy: Proxy | None) -> None:
        from tls_world import API_HOST, NAME_TABLE

        self.mode, self.host, self.address, self.proxy = mode, API_HOST, NAME_TABLE[API_HOST], proxy
        trust = proxy.session_ca if mode == "intercept" and proxy else world.ca_file
        self.context = ssl.create_default_context(cafile=str(trust))
        token = proxy.phantom if proxy else "none"
        self.request = (f"GET /bench HTTP/1.1\r\nHost: {API_HOST}\r\nAuthorization: Bearer {token}\r\n\r\n"
                        .encode())

    def connect(self) -> ssl.SSLSocket:
        if self.proxy is None:
            raw = socket.create_connection((self.address, 443), timeout=30)
        else:
            raw = socket.create_connection(("127.0.0.1", self.proxy.port), timeout=30)
            raw.sendall(f"CONNECT {self.host}:443 HTTP/1.1\r\nHost: {self.host}:443\r\n\r\n".encode())
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = raw.recv(4096)
                if not chunk:
                    raise ConnectionError(f"the proxy closed: {head!r}")
                head += chunk
            if not head.startswith(b"HTTP/1.1 200"):
                raise ConnectionError(f"the proxy refused: {head[:200]!r}")
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return self.context.wrap_socket(raw, server_hostname=self.host)

    def ask(self, tls: ssl.SSLSocket) -> None:
        tls.sendall(self.request)
        head = read_response(tls)
        if not head.startswith(b"HTTP/1.1 200"):
            raise ConnectionError(f"{self.mode}: {head[:200]!r}")


def percentiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {"p50_ms": ordered[len(ordered) // 2] * 1000, "p99_ms": ordered[min(len(ordered) - 1,
                                                                                int(len(ordered) * 0.99))] * 1000,
            "n": len(ordered)}


def latencies(client: Client, requests: int) -> dict[str, dict[str, float]]:
    """Each request's time on one kept-alive connection, and with a new connection (connect, the
    CONNECT, TLS, the request) each."""
    kept: list[float] = []
    with client.connect() as tls:
        client.ask(tls)                                        # warm
        for _ in range(requests):
            start = time.perf_counter()
            client.ask(tls)
            kept.append(time.perf_counter() - start)
    fresh: list[float] = []
    for _ in range(requests):
        start = time.perf_counter()
        with client.connect() as tls:
            client.ask(tls)
        fresh.append(time.perf_counter() - start)
    return {"kept_alive": percentiles(kept), "new_connection": percentiles(fresh)}


def memory_per_connection(mode: str, world: Any, connections: int) -> float:
    """KiB of the proxy's VmRSS per idle open connection of ``mode`` (each has carried one request)."""
    proxy = Proxy(mode, world)
    try:
        client = Client(mode, world, proxy)
        for _ in range(5):                                     # warm: first-use allocations
            with client.connect() as tls:
                client.ask(tls)
        time.sleep(0.5)
        before = proxy.rss_kib()
        held = []
        for _ in range(connections):
            for attempt in range(3):            # a lookup lost under the load is retried, not measured
                try:
                    tls = client.connect()
                    break
                except ConnectionError:
                    if attempt == 2:
                        raise
            client.ask(tls)
            held.append(tls)
        time.sleep(0.5)
        after = proxy.rss_kib()
        for tls in held:
            tls.close()
        return (after - before) / connections
    finally:
        proxy.close()


def run_interception_section(*, requests: int, connections: int, rounds: int) -> dict[str, Any]:
    from tls_world import TlsWorld

    world = TlsWorld()
    result: dict[str, Any] = {"requests": requests, "connections": connections, "rounds": rounds,
                              "load_before": os.getloadavg()}
    try:
        world.build()
        proxies = {mode: Proxy(mode, world) for mode in ("tunnel", "intercept")}
        try:
            for mode in ("direct", "tunnel", "intercept"):
                result[mode] = latencies(Client(mode, world, proxies.get(mode)), requests)
                world.api.clear()
        finally:
            for proxy in proxies.values():
                proxy.close()
        for mode in ("tunnel", "intercept"):
            rounds_kib = [memory_per_connection(mode, world, connections) for _ in range(rounds)]
            result[f"{mode}_kib_per_connection"] = statistics.median(rounds_kib)
            result[f"{mode}_kib_rounds"] = rounds_kib
            world.api.clear()
    finally:
        world.teardown()
    result["load_after"] = os.getloadavg()
    direct = result["direct"]
    for way in ("kept_alive", "new_connection"):
        line = ", ".join(f"{mode} {result[mode][way]['p50_ms']:.2f} / {result[mode][way]['p99_ms']:.2f}"
                         for mode in ("direct", "tunnel", "intercept"))
        added = ", ".join(f"{mode} +{result[mode][way]['p50_ms'] - direct[way]['p50_ms']:.2f}"
                          for mode in ("tunnel", "intercept"))
        print(f"HTTPS request latency, {way.replace('_', ' ')} (p50 / p99 ms, {requests} requests): {line}; "
              f"added at p50: {added} ms")
    print(f"proxy memory per idle open connection ({connections} held, median of {rounds}): tunnelled "
          f"{result['tunnel_kib_per_connection']:.1f} KiB, intercepted {result['intercept_kib_per_connection']:.1f} KiB")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=2000, help="requests per mode and way (default 2000)")
    parser.add_argument("--connections", type=int, default=200, help="idle connections held (default 200)")
    parser.add_argument("--rounds", type=int, default=3, help="memory rounds, median taken (default 3)")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    result = run_interception_section(requests=args.requests, connections=args.connections, rounds=args.rounds)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
