"""The host's network is not the host's local IPC (issue 24, round 4).

The hole: with `--network=host` the connect broker let a sandbox reach every host Unix socket but
sandboxd's own and the approval channels: the user's D-Bus session bus and `systemd --user`'s
private socket (from which `systemd-run --user` starts a process outside every wall), a Docker
socket, an ssh-agent, X11 by its file or its abstract twin. Now, with the host's network as
without network, a Unix connect succeeds only to a socket of the sandbox's own (its listener held
by a process of the sandbox) or one the policy names (`--allow-unix-socket`, allowed_unix_sockets);
Unix datagram sockets are refused, as without network.

A plain user the test makes runs the host's services here: a pathname listener in a 0700
directory of theirs (standing in for /run/user/UID/bus: this machine runs no user session), a
second one the policy names, an abstract listener (an X server's @/tmp/.X11-unix/X0, an abstract
D-Bus address), a seqpacket listener whose abstract name a sandbox also binds as a stream socket,
and a datagram socket (a journal). The same user probes them from a `--network=host` session of
the daemon, a rootless `sandboxd run --network=host` and root's `sandboxd run --network=host`
(which runs the command as the workspace's owner); each time the control is the same probe from
the host, as that user, and the services count what reached them.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from conftest import BASE_ENV, PY, REPO, SANDBOXD, SLOW, describe, make_dir, readable_copy_of_sandboxd
from daemon_fixtures import daemon  # noqa: F401 - a pytest fixture
from daemon_helpers import Daemon, PlainUser, plain_users, run_client_as
from socket_probes import ATTEMPT

pytestmark = pytest.mark.timeout(int(600 * SLOW))

# The user's services on the host. Each accepts (or receives) and counts; a line on stdin asks for
# the counts (and resets them), printed as one JSON line.
SERVICES = textwrap.dedent('''
    import json, os, socket, sys, threading
    names = json.loads(sys.argv[1])
    counts, lock = {}, threading.Lock()
    def serve(name, kind, address):
        s = socket.socket(socket.AF_UNIX, kind)
        if not address.startswith("@") and os.path.exists(address):
            os.unlink(address)
        s.bind(address.replace("@", "\\0", 1) if address.startswith("@") else address)
        counts[name] = 0
        if kind == socket.SOCK_DGRAM:
            def loop():
                while True:
                    s.recv(256)
                    with lock:
                        counts[name] += 1
        else:
            s.listen(64)
            def loop():
                while True:
                    s.accept()[0].close()
                    with lock:
                        counts[name] += 1
        threading.Thread(target=loop, daemon=True).start()
    serve("bus", socket.SOCK_STREAM, names["bus"])
    serve("agent", socket.SOCK_STREAM, names["agent"])
    serve("abstract bus", socket.SOCK_STREAM, names["abstract bus"])
    serve("abstract seqpacket", socket.SOCK_SEQPACKET, names["twin"])
    serve("journal", socket.SOCK_DGRAM, names["journal"])
    print("ready", flush=True)
    for _ in sys.stdin:
        with lock:
            print(json.dumps(counts), flush=True)
            for name in counts:
                counts[name] = 0
''')

# What a process tries, from a JSON plan; prints one JSON object. "@NAME" is an abstract address.
PROBE = textwrap.dedent('''
    import errno, json, os, socket, sys
    plan, seen = json.loads(sys.argv[1]), {}
    KINDS = {"stream": socket.SOCK_STREAM, "seqpacket": socket.SOCK_SEQPACKET}
    def address(text):
        return "\\0" + text[1:] if text.startswith("@") else text
    def failure(e):
        return errno.errorcode.get(e.errno, str(e.errno)) if e.errno else type(e).__name__
    def connect(kind, where):
        s = socket.socket(socket.AF_UNIX, KINDS[kind])
        s.settimeout(10)
        try:
            s.connect(address(where))
            return "connected"
        except OSError as e:
            return failure(e)
        finally:
            s.close()
    for name, (kind, where) in plan.get("connect", {}).items():
        seen[name] = connect(kind, where)
    for name, where in plan.get("datagram", {}).items():
        try:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        except OSError as e:
            seen[name] = "create " + failure(e)
            continue
        try:
            s.sendto(b"hello", address(where))
            seen[name] = "sent"
        except OSError as e:
            seen[name] = "send " + failure(e)
    # The sandbox's own servers: another process of it connects and is answered.
    for name, (kind, where) in plan.get("own", {}).items():
        srv = socket.socket(socket.AF_UNIX, KINDS[kind])
        if not where.startswith("@") and os.path.lexists(where):
            os.unlink(where)
        srv.bind(address(where))
        srv.listen(4)
        pid = os.fork()
        if pid == 0:
            c = socket.socket(socket.AF_UNIX, KINDS[kind])
            c.settimeout(10)
            try:
                c.connect(address(where))
                c.sendall(b"ping")
                os._exit(0 if c.recv(4) == b"pong" else 1)
            except OSError as e:
                os._exit(e.errno or 1)
        conn = None
        srv.settimeout(10)
        try:
            conn = srv.accept()[0]
            conn.sendall(conn.recv(4).replace(b"ping", b"pong"))
        except OSError:
            pass
        status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        seen[name] = "pong" if status == 0 else errno.errorcode.get(status, str(status))
        srv.close()
        if not where.startswith("@"):
            os.unlink(where)
    # A stream listener of the sandbox's own under the name of the host's seqpacket one (abstract
    # names are per type): its own is reached, the host's is not.
    if "twin" in plan:
        own = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        own.bind(address(plan["twin"]))
        own.listen(4)
        seen["twin: own stream"] = connect("stream", plan["twin"])
        seen["twin: host seqpacket"] = connect("seqpacket", plan["twin"])
        own.close()
    print(json.dumps(seen))
''')

# The session's calls: a server started in the background (a dev server) and reached from a later
# call of the same session, by its path in the session's /tmp and by an abstract name.
BACKGROUND_SERVER = textwrap.dedent('''
    import os, socket, sys, threading
    def serve(kind, address):
        s = socket.socket(socket.AF_UNIX, kind)
        s.bind(address)
        s.listen(8)
        def loop():
            while True:
                c = s.accept()[0]
                c.sendall(b"pong")
                c.close()
        threading.Thread(target=loop, daemon=True).start()
    serve(socket.SOCK_STREAM, "/tmp/dev.sock")
    serve(socket.SOCK_STREAM, "\\0" + sys.argv[1])
    open("/tmp/dev.ready", "w").close()
    threading.Event().wait()
''')

SESSION_PROBE = textwrap.dedent('''
    import time
    def run(session_id, argv):
        out = b""
        for reply in stub.Run(pb.ExecStart(session_id=session_id, argv=argv)):
            if reply.WhichOneof("kind") in ("stdout", "stderr"):
                out += getattr(reply, reply.WhichOneof("kind"))
        return out.decode()
    session = stub.CreateSession(pb.CreateSessionRequest(workspace=ARGS["workspace"], approval_policy=pb.NEVER,
        sandbox_policy=pb.SandboxPolicy(mode=pb.SandboxPolicy.WORKSPACE_WRITE, **ARGS["policy"])))
    result = {}
    try:
        result["probe"] = run(session.id, ["/usr/bin/python3", "-c", ARGS["probe"], ARGS["plan"]])
        if ARGS.get("background"):
            stub.StartBackground(pb.StartBackgroundRequest(session_id=session.id, argv=[
                "/usr/bin/python3", "-c", ARGS["background"], ARGS["dev_name"]]))
            deadline = time.monotonic() + 120
            while run(session.id, ["/bin/ls", "/tmp/dev.ready"]).strip() != "/tmp/dev.ready":
                assert time.monotonic() < deadline, "the background server never started"
                time.sleep(0.1)
            result["dev"] = run(session.id, ["/usr/bin/python3", "-c", ARGS["probe"], ARGS["dev_plan"]])
    finally:
        stub.CloseSession(pb.CloseSessionRequest(session_id=session.id))
    print(json.dumps(result))
''')

WARM_FILTERS = ("from sandboxd.kernel import seccomp\n"
                "seccomp.program_for(seccomp.FilterSpec(confined=True))\n")


class World(NamedTuple):
    daemon: Daemon
    user: PlainUser
    base: Path                 # 0755, root's
    code: Path                 # a copy of the sandboxd package every user can read (rootless runs)
    workspace: Path            # the user's, 0700
    names: dict[str, str]      # the services' addresses (SERVICES)
    services: "subprocess.Popen[str]"

    def counts(self) -> dict[str, int]:
        """What reached each service since the last look."""
        assert self.services.stdin is not None and self.services.stdout is not None
        self.services.stdin.write("count\n")
        self.services.stdin.flush()
        return dict(json.loads(self.services.stdout.readline()))


def _as(user: PlainUser, cwd: str = "/") -> dict[str, Any]:
    return {"user": user.uid, "group": user.gid, "extra_groups": [], "cwd": cwd}


@pytest.fixture(scope="module")
def world(daemon: Daemon) -> Iterator[World]:  # noqa: F811
    subprocess.run([sys.executable, "-c", WARM_FILTERS], check=True, timeout=120, cwd=REPO)
    with plain_users(1) as (user,):
        base = Path(tempfile.mkdtemp(prefix="sbxhostunix-", dir="/var/tmp"))
        services = None
        try:
            os.chmod(base, 0o755)
            code = readable_copy_of_sandboxd(base)
            workspace = make_dir(base / "ws", 0o700)
            run_dir = make_dir(base / "run-user", 0o700)      # what /run/user/UID is to a desktop session
            for path in (workspace, run_dir):
                os.chown(path, user.uid, user.gid)
            tag = uuid.uuid4().hex[:12]
            names = {"bus": str(run_dir / "bus"), "agent": str(run_dir / "agent.sock"),
                     "abstract bus": f"@sbxtest-{tag}/bus", "twin": f"@sbxtest-{tag}/twin",
                     "journal": str(run_dir / "journal.sock")}
            services = subprocess.Popen([PY, "-c", SERVICES, json.dumps(names)], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True, env=BASE_ENV, **_as(user))
            assert services.stdout is not None and services.stdout.readline() == "ready\n"
            yield World(daemon, user, base, code, workspace, names, services)
        finally:
            if services is not None:
                services.kill()
                services.wait(timeout=60)
            shutil.rmtree(base, ignore_errors=True)


def host_plan(w: World) -> dict[str, Any]:
    """Every host service, as a client of the user's would reach it."""
    return {"connect": {"bus": ["stream", w.names["bus"]], "agent": ["stream", w.names["agent"]],
                        "abstract bus": ["stream", w.names["abstract bus"]],
                        "abstract seqpacket": ["seqpacket", w.names["twin"]]},
            "datagram": {"journal": w.names["journal"], "abstract journal": "@sbxtest-none"}}


