"""Host pathname Unix sockets are unreachable from every confined sandbox; its own sockets keep working.

A network namespace does not cut off *pathname* Unix sockets: a host socket
file the sandbox can see (and, by mode, write) could be connected to. sandboxd
must refuse those (EACCES, ECONNREFUSED or EPERM), and no datagram may reach a
host socket path either, whatever the sandbox's network: the host's network
(--network=host) is the host's TCP and UDP, not its local IPC (issue 24, round 4;
tests/test_host_unix_sockets.py has the attack as a plain user). Sockets the
sandboxed command creates itself (in /tmp or the workspace) must still work
normally. Under danger-full-access host sockets are reachable: those runs are
the controls showing the listeners really accept connections.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import (
    ALL_POLICIES,
    CONFINED,
    accepted_connections,
    describe,
    py,
    run_sbx,
)

REFUSED = ("EACCES", "ECONNREFUSED", "EPERM")

# Connects to each (kind, path) in argv[1] (JSON); prints {path: "CONNECTED" | errno name}.
CONNECT = r"""
import errno, json, socket, sys
kinds = {'stream': socket.SOCK_STREAM, 'seqpacket': socket.SOCK_SEQPACKET}
out = {}
for kind, path in json.loads(sys.argv[1]):
    s = socket.socket(socket.AF_UNIX, kinds[kind])
    s.settimeout(5)
    try:
        s.connect(path)
        s.send(b'hello from the sandbox')
        out[kind + ':' + path] = 'CONNECTED'
    except OSError as e:
        out[kind + ':' + path] = errno.errorcode.get(e.errno, str(e.errno)) if e.errno else type(e).__name__
    finally:
        s.close()
print(json.dumps(out))
"""


def listen_unix(path: Path, kind: int = socket.SOCK_STREAM) -> socket.socket:
    srv = socket.socket(socket.AF_UNIX, kind)
    srv.bind(str(path))
    os.chmod(path, 0o777)
    if kind != socket.SOCK_DGRAM:
        srv.listen(16)
    srv.setblocking(False)
    return srv


@pytest.fixture
def host_sockets(outside: Path) -> Iterator[dict[str, socket.socket]]:
    """Host listeners (stream and seqpacket) on 0777 socket files in a 0777 directory outside the workspace."""
    socks = {"stream": listen_unix(outside / "host-stream.sock"),
             "seqpacket": listen_unix(outside / "host-seqpacket.sock", socket.SOCK_SEQPACKET)}
    try:
        yield socks
    finally:
        for s in socks.values():
            s.close()


def connect_from_sandbox(targets: list[tuple[str, str]], *, workspace: Path, policy: str,
                         options: tuple[str, ...] = ()) -> dict[str, str]:
    result = run_sbx(py(CONNECT, json.dumps(targets)), workspace=workspace, policy=policy, options=options)
    assert result.returncode == 0, describe(result)
    return json.loads(result.stdout)


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_host_socket_reachable_only_under_full_access(policy: str, workspace: Path, outside: Path,
                                                      host_sockets: dict[str, socket.socket]) -> None:
    """A host stream/seqpacket listener at a 0777 path: refused in every confined sandbox, the host's
    network included; connected under danger-full-access (the control)."""
    targets = [("stream", str(outside / "host-stream.sock")), ("seqpacket", str(outside / "host-seqpacket.sock"))]
    outcomes = connect_from_sandbox(targets, workspace=workspace, policy=policy)
    arrived = {kind: accepted_connections(sock) for kind, sock in host_sockets.items()}
    if policy in CONFINED:
        for target, outcome in outcomes.items():
            assert outcome in REFUSED, f"{target}: {outcome}"
        assert arrived == {"stream": 0, "seqpacket": 0}
    else:
        assert set(outcomes.values()) == {"CONNECTED"}, outcomes
        assert arrived == {"stream": 1, "seqpacket": 1}


@pytest.mark.parametrize("policy", CONFINED)
def test_host_socket_unreachable_by_any_path(policy: str, workspace: Path, outside: Path,
                                             host_sockets: dict[str, socket.socket]) -> None:
    """Neither a symlink in the workspace, /proc/self/root, `..` nor a relative path reaches the host socket."""
    sock = outside / "host-stream.sock"
    (workspace / "link.sock").symlink_to(sock)
    (workspace / "dirlink").symlink_to(outside)
    targets = [("stream", str(workspace / "link.sock")), ("stream", "link.sock"), ("stream", "dirlink/host-stream.sock"),
               ("stream", f"/proc/self/root{sock}"), ("stream", f"/proc/1/root{sock}"),
               ("stream", "../outside/host-stream.sock"), ("stream", f"{workspace}/../outside/host-stream.sock")]
    outcomes = connect_from_sandbox(targets, workspace=workspace, policy=policy)
    for target, outcome in outcomes.items():
        assert outcome in REFUSED + ("ENOENT",), f"{target}: {outcome}"
    assert accepted_connections(host_sockets["stream"]) == 0


@pytest.mark.parametrize("policy", CONFINED)
def test_host_socket_relative_to_cwd_unreachable(policy: str, workspace: Path, outside: Path,
                                                 host_sockets: dict[str, socket.socket]) -> None:
    """With --cwd in the host socket's directory, a bare relative name is still refused."""
    outcomes = connect_from_sandbox([("stream", "host-stream.sock"), ("seqpacket", "host-seqpacket.sock")],
                                    workspace=workspace, policy=policy, options=("--cwd", str(outside)))
    for target, outcome in outcomes.items():
        assert outcome in REFUSED, f"{target}: {outcome}"
    assert accepted_connections(host_sockets["stream"]) == 0


