"""The front door's socket files: its public socket made and replaced safely, the daemon's own
directories beside it made or checked (own_directory) and its private ones checked, and the
relay files of a dead daemon cleared (network.front_door).

A socket may sit in a shared directory (/tmp, /var/tmp, /dev/shm: defaults.SHARED_DIRECTORIES),
where any local user may make a name before the daemon does. A name taken so is never used nor
changed (chmod through a planted link would change whatever it points to): the daemon refuses to
start with PlaceTaken, one line naming the path, its owner and the fix."""

from __future__ import annotations

import errno
import os
import socket
import stat

__all__ = ["PlaceTaken", "check_socket_directory", "clear_relay_dir", "ensure_private_dir", "listen", "own_directory",
           "unlink_if_same", "unlink_quietly"]


class PlaceTaken(PermissionError):
    """A name the daemon keeps its own things under is another user's (or not what it must be):
    ``role`` says what the daemon keeps there, ``problem`` what is wrong (before the owner's
    name, when the owner is not the daemon's user), ``fix`` what to do."""

    REMOVE = "remove it (`rm -r {path}`) and start again, or "
    ELSEWHERE = "serve on a socket in a directory only root may write (the default, /run/sandboxd)"

    def __init__(self, path: str, owner: int, role: str, problem: str = "belongs to", fix: str = REMOVE) -> None:
        super().__init__(errno.EEXIST, f"{role}: {problem} uid {owner}", path)
        self.owner, self.role, self.problem, self.fix = owner, role, problem, fix

    def __str__(self) -> str:
        whose = f" {_user(self.owner)}, not to the daemon's uid {os.geteuid()}" if self.owner != os.geteuid() else ""
        return (f"{self.filename} ({self.role}) {self.problem}{whose}: "
                f"{self.fix.format(path=self.filename)}{self.ELSEWHERE}")


def _user(uid: int) -> str:
    import pwd

    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def own_directory(path: str, mode: int, *, role: str) -> bool:
    """``path`` a directory of this process's user (not a link to one), mode ``mode``: made so
    when missing (True), its mode set when it is ours already (False). PlaceTaken, with nothing
    changed, when the name is another user's or not a directory."""
    try:
        os.mkdir(path, mode)
        made = True
    except FileExistsError:
        made = False
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno not in (errno.ENOTDIR, errno.ELOOP):
            raise
        raise PlaceTaken(path, os.lstat(path).st_uid, role, "is not a directory: a link or file that belongs to") \
            from None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise PlaceTaken(path, st.st_uid, role)
        if made or stat.S_IMODE(st.st_mode) != mode:
            os.fchmod(fd, mode)                    # (mkdir's mode passed through the umask)
    finally:
        os.close(fd)
    return made


def check_socket_directory(path: str) -> None:
    """The directory of the daemon's socket when it is not a shared one: the daemon keeps its
    private sockets there, so it must be the daemon's user's and writable by nobody else (else
    another user could move them and put its own in their place). PlaceTaken otherwise."""
    st = os.stat(path)
    role = "the socket's directory, where the daemon keeps its private sockets"
    if st.st_uid != os.geteuid():
        raise PlaceTaken(path, st.st_uid, role, fix="")
    if st.st_mode & 0o022:
        raise PlaceTaken(path, st.st_uid, role, f"may be written by group or others (mode "
                         f"{stat.S_IMODE(st.st_mode):04o}), and is not a shared directory sandboxd knows "
                         "(/tmp, /var/tmp, /dev/shm)", fix="")


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
        if st.st_uid != os.geteuid():
            raise PlaceTaken(path, st.st_uid, "the daemon's socket", "is not a socket: it belongs to")
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
    if st.st_uid != os.geteuid():
        raise PlaceTaken(path, st.st_uid, "the daemon's socket", "is a socket another process listens on, which belongs to")
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