def sandbox_plan(w: World) -> dict[str, Any]:
    """The host's services, and the sandbox's own servers (its /tmp is its own)."""
    own_name = f"@sbxtest-own-{uuid.uuid4().hex[:12]}"
    return {**host_plan(w),
            "own": {"own stream /tmp": ["stream", "/tmp/own.sock"],
                    "own seqpacket /tmp": ["seqpacket", "/tmp/own-seqpacket.sock"],
                    "own stream in the workspace": ["stream", "own-in-ws.sock"],
                    "own abstract": ["stream", own_name]},
            "twin": w.names["twin"]}


# Inside every host-network sandbox: the host's services refused, except the one the policy names;
# the sandbox's own servers answered.
EXPECTED_INSIDE = {
    "bus": "EACCES", "agent": "connected", "abstract bus": "ECONNREFUSED", "abstract seqpacket": "ECONNREFUSED",
    "journal": "create EACCES", "abstract journal": "create EACCES",
    "own stream /tmp": "pong", "own seqpacket /tmp": "pong", "own stream in the workspace": "pong",
    "own abstract": "pong", "twin: own stream": "connected", "twin: host seqpacket": "ECONNREFUSED",
}
# What reached the services from inside: only the connect to the socket the policy names.
REACHED_FROM_INSIDE = {"bus": 0, "agent": 1, "abstract bus": 0, "abstract seqpacket": 0, "journal": 0}


