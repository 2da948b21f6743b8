"""nftables: NAT and the egress filter of isolated networks, in one table of the host.

One table, ``inet sandboxd``, serves every isolated sandbox on the machine (the
daemon's sessions and one-shot runs alike): its rules match the sandbox veth
interfaces by name (``sbx*``), so nothing is added or removed per sandbox and a
sandbox gone leaves no rule behind. It is created once, when missing, and never
flushed while sandboxes may depend on it. What it enforces, for traffic from a
sandbox:

- to the host itself (any of its addresses, its loopback services, the daemon's
  listeners): nothing but replies to connections the host opened;
- to another sandbox: nothing;
- to link-local (169.254.0.0/16, the cloud metadata service), loopback, and the
  private and reserved ranges (10/8, 172.16/12, 192.168/16, 100.64/10, ...):
  nothing, except DNS (port 53) to the configured resolvers;
- IPv6: nothing (sandboxes get IPv4 only);
- anything else: allowed, masqueraded out of the host's route to it.

Into a sandbox, only replies to connections it opened are forwarded. The ``nft``
command (Debian package nftables) does the work; its ruleset text is here.
"""

from __future__ import annotations

import subprocess

from sandboxd.defaults import PROXY_PORT  # the egress proxy's port (the ``proxied`` set: see ruleset)
from sandboxd.defaults import TRANSPARENT_PORT
from sandboxd.errors import SetupError

TABLE = "sandboxd"
INTERFACE_PATTERN = "sbx*"
# The SO_MARK of the egress proxy's upstream sockets, made inside the sandbox's namespace: the
# sandbox's own egress table lets them out. Setting a mark needs CAP_NET_ADMIN, which no sandboxed
# process holds, so only the root proxy can use this way out (and the host's filter still applies).
PROXY_MARK = 0x5BD0_0001
BLOCKED_RANGES = ("0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16", "172.16.0.0/12",
                  "192.0.0.0/24", "192.168.0.0/16", "198.18.0.0/15", "224.0.0.0/4", "240.0.0.0/4")


# Bumped whenever the ruleset changes: a table without this comment is replaced.
RULESET_VERSION = "sandboxd ruleset 3"


def ruleset() -> str:
    """The one table. It depends on no address pool: sandboxes are known by their links' names,
    so daemons and one-shot runs with different pools share it.

    The ``proxied`` set (sandboxes that may reach port PROXY_PORT of the host) is only ever emptied
    now: the egress proxy listens on each sandbox's own loopback (network.egress_proxy.PROXY_ADDRESS),
    and no sandbox may reach the host's port 3128, which any local user can bind. It stays in the
    table so that this ruleset's version, shared with older sandboxd on the same machine (whose
    proxies listen on the host side of the link), does not change under them."""
    sbx = f'"{INTERFACE_PATTERN}"'
    return f"""
table inet {TABLE} {{
  comment "{RULESET_VERSION}"
  set resolvers {{ type ipv4_addr; }}
  set proxied {{ type ipv4_addr; }}
  chain to_host {{
    type filter hook input priority -10; policy accept;
    iifname {sbx} ct state established,related accept
    iifname {sbx} ip saddr @proxied tcp dport {PROXY_PORT} accept
    iifname {sbx} drop
  }}
  chain through_host {{
    type filter hook forward priority -10; policy accept;
    iifname {sbx} oifname {sbx} drop
    oifname {sbx} ct state established,related accept
    oifname {sbx} drop
    iifname {sbx} meta nfproto ipv6 drop
    iifname {sbx} ip daddr @resolvers meta l4proto {{ udp, tcp }} th dport 53 accept
    iifname {sbx} ip daddr {{ {", ".join(BLOCKED_RANGES)} }} drop
    iifname {sbx} accept
  }}
  chain out_of_host {{
    type nat hook postrouting priority 100; policy accept;
    iifname {sbx} oifname != {sbx} masquerade
  }}
}}
"""


