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
import array
import ctypes
import errno
import os

from sandboxd._record import Record
from sandboxd.errors import Forbidden, InvalidPolicy
from sandboxd.kernel._libc import raw_syscall

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
    exist, Forbidden for one the caller cannot reach or lacks the rights on; no descriptor leaks."""
    if caller is None or (caller.uid == 0 and caller.gid == 0):
        return _open_here(requests)
    parent_end, child_end = _socket.socketpair(_socket.AF_UNIX, _socket.SOCK_SEQPACKET | _socket.SOCK_CLOEXEC)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child only reports, through the socket
        parent_end.close()
        code = 0
        try:
            _child(caller, requests, child_end)
        except BaseException:  # noqa: BLE001 - the parent sees a short answer
            code = 1
        os._exit(code)
    child_end.close()
    fds: list[int] = []
    try:
        for request in requests:
            answer, received = _receive(parent_end)
            if not received:
                raise _refusal(caller, request, answer)
            fds.append(received[0])
            for extra in received[1:]:
                os.close(extra)
        return fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    finally:
        parent_end.close()
        os.waitpid(pid, 0)


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


def _child(caller: Caller, requests: "list[PathRequest]", sock: "_socket.socket") -> None:
    """In the forked child: become the caller, then open and check each path in turn."""
    os.setgroups(list(caller.groups))
    os.setresgid(caller.gid, caller.gid, caller.gid)
    os.setresuid(caller.uid, caller.uid, caller.uid)
    for request in requests:
        try:
            fd = os.open(request.path, os.O_PATH | os.O_CLOEXEC)
        except OSError as exc:
            sock.send(f"open {exc.errno or errno.EIO}".encode())
            return
        if request.access:
            result = raw_syscall("faccessat2", ctypes.c_int(fd), b"", ctypes.c_int(request.access),
                                 ctypes.c_int(AT_EMPTY_PATH | AT_EACCESS))
            if result < 0:
                sock.send(f"access {-result}".encode())
                return
        sock.sendmsg([b"ok"], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, array.array("i", [fd]))])
        os.close(fd)


def _receive(sock: "_socket.socket") -> tuple[str, list[int]]:
    fds = array.array("i")
    data, ancillary, _, _ = sock.recvmsg(256, _socket.CMSG_SPACE(4 * fds.itemsize))
    for level, kind, payload in ancillary:
        if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    return data.decode(errors="replace"), list(fds)


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
