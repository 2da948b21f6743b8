"""Where a new daemon attaches to a surviving supervisor: a root-only Unix socket, its peers checked.

The supervisor (fork_server with ``--survive``) listens on ``supervisor.sock`` in the daemon's
private directory (defaults.private_dir: 0700, root's), SOCK_SEQPACKET like the socket pair the
first daemon talks on. A connection is taken only from a peer whose SO_PEERCRED uid is 0 and whose
executable is the supervisor's own interpreter, so neither a local user (who cannot even reach the
directory) nor another root program that happens to find the socket drives the fork server; and
only while no daemon is attached: one daemon at a time, a second is answered an error and closed.

"The same interpreter" is the same file (/proc/PID/exe's device and inode) or, failing that, a
file of the same size and SHA-256: a daemon pod replaced by a new one (`podman kube play
--replace`, a DaemonSet rollout) runs its interpreter from the new container's root file system, a
different file (another overlay mount) with the same bytes when the image's Python did not
change. Why the digest admits no more than the inode did: what the check ever said is "a program
run by this interpreter build" (any Python script on the same file passed; the socket's real
gate is uid 0 and the 0700 directory, which only the node's root, or a pod given that hostPath,
can reach); equal bytes are the same build whichever file holds them. A different interpreter
(another Python, a shell, socat) is refused as before, and so is an upgrade that changed the
image's Python: its daemon starts a fresh supervisor, and the old one stops its sandboxes after
supervisor.orphan_seconds (docs/operations.md, "Replacing the daemon's pod"). The peer's file is
hashed only when its size is ours (a root peer cannot make us read a file of any size).
"""

from __future__ import annotations

import hashlib
import os
import socket
import struct

TYPE_CHECKING = False
if TYPE_CHECKING:
    import io

SOCKET_NAME = "supervisor.sock"
_PEERCRED = struct.Struct("3i")


def path_in(private_dir: str) -> str:
    """The attach socket of the daemon whose private directory is ``private_dir``."""
    return os.path.join(private_dir, SOCKET_NAME)


class AttachPoint:
    """The listening socket (non-blocking: the loop polls it, ``accept`` never waits)."""

    def __init__(self, path: str) -> None:
        self.path = path
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)
        try:
            # A socket file left by a supervisor that is gone (its daemon found nobody listening
            # on it before starting this one): replaced. Only in the 0700 directory of root.
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            old = os.umask(0o077)
            try:
                sock.bind(path)
            finally:
                os.umask(old)
            os.chmod(path, 0o600)
            sock.listen(4)
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self._inode = os.stat(path).st_ino

    def fileno(self) -> int:
        return self._sock.fileno()

    def accept(self) -> "tuple[socket.socket | None, str]":
        """A waiting connection and why it is refused ("" if it is not), or (None, "") if none waits."""
        try:
            conn, _ = self._sock.accept()
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            return None, ""
        conn.setblocking(True)
        return conn, refusal(conn)

    def close(self) -> None:
        """Stop listening; the socket file goes too while it is still this one's."""
        try:
            if os.stat(self.path).st_ino == self._inode:
                os.unlink(self.path)
        except OSError:
            pass
        self._sock.close()


def peer(conn: socket.socket) -> tuple[int, int]:
    """The (pid, uid) the kernel names for the other end of ``conn``."""
    pid, uid, _gid = _PEERCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    return pid, uid


def refusal(conn: socket.socket) -> str:
    """Why the peer of ``conn`` may not attach ("" if it may): it must be root and run our executable."""
    pid, uid = peer(conn)
    if uid != 0:
        return f"uid {uid} may not attach to the supervisor: only root's sandboxd may"
    try:
        if same_executable(f"/proc/{pid}/exe", "/proc/self/exe"):
            return ""
    except OSError:
        return f"the attaching process {pid} is gone or unreadable"
    return f"process {pid} does not run sandboxd's interpreter ({os.readlink('/proc/self/exe')}): refused"


_CHUNK = 1 << 20


def same_executable(theirs: str, ours: str) -> bool:
    """Whether the files ``theirs`` and ``ours`` are one file, or two of the same size and SHA-256
    (see the module's doc); OSError when either cannot be read."""
    with open(theirs, "rb") as their_file, open(ours, "rb") as our_file:
        their_stat, our_stat = os.fstat(their_file.fileno()), os.fstat(our_file.fileno())
        if (their_stat.st_dev, their_stat.st_ino) == (our_stat.st_dev, our_stat.st_ino):
            return True
        if their_stat.st_size != our_stat.st_size:
            return False
        return _digest(their_file, our_stat.st_size) == _digest(our_file, our_stat.st_size)


def _digest(file: "io.BufferedReader", size: int) -> bytes:
    """SHA-256 of the first ``size`` bytes of ``file`` (no more, whatever it holds by now)."""
    digest, left = hashlib.sha256(), size
    while left > 0:
        chunk = file.read(min(_CHUNK, left))
        if not chunk:
            break
        digest.update(chunk)
        left -= len(chunk)
    return digest.digest()