def probe_on_host(w: World) -> dict[str, Any]:
    """The control: the same user, outside any sandbox, reaches every service."""
    done = subprocess.run([PY, "-c", PROBE, json.dumps(host_plan(w))], capture_output=True, text=True,
                          timeout=120 * SLOW, env=BASE_ENV, **_as(w.user))
    assert done.returncode == 0, describe(done)
    return dict(json.loads(done.stdout))


def check_control(w: World) -> None:
    seen = probe_on_host(w)
    assert seen == {"bus": "connected", "agent": "connected", "abstract bus": "connected",
                    "abstract seqpacket": "connected", "journal": "sent",
                    "abstract journal": "send ECONNREFUSED"}, seen
    assert w.counts() == {"bus": 1, "agent": 1, "abstract bus": 1, "abstract seqpacket": 1, "journal": 1}


def run_probe(w: World, *, rootless: bool) -> dict[str, Any]:
    """The sandbox plan in `sandboxd run --network=host --allow-unix-socket AGENT`: rootless (the
    user runs a copy of sandboxd) or root's (in the user's workspace: the command runs as the user)."""
    if rootless:
        command = [PY, "-m", "sandboxd.cli.main", "run"]
        options: dict[str, Any] = {"env": {**BASE_ENV, "HOME": str(w.workspace), "PYTHONPATH": str(w.code)},
                                   **_as(w.user, str(w.workspace))}
    else:
        command, options = [SANDBOXD, "run"], {"env": BASE_ENV, "cwd": str(w.workspace)}
    done = subprocess.run([*command, "--workspace", str(w.workspace), "--network=host",
                           "--allow-unix-socket", w.names["agent"], "--", PY, "-c", PROBE,
                           json.dumps(sandbox_plan(w))], capture_output=True, text=True, timeout=180 * SLOW,
                          stdin=subprocess.DEVNULL, **options)
    assert done.returncode == 0, describe(done)
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize("rootless", [True, False], ids=["rootless", "root"])
def test_a_host_network_run_reaches_no_host_unix_socket(world: World, rootless: bool) -> None:
    """`sandboxd run --network=host`, rootless as the user, or root's in the user's workspace (the
    command runs as the user, the workspace's owner): the stand-in session bus, the abstract
    listener, the seqpacket one behind a name the sandbox also binds, and the journal are refused;
    the socket `--allow-unix-socket` names is reached; the sandbox's own servers (in its /tmp, its
    workspace, abstract) answer. Control: the same user on the host reaches every one."""
    w = world
    w.counts()
    seen = run_probe(w, rootless=rootless)
    assert seen == EXPECTED_INSIDE, seen
    assert w.counts() == REACHED_FROM_INSIDE
    check_control(w)


