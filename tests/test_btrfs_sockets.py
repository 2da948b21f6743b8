"""Socket files on btrfs, named as sock_diag names them (issue 24, round 4, second hostile pass,
finding 4).

The hole: sock_diag's UNIX_DIAG_VFS names the file a socket is bound to by its superblock's device;
stat() on btrfs reports the subvolume's own anonymous device. The registry of approval channels
is written from sock_diag, the connect broker compared it with fstat(): on btrfs, wall 1 missed
`sandboxd mcp --http unix:PATH` (a sandbox whose policy named the socket connected, and only the
server's own walls answered), and the check that a socket file is the sandbox's own (sock_diag
again) refused a command's own socket in a btrfs workspace (EACCES without network,
ECONNREFUSED with the host's). Now the broker names a file by its mount's superblock device
(kernel.superblocks: statx's mount id, /proc/self/mountinfo's MAJOR:MINOR), as sock_diag does.

A small btrfs image and an ext4 one (the control: there both name a file alike) are loop-mounted
for the module; a plain user the test makes runs `sandboxd mcp --http unix:` on each, a plain
listener beside the btrfs one (named by the policy: reached) and another not named (refused), and
works in a workspace on each.
"""

from __future__ import annotations

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
from daemon_helpers import Daemon, PlainUser, plain_users
from loop_filesystems import loop_mounted
from mcp_helpers import http_server
from sandboxd.kernel import superblocks, unix_diag
from socket_probes import in_rootless_run, in_session, on_host

pytestmark = pytest.mark.timeout(int(600 * SLOW))

# The user's plain listeners on the host, until stdin closes.
LISTENERS = textwrap.dedent('''
    import socket, sys
    held = []
    for path in sys.argv[1:]:
        s = socket.socket(socket.AF_UNIX)
        s.bind(path)
        s.listen(16)
        held.append(s)
    print("ready", flush=True)
    sys.stdin.read()
''')


class Disks(NamedTuple):
    daemon: Daemon
    user: PlainUser
    code: Path
    mounts: dict[str, Path]            # "btrfs", "ext4" -> the mount point
    mcp: dict[str, str]                # the MCP server's Unix socket on each
    named: str                         # a plain listener on btrfs the policies name
    unnamed: str                       # and one they do not

    def workspace(self, kind: str) -> Path:
        return self.mounts[kind] / "ws"


def _as(user: PlainUser) -> dict[str, Any]:
    return {"user": user.uid, "group": user.gid, "extra_groups": [], "cwd": "/"}


@pytest.fixture(scope="module")
def disks(daemon: Daemon) -> Iterator[Disks]:  # noqa: F811
    with plain_users(1) as (user,), tempfile.TemporaryDirectory(prefix="sbxbtrfs-", dir="/var/tmp") as made:
        base = Path(made)
        os.chmod(base, 0o755)
        code = readable_copy_of_sandboxd(base)
        with loop_mounted("btrfs", base / "btrfs") as btrfs, loop_mounted("ext4", base / "ext4") as ext4:
            mounts = {"btrfs": btrfs, "ext4": ext4}
            for where in mounts.values():
                for name in ("ws", "sockets"):
                    os.chown(make_dir(where / name, 0o700), user.uid, user.gid)
            mcp = {kind: str(where / "sockets" / "mcp.sock") for kind, where in mounts.items()}
            named, unnamed = str(btrfs / "sockets" / "plain.sock"), str(btrfs / "sockets" / "other.sock")
            plain = subprocess.Popen([PY, "-c", LISTENERS, named, unnamed], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=BASE_ENV, **_as(user))
            try:
                assert plain.stdout is not None and plain.stdout.readline() == "ready\n"
                with http_server(daemon.socket, btrfs / "ws", f"unix:{mcp['btrfs']}", log=base / "btrfs.log",
                                 as_user=(user.uid, user.gid)), \
                        http_server(daemon.socket, ext4 / "ws", f"unix:{mcp['ext4']}", log=base / "ext4.log",
                                    as_user=(user.uid, user.gid)):
                    yield Disks(daemon, user, code, mounts, mcp, named, unnamed)
            finally:
                plain.kill()
                plain.wait(timeout=60)
        shutil.rmtree(base / "code", ignore_errors=True)


