"""The daemon's egress proxies and published ports under load, and who may publish which port.

One relay loop serves them all (network/tcp_relay): thousands of idle connections, from inside
a sandbox to its proxy or from another local user to a published port, cost the root daemon no
thread; each session holds at most its cap of connections (quotas.*_connections_per_session,
256 by default), a local user at most its share of a published port's (quotas.published_connections_per_peer,
32), and the ones over it are refused at once; another session is served meanwhile;
and when the flood goes, so do its descriptors. Real daemon, real sandboxes, real users; the
world of tests/test_isolated_network.py stands in for the internet.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import PY
from daemon_helpers import Daemon, PlainUser, create_session, make_base_dir, remove_tree, run_client_as, run_exec
from sandboxd.network.publish import DEFAULT_PER_PEER
from sandboxd.v1 import sandboxd_pb2 as pb
from test_isolated_network import DNS, World, free_port, http_get, world  # noqa: F401 - the same world fixture

pytestmark = pytest.mark.timeout(600)

CAP = 256                                   # the default of both quotas
PER_PEER = DEFAULT_PER_PEER                 # one local user's share of a published port (test_network_walls)

# A server for the sandboxes' published ports: one thread however many connections it holds.
SERVER = textwrap.dedent('''
    import asyncio, resource, sys
    resource.setrlimit(resource.RLIMIT_NOFILE, (resource.getrlimit(resource.RLIMIT_NOFILE)[1],) * 2)
    async def handle(reader, writer):
        try:
            while (line := await reader.readline()) not in (b"", b"\\r\\n", b"\\n"):
                pass
            if line:
                writer.write(b"HTTP/1.0 200 OK\\r\\nContent-Length: 5\\r\\n\\r\\nhello")
                await writer.drain()
        finally:
            writer.close()
    async def main():
        server = await asyncio.start_server(handle, "127.0.0.1", 8000, backlog=4096)
        await server.serve_forever()
    asyncio.run(main())
''')

# Opens N connections to HOST:PORT (PROXY: the sandbox's egress proxy) and keeps them idle; counts
# the ones the other side closes (readable at once: EOF or reset), writes {"opened", "closed"} to
# OUT, and holds the rest open until RELEASE exists.
FLOOD = textwrap.dedent('''
    import json, os, resource, select, socket, sys, time
    resource.setrlimit(resource.RLIMIT_NOFILE, (resource.getrlimit(resource.RLIMIT_NOFILE)[1],) * 2)
    target, count, expect_closed, out, release = sys.argv[1:6]
    if target == "PROXY":
        host, port = os.environ["HTTP_PROXY"].rsplit("/", 1)[-1].split(":")
    else:
        host, port = target.split(":")
    count, expect_closed = int(count), int(expect_closed)
    held = [socket.create_connection((host, int(port)), timeout=30) for _ in range(count)]
    poller = select.poll()
    for s in held:
        poller.register(s, select.POLLIN)
    closed = set()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        events = poller.poll(500 if len(closed) >= expect_closed else 2000)
        if not events and len(closed) >= expect_closed:
            break                       # everything expected came, and then nothing more
        for fd, _ in events:
            closed.add(fd)
            poller.unregister(fd)
    with open(out + ".tmp", "w") as f:
        json.dump({"opened": len(held), "closed": len(closed)}, f)
    os.rename(out + ".tmp", out)
    while not os.path.exists(release):
        time.sleep(0.2)
    for s in held:
        s.close()
''')

PROXY_GET = textwrap.dedent('''
    import urllib.request
    print(urllib.request.urlopen("http://internet.test:8080/", timeout=30).read().decode())
''')


def threads_of(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def fds_of(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def wait_for_file(path: Path, within: float = 240.0) -> dict[str, int]:
    deadline = time.monotonic() + within
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never came"
        time.sleep(0.2)
    return json.loads(path.read_text())  # type: ignore[no-any-return]


def policy(**kwargs: object) -> pb.SandboxPolicy:
    return pb.SandboxPolicy(mode=pb.SandboxPolicy.WORKSPACE_WRITE, network_access=True, **kwargs)  # type: ignore[arg-type]


def test_floods_cost_no_threads_are_capped_and_leave_nothing(world: World,
                                                             plain_users: Callable[[int], list[PlainUser]]) -> None:
    (user,) = plain_users(1)
    base = make_base_dir("sbxd-floods-")
    spaces = {}
    for name in ("a", "b", "c", "user"):
        spaces[name] = base / name
        spaces[name].mkdir()
    os.chown(spaces["user"], user.uid, user.gid)
    flood_port, control_port = free_port(), free_port()
    d = Daemon(base, args=["--dns", DNS])
    user_flood: subprocess.Popen[bytes] | None = None
    try:
        d.start()
        # a: floods its own proxy; b: its published port is flooded by a local user; c: the control.
        a = create_session(d.stub, spaces["a"], policy(allowed_domains=["internet.test"]))
        b = create_session(d.stub, spaces["b"], policy(published_ports=[f"{flood_port}:8000"]))
        c = create_session(d.stub, spaces["c"], policy(allowed_domains=["internet.test"],
                                                      published_ports=[f"{control_port}:8000"]))
        for session in (b, c):
            d.stub.StartBackground(pb.StartBackgroundRequest(session_id=session.id, argv=[PY, "-c", SERVER],
                                                             cwd=str(spaces["b" if session is b else "c"])))

        def controls() -> None:
            outcome = run_exec(d.stub, c.id, [PY, "-c", PROXY_GET])
            assert outcome.stdout.decode().strip() == "hello from internet", outcome.describe()
            assert http_get(control_port) == "HTTP/1.0 200 OK"
        controls()
        assert http_get(flood_port) == "HTTP/1.0 200 OK"
        threads, fds = threads_of(d.pid), fds_of(d.pid)

        d.stub.StartBackground(pb.StartBackgroundRequest(session_id=a.id, cwd=str(spaces["a"]), argv=[
            PY, "-c", FLOOD, "PROXY", "2000", str(2000 - CAP), str(spaces["a"] / "result"),
            str(spaces["a"] / "release")]))
        user_flood = subprocess.Popen(
            [PY, "-c", FLOOD, f"127.0.0.1:{flood_port}", "1500", str(1500 - PER_PEER), str(spaces["user"] / "result"),
             str(spaces["user"] / "release")], user=user.uid, group=user.gid, extra_groups=[],
            cwd="/", stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        in_sandbox = wait_for_file(spaces["a"] / "result")
        from_user = wait_for_file(spaces["user"] / "result")
        assert in_sandbox == {"opened": 2000, "closed": 2000 - CAP}, in_sandbox    # the cap, and no more
        assert from_user == {"opened": 1500, "closed": 1500 - PER_PEER}, from_user
        flooded_threads = threads_of(d.pid)
        assert flooded_threads <= threads + 5, (threads, flooded_threads)
        # They are held, the flood is real: the proxy's idle clients, and the user's share of relayed pairs.
        assert fds_of(d.pid) >= fds + CAP + PER_PEER
        controls()                                             # another session is served meanwhile
        assert threads_of(d.pid) <= threads + 5

        (spaces["a"] / "release").touch()
        (spaces["user"] / "release").touch()
        assert user_flood.wait(timeout=120) == 0, user_flood.stderr.read() if user_flood.stderr else ""
        deadline = time.monotonic() + 120
        while fds_of(d.pid) > fds and time.monotonic() < deadline:
            time.sleep(0.2)
        assert fds_of(d.pid) <= fds, (fds, fds_of(d.pid))      # every relayed socket was closed
        controls()                                             # and the capped sessions work again
        assert http_get(flood_port) == "HTTP/1.0 200 OK"
        print(f"daemon threads: {threads} before, {flooded_threads} with 3,500 connections held; fds {fds}")
    finally:
        if user_flood is not None and user_flood.poll() is None:
            user_flood.kill()
            user_flood.wait()
        d.close()
        remove_tree(base)


PUBLISH_AS_USER = '''
def attempt(ports, update=None):
    policy = pb.SandboxPolicy(mode=pb.SandboxPolicy.WORKSPACE_WRITE, network_access=True, published_ports=ports)
    try:
        if update:
            stub.UpdateSessionPolicy(pb.UpdateSessionPolicyRequest(session_id=update, sandbox_policy=policy),
                                     timeout=120)
            return ["OK", update]
        return ["OK", stub.CreateSession(pb.CreateSessionRequest(workspace=ARGS["workspace"], sandbox_policy=policy,
                                                                 approval_policy=pb.NEVER), timeout=120).id]
    except grpc.RpcError as error:
        return [error.code().name, error.details()]
low = attempt(["80:8000"])
high = attempt([f"{ARGS['port']}:8000"])
moved = attempt(["81:8000"], update=high[1]) if high[0] == "OK" else None
print(json.dumps({"low": low, "high": high, "moved": moved}))
'''


def test_only_root_publishes_privileged_host_ports(plain_users: Callable[[int], list[PlainUser]]) -> None:
    (user,) = plain_users(1)
    from sandboxd.network.publish import unprivileged_port_start

    start = unprivileged_port_start()
    if start <= 80:
        pytest.skip(f"net.ipv4.ip_unprivileged_port_start is {start}: port 80 is anyone's to bind on this host")
    base = make_base_dir("sbxd-ports-")
    workspace = base / "ws"
    workspace.mkdir()
    os.chown(workspace, user.uid, user.gid)
    d = Daemon(base)
    try:
        d.start()
        port = free_port()
        seen = run_client_as(user.uid, user.gid, d.socket, PUBLISH_AS_USER,
                             {"workspace": str(workspace), "port": port})
        code, message = seen["low"]
        assert code == "PERMISSION_DENIED", seen
        assert f"host port 80 is below {start}" in message and "only root may publish" in message, message
        assert seen["high"][0] == "OK", seen                                  # the control: a high port works
        assert not _free(port)                                                # published: the daemon listens
        assert seen["moved"][0] == "PERMISSION_DENIED" and "host port 81" in seen["moved"][1], seen
        # Root may publish a privileged port (one free on this host).
        low = next(p for p in range(1000, 1024) if _free(p))
        session = create_session(d.stub, base, policy(published_ports=[f"{low}:8000"]))
        assert list(session.sandbox_policy.published_ports) == [f"{low}:8000"]
        assert not _free(low)                                                 # the daemon listens there now
    finally:
        d.close()
        remove_tree(base)


def _free(port: int) -> bool:
    import socket
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def test_a_relay_copies_both_ways_with_bounded_buffers() -> None:
    """32 MiB each way through one Relay while one reader stalls: what the loop buffers stays
    within its bound (backpressure reaches the writer), every byte arrives in order, and each
    side's end (shutdown) reaches the other."""
    import hashlib
    import socket
    import threading

    from sandboxd.network import tcp_relay

    loop = tcp_relay.RelayLoop("test-relay")
    left, a = socket.socketpair()
    b, right = socket.socketpair()
    for sock in (a, b):
        sock.setblocking(False)
    closed = threading.Event()
    relay = loop.call(lambda: tcp_relay.Relay(loop, a, b, on_close=closed.set))
    payload = os.urandom(1 << 20) * 32
    digests: dict[str, str] = {}

    def send_then_end(sock: socket.socket) -> None:
        sock.sendall(payload)
        sock.shutdown(socket.SHUT_WR)

    def drain(sock: socket.socket, key: str) -> None:
        digest, size = hashlib.sha256(), 0
        while chunk := sock.recv(1 << 16):
            digest.update(chunk)
            size += len(chunk)
        digests[key] = f"{digest.hexdigest()}:{size}"

    writers = [threading.Thread(target=send_then_end, args=(s,)) for s in (left, right)]
    for w in writers:
        w.start()
    # Nobody reads yet: the writers block on a full pipe, and the loop holds no more than its bound.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and sum(loop.call(lambda: relay.buffered)) < tcp_relay.BUFFER_LIMIT:
        time.sleep(0.05)
    held = loop.call(lambda: relay.buffered)
    assert max(held) <= tcp_relay.BUFFER_LIMIT + tcp_relay.CHUNK, held
    assert all(w.is_alive() for w in writers)                      # backpressure reached the writers
    readers = [threading.Thread(target=drain, args=(s, k)) for s, k in ((left, "left"), (right, "right"))]
    for r in readers:
        r.start()
    for t in writers + readers:
        t.join(timeout=120)
    expected = f"{hashlib.sha256(payload).hexdigest()}:{len(payload)}"
    assert digests == {"left": expected, "right": expected}
    assert closed.wait(30)                                         # both directions ended: both closed
    assert a.fileno() == -1 and b.fileno() == -1
    left.close()
    right.close()
    loop.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("test-relay")]
