"""An intercepted connection: what the egress proxy hands a CONNECT to a host with endpoint rules
or credentials, instead of a blind ``Relay`` (design §4.3).

Given the sandbox's socket (its CONNECT read, not yet answered) and a socket connected to the
upstream, on the proxy's loop, never blocking:

1. TLS to the upstream, verified for ``host`` (upstream_tls). A certificate that fails gets the
   sandbox a ``502`` naming why, and the upstream gets no request at all.
2. ``established`` (the ``200`` to the CONNECT) to the sandbox; the leaf for ``host`` (minted off the
   loop by the session's CA, meanwhile).
3. The sandbox's TLS handshake against the leaf (its first byte must start a TLS record).
4. HTTP/1.1 mediation (http1.Mediator): the rules hook, the credential swap, streaming, upgrades.

Backpressure as tcp_relay's: a side is not read while the other's outgoing bytes hold
``BUFFER_LIMIT``. Handshakes have ``HANDSHAKE_SECONDS`` each, an idle connection
tcp_relay.IDLE_SECONDS. ``on_close`` runs once, when both sockets are closed.
"""

from __future__ import annotations

import socket
import ssl
import time
from concurrent.futures import Future
from typing import Callable

from sandboxd.network.credentials import CredentialSet
from sandboxd.network.event_loop import READ, WRITE, EventLoop
from sandboxd.network.interception.ca import SessionCA
from sandboxd.network.interception.http1 import MAX_BACKLOG, Mediator, Report, RequestHook, refusal_bytes
from sandboxd.network.interception.tls_end import TlsEnd
from sandboxd.network.interception.upstream_tls import why_untrusted
from sandboxd.network.tcp_relay import BUFFER_LIMIT, CHUNK, IDLE_SECONDS, nodelay

HANDSHAKE_SECONDS = 10.0
# From the first byte of a request head to its end, for each request of a connection (the egress
# proxy gives the first one of a connection as long: egress_proxy.REQUEST_SECONDS).
REQUEST_HEAD_SECONDS = 30.0
ESTABLISHED = b"HTTP/1.1 200 Connection established\r\n\r\n"
_TLS_RECORD = 0x16                     # a TLS handshake record's first byte (a ClientHello)


class Interceptor:
    """What a proxy needs to end TLS: its session's CA and the context the upstreams are checked
    with (upstream_tls.upstream_context: one per process)."""

    __slots__ = ("ca", "upstream_context")

    def __init__(self, ca: SessionCA, upstream_context: ssl.SSLContext) -> None:
        self.ca, self.upstream_context = ca, upstream_context


class Side:
    """One socket of an intercepted connection: the ciphertext waiting for it, how it ended."""

    __slots__ = ("owner", "sock", "out", "events", "eof")

    def __init__(self, owner: "Paired", sock: socket.socket) -> None:
        self.owner, self.sock = owner, sock
        self.out = bytearray()
        self.events = 0
        self.eof = False
        nodelay(sock)

    def on_ready(self, mask: int) -> None:
        self.owner.ready(self, mask)

    def close(self) -> None:
        self.owner.close()


class Paired:
    """A sandbox's socket and its upstream's, served together on the loop until ``on_close``:
    what Intercepted and plain.PlainMediated share (closing, timing out, flushing a side)."""

    def __init__(self, loop: EventLoop, client: socket.socket, upstream: socket.socket, deadline: float,
                 on_close: Callable[[], None]) -> None:
        self._loop, self._on_close = loop, on_close
        self._client, self._upstream = Side(self, client), Side(self, upstream)
        self._closing = False                            # flush what is pending, then close
        self.closed = False
        self.mediator: Mediator | None = None
        self.deadline = self._idle_deadline = time.monotonic() + deadline
        self._head_deadline: float | None = None         # a request head begun must end by then
        loop.add_timed(self)

    def ready(self, side: Side, mask: int) -> None:
        if self.closed:
            return
        if self.idle_counts():
            self._idle_deadline = time.monotonic() + IDLE_SECONDS
        if mask & WRITE:
            self._flush(side)
        if mask & READ and not self.closed:
            self._pull(side)
        self._watch_head()
        self._update()

    def room(self, side: Side) -> bool:
        """Whether ``side`` may be read: what it gives is not piling up, neither in its peer's
        outgoing bytes nor unparsed in the mediator (a pipelined request waiting for an answer the
        sandbox never reads, responses an upstream sends unasked)."""
        other = self._upstream if side is self._client else self._client
        if len(other.out) >= BUFFER_LIMIT:
            return False
        if self.mediator is None:
            return True
        return self.mediator.backlog[0 if side is self._client else 1] <= MAX_BACKLOG

    def _watch_head(self) -> None:
        """Start or stop the clock of a request head that has begun (REQUEST_HEAD_SECONDS)."""
        pending = self.mediator is not None and self.mediator.head_pending
        if not pending:
            self._head_deadline = None
        elif self._head_deadline is None:
            self._head_deadline = time.monotonic() + REQUEST_HEAD_SECONDS
        deadline = min(self._idle_deadline, self._head_deadline or self._idle_deadline)
        sooner = deadline < self.deadline
        self.deadline = deadline
        if sooner:
            self._loop.add_timed(self)                   # sooner than the timer now set for it

    def idle_counts(self) -> bool:
        """Whether traffic now moves the deadline on (IDLE_SECONDS from the last)."""
        return True

    def _pull(self, side: Side) -> None:
        raise NotImplementedError

    def _update(self) -> None:
        raise NotImplementedError

    def expired(self) -> None:
        """Told before a connection that made no progress in time is closed."""

    def expire(self) -> None:
        now = time.monotonic()
        if self._head_deadline is not None and now >= self._head_deadline:
            self.head_expired()
            self.close()
        elif now < self.deadline:
            self._loop.add_timed(self)
        else:
            self.expired()
            self.close()

    def head_expired(self) -> None:
        """Told before a connection whose request head did not end in time is closed."""

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._loop.discard_timed(self)
        for side in (self._client, self._upstream):
            self._loop.watch(side.sock, side.events, 0, side)
            side.events = 0
            side.sock.close()
        self._on_close()

    def _receive(self, side: Side) -> bytes | None:
        """What ``side`` has for us (b"": it ended); None for nothing yet, or a failure (closed)."""
        try:
            return side.sock.recv(CHUNK)
        except (BlockingIOError, InterruptedError):
            return None
        except OSError:
            self.close()
            return None

    def _flush(self, side: Side) -> None:
        if side.out and not self.closed:
            try:
                sent = side.sock.send(side.out)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError:
                self.close()
                return
            del side.out[:sent]