@pytest.mark.parametrize("policy", CONFINED)
def test_host_socket_inside_workspace_unreachable(policy: str, workspace: Path) -> None:
    """A socket a *host* process listens on inside the workspace (or a writable root) is still a host socket."""
    srv = listen_unix(workspace / "host-in-ws.sock")
    try:
        outcomes = connect_from_sandbox([("stream", str(workspace / "host-in-ws.sock")),
                                         ("stream", "host-in-ws.sock")], workspace=workspace, policy=policy)
        for target, outcome in outcomes.items():
            assert outcome in REFUSED, f"{target}: {outcome}"
        assert accepted_connections(srv) == 0
    finally:
        srv.close()


@pytest.mark.parametrize("policy", CONFINED)
def test_host_socket_rebound_by_name_in_sandbox_is_not_confused(policy: str, workspace: Path, outside: Path,
                                                                  host_sockets: dict[str, socket.socket]) -> None:
    """Binding an own socket first does not open the door to a host socket (the check is per inode)."""
    script = r"""
import errno, socket, sys
own = socket.socket(socket.AF_UNIX); own.bind('/tmp/own.sock'); own.listen(1)
s = socket.socket(socket.AF_UNIX)
try:
    s.connect(sys.argv[1]); print('CONNECTED')
except OSError as e:
    print(errno.errorcode.get(e.errno, e.errno))
"""
    result = run_sbx(py(script, str(outside / "host-stream.sock")), workspace=workspace, policy=policy)
    assert result.returncode == 0 and result.stdout.strip() in REFUSED, describe(result)
    assert accepted_connections(host_sockets["stream"]) == 0


