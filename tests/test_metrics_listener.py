"""The metrics listener cannot be stalled by idle connections and serves concurrent scrapes: a real
`sandboxd serve --metrics`, real sockets. The control is the listener it replaced (prometheus'
http.server handler, one connection at a time), which one idle connection stalls."""

from __future__ import annotations

import socket
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

import pytest

from daemon_helpers import Daemon, DaemonFactory
from sandboxd.network.scrape_listener import PER_PEER

pytestmark = pytest.mark.timeout(240)
IDLE = 200
SCRAPES = 20


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def scrape(port: int, timeout: float = 30) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout).read().decode()


@pytest.fixture
def metrics_daemon(sandboxd_daemon: DaemonFactory) -> Iterator[tuple[Daemon, int]]:
    port = free_port()
    yield sandboxd_daemon(args=["--metrics", f"127.0.0.1:{port}"]), port


def idle_connections(port: int, count: int) -> list[socket.socket]:
    """``count`` connections that never send a byte, held open by this test."""
    held = []
    for _ in range(count):
        held.append(socket.create_connection(("127.0.0.1", port), timeout=10))
    return held


def daemon_connections(daemon: Daemon, port: int) -> int:
    """Established TCP connections on ``port`` the daemon's process holds (its fds' socket inodes
    against /proc/net/tcp)."""
    import os

    inodes = set()
    for fd in os.listdir(f"/proc/{daemon.pid}/fd"):
        try:
            target = os.readlink(f"/proc/{daemon.pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    count = 0
    with open(f"/proc/{daemon.pid}/net/tcp") as table:
        for line in table.readlines()[1:]:
            fields = line.split()
            local_port, state, inode = int(fields[1].split(":")[1], 16), fields[3], fields[9]
            if local_port == port and state == "01" and inode in inodes:
                count += 1
    return count


def test_200_idle_connections_do_not_stall_a_scrape(metrics_daemon: tuple[Daemon, int]) -> None:
    daemon, port = metrics_daemon
    held = idle_connections(port, IDLE)
    try:
        text = scrape(port)
        assert "sandboxd_build_info{" in text and "sandboxd_sessions " in text
        # The daemon keeps at most PER_PEER of one address's connections: the oldest idle ones went.
        assert daemon_connections(daemon, port) <= PER_PEER
        assert scrape(port) .count("sandboxd_build_info{") == 1
    finally:
        for sock in held:
            sock.close()


def test_20_concurrent_scrapes_all_answer(metrics_daemon: tuple[Daemon, int]) -> None:
    _, port = metrics_daemon
    start = threading.Barrier(SCRAPES)

    def one(_: int) -> str:
        start.wait()
        return scrape(port)
    with ThreadPoolExecutor(SCRAPES) as pool:
        texts = list(pool.map(one, range(SCRAPES)))
    assert len(texts) == SCRAPES and all("sandboxd_build_info{" in text for text in texts)


def test_a_request_that_never_ends_is_closed_and_others_are_answered(metrics_daemon: tuple[Daemon, int]) -> None:
    _, port = metrics_daemon
    with socket.create_connection(("127.0.0.1", port), timeout=30) as slow:
        slow.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")          # no blank line: never complete
        assert "sandboxd_build_info{" in scrape(port)
        assert slow.recv(1) == b""                                     # closed at its deadline, unanswered
    with socket.create_connection(("127.0.0.1", port), timeout=30) as wrong:
        wrong.sendall(b"POST /metrics HTTP/1.1\r\n\r\n")
        assert wrong.recv(4096).startswith(b"HTTP/1.1 405 ")
    with pytest.raises(urllib.error.HTTPError) as missing:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/other", timeout=30)
    assert missing.value.code == 404


def test_control_the_old_one_thread_listener_is_stalled_by_one_idle_connection() -> None:
    """What the daemon served with before: http.server with prometheus' handler, one connection at
    a time. One idle connection and the scrape behind it gets no answer while it lasts."""
    from http.server import HTTPServer

    from prometheus_client import CollectorRegistry
    from prometheus_client.exposition import MetricsHandler

    class Handler(MetricsHandler):
        timeout = 60                      # the old listener's per-client timeout was 5 s; longer here
        registry = CollectorRegistry()
    server = HTTPServer(("127.0.0.1", 0), Handler)
    port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        assert scrape(port) == ""          # it serves (an empty registry)
        with socket.create_connection(("127.0.0.1", port)):
            with pytest.raises((TimeoutError, urllib.error.URLError)):
                scrape(port, timeout=3)
    finally:
        server.shutdown()
        server.server_close()
