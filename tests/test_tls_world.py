"""The TLS world of tests/tls_world.py works as its users expect, seen from the host (no sandbox):
each check here is what a credentials or interception test relies on."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path

import pytest

from conftest import BASE_ENV
from tls_world import (API_HOST, META_HOST, NAME_TABLE, NAMES, OTHER_HOST, SECRET, TlsWorld, tls_world,  # noqa: F401 - the fixture
                       ws_frame)

pytestmark = pytest.mark.timeout(300)


def curl(world: TlsWorld, *args: str) -> subprocess.CompletedProcess[str]:
    resolve = [item for host in (API_HOST, OTHER_HOST) for item in ("--resolve", f"{host}:443:{NAME_TABLE[host]}")]
    return subprocess.run(["curl", "-sS", "--noproxy", "*", "--cacert", str(world.ca_file), *resolve, *args],
                          capture_output=True, text=True, timeout=60, env=BASE_ENV)


def test_the_world_leaves_nothing_behind() -> None:
    """First in the module: the module's world (the fixture) would hold the machine-wide lock."""
    world = TlsWorld().build()
    names = (world.world.gw, world.world.pv, world.base)
    world.teardown()
    listed = subprocess.run(["ip", "-j", "link", "show"], capture_output=True, text=True, check=True).stdout
    links = {link["ifname"] for link in json.loads(listed)}
    assert not {f"{names[0]}h", f"{names[1]}h"} & links
    assert names[0] not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not Path(names[2]).exists()


def test_the_upstreams_record_what_they_receive(tls_world: TlsWorld) -> None:  # noqa: F811
    tls_world.api.clear()
    got = curl(tls_world, "-H", f"Authorization: Bearer {SECRET.decode()}", tls_world.url("/check"))
    assert got.stdout == "ok", got.stderr
    posted = curl(tls_world, "-d", "payload=1", tls_world.url("/submit?x=1"))
    assert posted.stdout == "got 9 bytes: payload=1", posted.stderr
    other = curl(tls_world, tls_world.url("/there", OTHER_HOST))
    assert other.stdout == "hello /there", other.stderr
    seen = tls_world.api.seen
    assert [(s.method, s.path) for s in seen] == [("GET", "/check"), ("POST", "/submit?x=1")]
    assert seen[0].headers["authorization"] == f"Bearer {SECRET.decode()}"
    assert seen[1].body == b"payload=1"
    assert [s.path for s in tls_world.other.seen][-1] == "/there"


def test_a_client_without_the_world_ca_is_refused(tls_world: TlsWorld) -> None:  # noqa: F811
    """Control for every 'the sandbox trusts the proxy' test: the world's certificate is no public one."""
    got = subprocess.run(["curl", "-sS", "--noproxy", "*", "--resolve", f"{API_HOST}:443:{NAME_TABLE[API_HOST]}",
                          tls_world.url("/check")], capture_output=True, text=True, timeout=60, env=BASE_ENV)
    assert got.returncode == 60, got.stderr                     # CURLE_PEER_FAILED_VERIFICATION


def test_streams_arrive_in_pieces(tls_world: TlsWorld) -> None:  # noqa: F811
    sse = curl(tls_world, "-N", tls_world.url("/sse?count=3&gap=0.05"))
    assert sse.stdout == "".join(f"id: {n}\ndata: event {n}\n\n" for n in range(3)), sse.stderr
    chunked = curl(tls_world, "--raw", tls_world.url("/chunked?count=2"))
    assert chunked.stdout == "8\nchunk 0\n\n8\nchunk 1\n\n0\n\n", chunked.stderr      # text mode: CRLF read as LF


def test_the_gated_stream_waits_for_its_acks(tls_world: TlsWorld) -> None:  # noqa: F811
    before = tls_world.api.gate_timeouts
    with tls_world.connect() as tls:
        tls.sendall(f"GET /sse-gated?count=3 HTTP/1.1\r\nHost: {API_HOST}\r\n\r\n".encode())
        reader = tls.makefile("rb")
        for number in range(3):
            while reader.readline().strip() != f"data: event {number}".encode():
                pass
            if number < 2:
                ack = curl(tls_world, tls_world.url("/sse-ack"))
                assert ack.stdout == "ack", ack.stderr
    assert tls_world.api.gate_timeouts == before


def test_the_websocket_echoes(tls_world: TlsWorld) -> None:  # noqa: F811
    with tls_world.connect() as tls:
        tls.sendall(f"GET /ws HTTP/1.1\r\nHost: {API_HOST}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                    f"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n".encode())
        head = b""
        while b"\r\n\r\n" not in head:
            head += tls.recv(1)
        assert head.startswith(b"HTTP/1.1 101"), head
        assert b"Sec-WebSocket-Accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo=" in head   # RFC 6455's example
        tls.sendall(ws_frame(1, b"hello world", mask=b"abcd"))
        echo = b""
        while len(echo) < 13:
            echo += tls.recv(64)
        assert echo == ws_frame(1, b"hello world")


def test_git_clones_and_pushes_over_https(tls_world: TlsWorld, tmp_path: Path) -> None:  # noqa: F811
    env = {**BASE_ENV, "GIT_SSL_CAINFO": str(tls_world.ca_file), "GIT_CONFIG_NOSYSTEM": "1", "HOME": str(tmp_path),
           "GIT_AUTHOR_NAME": "t", "GIT_COMMITTER_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_EMAIL": "t@t"}
    resolve = ["-c", f"http.curloptResolve={API_HOST}:443:{NAME_TABLE[API_HOST]}"]
    clone = subprocess.run(["git", *resolve, "clone", "-q", tls_world.git_url, str(tmp_path / "c")], env=env,
                           capture_output=True, text=True, timeout=120)
    assert clone.returncode == 0, clone.stderr
    subprocess.run(["git", "-C", str(tmp_path / "c"), "commit", "-q", "--allow-empty", "-m", "second"], env=env,
                   check=True)
    push = subprocess.run(["git", *resolve, "-C", str(tmp_path / "c"), "push", "-q", "origin", "main"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert push.returncode == 0, push.stderr
    log = subprocess.run(["git", "-C", str(tls_world.git_root / "repo.git"), "log", "--format=%s"], env=env,
                         capture_output=True, text=True, check=True)
    assert log.stdout.split() == ["second", "first"]


def lookup(name: str, qtype: int = 1) -> tuple[int, list[str]]:
    query = os.urandom(2) + b"\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00" + b"".join(
        bytes([len(label)]) + label.encode() for label in name.split(".")) + b"\x00" + qtype.to_bytes(2, "big") + b"\x00\x01"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(10)
        sock.sendto(query, (NAMES, 53))
        reply = sock.recv(512)
    answers = int.from_bytes(reply[6:8], "big")
    return reply[3] & 0x0F, [socket.inet_ntoa(reply[-4:])] if answers else []


@pytest.mark.parametrize("name", [API_HOST, OTHER_HOST, META_HOST])
def test_names_resolve_in_the_world(tls_world: TlsWorld, name: str) -> None:  # noqa: F811
    assert lookup(name) == (0, [NAME_TABLE[name]])
    assert lookup(name, 28) == (0, [])                           # AAAA: none, but the name exists


def test_other_names_do_not_exist(tls_world: TlsWorld) -> None:  # noqa: F811
    assert lookup("nothing.test.example") == (3, [])
