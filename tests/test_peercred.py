"""The front door tells the gRPC server who is calling, from the kernel (SO_PEERCRED).

Real sockets, a real grpcio server behind a real FrontDoor, real clients
(including one running as another uid). The relay must also carry bulk data
intact, apply backpressure instead of buffering, survive running out of file
descriptors, and leave nothing behind (files, descriptors, threads).
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import resource
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import eventually
from sandboxd.errors import CallerRefused
from sandboxd.network.front_door import FrontDoor, caller
from sandboxd.network.peer_credentials import PeerCredentials

MiB = 1 << 20


# --------------------------------------------------------------------------- fixtures


class Paths:
    """public socket in a 0755 directory (reachable by other uids); backend and relays in a 0700 one."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.private = base / "private"
        self.private.mkdir(mode=0o700)
        self.public = str(base / "sandboxd.sock")
        self.backend = str(self.private / "grpc.sock")
        self.relay = str(self.private / "relay")


@pytest.fixture
def paths() -> Iterator[Paths]:
    base = Path(tempfile.mkdtemp(prefix="sbxpc-", dir="/tmp"))
    os.chmod(base, 0o755)
    try:
        yield Paths(base)
    finally:
        shutil.rmtree(base, ignore_errors=True)


class Servicer(health_pb2_grpc.HealthServicer):
    """Health.Check records what the front door says about the caller; refuses unknown callers."""

    def __init__(self) -> None:
        self.door: FrontDoor | None = None
        self.seen: list[tuple[str, PeerCredentials | None]] = []

    def Check(self, request: health_pb2.HealthCheckRequest, context: grpc.ServicerContext
              ) -> health_pb2.HealthCheckResponse:
        assert self.door is not None
        peer = context.peer()
        self.seen.append((peer, self.door.identity(peer)))
        try:
            caller(self.door, context)
        except CallerRefused as exc:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


BLOCK = os.urandom(MiB)


def chunk(index: int) -> bytes:
    """Message ``index`` of a bulk stream: its number, then random bytes (order and content both checkable)."""
    return index.to_bytes(8, "big") + BLOCK[8:]


