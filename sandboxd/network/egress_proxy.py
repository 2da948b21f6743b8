"""The domain allowlist: a small filtering proxy (HTTP CONNECT, plain HTTP, SOCKS5) between an
isolated sandbox and the internet.

With ``allowed_domains`` the sandbox's namespace lets out nothing but DNS and TCP to this proxy
(kernel.nftables.egress_ruleset), so a program that ignores the proxy variables gets nothing. The
proxy listens on the sandbox's own loopback, ``PROXY_ADDRESS``:defaults.PROXY_PORT (127.0.0.1:3128 inside the
sandbox's network namespace, bound before the sandbox exists; ``listen``), and for each request:

- takes the destination *name* (CONNECT host:port, an absolute http:// URI, or a SOCKS5 domain
  address; a bare IP address is refused: there is no name to check),
- checks it against the allowlist (``pypi.org`` exactly, ``*.pypi.org`` any subdomain): only an ASCII
  host name can match, the rule the policy's names follow (policy.domains), and, rootless, the port
  against ROOTLESS_PORTS,
- resolves it itself (network.dns: the configured resolvers, else the host's) and refuses at once, with a
  reason, an address in a range no sandbox may reach (``REFUSED_RANGES``),
- connects from INSIDE the sandbox's network namespace, with a socket carrying ``PROXY_MARK``
  (the one thing besides DNS and the proxy that the sandbox's own egress table lets out, and that
  the sandbox cannot set: SO_MARK needs CAP_NET_ADMIN). So the host's kernel filter judges the
  proxy's connection exactly as the sandbox's own: the host's addresses, its loopback, private and
  reserved ranges and the metadata service stay out of reach whatever a name resolves to, and the
  early range check is only there to say why.
- or refuses, and reports the refusal (``on_denied``: an event in the daemon, a line on stderr
  for ``sandboxd run``; ``on_event``: the same as a typed ProxyEvent).

What it enforces is a ``NetworkRules`` (policy.network), replaced by ``update`` for the next
request (with the credentials, when given; open connections the change takes away are cut). With
an ``upstream`` (network.upstream.UpstreamRoute) every allowed connection goes on as a CONNECT
through the corporate proxy, after the same checks. Cloud metadata names and addresses (policy.network.metadata_name/metadata_address) are
refused whatever the rules or ``allowed_ranges`` say. A CONNECT to a host the rules intercept
(endpoint rules, or a credential for that host and port) is handed to interception.Intercepted,
whose request hook judges every request by the endpoint rules in force when it arrives. Plain
``http://`` requests are all read too, each judged the same way (interception.plain: one
connection, one host; credentials never apply in clear).

With ``unlisted = ask`` and an ``ask`` (network.questions), a connection to an unlisted host
(after every other check: metadata and refused ranges are never asked) and a request no endpoint
rule lets through are held, parked on the loop with no thread and nothing read, and a Question
(host, port, method, path, the advisor's proposal; never headers or body) is asked off the loop.
An allow connects the held connection or passes the held request; a deny refuses it (403 naming
the rule set, or a SOCKS refusal); a client that leaves meanwhile withdraws its question.

Every proxy of a process is served by the process's one relay loop (tcp_relay): no thread per
connection. A proxy serves at most ``cap.limit`` connections at once (the daemon's
``quotas.proxy_connections_per_session``); more are refused at once (a 503, or a SOCKS failure,
when the client has already spoken) and counted in ``cap.refused``; of them, at most
``intercepted_cap.limit`` intercepted (``quotas.intercepted_connections_per_session``: each holds two
TLS ends and two HTTP parsers), refused the same way past it. A client has
``REQUEST_SECONDS`` to send its request; a relayed connection idle for tcp_relay.IDLE_SECONDS is
closed.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
import logging
import time
from concurrent.futures import Future
from typing import Callable

from sandboxd._record import Record
from sandboxd.defaults import PROXY_PORT
from sandboxd.kernel.nftables import BLOCKED_RANGES, PROXY_MARK
from sandboxd.network.dns import resolve
from sandboxd.policy.domains import domain_matches, host_name
from sandboxd.network.questions import Answer, Ask, Question, Withdraw
from sandboxd.policy.network import (NetworkRules, Unlisted, endpoint_allowed, match_cost, metadata_address,
                                     metadata_name,
                                     normalize_path, why_not_normal)
from sandboxd.printable import printable
from sandboxd.network.event_loop import LOOKUP, READ
from sandboxd.network.tcp_relay import (ConnectionCap, Connecting, Relay, RelayLoop, TcpService, listen_tcp,
                                           refuse, socket_in_namespace)

TYPE_CHECKING = False
if TYPE_CHECKING:                        # the interception room imports h11 and ssl: only when used
    from sandboxd.network.credentials import CredentialSet
    from sandboxd.network.interception.http1 import Pending, Refusal, Report
    from sandboxd.network.interception.intercepted import Intercepted, Interceptor
    from sandboxd.network.interception.plain import PlainMediated
    from sandboxd.network.upstream import UpstreamConnect, UpstreamRoute

DEFAULT_CONNECTIONS = 256
DEFAULT_INTERCEPTED = 64           # quotas.intercepted_connections_per_session's default
log = logging.getLogger("sandboxd")

REQUEST_SECONDS = 30.0             # from accepting a connection to a complete request
MAX_REQUEST_HEAD = 65536
# The host filter's ranges, and the documentation and reserved ones no real destination is in:
# the early refusal (with a reason) of what the kernel would refuse anyway, or should never see.
# 198.51.100.0/24 (TEST-NET-2) is left out on purpose: the test suite's stand-in internet lives there.
REFUSED_RANGES = BLOCKED_RANGES + ("192.0.2.0/24", "203.0.113.0/24", "192.88.99.0/24", "255.255.255.255/32")
_REFUSED = [ipaddress.ip_network(r) for r in REFUSED_RANGES]
# The ports a rootless proxy relays an allowed name to (network.loopback_proxy): HTTP and HTTPS
# and their usual alternates, what package registries and web APIs listen on. With no kernel
# filter behind it, an allowed name is not an allowed host: its ssh, mail or database port stays
# shut (docs/rootless.md names these).
ROOTLESS_PORTS = (80, 443, 8080, 8443)

# Where a sandbox finds its proxy: its own loopback. Not the host side of its link: an address of the
# host's namespace, where any local user may bind port 3128 (or 0.0.0.0:3128, or any address with
# IP_FREEBIND) first, and so refuse every allowed-domains sandbox its proxy or, once the sandbox
# could reach that port, receive its traffic. Nobody but root and the sandbox enters its namespace.
PROXY_ADDRESS = "127.0.0.1"

HTTP_FORBIDDEN = b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
HTTP_BAD_REQUEST = b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
HTTP_BAD_GATEWAY = b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
HTTP_BUSY = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
SOCKS_NOT_ALLOWED = b"\x05\x02\x00\x01" + b"\0" * 6     # connection not allowed by ruleset
SOCKS_FAILED = b"\x05\x01\x00\x01" + b"\0" * 6          # general failure
SOCKS_REFUSED = b"\x05\x05\x00\x01" + b"\0" * 6         # connection refused
SOCKS_OK = b"\x05\x00\x00\x01" + b"\0" * 6


def allowed_name(name: str, patterns: "tuple[str, ...] | list[str]") -> str | None:
    """A request's destination ``name`` as a host name (policy.domains.host_name: lower case,
    without a final dot) when one of ``patterns`` (a policy's allowed_domains) allows it; else
    None. A name that is no host name, one not in ASCII included, is never allowed."""
    host = host_name(name)
    if host is None:
        return None
    return host if any(domain_matches(host, pattern) for pattern in patterns) else None


MAX_RULES_SHOWN = 20                # endpoint rules quoted in a refusal's body
# Segment comparisons (match_cost) an endpoint check may take on the relay loop; a costlier one is
# judged on a worker (loop.offload), its request held meanwhile.
MAX_LOOP_COMPARISONS = 4096
MAX_RULED_TARGET = 8192            # bytes of a request target to a host with endpoint rules (414 past)
MAX_REFUSAL_BODY = 4096             # bytes of a refusal's body, whatever it quotes
MAX_UNRESOLVED_NOTED = 256          # names logged as resolved only upstream, per proxy


class ProxyEvent(Record):
    """A refusal as the proxy reports it. ``kind``: domain, endpoint, metadata, range, address,
    port, protocol, cap, upstream_tls, upstream, timeout (design §4.5), policy (an open connection
    cut by ``EgressProxy.update``); ``detail`` is printable."""

    kind: str
    host: str
    port: int
    method: str = ""
    path: str = ""
    detail: str = ""


class _Destination(Record):
    """Where an open connection relays to (host, port as matched), its kind (tunnel, intercepted,
    plain), and whether a person allowed it once (kept apart from the kind: only the allowlist
    cut spares such a connection, never the cuts for reading its requests or its credentials)."""

    host: str
    port: int
    kind: str
    allowed_once: bool = False


def refused_range(address: str, allowed_ranges: "tuple[str, ...]" = ()) -> bool:
    """Is ``address`` in a range the proxy refuses before trying (REFUSED_RANGES, less the
    ``allowed_ranges`` root named; a metadata address always)?"""
    return metadata_address(address) or blocked_range(address, allowed_ranges) is not None


def blocked_range(address: str, allowed_ranges: "tuple[str, ...]" = ()) -> str | None:
    """The refused range (of REFUSED_RANGES) ``address`` is in, unless root named a range holding
    it in ``allowed_ranges`` (network.allowed_ranges); None when it is in none."""
    ip = ipaddress.ip_address(address)
    if any(ip in ipaddress.ip_network(r) for r in allowed_ranges):
        return None
    return next((str(network) for network in _REFUSED if ip in network), None)


def ambiguous_target(target: str) -> str:
    """Why a request target to a host with endpoint rules is refused before matching ("" when it
    is not): what normalize_path refuses, and what servers and frameworks read as another path or
    method than the rules would match: path parameters (``;``), empty segments (``//``), a
    ``_method=`` override in the query."""
    if normalize_path(target) is None:
        return f"an ambiguous path ({why_not_normal(target)})"
    path, _, query = target.partition("?")
    if ";" in path:
        return "a ';' in the path (path parameters)"
    if "//" in path:
        return "an empty segment ('//') in the path"
    if "_method=" in query.lower() or "_method%3d" in query.lower():
        return "a '_method=' method override in the query"
    return ""


def endpoint_refusal(host: str, method: str, target: str, rules: NetworkRules) -> str:
    """The 403's body for a request no endpoint rule of ``host`` allows (design §5.4)."""
    ruled = rules.ruled(host)
    lines = [f"sandboxd: {printable(method)} {printable(target.partition('?')[0])} is not among the "
             f"endpoint rules for {host}:"]
    lines += [f"  {','.join(rule.methods)}:{rule.path}" for rule in ruled[:MAX_RULES_SHOWN]]
    if len(ruled) > MAX_RULES_SHOWN:
        lines.append(f"  ... and {len(ruled) - MAX_RULES_SHOWN} more")
    return "\n".join(lines)


def _listed(domains: "tuple[str, ...]") -> str:
    """The allowed domains, as a refusal names them (at most MAX_RULES_SHOWN)."""
    if not domains:
        return "none are allowed"
    more = f", ... and {len(domains) - MAX_RULES_SHOWN} more" if len(domains) > MAX_RULES_SHOWN else ""
    return "allowed: " + ", ".join(domains[:MAX_RULES_SHOWN]) + more


def http_refusal(status: int, reason: str, body: str) -> bytes:
    """A complete HTTP response that closes the connection: ``body`` (printable text), cut to
    MAX_REFUSAL_BODY bytes."""
    payload = (body.encode("utf-8")[:MAX_REFUSAL_BODY - 1].decode("utf-8", "ignore") + "\n").encode("utf-8")
    return (f"HTTP/1.1 {status} {reason}\r\nContent-Type: text/plain; charset=utf-8\r\n"
            f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n").encode("ascii") + payload


def host_owns(address: str) -> bool:
    """Is ``address`` one of this host's own (one a socket here can bind)? A rootless proxy has no
    kernel filter between it and the host's services, which may listen on any of the host's
    addresses, public ones too: it refuses them itself. Where every address binds
    (ip_nonlocal_bind), every one is refused: closed, not open."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as probe:
        try:
            probe.bind((address, 0))
        except OSError:
            return False
    return True


def proxy_environment() -> dict[str, str]:
    """The variables that point a sandbox's programs at its proxy (PROXY_ADDRESS). ALL_PROXY names
    the HTTP proxy too, not ``socks5h://``: httpx (and others) take ALL_PROXY for every scheme and,
    without an optional SOCKS package, fail every request on a socks URL. The proxy still speaks
    SOCKS5 on the same port to a program told to use it."""
    url = f"http://{PROXY_ADDRESS}:{PROXY_PORT}"
    env = {"NO_PROXY": "localhost,127.0.0.1"}
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        env[name] = url
    return {**env, **{key.lower(): value for key, value in env.items()}}


def _same_credentials(old: "CredentialSet | None", new: "CredentialSet | None", host: str, port: int) -> bool:
    """Whether ``old`` and ``new`` hold the same credentials (spec, phantom, secret) for
    ``host``:``port``."""
    before = old.for_upstream(host, port) if old is not None else ()
    after = new.for_upstream(host, port) if new is not None else ()
    return len(before) == len(after) and all(a.same(b) for a, b in zip(before, after, strict=True))


class EgressProxy(TcpService):
    def __init__(self, listener: socket.socket, rules: NetworkRules, *,
                 netns_fd: int, resolvers: "list[str] | tuple[str, ...]" = (),
                 on_denied: "Callable[[str, str], None]" = lambda destination, why: None,
                 on_event: "Callable[[ProxyEvent], None] | None" = None,
                 interceptor: "Interceptor | None" = None, credentials: "CredentialSet | None" = None,
                 allowed_ranges: "tuple[str, ...]" = (), upstream: "UpstreamRoute | None" = None,
                 ask: Ask | None = None,
                 connections: int = DEFAULT_CONNECTIONS, intercepted_connections: int = DEFAULT_INTERCEPTED,
                 loop: RelayLoop | None = None) -> None:
        """``listener``: bound and listening on the sandbox's loopback (see ``listen``); only
        clients from PROXY_ADDRESS are served, once ``start`` is called; upstream connections are made in the
        network namespace ``netns_fd`` (the sandbox's; the proxy keeps its own copy; -1: this
        process's own, for rootless `sandboxd run`, whose sandbox has only loopback:
        network.loopback_proxy).
        ``rules``: what is allowed (``update`` replaces them). ``interceptor`` (the session's CA)
        and ``credentials``: for the hosts ``rules.intercepts``; without an interceptor such a host
        is refused. ``allowed_ranges``: blocked ranges root named reachable (never metadata).
        ``upstream``: the corporate proxy every allowed connection goes through, as a CONNECT
        (network.upstream), after the same checks.
        ``connections``: connections served at once; of them, ``intercepted_connections`` at most
        intercepted (each holds two TLS ends and two HTTP parsers: quotas.intercepted_connections_per_session).
        ``on_event(event)`` is told of every refusal, typed (on a worker thread); without it,
        ``on_denied(destination, why)``. ``ask``: with ``rules.unlisted`` ASK, what an unlisted
        host or an endpoint miss becomes instead of a refusal (``_Asking``)."""
        super().__init__(listener, "sandboxd-egress-proxy", loop)
        self._rules, self._client = rules, PROXY_ADDRESS
        self._resolvers, self._on_denied, self._on_event = list(resolvers), on_denied, on_event
        self._interceptor, self._credentials = interceptor, credentials
        self._allowed_ranges, self._upstream = allowed_ranges, upstream
        self._unresolved: set[str] = set()
        self._ask = ask
        self._netns = os.dup(netns_fd) if netns_fd >= 0 else -1
        self._ports = ROOTLESS_PORTS if netns_fd < 0 else None
        self.cap = ConnectionCap(connections)
        self.intercepted_cap = ConnectionCap(intercepted_connections)
        self._cap_reported = self._intercepted_cap_reported = False
        self.unreported = 0                             # refusals not reported: too many waiting
        # Each relayed connection's destination, for ``update`` to cut what a change takes away.
        # Loop thread only.
        self._destinations: "dict[Relay | Intercepted | PlainMediated, _Destination]" = {}
        self._captured: TcpService | None = None        # serve_captured's listener

    @property
    def rules(self) -> NetworkRules:
        return self._rules

    @property
    def interceptor(self) -> "Interceptor | None":
        return self._interceptor

    @property
    def credentials(self) -> "CredentialSet | None":
        return self._credentials

    def update(self, rules: NetworkRules, credentials: "CredentialSet | None" = None) -> None:
        """Enforce ``rules`` (and, when given, ``credentials``) for every connection and request read
        after this returns (any thread; returns once done). The references are replaced first, which
        the loop reads once per request, so no request read after the call sees the old ones. Then,
        on the loop, every open connection the change takes away is cut: to a host no longer allowed
        (unless a person allowed that connection once: the allowlist never was its reason), a
        tunnel to a host now intercepted (its requests must be read), an intercepted one whose
        host's credentials changed; the last two whatever a person answered. The others stay;
        intercepted ones judge their next request by the new rules and take the new set (the old
        one may be wiped once this returns)."""
        old = self._credentials
        self._rules = rules
        if credentials is not None:
            self._credentials = credentials
        if not self._closed:                            # a closed proxy holds no connection to cut
            self._loop.call(lambda: self._cut_stale(rules, old))

    def _cut_stale(self, rules: NetworkRules, old: "CredentialSet | None") -> None:
        new = self._credentials
        for connection, destination in list(self._destinations.items()):
            host, port, kind = destination.host, destination.port, destination.kind
            # An allow-once answer was about this connection, not the allowlist, which never let it
            # through: no allowlist change takes it away. An allow-for-the-session answer became a
            # rule of the allowlist (applied before the answer comes), so removing it cuts.
            if not rules.allowed(host, port) and not destination.allowed_once:
                why = "it is no longer allowed"
            elif kind == "tunnel" and rules.intercepts(host, port):
                why = "its requests must now be read"
            elif kind == "intercepted" and not _same_credentials(old, new, host, port):
                why = "its credentials changed"
            else:
                if kind == "intercepted":
                    from sandboxd.network.interception.intercepted import Intercepted

                    assert isinstance(connection, Intercepted)
                    connection.use_credentials(new)
                continue
            self.denied(f"{host}:{port}", f"an open connection was cut: {why}", "policy")
            connection.close()

    @staticmethod
    def listen(netns_fd: int) -> socket.socket:
        """The proxy's listening socket on PROXY_ADDRESS:PROXY_PORT in the network namespace
        ``netns_fd``: a sandbox's new one, before any of its processes exists (so nothing else
        holds the port)."""
        return listen_tcp(PROXY_ADDRESS, PROXY_PORT, step="egress proxy", netns_fd=netns_fd)

    def start(self) -> "EgressProxy":
        super().start()
        return self

    def serve_captured(self, listener: socket.socket) -> None:
        """Serve transparent capture's ``listener`` too (network.transparent: the sandbox's ports 80
        and 443, judged by the name each connection carries), until the proxy closes. Takes it."""
        from sandboxd.network.transparent import serve_captured

        def attach() -> None:
            if self._closed:
                listener.close()
            else:
                self._captured = serve_captured(self, listener)
        self._loop.call(attach)

    def _close_in_loop(self) -> None:
        if not self._closed:
            if self._captured is not None:
                self._captured.close()
            super()._close_in_loop()
            if self._netns >= 0:
                os.close(self._netns)

    def denied(self, destination: str, why: str, kind: str = "domain", method: str = "", path: str = "") -> None:
        """Report a refusal off the loop (the daemon's report writes to the event store)."""
        name, _, port = destination.rpartition(":")
        event = ProxyEvent(kind=kind, host=name, port=int(port) if port.isdigit() else 0, method=method,
                           path=path, detail=why)
        # In this proxy's own turn (event_loop.offload): a sandbox that makes refusals faster than
        # they are written delays (and past MAX_QUEUED_PER_OWNER loses) its own reports only.
        if self._on_event is not None:
            on_event = self._on_event
            reported = self._loop.offload(lambda: on_event(event), owner=self)
        else:
            reported = self._loop.offload(lambda: self._on_denied(destination, why), owner=self)
        if not reported:
            self.unreported += 1

    def asks(self, rules: NetworkRules) -> bool:
        """Whether what ``rules`` do not list is asked about rather than refused."""
        return self._ask is not None and rules.unlisted == Unlisted.ASK

    def question(self, host: str, port: int, method: str, path: str, scheme: str, rules: NetworkRules) -> Question:
        """What a person is asked about a held connection or request (never its headers or
        body), with the advisor's proposal."""
        from sandboxd.policy.network_advice import propose

        path = path.partition("?")[0]                   # a query may carry what the person need not see
        proposal = propose(host, port, method, path, rules)
        why = proposal.why if proposal is not None else f"{host}:{port} is not allowed as {printable(method)} " \
                                                           f"{printable(path)}"
        return Question(host=host, port=port, method=method, path=path, scheme=scheme,
                        proposal=proposal.rule if proposal is not None else "",
                        proposal_kind=proposal.kind if proposal is not None else "", why=why)

    def begin_question(self, question: Question, answered: "Callable[[Answer, str], None]") -> Withdraw:
        """Ask ``question`` (off the loop); ``answered(answer, why)`` comes on the loop, once,
        unless the returned withdraw is called first."""
        assert self._ask is not None
        return _Asking(self, self._ask, question, answered).withdraw

    def request_hook(self, host: str, port: int, *, scheme: str = "https",
                     first_granted: bool = False) -> "_Judge":
        """The hook a mediated connection to ``host``:``port`` judges each request with, by the
        rules in force when that request arrives (Mediator reports its refusals); under ``unlisted
        = ask`` a request they do not let through is held and asked about. ``first_granted``: a
        person allowed the connection's first request already (a plain connection asked about)."""
        return _Judge(self, host, port, scheme, first_granted)

    def report_for(self, host: str, port: int) -> "Report":
        def report(kind: str, detail: str, method: str, target: str) -> None:
            self.denied(f"{host}:{port}", detail, kind, printable(method), printable(target))
        return report

    def accepted(self, client: socket.socket, address: str) -> None:
        if address != self._client:
            refuse(client)                              # another sandbox's traffic: not ours to serve
            return
        if not self.cap.take():
            self._refuse_over_cap(client)
            return
        self._cap_reported = False
        request = _Request(self, client)
        self.track(request)

    def opened(self, connection: "Relay | Intercepted | PlainMediated", host: str, port: int, kind: str,
               allowed_once: bool = False) -> None:
        """``connection`` (to ``host``:``port``, a tunnel, intercepted or plain) now relays;
        ``allowed_once``: a person allowed this connection once (its host is not listed)."""
        self._destinations[connection] = _Destination(host, port, kind, allowed_once)

    def forget(self, connection: "Relay | Intercepted | PlainMediated") -> None:
        self._destinations.pop(connection, None)

    def _refuse_over_cap(self, client: socket.socket) -> None:
        try:
            first = client.recv(1, socket.MSG_PEEK)
        except OSError:
            first = b""
        refuse(client, b"\x05\xff" if first == b"\x05" else HTTP_BUSY if first else b"")
        if not self._cap_reported:                      # once per episode, not once per connection
            self._cap_reported = True
            self.denied("(any)", f"the sandbox holds {self.cap.limit} proxy connections, its maximum: "
                                 "further ones are refused until some close")

    def take_intercepted(self, destination: str) -> bool:
        """Room for one more intercepted connection (released with ``release_intercepted``)? When
        there is none, the first refusal of the episode is reported."""
        if self.intercepted_cap.take():
            self._intercepted_cap_reported = False
            return True
        if not self._intercepted_cap_reported:
            self._intercepted_cap_reported = True
            self.denied(destination, f"the sandbox holds {self.intercepted_cap.limit} intercepted connections, "
                                     "its maximum (quotas.intercepted_connections_per_session): further ones "
                                     "are refused until some close", "cap")
        return False

    def release_intercepted(self) -> None:
        self.intercepted_cap.release()

    def open_upstream(self, name: str, port: int, request: "_Request") -> None:
        """Check ``name``, resolve it off the loop, connect from the sandbox's namespace (or, with
        an upstream route, to the corporate proxy and CONNECT through it); then
        ``request.connected(error)`` or ``request.refuse``/``request.fail``, on the loop."""
        destination = f"{printable(name)}:{port}"
        rules = self._rules
        host = host_name(name)
        # A metadata name, or a metadata address given bare (never taken, but said as what it is).
        if metadata_name(host) if host is not None else metadata_address(name.removeprefix("[").removesuffix("]")):
            request.refuse(destination, "a cloud metadata service is never reachable", "metadata")
            return
        asking = False
        if host is None or not rules.allowed(host, port):
            if host is None or not self.asks(rules):
                request.refuse(destination, "not in the allowed domains", "domain")
                return
            asking = True                               # after the checks every connection gets
        intercept = not request.plain and rules.intercepts(host, port)
        if intercept and (self._interceptor is None or request.to_upstream):
            request.refuse(destination, "its requests must be read, which this connection does not allow", "protocol")
            return
        request.host, request.port, request.intercept = host, port, intercept
        resolvers, route = tuple(self._resolvers), self._upstream

        def work() -> tuple[str | None, str | None]:
            """The name's address here (None: only the upstream proxy resolves it) and the upstream
            proxy's ("" when it does not resolve)."""
            try:
                address: str | None = resolve(host, resolvers)   # the name as matched, as DNS holds it
            except (OSError, UnicodeError):
                if route is None:
                    raise
                address = None
            if route is None:
                return address, None
            try:
                return address, route.literal() or resolve(route.host, resolvers)
            except (OSError, UnicodeError):
                return address, ""

        def then(future: "Future[tuple[str | None, str | None]]") -> None:
            if request.closed:
                return
            try:
                address, via = future.result()
            except (OSError, UnicodeError):
                request.refuse(destination, "the name does not resolve", "domain")
                return
            if address is not None and not self._address_allowed(request, destination, address, port):
                return
            if address is None:
                self._unresolved_here(host)
            if self._ports is not None and port not in self._ports:   # after the graver reasons, to say them
                request.refuse(destination, f"port {port} is not one this proxy relays to (only "
                                            f"{', '.join(map(str, self._ports))})", "port")
                return
            if asking:
                self._hold(request, rules, address, via)
            else:
                self._connect(request, address, via)
        # Its own turn in the loop's lookup pool: a sandbox whose names never resolve holds at most
        # event_loop.LOOKUPS_PER_OWNER threads, and the rest of its lookups wait behind every other
        # proxy's (event_loop, fair_pool).
        if not self._loop.offload(work, then, owner=self, lane=LOOKUP):
            request.fail(request.busy())

    def _hold(self, request: "_Request", rules: NetworkRules, address: str | None, via: str | None) -> None:
        """Hold the connection to an unlisted host (checked for everything but the allowlist) and
        ask; connect it on an allow, refuse it on a deny. Meanwhile the client is watched only for
        leaving (_Request.on_ready)."""
        host, port = request.host, request.port
        question = self.question(host, port, request.method, request.path, "http" if request.plain else "https",
                                 rules)

        def answered(answer: Answer, why: str) -> None:
            request.withdraw = None
            if request.closed:
                return
            request.held = False
            request.unwatch()
            if answer == Answer.DENY:
                request.fail(request.refusal(f"sandboxd: {host}:{port} is not among the allowed domains "
                                             f"({_listed(rules.domains)})\n{why or 'sandboxd: refused when asked'}"))
                return
            request.granted = True
            request.allowed_once = answer == Answer.ALLOW_ONCE
            self._connect(request, address, via)
        request.held = True
        request.withdraw = self.begin_question(question, answered)
        request.watch()

    def _connect(self, request: "_Request", address: str | None, via: str | None) -> None:
        """Connect ``request``'s upstream: to ``address`` from the sandbox's namespace, or through
        the upstream proxy (at ``via``)."""
        port, destination, route = request.port, f"{request.host}:{request.port}", self._upstream
        if route is not None:
            if not via:
                self.denied(destination, f"the upstream proxy {route.text()} does not resolve", "upstream")
                request.fail(request.unreachable)
                return
            request.through(route, via)
            return
        assert address is not None
        try:
            upstream = (socket_in_namespace(self._netns, mark=PROXY_MARK) if self._netns >= 0 else
                        # Rootless: no kernel filter behind it, so the two checks above are the
                        # wall, on exactly the address connected to.
                        socket.socket(socket.AF_INET,
                                      socket.SOCK_STREAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC))
        except OSError:
            request.fail(request.unreachable)      # the sandbox's namespace is gone
            return
        request.upstream = upstream
        request.connecting = Connecting(self._loop, upstream, (address, port), request.connected)

    def _address_allowed(self, request: "_Request", destination: str, address: str, port: int) -> bool:
        """Whether the address a name resolves to may be reached; else refuses ``request`` saying why."""
        if metadata_address(address):
            request.refuse(destination, f"it resolves to {address}, a cloud metadata service", "metadata")
            return False
        blocked = blocked_range(address, self._allowed_ranges)
        if blocked is not None:
            request.refuse(destination, f"it resolves to {address}, in {blocked}, a blocked range (root may "
                                        f"name the range in network.allowed_ranges)", "range")
            return False
        if self._netns < 0 and host_owns(address):
            request.refuse(destination, f"it resolves to {address}, an address of this host", "address")
            return False
        return True

    def _unresolved_here(self, host: str) -> None:
        """A name only the upstream proxy resolves: its range is not checked here; said once per name."""
        if host not in self._unresolved and len(self._unresolved) < MAX_UNRESOLVED_NOTED:
            self._unresolved.add(host)
            log.info("egress proxy: %s does not resolve here; it goes to the upstream proxy unresolved, so "
                     "the range of its address is not checked here", host)


class _Request:
    """One client connection of the proxy until its upstream is connected: reads the request
    (HTTP or SOCKS5) without blocking, then hands both sockets to a Relay."""

    def __init__(self, proxy: EgressProxy, client: socket.socket) -> None:
        self.proxy, self.client = proxy, client
        self.data = bytearray()
        self.closed = False
        self.watched = False
        self.socks_greeted = False
        self.complete = False                           # the request is read: upstream is being opened
        self.forbidden, self.unreachable, self.success = HTTP_FORBIDDEN, HTTP_BAD_GATEWAY, b""
        self.to_upstream = b""
        self.upstream: socket.socket | None = None
        self.connecting: "Connecting | UpstreamConnect | None" = None
        self.first = b""                                # what an upstream proxy sent after its answer
        self.relay: "Relay | Intercepted | PlainMediated | None" = None
        self.plain = False                              # an absolute-form http:// request
        self.intercepted = False                        # holds a place of proxy.intercepted_cap
        self.host, self.port, self.intercept = "", 0, False     # as matched; handed to Intercepted
        self.method, self.path = "CONNECT", ""          # what a question shows: a plain request's own
        self.held = False                               # waiting for a question's answer (EgressProxy._hold)
        self.withdraw: Withdraw | None = None
        self.granted = False                            # a person allowed it (a plain one's first request)
        self.allowed_once = False                       # ... by allowing it once (not a rule of the session)
        self.judge: "_Judge | None" = None              # the mediated connection's request hook
        self.deadline = time.monotonic() + REQUEST_SECONDS
        proxy.loop.add_timed(self)
        self._watch(True)

    def watch(self) -> None:
        self._watch(True)

    def unwatch(self) -> None:
        self._watch(False)

    def refusal(self, text: str) -> bytes:
        """A refusal naming why, as this client understands one (SOCKS has no room for text)."""
        if self.forbidden is not HTTP_FORBIDDEN:
            return self.forbidden
        return http_refusal(403, "Forbidden", text)

    def _watch(self, on: bool) -> None:
        if on != self.watched:
            self.proxy.loop.watch(self.client, READ if self.watched else 0, READ if on else 0, self)
            self.watched = on

    def on_ready(self, _mask: int) -> None:
        if self.held:
            self._left_while_held()
            return
        try:
            chunk = self.client.recv(8192)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self.close()
            return
        if not chunk:
            self.close()
            return
        self.data += chunk
        try:
            if self.data[0] == 5:
                self._socks5()
            else:
                self._http()
        except (ValueError, IndexError, UnicodeError, struct.error):
            self.fail(SOCKS_FAILED if self.socks_greeted or self.data[:1] == b"\x05" else HTTP_BAD_REQUEST)

    def _left_while_held(self) -> None:
        """Readable while held: gone (an error; its end, for a tunnel, which has nothing to say
        before it is answered), or early bytes (or a plain request's end: HTTP/1.0 clients may
        half-close and wait), left unread, after which only the question's own bound (its timeout)
        holds it."""
        try:
            gone = not self.client.recv(1, socket.MSG_PEEK) and not self.plain
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            gone = True
        if gone:
            self.close()
        else:
            self._watch(False)

    def expire(self) -> None:
        if not self.complete:                           # still no complete request: give up on it
            self.close()

    def _http(self) -> None:
        end = self.data.find(b"\r\n\r\n")
        if end < 0:
            if len(self.data) > MAX_REQUEST_HEAD:
                self.fail(HTTP_BAD_REQUEST)
            return
        head, rest = bytes(self.data[:end + 4]), bytes(self.data[end + 4:])
        request_line, _, headers = head.partition(b"\r\n")
        method, target, version = request_line.decode("latin-1").split(" ", 2)
        if method.upper() == "CONNECT":
            name, _, port = target.rpartition(":")
            self.success = b"HTTP/1.1 200 Connection established\r\n\r\n"
            self.to_upstream = rest
            self._start(name.strip("[]"), int(port))
            return
        if not target.startswith("http://"):
            self.fail(HTTP_BAD_REQUEST)
            return
        authority, _, path = target[len("http://"):].partition("/")
        name, _, port = authority.partition(":")
        self.method, self.path = method, "/" + path
        # Every request of the connection is read and judged (interception.plain), this one too:
        # as sent, absolute-form, with whatever followed it.
        self.to_upstream = bytes(self.data)
        self.plain = True
        self._start(name, int(port or 80))

    def _socks5(self) -> None:
        data = self.data
        if not self.socks_greeted:
            if len(data) < 2 or len(data) < 2 + data[1]:
                return
            del data[:2 + data[1]]                      # offered methods: we take "no authentication"
            self.socks_greeted = True
            self.forbidden, self.unreachable = SOCKS_NOT_ALLOWED, SOCKS_REFUSED
            self.client.send(b"\x05\x00")
        if len(data) < 5:
            return
        command, kind = data[1], data[3]
        if kind == 3:
            size = 4 + 1 + data[4] + 2
        elif kind in (1, 4):
            size = 4 + (4 if kind == 1 else 16) + 2
        else:
            raise ValueError("bad SOCKS5 address type")
        if len(data) < size:
            return
        port = struct.unpack(">H", bytes(data[size - 2:size]))[0]
        # As sent: a name in A-labels stays one (allowed_name matches text; "idna" decoding
        # made it Unicode, which no allowed domain is).
        name = bytes(data[5:size - 2]).decode("latin-1") if kind == 3 else ""
        self.to_upstream = bytes(data[size:])
        self.success = SOCKS_OK
        if not name:
            self.proxy.denied(f"(an address):{port}", "SOCKS5 without a name: use socks5h")
        if command != 1 or not name:
            self.fail(SOCKS_NOT_ALLOWED)
            return
        self._start(name, port)

    def _start(self, name: str, port: int) -> None:
        if not 0 < port < 65536 or not name:
            raise ValueError("bad destination")
        self._watch(False)                              # nothing more is read until it is connected
        self.proxy.loop.discard_timed(self)
        self.complete = True
        self.proxy.open_upstream(name, port, self)

    def connected(self, error: OSError | None) -> None:
        if self.closed:
            return
        if error is not None:
            self.fail(self.unreachable)
            return
        assert self.upstream is not None
        proxy, upstream = self.proxy, self.upstream
        rules = proxy.rules                             # an update while resolving or connecting
        if (not rules.allowed(self.host, self.port) and not self.granted) or (
                not self.plain and rules.intercepts(self.host, self.port) != self.intercept):
            proxy.denied(f"{self.host}:{self.port}", "the network policy changed while connecting")
            self.fail(self.forbidden)
            return
        if self.first and (self.intercept or self.plain):
            proxy.denied(f"{self.host}:{self.port}", "the upstream proxy sent bytes before the request", "upstream")
            self.fail(self.unreachable)
            return
        if self.intercept and not proxy.take_intercepted(f"{self.host}:{self.port}"):
            self.fail(self.busy())
            return
        self.closed = True                              # the relay owns both sockets from here
        proxy.untrack(self)
        relay: "Relay | Intercepted | PlainMediated"
        if self.intercept:
            from sandboxd.network.interception.intercepted import Intercepted

            assert proxy.interceptor is not None
            self.intercepted = True
            kind, port = "intercepted", self.port
            relay = Intercepted(proxy.loop, self.client, upstream, self.host, port,
                                interceptor=proxy.interceptor, credentials=proxy.credentials,
                                on_request=self._judge(proxy.request_hook(self.host, port, scheme="https")),
                                report=proxy.report_for(self.host, port), established=self.success,
                                on_close=self._relay_closed)
        elif self.plain:
            from sandboxd.network.interception.plain import PlainMediated

            kind = "plain"
            relay = PlainMediated(proxy.loop, self.client, upstream, self.host, self.port, first=self.to_upstream,
                                  on_request=self._judge(proxy.request_hook(self.host, self.port, scheme="http",
                                                                            first_granted=self.granted)),
                                  report=proxy.report_for(self.host, self.port), on_close=self._relay_closed)
        else:
            kind = "tunnel"
            relay = Relay(proxy.loop, self.client, upstream, to_a=self.success + self.first, to_b=self.to_upstream,
                          on_close=self._relay_closed)
        self.relay = relay
        if not relay.closed:
            proxy.track(relay)
            proxy.opened(relay, self.host, self.port, kind, allowed_once=self.allowed_once)

    def _judge(self, judge: "_Judge") -> "_Judge":
        self.judge = judge
        return judge

    def _relay_closed(self) -> None:
        if self.judge is not None:
            self.judge.abandon()                        # a request held for a question: withdrawn
        if self.relay is not None:
            self.proxy.untrack(self.relay)
            self.proxy.forget(self.relay)
        if self.intercepted:
            self.intercepted = False
            self.proxy.release_intercepted()
        self.proxy.cap.release()

    def busy(self) -> bytes:
        """What a client is told when the proxy has no room for its connection: a 503, a SOCKS
        failure, or (a captured TLS connection: no HTTP to answer in) nothing."""
        if self.socks_greeted:
            return SOCKS_FAILED
        return HTTP_BUSY if self.forbidden is HTTP_FORBIDDEN else b""

    def refuse(self, destination: str, why: str, kind: str) -> None:
        """Turn the request away: reported, and the client told why (an HTTP 403 whose body says
        it; a SOCKS client gets its ruleset code, which has no room for a reason)."""
        self.proxy.denied(destination, why, kind)
        self.fail(self.forbidden if self.forbidden is not HTTP_FORBIDDEN else
                  http_refusal(403, "Forbidden", f"sandboxd: {destination}: {why}"))

    def through(self, route: "UpstreamRoute", via: str) -> None:
        """Connect to the corporate proxy ``route`` (at ``via``) and CONNECT to this request's
        host and port through it; then ``connected``."""
        from sandboxd.network.upstream import UpstreamConnect

        proxy, destination = self.proxy, f"{self.host}:{self.port}"
        try:
            upstream = route.socket()
        except OSError:
            self.fail(self.unreachable)
            return
        self.upstream = upstream

        def tunnel_ready(why: str | None, first: bytes) -> None:
            if self.closed:
                return
            if why is not None:
                proxy.denied(destination, why, "upstream")
                self.fail(self.unreachable)
                return
            self.first = first
            self.connected(None)

        def reached(error: OSError | None) -> None:
            if self.closed:
                return
            if error is not None:
                proxy.denied(destination, f"the upstream proxy {route.text()} is unreachable "
                                          f"({error.strerror or type(error).__name__})", "upstream")
                self.fail(self.unreachable)
                return
            self.connecting = UpstreamConnect(proxy.loop, upstream, route, self.host, self.port, tunnel_ready)
        self.connecting = Connecting(proxy.loop, upstream, (via, route.port), reached)

    def fail(self, reply: bytes) -> None:
        if not self.closed:
            try:
                self.client.send(reply)
            except OSError:
                pass
        self.close()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        proxy = self.proxy
        withdraw, self.withdraw = self.withdraw, None
        if withdraw is not None:
            withdraw()                                  # the client left, or the proxy closed
        proxy.loop.discard_timed(self)
        self._watch(False)
        if self.connecting is not None:
            self.connecting.close()
        if self.upstream is not None:
            self.upstream.close()
        self.client.close()
        proxy.untrack(self)
        proxy.cap.release()



class _Asking:
    """One question asked for the proxy: ``ask`` runs on a worker (the asker may write its
    audit record), its answer is posted to the loop and delivered once, unless withdrawn first."""

    def __init__(self, proxy: EgressProxy, ask: Ask, question: Question,
                 answered: "Callable[[Answer, str], None]") -> None:
        self._loop, self._answered = proxy.loop, answered
        self._asker_withdraw: Withdraw | None = None
        self._done = self._withdrawn = False            # answered or withdrawn (loop thread only)

        def work() -> Withdraw:
            return ask(question, self._on_answer)

        def then(future: "Future[Withdraw]") -> None:
            try:
                withdraw = future.result()
            except Exception:  # noqa: BLE001 (an asker's failure refuses this one, nothing more)
                self._deliver(Answer.DENY, "sandboxd: the question could not be asked")
                return
            if self._withdrawn:
                self._loop.offload(withdraw)            # gone before the asker answered the call
            else:
                self._asker_withdraw = withdraw
        self._loop.offload(work, then)

    def _on_answer(self, answer: Answer, why: str = "") -> None:
        self._loop.post(lambda: self._deliver(answer, why))

    def _deliver(self, answer: Answer, why: str) -> None:
        if not self._done:
            self._done = True
            self._asker_withdraw = None
            self._answered(answer, why)

    def withdraw(self) -> None:
        """On the loop: the held work is gone."""
        if self._done:
            return
        self._done = self._withdrawn = True
        withdraw, self._asker_withdraw = self._asker_withdraw, None
        if withdraw is not None:
            self._loop.offload(withdraw)


class _Judge:
    """The request hook of one mediated connection (http1.RequestHook): the host's allowance and
    endpoint rules, an offloaded check when they are costly (http1.Pending), a question under
    ``unlisted = ask``. ``abandon`` (the connection closed) withdraws a question still open."""

    def __init__(self, proxy: EgressProxy, host: str, port: int, scheme: str, first_granted: bool) -> None:
        self._proxy, self._host, self._port, self._scheme = proxy, host, port, scheme
        self._granted = first_granted
        self._withdraw: Withdraw | None = None

    def __call__(self, method: str, target: str) -> "Refusal | Pending | None":
        from sandboxd.network.interception.http1 import Pending, Refusal

        if self._granted:                               # the question about the connection named this one
            self._granted = False
            return None
        proxy, host, port = self._proxy, self._host, self._port
        rules = proxy.rules
        if not rules.allowed(host, port):
            refusal = Refusal(403, f"sandboxd: {host}:{port} is not among the allowed domains", "domain")
            return self._ask(method, target, rules, refusal) if proxy.asks(rules) else refusal
        ruled = rules.ruled(host)
        if not ruled:
            return None
        if len(target) > MAX_RULED_TARGET:
            return Refusal(414, f"sandboxd: a request target over {MAX_RULED_TARGET} bytes to a host with "
                                "endpoint rules", "endpoint")
        why = ambiguous_target(target)
        if why:
            return Refusal(400, f"sandboxd: {why}, which servers read differently; {host} has endpoint rules",
                           "endpoint")
        path = normalize_path(target)
        assert path is not None                         # ambiguous_target said why not
        refusal = Refusal(403, endpoint_refusal(host, method, target, rules), "endpoint")
        if match_cost(ruled, path) <= MAX_LOOP_COMPARISONS:
            if endpoint_allowed(ruled, method, path):
                return None
            return self._ask(method, target, rules, refusal) if proxy.asks(rules) else refusal
        # Many rules and a long path: judged on a worker, the loop serves everyone meanwhile.
        pending = Pending()

        def settle(future: "Future[bool]") -> None:
            try:
                allowed = future.result()
            except Exception as exc:  # noqa: BLE001 (a failure refuses this request only)
                pending.settle(Refusal(403, f"sandboxd: the endpoint rules could not be judged "
                                            f"({type(exc).__name__})", "internal"))
                return
            if allowed:
                pending.settle(None)
            elif proxy.asks(rules):
                self._ask(method, target, rules, refusal, pending)
            else:
                pending.settle(refusal)
        # In this proxy's own turn: one sandbox's costly paths wait behind other proxies' work.
        if not proxy.loop.offload(lambda: endpoint_allowed(ruled, method, path), settle, owner=proxy):
            pending.settle(Refusal(503, "sandboxd: too many requests waiting to be judged", "cap"))
        return pending

    def _ask(self, method: str, target: str, rules: NetworkRules, refusal: "Refusal",
             pending: "Pending | None" = None) -> "Pending":
        """Hold the request and ask; it passes on an allow, gets ``refusal`` (and why) on a deny."""
        from sandboxd.network.interception.http1 import Pending, Refusal

        held = pending if pending is not None else Pending()
        question = self._proxy.question(self._host, self._port, method, target, self._scheme, rules)

        def answered(answer: Answer, why: str) -> None:
            self._withdraw = None
            held.settle(None if answer != Answer.DENY else
                        Refusal(403, f"{refusal.body}\n{why or 'sandboxd: refused when asked'}", refusal.kind))
        self._withdraw = self._proxy.begin_question(question, answered)
        return held

    def abandon(self) -> None:
        withdraw, self._withdraw = self._withdraw, None
        if withdraw is not None:
            withdraw()
