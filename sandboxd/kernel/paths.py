"""Host paths a policy names: existence, symlink resolution, and the descriptors that get bound.

Each path is opened once, as the caller (kernel.access), and everything after that comes from
the descriptor: the real path, the caller's rights, the mount. A writable root given through a
symlink is resolved and the real directory is what gets bound. A symlink that sits *inside* a
writable area is refused, because a sandboxed command could have planted it there to turn a
later run's writable root into a host directory of its choosing.
"""

from __future__ import annotations

import errno
import os
import stat

from sandboxd._record import Record
from sandboxd.errors import InvalidPolicy
from sandboxd.kernel import access
from sandboxd.policy.sandbox import is_within, validate_writable_root

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable


class ResolvedPaths(Record):
    workspace: str
    cwd: str
    writable_roots: tuple[str, ...]  # real paths, parents before children, without duplicates
    # O_PATH descriptors of the workspace and the writable roots, by real path, opened (and
    # checked) as the caller: what gets bound into the sandbox. The caller of ``resolve`` owns them.
    descriptors: dict[str, int]
    # The allowed Unix sockets the caller may connect to, as (major, minor, inode).
    socket_ids: frozenset[tuple[int, int, int]] = frozenset()

    def close(self) -> None:
        for fd in self.descriptors.values():
            os.close(fd)
        self.descriptors.clear()


def requests_for(workspace: str, writable_roots: tuple[str, ...],
                 allowed_sockets: tuple[str, ...] = ()) -> "list[access.PathRequest]":
    """What ``resolve`` opens as the caller, in its order (InvalidPolicy for a relative path)."""
    for what, path in [("workspace", workspace), *[("writable root", r) for r in writable_roots],
                       *[("allowed Unix socket", p) for p in allowed_sockets]]:
        if not path.startswith("/"):
            raise InvalidPolicy(f"{what} {path!r} is relative: give an absolute path")
    return ([access.PathRequest(workspace, "workspace", access.WRITE)]
            + [access.PathRequest(r, "writable root", access.WRITE) for r in writable_roots]
            + [access.PathRequest(p, "allowed Unix socket", access.WRITE) for p in allowed_sockets])


def planted_symlink_check(workspace: str, writable_roots: tuple[str, ...], *,
                          workspace_writable: bool) -> "Callable[[list[int]], None]":
    """The walk along the given writable paths that ``resolve`` makes (``_refuse_planted_symlinks``),
    on the descriptors of ``requests_for`` (InvalidPolicy for a planted symlink): for
    access.PendingOpen, whose child walks as the caller, so a lookup that does not answer
    waits there and not in a poll loop."""
    def check(fds: list[int]) -> None:
        reals = [access.real_path(fd) for fd in fds[:1 + len(writable_roots)]]
        writable = (reals[:1] if workspace_writable else []) + reals[1:]
        for given in ([workspace] if workspace_writable else []) + list(writable_roots):
            _refuse_planted_symlinks(given, writable)
    return check


def resolve(workspace: str, cwd: str | None, writable_roots: tuple[str, ...], *,
            workspace_writable: bool, confined: bool = True,
            caller: "tuple[int, int, tuple[int, ...]] | None" = None,
            allowed_sockets: tuple[str, ...] = (), opened: "list[int] | None" = None) -> ResolvedPaths:
    """Open the workspace, the writable roots and the allowed sockets once, as ``caller`` (the
    kernel checks its rights: write on the workspace and roots, write on a socket, which is what
    connect() needs), and resolve everything from those descriptors. ``opened``: those
    descriptors, opened already (``requests_for``, by a poll loop's access.PendingOpen, which
    also made the ``planted_symlink_check``); this function owns them then."""
    if opened is None:
        requests = requests_for(workspace, writable_roots, allowed_sockets)
        who = access.Caller(caller[0], caller[1], caller[2]) if caller else None
        fds = access.open_as(who, requests)
    else:
        fds = opened
    try:
        resolved = _from_descriptors(fds, workspace, cwd, writable_roots, allowed_sockets,
                                     workspace_writable=workspace_writable, confined=confined,
                                     walked=opened is not None)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    kept = set(resolved.descriptors.values())
    for fd in fds:
        if fd not in kept:
            os.close(fd)
    return resolved


