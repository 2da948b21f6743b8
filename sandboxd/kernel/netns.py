"""Network namespaces: loopback for sandboxes without network, and isolated networks.

A new network namespace has only ``lo``, and it is down. An ioctl on any
socket in the namespace brings it up without loading a netlink library, which
keeps the one-shot path fast.

An isolated network (``network_access`` with the default ``network_mode``
"isolated") is a namespace of its own joined to the host by a veth pair, built
with pyroute2 (links, addresses, routes) before the sandbox's init exists; init
then joins it with setns. NAT and the egress filter are the host's nftables
table (sandboxd.kernel.nftables). Imports here are local: pyroute2 alone takes
0.3 s to import, which only isolated networks pay.
"""

from __future__ import annotations

import _socket  # the C module: socket.py's enums cost more to import than a launch
import fcntl
import struct

from sandboxd.errors import SetupError
from sandboxd.kernel._libc import from_oserror

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

SIOCGIFFLAGS = 0x8913
SIOCSIFFLAGS = 0x8914
IFF_UP = 0x1


def bring_up_loopback() -> None:
    try:
        sock = _socket.socket(_socket.AF_INET, _socket.SOCK_DGRAM | _socket.SOCK_CLOEXEC, 0)
        try:
            request = struct.pack("16sH14x", b"lo", 0)
            flags = struct.unpack("16sH14x", fcntl.ioctl(sock.fileno(), SIOCGIFFLAGS, request))[1]
            fcntl.ioctl(sock.fileno(), SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | IFF_UP))
        finally:
            sock.close()
    except OSError as exc:
        raise from_oserror(exc, "bring up loopback", "lo") from None


# ---- isolated networks: a namespace of its own, joined to the host by a veth pair -----------

DEFAULT_POOL = "10.233.0.0/16"
LINK_PREFIX = "sbx"                   # nftables matches sandbox links by this prefix (kernel.nftables)
SANDBOX_LINK = "eth0"
LOCK_PATH = "/run/sandboxd/network.lock"
_counter = 0


class IsolatedNetwork:
    """A network namespace with a veth link to the host: the sandbox side ``eth0`` has
    ``sandbox_address`` and a default route through ``host_address`` on the host side
    ``host_link``. NAT and filtering are the host table's (kernel.nftables)."""

    def __init__(self, netns_fd: int, host_link: str, host_address: str, sandbox_address: str,
                 resolvers: "list[str]") -> None:
        self.netns_fd = netns_fd
        self.host_link = host_link
        self.host_address = host_address
        self.sandbox_address = sandbox_address
        self.resolvers = resolvers
        self.proxy_listener: "Any" = None           # the egress proxy's socket, with allowed domains

    def resolv_conf(self) -> str:
        """The sandbox's /etc/resolv.conf."""
        if not self.resolvers:
            return "# sandboxd: no DNS resolver reachable from the sandbox (pass --dns)\n"
        return "".join(f"nameserver {ip}\n" for ip in self.resolvers) + "options edns0\n"

    def close(self) -> None:
        """Delete the host side of the link (the sandbox side goes with it) and let go of the
        namespace (it ends with its last process). Safe to call twice."""
        if self.netns_fd >= 0:
            import os
            os.close(self.netns_fd)
            self.netns_fd = -1
        if self.proxy_listener is not None:
            self.proxy_listener.close()
            self.proxy_listener = None
        if self.host_link:
            _delete_link(self.host_link)
            self.host_link = ""


def create_isolated(*, pool: str = DEFAULT_POOL, resolvers: "list[str] | None" = None,
                    allowed_hosts: "tuple[str, ...]" = (), via_proxy: bool = False) -> IsolatedNetwork:
    """A new network namespace (not entered: the caller's stays as it was) with loopback and
    ``eth0`` up, an address from ``pool``, a default route out through the host, the host's
    nftables table in place and IPv4 forwarding on for the link and the host's uplink. With
    ``allowed_hosts`` ("CIDR[:PORTS]") or ``via_proxy`` (allowed domains: the egress proxy on the
    namespace's own loopback, network.egress_proxy), an egress allowlist inside the namespace too."""
    import fcntl
    import ipaddress
    import os
    import socket

    from sandboxd.kernel import namespaces, nftables

    global _counter
    resolvers = list(resolvers) if resolvers is not None else host_resolvers()
    network = ipaddress.ip_network(pool)
    os.makedirs(os.path.dirname(LOCK_PATH), mode=0o755, exist_ok=True)
    lock = os.open(LOCK_PATH, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    netns_fd = -1
    host_link = ""
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)                 # pool allocation and table creation, machine-wide
        nftables.ensure_table(resolvers)
        block = _free_block(network)
        host_address, sandbox_address = str(block[1]), str(block[2])
        _counter += 1
        host_link = f"{LINK_PREFIX}{os.getpid():x}x{_counter:x}"[:15]
        # A namespace made by unsharing our own and coming straight back: no process needed.
        # A netlink socket made while inside stays bound to it.
        own = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        try:
            namespaces.unshare(namespaces.CLONE_NEWNET)
            try:
                netns_fd = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
                inside = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC, 0)
                if allowed_hosts or via_proxy:            # nft runs here, so it loads into the new namespace
                    from sandboxd.policy.sandbox import parse_allowed_host
                    nftables.load_here(nftables.egress_ruleset(resolvers, [parse_allowed_host(h) for h in allowed_hosts],
                                                               via_proxy=via_proxy),
                                       "load egress allowlist")
            finally:
                namespaces.setns(own, namespaces.CLONE_NEWNET)
        finally:
            os.close(own)
        _configure(host_link, netns_fd, inside, host_address, sandbox_address, block.prefixlen)
    except BaseException as exc:
        if host_link:
            _delete_link(host_link, missing_ok=True)
        if netns_fd >= 0:
            os.close(netns_fd)
        if isinstance(exc, OSError):
            raise SetupError("isolated network", exc.errno or 0, detail=str(exc)) from None
        raise
    finally:
        os.close(lock)
    return IsolatedNetwork(netns_fd, host_link, host_address, sandbox_address, resolvers)


