"""Where a new daemon attaches to a surviving supervisor: a root-only Unix socket, its peers checked.

The supervisor (fork_server with ``--survive``) listens on ``supervisor.sock`` in the daemon's
private directory (defaults.private_dir: 0700, root's), SOCK_SEQPACKET like the socket pair the
first daemon talks on. A connection is taken only from a peer whose SO_PEERCRED uid is 0 and whose
executable is the supervisor's own (/proc/PID/exe, by device and inode: the interpreter the daemon
runs), so neither a local user (who cannot even reach the directory) nor another root program
that happens to find the socket drives the fork server; and only while no daemon is attached:
one daemon at a time, a second is answered an error and closed.
"""

from __future__ import annotations

import os
import socket
import struct

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
        theirs, ours = os.stat(f"/proc/{pid}/exe"), os.stat("/proc/self/exe")
    except OSError:
        return f"the attaching process {pid} is gone or unreadable"
    if (theirs.st_dev, theirs.st_ino) != (ours.st_dev, ours.st_ino):
        return f"process {pid} does not run sandboxd's interpreter ({os.readlink('/proc/self/exe')}): refused"
    return ""
