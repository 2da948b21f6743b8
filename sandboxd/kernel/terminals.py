"""Pseudo-terminals, by descriptor only.

A call with a terminal opens /dev/ptmx inside the session (the session's own devpts instance,
launcher/rootfs.py), as the caller's uid after every privilege is dropped, and reaches the peer
with TIOCGPTPEER rather than by its /dev/pts/N name: no path is looked up twice. The master goes
back to the daemon over a socket (SCM_RIGHTS); the daemon only checks (``is_master``), resizes
and reads and writes it, it never opens anything inside a sandbox by name.

The ioctl numbers are the kernel's ABI (asm-generic/ioctls.h), not sandboxd's own constants;
sandboxd_call.c takes them from the C library's headers.
"""

from __future__ import annotations

import os
import sys

import fcntl

TIOCSCTTY = 0x540E
TIOCSWINSZ = 0x5414
TIOCGWINSZ = 0x5413
TIOCGPTN = 0x80045430
TIOCSPTLCK = 0x40045431
TIOCGPTPEER = 0x5441
PTY_MASTER_MAJOR, PTMX_MINOR = 5, 2     # /dev/ptmx and every devpts instance's ptmx: c 5:2
PTMX_PATH = "/dev/ptmx"                 # inside a session: a link to its own devpts' pts/ptmx
MIN_SIZE, MAX_SIZE = 1, 1000            # rows and columns a terminal may have (ExecStart.terminal)


def winsize(rows: int, columns: int) -> bytes:
    """struct winsize: rows, columns, then the unused pixel sizes."""
    return b"".join(value.to_bytes(2, sys.byteorder) for value in (rows, columns, 0, 0))


def open_pair(rows: int, columns: int, ptmx: str = PTMX_PATH) -> tuple[int, int]:
    """(master, peer), both close-on-exec and neither a controlling terminal yet, at the given size."""
    master = os.open(ptmx, os.O_RDWR | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        fcntl.ioctl(master, TIOCSPTLCK, (0).to_bytes(4, sys.byteorder))      # unlockpt
        set_size(master, rows, columns)
        peer = fcntl.ioctl(master, TIOCGPTPEER, os.O_RDWR | os.O_NOCTTY | os.O_CLOEXEC)
    except BaseException:
        os.close(master)
        raise
    return master, peer


def take_as_controlling(peer: int) -> None:
    """Make ``peer`` the caller's controlling terminal and its stdin, stdout and stderr. The caller
    is a session leader without a terminal (setsid) and holds no other copy once this returns."""
    fcntl.ioctl(peer, TIOCSCTTY, 0)
    for target in (0, 1, 2):
        os.dup2(peer, target)
    if peer > 2:
        os.close(peer)


def set_size(master: int, rows: int, columns: int) -> None:
    """Resize; the kernel sends SIGWINCH to the terminal's foreground process group."""
    fcntl.ioctl(master, TIOCSWINSZ, winsize(rows, columns))


def get_size(fd: int) -> tuple[int, int]:
    data = fcntl.ioctl(fd, TIOCGWINSZ, bytes(8))
    return int.from_bytes(data[0:2], sys.byteorder), int.from_bytes(data[2:4], sys.byteorder)


def is_master(fd: int) -> bool:
    """Whether ``fd`` is a pseudo-terminal master (what a sandboxed process sent back could be anything)."""
    import stat

    st = os.fstat(fd)
    if not stat.S_ISCHR(st.st_mode) or (os.major(st.st_rdev), os.minor(st.st_rdev)) != (PTY_MASTER_MAJOR, PTMX_MINOR):
        return False
    try:
        fcntl.ioctl(fd, TIOCGPTN, bytes(4))
    except OSError:
        return False
    return True