def _nft(script: str, step: str) -> subprocess.CompletedProcess[str]:
    try:
        result = subprocess.run(["nft", "-f", "-"], input=script, capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        raise SetupError(step, 2, "nft", hint="isolated networks need nftables: apt-get install nftables "
                         "(or use --network=host, or no network)") from None
    if result.returncode != 0:
        raise SetupError(step, 0, detail=result.stderr.strip()[:500],
                         hint="the kernel needs nf_tables with NAT (CONFIG_NF_TABLES, CONFIG_NFT_NAT)")
    return result


def _listing() -> str | None:
    """The table as nft's text, or None. Text, not ``nft -j``: the version is the table's comment,
    and nft 1.0.6 (Debian 12) leaves table comments out of its JSON."""
    try:
        result = subprocess.run(["nft", "list", "table", "inet", TABLE], capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        return None
    return result.stdout if result.returncode == 0 else None


def ensure_table(resolvers: "list[str] | tuple[str, ...]") -> None:
    """Create the table if it is missing or from an older sandboxd (callers hold the network
    lock; the replacement is one nft transaction, so no packet sees the table half-made), and
    make sure ``resolvers`` are in its resolver set."""
    current = _listing()
    if current is None or RULESET_VERSION not in current:
        replace = f"add table inet {TABLE}\ndelete table inet {TABLE}\n" if current is not None else ""
        _nft(replace + ruleset(), "create nftables table")
    if resolvers:
        _nft(f"add element inet {TABLE} resolvers {{ {', '.join(resolvers)} }}\n", "allow resolvers")


def allow_proxy(sandbox_address: str, allowed: bool) -> None:
    """Let one sandbox reach the host's egress proxy port on its link, or stop. Only sandboxes in
    this set may, and this version adds none (``ruleset``): the sweep removes what older ones
    added for sandboxes that are gone."""
    verb = "add" if allowed else "delete"
    try:
        _nft(f"{verb} element inet {TABLE} proxied {{ {sandbox_address} }}\n", "egress proxy access")
    except SetupError:
        if allowed:
            raise                                          # deleting what is gone already is fine


def proxied_addresses() -> "list[str]":
    """The sandboxes allowed to reach the proxy port ([] without the table, or without nft). Read as
    nft's JSON (``nft -j``), not its text: the text's layout changes between releases."""
    import json

    try:
        listing = subprocess.run(["nft", "-j", "list", "set", "inet", TABLE, "proxied"], capture_output=True,
                                 text=True, timeout=30)
    except FileNotFoundError:
        return []
    if listing.returncode != 0:
        return []                                         # no table (yet)
    addresses = []
    for entry in json.loads(listing.stdout).get("nftables", []):
        for element in entry.get("set", {}).get("elem", []):
            # A plain element is its value; one with a timeout or comment is {"elem": {"val": ...}}.
            value = element.get("elem", {}).get("val") if isinstance(element, dict) else element
            if isinstance(value, str):
                addresses.append(value)
    return addresses


# The ports a proxied sandbox's connections are captured on (network.transparent): HTTP and HTTPS.
CAPTURED_PORTS = (80, 443)


def egress_ruleset(resolvers: "list[str] | tuple[str, ...]",
                   allowed: "list[tuple[str, tuple[tuple[int, int], ...]]]", *, via_proxy: bool = False) -> str:
    """The allowlist of one isolated network, loaded inside its namespace (the sandbox holds no
    capability to change it): loopback (where the egress proxy listens, network.egress_proxy),
    replies, DNS to the resolvers, the allowed destinations, and ``via_proxy`` the proxy's own
    upstream sockets (``PROXY_MARK``); everything else is rejected at once (a program fails fast
    instead of timing out).

    ``via_proxy`` also captures: TCP to CAPTURED_PORTS of any address outside the namespace (but
    the ``allowed`` ones, reached directly) is redirected to 127.0.0.1:TRANSPARENT_PORT, where the
    egress proxy judges it by the name it carries (network.transparent), so a program that ignores
    the proxy variables still gets through to an allowed name. The proxy's own sockets (its mark)
    are not redirected. The filter lets the redirected connection in by its new destination: an
    output hook's interface is the one routed before the redirect."""
    lines = ['oifname "lo" accept', "ct state established,related accept"]
    if via_proxy:
        lines.append(f"ip daddr 127.0.0.1 tcp dport {TRANSPARENT_PORT} ct status dnat accept")
    if resolvers:
        lines.append(f"ip daddr {{ {', '.join(resolvers)} }} meta l4proto {{ udp, tcp }} th dport 53 accept")
    if via_proxy:                                        # the egress proxy: the way out for allowed domains
        lines.append(f"meta mark {PROXY_MARK:#x} meta l4proto tcp accept")  # the proxy's own upstream connections
    for cidr, ports in allowed:
        if ports:
            spec = ", ".join(str(low) if low == high else f"{low}-{high}" for low, high in ports)
            lines.append(f"ip daddr {cidr} meta l4proto {{ tcp, udp }} th dport {{ {spec} }} accept")
        else:
            lines.append(f"ip daddr {cidr} accept")
    lines.append("reject with icmpx type admin-prohibited")
    body = "\n    ".join(lines)
    capture = ""
    if via_proxy:
        direct = [f"ip daddr {cidr} return" for cidr, _ in allowed]
        rules = ['oifname "lo" return', f"meta mark {PROXY_MARK:#x} return", *direct,
                 f"meta nfproto ipv4 tcp dport {{ {', '.join(map(str, CAPTURED_PORTS))} }} "
                 f"redirect to :{TRANSPARENT_PORT}"]
        capture = """
  chain capture {
    type nat hook output priority -100; policy accept;
    """ + "\n    ".join(rules) + """
  }"""
    return f"""
table inet {TABLE}_egress {{
  chain out {{
    type filter hook output priority 0; policy drop;
    {body}
  }}{capture}
}}
"""


def load_here(script: str, step: str) -> None:
    """Load a ruleset into the network namespace the caller is in now."""
    _nft(script, step)
