"""Behind a corporate proxy: every connection the egress proxy lets out goes on as a CONNECT through
it (issue 26 item 4; ``network.upstream_proxy``, ``--upstream-proxy``).

Our checks come first and are the same as without it (egress_proxy.EgressProxy.open_upstream): the
allowlist, endpoint rules, credentials, cloud metadata names, and the ranges of what the name
resolves to *here*. On networks where names resolve only at the corporate proxy (a split-horizon
or no DNS at all), the name is passed on unresolved and the range check cannot be made here: the
proxy says so in its log, once per name. A name that does resolve here to a refused range stays
refused unless root named that range in ``network.allowed_ranges``.

The corporate proxy is root's configuration, never the sandbox's choice: it is connected to from
the egress proxy's own network namespace (the host's), not the sandbox's, whose kernel filter
refuses the private ranges such proxies live in. Its answer to the CONNECT is read on the relay
loop (``UpstreamConnect``, never blocking): a head of at most ``MAX_REPLY_HEAD`` bytes within
tcp_relay.CONNECT_SECONDS, a 2xx status, or the sandbox gets a 502 and an ``upstream`` event quoting
the status line (printable). Bytes after the head are the tunnel's first ones. For an intercepted
host the real upstream's certificate is still verified end to end, through the tunnel
(upstream_tls: the host's store, ``network.upstream_ca_file``, which is ``ca_pem`` here, added by
whoever builds the interceptor's context).
"""

from __future__ import annotations

import ipaddress
import socket
import time
from typing import Callable

from sandboxd._record import Record
from sandboxd.network.event_loop import READ, WRITE, EventLoop
from sandboxd.network.tcp_relay import CONNECT_SECONDS
from sandboxd.printable import printable

MAX_REPLY_HEAD = 8192              # bytes of the corporate proxy's answer to a CONNECT
MAX_STATUS_SHOWN = 200             # characters of its status line quoted in an event


class UpstreamRoute(Record):
    """The corporate proxy: ``host`` (a host name or an IPv4 address) and ``port``, as
    config.split_upstream_proxy gives them from ``http://HOST:PORT``; ``ca_pem``: the certificates
    of ``network.upstream_ca_file`` (an intercepting proxy's CA, trusted for upstream servers)."""

    host: str
    port: int
    ca_pem: str = ""

    def text(self) -> str:
        return f"http://{self.host}:{self.port}"

    def literal(self) -> str | None:
        """The host as an IPv4 address, when it is one (nothing to resolve)."""
        try:
            return str(ipaddress.IPv4Address(self.host))
        except ValueError:
            return None

    def socket(self) -> socket.socket:
        """A non-blocking socket of this process's network namespace for connecting to it."""
        return socket.socket(socket.AF_INET, socket.SOCK_STREAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)


def connect_request(host: str, port: int) -> bytes:
    """The CONNECT sent to the corporate proxy for ``host``:``port`` (a host name as matched)."""
    authority = f"{host}:{port}"
    return f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode("ascii")


# done(why, first): why is None once the tunnel is open (first: bytes the proxy sent after its
# answer's head, the tunnel's first), else a printable line saying what failed.
Done = Callable[["str | None", bytes], None]


class UpstreamConnect:
    """On the loop: send the CONNECT for ``host``:``port`` on ``sock`` (connected to ``route``),
    read the answer's head, then ``done(None, first)`` or ``done(why, b"")``, once. The caller
    owns ``sock`` throughout (closes it on failure)."""

    def __init__(self, loop: EventLoop, sock: socket.socket, route: UpstreamRoute, host: str, port: int,
                 done: Done) -> None:
        self._loop, self._sock, self._route, self._done = loop, sock, route, done
        self._out = bytearray(connect_request(host, port))
        self._head = bytearray()
        self._events = 0
        self._finished = False
        self.deadline = time.monotonic() + CONNECT_SECONDS
        loop.add_timed(self)
        self._write()
        self._watch()

    def _watch(self) -> None:
        if self._finished:
            return
        wanted = WRITE if self._out else READ
        self._loop.watch(self._sock, self._events, wanted, self)
        self._events = wanted

    def on_ready(self, mask: int) -> None:
        if mask & WRITE:
            self._write()
        elif mask & READ:
            self._read()
        self._watch()

    def _write(self) -> None:
        try:
            sent = self._sock.send(self._out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._finish(f"the upstream proxy {self._route.text()} failed ({exc.strerror or type(exc).__name__})")
            return
        del self._out[:sent]

    def _read(self) -> None:
        try:
            chunk = self._sock.recv(MAX_REPLY_HEAD + 1 - len(self._head))
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._finish(f"the upstream proxy {self._route.text()} failed ({exc.strerror or type(exc).__name__})")
            return
        if not chunk:
            self._finish(f"the upstream proxy {self._route.text()} closed the connection before answering")
            return
        self._head += chunk
        end = self._head.find(b"\r\n\r\n")
        if end < 0:
            if len(self._head) > MAX_REPLY_HEAD:
                self._finish(f"the upstream proxy {self._route.text()} answered with a head over "
                             f"{MAX_REPLY_HEAD} bytes")
            return
        status_line = bytes(self._head[:self._head.find(b"\r\n")]).decode("latin-1")
        parts = status_line.split(" ", 2)
        if len(parts) >= 2 and parts[0].startswith("HTTP/1.") and len(parts[1]) == 3 and parts[1].startswith("2") \
                and parts[1].isdigit():
            self._finish(None, bytes(self._head[end + 4:]))
        else:
            self._finish(f"the upstream proxy {self._route.text()} refused the connection: "
                         f"{printable(status_line[:MAX_STATUS_SHOWN])}")

    def expire(self) -> None:
        self._finish(f"the upstream proxy {self._route.text()} did not answer in {CONNECT_SECONDS:.0f} s")

    def close(self) -> None:
        """Given up (the service closes): the caller closes the socket."""
        self._stop()

    def _stop(self) -> bool:
        if self._finished:
            return False
        self._finished = True
        self._loop.discard_timed(self)
        self._loop.watch(self._sock, self._events, 0, self)
        self._events = 0
        return True

    def _finish(self, why: str | None, first: bytes = b"") -> None:
        if self._stop():
            self._done(why, first)


__all__ = ["MAX_REPLY_HEAD", "UpstreamConnect", "UpstreamRoute", "connect_request"]