@pytest.mark.parametrize("policy", CONFINED)
def test_symlink_flipping_race_never_reaches_host(policy: str, workspace: Path, outside: Path,
                                                  host_sockets: dict[str, socket.socket]) -> None:
    """A process flipping a symlink between an own socket and the host socket while another connects
    through it in a loop never gets a connection to the host socket (check-then-connect must be atomic)."""
    script = r"""
import os, socket, sys, time
host = sys.argv[1]
own = socket.socket(socket.AF_UNIX); own.bind('/tmp/own.sock'); own.listen(1024)
flipper = os.fork()
if flipper == 0:
    while True:
        for target in ('/tmp/own.sock', host):
            try:
                os.symlink(target, '/tmp/flip.new'); os.rename('/tmp/flip.new', '/tmp/flip')
            except OSError:
                pass
own.setblocking(False)
mine = refused = 0
deadline = time.monotonic() + 1.5
while time.monotonic() < deadline:
    c = socket.socket(socket.AF_UNIX)
    try:
        c.connect('/tmp/flip'); mine += 1
        own.accept()[0].close()
    except OSError:
        refused += 1
    c.close()
os.kill(flipper, 9)
print(mine, refused)
"""
    result = run_sbx(py(script, str(outside / "host-stream.sock")), workspace=workspace, policy=policy,
                     options=("--timeout", "20"))
    assert result.returncode == 0, describe(result)
    mine, refused = (int(x) for x in result.stdout.split())
    assert accepted_connections(host_sockets["stream"]) == 0, "a connection reached the host socket"
    assert mine > 0 and refused > 0, "the race was not exercised"


# --------------------------------------------------------------------------- datagrams

DATAGRAM = r"""
import errno, json, socket, sys
path = sys.argv[1]
types = {'SOCK_DGRAM': socket.SOCK_DGRAM, 'SOCK_RAW': socket.SOCK_RAW,
         'SOCK_DGRAM|SOCK_CLOEXEC': socket.SOCK_DGRAM | socket.SOCK_CLOEXEC,
         'SOCK_RAW|SOCK_NONBLOCK': socket.SOCK_RAW | socket.SOCK_NONBLOCK}
out = {}
for name, kind in types.items():
    for how in ('socket', 'socketpair'):
        key = f'{how}({name})'
        try:
            s = socket.socket(socket.AF_UNIX, kind) if how == 'socket' else socket.socketpair(socket.AF_UNIX, kind)[0]
        except OSError as e:
            out[key] = 'create ' + errno.errorcode.get(e.errno, str(e.errno))
            continue
        try:
            s.sendto(key.encode(), path)
            out[key] = 'SENT'
        except OSError as e:
            out[key] = 'send ' + errno.errorcode.get(e.errno, str(e.errno))
print(json.dumps(out))
"""


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_no_datagram_reaches_a_host_socket(policy: str, workspace: Path, outside: Path) -> None:
    """From no confined sandbox, the host's network included, does a Unix datagram reach a host
    socket path (whatever the socket type spelling: AF_UNIX SOCK_RAW is a datagram socket too);
    under danger-full-access they do (control)."""
    path = outside / "host-dgram.sock"
    srv = listen_unix(path, socket.SOCK_DGRAM)
    try:
        result = run_sbx(py(DATAGRAM, str(path)), workspace=workspace, policy=policy)
        assert result.returncode == 0, describe(result)
        received = []
        while True:
            try:
                received.append(srv.recv(256).decode())
            except BlockingIOError:
                break
    finally:
        srv.close()
    outcomes = json.loads(result.stdout)
    if policy in CONFINED:
        assert received == [], f"datagrams reached the host: {received} ({outcomes})"
    else:
        assert len(received) == len(outcomes) == 8, (received, outcomes)


# --------------------------------------------------------------------------- the sandbox's own sockets

