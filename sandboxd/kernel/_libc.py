"""ctypes access to the few system calls Python's ``os`` module lacks, and the
single place where their errno values become ``SetupError``s with a hint."""

from __future__ import annotations

import ctypes
import errno
import os

from sandboxd.errors import NamespacesUnavailable, ProcessLimitReached, SetupError

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long

_MACHINE = os.uname().machine
# System calls without a glibc wrapper. 434 and up are the same on every
# architecture; older ones differ.
_SYSCALLS = {
    "x86_64": {"pivot_root": 155, "seccomp": 317, "statx": 332},
    "aarch64": {"pivot_root": 41, "seccomp": 277, "statx": 291},
}
_COMMON = {"open_tree": 428, "move_mount": 429, "pidfd_open": 434, "close_range": 436, "openat2": 437,
           "pidfd_getfd": 438, "faccessat2": 439, "mount_setattr": 442, "landlock_create_ruleset": 444, "landlock_add_rule": 445,
           "landlock_restrict_self": 446}


def syscall_number(name: str) -> int:
    if name in _COMMON:
        return _COMMON[name]
    try:
        return _SYSCALLS[_MACHINE][name]
    except KeyError:
        raise SetupError(name, errno.ENOSYS, detail=f"unsupported architecture {_MACHINE}") from None


def raw_syscall(name: str, *args: object) -> int:
    """Run a system call; return its result or -errno (never raises)."""
    ctypes.set_errno(0)
    result: int = libc.syscall(ctypes.c_long(syscall_number(name)), *args)
    if result < 0:
        return -ctypes.get_errno()
    return result


def checked(result: int, step: str, path: str | None = None) -> int:
    """Turn a libc-style result (-1 and errno) or a raw -errno into a SetupError."""
    if result >= 0:
        return result
    code = -result if result < -1 else ctypes.get_errno()
    raise setup_error(step, code, path)


def setup_error(step: str, code: int, path: str | None = None, detail: str | None = None) -> SetupError:
    """The translation table: which kernel refusal means what to the user."""
    hint = None
    cls = SetupError
    if step.startswith("unshare") or step.startswith("setns"):
        if code in (errno.EPERM, errno.EACCES, errno.ENOSPC, errno.EINVAL, errno.ENOSYS):
            cls = NamespacesUnavailable
            hint = ("the kernel or the container refused to create namespaces: run sandboxd as root on the host, "
                    "or give its container CAP_SYS_ADMIN and an unconfined seccomp/AppArmor profile "
                    "(docker run --privileged, or --cap-add SYS_ADMIN --security-opt seccomp=unconfined "
                    "--security-opt apparmor=unconfined); on Ubuntu 24.04+ check "
                    "kernel.apparmor_restrict_unprivileged_userns; check user.max_*_namespaces sysctls")
    elif step.startswith("mount") or step.startswith("pivot_root") or step.startswith("bind"):
        if code in (errno.EPERM, errno.EACCES):
            hint = ("mounting was refused: sandboxd needs CAP_SYS_ADMIN (root, or a container with "
                    "--cap-add SYS_ADMIN and apparmor=unconfined)")
        elif code == errno.ENOENT:
            hint = "the path does not exist on the host; create it or drop it from the policy"
    elif step == "exec":
        if code == errno.ENOENT:
            hint = "the program was not found inside the sandbox: check the name, PATH, and that it is not under a hidden path"
        elif code == errno.EACCES:
            hint = "the program is not executable by the sandbox user (check its mode and the --user given)"
    elif step.startswith("seccomp"):
        hint = "the kernel refused the seccomp filter: it needs CONFIG_SECCOMP_FILTER (and 5.0+ for user notification)"
    elif step == "fork" and code == errno.EAGAIN:
        cls = ProcessLimitReached
        hint = ("the sandbox has as many processes as it may: its own limit (limits.pids; `sandboxd run --pids`), "
                "its owner's share of all sandboxes' (limits.owner_pids) or all sandboxes' together "
                "(limits.total_pids) is reached; end some of its processes or close sessions")
    elif step.startswith("cgroup"):
        hint = ("cgroup limits need a writable cgroup hierarchy: run as root, or under systemd with Delegate=yes")
    return cls(step, code, path, hint=hint, detail=detail)


def errno_of(exc: OSError) -> int:
    return exc.errno or errno.EIO


def from_oserror(exc: OSError, step: str, path: str | None = None) -> SetupError:
    return setup_error(step, errno_of(exc), path or exc.filename)


def prctl(option: int, arg2: int = 0, arg3: int = 0, arg4: int = 0, arg5: int = 0, *, step: str = "prctl") -> int:
    result = libc.prctl(ctypes.c_int(option), ctypes.c_ulong(arg2), ctypes.c_ulong(arg3),
                        ctypes.c_ulong(arg4), ctypes.c_ulong(arg5))
    return checked(result, step)


def fsencode(path: str | bytes | None) -> bytes | None:
    if path is None:
        return None
    return os.fsencode(path)
