"""Network isolation: only `lo` without --network, host listeners unreachable, loopback still usable."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import (
    ALL_POLICIES,
    CONFINED,
    NO_NETWORK,
    accepted_connections,
    describe,
    py,
    run_sbx,
)


def host_interfaces() -> set[str]:
    return set(os.listdir("/sys/class/net"))


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_ip_link_shows_only_lo_without_network(policy: str, workspace: Path) -> None:
    """`ip link` lists only an UP `lo` without network, and the host's interfaces with it."""
    result = run_sbx(["ip", "-o", "link", "show"], workspace=workspace, policy=policy)
    assert result.returncode == 0, describe(result)
    names = {line.split(":")[1].strip().split("@")[0] for line in result.stdout.splitlines()}
    if policy in NO_NETWORK:
        assert names == {"lo"}, result.stdout
        assert "UP" in result.stdout.split("<", 1)[1].split(">", 1)[0], "lo is not up"
    else:
        assert names == host_interfaces(), result.stdout


def test_host_has_more_than_lo() -> None:
    """Control for the test above: this host has interfaces besides lo, so 'only lo' means something."""
    assert host_interfaces() - {"lo"}, "the host itself has only lo: the interface test cannot tell namespaces apart"


CONNECT_TCP = r"""
import errno, socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
s.settimeout(5)
try:
    s.connect(('127.0.0.1', int(sys.argv[1])))
    print('CONNECTED')
except OSError as e:
    print('FAILED', errno.errorcode.get(e.errno, e.errno) if e.errno else type(e).__name__)
"""


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_host_tcp_listener_reachable_only_with_network(policy: str, workspace: Path,
                                                       tcp_listener: socket.socket) -> None:
    """A host listener on 127.0.0.1 is unreachable without network, reachable with --network / full access."""
    port = tcp_listener.getsockname()[1]
    result = run_sbx(py(CONNECT_TCP, str(port)), workspace=workspace, policy=policy)
    assert result.returncode == 0, describe(result)
    arrived = accepted_connections(tcp_listener)
    if policy in NO_NETWORK:
        assert result.stdout.startswith("FAILED"), describe(result)
        assert "ECONNREFUSED" in result.stdout or "ENETUNREACH" in result.stdout, describe(result)
        assert arrived == 0
    else:
        assert result.stdout == "CONNECTED\n", describe(result)
        assert arrived == 1


@pytest.mark.parametrize("policy", NO_NETWORK)
def test_host_tcp_listener_on_all_addresses_unreachable(policy: str, workspace: Path) -> None:
    """A host listener on 0.0.0.0 is unreachable through 127.0.0.1 and the host's own addresses."""
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind(("0.0.0.0", 0))
    srv.listen(8)
    srv.setblocking(False)
    try:
        port = srv.getsockname()[1]
        script = r"""
import socket, sys, json
port = int(sys.argv[1])
out = {}
for host in sys.argv[2:]:
    s = socket.socket(); s.settimeout(3)
    try:
        s.connect((host, port)); out[host] = 'CONNECTED'
    except OSError as e:
        out[host] = str(e.errno)
print(json.dumps(out))
"""
        addresses = ["127.0.0.1"] + sorted(_host_ipv4_addresses() - {"127.0.0.1"})
        result = run_sbx(py(script, str(port), *addresses), workspace=workspace, policy=policy)
        assert result.returncode == 0, describe(result)
        assert "CONNECTED" not in json.loads(result.stdout).values(), describe(result)
        assert accepted_connections(srv) == 0
    finally:
        srv.close()


def _host_ipv4_addresses() -> set[str]:
    out = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True).stdout
    return {line.split()[3].split("/")[0] for line in out.splitlines()}


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_loopback_inside_works(policy: str, workspace: Path) -> None:
    """The sandbox's own loopback works: a server it starts on 127.0.0.1 is reachable from inside."""
    script = r"""
import socket
srv = socket.socket(); srv.bind(('127.0.0.1', 0)); srv.listen(1)
c = socket.create_connection(srv.getsockname(), timeout=5)
conn, _ = srv.accept(); conn.sendall(b'pong')
print(c.recv(4).decode())
"""
    result = run_sbx(py(script), workspace=workspace, policy=policy)
    assert result.returncode == 0 and result.stdout == "pong\n", describe(result)


@pytest.fixture
def abstract_listener() -> Iterator[tuple[socket.socket, str]]:
    """A host Unix socket in the abstract namespace (tied to the host network namespace)."""
    name = f"sbxtest-{uuid.uuid4().hex}"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind("\0" + name)
    srv.listen(8)
    srv.setblocking(False)
    try:
        yield srv, name
    finally:
        srv.close()


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_host_abstract_unix_socket_reachable_only_under_full_access(
        policy: str, workspace: Path, abstract_listener: tuple[socket.socket, str]) -> None:
    """An abstract host socket is cut off by the network namespace, and with the host's network by
    the connect broker (its listener is no process's of the sandbox); reachable under
    danger-full-access (the control)."""
    srv, name = abstract_listener
    script = r"""
import errno, socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    s.connect('\0' + sys.argv[1]); print('CONNECTED')
except OSError as e:
    print('FAILED', errno.errorcode.get(e.errno, e.errno))
"""
    result = run_sbx(py(script, name), workspace=workspace, policy=policy)
    assert result.returncode == 0, describe(result)
    arrived = accepted_connections(srv)
    if policy == "danger-full-access":
        assert result.stdout == "CONNECTED\n" and arrived == 1, describe(result)
    else:
        assert result.stdout.startswith("FAILED"), describe(result)
        assert arrived == 0


THREADED_CONNECTS = r"""
import json, socket, sys, threading
srv = socket.socket()
srv.bind(("127.0.0.1", 0))
srv.listen(4)
port = srv.getsockname()[1]
results = {}
def attempt(name, family, address):
    s = socket.socket(family)
    s.settimeout(10)
    try:
        s.connect(address)
        results[name] = "connected"
    except OSError as exc:
        results[name] = exc.strerror
threads = [threading.Thread(target=attempt, args=("own listener", socket.AF_INET, ("127.0.0.1", port))),
           threading.Thread(target=attempt, args=("host socket", socket.AF_UNIX, sys.argv[1]))]
for t in threads:
    t.start()
for t in threads:
    t.join(30)
print(json.dumps(results))
"""


@pytest.mark.parametrize("policy", CONFINED)
def test_connect_from_a_second_thread_is_answered(policy: str, workspace: Path, base_dir: Path) -> None:
    """init brokers every connect() of a confined sandbox, and the caller may be any thread of a
    process (its tid is not a pidfd-able process): a worker thread's connect is answered, allowed
    or refused, never left hanging."""
    host_socket = base_dir / f"host-{uuid.uuid4().hex[:6]}.sock"
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(host_socket))
    os.chmod(host_socket, 0o666)
    server.listen(4)
    try:
        result = run_sbx(py(THREADED_CONNECTS, str(host_socket)), workspace=workspace, policy=policy, timeout=120)
    finally:
        server.close()
    assert result.returncode == 0, describe(result)
    verdicts = json.loads(result.stdout)
    assert verdicts["own listener"] == "connected", verdicts
    # A host socket: refused in every confined sandbox, the host's network included (the broker answered).
    assert verdicts["host socket"] == "Permission denied", verdicts
