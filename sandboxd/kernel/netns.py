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

The host's network may be shared by several daemons (a container with the host's
network and a PID namespace of its own, a second checkout's daemon) and by
older sandboxd. So nothing here is named after a pid: a host link's name is
random (``sbx`` + 12 hex digits), its alias names its creator as cgroups do
(kernel.creators: pid, start time, PID namespace), the sweep takes only links
whose creator is provably dead, and a link's block of the address pool is
claimed in the kernel by its route, which no second creator can add.
"""

from __future__ import annotations

import _socket  # the C module: socket.py's enums cost more to import than a launch
import errno
import fcntl
import struct

from sandboxd.errors import SetupError
from sandboxd.kernel._libc import from_oserror

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from sandboxd.kernel.creators import Creator

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
OWNER_ALIAS = "sandboxd "             # a sandbox link's alias: this, then its creator (kernel.creators)
SANDBOX_LINK = "eth0"
LOCK_PATH = "/run/sandboxd/network.lock"
NAME_TRIES = 8                        # new names for a link whose name the host has (EEXIST): 2^-48 each
IFA_F_NOPREFIXROUTE = 0x200           # <linux/if_addr.h>: the block's route is ours (_claim_block)
RT_SCOPE_LINK = 253                   # <linux/rtnetlink.h>: the scope and origin of the route the kernel
RTPROT_KERNEL = 2                     # would add for the address itself


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
        self.transparent_listener: "Any" = None     # and its transparent capture's (network.transparent)

    def resolv_conf(self) -> str:
        """The sandbox's /etc/resolv.conf."""
        if not self.resolvers:
            return "# sandboxd: no DNS resolver reachable from the sandbox (pass --dns)\n"
        return "".join(f"nameserver {ip}\n" for ip in self.resolvers) + "options edns0\n"

    def close(self) -> None:
        """Delete the host side of the link (the sandbox side goes with it, and the block's route and
        address with them) and let go of the namespace (it ends with its last process). Safe to call
        twice."""
        if self.netns_fd >= 0:
            import os
            os.close(self.netns_fd)
            self.netns_fd = -1
        for listener in (self.proxy_listener, self.transparent_listener):
            if listener is not None:
                listener.close()
        self.proxy_listener = self.transparent_listener = None
        if self.host_link:
            _delete_link(self.host_link)
            self.host_link = ""


