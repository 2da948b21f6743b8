"""One exact NETLINK_SOCK_DIAG question and its answer (kernel.unix_diag, kernel.inet_diag).

An exact question (no NLM_F_DUMP: one socket, named by its inode or its addresses) is answered by
one message, queued before send() returns. So a socket kept open and shared (a sandbox's init
keeps one of the host's network namespace, opened before it leaves it: launcher.sequence, for its
connect brokers' threads) serves one question at a time under a lock, never waits (it is
non-blocking: no answer is a failure, not a hang), and takes only the answer carrying its
question's sequence number. Hand-rolled with ``struct``, like the rest of the launch path.
"""

from __future__ import annotations

import _socket
import _thread
import errno
import os
import struct

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST = 0x1
NLMSG_ERROR = 2
HEADER = struct.Struct("=IHHII")              # nlmsghdr: length, type, flags, sequence, port
NO_ANSWER = (errno.ENOENT, errno.ESTALE)       # no such socket here; one, but not the cookie asked for

_shared_lock = _thread.allocate_lock()
_sequence = [0]


def open_shared() -> int:
    """A descriptor of a sock_diag socket of the current network namespace, for ``ask(fd=)``."""
    sock = _socket.socket(_socket.AF_NETLINK, _socket.SOCK_DGRAM | _socket.SOCK_CLOEXEC | _socket.SOCK_NONBLOCK,
                          NETLINK_SOCK_DIAG)
    return sock.detach()


def ask(body: bytes, fd: int = -1) -> bytes | None:
    """The answer (its payload, after the header) to the exact question ``body`` (a
    *_diag_req), on a socket of our network namespace, or on ``fd`` (``open_shared``); None when
    the kernel has no such socket (NO_ANSWER); OSError for any other failure."""
    if fd < 0:
        sock = _socket.socket(_socket.AF_NETLINK, _socket.SOCK_DGRAM | _socket.SOCK_CLOEXEC, NETLINK_SOCK_DIAG)
        try:
            sock.send(HEADER.pack(HEADER.size + len(body), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST, 1, 0) + body)
            return _payload(sock.recv(65536), 1)[1]
        finally:
            sock.close()
    with _shared_lock:
        _sequence[0] = sequence = _sequence[0] % 0x7FFFFFFF + 1
        os.write(fd, HEADER.pack(HEADER.size + len(body), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST, sequence, 0) + body)
        while True:
            ours, answer = _payload(os.read(fd, 65536), sequence)   # BlockingIOError when none came
            if ours:
                return answer
            # Left by a question that failed half-way: read on.


def _payload(data: bytes, sequence: int) -> tuple[bool, bytes | None]:
    """(whether ``data`` answers question ``sequence``, its payload or None: ``ask``)."""
    if len(data) < HEADER.size:
        raise OSError(errno.EPROTO, "sock_diag: an answer shorter than its header")
    length, kind, _, answered, _ = HEADER.unpack_from(data)
    if answered != sequence:
        return False, None
    if kind == NLMSG_ERROR:
        code = -struct.unpack_from("=i", data, HEADER.size)[0] if len(data) >= HEADER.size + 4 else errno.EPROTO
        if code in NO_ANSWER:
            return True, None
        raise OSError(code, "sock_diag")
    if kind != SOCK_DIAG_BY_FAMILY:
        raise OSError(errno.EPROTO, f"sock_diag: an answer of type {kind}")
    return True, data[HEADER.size:length]
