"""A plain ``http://`` connection through the egress proxy, every request read (design §4.6).

A client sends a proxy absolute-form requests (``GET http://host/path``), several on one
keep-alive connection. The egress proxy used to rewrite the first and relay the rest unread, so
endpoint rules could judge only the first. Here each request goes through http1.Mediator (no TLS,
no credential swap: a secret never travels in clear): it must name the connection's host and port,
is judged by the request hook, and goes on in origin-form. Sockets and backpressure as
intercepted.Intercepted's (both are intercepted.Paired), without the TLS phases; idle for tcp_relay.IDLE_SECONDS, it is closed.
"""

from __future__ import annotations

import socket
from typing import Callable

from sandboxd.network.event_loop import READ, WRITE, EventLoop
from sandboxd.network.interception.http1 import Mediator, Report, RequestHook
from sandboxd.network.interception.intercepted import Paired, Side
from sandboxd.network.tcp_relay import IDLE_SECONDS

HTTP_PORT = 80


class PlainMediated(Paired):
    """The plain HTTP exchange with ``host``:``port`` (as matched), from the bytes ``first`` the
    proxy already read (the first request's head, absolute-form, and what followed it)."""

    def __init__(self, loop: EventLoop, client: socket.socket, upstream: socket.socket, host: str, port: int, *,
                 first: bytes, on_request: RequestHook | None = None, report: Report | None = None,
                 on_close: Callable[[], None] = lambda: None) -> None:
        super().__init__(loop, client, upstream, IDLE_SECONDS, on_close)
        self.http = Mediator(host, port, default_port=HTTP_PORT, on_request=on_request, report=report,
                             absolute_form=True)
        self.mediator = self.http
        self.http.on_wake = self._woken
        self.http.from_client(first)
        self._pass()
        self._watch_head()
        self._update()

    def _woken(self) -> None:
        """A held request was judged: pass on what the mediator has now."""
        if not self.closed:
            self._pass()
            self._watch_head()
            self._update()

    def _pull(self, side: Side) -> None:
        data = self._receive(side)
        if data is None:
            return
        side.eof = not data
        if side is self._client:
            self.http.from_client(data)
        else:
            self.http.from_upstream(data)
        self._pass()

    def _pass(self) -> None:
        mediator = self.http
        for pending, side in ((mediator.to_client, self._client), (mediator.to_upstream, self._upstream)):
            if pending:
                side.out += pending
                pending.clear()
                self._flush(side)

    def _update(self) -> None:
        if self.closed:
            return
        done = self.http.done
        if (done or (self._client.eof and self._upstream.eof)) and not self._client.out and not self._upstream.out:
            self.close()
            return
        for side in (self._client, self._upstream):
            reading = not done and not side.eof and self.room(side)
            wanted = (READ if reading else 0) | (WRITE if side.out else 0)
            self._loop.watch(side.sock, side.events, wanted, side)
            side.events = wanted


__all__ = ["PlainMediated"]
