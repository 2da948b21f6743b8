"""Who is at the other end of a Unix connection, as the kernel says (SO_PEERCRED, SO_PEERGROUPS):
read once, when the front door accepts the connection (network.front_door)."""

from __future__ import annotations

import errno
import socket
import struct

from sandboxd._record import Record

__all__ = ["PeerCredentials", "peer_groups", "peer_ucred"]

# struct ucred { pid_t pid; uid_t uid; gid_t gid; }: the kernel's answer to SO_PEERCRED.
_UCRED = struct.Struct("iII")
_SO_PEERGROUPS = 59
_NGROUPS_MAX = 65536


class PeerCredentials(Record):
    """A caller as the kernel saw it when it connected (SO_PEERCRED); or, for a TLS caller,
    the local uid/gid it acts as, and ``principal`` naming its client certificate."""

    uid: int
    gid: int
    pid: int
    principal: str = ""
    # Supplementary groups, from SO_PEERGROUPS at connect time (the caller's /proc entry may be
    # gone or reused by then); for a TLS caller, those of the local user it acts as.
    groups: tuple[int, ...] = ()
    # Non-empty when the caller must be refused whatever it asks (for example: its process runs
    # inside one of this daemon's own sandboxes); the reason, said to the caller.
    refusal: str = ""
    # /proc/PID/cgroup as the door read it at accept (only when asked: tenancy by pod), confirmed
    # by the pidfd to be the connecting process's; service.principals reads the pod from it.
    cgroups: str = ""


def peer_ucred(conn: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process that connected ``conn``, as of connect(); OSError if it is gone."""
    pid, uid, gid = _UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    return pid, uid, gid


def peer_groups(conn: socket.socket) -> tuple[int, ...]:
    """The connecting process's supplementary groups (SO_PEERGROUPS), as of connect()."""
    size = 64 * 4
    for _ in range(2):
        try:
            raw = conn.getsockopt(socket.SOL_SOCKET, _SO_PEERGROUPS, size)
        except OSError as exc:
            if exc.errno == errno.ERANGE:
                size = _NGROUPS_MAX * 4  # more than 64 groups: ask for room for all
                continue
            return ()
        return struct.unpack(f"{len(raw) // 4}I", raw[: len(raw) // 4 * 4])
    return ()
