"""The HTTP/1.1 mediator against request smuggling and oversized heads: each request of the corpus
is sent byte for byte inside TLS through the intercepting proxy to a raw upstream that records
exactly what it received. Each must get a 4xx and reach the upstream as nothing, or reach it as
exactly one well-formed request: never two, never bytes the proxy did not frame itself.
Plus the mediator's own rules (Host, target form, hop-by-hop headers, h2c, pipelining) and the
credential swap and scrubbing in pieces (sans-IO, no sockets).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import h11
import pytest

from interception_helpers import API, SECRET, RawUpstream, World, credential_set
from sandboxd.network.credentials import Scrubber, new_phantom
from sandboxd.network.interception.http1 import MAX_HEADERS, MAX_REQUEST_HEAD, Mediator, Refusal

PHANTOM = new_phantom()


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    w = World(tmp_path_factory.mktemp("mediator"), raw=True)
    try:
        yield w
    finally:
        w.close()


def _upstream_saw(world: World, before: int) -> list[h11.Request]:
    """The requests in what the raw upstream received on the connection made after ``before``
    records (the proxy makes one upstream connection per CONNECT), as an HTTP server reads them."""
    upstream = world.upstream
    assert isinstance(upstream, RawUpstream)
    end = time.monotonic() + 30
    while time.monotonic() < end:
        with upstream.lock:
            if len(upstream.received) > before:
                data = upstream.received[before]
                break
        time.sleep(0.02)
    else:
        raise AssertionError("the upstream connection never ended")
    server = h11.Connection(h11.SERVER, max_incomplete_event_size=1 << 20)
    server.receive_data(data)
    server.receive_data(b"")
    requests: list[h11.Request] = []
    while True:
        event = server.next_event()      # raises on anything malformed: the proxy never sends that
        if event is h11.NEED_DATA or event is h11.PAUSED or isinstance(event, h11.ConnectionClosed):
            break
        if isinstance(event, h11.Request):
            requests.append(event)
        if isinstance(event, h11.EndOfMessage):
            server.send(h11.Response(status_code=200, headers=[("Content-Length", "0")]))
            server.send(h11.EndOfMessage())
            if server.our_state is h11.MUST_CLOSE:
                break
            server.start_next_cycle()
    return requests


def _exchange(world: World, request: bytes) -> tuple[bytes, list[h11.Request]]:
    upstream = world.upstream
    assert isinstance(upstream, RawUpstream)
    with upstream.lock:
        before = len(upstream.received)
    answer = world.exchange(request.replace(b"@HOST@", f"{API}:{upstream.port}".encode()))
    return answer, _upstream_saw(world, before)


HEAD = b"Host: @HOST@\r\nConnection: close\r\n"          # @HOST@: the upstream's authority

# Each: the request bytes, the status the sandbox must get when it is refused.
SMUGGLING = {
    "content-length and transfer-encoding": (
        b"POST / HTTP/1.1\r\n" + HEAD + b"Content-Length: 6\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"0\r\n\r\nGET /admin HTTP/1.1\r\nHost: x\r\n\r\n", 400),
    "two content-lengths": (
        b"POST / HTTP/1.1\r\n" + HEAD + b"Content-Length: 5\r\nContent-Length: 40\r\n\r\nhello", 400),
    "xchunked": (b"POST / HTTP/1.1\r\n" + HEAD + b"Transfer-Encoding: xchunked\r\n\r\n0\r\n\r\n", 400),
    "chunked twice": (b"POST / HTTP/1.1\r\n" + HEAD + b"Transfer-Encoding: chunked, chunked\r\n\r\n0\r\n\r\n",
                      400),
    "space before colon": (b"POST / HTTP/1.1\r\n" + HEAD + b"Content-Length : 5\r\n\r\nhello", 400),
    "nul in a value": (b"GET / HTTP/1.1\r\n" + HEAD + b"X-A: a\x00b\r\n\r\n", 400),
    "http/2 preface": (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 400),
    "absolute-form inside tls": (b"GET https://" + API.encode() + b"/ HTTP/1.1\r\n" + HEAD + b"\r\n", 400),
    "connect inside": (b"CONNECT evil.test:443 HTTP/1.1\r\n" + HEAD + b"\r\n", 405),
    "another host": (b"GET / HTTP/1.1\r\nHost: evil.test\r\nConnection: close\r\n\r\n", 421),
    "two hosts": (b"GET / HTTP/1.1\r\n" + HEAD + b"Host: evil.test\r\n\r\n", 400),
    "a huge head": (b"GET / HTTP/1.1\r\n" + HEAD + b"X-Big: " + b"a" * MAX_REQUEST_HEAD + b"\r\n\r\n", 431),
    "too many fields": (b"GET / HTTP/1.1\r\n" + HEAD + b"".join(b"X-%d: v\r\n" % n for n in range(MAX_HEADERS))
                        + b"\r\n", 431),
}


@pytest.mark.parametrize("case", sorted(SMUGGLING))
def test_a_smuggling_attempt_is_refused_and_reaches_nothing(world: World, case: str) -> None:
    request, status = SMUGGLING[case]
    answer, seen = _exchange(world, request)
    assert answer.startswith(b"HTTP/1.1 %d " % status), answer[:200]
    assert seen == []


def test_a_request_hidden_in_a_body_stays_body(world: World) -> None:
    hidden = b"GET /admin HTTP/1.1\r\nHost: x\r\n\r\n"
    answer, seen = _exchange(world, b"POST / HTTP/1.1\r\n" + HEAD + b"Content-Length: %d\r\n\r\n" % len(hidden)
                             + hidden)
    assert answer.startswith(b"HTTP/1.1 200 ")
    assert [(r.method, r.target) for r in seen] == [(b"POST", b"/")]


def test_obs_fold_reaches_the_upstream_unfolded_in_one_request(world: World) -> None:
    answer, seen = _exchange(world, b"GET /fold HTTP/1.1\r\n" + HEAD + b"X-Folded: a\r\n b\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 200 ")
    [request] = seen
    assert dict(request.headers)[b"x-folded"] == b"a b"


def test_a_bad_chunk_is_refused_and_nothing_after_it_reaches_the_upstream(world: World) -> None:
    upstream = world.upstream
    assert isinstance(upstream, RawUpstream)
    with upstream.lock:
        before = len(upstream.received)
    answer = world.exchange((b"POST /chunks HTTP/1.1\r\n" + HEAD + b"Transfer-Encoding: chunked\r\n\r\n"
                             b"zz\r\nGET /admin HTTP/1.1\r\nHost: x\r\n\r\n0\r\n\r\n").replace(
                                 b"@HOST@", f"{API}:{upstream.port}".encode()))
    assert answer.startswith(b"HTTP/1.1 400 ")
    end = time.monotonic() + 30
    while len(upstream.received) <= before and time.monotonic() < end:
        time.sleep(0.02)
    data = upstream.received[before]
    # The head went on as it came (bodies stream); the body never did: one unfinished request only.
    assert data.count(b"HTTP/1.1") == 1 and b"/admin" not in data and data.startswith(b"POST /chunks ")


def test_bare_line_feeds_reach_the_upstream_as_one_well_formed_request(world: World) -> None:
    answer, seen = _exchange(world, b"GET /lf HTTP/1.1\nHost: @HOST@\nConnection: close\n\n")
    # h11 reads bare LF as the RFC allows a recipient to; what goes on is re-serialised (CRLF).
    assert answer.startswith(b"HTTP/1.1 200 ")
    assert [(r.method, r.target) for r in seen] == [(b"GET", b"/lf")]


def test_pipelined_requests_pass_in_order_one_by_one(world: World) -> None:
    answer, seen = _exchange(world, b"GET /1 HTTP/1.1\r\nHost: @HOST@\r\n\r\n" + b"GET /2 HTTP/1.1\r\n" + HEAD
                             + b"\r\n")
    assert answer.count(b"HTTP/1.1 200 ") == 2
    assert [r.target for r in seen] == [b"/1", b"/2"]


def test_hop_by_hop_and_h2c_upgrade_are_not_passed_on(world: World) -> None:
    answer, seen = _exchange(world, b"GET / HTTP/1.1\r\n" + b"Host: @HOST@\r\n"
                             + b"Connection: close, Upgrade, HTTP2-Settings, X-Hop\r\nUpgrade: h2c\r\n"
                             b"HTTP2-Settings: AAMAAABkAAQAAP__\r\nX-Hop: 1\r\nProxy-Authorization: Basic eDp5\r\n"
                             b"Keep-Alive: timeout=5\r\nX-Kept: yes\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 200 ")
    [request] = seen
    names = {name for name, _ in request.headers}
    assert b"x-kept" in names
    assert not names & {b"upgrade", b"http2-settings", b"x-hop", b"proxy-authorization", b"keep-alive"}


# -- sans-IO: the mediator alone ------------------------------------------------------------------

def _mediate(request: bytes, *, credentials: bool = True, host: str = API, port: int = 443) -> Mediator:
    mediator = Mediator(host, port, credentials=credential_set(port, PHANTOM) if credentials else None)
    mediator.from_client(request)
    return mediator


def _parsed(data: bytes) -> h11.Request:
    server = h11.Connection(h11.SERVER)
    server.receive_data(bytes(data))
    event = server.next_event()
    assert isinstance(event, h11.Request)
    return event


def test_the_swap_puts_the_secret_in_the_credentials_header_only() -> None:
    mediator = _mediate(f"GET / HTTP/1.1\r\nHost: {API}\r\nAuthorization: token {PHANTOM}\r\n"
                        f"X-Other: {PHANTOM}\r\n\r\n".encode())
    request = _parsed(mediator.to_upstream)
    headers = dict(request.headers)
    assert headers[b"authorization"] == b"Bearer " + SECRET
    assert headers[b"x-other"] == PHANTOM.encode()                 # the phantom elsewhere stays
    assert mediator.swaps == 1
    # Control: without credentials (plain HTTP, another host) the phantom is passed as sent.
    plain = _mediate(f"GET / HTTP/1.1\r\nHost: {API}\r\nAuthorization: token {PHANTOM}\r\n\r\n".encode(),
                     credentials=False)
    assert dict(_parsed(plain.to_upstream).headers)[b"authorization"] == f"token {PHANTOM}".encode()


def test_a_refusal_body_never_holds_the_secret() -> None:
    mediator = _mediate(f"GET http://x/ HTTP/1.1\r\nHost: {API}\r\nAuthorization: Bearer {PHANTOM}\r\n\r\n".encode())
    assert mediator.done and not mediator.to_upstream
    assert SECRET not in mediator.to_client and mediator.to_client.startswith(b"HTTP/1.1 400 ")


def test_a_response_split_inside_the_secret_is_still_scrubbed() -> None:
    mediator = _mediate(f"GET / HTTP/1.1\r\nHost: {API}\r\n\r\n".encode())
    body = b"you sent " + SECRET + b" as your token\n"
    response = b"HTTP/1.1 200 OK\r\nX-Echo: " + SECRET + b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body
    cut = response.index(SECRET, response.index(b"\r\n\r\n")) + 7
    mediator.from_upstream(response[:cut])
    first = bytes(mediator.to_client)
    mediator.from_upstream(response[cut:])
    out = first + bytes(mediator.to_client[len(first):])
    assert SECRET not in out and SECRET[:7] not in out[out.index(b"\r\n\r\n"):]
    assert out.count(b"*" * len(SECRET)) == 2                       # head and body, same lengths
    assert out.endswith(b" as your token\n")


def test_the_scrubber_holds_back_only_a_possible_start_of_the_secret() -> None:
    scrubber = Scrubber([SECRET])
    assert scrubber.feed(b"data: event\n\n") == b"data: event\n\n"     # an SSE event passes at once
    assert scrubber.feed(b"abc " + SECRET[:5]) == b"abc "
    assert scrubber.feed(SECRET[5:] + b" end") == b"*" * len(SECRET) + b" end"
    assert scrubber.feed(b"x" + SECRET[:3]) == b"x"
    assert scrubber.finish() == SECRET[:3]                           # at the end it was not the secret


def test_a_secret_prints_as_secret_and_is_never_pickled() -> None:
    import pickle

    from sandboxd.network.credentials import Secret

    secret = Secret(SECRET)
    assert SECRET.decode() not in repr(secret) and SECRET.decode() not in str(secret)
    with pytest.raises(TypeError):
        pickle.dumps(secret)
    credentials = credential_set(443, PHANTOM)
    assert SECRET.decode() not in repr(credentials.for_upstream(API, 443))
    secret.wipe()
    assert secret.render(credential_set(443, PHANTOM).for_upstream(API, 443)[0].spec) == b"Bearer " + b"\0" * len(SECRET)


# -- the hostile passes' findings (re-applied): scrubbing every echo form, plaintext only ------------

ODD_SECRET = b"ab/c\"d<e>&f+g h'ij0123456789"        # one of each character some escaping changes


def _answered(mediator: Mediator, response: bytes) -> bytes:
    mediator.from_upstream(response)
    return bytes(mediator.to_client)


def _odd(request: bytes = b"") -> Mediator:
    mediator = Mediator(API, 443, credentials=credential_set(443, PHANTOM, secret=ODD_SECRET))
    mediator.from_client(request or f"GET / HTTP/1.1\r\nHost: {API}\r\nAuthorization: Bearer {PHANTOM}\r\n\r\n"
                         .encode())
    return mediator


def test_every_echo_form_of_the_secret_is_scrubbed_from_a_response() -> None:
    import base64
    import html
    import json
    import urllib.parse

    text = ODD_SECRET.decode()
    plain_forms = [ODD_SECRET, json.dumps(text).encode(), urllib.parse.quote(text, safe="").encode(),
                   urllib.parse.quote(text, safe="").lower().encode(), html.escape(text).encode()]
    wrapped = [base64.b64encode(prefix + ODD_SECRET + b"tail") for prefix in (b"", b"x", b"xy", b"user:")]
    body = b"\n".join(plain_forms + wrapped) + b"\n"
    name_form = base64.urlsafe_b64encode(b"x" + ODD_SECRET + b"z")        # a header name may hold it
    mediator = _odd()
    out = _answered(mediator, b"HTTP/1.1 200 you sent " + urllib.parse.quote(text, safe="").encode() + b"\r\n"
                    + b"X-" + name_form.rstrip(b"=") + b": 1\r\nX-Echo: " + json.dumps(text).encode() + b"\r\n"
                    + b"Content-Length: %d\r\n\r\n" % len(body) + body)
    assert name_form[2:30] not in out and b"\r\nX-" in out
    for form in plain_forms:
        assert form.strip(b'"') not in out, form
    for whole in wrapped:
        assert whole not in out
    assert out.count(b"\n") >= len(plain_forms) + len(wrapped)            # framing kept: same lengths
    # Control: the same response on a connection without the credential passes as sent.
    bare = Mediator(API, 443)
    bare.from_client(f"GET / HTTP/1.1\r\nHost: {API}\r\n\r\n".encode())
    assert body in _answered(bare, b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)


def test_a_reason_phrase_is_scrubbed_and_printable() -> None:
    out = _answered(_odd(), b"HTTP/1.1 200 OK " + ODD_SECRET + b" \x1b[2J\r\nContent-Length: 0\r\n\r\n")
    status_line = out.split(b"\r\n")[0]
    assert ODD_SECRET not in status_line and b"\x1b" not in status_line, status_line


def test_a_502_for_a_malformed_response_quotes_no_secret() -> None:
    reports: list[tuple[str, str, str, str]] = []
    mediator = Mediator(API, 443, credentials=credential_set(443, PHANTOM), report=lambda *r: reports.append(r))
    mediator.from_client(f"GET / HTTP/1.1\r\nHost: {API}\r\n\r\n".encode())
    out = _answered(mediator, b"HTTP/1.1 200 OK\r\nbad header " + SECRET + b"\x1b\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 502") and b"illegal header line" in out, out      # control: it is quoted
    assert SECRET not in out and b"\x1b" not in out
    assert reports and all(SECRET.decode() not in detail for _, detail, _, _ in reports)


def test_a_credential_connection_asks_for_identity_and_no_range() -> None:
    request = (f"GET / HTTP/1.1\r\nHost: {API}\r\nAuthorization: Bearer {PHANTOM}\r\nAccept-Encoding: gzip, br\r\n"
               "Range: bytes=5-\r\nIf-Range: x\r\n\r\n").encode()
    headers = dict(_parsed(_mediate(request).to_upstream).headers)
    assert headers[b"accept-encoding"] == b"identity" and b"range" not in headers and b"if-range" not in headers
    # Control: without credentials the client's own choice passes.
    headers = dict(_parsed(_mediate(request, credentials=False).to_upstream).headers)
    assert headers[b"accept-encoding"] == b"gzip, br" and headers[b"range"] == b"bytes=5-"


def test_an_encoded_response_on_a_credential_connection_is_a_502() -> None:
    mediator = _mediate(f"GET / HTTP/1.1\r\nHost: {API}\r\nAuthorization: Bearer {PHANTOM}\r\n\r\n".encode())
    out = _answered(mediator, b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: 3\r\n\r\nabc")
    assert out.startswith(b"HTTP/1.1 502") and b"abc" not in out, out


def test_an_upgrade_on_a_connection_that_carries_a_credential_is_refused() -> None:
    upgrade = (f"GET /ws HTTP/1.1\r\nHost: {API}\r\nAuthorization: Bearer {PHANTOM}\r\nConnection: Upgrade\r\n"
               "Upgrade: websocket\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
               "\r\n").encode()
    mediator = _mediate(upgrade)
    assert mediator.to_client.startswith(b"HTTP/1.1 403") and not mediator.to_upstream and mediator.done
    # Control: the same upgrade without the credential's header passes on.
    passed = _mediate(upgrade.replace(f"Authorization: Bearer {PHANTOM}\r\n".encode(), b""), credentials=False)
    assert dict(_parsed(passed.to_upstream).headers)[b"upgrade"] == b"websocket"


@pytest.mark.parametrize("header", ["X-HTTP-Method-Override", "X-HTTP-Method", "X-Method-Override"])
def test_a_method_override_is_judged_as_the_method_it_names(header: str) -> None:
    seen: list[str] = []

    def hook(method: str, target: str) -> Refusal | None:
        seen.append(method)
        return None if method == "GET" else Refusal(403, f"sandboxd: {method} is not allowed")

    mediator = Mediator(API, 443, on_request=hook)
    mediator.from_client(f"GET / HTTP/1.1\r\nHost: {API}\r\n{header}: delete\r\n\r\n".encode())
    assert seen == ["GET", "DELETE"] and mediator.to_client.startswith(b"HTTP/1.1 403") and not mediator.to_upstream
    control = Mediator(API, 443, on_request=hook)
    control.from_client(f"GET / HTTP/1.1\r\nHost: {API}\r\n\r\n".encode())
    assert control.to_upstream and not control.to_client


@pytest.mark.parametrize("method, override", [("*", ""), ("G-T", ""), ("GET", "*"), ("GET", "DELETE;x")])
def test_a_method_or_override_that_is_not_letters_is_a_400(method: str, override: str) -> None:
    seen: list[str] = []
    mediator = Mediator(API, 443, on_request=lambda m, t: seen.append(m))
    extra = f"X-HTTP-Method-Override: {override}\r\n" if override else ""
    mediator.from_client(f"{method} / HTTP/1.1\r\nHost: {API}\r\n{extra}\r\n".encode())
    assert mediator.to_client.startswith(b"HTTP/1.1 400") and not mediator.to_upstream and seen == []


def test_a_refusal_body_is_at_most_4_kib() -> None:
    from sandboxd.network.interception.http1 import MAX_REFUSAL_BODY, refusal_bytes

    answer = refusal_bytes(403, "x" * 100_000)
    assert len(answer.partition(b"\r\n\r\n")[2]) == MAX_REFUSAL_BODY
    assert len(refusal_bytes(403, "short").partition(b"\r\n\r\n")[2]) == len("short\n")        # control


def test_a_pending_verdict_holds_the_request_and_its_body_until_it_settles() -> None:
    from sandboxd.network.interception.http1 import Pending

    pendings: list[Pending] = []

    def hook(method: str, target: str) -> Pending:
        pendings.append(Pending())
        return pendings[-1]

    woken: list[int] = []
    mediator = Mediator(API, 443, on_request=hook)
    mediator.on_wake = lambda: woken.append(1)
    mediator.from_client(f"POST /a HTTP/1.1\r\nHost: {API}\r\nContent-Length: 4\r\n\r\nbody".encode())
    assert len(pendings) == 1 and not mediator.to_upstream and not mediator.to_client      # held, body too
    pendings[0].settle(None)
    assert woken == [1] and mediator.to_upstream.startswith(b"POST /a HTTP/1.1") and mediator.to_upstream.endswith(b"body")
    # A refusal settles the next request: 403, nothing more passed.
    mediator.from_upstream(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
    sent = len(mediator.to_upstream)
    mediator.from_client(f"GET /b HTTP/1.1\r\nHost: {API}\r\n\r\n".encode())
    assert len(pendings) == 2
    pendings[1].settle(Refusal(403, "sandboxd: no"))
    assert b"HTTP/1.1 403" in mediator.to_client and len(mediator.to_upstream) == sent and mediator.done
