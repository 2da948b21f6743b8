"""HTTP/1.1 mediation of an intercepted connection: sans-IO, two h11 connections.

Toward the sandbox h11 plays the server, toward the upstream the client. Each request the sandbox
sends is parsed strictly (h11 refuses bad header syntax, obs-fold, conflicting Content-Length,
transfer codings other than chunked; we refuse Content-Length with Transfer-Encoding, more than
``MAX_HEADERS`` fields, a head over ``MAX_REQUEST_HEAD``) and then **re-serialised** toward the
upstream from the parsed event: the upstream reads exactly the framing the proxy read, so the two
cannot disagree on where a request ends (no smuggling). On the way, the hook ``on_request`` (the
endpoint rules, a question) may refuse it, hop-by-hop headers are dropped and, on a TLS connection
to a credential's upstream, the phantom is swapped for the secret (network.credentials).

Bodies pass as h11 ``Data`` events as soon as they arrive, both ways, never accumulated: SSE,
chunked downloads and MCP streamable HTTP flow event by event. A ``101`` answer to a WebSocket
upgrade switches the mediator to a byte pump (``switched``); other upgrades (``h2c``) are removed
from the request. h11 serves one request at a time, so pipelined requests are answered in order.

The owner (``intercepted.Intercepted``) feeds plaintext in (``from_client``, ``from_upstream``;
b"" for an end) and drains ``to_client``/``to_upstream``; ``done`` says: flush and close.
"""

from __future__ import annotations

from typing import Callable

import h11

from sandboxd.network.credentials import CredentialSet
from sandboxd.policy.domains import host_name
from sandboxd.printable import printable

MAX_REQUEST_HEAD = 64 * 1024           # request line and headers
MAX_RESPONSE_HEAD = 64 * 1024
# Unparsed bytes a side may have in h11's buffer before it is no longer read: a head must fit (h11
# refuses it past MAX_REQUEST_HEAD), a pipelined one waits there while the one before is answered.
MAX_BACKLOG = max(MAX_REQUEST_HEAD, MAX_RESPONSE_HEAD)
MAX_HEADERS = 128                      # header fields of a request
# Hop-by-hop fields (RFC 9110 7.6.1) and the proxy's own: never passed on as sent. "connection"
# and "upgrade" are rebuilt when a WebSocket upgrade is passed, "connection: close" kept.
_HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-authorization", b"proxy-authenticate",
                         b"proxy-connection", b"te", b"trailer", b"upgrade"})
_REASONS = {400: "Bad Request", 403: "Forbidden", 405: "Method Not Allowed", 408: "Request Timeout",
            414: "URI Too Long", 421: "Misdirected Request", 431: "Request Header Fields Too Large",
            502: "Bad Gateway"}
MAX_REFUSAL_BODY = 4096                # bytes of a refusal's body, whatever it quotes
# Headers that make a server take the request as another method (frameworks honour them): the
# request is judged as each method they name too, and refused if one is no method (not letters).
METHOD_OVERRIDES = frozenset({b"x-http-method-override", b"x-http-method", b"x-method-override"})
# On a connection to a credential's upstream the response must reach the scrubber as plain text:
# what asks for another encoding or a part of the body is dropped (Accept-Encoding: identity put in).
_CREDENTIAL_DROPPED = frozenset({b"accept-encoding", b"range", b"if-range", b"te"})


class Refusal:
    """A request turned away: the sandbox gets ``status`` with ``body`` (one line, no caller text
    unescaped), and the connection is closed."""

    __slots__ = ("status", "body", "kind")

    def __init__(self, status: int, body: str, kind: str = "endpoint") -> None:
        self.status, self.body, self.kind = status, body, kind


class Pending:
    """A hook's answer that comes later (an endpoint check offloaded from the loop; a question):
    the request is held, nothing more the sandbox sends is parsed, until ``settle`` (on the loop)
    gives None (pass) or a Refusal. Loop thread only."""

    __slots__ = ("_then", "_result", "_settled")

    def __init__(self) -> None:
        self._then: "Callable[[Refusal | None], None] | None" = None
        self._result: "Refusal | None" = None
        self._settled = False

    def then(self, fn: "Callable[[Refusal | None], None]") -> None:
        if self._settled:
            fn(self._result)
        else:
            self._then = fn

    def settle(self, result: "Refusal | None") -> None:
        if self._settled:
            return
        self._settled, self._result = True, result
        if self._then is not None:
            self._then(result)


class _Held:
    """A request read and being judged: its event, target (origin-form) and headers as read."""

    __slots__ = ("event", "target", "raw")

    def __init__(self, event: h11.Request, target: str, raw: list[tuple[bytes, bytes]]) -> None:
        self.event, self.target, self.raw = event, target, raw


