"""An approval channel's registration refuses its own sockets, not the addresses they had (issue 24,
round 4, second hostile pass, finding 3).

The hole: entries of the registry (RegisterApprovalChannel) were matched by address and port and
lasted as long as the registering process. A user who registered two loopback ports, closed the
listeners and slept blocked those ports for every host-network sandbox on the machine: another
user's own servers there were refused EACCES from its sandboxes (and reachable from the host).
Now an entry names its socket: the broker refuses a connect only while the listener the kernel
finds at that address and port, or the socket bound to that file, is the registered one.

Two plain users the test makes: the attacker registers two TCP ports and a Unix socket (on a
small ext4, where a freed inode number is the next one handed out), closes them and waits,
holding a third TCP listener and a second Unix one open and registered (the live channel, still
refused). The victim then runs servers on the two ports, a third never registered (the control),
and a Unix one in the same directory, which gets the attacker's freed inode number (the entry's
file identity); it connects to all of them from a host-network session of the daemon and from a
rootless `sandboxd run --network=host` that reads the daemon's registry, and from the host.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from conftest import BASE_ENV, PY, SLOW, make_dir, readable_copy_of_sandboxd
from daemon_fixtures import daemon  # noqa: F401 - a pytest fixture
from daemon_helpers import _CLIENT_PRELUDE, PYTHON, Daemon, PlainUser, plain_users
from loop_filesystems import loop_mounted
from socket_probes import in_rootless_run, in_session, on_host

pytestmark = pytest.mark.timeout(int(600 * SLOW))

# The attacker: registers what it listens on, closes some of it, and lives on (its entries with it).
ATTACKER = textwrap.dedent('''
    import socket
    closed = [socket.create_server(("127.0.0.1", port)) for port in ARGS["ports"]]
    live = socket.create_server(("127.0.0.1", 0))
    os.umask(0)                                     # the Unix sockets: anyone may connect (0777)
    unix = {}
    for name in ("closed", "live"):
        unix[name] = socket.socket(socket.AF_UNIX)
        unix[name].bind(ARGS[name])
        unix[name].listen(4)
    listeners = list(stub.RegisterApprovalChannel(pb.RegisterApprovalChannelRequest()).listeners)
    freed = os.stat(ARGS["closed"]).st_ino
    for sock in closed:
        sock.close()
    unix["closed"].close()
    os.unlink(ARGS["closed"])
    print(json.dumps({"listeners": listeners, "live": live.getsockname()[1], "freed": freed}), flush=True)
    sys.stdin.read()
''')

# The victim's servers on the host: TCP ports and a Unix socket that takes the freed inode number.
# Asked (a line on stdin), each accepts what is queued and says how many: a connect() that returned
# is queued, so nothing is counted late.
VICTIM = textwrap.dedent('''
    import json, os, socket, sys
    ports, directory, freed = json.loads(sys.argv[1])
    servers = [socket.create_server(("127.0.0.1", port)) for port in ports]
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(os.path.join(directory, "victim.sock"))
    unix.listen(16)
    servers.append(unix)
    for server in servers:
        server.setblocking(False)
    print(json.dumps({"inode": os.stat(os.path.join(directory, "victim.sock")).st_ino}), flush=True)
    for _ in sys.stdin:
        counts = [0] * len(servers)
        for i, server in enumerate(servers):
            try:
                while True:
                    server.accept()[0].close()
                    counts[i] += 1
            except BlockingIOError:
                pass
        print(json.dumps(counts), flush=True)
''')


class Scene(NamedTuple):
    daemon: Daemon
    victim: PlainUser
    code: Path
    workspace: Path
    ports: list[int]             # the attacker's closed ones, then the control
    live_port: int               # the attacker's live channel
    closed_unix: str             # where the attacker's closed channel was: the victim's socket now
    live_unix: str
    registry: list[str]          # the attacker's entries, after it closed its sockets
    freed: int                   # the inode number the attacker's closed Unix channel had
    victim_inode: int
    servers: "subprocess.Popen[str]"

    def reached(self) -> list[int]:
        """Connections each victim server accepted since the last look (ports, then the Unix one)."""
        assert self.servers.stdin is not None and self.servers.stdout is not None
        self.servers.stdin.write("count\n")
        self.servers.stdin.flush()
        counts: list[int] = json.loads(self.servers.stdout.readline())
        return counts


def _free_ports(count: int) -> list[int]:
    probes = [socket.create_server(("127.0.0.1", 0)) for _ in range(count)]
    ports = [int(probe.getsockname()[1]) for probe in probes]
    for probe in probes:
        probe.close()
    return ports


def _as(user: PlainUser) -> dict[str, Any]:
    return {"user": user.uid, "group": user.gid, "extra_groups": [], "cwd": "/"}


@pytest.fixture(scope="module")
def scene(daemon: Daemon) -> Iterator[Scene]:  # noqa: F811
    processes: list[subprocess.Popen[str]] = []
    with plain_users(2) as (attacker, victim), \
            tempfile.TemporaryDirectory(prefix="sbxchannels-", dir="/var/tmp") as made:
        base = Path(made)
        try:
            os.chmod(base, 0o755)
            code = readable_copy_of_sandboxd(base)
            workspace = make_dir(base / "ws", 0o700)
            os.chown(workspace, victim.uid, victim.gid)
            with loop_mounted("ext4", base / "ext4") as shared:
                sockets = make_dir(shared / "sockets", 0o1777)
                ports = _free_ports(3)
                payload = json.dumps({"uid": attacker.uid, "gid": attacker.gid, "socket": daemon.socket,
                                      "ports": ports[:2], "closed": str(sockets / "channel.sock"),
                                      "live": str(sockets / "live.sock")})
                processes.append(subprocess.Popen([PYTHON, "-c", _CLIENT_PRELUDE + ATTACKER, payload], text=True,
                                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=BASE_ENV, cwd="/"))
                assert processes[0].stdout is not None
                registered = json.loads(processes[0].stdout.readline())
                assert {f"tcp 127.0.0.1:{port}" for port in ports[:2]} <= set(registered["listeners"]), registered
                entries = [name for name in os.listdir(Path(daemon.socket).parent / ".sandboxd-mcp" / "listeners")
                           if name.split("-")[-1].startswith(f"{attacker.uid}.")]
                processes.append(subprocess.Popen([PY, "-c", VICTIM, json.dumps([ports, str(sockets),
                                                                                 registered["freed"]])],
                                                  text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                                  env=BASE_ENV, **_as(victim)))
                assert processes[1].stdout is not None
                victim_inode = json.loads(processes[1].stdout.readline())["inode"]
                yield Scene(daemon, victim, code, workspace, ports, registered["live"], str(sockets / "victim.sock"),
                            str(sockets / "live.sock"), entries, registered["freed"], victim_inode, processes[1])
                for process in processes:
                    process.kill()
                    process.wait(timeout=60)
        finally:
            for process in processes:
                if process.poll() is None:
                    process.kill()
                    process.wait(timeout=60)
            shutil.rmtree(base / "code", ignore_errors=True)


def plan(s: Scene) -> dict[str, Any]:
    return {"tcp": {"registered then closed": ["127.0.0.1", s.ports[0]],
                    "registered then closed 2": ["127.0.0.1", s.ports[1]],
                    "never registered": ["127.0.0.1", s.ports[2]],
                    "attacker's live channel": ["127.0.0.1", s.live_port]},
            "unix": {"victim's, at the freed inode": s.closed_unix, "attacker's live channel unix": s.live_unix}}


# From the host: everything. From a host-network sandbox: everything but the live channels.
EVERYTHING = {"registered then closed": "connected", "registered then closed 2": "connected",
              "never registered": "connected", "attacker's live channel": "connected",
              "victim's, at the freed inode": "connected", "attacker's live channel unix": "connected"}
INSIDE = {**EVERYTHING, "attacker's live channel": "EACCES", "attacker's live channel unix": "EACCES"}


def test_the_scene_is_the_finding(scene: Scene) -> None:
    """The set-up reproduces the finding: the attacker's entries for its closed sockets are still
    in the registry, and the victim's Unix socket has the inode number of one of them (on one
    device: the entry's file identity)."""
    s = scene
    assert any(name.startswith(f"tcp-7f000001-{s.ports[0]}-") for name in s.registry), s.registry
    assert any(name.startswith(f"tcp-7f000001-{s.ports[1]}-") for name in s.registry), s.registry
    assert any(name.startswith("unix-") and name.split("-")[3] == str(s.freed) for name in s.registry), s.registry
    assert s.victim_inode == s.freed
    assert on_host(s.victim, plan(s)) == EVERYTHING                    # the control: nothing is wrong on the host
    assert s.reached() == [1, 1, 1, 1]