def _configure(host_link: str, netns_fd: int, inside: "Any", host_address: str, sandbox_address: str,
               prefix: int) -> None:
    from pyroute2 import IPRoute  # 0.3 s to import: only here, for isolated networks

    with IPRoute() as host:
        host.link("add", ifname=host_link, kind="veth", peer={"ifname": SANDBOX_LINK, "net_ns_fd": netns_fd})
        index = host.link_lookup(ifname=host_link)[0]
        host.addr("add", index=index, address=host_address, prefixlen=prefix)
        host.link("set", index=index, state="up")
        uplinks = {route.get_attr("RTA_OIF") for route in host.get_default_routes(family=2)}
        uplink_names = [host.get_links(i)[0].get_attr("IFLA_IFNAME") for i in uplinks if i]
    for name in [host_link, *uplink_names]:
        _enable_forwarding(name)
    ipr = IPRoute(use_socket=inside)
    try:
        ipr.link("set", index=ipr.link_lookup(ifname="lo")[0], state="up")
        eth = ipr.link_lookup(ifname=SANDBOX_LINK)[0]
        ipr.addr("add", index=eth, address=sandbox_address, prefixlen=prefix)
        ipr.link("set", index=eth, state="up")
        ipr.route("add", dst="0.0.0.0/0", gateway=host_address)
    finally:
        ipr.close()
        inside.close()


def _free_block(network: "Any") -> "Any":
    """The first /30 of ``network`` no sandbox link on this host uses."""
    from pyroute2 import IPRoute

    with IPRoute() as host:
        used = {address.get_attr("IFA_ADDRESS") for address in host.get_addr(family=2)}
    for block in network.subnets(new_prefix=30):
        if str(block[1]) not in used:
            return block
    raise SetupError("isolated network", 28, detail=f"the address pool {network} is exhausted",
                     hint="close sessions, or give a larger pool")


def _enable_forwarding(link: str) -> None:
    path = f"/proc/sys/net/ipv4/conf/{link}/forwarding"
    with open(path, "r+") as f:
        if f.read().strip() != "1":
            f.seek(0)
            f.write("1")


def _delete_link(name: str, *, missing_ok: bool = True) -> None:
    from pyroute2 import IPRoute
    from pyroute2.netlink.exceptions import NetlinkError

    with IPRoute() as host:
        try:
            host.link("del", ifname=name)
        except NetlinkError as exc:
            if not (missing_ok and exc.code == 19):      # ENODEV: gone already
                raise


def sweep_stale() -> int:
    """Delete sandbox links whose creating process is dead (a killed daemon or `sandboxd run`),
    and the proxy access of sandboxes that are gone. Returns how many links. Cheap when there
    is nothing to do: pyroute2 is imported only when some sandbox link or proxy entry exists."""
    import os

    from sandboxd.kernel import nftables

    names = [name for name in os.listdir("/sys/class/net") if name.startswith(LINK_PREFIX)]
    proxied = nftables.proxied_addresses()
    if not names and not proxied:
        return 0
    from pyroute2 import IPRoute

    removed = 0
    for name in names:
        if not name or not name.startswith(LINK_PREFIX) or "x" not in name[len(LINK_PREFIX):]:
            continue
        owner = name[len(LINK_PREFIX):].split("x", 1)[0]
        try:
            pid = int(owner, 16)
        except ValueError:
            continue
        if not os.path.exists(f"/proc/{pid}"):
            _delete_link(name)
            removed += 1
    # Proxy access of sandboxes whose link is gone (their creator was killed before closing them):
    # given by sandboxd versions whose proxy listened on the host side of the link.
    if proxied:
        with IPRoute() as host:
            live = {address.get_attr("IFA_ADDRESS") for address in host.get_addr(family=2)}
        for address in proxied:
            host_side = address.rsplit(".", 1)[0] + "." + str(int(address.rsplit(".", 1)[1]) - 1)
            if host_side not in live:
                nftables.allow_proxy(address, False)
    return removed


def host_resolvers() -> "list[str]":
    """The host's IPv4 resolvers a sandbox can reach (not loopback): from /etc/resolv.conf, or
    systemd-resolved's upstream list when the host points at its local stub."""
    for path in ("/etc/resolv.conf", "/run/systemd/resolve/resolv.conf"):
        try:
            with open(path) as f:
                servers = [line.split()[1] for line in f if line.startswith("nameserver") and len(line.split()) > 1]
        except OSError:
            continue
        usable = [s for s in servers if "." in s and not s.startswith("127.")]
        if usable:
            return usable
    return []