def test_a_host_network_daemon_session_reaches_no_host_unix_socket(world: World) -> None:
    """A `network_mode="host"` session the user opens on the daemon: the same from its calls, and
    a server the session started in the background is reached from its later calls (the session's
    init brokers them all: the listener is held in its PID namespace)."""
    w = world
    w.counts()
    dev_name = f"sbxtest-dev-{uuid.uuid4().hex[:12]}"
    dev_plan = {"connect": {"dev /tmp": ["stream", "/tmp/dev.sock"], "dev abstract": ["stream", "@" + dev_name]}}
    answer = run_client_as(w.user.uid, w.user.gid, w.daemon.socket, SESSION_PROBE, {
        "workspace": str(w.workspace), "probe": PROBE, "plan": json.dumps(sandbox_plan(w)),
        "policy": {"network_access": True, "network_mode": "host", "allowed_unix_sockets": [w.names["agent"]]},
        "background": BACKGROUND_SERVER, "dev_name": dev_name, "dev_plan": json.dumps(dev_plan)})
    seen = json.loads(answer["probe"].strip().splitlines()[-1])
    assert seen == EXPECTED_INSIDE, answer
    assert json.loads(answer["dev"].strip().splitlines()[-1]) == {"dev /tmp": "connected",
                                                                  "dev abstract": "connected"}, answer
    assert w.counts() == REACHED_FROM_INSIDE
    check_control(w)


def test_without_the_allowed_socket_nothing_of_the_host_is_reached(world: World) -> None:
    """The same session without allowed_unix_sockets: the socket it named before is refused too."""
    w = world
    w.counts()
    plan = {"connect": {"agent": ["stream", w.names["agent"]], "bus": ["stream", w.names["bus"]]}}
    answer = run_client_as(w.user.uid, w.user.gid, w.daemon.socket, SESSION_PROBE, {
        "workspace": str(w.workspace), "probe": PROBE, "plan": json.dumps(plan),
        "policy": {"network_access": True, "network_mode": "host"}})
    assert json.loads(answer["probe"].strip().splitlines()[-1]) == {"agent": "EACCES", "bus": "EACCES"}, answer
    assert w.counts() == {"bus": 0, "agent": 0, "abstract bus": 0, "abstract seqpacket": 0, "journal": 0}
    check_control(w)


# Another local user's listeners, many of them (abstract names and files of its own), held until
# stdin closes: with the host's network they share the sandbox's namespace. Finding 9 of round 4's
# second hostile pass: the broker dumped them all on every connect (95,000 made each of a
# host-network sandbox's Unix connects 200 times slower); now it looks only at the sandbox's own.
CROWD = textwrap.dedent('''
    import os, resource, socket, sys
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    directory, count, part = sys.argv[1], min(int(sys.argv[2]), hard - 64), sys.argv[3]
    held = []
    for i in range(count):
        s = socket.socket(socket.AF_UNIX)
        s.bind(os.path.join(directory, "l%s-%d" % (part, i)) if i % 10 == 0 else "\\0sbxtest-crowd-%d-%d" % (os.getpid(), i))
        s.listen(1)
        held.append(s)
    print(len(held), flush=True)
    sys.stdin.read()
''')
CROWD_SIZE = 10_000


