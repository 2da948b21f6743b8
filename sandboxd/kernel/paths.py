"""Host paths a policy names: existence, symlink resolution, and pinning.

A writable root given through a symlink is resolved first and the real
directory is what gets bound. A symlink that sits *inside* a writable area is
refused, because a sandboxed command could have planted it there to turn a
later run's writable root into a host directory of its choosing.
"""

from __future__ import annotations

import errno
import os
import stat

from sandboxd._record import Record
from sandboxd.errors import InvalidPolicy, SetupError
from sandboxd.policy.sandbox import is_within, validate_writable_root


class ResolvedPaths(Record):
    workspace: str
    cwd: str
    writable_roots: tuple[str, ...]  # real paths, parents before children, without duplicates


def resolve(workspace: str, cwd: str | None, writable_roots: tuple[str, ...], *,
            workspace_writable: bool, confined: bool = True) -> ResolvedPaths:
    real_ws = _real_existing(workspace, "workspace", want_dir=True)
    if confined:
        # The workspace is bound into the sandbox (read-write, or read-only under
        # read-only): it must not hand over the host's root, /proc, /sys or /dev.
        try:
            if workspace_writable:
                validate_writable_root(real_ws)
            else:
                _refuse_kernel_filesystems(real_ws)
                if real_ws == "/":
                    # Bound over the new root it would cover the sandbox's own /proc, /sys,
                    # /dev and /tmp with the host's.
                    raise InvalidPolicy("a workspace of / would cover the sandbox's own /proc, /sys, /dev "
                                        "and /tmp with the host's")
        except InvalidPolicy as exc:
            where = f"{workspace!r}" + (f" (resolved: {real_ws!r})" if real_ws != workspace else "")
            raise InvalidPolicy(f"workspace {where} cannot be used: {exc}; run from, or pass --workspace, "
                                "a project directory") from None
    real_cwd = _real_existing(cwd, "cwd", want_dir=True) if cwd else real_ws
    reals = [_real_existing(r, "writable root", want_dir=False) for r in writable_roots]
    for given, real in zip(writable_roots, reals, strict=True):
        try:
            validate_writable_root(real)
        except InvalidPolicy as exc:
            raise InvalidPolicy(f"writable root {given!r} resolves to {real!r}: {exc}") from None
    writable = ([real_ws] if workspace_writable else []) + reals
    for given in ([workspace] if workspace_writable else []) + list(writable_roots):
        _refuse_planted_symlinks(given, writable)
    ordered = sorted(dict.fromkeys(writable), key=lambda p: (p.count("/"), p))
    return ResolvedPaths(real_ws, real_cwd, tuple(ordered))


def _refuse_kernel_filesystems(path: str) -> None:
    for prefix in ("/proc", "/sys", "/dev"):
        if is_within(path, prefix):
            raise InvalidPolicy(f"{path!r} is under {prefix}, which the sandbox replaces with its own")


def _real_existing(path: str, what: str, *, want_dir: bool) -> str:
    if not path.startswith("/"):
        raise InvalidPolicy(f"{what} {path!r} is relative: give an absolute path")
    real = os.path.realpath(path)
    try:
        st = os.stat(real)
    except FileNotFoundError:
        fix = "create it first" + (" or remove it from the policy" if what == "writable root" else "")
        raise InvalidPolicy(f"{what} {path!r} does not exist: {fix}") from None
    except OSError as exc:
        raise InvalidPolicy(f"{what} {path!r} cannot be used: {os.strerror(exc.errno or errno.EIO)}") from None
    if want_dir and not stat.S_ISDIR(st.st_mode):
        raise InvalidPolicy(f"{what} {path!r} is not a directory")
    return real


def _refuse_planted_symlinks(given: str, writable: list[str]) -> None:
    """Walk ``given`` component by component; a symlink inside a writable area is refused."""
    current = "/"
    for part in [p for p in given.split("/") if p and p != "."]:
        if part == "..":
            current = os.path.dirname(current) or "/"
            continue
        candidate = os.path.join(current, part)
        if os.path.islink(candidate):
            for area in writable:
                if is_within(current, area):
                    raise InvalidPolicy(
                        f"{given!r} passes through the symlink {candidate!r}, which lies inside the writable "
                        f"area {area!r} where a sandboxed command could have planted it; give the resolved "
                        f"path {os.path.realpath(given)!r} explicitly if that is really meant")
            current = os.path.realpath(candidate)
        else:
            current = candidate


def pin(path: str, *, step: str) -> int:
    """Open ``path`` as an O_PATH descriptor and check nothing swapped a symlink in since it was resolved.

    Mounting from ``/proc/self/fd/N`` afterwards binds exactly that inode,
    whatever happens to the name, and works even after /tmp is hidden.
    """
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError as exc:
        raise SetupError(step, exc.errno or errno.EIO, path,
                         hint="the path changed or vanished since the launch was planned") from None
    actual = os.readlink(f"/proc/self/fd/{fd}")
    if actual != path:
        os.close(fd)
        raise SetupError(step, errno.ELOOP, path,
                         detail=f"it now leads to {actual!r}: a symlink was swapped in during setup")
    return fd