OWN_SERVER = r"""
import os, socket, sys
kinds = {'stream': socket.SOCK_STREAM, 'seqpacket': socket.SOCK_SEQPACKET}
for kind, path in ((k, p) for k in kinds for p in sys.argv[1:]):
    if os.path.lexists(path):
        os.unlink(path)
    srv = socket.socket(socket.AF_UNIX, kinds[kind]); srv.bind(path); srv.listen(4)
    pid = os.fork()
    if pid == 0:                                    # the client is another process of the sandbox
        c = socket.socket(socket.AF_UNIX, kinds[kind]); c.settimeout(5)
        c.connect(path); c.sendall(b'ping'); print(kind, path, c.recv(16).decode(), flush=True)
        os._exit(0)
    conn, _ = srv.accept()
    conn.sendall(conn.recv(16).replace(b'ping', b'pong'))
    os.waitpid(pid, 0)
    conn.close(); srv.close(); os.unlink(path)
"""


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_own_socket_in_tmp_works(policy: str, workspace: Path) -> None:
    """A server the command binds in /tmp is reachable from another process of the sandbox (stream, seqpacket)."""
    result = run_sbx(py(OWN_SERVER, "/tmp/own.sock"), workspace=workspace, policy=policy)
    assert result.returncode == 0, describe(result)
    assert result.stdout.splitlines() == ["stream /tmp/own.sock pong", "seqpacket /tmp/own.sock pong"]


@pytest.mark.parametrize("policy", ["workspace-write", "workspace-write+network"])
def test_own_socket_in_workspace_works(policy: str, workspace: Path) -> None:
    """A server bound in the workspace works by absolute and by relative path."""
    result = run_sbx(py(OWN_SERVER, str(workspace / "abs.sock"), "rel.sock"), workspace=workspace, policy=policy)
    assert result.returncode == 0, describe(result)
    assert [line.split()[-1] for line in result.stdout.splitlines()] == ["pong"] * 4, describe(result)


@pytest.mark.parametrize("policy", CONFINED)
def test_own_socket_through_symlink_and_subdirectory_cwd(policy: str, workspace: Path) -> None:
    """The sandbox's own socket is reachable through a symlink and from a process whose cwd differs."""
    script = r"""
import os, socket
os.makedirs('/tmp/d/sub', exist_ok=True)
srv = socket.socket(socket.AF_UNIX); srv.bind('/tmp/d/real.sock'); srv.listen(4)
os.symlink('/tmp/d/real.sock', '/tmp/d/link.sock')
os.chdir('/tmp/d/sub')
for path in ('/tmp/d/link.sock', '../real.sock', '../link.sock'):
    c = socket.socket(socket.AF_UNIX); c.settimeout(5); c.connect(path)
    conn, _ = srv.accept(); print('ok', path)
"""
    result = run_sbx(py(script), workspace=workspace, policy=policy)
    assert result.returncode == 0, describe(result)
    assert result.stdout.split("\n")[:3] == ["ok /tmp/d/link.sock", "ok ../real.sock", "ok ../link.sock"]


@pytest.mark.parametrize("policy", CONFINED)
def test_nonblocking_connect_to_own_socket(policy: str, workspace: Path) -> None:
    """A non-blocking connect to the sandbox's own socket succeeds (asyncio-style clients)."""
    script = r"""
import asyncio, socket
async def main():
    async def handle(reader, writer):
        writer.write(await reader.read(4)); await writer.drain(); writer.close()
    server = await asyncio.start_unix_server(handle, '/tmp/aio.sock')
    reader, writer = await asyncio.wait_for(asyncio.open_unix_connection('/tmp/aio.sock'), 5)
    writer.write(b'echo'); await writer.drain()
    print((await asyncio.wait_for(reader.read(4), 5)).decode())
    server.close()
asyncio.run(main())
"""
    result = run_sbx(py(script), workspace=workspace, policy=policy)
    assert result.returncode == 0 and result.stdout == "echo\n", describe(result)


@pytest.mark.parametrize("policy", CONFINED)
def test_connect_errors_keep_their_meaning(policy: str, workspace: Path) -> None:
    """Connecting to a missing path gives ENOENT and to a non-socket ECONNREFUSED, as on a plain kernel."""
    (workspace / "plain.txt").write_text("x")
    outcomes = connect_from_sandbox([("stream", "/tmp/missing.sock"), ("stream", str(workspace / "plain.txt"))],
                                    workspace=workspace, policy=policy)
    assert outcomes == {"stream:/tmp/missing.sock": "ENOENT", f"stream:{workspace}/plain.txt": "ECONNREFUSED"}


