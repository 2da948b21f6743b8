"""The TLS and metrics listeners at start-up, from the operator's side: a real `sandboxd serve`
given a busy port, a port out of range, a host that is no host or not this machine's, stops with
exit status 1 (a bad value: 2, as every configuration error) and ONE line naming the key, the value
and the cause; never a traceback, never "another daemon is serving" the Unix socket. Each has its
control: the same start with the port free serves."""

from __future__ import annotations

import socket
import subprocess
import urllib.request
from pathlib import Path

import pytest

from daemon_helpers import DaemonFactory, TlsListener

pytestmark = pytest.mark.timeout(180)


def busy_port(reuse_port: bool = False) -> socket.socket:
    """A listener on a free loopback port, held by this test (another process's, to the daemon)."""
    holder = socket.socket()
    if reuse_port:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    return holder


def one_line(log: str) -> str:
    lines = [line for line in log.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in log, log
    return lines[0]


def self_signed(base: Path) -> TlsListener:
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out",
                    "server.pem", "-days", "2", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   cwd=base, check=True, capture_output=True)
    return TlsListener("", base / "server.pem", base / "server.key", base / "server.pem", "65534:65534")


def test_a_busy_metrics_port_is_named_as_such_and_a_free_one_serves(sandboxd_daemon: DaemonFactory) -> None:
    holder = busy_port()
    address = f"127.0.0.1:{holder.getsockname()[1]}"
    with holder:
        failed = sandboxd_daemon.start_failure(args=["--metrics", address])
    assert failed.returncode == 1
    assert one_line(failed.log) == (f"sandboxd serve: metrics.listen {address}: address already in use (another "
                                    "process listens there: stop it, or choose another port)"), failed.log
    # Control: the port free again, the same start serves metrics there.
    sandboxd_daemon(args=["--metrics", address])
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=30).read().decode()
    assert "sandboxd_build_info{" in text


def test_a_busy_tls_port_is_named_as_such_even_one_shared_with_so_reuseport(sandboxd_daemon: DaemonFactory) -> None:
    tls = self_signed(sandboxd_daemon.base)
    for reuse_port in (False, True):        # gRPC's own default would have shared a SO_REUSEPORT port
        holder = busy_port(reuse_port)
        address = f"127.0.0.1:{holder.getsockname()[1]}"
        with holder:
            failed = sandboxd_daemon.start_failure(tls=TlsListener(address, tls.cert, tls.key, tls.client_ca,
                                                                   tls.tcp_user))
        assert failed.returncode == 1, failed.log
        assert f"sandboxd serve: tls.address {address}: address already in use" in failed.log, failed.log
        assert "Traceback" not in failed.log and "another daemon is serving" not in failed.log, failed.log
    # Control: free, it serves TLS there (a TCP connect reaches it).
    sandboxd_daemon(tls=TlsListener(address, tls.cert, tls.key, tls.client_ca, tls.tcp_user))
    socket.create_connection(("127.0.0.1", int(address.rsplit(":", 1)[1])), timeout=10).close()


@pytest.mark.parametrize("value, exit_status, words", [
    ("127.0.0.1", 2, "metrics.listen: '127.0.0.1' must be HOST:PORT"),
    ("127.0.0.1:70000", 2, "metrics.listen: '127.0.0.1:70000' must be HOST:PORT"),
    ("127.0.0.1:0", 2, "metrics.listen: '127.0.0.1:0' must be HOST:PORT"),
    ("http://127.0.0.1:9464", 2, "metrics.listen: 'http://127.0.0.1:9464' must be HOST:PORT"),
    ("no-such-host.invalid:9464", 2, "metrics.listen: 'no-such-host.invalid:9464': unknown host 'no-such-host.invalid'"),
    ("192.0.2.1:9464", 1, "metrics.listen 192.0.2.1:9464: cannot assign requested address (not an address of this "
                          "machine"),
])
def test_a_bad_metrics_address_stops_the_start_with_one_line(sandboxd_daemon: DaemonFactory, value: str,
                                                             exit_status: int, words: str) -> None:
    failed = sandboxd_daemon.start_failure(args=["--metrics", value])
    assert failed.returncode == exit_status and words in one_line(failed.log), failed.log
