"""A machine of its own for the metadata tests (tests/test_metadata.py), made of two network
namespaces the test owns, so the machine's links, routes, nftables and address pool are never
touched and another sandboxd (or another run of these tests) can serve beside it:

- ``host``: stands in for the machine. `sandboxd run` is started inside it (``nsenter --net``: only
  the network namespace changes, mounts and cgroups stay the machine's), so "the host's network"
  (--network=host) is this namespace, the isolated network's veth, NAT and `inet sandboxd` table
  are made here, and its default routes (IPv4 and IPv6) lead to ``cloud``;
- ``cloud``: every cloud metadata address of policy.network.METADATA_ADDRESSES on its loopback, and
  the NAT64 spelling of 169.254.169.254 (64:ff9b::a9fe:a9fe, standing in for a translator that would
  forward it there), each answering HTTP on port 80 ("metadata ADDRESS") and UDP on port 80
  ("udp ADDRESS"); an ordinary server, INTERNET, for the controls; and a DNS server on port 53 of
  every address (DNS_SERVER, and 169.254.169.254 as Google's metadata server is a resolver) that
  answers test names, some of them with metadata addresses (NAMES).

The DNS responder is a minimal one written here (A records only; anything else: no answer): the
tests' shared world (tests/tls_world.py) was not ready when this was written. Every datagram and
connection that reaches the cloud is counted per local address (``reached``), so a refusal is
shown as "nothing arrived", not only as an error inside the sandbox.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap

from conftest import PY

INTERNET = "198.51.100.10"
DNS_SERVER = "198.51.100.53"
NAT64_METADATA = "64:ff9b::a9fe:a9fe"
MAPPED_METADATA = "::ffff:169.254.169.254"
HOST_SIDE, CLOUD_SIDE = "203.0.113.1", "203.0.113.2"
HOST_SIDE6, CLOUD_SIDE6 = "fd5d:6d64::1", "fd5d:6d64::2"
NAMES = {"internet.test": INTERNET, "meta.test": "169.254.169.254", "ecs.test": "169.254.170.2",
         "alibaba.test": "100.100.100.200", "oracle.test": "192.0.0.192",
         # A metadata *name* that resolves to an ordinary address: refused by name, whatever it resolves to.
         "metadata.google.internal": INTERNET}

CLOUD = textwrap.dedent('''
    import json, socket, socketserver, struct, sys, threading
    reached = {}
    lock = threading.Lock()
    def count(address, what):
        address = address[7:] if address.startswith("::ffff:") else address
        with lock:
            reached[f"{what} {address}"] = reached.get(f"{what} {address}", 0) + 1
    class Http(socketserver.StreamRequestHandler):
        def handle(self):
            local = self.connection.getsockname()[0]
            count(local, "tcp")
            self.rfile.readline()
            local = local[7:] if local.startswith("::ffff:") else local
            body = ("metadata " + local).encode()
            self.wfile.write(b"HTTP/1.0 200 OK\\r\\nContent-Length: %d\\r\\n\\r\\n" % len(body) + body)
    class Dual(socketserver.ThreadingTCPServer):
        address_family = socket.AF_INET6
        allow_reuse_address = True
        daemon_threads = True
        def server_bind(self):
            self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            super().server_bind()
    def udp_echo():
        sock = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_RECVPKTINFO, 1)
        sock.bind(("::", 80))
        while True:
            data, ancillary, _, peer = sock.recvmsg(512, 256)
            info = next(d for _, _, d in ancillary)     # in6_pktinfo: the address the datagram was sent to
            local = socket.inet_ntop(socket.AF_INET6, info[:16])
            count(local, "udp")
            # Answered from that address (a connected client takes replies from its peer only).
            sock.sendmsg([b"udp " + (local[7:] if local.startswith("::ffff:") else local).encode()],
                         [(socket.IPPROTO_IPV6, socket.IPV6_PKTINFO, info[:16] + bytes(4))], 0, peer)
    def dns(names):
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.setsockopt(socket.IPPROTO_IP, 8, 1)        # IP_PKTINFO (not named by Python 3.11)
        sock.bind(("0.0.0.0", 53))
        while True:
            query, ancillary, _, peer = sock.recvmsg(512, 256)
            packed = next(d for _, _, d in ancillary)[8:12]    # in_pktinfo.ipi_addr: where it was sent
            count(socket.inet_ntoa(packed), "dns")
            labels, i = [], 12
            while query[i]:
                labels.append(query[i + 1:i + 1 + query[i]].decode().lower()); i += 1 + query[i]
            name, qtype = ".".join(labels), struct.unpack(">H", query[i + 1:i + 3])[0]
            ip = names.get(name) if qtype == 1 else None
            flags = 0x8180 if name in names else 0x8183
            reply = query[:2] + struct.pack(">HHHHH", flags, 1, 1 if ip else 0, 0, 0) + query[12:i + 5]
            if ip:
                reply += b"\\xc0\\x0c" + struct.pack(">HHIH", 1, 1, 60, 4) + socket.inet_aton(ip)
            sock.sendmsg([reply], [(socket.IPPROTO_IP, 8, bytes(4) + packed + bytes(4))], 0, peer)  # from there
    server = Dual(("::", 80), Http)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    threading.Thread(target=udp_echo, daemon=True).start()
    threading.Thread(target=dns, args=(json.loads(sys.argv[1]),), daemon=True).start()
    print("ready", flush=True)
    for line in sys.stdin:
        with lock:
            print(json.dumps(reached), flush=True)
            reached.clear()
''')


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise AssertionError(f"ip {' '.join(args)}: {done.stderr.strip()}")


class MetadataWorld:
    """The two namespaces and the cloud's servers. ``close`` removes everything (the namespaces take
    their veth, addresses, routes and nftables with them)."""

    def __init__(self) -> None:
        from sandboxd.policy.network import METADATA_ADDRESSES

        tag = os.urandom(3).hex()                       # unique: beside another run of these tests
        self.host, self.cloud = f"sbxmdh{tag}", f"sbxmdc{tag}"
        self.metadata = METADATA_ADDRESSES
        self.server: "subprocess.Popen[str] | None" = None
        _ip("netns", "add", self.host)
        try:
            _ip("netns", "add", self.cloud)
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        host, cloud = self.host, self.cloud
        _ip("-n", host, "link", "add", "up0", "type", "veth", "peer", "name", "up0", "netns", cloud)
        for ns, v4, v6 in ((host, HOST_SIDE, HOST_SIDE6), (cloud, CLOUD_SIDE, CLOUD_SIDE6)):
            _ip("-n", ns, "addr", "add", f"{v4}/30", "dev", "up0")
            _ip("-n", ns, "-6", "addr", "add", f"{v6}/64", "dev", "up0", "nodad")
            _ip("-n", ns, "link", "set", "up0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", host, "route", "add", "default", "via", CLOUD_SIDE)
        _ip("-n", host, "-6", "route", "add", "default", "via", CLOUD_SIDE6)
        for address in (*self.metadata, NAT64_METADATA, INTERNET, DNS_SERVER):
            _ip("-n", cloud, "addr", "add", address + ("/128" if ":" in address else "/32"), "dev", "lo")
        self.server = subprocess.Popen(["ip", "netns", "exec", cloud, PY, "-c", CLOUD, json.dumps(NAMES)],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.server.stdout is not None and self.server.stdout.readline() == "ready\n"

    def in_host(self, argv: "list[str]") -> "list[str]":
        """``argv`` run in the stand-in host's network namespace (nothing else of it changes)."""
        return ["nsenter", f"--net=/run/netns/{self.host}", "--", *argv]

    def reached(self) -> dict[str, int]:
        """What reached the cloud since the last look: "tcp ADDRESS", "udp ADDRESS", "dns ADDRESS" counts."""
        assert self.server is not None and self.server.stdin is not None and self.server.stdout is not None
        self.server.stdin.write("count\n")
        self.server.stdin.flush()
        return dict(json.loads(self.server.stdout.readline()))

    def close(self) -> None:
        if self.server is not None:
            self.server.kill()
            self.server.wait(timeout=30)
            self.server = None
        for ns in (self.host, self.cloud):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