EARLY_AND_HIDDEN = r"""
import ctypes, errno, os, socket, time
def attempt(path):
    c = socket.socket(socket.AF_UNIX)
    c.settimeout(5)
    try:
        c.connect(path); return 'connected'
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e.errno))
    finally:
        c.close()
early = socket.socket(socket.AF_UNIX); early.bind('SOCKDIR/early.sock')
print('bound', attempt('SOCKDIR/early.sock'))
early.listen(1)
print('listening', attempt('SOCKDIR/early.sock'))
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    assert ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0) == 0       # PR_SET_DUMPABLE: hidden
    hidden = socket.socket(socket.AF_UNIX); hidden.bind('SOCKDIR/hidden.sock'); hidden.listen(1)
    os.write(w, b'x'); time.sleep(60); os._exit(0)
os.read(r, 1)
print('non-dumpable server', attempt('SOCKDIR/hidden.sock'), flush=True)
os.kill(pid, 9)
"""


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_own_socket_before_listen_and_behind_a_non_dumpable_server(policy: str, workspace: Path) -> None:
    """The sandbox's own socket, bound and not listening yet, answers ECONNREFUSED (as the kernel
    does: a client racing its server's start retries), then connects. With the host's network a
    server of the sandbox that made itself non-dumpable cannot be seen holding its listener: it
    is refused (the check fails closed); without network the namespace says it is the sandbox's,
    and under danger-full-access (the control) the kernel connects it."""
    sockdir = str(workspace) if policy == "danger-full-access" else "/tmp"
    result = run_sbx(py(EARLY_AND_HIDDEN.replace("SOCKDIR", sockdir)), workspace=workspace, policy=policy)
    assert result.returncode == 0, describe(result)
    hidden = "EACCES" if policy == "workspace-write+network" else "connected"
    assert result.stdout.splitlines() == ["bound ECONNREFUSED", "listening connected",
                                          f"non-dumpable server {hidden}"], describe(result)


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_blocked_connect_does_not_stall_other_connects(policy: str, workspace: Path) -> None:
    """A connect that blocks (own server with a full backlog) must not hold up an unrelated connect
    of another process. In every confined sandbox init brokers every connect; danger-full-access
    (no broker) is the control: on a plain kernel the second connect completes at once."""
    script = r"""
import os, socket, time
full = socket.socket(socket.AF_UNIX); full.bind('SOCKDIR/full.sock'); full.listen(0)
ready = socket.socket(socket.AF_UNIX); ready.bind('SOCKDIR/ready.sock'); ready.listen(4)
blocked = []
for _ in range(3):
    pid = os.fork()
    if pid == 0:
        socket.socket(socket.AF_UNIX).connect('SOCKDIR/full.sock')   # the later ones block: nobody accepts
        time.sleep(60)
        os._exit(0)
    blocked.append(pid)
time.sleep(0.5)
started = time.monotonic()
c = socket.socket(socket.AF_UNIX); c.settimeout(3)
try:
    c.connect('SOCKDIR/ready.sock'); print('connected', round(time.monotonic() - started, 2), flush=True)
except OSError as e:
    print('failed', e, flush=True)
for pid in blocked:
    os.kill(pid, 9)
"""
    # danger-full-access shares the host's /tmp: bind in the workspace there.
    sockdir = str(workspace) if policy == "danger-full-access" else "/tmp"
    result = run_sbx(py(script.replace("SOCKDIR", sockdir)), workspace=workspace, policy=policy,
                     options=("--timeout", "8"))
    assert result.returncode == 0, describe(result)
    # A stalled connect would hit the 3 s socket timeout and print "failed".
    assert result.stdout.startswith("connected"), describe(result)