# on_request(method, target) -> None (pass), a Refusal, or Pending; called on the loop, must not block.
RequestHook = Callable[[str, str], "Refusal | Pending | None"]
# report(kind, detail, method, target): a refusal or failure, for the proxy's events (called on the
# loop). Kinds: the hook's Refusal.kind ("endpoint", ...), "protocol" (a request or answer we will not
# pass), "upstream" (the upstream's answer is malformed), and from intercepted.Intercepted
# "upstream_tls", "timeout", "internal". ``detail`` is printable (no caller text unescaped).
Report = Callable[[str, str, str, str], None]


def refusal_bytes(status: int, body: str) -> bytes:
    """A complete ``status`` response that closes the connection, with ``body`` as text."""
    payload = body.encode("utf-8")[:MAX_REFUSAL_BODY - 1] + b"\n"
    return (f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\nContent-Type: text/plain; charset=utf-8\r\n"
            f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n").encode("ascii") + payload


def _head_size(target: str, raw: list[tuple[bytes, bytes]]) -> int:
    return len(target) + sum(len(name) + len(value) + 4 for name, value in raw)


def _letters(text: str) -> bool:
    """Whether ``text`` is a method an endpoint rule can name: ASCII letters only (never ``*``,
    which a rule reads as any method, nor any other token character)."""
    return text.isascii() and text.isalpha()


def _tokens(value: bytes) -> set[bytes]:
    return {token.strip().lower() for token in value.split(b",")}


class Mediator:
    """One intercepted connection's HTTP/1.1 exchange with ``host``:``port`` (the CONNECT target,
    as matched). ``credentials``: given only on TLS whose upstream certificate verified for host."""

    def __init__(self, host: str, port: int, *, default_port: int = 443, credentials: CredentialSet | None = None,
                 on_request: RequestHook | None = None, report: Report | None = None,
                 absolute_form: bool = False) -> None:
        """``absolute_form``: a plain http:// connection to the proxy, whose requests name
        ``http://HOST[:PORT]/PATH`` (RFC 9112 3.2.2): each must name this connection's host and
        port, and goes on in origin-form (plain.PlainMediated)."""
        self.host, self.port = host, port
        self._absolute_form = absolute_form
        self._authorities = {host.encode("ascii"), f"{host}:{port}".encode("ascii")} if port == default_port else {
            f"{host}:{port}".encode("ascii")}
        self._credentials = credentials if credentials else None
        self._on_request, self._report = on_request, report or (lambda kind, detail, method, target: None)
        self._client = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_REQUEST_HEAD)
        self._upstream = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_RESPONSE_HEAD)
        self._scrubber = self._credentials.scrubber(host, port) if self._credentials is not None else None
        self._scrub_body = False
        self._upgrading = False                          # the request in flight asks for a WebSocket
        self._client_gone = False
        self._current = ("", "")                         # method and target of the request in flight
        self.to_client = bytearray()
        self.to_upstream = bytearray()
        self._held: _Held | None = None                  # a request waiting for its Pending verdict
        # Called (on the loop) when a held request was settled: the owner passes what is pending on.
        self.on_wake: Callable[[], None] = lambda: None
        self.switched = False                            # a 101 passed: bytes flow unparsed
        self.done = False                                # flush what is pending, then close
        self.requests = 0
        self.swaps = 0

    def use_credentials(self, credentials: CredentialSet | None) -> None:
        """The set to swap from for the next request: one holding the same credentials for this
        host and port (the proxy cuts a connection whose credentials changed)."""
        if self._credentials is not None and credentials:
            self._credentials = credentials

    @property
    def head_pending(self) -> bool:
        """Whether part of a request head has come and the rest not yet (the owner gives a head
        REQUEST_HEAD_SECONDS to be complete: a client trickling one never holds the connection)."""
        return (not self.done and not self.switched and self._client.their_state is h11.IDLE
                and bool(self._client.trailing_data[0]))

    @property
    def backlog(self) -> tuple[int, int]:
        """Bytes taken in from the sandbox, and from the upstream, not yet parsed (h11 holds a
        pipelined request while one is answered, or what an upstream sends unasked): the owner stops
        reading a side whose backlog holds tcp_relay.BUFFER_LIMIT."""
        return len(self._client.trailing_data[0]), len(self._upstream.trailing_data[0])

    # -- input ---------------------------------------------------------------------------------

    def from_client(self, data: bytes) -> None:
        """Plaintext from the sandbox (b"": it ended its side)."""
        if self.done:
            return
        if self.switched:
            self.to_upstream += data
            self.done = not data
            return
        self._client.receive_data(data)
        self._pump_client()

    def from_upstream(self, data: bytes) -> None:
        """Plaintext from the upstream (b"": it ended its side)."""
        if self.done:
            return
        if self.switched:
            self.to_client += data
            self.done = not data
            return
        self._upstream.receive_data(data)
        self._pump_upstream()

    # -- requests ------------------------------------------------------------------------------

    def _pump_client(self) -> None:
        while not self.done and not self.switched and self._held is None:
            try:
                event = self._client.next_event()
            except h11.RemoteProtocolError as exc:
                status = 431 if exc.error_status_hint == 431 else 400
                self._refuse(Refusal(status, f"sandboxd: a malformed request ({printable(str(exc))})", "protocol"))
                return
            if event is h11.NEED_DATA or event is h11.PAUSED:
                return
            if isinstance(event, h11.Request):
                self._request(event)
            elif isinstance(event, h11.Data):
                self._send_upstream(h11.Data(data=event.data))
            elif isinstance(event, h11.EndOfMessage):
                self._send_upstream(h11.EndOfMessage())
            elif isinstance(event, h11.ConnectionClosed):
                self._client_gone = True
                if self._client.our_state is not h11.SEND_RESPONSE:
                    self.done = True
                return

    def _request(self, event: h11.Request) -> None:
        method, target = event.method.decode("ascii"), event.target.decode("ascii")
        self._current = (method, target)
        self.requests += 1
        raw = list(event.headers.raw_items())
        if self._absolute_form:
            split = self._origin_form(target)
            if split is None:
                self._refuse(Refusal(400, f"sandboxd: this connection is to http://{self.host}:{self.port}; a request "
                                          "through it names that host, as http://HOST[:PORT]/PATH", "protocol"))
                return
            # RFC 9112 3.2.2: the target's authority is the request's Host, whatever Host said (an
            # HTTP/1.0 client may send none).
            authority, target = split
            raw = [(name, value) for name, value in raw if name.lower() != b"host"] + [(b"Host", authority)]
            self._current = (method, target)
        names = [name.lower() for name, _ in raw]
        refusal = self._check(event, method, target, raw, names)
        overrides = [item.strip().decode("latin-1") for name, value in raw if name.lower() in METHOD_OVERRIDES
                     for item in value.split(b",")]
        if refusal is None and not all(_letters(text) for text in [method, *overrides]):
            refusal = Refusal(400, "sandboxd: a method (or method override header) that is not letters", "protocol")
        if refusal is not None:
            self._refuse(refusal)
            return
        methods = list(dict.fromkeys([method, *(text.upper() for text in overrides)]))
        self._judge(_Held(event, target, raw), methods if self._on_request is not None else [])

    def _judge(self, held: "_Held", methods: list[str]) -> None:
        """Ask the hook about each of ``methods`` in turn (the request's, its overrides'); pass the
        request on once none refused. A Pending answer holds the request (nothing more of the
        sandbox's is parsed) until it settles."""
        assert self._on_request is not None or not methods
        while methods:
            assert self._on_request is not None
            outcome = self._on_request(methods.pop(0), held.target)
            if isinstance(outcome, Pending):
                self._held = held
                outcome.then(lambda result: self._settled(held, methods, result))
                return
            if outcome is not None:
                self._refuse(outcome)
                return
        self._forward(held)

    def _settled(self, held: "_Held", methods: list[str], result: "Refusal | None") -> None:
        if self._held is not held or self.done:
            return                                       # the connection ended meanwhile
        self._held = None
        if result is not None:
            self._refuse(result)
        else:
            self._judge(held, methods)
        if self._held is None:
            self._pump_client()                          # its body, or a pipelined request, waits in h11
        self.on_wake()

    def _forward(self, held: "_Held") -> None:
        """The judged request on to the upstream: hop-by-hop headers dropped, the credential in."""
        headers = self._forwarded(held.raw)
        if self._credentials is not None:
            headers, swapped = self._credentials.swap(self.host, self.port, headers)
            self.swaps += swapped
        if self._scrubber is not None:
            if self._upgrading and self.swaps:
                self._refuse(Refusal(403, "sandboxd: no protocol upgrade on a connection that carries a credential "
                                          "(what it would carry could not be checked for the secret)", "protocol"))
                return
            headers = [(name, value) for name, value in headers if name.lower() not in _CREDENTIAL_DROPPED]
            headers.append((b"Accept-Encoding", b"identity"))
        self._send_upstream(h11.Request(method=held.event.method, target=held.target.encode("ascii"), headers=headers))

    def _origin_form(self, target: str) -> tuple[bytes, str] | None:
        """An absolute-form ``target``'s authority and path (with its query), when it names this
        connection's host and port; else None."""
        if target[:7].lower() != "http://":
            return None
        authority, slash, rest = target[7:].partition("/")
        if "@" in authority or not self._own_authority(authority.encode("ascii")):
            return None
        return authority.encode("ascii"), (slash + rest if slash else "/")

    def _check(self, event: h11.Request, method: str, target: str, raw: list[tuple[bytes, bytes]],
               names: list[bytes]) -> Refusal | None:
        if len(raw) > MAX_HEADERS:
            return Refusal(431, f"sandboxd: more than {MAX_HEADERS} header fields", "protocol")
        if _head_size(target, raw) > MAX_REQUEST_HEAD:     # h11 bounds only a head still incomplete
            return Refusal(431, f"sandboxd: a request head over {MAX_REQUEST_HEAD} bytes", "protocol")
        if method == "CONNECT":
            return Refusal(405, f"sandboxd: CONNECT inside a connection to {self.host}:{self.port}", "protocol")
        if not target.startswith("/"):
            return Refusal(400, "sandboxd: inside an intercepted connection a request target is a path "
                                "starting with '/'", "protocol")
        if b"content-length" in names and b"transfer-encoding" in names:
            return Refusal(400, "sandboxd: a request with both Content-Length and Transfer-Encoding", "protocol")
        hosts = [value for name, value in raw if name.lower() == b"host"]
        if len(hosts) != 1 or not self._own_authority(hosts[0]):
            return Refusal(421, f"sandboxd: this connection is to {self.host}:{self.port}; the request's Host "
                                "header names another", "protocol")
        return None

    def _own_authority(self, value: bytes) -> bool:
        try:
            text = value.decode("ascii")
        except UnicodeDecodeError:
            return False
        name, colon, port = text.rpartition(":") if ":" in text else (text, "", "")
        normal = host_name(name)
        if normal is None:
            return False
        return (normal + colon + port).encode("ascii") in self._authorities

    def _forwarded(self, raw: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        """The request's headers as the upstream gets them: hop-by-hop fields (and those the
        Connection field names) dropped; a WebSocket upgrade and ``Connection: close`` kept."""
        connection: set[bytes] = set()
        upgrade = b""
        for name, value in raw:
            lower = name.lower()
            if lower == b"connection":
                connection |= _tokens(value)
            elif lower == b"upgrade":
                upgrade = value
        self._upgrading = b"upgrade" in connection and b"websocket" in _tokens(upgrade)
        out = [(name, value) for name, value in raw
               if name.lower() not in _HOP_BY_HOP and name.lower() not in connection]
        if self._upgrading:
            out += [(b"Connection", b"Upgrade"), (b"Upgrade", upgrade)]
        elif b"close" in connection:
            out.append((b"Connection", b"close"))
        return out

    # -- responses -----------------------------------------------------------------------------

    def _pump_upstream(self) -> None:
        while not self.done and not self.switched:
            if self._upstream.our_state is h11.IDLE and self._upstream.trailing_data[0]:
                # No request of ours in flight: h11 would read these bytes as a response and the
                # sandbox would take it for the answer to its next request (a desync). Cut.
                self._report("upstream", "the upstream sent a response to no request", *self._current)
                self.done = True
                return
            try:
                event = self._upstream.next_event()
            except h11.RemoteProtocolError as exc:
                self._upstream_failed(f"the upstream's response is malformed ({str(exc)})")
                return
            if event is h11.NEED_DATA or event is h11.PAUSED:
                return
            if isinstance(event, h11.InformationalResponse):
                self._informational(event)
            elif isinstance(event, h11.Response):
                self._response(event)
            elif isinstance(event, h11.Data):
                data = self._scrubber.feed(event.data) if self._scrub_body and self._scrubber else event.data
                if data:
                    self._send_client(h11.Data(data=data))
            elif isinstance(event, h11.EndOfMessage):
                if self._scrub_body and self._scrubber is not None:
                    rest = self._scrubber.finish()
                    if rest:
                        self._send_client(h11.Data(data=rest))
                self._send_client(h11.EndOfMessage())
                self._next_cycle()
            elif isinstance(event, h11.ConnectionClosed):
                self.done = True
                return

    def _response_headers(self, raw: list[tuple[bytes, bytes]], *, keep_upgrade: bool) -> list[tuple[bytes, bytes]]:
        connection: set[bytes] = set()
        for name, value in raw:
            if name.lower() == b"connection":
                connection |= _tokens(value)
        out: list[tuple[bytes, bytes]] = []
        scrub = self._scrubber.head_value if self._scrubber is not None else (lambda text: text)
        for name, value in raw:
            lower = name.lower()
            if lower in (b"connection", b"upgrade") and keep_upgrade:
                out.append((name, value))
            elif lower not in _HOP_BY_HOP and lower not in connection:
                out.append((scrub(name), scrub(value)))
        if b"close" in connection and not keep_upgrade:
            out.append((b"Connection", b"close"))
        return out

    def _informational(self, event: h11.InformationalResponse) -> None:
        switching = event.status_code == 101
        if switching and not self._upgrading:
            self._upstream_failed("the upstream switched protocols without being asked")
            return
        headers = self._response_headers(list(event.headers.raw_items()), keep_upgrade=switching)
        self._send_client(h11.InformationalResponse(status_code=event.status_code, headers=headers,
                                                    reason=self._reason(event.reason)))
        if switching and not self.done:
            self.switched = True
            self.to_upstream += self._client.trailing_data[0]
            self.to_client += self._upstream.trailing_data[0]

    def _response(self, event: h11.Response) -> None:
        raw = list(event.headers.raw_items())
        if _head_size("", raw) > MAX_RESPONSE_HEAD:
            self._upstream_failed(f"the upstream's response head is over {MAX_RESPONSE_HEAD} bytes")
            return
        encoding = [value.strip().lower() for name, value in raw if name.lower() == b"content-encoding"]
        self._scrub_body = self._scrubber is not None
        if self._scrub_body and not all(value in (b"", b"identity") for value in encoding):
            self._upstream_failed("the upstream's response to a request with a credential is encoded "
                                  "(Content-Encoding), so it cannot be checked for the secret")
            return
        headers = self._response_headers(raw, keep_upgrade=False)
        self._send_client(h11.Response(status_code=event.status_code, headers=headers,
                                       reason=self._reason(event.reason)))

    def _reason(self, reason: bytes) -> bytes:
        """An upstream's reason phrase as the sandbox gets it: scrubbed, printable."""
        return self._clean(reason.decode("latin-1")).encode("utf-8")

    def _clean(self, text: str) -> str:
        """Text that may quote what an upstream sent, for the sandbox or an event: printable, and
        without the secret in any form (scrubbed before and after escaping)."""
        if self._scrubber is None:
            return printable(text)
        scrub = self._scrubber.head_value
        once = scrub(text.encode("utf-8", "surrogateescape")).decode("utf-8", "replace")
        return scrub(printable(once).encode("utf-8")).decode("utf-8", "replace")

    def _next_cycle(self) -> None:
        """A response ended: go on with the next request, or close when either side cannot."""
        client, upstream = self._client, self._upstream
        states = (client.our_state, client.their_state, upstream.our_state, upstream.their_state)
        if self._client_gone or any(state is not h11.DONE for state in states):
            self.done = True                             # Connection: close, or a request body still coming
            return
        client.start_next_cycle()
        upstream.start_next_cycle()
        self._pump_client()                              # a pipelined request may wait in h11's buffer

    # -- output and failure --------------------------------------------------------------------

    def _send_upstream(self, event: h11.Event) -> None:
        try:
            data = self._upstream.send(event)
        except h11.LocalProtocolError as exc:
            self._refuse(Refusal(400, f"sandboxd: the request cannot be passed on ({printable(str(exc))})", "protocol"))
            return
        if data:
            self.to_upstream += data

    def _send_client(self, event: h11.Event) -> None:
        try:
            data = self._client.send(event)
        except h11.LocalProtocolError as exc:
            self._report("protocol", f"the response cannot be passed on ({self._clean(str(exc))})", *self._current)
            self.done = True
            return
        if data:
            self.to_client += data

    def _refuse(self, refusal: Refusal) -> None:
        """Answer the request in flight with ``refusal`` (if no answer has begun) and close."""
        self._report(refusal.kind, refusal.body, *self._current)
        if self._client.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            self.to_client += refusal_bytes(refusal.status, refusal.body)
        self.done = True

    def _upstream_failed(self, why: str) -> None:
        why = self._clean(why)
        self._report("upstream", why, *self._current)
        if self._client.our_state is h11.SEND_RESPONSE:
            self.to_client += refusal_bytes(502, f"sandboxd: {why}")
        self.done = True


__all__ = ["MAX_BACKLOG", "MAX_HEADERS", "MAX_REQUEST_HEAD", "MAX_RESPONSE_HEAD", "Mediator", "Pending", "Refusal",
           "RequestHook", "refusal_bytes"]