def test_a_host_network_session_reaches_the_ports_and_files_a_closed_channel_had(scene: Scene) -> None:
    """The victim's `network_mode="host"` session (its policy names both Unix sockets): its servers
    on the ports and at the inode number the attacker registered then closed are reached, as the
    never-registered port is (the control); the attacker's live channel is still refused."""
    s = scene
    s.reached()
    seen = in_session(s.daemon.socket, s.victim, s.workspace, plan(s), network_access=True, network_mode="host",
                      allowed_unix_sockets=[s.closed_unix, s.live_unix])
    assert seen == INSIDE, seen
    assert s.reached() == [1, 1, 1, 1]


def test_a_rootless_host_network_run_reaches_them_too(scene: Scene) -> None:
    """The same from the victim's rootless `sandboxd run --network=host`, which reads the daemon's
    registry ($SANDBOXD_SOCKET)."""
    s = scene
    s.reached()
    seen = in_rootless_run(s.victim, s.code, s.workspace, plan(s), "--network=host", "--allow-unix-socket",
                           s.closed_unix, "--allow-unix-socket", s.live_unix, socket_path=s.daemon.socket)
    assert seen == INSIDE, seen
    assert s.reached() == [1, 1, 1, 1]


def test_without_network_the_closed_channels_file_is_the_victims(scene: Scene) -> None:
    """Without network (Unix sockets only: the registry is asked in the daemon's network namespace)."""
    s = scene
    s.reached()
    unix_only = {"unix": plan(s)["unix"]}
    seen = in_session(s.daemon.socket, s.victim, s.workspace, unix_only,
                      allowed_unix_sockets=[s.closed_unix, s.live_unix])
    assert seen == {"victim's, at the freed inode": "connected", "attacker's live channel unix": "EACCES"}, seen
    assert s.reached() == [0, 0, 0, 1]
