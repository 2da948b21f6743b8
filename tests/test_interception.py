"""The interception room end to end on loopback: real clients (curl, Python requests and httpx,
websockets) through a CONNECT front and ``Intercepted``, to an in-process HTTPS upstream whose CA
only the proxy trusts. The phantom becomes the secret for the credential's upstream only; the
secret never comes back; SSE arrives before the stream ends; an untrusted upstream gets nothing.
"""

from __future__ import annotations

import os
import shutil
import socket
import ssl
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from interception_helpers import API, OTHER, SECRET, UpstreamCA, Upstream, World, credential_set
from sandboxd.network.credentials import new_phantom
from sandboxd.network.interception.http1 import Refusal
from sandboxd.policy.network import CredentialSpec

PHANTOM = new_phantom()


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    w = World(tmp_path, credentials=lambda port: credential_set(port, PHANTOM))
    try:
        yield w
    finally:
        w.close()


def _requests_get(world: World, url: str, **headers: str) -> tuple[int, str]:
    import requests

    with requests.Session() as session:
        session.trust_env = False
        answer = session.get(url, proxies={"https": world.proxy}, verify=str(world.ca_file), headers=headers,
                             timeout=30)
        return answer.status_code, answer.text


def test_requests_gets_the_secret_injected_while_holding_only_the_phantom(world: World) -> None:
    status, text = _requests_get(world, world.url("/check"), Authorization=f"Bearer {PHANTOM}")
    assert (status, text) == (200, "ok")
    method, path, headers = world.upstream.recorder.requests[-1]
    assert headers["authorization"] == "Bearer " + SECRET.decode()
    # Control: without the phantom the request stays anonymous (the upstream says bad).
    assert _requests_get(world, world.url("/check")) == (200, "bad")
    assert "authorization" not in world.upstream.recorder.requests[-1][2]


def test_the_phantom_sent_to_another_host_arrives_as_the_phantom(world: World) -> None:
    assert _requests_get(world, world.url("/check", OTHER), Authorization=f"Bearer {PHANTOM}") == (200, "bad")
    assert world.upstream.recorder.requests[-1][2]["authorization"] == f"Bearer {PHANTOM}"
    # Control: the same request to the credential's host gets the secret.
    assert _requests_get(world, world.url("/check"), Authorization=f"Bearer {PHANTOM}") == (200, "ok")


def test_the_phantom_to_the_same_host_on_another_port_stays_a_phantom(world: World, tmp_path: Path) -> None:
    second = Upstream(world.test_ca, tmp_path)
    try:
        url = f"https://{API}:{second.port}/check"
        assert _requests_get(world, url, Authorization=f"Bearer {PHANTOM}") == (200, "bad")
        assert second.recorder.requests[-1][2]["authorization"] == f"Bearer {PHANTOM}"
    finally:
        second.close()


def test_an_echoed_secret_is_scrubbed_from_heads_and_bodies(world: World) -> None:
    status, text = _requests_get(world, world.url("/echo-headers"), Authorization=f"Bearer {PHANTOM}")
    assert status == 200
    assert SECRET.decode() not in text
    assert "Bearer " + "*" * len(SECRET) in text
    # Control: the upstream did get (and echo) the secret itself.
    assert world.upstream.recorder.requests[-1][2]["authorization"] == "Bearer " + SECRET.decode()


def test_httpx_through_the_mediator(world: World) -> None:
    import httpx

    with httpx.Client(proxy=world.proxy, verify=world.client_context(), trust_env=False) as client:
        first = client.get(world.url("/check"), headers={"Authorization": f"Bearer {PHANTOM}"})
        second = client.post(world.url("/upload"), content=b"x" * 100_000)    # same connection, a body
    assert (first.status_code, first.text) == (200, "ok")
    assert second.status_code == 200 and second.text.startswith("got 100000 bytes")