def stream(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
    for index in range(int.from_bytes(request, "big")):
        yield chunk(index)


def upload(requests: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
    digest = hashlib.sha256()
    for request in requests:
        digest.update(request)
    return digest.digest()


@pytest.fixture
def backend(paths: Paths) -> Iterator[Servicer]:
    """A grpcio server on the private socket: Health plus raw-bytes bulk methods."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    servicer = Servicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Bulk", {
        # No (de)serializers: requests and responses are raw bytes.
        "Stream": grpc.unary_stream_rpc_method_handler(stream),
        "Upload": grpc.stream_unary_rpc_method_handler(upload),
    }),))
    server.add_insecure_port("unix:" + paths.backend)
    server.start()
    try:
        yield servicer
    finally:
        server.stop(None).wait()


@pytest.fixture
def door(paths: Paths, backend: Servicer) -> Iterator[FrontDoor]:
    front = FrontDoor(paths.public, paths.backend, relay_dir=paths.relay)
    backend.door = front
    front.start()
    try:
        yield front
    finally:
        front.close()


def check(target: str) -> int:
    with grpc.insecure_channel(target) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status


def wait_for(condition: Callable[[], bool], within: float = 5.0) -> bool:
    return eventually(condition, within)


def our_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("sandboxd-")]


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


# --------------------------------------------------------------------------- identity


def test_identifies_the_calling_process(door: FrontDoor, backend: Servicer, paths: Paths) -> None:
    assert check("unix:" + paths.public) == health_pb2.HealthCheckResponse.SERVING
    [(peer, who)] = backend.seen
    assert peer.startswith("unix:" + paths.relay + "/"), peer
    assert who == PeerCredentials(uid=os.getuid(), gid=os.getgid(), pid=os.getpid())
    assert stat_mode(paths.public) == 0o666


def test_a_connection_around_the_door_is_refused(door: FrontDoor, backend: Servicer, paths: Paths) -> None:
    # Straight to the backend socket: the server sees "unix:", which names nobody.
    with pytest.raises(grpc.RpcError) as raised:
        check("unix:" + paths.backend)
    assert raised.value.code() == grpc.StatusCode.PERMISSION_DENIED
    [(peer, who)] = backend.seen
    assert who is None and door.identity(peer) is None


# The child starts as root (it must, to become another uid), imports grpc
# (the interpreter's own library may be unreadable to that uid), drops to
# uid/gid, and only then connects and calls. It never says who it is: the
# kernel does.
AS_OTHER_USER = r"""
import os, sys
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
public, uid, gid = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
os.setgroups([])
os.setgid(gid)
os.setuid(uid)
with grpc.insecure_channel("unix:" + public) as channel:
    status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status
print(os.getpid(), os.getuid(), os.getgid(), status)
"""


@pytest.mark.parametrize("uid,gid", [(65534, 65534), (54321, 54322)], ids=["nobody", "unnamed-uid"])
def test_identifies_another_uid_from_the_kernel(door: FrontDoor, backend: Servicer, paths: Paths,
                                                uid: int, gid: int) -> None:
    child = subprocess.run([sys.executable, "-c", AS_OTHER_USER, paths.public, str(uid), str(gid)],
                           capture_output=True, text=True, timeout=30, cwd="/")
    assert child.returncode == 0, child.stderr
    pid, child_uid, child_gid, status = map(int, child.stdout.split())
    assert (child_uid, child_gid, status) == (uid, gid, health_pb2.HealthCheckResponse.SERVING)
    [(_, who)] = backend.seen
    assert who == PeerCredentials(uid=uid, gid=gid, pid=pid)


# --------------------------------------------------------------------------- bulk data


def test_bulk_data_streams_intact(door: FrontDoor, paths: Paths, capsys: pytest.CaptureFixture[str]) -> None:
    count = 256  # x 1 MiB
    rates = {}
    for name, target in (("front door", paths.public), ("direct", paths.backend)):
        with grpc.insecure_channel("unix:" + target) as channel:
            call = channel.unary_stream("/test.Bulk/Stream")
            started = time.perf_counter()
            received = 0
            for index, message in enumerate(call(count.to_bytes(8, "big"), timeout=60)):
                # Whole-message compare (memcmp) rather than hashing: cheap enough not to dominate the timing.
                assert message == chunk(index), f"message {index} differs"
                received += 1
            elapsed = time.perf_counter() - started
            assert received == count
            rates[name] = count * MiB / elapsed / 1e6
    # Upstream too: client -> server through the relay.
    parts = [os.urandom(MiB) for _ in range(32)]
    with grpc.insecure_channel("unix:" + paths.public) as channel:
        digest = channel.stream_unary("/test.Bulk/Upload")(iter(parts), timeout=60)
    assert digest == hashlib.sha256(b"".join(parts)).digest()
    with capsys.disabled():
        print(f"\n[peercred] 256 MiB gRPC server stream: {rates['front door']:.0f} MB/s through the front door, "
              f"{rates['direct']:.0f} MB/s direct")


# A plain backend (no gRPC) to look at the relay itself. The first byte a
# connection sends picks what it does: F floods (counting what it got rid of),
# E echoes.
class RawBackend:
    def __init__(self, path: str) -> None:
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(64)
        self.flooded = 0
        self.flood_stalled = threading.Event()
        self.flood_done = threading.Event()
        self.stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            kind = conn.recv(1)
            if kind == b"E":
                while data := conn.recv(65536):
                    conn.sendall(data)
            elif kind == b"F":
                self._flood(conn)

    def _flood(self, conn: socket.socket) -> None:
        conn.setblocking(False)
        block = b"f" * 65536
        while not self.stop.is_set():
            try:
                self.flooded += conn.send(block)
                continue
            except BlockingIOError:
                pass
            # Nothing could be written for a while: the reader's side is full.
            if not select.select([], [conn], [], 0.3)[1]:
                self.flood_stalled.set()
                select.select([], [conn], [], 0.05)
        conn.setblocking(True)
        conn.shutdown(socket.SHUT_WR)
        self.flood_done.set()
        while conn.recv(65536):
            pass

    def close(self) -> None:
        self.stop.set()
        self.listener.close()


@pytest.fixture
def raw_door(paths: Paths) -> Iterator[tuple[FrontDoor, RawBackend]]:
    raw = RawBackend(paths.backend)
    front = FrontDoor(paths.public, paths.backend, relay_dir=paths.relay)
    front.start()
    try:
        yield front, raw
    finally:
        front.close()
        raw.close()


def echo_once(path: str, payload: bytes) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(path)
        sock.sendall(b"E" + payload)
        sock.shutdown(socket.SHUT_WR)  # the half-close must reach the backend...
        received = b""
        while data := sock.recv(65536):  # ...and its close come back
            received += data
        return received


def test_a_slow_reader_stalls_the_writer_without_stalling_others(
        raw_door: tuple[FrontDoor, RawBackend], paths: Paths) -> None:
    door, raw = raw_door
    slow = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    slow.connect(paths.public)
    slow.sendall(b"F")  # ...and then never read
    assert raw.flood_stalled.wait(10), "the backend never felt backpressure"
    in_flight = raw.flooded
    # Two socket buffers and one pipe, not the whole stream.
    assert in_flight < 8 * MiB, f"{in_flight} bytes buffered for a reader that does not read"
    # Other connections still flow while that one is stuck.
    assert echo_once(paths.public, b"hello" * 1000) == b"hello" * 1000
    # Once the reader reads, everything the backend sent arrives, then EOF.
    raw.stop.set()
    assert raw.flood_done.wait(10)
    slow.settimeout(10)
    got = 0
    while data := slow.recv(MiB):
        got += len(data)
    slow.close()
    assert got == raw.flooded
    assert wait_for(lambda: door.connections == 0)


def test_accepting_survives_running_out_of_descriptors(raw_door: tuple[FrontDoor, RawBackend], paths: Paths,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="sandboxd.network.front_door")
    door, _ = raw_door
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # made while descriptors remain
    client.settimeout(10)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowest_free = os.dup(0)
    os.close(lowest_free)
    # Every descriptor below the limit is taken: accept() now fails with EMFILE.
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free, hard))
    try:
        client.connect(paths.public)  # lands in the backlog
        time.sleep(0.3)
        assert door.connections == 0
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert "file descriptors left" in caplog.text or "cannot accept (Too many open files)" in caplog.text
    assert "sandboxd-frontdoor" in our_threads()
    with client:
        client.sendall(b"Eback")
        assert client.recv(100) == b"back"
    assert echo_once(paths.public, b"later") == b"later"


def test_the_door_leaves_a_reserve_of_descriptors(raw_door: tuple[FrontDoor, RawBackend], paths: Paths,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="sandboxd.network.front_door")
    door, _ = raw_door
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    clients = []
    limit = fd_count() + 64 + 40     # the door's reserve (64), and room for a few connections
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
    try:
        for _ in range(10):
            client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            client.settimeout(10)
            client.connect(paths.public)   # accepted, or left in the backlog
            client.sendall(b"Eping")
            clients.append(client)
        time.sleep(0.5)
        # Some were served, the rest wait: the door stopped before the process ran out.
        assert 0 < door.connections < 10, door.connections
        assert limit - fd_count() >= 32, (limit, fd_count())
        assert "file descriptors left" in caplog.text
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    # Room again: the waiting ones are accepted and served, in the state they were left in.
    for client in clients:
        assert client.recv(4) == b"ping"
        client.close()
    assert wait_for(lambda: door.connections == 0)


def test_a_backend_that_does_not_accept_does_not_stall_the_door(paths: Paths) -> None:
    # A backend whose backlog is full: connect() to it says EAGAIN (a Unix socket never says
    # EINPROGRESS), and the door must retry later rather than wait in connect().
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(paths.backend)
    listener.listen(0)
    squatters = []
    while True:
        squatter = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK)
        try:
            squatter.connect(paths.backend)
        except BlockingIOError:
            squatter.close()
            break
        squatters.append(squatter)
    door = FrontDoor(paths.public, paths.backend, relay_dir=paths.relay, connections_per_uid=3, root_connections=3)
    door.start()
    clients = []
    try:
        for payload in (b"one", b"two", b"six"):
            client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            client.settimeout(10)
            client.connect(paths.public)
            client.sendall(b"E" + payload)
            clients.append(client)
        # The door kept accepting while all three wait for the backend: a fourth is over quota, closed.
        assert wait_for(lambda: door.connections_by_uid() == {0: 3})
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as fourth:
            fourth.settimeout(10)
            fourth.connect(paths.public)
            assert fourth.recv(1) == b""
        # The backend starts accepting (and echoing): the three get through.
        for squatter in squatters:
            squatter.close()
        served = threading.Event()

        def serve() -> None:
            echoed = 0
            while echoed < len(clients):
                conn, _ = listener.accept()
                with conn:
                    if conn.recv(1) == b"E":  # (the squatters' connections, still queued, say nothing)
                        conn.sendall(conn.recv(3))
                        echoed += 1
            served.set()

        threading.Thread(target=serve, daemon=True).start()
        assert sorted(client.recv(3) for client in clients) == [b"one", b"six", b"two"]
        assert served.wait(10)
    finally:
        for client in clients:
            client.close()
        door.close()
        listener.close()


# --------------------------------------------------------------------------- lifecycle


def test_no_backend_means_unavailable_not_a_hang(paths: Paths) -> None:
    with FrontDoor(paths.public, paths.backend, relay_dir=paths.relay) as door:
        door.start()
        with pytest.raises(grpc.RpcError) as raised:
            check("unix:" + paths.public)
        assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
        assert wait_for(lambda: door.connections == 0)
        assert os.listdir(paths.relay) == []


def test_close_removes_everything_and_leaks_nothing(paths: Paths, backend: Servicer) -> None:
    # Warm up what gRPC creates once per process (pollers, wakeup fds), then measure.
    with FrontDoor(paths.public, paths.backend, relay_dir=paths.relay) as warm:
        backend.door = warm
        warm.start()
        assert check("unix:" + paths.public) == health_pb2.HealthCheckResponse.SERVING
    assert wait_for(lambda: not our_threads())
    fds_before = fd_count()

    door = FrontDoor(paths.public, paths.backend, relay_dir=paths.relay)
    backend.door = door
    door.start()
    # A few hundred connections: raw ones that say nothing or garbage, gRPC ones that call.
    for _round in range(3):
        socks = []
        for i in range(80):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(paths.public)
            if i % 2:
                sock.sendall(b"GET / HTTP/1.0\r\n\r\n")
            socks.append(sock)
        for sock in socks:
            sock.close()
        for _ in range(10):
            assert check("unix:" + paths.public) == health_pb2.HealthCheckResponse.SERVING
    assert wait_for(lambda: door.connections == 0), f"{door.connections} relays still alive"
    assert wait_for(lambda: our_threads() == ["sandboxd-frontdoor"]), our_threads()
    assert os.listdir(paths.relay) == []

    # Connections still open at close() are cut, and their files removed.
    channel = grpc.insecure_channel("unix:" + paths.public)
    health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    hanging = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    hanging.connect(paths.public)
    hanging.settimeout(10)
    assert wait_for(lambda: door.connections == 2 and len(os.listdir(paths.relay)) == 2)
    door.close()
    assert not os.path.lexists(paths.public)
    assert os.listdir(paths.relay) == []
    assert door.connections == 0 and door.identity(backend.seen[-1][0]) is None
    assert our_threads() == []
    while hanging.recv(65536):  # gRPC's greeting (SETTINGS), then EOF rather than a hang
        pass
    hanging.close()
    channel.close()
    door.close()  # idempotent
    assert wait_for(lambda: fd_count() <= fds_before), f"{fd_count()} fds now, {fds_before} before"


def stat_mode(path: str) -> int:
    return os.stat(path).st_mode & 0o7777


def test_a_stale_socket_is_replaced(paths: Paths, backend: Servicer) -> None:
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(paths.public)  # a daemon that died without cleaning up
    dead.close()
    os.makedirs(paths.relay, mode=0o700)
    Path(paths.relay, "7.sock").touch()  # and its relay files
    with FrontDoor(paths.public, paths.backend, relay_dir=paths.relay, mode=0o660) as door:
        backend.door = door
        door.start()
        assert os.listdir(paths.relay) == []
        assert stat_mode(paths.public) == 0o660
        assert check("unix:" + paths.public) == health_pb2.HealthCheckResponse.SERVING
    assert not os.path.lexists(paths.public)


def test_refuses_to_replace_what_is_not_a_stale_socket(paths: Paths) -> None:
    Path(paths.public).write_text("precious\n")
    with pytest.raises(FileExistsError, match="not a socket"):
        FrontDoor(paths.public, paths.backend, relay_dir=paths.relay)
    assert Path(paths.public).read_text() == "precious\n"
    os.unlink(paths.public)
    # A live socket: another daemon is using it.
    live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    live.bind(paths.public)
    live.listen(1)
    with live, pytest.raises(OSError) as raised:
        FrontDoor(paths.public, paths.backend, relay_dir=paths.relay)
    assert raised.value.errno == errno.EADDRINUSE and "another process" in str(raised.value)
    assert os.path.exists(paths.public)


def test_refuses_directories_others_can_enter(paths: Paths) -> None:
    open_dir = paths.base / "open"
    open_dir.mkdir(mode=0o755)
    os.chmod(open_dir, 0o755)
    with pytest.raises(PermissionError, match="relay directory"):
        FrontDoor(paths.public, paths.backend, relay_dir=str(open_dir))
    with pytest.raises(PermissionError, match="backend socket directory"):
        FrontDoor(paths.public, str(open_dir / "grpc.sock"), relay_dir=paths.relay)
    assert not os.path.lexists(paths.public)


# --------------------------------------------------------------------------- groups, refusals, quotas


@pytest.fixture
def user_in_group() -> Iterator[tuple[str, int, int, int]]:
    """A real local user (useradd) with a real supplementary group (groupadd): name, uid, gid, group."""
    import grp
    import pwd
    from daemon_helpers import scratch_group
    user = f"sbxt-{os.urandom(4).hex()}"
    with scratch_group("sbxt-g") as group:
        subprocess.run(["useradd", "-M", "-N", "-s", "/usr/sbin/nologin", "-G", group, user], check=True)
        try:
            entry = pwd.getpwnam(user)
            yield user, entry.pw_uid, entry.pw_gid, grp.getgrnam(group).gr_gid
        finally:
            subprocess.run(["userdel", user], check=True)


# As AS_OTHER_USER, but the groups are the user's own from /etc/group (initgroups), as a login has them.
AS_USER_WITH_GROUPS = r"""
import os, sys
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
public, name, uid, gid = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
os.initgroups(name, gid)
os.setgid(gid)
os.setuid(uid)
with grpc.insecure_channel("unix:" + public) as channel:
    status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status
print(os.getpid(), status, *os.getgroups())
"""


def test_supplementary_groups_come_from_the_kernel(door: FrontDoor, backend: Servicer, paths: Paths,
                                                   user_in_group: tuple[str, int, int, int]) -> None:
    name, uid, gid, group = user_in_group
    child = subprocess.run([sys.executable, "-c", AS_USER_WITH_GROUPS, paths.public, name, str(uid), str(gid)],
                           capture_output=True, text=True, timeout=30, cwd="/")
    assert child.returncode == 0, child.stderr
    pid, status, *groups = map(int, child.stdout.split())
    assert status == health_pb2.HealthCheckResponse.SERVING and group in groups
    [(_, who)] = backend.seen
    assert who is not None and (who.uid, who.gid, who.pid) == (uid, gid, pid)
    assert group in who.groups and sorted(who.groups) == sorted(set(groups))
    # Control: a caller without supplementary groups is seen without any.
    child = subprocess.run([sys.executable, "-c", AS_OTHER_USER, paths.public, "65534", "65534"],
                           capture_output=True, text=True, timeout=30, cwd="/")
    assert child.returncode == 0, child.stderr
    assert backend.seen[-1][1] is not None and backend.seen[-1][1].groups == ()


def private_channel(target: str) -> grpc.Channel:
    """A channel with a connection of its own (grpcio otherwise shares one per target)."""
    return grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])


def test_a_refused_caller_is_denied_on_every_call(paths: Paths, backend: Servicer) -> None:
    refuse = ["you run inside a sandbox of this daemon (test)"]
    asked: list[tuple[PeerCredentials, int, str]] = []

    def check(who: PeerCredentials, pidfd: int) -> str:
        # What the pidfd says about the process it pins (Linux 6.5+: always there).
        with open(f"/proc/self/fdinfo/{pidfd}") as f:
            pinned = next(line.split()[1] for line in f if line.startswith("Pid:"))
        asked.append((who, int(pinned), refuse[0]))
        return refuse[0]

    with FrontDoor(paths.public, paths.backend, relay_dir=paths.relay, peer_check=check) as door:
        backend.door = door
        door.start()
        refused = private_channel("unix:" + paths.public)
        stub = health_pb2_grpc.HealthStub(refused)
        for _ in range(3):
            with pytest.raises(grpc.RpcError) as raised:
                stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert raised.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert raised.value.details() == refuse[0]
        # Decided once, at accept: a new connection is asked again, the old one stays refused.
        refuse[0] = ""
        with private_channel("unix:" + paths.public) as accepted:
            assert health_pb2_grpc.HealthStub(accepted).Check(health_pb2.HealthCheckRequest(), timeout=10).status \
                == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as raised:
            stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert raised.value.code() == grpc.StatusCode.PERMISSION_DENIED
        refused.close()
    assert [(who.uid, who.pid, pinned, reason) for who, pinned, reason in asked] == [
        (os.getuid(), os.getpid(), os.getpid(), "you run inside a sandbox of this daemon (test)"),
        (os.getuid(), os.getpid(), os.getpid(), "")]
    assert asked[0][0].groups == tuple(sorted(set(os.getgroups()))) or set(asked[0][0].groups) == set(os.getgroups())


def test_a_check_that_fails_refuses(paths: Paths, backend: Servicer, caplog: pytest.LogCaptureFixture) -> None:
    def check(who: PeerCredentials, pidfd: int) -> str:
        raise RuntimeError("cannot tell")

    with FrontDoor(paths.public, paths.backend, relay_dir=paths.relay, peer_check=check) as door:
        backend.door = door
        door.start()
        with pytest.raises(grpc.RpcError) as raised:
            with private_channel("unix:" + paths.public) as channel:
                health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert raised.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "could not check who is calling" in raised.value.details()
    assert "peer check failed" in caplog.text


def test_a_caller_the_daemon_cannot_see_is_refused_with_the_fix(paths: Paths, backend: Servicer) -> None:
    """SO_PEERCRED's pid is 0 for a caller outside the daemon's PID namespace (a daemon in a pod
    without hostPID, found by packaging/container/build-and-run): it is refused with what to change,
    and the check is not asked about a process it cannot see."""
    asked: list[int] = []

    def check(who: PeerCredentials, pidfd: int) -> str:
        asked.append(who.pid)
        return ""

    with FrontDoor(paths.public, paths.backend, relay_dir=paths.relay, peer_check=check) as door:
        ours, theirs = socket.socketpair()
        with ours, theirs:
            invisible = door._check(ours, PeerCredentials(uid=os.getuid(), gid=os.getgid(), pid=0, groups=()))
            visible = door._check(ours, PeerCredentials(uid=os.getuid(), gid=os.getgid(), pid=os.getpid(), groups=()))
    assert "outside the daemon's PID namespace" in invisible and "hostPID: true" in invisible
    assert visible == "" and asked == [os.getpid()]                  # control: a visible caller is checked


# Connects `count` times to the public socket as uid/gid, says how many connections the door
# closed at once (EOF without a byte) and whether one more echoes, then waits for a line on stdin.
HOLD_CONNECTIONS = r"""
import os, select, socket, sys
public, uid, gid, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
os.setgroups([])
os.setgid(gid)
os.setuid(uid)
socks = []
for _ in range(count):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(public)
    socks.append(s)
closed = 0
for s in socks:
    s.settimeout(10)
    try:
        s.sendall(b"Ex")      # the raw backend echoes what follows E
        closed += s.recv(1) == b""
    except (BrokenPipeError, ConnectionResetError):
        closed += 1
print(closed, flush=True)
sys.stdin.readline()
"""


def test_connections_over_a_uids_quota_are_closed_at_once(paths: Paths, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="sandboxd.network.front_door")
    raw = RawBackend(paths.backend)
    door = FrontDoor(paths.public, paths.backend, relay_dir=paths.relay, connections_per_uid=3, root_connections=5)
    door.start()
    holders = []
    try:
        holder = subprocess.Popen([sys.executable, "-c", HOLD_CONNECTIONS, paths.public, "65534", "65534", "6"],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd="/")
        holders.append(holder)
        assert holder.stdout is not None
        assert holder.stdout.readline().split() == ["3"]        # 6 tried, 3 served, 3 closed
        assert door.connections_by_uid() == {65534: 3}
        # Everyone else is still served: root (its own, larger bound) up to 5...
        mine = []
        for _ in range(5):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(10)
            sock.connect(paths.public)
            sock.sendall(b"Eok")
            assert sock.recv(2) == b"ok"
            mine.append(sock)
        assert door.connections_by_uid() == {65534: 3, 0: 5}
        # ...and its sixth is closed.
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sixth:
            sixth.settimeout(10)
            sixth.connect(paths.public)
            assert sixth.recv(1) == b""
        for sock in mine:
            sock.close()
        # One warning per uid, however many connections it had closed.
        assert caplog.text.count("uid 65534 has 3 connections open") == 1, caplog.text
        assert caplog.text.count("uid 0 has 5 connections open") == 1, caplog.text
        holder.communicate("\n", timeout=30)
        assert wait_for(lambda: door.connections_by_uid() == {}), door.connections_by_uid()
        # The quota is of connections open at once: gone, the uid may connect again.
        again = subprocess.run([sys.executable, "-c", HOLD_CONNECTIONS, paths.public, "65534", "65534", "3"],
                               input="\n", capture_output=True, text=True, timeout=30, cwd="/")
        assert again.stdout.split() == ["0"], again.stderr
        assert wait_for(lambda: door.connections == 0)
    finally:
        for holder in holders:
            holder.kill()
            holder.wait()
        door.close()
        raw.close()


# Connects to the public socket, hands the connection to its parent (SCM_RIGHTS), and exits.
CONNECT_AND_EXIT = r"""
import socket, sys
public, channel = sys.argv[1], socket.socket(fileno=int(sys.argv[2]))
conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
conn.connect(public)
socket.send_fds(channel, [b"x"], [conn.fileno()])
"""


class PeerOf:
    """What a handler's context says: just the peer string (caller() needs nothing else)."""

    def __init__(self, peer: str) -> None:
        self._peer = peer

    def peer(self) -> str:
        return self._peer


def test_a_connection_whose_process_is_gone_is_refused(paths: Paths) -> None:
    raw = RawBackend(paths.backend)
    asked: list[int] = []

    def check(who: PeerCredentials, pidfd: int) -> str:
        asked.append(who.pid)
        return ""

    door = FrontDoor(paths.public, paths.backend, relay_dir=paths.relay, peer_check=check)
    ours, theirs = socket.socketpair()
    try:
        # Not started yet: the connection waits in the backlog while its process exits.
        child = subprocess.run([sys.executable, "-c", CONNECT_AND_EXIT, paths.public, str(theirs.fileno())],
                               pass_fds=[theirs.fileno()], capture_output=True, text=True, timeout=30)
        assert child.returncode == 0, child.stderr
        _, [fd], _, _ = socket.recv_fds(ours, 1, 1)
        inherited = socket.socket(fileno=fd)
        door.start()
        # Control: a live process connecting after it is checked and served.
        live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        live.connect(paths.public)
        assert wait_for(lambda: door.connections == 2)
        gone = door.identity(f"unix:{paths.relay}/0.sock")
        served = door.identity(f"unix:{paths.relay}/1.sock")
        assert gone is not None and "exited before the daemon could check it" in gone.refusal
        assert served is not None and served.refusal == "" and served.pid == os.getpid()
        assert asked[-1] == os.getpid() and len(asked) <= 2   # (the gone one: asked or not, by kernel)
        with pytest.raises(CallerRefused, match="exited before"):
            caller(door, PeerOf(f"unix:{paths.relay}/0.sock"))
        assert caller(door, PeerOf(f"unix:{paths.relay}/1.sock")) == served
        inherited.close()
        live.close()
    finally:
        ours.close()
        theirs.close()
        door.close()
        raw.close()
