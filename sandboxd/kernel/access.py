"""A path as the caller sees it: opened, and its access checked, under the caller's own credentials.

The root daemon must never let a caller use a directory (or a socket) the caller could not use
itself. Re-implementing the kernel's permission rules in Python (mode bits, groups, ACLs, LSMs)
gets them wrong, so the kernel is asked instead: a short-lived child of the (single-threaded)
fork server takes the caller's uid, gid and supplementary groups, opens each path with O_PATH
(so the lookup runs with the caller's search rights and follows symlinks as the caller would),
asks ``faccessat2(fd, "", mode, AT_EMPTY_PATH | AT_EACCESS)`` on the opened object (ACLs count),
and sends the descriptor back. The parent then uses *that descriptor* for everything else: its
real path, the reach check just done, and the bind mount (``mounts.clone_tree``), so a symlink
swapped in between cannot change what was checked.
"""

from __future__ import annotations

import _socket
import ctypes
import errno
import os
import select
import _signal as signal  # the C module: signal.py builds IntEnums (the run path avoids enum)
import struct  # not array: its import loads collections.abc (about 2 ms of `sandboxd run`)

from sandboxd._record import Record
from sandboxd.errors import Forbidden, InvalidPolicy
from sandboxd.kernel._libc import raw_syscall

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable

AT_EMPTY_PATH = 0x1000
AT_EACCESS = 0x200
READ, WRITE, SEARCH = os.R_OK, os.W_OK, os.X_OK


class Caller(Record):
    """Whose rights a path is checked with: a uid, its primary gid and supplementary groups."""

    uid: int
    gid: int
    groups: tuple[int, ...] = ()


class PathRequest(Record):
    """One path to open: ``what`` names it in messages ("workspace", "writable root", ...);
    ``access`` is the rights the caller must have on it (os.W_OK, ...; 0: reach only)."""

    path: str
    what: str
    access: int


def open_as(caller: "Caller | None", requests: "list[PathRequest]") -> list[int]:
    """An O_PATH descriptor for each request, opened and checked as ``caller`` (None: as this
    process, with no check: root's own launches). Raises InvalidPolicy for a path that does not
    exist, Forbidden for one the caller cannot reach or lacks the rights on; no descriptor leaks.
    Waits as long as the lookups take: a process with other work (the fork server) uses
    ``PendingOpen`` from its poll loop instead."""
    if caller is None or (caller.uid == 0 and caller.gid == 0):
        return _open_here(requests)
    pending = PendingOpen(caller, requests)
    try:
        while not pending.step():
            select_poll = _poller(pending.fileno())
            select_poll.poll()
        return pending.take()
    finally:
        pending.abandon()
        pending.reap(block=True)


def _poller(fd: int) -> "select.poll":
    waiter = select.poll()
    waiter.register(fd, select.POLLIN)
    return waiter


class PendingOpen:
    """``open_as`` in a child, answered a descriptor at a time, for a poll loop that must never
    wait on a caller's path: a lookup on a file system that does not answer (a FUSE server that
    never replies, a hung NFS or sshfs mount) blocks only this child. Poll ``fileno()``; call
    ``step()`` when it is readable (True: every answer is in, or the child failed); then ``take()``.
    ``abandon()`` (always, at the end) SIGKILLs the child if it is still there; ``reap()``
    collects it once its pidfd (``pidfd``) is readable: a task stuck in D state on a hard NFS
    mount may take long, and nobody waits for it."""

    def __init__(self, caller: Caller, requests: "list[PathRequest]",
                 check: "Callable[[list[int]], None] | None" = None,
                 enter: "Callable[[], None] | None" = None) -> None:
        """``check``: run in the child, as the caller, on all the descriptors once opened (it may
        raise InvalidPolicy): lookups of its own (a walk along the given paths) then wait on the
        caller's file systems in the child too, never in this process. ``enter``: run in the child
        first, still with this process's rights (the fork server moves it into its owner's cgroup:
        a child stuck on the caller's mount then counts against the caller's own share)."""
        self.caller, self.requests = caller, list(requests)
        self._fds: list[int] = []
        self._refusal: Exception | None = None
        self._checking = check is not None
        self._sock, child_end = _socket.socketpair(_socket.AF_UNIX, _socket.SOCK_SEQPACKET | _socket.SOCK_CLOEXEC)
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child only reports, through the socket
            self._sock.close()
            code = 0
            try:
                if enter is not None:
                    enter()
                _child(caller, requests, child_end, check)
            except BaseException:  # noqa: BLE001 - the parent sees a short answer
                code = 1
            os._exit(code)
        child_end.close()
        self.pid = pid
        self.pidfd = os.pidfd_open(pid)
        self._sock.setblocking(False)
        self._reaped = False

    def fileno(self) -> int:
        return self._sock.fileno()

    def step(self) -> bool:
        """Take the answers that are in; True once there is nothing more to wait for."""
        while (len(self._fds) < len(self.requests) or self._checking) and self._refusal is None:
            try:
                answer, received = _receive(self._sock)
            except BlockingIOError:
                return False
            except OSError:
                answer, received = "", []
            if len(self._fds) == len(self.requests):      # the check's verdict
                for fd in received:
                    os.close(fd)
                self._checking = False
                if answer != "checked":
                    self._refusal = InvalidPolicy(answer.partition(" ")[2]) if answer.startswith("refused ") \
                        else Forbidden(f"the path check as uid {self.caller.uid} failed")
                return True
            if not received:
                self._refusal = _refusal(self.caller, self.requests[len(self._fds)], answer)
                return True
            self._fds.append(received[0])
            for extra in received[1:]:
                os.close(extra)
        return True

    def take(self) -> list[int]:
        """The descriptors, one per request (the caller owns them), or the refusal raised."""
        if self._refusal is not None:
            raise self._refusal
        fds, self._fds = self._fds, []
        return fds

    def waiting_on(self) -> PathRequest | None:
        """The request whose answer has not come: the path a hung lookup is stuck on (None: every
        path is open, the ``check`` is what has not answered)."""
        return self.requests[len(self._fds)] if len(self._fds) < len(self.requests) else None

    def abandon(self) -> None:
        """Stop waiting: close what was received and not taken, SIGKILL the child if still there."""
        for fd in self._fds:
            os.close(fd)
        self._fds = []
        if self._sock.fileno() >= 0:
            self._sock.close()
        if not self._reaped:
            try:
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def reap(self, *, block: bool = False) -> bool:
        """Collect the child (True once it is gone and its pidfd closed)."""
        if self._reaped:
            return True
        try:
            pid, _ = os.waitpid(self.pid, 0 if block else os.WNOHANG)
        except ChildProcessError:
            pid = self.pid
        if pid == 0:
            return False
        os.close(self.pidfd)
        self._reaped = True
        return True


