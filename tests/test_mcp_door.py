"""The door of `sandboxd mcp --http` (issue 24, item 1): no sandboxed command reaches an approval
channel, whatever its network.

The attack (round 4): `sandboxd mcp --http` admitted clients by uid only. A command in a
`--network=host` sandbox runs as that uid and shares the host's loopback: it connected, opened an
MCP session and approved its own held calls. Three walls now, each tested alone here, from a
rootless `sandboxd run --network=host` and from a `--network=host` daemon session of a plain user
the test makes, each with a control (the same connection succeeding without that wall):

1. every sandbox's connect broker refuses the server's registered listening sockets (loopback
   TCP and Unix), whatever the sandbox's network and policy (control: another listener of the
   same user, beside it, is reached: a TCP one by the host's network, a Unix one when the policy
   names it, as it names the server's);
2. the server refuses (403) a connection whose process runs inside a sandbox, before any HTTP is
   read (shown from sandboxes whose broker does not know the server: a second daemon's session,
   a run that knows no daemon; control: the same request from outside succeeds);
3. every request needs the server's bearer token (401), which no sandbox can read (shown through a
   relay of the user's on the host, which walls 1 and 2 cannot tell apart from the user; control:
   the same relay with the token succeeds).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from conftest import BASE_ENV, PY, REPO, SLOW, describe, make_dir, readable_copy_of_sandboxd
from daemon_fixtures import daemon  # noqa: F401 - a pytest fixture
from daemon_helpers import Daemon, DaemonFactory, PlainUser, plain_users, run_client_as
from mcp_helpers import ENV, SANDBOXD
from sandboxd import defaults

pytestmark = pytest.mark.timeout(int(600 * SLOW))

# What a sandboxed (or host) process tries, from a JSON plan: TCP and Unix connects, HTTP requests
# (with the token read from a file, if it can), file reads. Prints what happened, as JSON.
PROBE = textwrap.dedent('''
    import errno, http.client, json, os, socket, sys
    plan, seen = json.loads(sys.argv[1]), {}
    def failure(e):
        return errno.errorcode.get(e.errno, type(e).__name__) if isinstance(e, OSError) and e.errno else type(e).__name__
    for name, (host, port) in plan.get("tcp", {}).items():
        s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        s.settimeout(10)
        try:
            s.connect((host, port)); seen[name] = "connected"
        except OSError as e:
            seen[name] = failure(e)
        s.close()
    for name, path in plan.get("unix", {}).items():
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(10)
        try:
            s.connect(path); seen[name] = "connected"
        except OSError as e:
            seen[name] = failure(e)
        s.close()
    for name, path in plan.get("read", {}).items():
        try:
            seen[name] = "read " + str(len(open(path).read()))
        except OSError as e:
            seen[name] = failure(e)
    body = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {"elicitation": {}},
        "clientInfo": {"name": "probe", "version": "1"}}})
    for name, (host, port, token_file) in plan.get("post", {}).items():
        headers = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream",
                   "Host": f"127.0.0.1:{port}"}
        if token_file:
            try:
                headers["Authorization"] = "Bearer " + open(token_file).read().strip()
            except OSError as e:
                seen[name] = "token " + failure(e)
                continue
        try:
            c = http.client.HTTPConnection(host, port, timeout=30)
            if plan.get("undumpable"):
                # Connected first (the connect broker reads the caller's memory, which it could
                # not then), and then hide this process's descriptors from its own user.
                c.connect()
                import ctypes
                assert ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0) == 0   # PR_SET_DUMPABLE
            c.request("POST", "/mcp", body, headers)
            seen[name] = c.getresponse().status
        except OSError as e:
            seen[name] = failure(e)
    print(json.dumps(seen))
''')

# Run as the user on the host: a plain TCP listener and a plain Unix one (the controls of wall 1),
# and a relay from a port to the MCP server's (wall 3: a proxy or port forward of the user's).
HELPER = textwrap.dedent('''
    import json, os, socket, sys, threading
    mcp_port, unix_path = int(sys.argv[1]), sys.argv[2]
    plain = socket.create_server(("127.0.0.1", 0))
    if os.path.exists(unix_path):
        os.unlink(unix_path)
    unix = socket.socket(socket.AF_UNIX); unix.bind(unix_path); unix.listen(16)
    relay = socket.create_server(("127.0.0.1", 0))
    def accept_forever(server):
        while True:
            server.accept()[0].close()
    def pump(a, b):
        try:
            while (data := a.recv(65536)):
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                try: s.shutdown(socket.SHUT_RDWR)
                except OSError: pass
    def relay_forever():
        while True:
            client = relay.accept()[0]
            upstream = socket.create_connection(("127.0.0.1", mcp_port))
            threading.Thread(target=pump, args=(client, upstream), daemon=True).start()
            threading.Thread(target=pump, args=(upstream, client), daemon=True).start()
    for target, arg in ((accept_forever, plain), (accept_forever, unix), (relay_forever, None)):
        threading.Thread(target=target, args=(arg,) if arg is not None else (), daemon=True).start()
    print(json.dumps({"plain": plain.getsockname()[1], "relay": relay.getsockname()[1]}), flush=True)
    sys.stdin.read()
''')

WARM_FILTERS = ("from sandboxd.kernel import seccomp\n"
                "seccomp.program_for(seccomp.FilterSpec(confined=True))\n")


class Door(NamedTuple):
    daemon: Daemon
    user: PlainUser            # runs the MCP server, its helper, and the sandboxes
    base: Path                 # 0755, root's
    code: Path                 # a copy of the sandboxd package every user can read (rootless runs)
    workspace: Path            # the user's
    sockets: Path              # the user's (0700): the MCP server's Unix socket and the plain one
    mcp_port: int
    token_file: str            # where the TCP server said its token is
    mcp_unix: str
    unix_token_file: str
    plain_port: int            # the helper's
    plain_unix: str
    relay_port: int


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _as(user: PlainUser) -> dict[str, Any]:
    return {"user": user.uid, "group": user.gid, "extra_groups": [], "cwd": "/"}


def _start_mcp(daemon: Daemon, user: PlainUser, workspace: Path, listen: str, log: Path) -> tuple[
        subprocess.Popen[bytes], str]:
    """`sandboxd mcp --http LISTEN --approval always` as ``user``; the server and its token file,
    once it says it serves."""
    with open(log, "wb") as out:
        server = subprocess.Popen(["setpriv", f"--reuid={user.uid}", f"--regid={user.gid}", "--clear-groups",
                                   SANDBOXD, "mcp", "--socket", daemon.socket, "--workspace", str(workspace),
                                   "--approval", "always", "--http", listen], env=ENV, cwd="/",
                                  stdin=subprocess.DEVNULL, stdout=out, stderr=out)
    deadline = time.monotonic() + 120 * SLOW
    while "serving" not in log.read_text():
        assert server.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)
    line = next(line for line in log.read_text().splitlines() if "serving" in line)
    return server, line.split("the token in ", 1)[1].strip()


@pytest.fixture(scope="module")
def door(daemon: Daemon) -> Iterator[Door]:  # noqa: F811
    subprocess.run([sys.executable, "-c", WARM_FILTERS], check=True, timeout=120, cwd=REPO)
    with plain_users(1) as (user,):
        base = Path(tempfile.mkdtemp(prefix="sbxmcpdoor-", dir="/var/tmp"))
        processes: list[subprocess.Popen[Any]] = []
        try:
            os.chmod(base, 0o755)
            code = readable_copy_of_sandboxd(base)
            workspace = make_dir(base / "ws", 0o700)
            sockets = make_dir(base / "sockets", 0o700)
            for path in (workspace, sockets):
                os.chown(path, user.uid, user.gid)
            mcp_port = _free_port()
            server, token_file = _start_mcp(daemon, user, workspace, f"127.0.0.1:{mcp_port}", base / "mcp-tcp.log")
            processes.append(server)
            mcp_unix = str(sockets / "mcp.sock")
            unix_server, unix_token_file = _start_mcp(daemon, user, workspace, f"unix:{mcp_unix}",
                                                      base / "mcp-unix.log")
            processes.append(unix_server)
            plain_unix = str(sockets / "plain.sock")
            helper = subprocess.Popen([PY, "-c", HELPER, str(mcp_port), plain_unix], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True, env=BASE_ENV, **_as(user))
            processes.append(helper)
            assert helper.stdout is not None
            ports = json.loads(helper.stdout.readline())
            yield Door(daemon, user, base, code, workspace, sockets, mcp_port, token_file, mcp_unix, unix_token_file,
                       ports["plain"], plain_unix, ports["relay"])
        finally:
            for process in processes:
                process.terminate()
            for process in processes:
                process.wait(timeout=60)
            shutil.rmtree(base, ignore_errors=True)


def probe_on_host(d: Door, plan: dict[str, Any]) -> dict[str, Any]:
    """The control: the plan run by the same user, outside any sandbox."""
    done = subprocess.run([PY, "-c", PROBE, json.dumps(plan)], capture_output=True, text=True,
                          timeout=120 * SLOW, env=BASE_ENV, **_as(d.user))
    assert done.returncode == 0, describe(done)
    return dict(json.loads(done.stdout))


def probe_in_run(d: Door, plan: dict[str, Any], *options: str, knows_daemon: bool = True) -> dict[str, Any]:
    """The plan in a rootless `sandboxd run OPTIONS` of the user; ``knows_daemon``: with
    $SANDBOXD_SOCKET naming the test daemon (as the user's clients would have it), so the run
    hides that daemon's place and reads its registry of approval channels."""
    env = {**BASE_ENV, "HOME": str(d.workspace), "PYTHONPATH": str(d.code)}
    if knows_daemon:
        env["SANDBOXD_SOCKET"] = d.daemon.socket
    done = subprocess.run([PY, "-m", "sandboxd.cli.main", "run", "--workspace", str(d.workspace), *options, "--",
                           PY, "-c", PROBE, json.dumps(plan)], capture_output=True, text=True,
                          timeout=120 * SLOW, stdin=subprocess.DEVNULL, env=env,
                          **{**_as(d.user), "cwd": str(d.workspace)})
    assert done.returncode == 0, describe(done)
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


SESSION_PROBE = textwrap.dedent('''
    session = stub.CreateSession(pb.CreateSessionRequest(workspace=ARGS["workspace"], approval_policy=pb.NEVER,
        sandbox_policy=pb.SandboxPolicy(mode=pb.SandboxPolicy.WORKSPACE_WRITE, **ARGS["policy"])))
    out = b""
    try:
        for reply in stub.Run(pb.ExecStart(session_id=session.id, argv=["/usr/bin/python3", "-c", ARGS["probe"], ARGS["plan"]])):
            if reply.WhichOneof("kind") in ("stdout", "stderr"):
                out += getattr(reply, reply.WhichOneof("kind"))
    finally:
        stub.CloseSession(pb.CloseSessionRequest(session_id=session.id))
    print(json.dumps({"out": out.decode()}))
''')


def probe_in_session(d: Door, plan: dict[str, Any], socket_path: str = "", **policy: Any) -> dict[str, Any]:
    """The plan in a session the user creates (its policy: WORKSPACE_WRITE with ``policy``) on the
    test daemon, or on the daemon of ``socket_path``."""
    answer = run_client_as(d.user.uid, d.user.gid, socket_path or d.daemon.socket, SESSION_PROBE, {
        "workspace": str(d.workspace), "policy": policy, "probe": PROBE, "plan": json.dumps(plan)})
    return dict(json.loads(answer["out"].strip().splitlines()[-1]))


def wall_one_plan(d: Door) -> dict[str, Any]:
    return {"tcp": {"mcp": ["127.0.0.1", d.mcp_port], "mcp 0.0.0.0": ["0.0.0.0", d.mcp_port],
                    "mcp mapped": ["::ffff:127.0.0.1", d.mcp_port], "plain": ["127.0.0.1", d.plain_port]},
            "unix": {"unix mcp": d.mcp_unix, "unix plain": d.plain_unix},
            "read": {"token": d.token_file, "unix token": d.unix_token_file}}


def test_the_server_registered_its_sockets_and_hid_its_token(door: Door) -> None:
    """The controls of everything below: from the host, as the same user, both servers answer
    with the token (and the plain listeners, the relay), and the token files are readable."""
    d = door
    seen = probe_on_host(d, {**wall_one_plan(d), "post": {
        "tcp": ["127.0.0.1", d.mcp_port, d.token_file], "tcp no token": ["127.0.0.1", d.mcp_port, ""],
        "relay": ["127.0.0.1", d.relay_port, d.token_file]}})
    assert {seen[name] for name in ("mcp", "mcp 0.0.0.0", "mcp mapped", "plain", "unix mcp", "unix plain")} == {
        "connected"}, seen
    assert seen["token"] == "read 65" and seen["unix token"] == "read 65", seen
    assert (seen["tcp"], seen["tcp no token"], seen["relay"]) == (200, 401, 200), seen
    # Where the tokens are: the user's own directory in the daemon's place, 0700 and 0600.
    secrets = Path(d.token_file).parent
    assert secrets.parent == Path(defaults.channels_dir(d.daemon.socket)) == Path(d.unix_token_file).parent.parent
    assert (secrets.stat().st_uid, secrets.stat().st_mode & 0o777) == (d.user.uid, 0o700)
    assert (Path(d.token_file).stat().st_mode & 0o777) == 0o600
    registry = os.listdir(secrets.parent / "listeners")
    assert any(name.startswith(f"tcp-7f000001-{d.mcp_port}-") and name.split("-")[-1].startswith(f"{d.user.uid}.")
               for name in registry), registry
    assert any(name.startswith("unix-") for name in registry), registry


def test_wall_one_a_rootless_host_network_run_cannot_connect(door: Door) -> None:
    """Rootless `sandboxd run --network=host` as the user: the broker refuses the server's port in
    every spelling and its Unix socket (named by --allow-unix-socket); the user's other listener
    and socket beside them (named too) are reached (the control); the tokens are nowhere to be seen."""
    seen = probe_in_run(door, wall_one_plan(door), "--network=host", "--allow-unix-socket", door.mcp_unix,
                        "--allow-unix-socket", door.plain_unix)
    assert seen["mcp"] == "EACCES" and seen["mcp 0.0.0.0"] == "EACCES" and seen["mcp mapped"] == "EACCES", seen
    assert seen["plain"] == "connected", seen
    assert (seen["unix mcp"], seen["unix plain"]) == ("EACCES", "connected"), seen
    assert seen["token"] == "ENOENT" and seen["unix token"] == "ENOENT", seen


def test_wall_one_a_host_network_daemon_session_cannot_connect(door: Door) -> None:
    """A `--network=host` session the user opens on the daemon: the same, from the session's calls."""
    seen = probe_in_session(door, wall_one_plan(door), network_access=True, network_mode="host",
                            allowed_unix_sockets=[door.mcp_unix, door.plain_unix])
    assert seen["mcp"] == "EACCES" and seen["mcp 0.0.0.0"] == "EACCES" and seen["mcp mapped"] == "EACCES", seen
    assert seen["plain"] == "connected", seen
    assert (seen["unix mcp"], seen["unix plain"]) == ("EACCES", "connected"), seen
    assert seen["token"] == "ENOENT" and seen["unix token"] == "ENOENT", seen


def test_wall_one_holds_whatever_the_network_and_the_allowed_sockets(door: Door) -> None:
    """Without network, a sandbox reaches only the host sockets its policy names: naming the
    server's socket does not help (control: the plain socket, named the same way, is reached)."""
    plan = {"unix": {"mcp": door.mcp_unix, "plain": door.plain_unix}}
    in_session = probe_in_session(door, plan, allowed_unix_sockets=[door.mcp_unix, door.plain_unix])
    assert in_session == {"mcp": "EACCES", "plain": "connected"}, in_session
    in_run = probe_in_run(door, plan, "--allow-unix-socket", door.mcp_unix, "--allow-unix-socket", door.plain_unix)
    assert in_run == {"mcp": "EACCES", "plain": "connected"}, in_run


def test_wall_two_the_server_refuses_a_sandboxed_process(door: Door,
                                                         sandboxd_daemon: DaemonFactory) -> None:
    """Sandboxes whose broker does not know this server's registry (a rootless run that knows no
    daemon; a host-network session of a second daemon) connect, even with the token in hand (the
    user's files are not hidden from them): the server answers 403 before reading anything.
    Control: the same request from the host succeeds."""
    d = door
    plan = {"post": {"with token": ["127.0.0.1", d.mcp_port, d.token_file]}}
    assert probe_on_host(d, plan) == {"with token": 200}
    seen = probe_in_run(d, plan, "--network=host", knows_daemon=False)
    assert seen == {"with token": 403}, seen
    # A sandboxed process that made itself non-dumpable, so that its user cannot list its
    # descriptors: no examinable holder of the connection, refused all the same.
    seen = probe_in_run(d, {**plan, "undumpable": True}, "--network=host", knows_daemon=False)
    assert seen == {"with token": 403}, seen
    other = sandboxd_daemon()
    seen = probe_in_session(d, plan, other.socket, network_access=True, network_mode="host")
    assert seen == {"with token": 403}, seen


def test_wall_three_the_token_stops_what_walls_one_and_two_cannot_see(door: Door) -> None:
    """A relay of the user's on the host (a proxy, a port forward) is not a sandbox and not the
    server's port: a sandbox reaches the server through it. Without the token (hidden from it) it
    gets 401; the control, through the same relay, sends the token and gets 200."""
    d = door
    seen = probe_in_run(d, {"post": {"relay": ["127.0.0.1", d.relay_port, ""],
                                     "relay with token": ["127.0.0.1", d.relay_port, d.token_file]}},
                        "--network=host")
    assert seen == {"relay": 401, "relay with token": "token ENOENT"}, seen
    seen = probe_in_session(d, {"post": {"relay": ["127.0.0.1", d.relay_port, ""]}}, network_access=True,
                            network_mode="host")
    assert seen == {"relay": 401}, seen
    assert probe_on_host(d, {"post": {"relay": ["127.0.0.1", d.relay_port, d.token_file]}}) == {"relay": 200}


REGISTER = textwrap.dedent('''
    import socket
    def register():
        try:
            return {"listeners": list(stub.RegisterApprovalChannel(pb.RegisterApprovalChannelRequest()).listeners)}
        except grpc.RpcError as e:
            return {"code": e.code().name, "details": e.details()}
    seen = {"nothing": register()}                   # holds no listening socket (the MCP port is not its own)
    wide = socket.create_server(("0.0.0.0", 0))
    seen["wide"] = register()
    wide.close()
    mine = [socket.create_server(("127.0.0.1", 0)) for _ in range(16)]
    seen["mine"] = register()
    mine.append(socket.create_server(("127.0.0.1", 0)))
    seen["one more"] = register()
    try:
        open(ARGS["token"]).read()
        seen["token"] = "read"
    except OSError as e:
        seen["token"] = type(e).__name__
    print(json.dumps(seen))
''')


def test_a_user_registers_only_its_own_listening_sockets(door: Door, daemon: Daemon) -> None:  # noqa: F811
    """Another local user can neither read the server's token nor take its port: registration
    names nothing, the daemon finds the sockets the calling process itself holds, so a process
    without one (the server's port is someone else's) gets INVALID_ARGUMENT, as does one listening
    beyond loopback; 16 of its own are registered (the control), the 17th is RESOURCE_EXHAUSTED.
    All of them go when that process exits."""
    with plain_users(1) as (other,):
        seen = run_client_as(other.uid, other.gid, daemon.socket, REGISTER, {"token": door.token_file})
        registry = Path(defaults.channel_registry(daemon.socket))
        deadline = time.monotonic() + 60 * SLOW
        while (left := [name for name in os.listdir(registry) if name.split("-")[-1].startswith(f"{other.uid}.")]):
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
    assert seen["nothing"]["code"] == "INVALID_ARGUMENT" and "holds no listening socket" in seen["nothing"]["details"]
    assert seen["wide"]["code"] == "INVALID_ARGUMENT" and "not a loopback address" in seen["wide"]["details"], seen
    assert len(seen["mine"]["listeners"]) == 16 and seen["mine"]["listeners"][0].startswith("tcp 127.0.0.1:"), seen
    assert seen["one more"]["code"] == "RESOURCE_EXHAUSTED", seen
    assert seen["token"] == "PermissionError", seen
    assert left == [], left                          # its process exited: its registrations went with it