class Intercepted(Paired):
    """One intercepted connection to ``host``:``port`` (the CONNECT target, as matched)."""

    def __init__(self, loop: EventLoop, client: socket.socket, upstream: socket.socket, host: str, port: int, *,
                 interceptor: Interceptor, credentials: CredentialSet | None = None,
                 on_request: RequestHook | None = None, report: Report | None = None,
                 established: bytes = ESTABLISHED, on_close: Callable[[], None] = lambda: None) -> None:
        super().__init__(loop, client, upstream, HANDSHAKE_SECONDS, on_close)
        self.host, self.port = host, port
        self._interceptor, self._credentials = interceptor, credentials
        self._on_request = on_request
        self._report: Report = report or (lambda kind, detail, method, target: None)
        self._established = established
        self._upstream_tls = TlsEnd(interceptor.upstream_context, server_side=False, server_hostname=host)
        self._client_tls: TlsEnd | None = None
        self._leaf: ssl.SSLContext | None = None
        self.phase = "upstream"                          # upstream, leaf, client, mediate
        # In the session's own turn (event_loop.offload: fair between sessions); its CA is its owner.
        if not loop.offload(lambda: interceptor.ca.leaf(host), self._leaf_ready, owner=interceptor.ca):
            self._report("cap", f"no certificate for {host}: too many connections are waiting for one", "", "")
            self.close()
            return
        self._step_upstream_handshake()
        self._update()

    def use_credentials(self, credentials: CredentialSet | None) -> None:
        """The set to take the secrets from from now on: one holding the same credentials for this
        host and port (egress_proxy.EgressProxy.update cuts a connection whose credentials changed)."""
        self._credentials = credentials
        if self.mediator is not None:
            self.mediator.use_credentials(credentials)

    # -- the loop's calls ------------------------------------------------------------------------

    def idle_counts(self) -> bool:
        return self.phase == "mediate"                   # before: the handshake's deadline holds

    def expired(self) -> None:
        self._report("timeout", f"no progress in the {self.phase} phase", "", "")

    def head_expired(self) -> None:
        self._report("timeout", f"a request head did not end within {REQUEST_HEAD_SECONDS:.0f} s", "", "")

    # -- reading ---------------------------------------------------------------------------------

    def _pull(self, side: Side) -> None:
        if self.phase == "leaf" and side is self._client:
            return                                       # not answered yet: nothing to read
        data = self._receive(side)
        if data is None:
            return
        if not data:
            side.eof = True
        if side is self._upstream:
            self._upstream_tls.feed(data)
            if self.phase == "upstream":
                self._step_upstream_handshake()
            elif self.phase == "mediate":
                self._mediate_upstream()
            elif not data:
                self.close()
            return
        if self.phase == "client" and self._client_tls is None:
            if not data:
                self.close()
                return
            if data[:1] != bytes([_TLS_RECORD]):
                self._report("protocol", f"{self.host}:{self.port} is intercepted: only TLS carrying HTTP/1.1 "
                                         "reaches it", "", "")
                self.close()
                return
            assert self._leaf is not None
            self._client_tls = TlsEnd(self._leaf, server_side=True)
        tls = self._client_tls
        if tls is None:
            self.close()
            return
        tls.feed(data)
        if self.phase == "client":
            self._step_client_handshake()
        elif self.phase == "mediate":
            self._mediate_client()

    # -- the phases ------------------------------------------------------------------------------

    def _step_upstream_handshake(self) -> None:
        try:
            done = self._upstream_tls.handshake()
        except ssl.SSLError as exc:
            self._pass_ciphertext()
            why = why_untrusted(self.host, self.port, exc)
            self._report("upstream_tls", why, "", "")
            self._client.out += refusal_bytes(502, why)
            self._finish()
            return
        self._pass_ciphertext()
        if done:
            self.phase = "leaf"
            self._answer_client()
        elif self._upstream.eof:
            self._report("upstream_tls", f"{self.host}:{self.port} closed during the TLS handshake", "", "")
            self._client.out += refusal_bytes(502, f"sandboxd: {self.host}:{self.port} closed during the TLS "
                                                   "handshake")
            self._finish()

    def _leaf_ready(self, future: "Future[ssl.SSLContext]") -> None:
        if self.closed:
            return
        try:
            self._leaf = future.result()
        except Exception as exc:  # noqa: BLE001 (a bug in minting must close this connection only)
            self._report("internal", f"no certificate for {self.host}: {type(exc).__name__}", "", "")
            self.close()
            return
        self._answer_client()
        self._update()

    def _answer_client(self) -> None:
        """Both the upstream verified and the leaf minted: answer the CONNECT."""
        if self.phase != "leaf" or self._leaf is None:
            return
        self.phase = "client"
        self.deadline = self._idle_deadline = time.monotonic() + HANDSHAKE_SECONDS
        self._client.out += self._established
        self._flush(self._client)

    def _step_client_handshake(self) -> None:
        tls = self._client_tls
        assert tls is not None
        try:
            done = tls.handshake()
        except ssl.SSLError as exc:
            self._pass_ciphertext()
            self._report("client_tls", f"the sandbox's TLS handshake for {self.host} failed "
                                       f"({getattr(exc, 'reason', None) or type(exc).__name__})", "", "")
            self._finish()
            return
        self._pass_ciphertext()
        if not done:
            if self._client.eof:
                self.close()
            return
        self.phase = "mediate"
        self.deadline = self._idle_deadline = time.monotonic() + IDLE_SECONDS
        self.mediator = Mediator(self.host, self.port, default_port=443, credentials=self._credentials,
                                 on_request=self._on_request, report=self._report)
        self.mediator.on_wake = self._woken
        self._mediate_client()
        self._mediate_upstream()

    def _woken(self) -> None:
        """A held request was judged: pass on what the mediator has now."""
        if not self.closed:
            self._pass_plaintext()
            self._watch_head()
            self._update()

    def _mediate_client(self) -> None:
        tls, mediator = self._client_tls, self.mediator
        assert tls is not None and mediator is not None
        plain = tls.read()
        if plain:
            mediator.from_client(plain)
        if tls.eof or self._client.eof:
            mediator.from_client(b"")
        self._pass_plaintext()

    def _mediate_upstream(self) -> None:
        mediator = self.mediator
        assert mediator is not None
        plain = self._upstream_tls.read()
        if plain:
            mediator.from_upstream(plain)
        if self._upstream_tls.eof or self._upstream.eof:
            mediator.from_upstream(b"")
        self._pass_plaintext()

    # -- writing ---------------------------------------------------------------------------------

    def _pass_plaintext(self) -> None:
        mediator, client_tls = self.mediator, self._client_tls
        assert mediator is not None and client_tls is not None
        if mediator.to_client:
            client_tls.write(bytes(mediator.to_client))
            mediator.to_client.clear()
        if mediator.to_upstream:
            self._upstream_tls.write(bytes(mediator.to_upstream))
            mediator.to_upstream.clear()
        if mediator.done:
            self._finish()
        self._pass_ciphertext()

    def _pass_ciphertext(self) -> None:
        for tls, side in ((self._upstream_tls, self._upstream), (self._client_tls, self._client)):
            if tls is not None:
                pending = tls.pending_out()
                if pending:
                    side.out += pending
                    self._flush(side)

    def _finish(self) -> None:
        """Stop reading; close once what is pending has been sent."""
        self._closing = True

    def _update(self) -> None:
        if self.closed:
            return
        if self._closing and not self._client.out and not self._upstream.out:
            self.close()
            return
        for side in (self._client, self._upstream):
            reading = not self._closing and not side.eof and self.room(side)
            if side is self._client and self.phase in ("upstream", "leaf"):
                reading = False                          # the CONNECT is not answered yet
            wanted = (READ if reading else 0) | (WRITE if side.out else 0)
            self._loop.watch(side.sock, side.events, wanted, side)
            side.events = wanted
        if self._client.eof and self._upstream.eof:
            self.close()


__all__ = ["ESTABLISHED", "HANDSHAKE_SECONDS", "Intercepted", "Interceptor", "Paired"]
