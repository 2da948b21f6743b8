"""The front door's socket files: its public socket made and replaced safely, its private
directories checked, and the relay files of a dead daemon cleared (network.front_door)."""

from __future__ import annotations

import errno
import os
import socket
import stat

__all__ = ["clear_relay_dir", "ensure_private_dir", "listen", "unlink_if_same", "unlink_quietly"]


def ensure_private_dir(path: str, *, create: bool, what: str) -> None:
    """``path`` must be a real directory, owned by us, closed to group and others."""
    if create:
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, f"{what} does not exist", path) from None
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(errno.ENOTDIR, f"{what} is not a directory", path)
    if st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise PermissionError(errno.EACCES, f"{what} must be owned by uid {os.geteuid()} and mode 0700 "
                              f"(it is uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o})", path)


def listen(path: str, mode: int) -> tuple[socket.socket, tuple[int, int]]:
    """Bind and listen on ``path`` with ``mode``; returns the socket and the file's (dev, ino)."""
    _remove_stale_socket(path)
    # Bound under a temporary name, chmod'ed, then renamed into place: clients
    # can never see the socket with the umask's mode instead of ``mode``.
    temp = f"{path}.{os.getpid()}.new"
    unlink_quietly(temp)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(temp)
        os.chmod(temp, mode)
        sock.listen(socket.SOMAXCONN)
        os.rename(temp, path)
        st = os.lstat(path)
    except BaseException:
        sock.close()
        unlink_quietly(temp)
        raise
    return sock, (st.st_dev, st.st_ino)


def _remove_stale_socket(path: str) -> None:
    """Make room at ``path``: nothing there, or a socket nobody listens on (removed). Else refuse."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise FileExistsError(errno.EEXIST, "refusing to replace something that is not a socket "
                              "(remove it, or choose another socket path)", path)
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.setblocking(False)
    try:
        probe.connect(path)
    except ConnectionRefusedError:
        # Nobody listening: a dead daemon's leftover.
        unlink_quietly(path)
        return
    except FileNotFoundError:
        return
    except BlockingIOError:
        pass  # a full backlog: someone is listening
    finally:
        probe.close()
    raise OSError(errno.EADDRINUSE, "another process is accepting connections on this socket "
                  "(is another sandboxd running?)", path)


def clear_relay_dir(relay_dir: str) -> None:
    for name in os.listdir(relay_dir):
        stem, dot, ext = name.partition(".")
        if stem.isdigit() and dot and ext == "sock":
            unlink_quietly(os.path.join(relay_dir, name))


def unlink_if_same(path: str, ident: tuple[int, int]) -> None:
    """Remove ``path`` only if it is still our socket (not one a newer daemon put there)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if (st.st_dev, st.st_ino) == ident:
        unlink_quietly(path)


def unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