@pytest.fixture(scope="module")
def crowd(world: World) -> Iterator[int]:
    """CROWD_SIZE listeners of another plain user, in as many processes as its descriptor limit needs."""
    with plain_users(1) as (other,):
        directory = make_dir(world.base / "crowd", 0o700)
        os.chown(directory, other.uid, other.gid)
        # A plain user's process holds as many as its hard descriptor limit allows (4096 on the
        # matrix's guests, and root here cannot raise it without CAP_SYS_RESOURCE): as many
        # processes as it takes.
        processes: list[subprocess.Popen[str]] = []
        held = 0
        try:
            while held < CROWD_SIZE and len(processes) < 16:
                process = subprocess.Popen([PY, "-c", CROWD, str(directory), str(CROWD_SIZE - held),
                                            str(len(processes))], stdin=subprocess.PIPE,
                                           stdout=subprocess.PIPE, text=True, env=BASE_ENV, **_as(other))
                processes.append(process)
                assert process.stdout is not None
                held += int(process.stdout.readline())
            yield held
        finally:
            for process in processes:
                process.kill()
                process.wait(timeout=60)


def test_own_sockets_are_found_among_many_foreign_listeners(world: World, crowd: int) -> None:
    """With another user's thousands of listening sockets in the host's namespace: the sandbox's own
    servers answer, the host's services are refused, from a host-network session (its background
    server too) and a rootless run, as without them."""
    w = world
    assert crowd >= 5_000
    w.counts()
    assert run_probe(w, rootless=True) == EXPECTED_INSIDE
    assert w.counts() == REACHED_FROM_INSIDE
    test_a_host_network_daemon_session_reaches_no_host_unix_socket(w)


# A command's servers whose bound name no longer leads to them: one bound under a temporary name
# and renamed into place (its own: reached), and one whose file was unlinked and replaced by a host
# socket moved there from the workspace (the host's, behind the own socket's name: refused).
RENAMES = ATTEMPT + textwrap.dedent('''
    import json, os, sys
    host_socket, seen = sys.argv[1], {}
    def connect(path):
        return attempt(socket.AF_UNIX, path)
    moved = socket.socket(socket.AF_UNIX)
    moved.bind("/tmp/placing.sock")
    moved.listen(4)
    os.rename("/tmp/placing.sock", "/tmp/served.sock")
    seen["own, renamed into place"] = connect("/tmp/served.sock")
    decoy = socket.socket(socket.AF_UNIX)
    decoy.bind("decoy.sock")
    decoy.listen(4)
    seen["own, before"] = connect("decoy.sock")
    os.unlink("decoy.sock")
    os.rename(host_socket, "decoy.sock")
    seen["host's, under the own one's name"] = connect("decoy.sock")
    print(json.dumps(seen))
''')


def test_a_host_socket_moved_under_an_own_sockets_name_is_refused(world: World, crowd: int) -> None:
    """A host-network sandbox cannot pass a host socket off as its own by giving it the name its own
    socket was bound by (getsockname() still says that name; the broker asks sock_diag which file
    the socket is bound to). The host's server, the user's in the workspace, is reached by the same
    path from the host (the control)."""
    w = world
    host_server = socket.socket(socket.AF_UNIX)
    try:
        host_socket = w.workspace / "host-server.sock"
        host_server.bind(str(host_socket))
        os.chown(host_socket, w.user.uid, w.user.gid)
        host_server.listen(8)
        host_server.setblocking(False)
        answer = run_client_as(w.user.uid, w.user.gid, w.daemon.socket, SESSION_PROBE, {
            "workspace": str(w.workspace), "probe": RENAMES, "plan": str(host_socket),
            "policy": {"network_access": True, "network_mode": "host"}})
        seen = json.loads(answer["probe"].strip().splitlines()[-1])
        assert seen == {"own, renamed into place": "connected", "own, before": "connected",
                        "host's, under the own one's name": "EACCES"}, answer
        with pytest.raises(BlockingIOError):
            host_server.accept()                   # nothing reached it
        control = probe_on_path(w, str(w.workspace / "decoy.sock"))
        assert control == "connected"
        host_server.accept()[0].close()
    finally:
        host_server.close()
        for name in ("decoy.sock", "host-server.sock"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(w.workspace / name)


def probe_on_path(w: World, path: str) -> str:
    """The user connects to ``path`` from the host."""
    done = subprocess.run([PY, "-c", "import socket, sys; socket.socket(socket.AF_UNIX).connect(sys.argv[1])", path],
                          capture_output=True, text=True, timeout=120 * SLOW, env=BASE_ENV, **_as(w.user))
    return "connected" if done.returncode == 0 else done.stderr.strip().splitlines()[-1]
