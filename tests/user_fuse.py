"""A plain user's own FUSE file system, mounted with fusermount3 (what any user can do where
/dev/fuse is 0666, as udev sets it up on Debian and Ubuntu), served by a small server of that user.

Two kinds:

* ``stuck``: the server answers the mount's INIT, then reads every request and answers none. A
  process of the user that looks a path up there waits forever, and once it is SIGKILLed it waits
  uninterruptibly (D state: the kernel waits for the answer to a request its server has read, or
  for the connection to go). What the issue's attacker leaves in its sandbox groups.
* ``answering``: an empty, read-only directory that answers everything (lookups: ENOENT). Without
  ``allow_other`` only the mounting user may look at it: root gets EACCES, as from a user's sshfs.

``release`` ends the server: its device closes, the kernel aborts the connection, every waiting
request fails, and the mount is detached.
"""

from __future__ import annotations

import json
import os
import select
import stat
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import PY

# Run as the mounting user. argv: kind (stuck, answering), mount point. Prints {"mounted": path},
# then, stuck, one {"swallowed": opcode} line per request it read and will never answer.
SERVER = r'''
import array, json, os, socket, struct, subprocess, sys, time
kind, mountpoint = sys.argv[1], sys.argv[2]
ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
subprocess.run(["fusermount3", "-o", f"fsname={kind},subtype={kind}", "--", mountpoint], check=True,
               env={"_FUSE_COMMFD": str(theirs.fileno()), "PATH": "/usr/bin:/bin"}, pass_fds=(theirs.fileno(),))
fds = array.array("i")
_, ancillary, _, _ = ours.recvmsg(1, socket.CMSG_SPACE(fds.itemsize))
fds.frombytes(ancillary[0][2][:fds.itemsize])
device = fds[0]
print(json.dumps({"mounted": mountpoint}), flush=True)
INIT, GETATTR, LOOKUP, FORGET, STATFS, RELEASE, FLUSH = 26, 3, 1, 2, 17, 18, 25
OPENDIR, READDIR, RELEASEDIR, ACCESS, INTERRUPT, DESTROY, BATCH_FORGET = 27, 28, 29, 34, 36, 38, 42
NO_REPLY = (FORGET, INTERRUPT, BATCH_FORGET)
now = int(time.time())
uid, gid = os.getuid(), os.getgid()
root_attr = struct.pack("<QQQQQQIIIIIIIIII", 1, 0, 0, now, now, now, 0, 0, 0, 0o40755, 2, uid, gid, 0, 4096, 0)
def reply(unique, error=0, body=b""):
    os.write(device, struct.pack("<IiQ", 16 + len(body), -error, unique) + body)
while True:
    try:
        request = os.read(device, 1 << 20)
    except OSError:
        break                                         # unmounted: the connection is gone
    _, opcode, unique = struct.unpack_from("<IIQ", request)
    if opcode == INIT:
        # FUSE_PARALLEL_DIROPS: lookups in one directory each reach the server (else they queue on a lock)
        reply(unique, body=struct.pack("<IIIIHHIIHHI7I", 7, 31, 0, 1 << 18, 16, 12, 4096, 1, 0, 0, 0, *[0] * 7))
    elif kind == "stuck":
        print(json.dumps({"swallowed": opcode}), flush=True)
    elif opcode in NO_REPLY:
        pass
    elif opcode == GETATTR:
        reply(unique, body=struct.pack("<QII", 1, 0, 0) + root_attr)
    elif opcode == LOOKUP:
        reply(unique, 2)                              # ENOENT: the directory is empty
    elif opcode == OPENDIR:
        reply(unique, body=struct.pack("<QII", 1, 0, 0))
    elif opcode == STATFS:
        reply(unique, body=struct.pack("<QQQQQIIII6I", 0, 0, 0, 0, 0, 4096, 255, 4096, 0, *[0] * 6))
    elif opcode in (READDIR, RELEASEDIR, RELEASE, FLUSH, ACCESS, DESTROY):
        reply(unique)                                 # READDIR: no entries
    else:
        reply(unique, 38)                             # ENOSYS
'''


class UserFuse:
    """A FUSE mount of ``uid``/``gid`` at ``mountpoint`` (made here, owned by them), served until ``release``."""

    def __init__(self, kind: str, uid: int, gid: int, mountpoint: Path) -> None:
        mountpoint.mkdir(mode=0o755)
        os.chown(mountpoint, uid, gid)
        self.kind, self.mountpoint = kind, mountpoint
        self.server = subprocess.Popen([PY, "-c", SERVER, kind, str(mountpoint)], user=uid, group=gid, extra_groups=[],
                                       stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, cwd="/")
        self._pending = b""
        line = self.next_line()
        assert "mounted" in line, f"the {kind} FUSE mount failed (exit {self.server.wait()})"

    def next_line(self, within: float = 60.0) -> dict[str, object]:
        """The server's next line ({} if it says nothing within ``within`` seconds, or has exited)."""
        assert self.server.stdout is not None
        deadline = time.monotonic() + within
        waiter = select.poll()
        waiter.register(self.server.stdout.fileno(), select.POLLIN)
        while b"\n" not in self._pending:                 # read by hand: a buffered readline hides lines from poll
            if not waiter.poll(max(0, int((deadline - time.monotonic()) * 1000))):
                return {}
            data = os.read(self.server.stdout.fileno(), 65536)
            if not data:
                return {}
            self._pending += data
        line, self._pending = self._pending.split(b"\n", 1)
        return json.loads(line)

    def swallowed(self) -> int | None:
        """The opcode of the next request the stuck server read (and will never answer)."""
        found = self.next_line().get("swallowed")
        return found if isinstance(found, int) else None

    def release(self) -> None:
        if self.server.poll() is None:
            self.server.kill()
        self.server.wait(60)
        subprocess.run(["umount", "-l", str(self.mountpoint)], check=False, timeout=60, stderr=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def fuse_for_users() -> Iterator[None]:
    """/dev/fuse usable by every user, as udev sets it up on Debian and Ubuntu (0666): what a plain
    user needs to mount FUSE. Containers often leave it 0600; its mode is restored afterwards."""
    if not os.path.exists("/dev/fuse"):
        pytest.skip("no /dev/fuse: this kernel has no FUSE")
    mode = stat.S_IMODE(os.stat("/dev/fuse").st_mode)
    os.chmod("/dev/fuse", mode | 0o666)
    try:
        yield
    finally:
        os.chmod("/dev/fuse", mode)