def _from_descriptors(fds: list[int], workspace: str, cwd: str | None, writable_roots: tuple[str, ...],
                      allowed_sockets: tuple[str, ...], *, workspace_writable: bool, confined: bool,
                      walked: bool = False) -> ResolvedPaths:
    roots = 1 + len(writable_roots)
    socket_ids = frozenset(_socket_identity(fd, path) for fd, path in zip(fds[roots:], allowed_sockets, strict=True))
    real_ws = access.real_path(fds[0])
    if not stat.S_ISDIR(_stat_as_root(fds[0], "workspace", workspace).st_mode):
        raise InvalidPolicy(f"workspace {workspace!r} is not a directory")
    for fd, given in zip(fds[1:roots], writable_roots, strict=True):
        _stat_as_root(fd, "writable root", given)
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
    reals = [access.real_path(fd) for fd in fds[1:roots]]
    for given, real in zip(writable_roots, reals, strict=True):
        try:
            validate_writable_root(real)
        except InvalidPolicy as exc:
            raise InvalidPolicy(f"writable root {given!r} resolves to {real!r}: {exc}") from None
    writable = ([real_ws] if workspace_writable else []) + reals
    if not walked:
        planted_symlink_check(workspace, writable_roots, workspace_writable=workspace_writable)(fds)
    descriptors: dict[str, int] = {}
    for real, fd in zip([real_ws, *reals], fds[:roots], strict=True):
        descriptors.setdefault(real, fd)
    ordered = sorted(dict.fromkeys(writable), key=lambda p: (p.count("/"), p))
    return ResolvedPaths(real_ws, real_cwd, tuple(ordered), descriptors, socket_ids)


def _stat_as_root(fd: int, what: str, given: str) -> os.stat_result:
    """fstat of a path the caller opened, as this process (root): refused with what to do when
    its file system does not let root in. A FUSE mount without ``allow_other`` (sshfs, rclone, a
    user's own FUSE server) answers only its mounting user, and root gets EACCES: a sandbox is set
    up as root (its mounts, its cwd) before it drops to the caller's uid, so it cannot use it."""
    try:
        return os.fstat(fd)
    except PermissionError:
        kind = file_system_type(fd)
        raise InvalidPolicy(
            f"{what} {given!r} is on a file system{f' ({kind})' if kind else ''} that refuses root (EACCES): "
            "a FUSE mount without allow_other answers only the user who mounted it, and a sandbox is set up "
            "as root before it drops to your uid; mount it with -o allow_other (user_allow_other in "
            "/etc/fuse.conf), or use a directory on a local file system") from None


def file_system_type(fd: int) -> str | None:
    """The type of the file system ``fd`` is on (``fuse.sshfs``, ``ext4``), from its mount's line in
    /proc/self/mountinfo (no lookup under the mount: a statfs could wait on a FUSE server)."""
    fields = mount_fields(fd)
    try:
        return fields[fields.index("-") + 1] if fields else None
    except (ValueError, IndexError):
        return None


def mount_fields(fd: int) -> list[str] | None:
    """The fields of the /proc/self/mountinfo line (proc(5)) of the mount ``fd`` is on, or None."""
    mount_id = mount_id_of(fd)
    return None if mount_id is None else mount_table().get(mount_id)


def mount_id_of(fd: int) -> str | None:
    """The id of the mount ``fd`` is on (/proc/self/fdinfo's mnt_id), or None."""
    try:
        with open(f"/proc/self/fdinfo/{fd}") as info:
            return next(line.split()[1] for line in info if line.startswith("mnt_id:"))
    except (OSError, StopIteration, IndexError):
        return None


def mount_table() -> dict[str, list[str]]:
    """/proc/self/mountinfo read once: each line's fields by its mount id (the first field). For a
    caller asking about many mounts: one read, not one per mount."""
    try:
        with open("/proc/self/mountinfo") as mounts:
            return {fields[0]: fields for fields in (line.split() for line in mounts) if fields}
    except OSError:
        return {}


def _socket_identity(fd: int, given: str) -> tuple[int, int, int]:
    st = _stat_as_root(fd, "allowed Unix socket", given)
    if not stat.S_ISSOCK(st.st_mode):
        raise InvalidPolicy(f"allowed Unix socket {given!r} is not a socket")
    return (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)


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