def test_sock_diag_and_stat_name_a_btrfs_file_apart(disks: Disks) -> None:
    """The premise, and what the broker does about it: a socket bound on btrfs is bound to a file
    whose stat() device is not the one sock_diag names; superblocks.identity names it as sock_diag
    does. On ext4 (the control) all three agree."""
    seen = {}
    for kind, where in disks.mounts.items():
        path = str(where / "premise.sock")
        with socket.socket(socket.AF_UNIX) as bound:
            bound.bind(path)
            fd = os.open(path, os.O_PATH)
            try:
                st = os.fstat(fd)
                seen[kind] = (unix_diag.file_identity(st), unix_diag.socket_file(os.fstat(bound.fileno()).st_ino),
                              superblocks.identity(fd, st))
            finally:
                os.close(fd)
                os.unlink(path)
    stat_says, diag_says, broker_says = seen["btrfs"]
    assert diag_says is not None and stat_says != diag_says and stat_says[2] == diag_says[2], seen          # same inode, another device
    assert broker_says == diag_says, seen
    assert seen["ext4"][0] == seen["ext4"][1] == seen["ext4"][2], seen


def wall_one_plan(d: Disks) -> dict[str, Any]:
    return {"unix": {"mcp on btrfs": d.mcp["btrfs"], "mcp on ext4": d.mcp["ext4"],
                     "named on btrfs": d.named, "not named on btrfs": d.unnamed}}


INSIDE = {"mcp on btrfs": "EACCES", "mcp on ext4": "EACCES", "named on btrfs": "connected",
          "not named on btrfs": "EACCES"}


def test_the_control_the_user_reaches_every_socket_from_the_host(disks: Disks) -> None:
    seen = on_host(disks.user, wall_one_plan(disks))
    assert set(seen.values()) == {"connected"}, seen


@pytest.mark.parametrize("network", ["none", "host"])
def test_wall_one_refuses_an_mcp_server_on_btrfs(disks: Disks, network: str) -> None:
    """A session whose policy names both MCP servers' sockets and a plain one beside them: the
    servers are refused on btrfs as on ext4; the plain socket it names is reached (the control:
    only the registration refuses), the one it does not name is refused."""
    d = disks
    policy: dict[str, Any] = {"network_access": True, "network_mode": "host"} if network == "host" else {}
    seen = in_session(d.daemon.socket, d.user, d.workspace("ext4"), wall_one_plan(d),
                      allowed_unix_sockets=[d.mcp["btrfs"], d.mcp["ext4"], d.named], **policy)
    assert seen == INSIDE, seen


def test_wall_one_holds_in_a_rootless_host_network_run(disks: Disks) -> None:
    d = disks
    seen = in_rootless_run(d.user, d.code, d.workspace("ext4"), wall_one_plan(d), "--network=host",
                           *(option for path in (d.mcp["btrfs"], d.mcp["ext4"], d.named)
                             for option in ("--allow-unix-socket", path)), socket_path=d.daemon.socket)
    assert seen == INSIDE, seen


@pytest.mark.parametrize("network", ["none", "host"])
@pytest.mark.parametrize("kind", ["btrfs", "ext4"])
def test_a_commands_own_socket_in_a_btrfs_workspace(disks: Disks, kind: str, network: str) -> None:
    """A command binds a socket in its workspace and connects to it, by a relative and an absolute
    path: it is the sandbox's own, on btrfs as on ext4 (the control), without network and with the
    host's."""
    d = disks
    policy: dict[str, Any] = {"network_access": True, "network_mode": "host"} if network == "host" else {}
    plan = {"own": {"relative": "own.sock", "absolute": str(d.workspace(kind) / "own-absolute.sock")}}
    seen = in_session(d.daemon.socket, d.user, d.workspace(kind), plan, **policy)
    assert seen == {"relative": "connected", "absolute": "connected"}, seen