def _open_here(requests: "list[PathRequest]") -> list[int]:
    fds: list[int] = []
    try:
        for request in requests:
            try:
                fds.append(os.open(request.path, os.O_PATH | os.O_CLOEXEC))
            except OSError as exc:
                raise _refusal(None, request, f"open {exc.errno}") from None
        return fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def _child(caller: Caller, requests: "list[PathRequest]", sock: "_socket.socket",
           check: "Callable[[list[int]], None] | None" = None) -> None:
    """In the forked child: become the caller, then open and check each path in turn."""
    os.setgroups(list(caller.groups))
    os.setresgid(caller.gid, caller.gid, caller.gid)
    os.setresuid(caller.uid, caller.uid, caller.uid)
    opened: list[int] = []                # kept for ``check``; the process's exit closes them
    for request in requests:
        try:
            fd = os.open(request.path, os.O_PATH | os.O_CLOEXEC)
        except OSError as exc:
            sock.send(f"open {exc.errno or errno.EIO}".encode())
            return
        if request.access and (caller.uid, caller.gid) != (0, 0):    # root: no check, as in open_as
            result = raw_syscall("faccessat2", ctypes.c_int(fd), b"", ctypes.c_int(request.access),
                                 ctypes.c_int(AT_EMPTY_PATH | AT_EACCESS))
            if result < 0:
                sock.send(f"access {-result}".encode())
                return
        sock.sendmsg([b"ok"], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, _FD.pack(fd))])
        opened.append(fd)
    if check is not None:
        try:
            check(opened)
        except InvalidPolicy as exc:
            sock.send(f"refused {exc}".encode()[:4000])
            return
        sock.send(b"checked")


def _receive(sock: "_socket.socket") -> tuple[str, list[int]]:
    fds: list[int] = []
    data, ancillary, _, _ = sock.recvmsg(4096, _socket.CMSG_SPACE(4 * _FD.size))
    for level, kind, payload in ancillary:
        if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS:
            fds += [fd for (fd,) in _FD.iter_unpack(payload[: len(payload) - len(payload) % _FD.size])]
    return data.decode(errors="replace"), fds


_FD = struct.Struct("i")                  # one descriptor of an SCM_RIGHTS message
_RIGHTS = {READ: ("readable", "read"), WRITE: ("writable", "write"), SEARCH: ("searchable", "search")}


def _refusal(caller: "Caller | None", request: PathRequest, answer: str) -> Exception:
    stage, _, number = answer.partition(" ")
    code = int(number) if number.isdigit() else errno.EIO
    who = "sandboxd" if caller is None else f"uid {caller.uid}"
    if stage == "open" and code in (errno.ENOENT, errno.ENOTDIR):
        return InvalidPolicy(f"{request.what} {request.path!r} does not exist: create it first"
                             + (" or remove it from the policy" if request.what != "workspace" else ""))
    if stage == "open" and code in (errno.EACCES, errno.EPERM):
        return Forbidden(f"{request.what} {request.path!r} is not reachable by {who}: a session may only use "
                         "paths its caller could reach itself")
    if stage == "access":
        adjective, verb = _RIGHTS.get(request.access, ("usable", "use"))
        return Forbidden(f"{request.what} {request.path!r} is not {adjective} by {who} (the kernel says "
                         f"{errno.errorcode.get(code, code)}): a session may only use paths its caller could "
                         f"{verb} itself")
    if not answer:
        return Forbidden(f"{request.what} {request.path!r}: the access check as {who} failed")
    return InvalidPolicy(f"{request.what} {request.path!r} cannot be used: {os.strerror(code)}")


def real_path(fd: int) -> str:
    """The path of an opened object, as the kernel names it now."""
    return os.readlink(f"/proc/self/fd/{fd}")
