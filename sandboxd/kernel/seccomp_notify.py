"""seccomp user notification: the supervisor side (receive, inspect, answer).

A filter action of SECCOMP_RET_USER_NOTIF stops the calling thread and hands
the system call to whoever holds the listener descriptor. Reading arguments
from the caller's memory and then letting the kernel *continue* the call is
racy (another thread can rewrite the memory in between), so the supervisor
here never continues a call it has inspected: it performs the call itself on
a copy of the arguments, with a duplicate of the caller's descriptor
(pidfd_getfd), and returns the result.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os

from sandboxd._record import Record
from sandboxd.kernel._libc import libc, raw_syscall

SECCOMP_IOCTL_NOTIF_RECV = 0xC0502100
SECCOMP_IOCTL_NOTIF_SEND = 0xC0182101
SECCOMP_IOCTL_NOTIF_ID_VALID = 0x40082102


class _SeccompData(ctypes.Structure):
    _fields_ = [("nr", ctypes.c_int), ("arch", ctypes.c_uint32), ("instruction_pointer", ctypes.c_uint64),
                ("args", ctypes.c_uint64 * 6)]


class _Notif(ctypes.Structure):
    _fields_ = [("id", ctypes.c_uint64), ("pid", ctypes.c_uint32), ("flags", ctypes.c_uint32),
                ("data", _SeccompData)]


class _NotifResp(ctypes.Structure):
    _fields_ = [("id", ctypes.c_uint64), ("val", ctypes.c_int64), ("error", ctypes.c_int32),
                ("flags", ctypes.c_uint32)]


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


class Notification(Record):
    id: int
    pid: int
    syscall: int
    args: tuple[int, ...]


def receive(listener: int) -> Notification | None:
    """Take the next pending notification; None when the caller vanished meanwhile."""
    notif = _Notif()
    try:
        fcntl.ioctl(listener, SECCOMP_IOCTL_NOTIF_RECV, notif)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.EINTR):
            return None
        raise
    return Notification(notif.id, notif.pid, notif.data.nr, tuple(notif.data.args))


def still_valid(listener: int, notification_id: int) -> bool:
    """True while the caller still waits (so its pid and memory were not recycled)."""
    value = ctypes.c_uint64(notification_id)
    try:
        fcntl.ioctl(listener, SECCOMP_IOCTL_NOTIF_ID_VALID, value)
    except OSError:
        return False
    return True


def respond(listener: int, notification_id: int, result: int) -> None:
    """Answer: ``result`` >= 0 is the return value, < 0 is -errno."""
    resp = _NotifResp(notification_id, result if result >= 0 else 0, result if result < 0 else 0, 0)
    try:
        fcntl.ioctl(listener, SECCOMP_IOCTL_NOTIF_SEND, resp)
    except OSError as exc:
        if exc.errno != errno.ENOENT:  # the caller was killed while we worked: nothing to answer
            raise


def read_memory(pid: int, address: int, length: int) -> bytes:
    """Copy ``length`` bytes out of process ``pid`` (process_vm_readv)."""
    buffer = ctypes.create_string_buffer(length)
    local = _IoVec(ctypes.cast(buffer, ctypes.c_void_p), length)
    remote = _IoVec(address, length)
    got = libc.process_vm_readv(ctypes.c_int(pid), ctypes.byref(local), ctypes.c_ulong(1), ctypes.byref(remote),
                                ctypes.c_ulong(1), ctypes.c_ulong(0))
    if got < 0:
        raise OSError(ctypes.get_errno(), "process_vm_readv")
    return buffer.raw[:got]


def borrow_fd(pid: int, fd: int) -> int:
    """A duplicate of descriptor ``fd`` of process ``pid`` (pidfd_getfd, Linux 5.6)."""
    pidfd = raw_syscall("pidfd_open", pid, 0)
    if pidfd < 0:
        raise OSError(-pidfd, "pidfd_open")
    try:
        copy = raw_syscall("pidfd_getfd", pidfd, fd, 0)
        if copy < 0:
            raise OSError(-copy, "pidfd_getfd")
        os.set_inheritable(copy, False)
        return copy
    finally:
        os.close(pidfd)


def connect_raw(fd: int, address: bytes) -> int:
    """connect(2) with a raw sockaddr; returns 0 or -errno."""
    buffer = ctypes.create_string_buffer(address, len(address))
    ctypes.set_errno(0)
    result = libc.connect(ctypes.c_int(fd), buffer, ctypes.c_uint(len(address)))
    return 0 if result == 0 else -ctypes.get_errno()