def test_curl_through_the_mediator(world: World) -> None:
    curl = shutil.which("curl")
    assert curl is not None, "curl is not installed (packaging/setup.sh test installs it)"
    env = {key: value for key, value in os.environ.items() if "proxy" not in key.lower()}
    result = subprocess.run([curl, "-sS", "--proxy", world.proxy, "--cacert", str(world.ca_file),
                             "-H", f"Authorization: Bearer {PHANTOM}", world.url("/check"), world.url("/hello")],
                            capture_output=True, text=True, env=env, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "okhello /hello"


def test_sse_events_arrive_before_the_stream_ends(world: World) -> None:
    import requests

    with requests.Session() as session:
        session.trust_env = False
        answer = session.get(world.url("/sse"), proxies={"https": world.proxy}, verify=str(world.ca_file),
                             stream=True, timeout=30)
        lines = answer.iter_lines()
        first = next(lines)
        # The upstream holds the rest until this gate opens: the first event came through alone.
        assert first == b"data: event 0"
        assert not world.upstream.recorder.sse_gate.is_set()
        world.upstream.recorder.sse_gate.set()
        rest = [line for line in lines if line]
    assert rest == [b"data: event 1", b"data: event 2"]


def test_an_upstream_the_proxy_does_not_trust_gets_no_request(tmp_path: Path) -> None:
    world = World(tmp_path, credentials=lambda port: credential_set(port, PHANTOM))
    stranger = Upstream(UpstreamCA(), tmp_path)              # another CA: not the one the proxy trusts
    try:
        import requests

        with pytest.raises(requests.exceptions.ProxyError):
            _requests_get(world, f"https://{API}:{stranger.port}/check", Authorization=f"Bearer {PHANTOM}")
        assert stranger.recorder.requests == []
        assert any(kind == "upstream_tls" and "not trusted" in detail for kind, detail, _, _ in world.front.reports)
        # Control: the trusted upstream is reached through the same proxy.
        assert _requests_get(world, world.url("/check"), Authorization=f"Bearer {PHANTOM}") == (200, "ok")
    finally:
        stranger.close()
        world.close()


def test_the_request_hook_refuses_and_the_upstream_sees_nothing(tmp_path: Path) -> None:
    def only_get(method: str, target: str) -> Refusal | None:
        return None if method == "GET" else Refusal(403, "sandboxd: POST is not in the endpoint rules of "
                                                         f"{API}")

    world = World(tmp_path, on_request=only_get)
    try:
        import requests

        with requests.Session() as session:
            session.trust_env = False
            refused = session.post(world.url("/upload"), data=b"body", proxies={"https": world.proxy},
                                   verify=str(world.ca_file), timeout=30)
        assert refused.status_code == 403 and "endpoint rules" in refused.text
        assert world.upstream.recorder.requests == []
        assert _requests_get(world, world.url("/x")) == (200, "hello /x")       # control: GET passes
    finally:
        world.close()


def test_basic_credentials_for_git_style_clients(tmp_path: Path) -> None:
    import base64

    world = World(tmp_path, credentials=lambda port: credential_set(
        port, PHANTOM, spec=CredentialSpec("GIT_TOKEN", API, port, "Authorization", "Basic {}", "git")))
    try:
        sent = base64.b64encode(f"anyone:{PHANTOM}".encode()).decode()
        _requests_get(world, world.url("/x"), Authorization=f"Basic {sent}")
        got = world.upstream.recorder.requests[-1][2]["authorization"]
        assert got == "Basic " + base64.b64encode(b"git:" + SECRET).decode()
    finally:
        world.close()


def test_websocket_upgrade_passes_frames_both_ways(tmp_path: Path, world: World) -> None:
    from websockets.sync.client import connect
    from websockets.sync.server import serve

    def echo(websocket: object) -> None:
        for message in websocket:  # type: ignore[attr-defined]
            websocket.send("echo " + message)  # type: ignore[attr-defined]

    server = serve(echo, "127.0.0.1", 0, ssl=world.test_ca.server_context(tmp_path))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        port = server.socket.getsockname()[1]
        with connect(f"wss://{API}:{port}/ws", proxy=world.proxy, ssl=world.client_context(),
                     open_timeout=30) as websocket:
            for number in range(3):
                websocket.send(f"m{number}")
                assert websocket.recv(timeout=30) == f"echo m{number}"
    finally:
        server.shutdown()


def test_a_client_that_does_not_speak_tls_is_closed(world: World) -> None:
    with socket.create_connection(("127.0.0.1", world.front.port), timeout=30) as raw:
        raw.sendall(f"CONNECT {API}:{world.upstream.port} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        assert raw.recv(4096).startswith(b"HTTP/1.1 200")
        raw.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert raw.recv(4096) == b""
    assert world.wait_closed(1)
    assert any(kind == "protocol" for kind, *_ in world.front.reports)


def test_the_client_handshake_offers_http1_only(world: World) -> None:
    context = world.client_context()
    context.set_alpn_protocols(["h2", "http/1.1"])
    with socket.create_connection(("127.0.0.1", world.front.port), timeout=30) as raw:
        raw.sendall(f"CONNECT {API}:{world.upstream.port} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        assert raw.recv(4096).startswith(b"HTTP/1.1 200")
        with context.wrap_socket(raw, server_hostname=API) as tls:
            assert tls.selected_alpn_protocol() == "http/1.1"
            with pytest.raises(ssl.SSLCertVerificationError):
                # Control: the leaf is for API only; asked as another name it does not verify.
                other = socket.create_connection(("127.0.0.1", world.front.port), timeout=30)
                other.sendall(f"CONNECT {API}:{world.upstream.port} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
                other.recv(4096)
                try:
                    world.client_context().wrap_socket(other, server_hostname=OTHER)
                finally:
                    other.close()