def create_isolated(*, pool: str = DEFAULT_POOL, resolvers: "list[str] | None" = None,
                    allowed_hosts: "tuple[str, ...]" = (), via_proxy: bool = False) -> IsolatedNetwork:
    """A new network namespace (not entered: the caller's stays as it was) with loopback and
    ``eth0`` up, an address from ``pool``, a default route out through the host, the host's
    nftables table in place and IPv4 forwarding on for the link and the host's uplink. With
    ``allowed_hosts`` ("CIDR[:PORTS]") or ``via_proxy`` (allowed domains: the egress proxy on the
    namespace's own loopback, network.egress_proxy), an egress allowlist inside the namespace too.

    The host side's name is random (``new_link_name``) and its alias names this process as its
    creator (kernel.creators), so daemons sharing the host's network never collide on a name nor
    sweep each other's links (``sweep_stale``); its block of the pool is claimed in the kernel
    (``_claim_block``), so they never share a block either."""
    import fcntl
    import ipaddress
    import os
    import socket

    from pyroute2 import IPRoute  # 0.3 s to import: only here, for isolated networks

    from sandboxd.kernel import namespaces, nftables

    resolvers = list(resolvers) if resolvers is not None else host_resolvers()
    network = ipaddress.ip_network(pool)
    os.makedirs(os.path.dirname(LOCK_PATH), mode=0o755, exist_ok=True)
    lock = os.open(LOCK_PATH, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    netns_fd = -1
    host_link = ""
    try:
        # The table's creation, and the pool among the creators that share this file (one mount
        # namespace's): the kernel's claim (_claim_block) holds between those that do not.
        fcntl.flock(lock, fcntl.LOCK_EX)
        nftables.ensure_table(resolvers)
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
        inner = IPRoute(use_socket=inside)
        try:
            with IPRoute() as host:
                host_link, index = _link_to_host(host, netns_fd)
                block = _configure(host, host_link, index, inner, network)
        finally:
            inner.close()
            inside.close()
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
    return IsolatedNetwork(netns_fd, host_link, str(block[1]), str(block[2]), resolvers)


def new_link_name() -> str:
    """``sbx`` and 12 random hex digits: the 15 bytes IFNAMSIZ leaves. Random, not after the pid: a
    daemon in another PID namespace on the same host network may have a fork server of the same pid.
    And without an ``x``: older sandboxd read ``sbx<pid, hex>x<n>`` as a pid in their sweep."""
    import os

    return f"{LINK_PREFIX}{os.urandom(6).hex()}"


def _link_to_host(host: "Any", netns_fd: int) -> tuple[str, int]:
    """Make the veth pair, ``eth0`` in the namespace ``netns_fd`` and the host end under a new name
    (another if the host has that one: EEXIST), and name this process in the host end's alias as
    its creator. A sweep leaves a link without an alias alone, and none is left without one: if
    this process dies before the alias is set, the namespace (held by nothing but its descriptors
    then) ends and takes the pair with it. Returns the host end's name and index."""
    from pyroute2.netlink.exceptions import NetlinkError

    from sandboxd.kernel.creators import creator_tag

    for attempt in range(NAME_TRIES):
        name = new_link_name()
        try:
            host.link("add", ifname=name, kind="veth", peer={"ifname": SANDBOX_LINK, "net_ns_fd": netns_fd})
            break
        except NetlinkError as exc:
            if exc.code != errno.EEXIST or attempt == NAME_TRIES - 1:
                raise
    index: int = host.link_lookup(ifname=name)[0]
    host.link("set", index=index, ifalias=OWNER_ALIAS + creator_tag())
    return name, index


def _configure(host: "Any", host_link: str, index: int, inner: "Any", network: "Any") -> "Any":
    """Claim a block of ``network`` for the host side, address both sides, bring them up and route
    the sandbox through the host (``host``, ``inner``: netlink sockets of the host and of the new
    namespace). Returns the block."""
    host.link("set", index=index, state="up")             # a route's link must be up (ENETDOWN)
    block = _claim_block(host, index, network)
    host.addr("add", index=index, address=str(block[1]), prefixlen=block.prefixlen, IFA_FLAGS=IFA_F_NOPREFIXROUTE)
    uplinks = {route.get_attr("RTA_OIF") for route in host.get_default_routes(family=2)}
    uplink_names = [host.get_links(i)[0].get_attr("IFLA_IFNAME") for i in uplinks if i]
    for name in [host_link, *uplink_names]:
        _enable_forwarding(name)
    inner.link("set", index=inner.link_lookup(ifname="lo")[0], state="up")
    eth = inner.link_lookup(ifname=SANDBOX_LINK)[0]
    inner.addr("add", index=eth, address=str(block[2]), prefixlen=block.prefixlen)
    inner.link("set", index=eth, state="up")
    inner.route("add", dst="0.0.0.0/0", gateway=str(block[1]))
    return block


def _claim_block(host: "Any", index: int, network: "Any") -> "Any":
    """The lowest /30 of ``network`` that is free, claimed for the link ``index`` by its route: the
    one the kernel would add for the link's address, added here first and exclusively
    (NLM_F_EXCL). The kernel refuses a second route to the same /30 whoever asks (EEXIST), and an
    older sandboxd's link has that route through its address, so creators that do not share
    LOCK_PATH (daemons in containers with the host's network) never get the same block. Blocks
    with an address of the host's are not tried (an older sandboxd's links, the host's own)."""
    from pyroute2.netlink.exceptions import NetlinkError

    used = {address.get_attr("IFA_ADDRESS") for address in host.get_addr(family=2)}
    for block in network.subnets(new_prefix=30):
        if str(block[1]) in used or str(block[2]) in used:
            continue
        try:
            host.route("add", dst=str(block.network_address), dst_len=block.prefixlen, oif=index,
                       scope=RT_SCOPE_LINK, proto=RTPROT_KERNEL)
        except NetlinkError as exc:
            if exc.code == errno.EEXIST:                  # another creator's, or something else's
                continue
            raise
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


def link_creator(name: str) -> "Creator | None":
    """Who made the sandbox link ``name``: the creator its alias names (``_link_to_host``); None for
    a link that names none: an older sandboxd's ``sbx<pid, hex>x<n>``, which a pid alone cannot
    judge, or one of ours an instant old, whose alias is not set yet."""
    from sandboxd.kernel.creators import parse_creator

    try:
        with open(f"/sys/class/net/{name}/ifalias") as f:
            alias = f.read().strip()
    except OSError:                                       # gone meanwhile
        return None
    return parse_creator(alias[len(OWNER_ALIAS):]) if alias.startswith(OWNER_ALIAS) else None


def sweep_stale() -> int:
    """Delete the sandbox links whose creator is provably dead (kernel.creators: made in our PID
    namespace by a process gone since: a killed daemon's fork server, a killed `sandboxd run`), and
    the proxy access of sandboxes that are gone. Returns how many links. Another live daemon's links
    stay whatever its pids are here (another PID namespace), and so do links that name no creator
    (an older sandboxd's, which its own sweep judges). Cheap when there is nothing to do: pyroute2 is
    imported only when there is something to delete."""
    import os

    from sandboxd.kernel import nftables
    from sandboxd.kernel.creators import DeadCreators

    names = [name for name in os.listdir("/sys/class/net") if name.startswith(LINK_PREFIX)]
    proxied = nftables.proxied_addresses()
    if not names and not proxied:
        return 0
    dead = DeadCreators()
    removed = 0
    for name in names:
        creator = link_creator(name)
        if creator is not None and creator in dead:
            _delete_link(name)                            # its route, address and forwarding go with it
            removed += 1
    # Proxy access of sandboxes whose link is gone (their creator was killed before closing them):
    # given by sandboxd versions whose proxy listened on the host side of the link.
    if proxied:
        from pyroute2 import IPRoute

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
