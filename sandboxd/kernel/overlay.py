"""Review mode's mount: a kernel overlayfs over a writable root, whose upper layer is the change set.

The host directory (the workspace or a writable root) is the lower layer; the upper and work
directories belong to sandboxd (root: a per-session directory 0700 under the state directory;
a plain user's `sandboxd run`: a directory of its own, mounted from its user namespace with
``userxattr``, Linux 5.11+). The overlay is mounted inside the sandbox's mount namespace at the
path where the sandbox sees the root, so commands see a normal writable directory and the host
sees nothing: every write lands in the upper layer, which ``sandboxd.review`` reads.

Options, the same on every kernel (each is a mount option since 4.19, so 6.1 and 6.18 agree):

* ``index=off``, ``metacopy=off``, ``redirect_dir=nofollow``, ``xino=off``: the upper layer is
  an exact, readable change set. With metacopy a chmod copies up metadata only and the content
  stays a reference to the lower; with redirect_dir a renamed directory is a pointer to its old
  place: neither is a change a person can read or apply on its own. Without redirects a rename
  of a directory the host has gives EXDEV and ``mv`` copies it (the change set then says: added
  here, deleted there). These four are also exactly the features whose absence makes changes to
  the lower layer while the overlay is not mounted legal (Documentation/filesystems/overlayfs.rst,
  "Changes to underlying filesystems"), which is what an apply between calls is. nofollow rather
  than off: off means "follow" on a kernel built with OVERLAY_FS_REDIRECT_ALWAYS_FOLLOW.
* ``userxattr`` rootless: overlay's own attributes (opaque, whiteout, origin) are ``user.overlay.*``,
  the only ones a user namespace may write; as root they are ``trusted.overlay.*``.
* the layers are named ``/proc/self/fd/N`` of descriptors opened beforehand: no escaping of
  commas and colons in paths, and the sandbox's /proc/self/mountinfo names no host path.

Checkpoints (review.checkpoints) stack: a checkpoint renames the upper directory into a read-only
layer and starts an empty upper, so the overlay is then mounted with
``lowerdir=ckN:...:ck1:HOST`` (newest first). overlayfs honours whiteouts and opaque directories
in every lower layer but the last, exactly as in an upper, so the sandbox sees the same tree. At
most MAX_CHECKPOINTS: far below the kernel's 500 lower layers, and the mount's options (one page
for mount(2), 4096 bytes with the terminating NUL; ``lowerdir+`` is 6.8+ only) stay under 1.5 KiB.

Not every directory can be a lower layer for review. ``check_lower`` refuses, with one line
naming why, what would make the change set or its conflict check untrustworthy, rather than
falling back to direct writes.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
import time

from sandboxd._record import Record
from sandboxd.errors import InvalidPolicy, SetupError
from sandboxd.kernel._libc import fsencode, libc
from sandboxd.kernel.mounts import MS_NODEV, MS_NOSUID

STEP = "mount review overlay"
OPTIONS = "index=off,metacopy=off,redirect_dir=nofollow,xino=off"
ROOTLESS_MIN_KERNEL = (5, 11)                # unprivileged overlayfs and its userxattr option
TRUSTED_PREFIX = "trusted.overlay."
USER_PREFIX = "user.overlay."
LAYERS_FILE = "layers.json"
CLOCK_REALTIME_COARSE = 5                    # <linux/time.h>: the time module does not name it
MAX_CHECKPOINTS = 64                         # checkpoint layers one overlay stacks at most (see above)
DEFAULT_CHECKPOINTS = 32                     # config review.max_checkpoints
CHECKPOINTS_DIR = "checkpoints"              # beside each overlay's upper/ and work/: its checkpoint layers
MAX_OPTIONS = 4095                           # mount(2) copies one page of options, NUL included

OVERLAYFS_MAGIC = 0x794C7630
# Lower file systems review mode refuses, and why (statfs f_type).
_NETWORK = ("a network file system: another host can change it behind the overlay, and its change times "
            "are the server's, so a conflict could go unseen")
REFUSED_LOWERS: dict[int, tuple[str, str]] = {
    OVERLAYFS_MAGIC: ("overlayfs", "it is an overlay already, whose own layers can change under a second one; "
                                   "name the directory it is built from"),
    0x6969: ("nfs", _NETWORK),
    0xFF534D42: ("cifs", _NETWORK),
    0xFE534D42: ("smb2", _NETWORK),
    0x517B: ("smb", _NETWORK),
    0x00C36400: ("ceph", _NETWORK),
    0x6B414653: ("afs", _NETWORK),
    0x5346414F: ("afs", _NETWORK),
    0x01021997: ("9p", _NETWORK),
    0x65735546: ("fuse", "a FUSE file system: its server decides what every read and every change time says, "
                         "so neither the change set nor a conflict check could be trusted"),
    0x4D44: ("vfat", "it keeps no change time, which the conflict check relies on"),
    0x2011BAB0: ("exfat", "it keeps no change time, which the conflict check relies on"),
    0x9FA0: ("proc", "a kernel interface, not files"),
    0x62656572: ("sysfs", "a kernel interface, not files"),
}
# Upper (state) file systems that cannot hold overlay's attributes or are refused by overlayfs.
REFUSED_UPPERS = {OVERLAYFS_MAGIC, 0x6969, 0xFF534D42, 0xFE534D42, 0x517B, 0x65735546, 0x4D44, 0x2011BAB0}


class Layers(Record):
    """One overlay of a review session: which host directory it covers, where its layers are, and
    the facts taken before it was mounted that the conflict check compares the host with."""

    root: str                   # the lower: the host directory's real path, where the sandbox sees it
    upper: str                  # the change set
    work: str                   # overlayfs's own scratch directory (same file system as upper)
    userxattr: bool             # overlay's attributes are user.overlay.* (rootless) or trusted.overlay.*
    root_dev: int               # the lower's identity when the layers were made
    root_ino: int
    started_ns: int             # CLOCK_REALTIME_COARSE then (started_now; review.conflicts)
    # The checkpoint layers under the upper, oldest first (review.checkpoints): read-only lower
    # layers between the upper and the host, each a former upper directory.
    checkpoints: tuple[str, ...] = ()

    @property
    def xattr_prefix(self) -> str:
        return USER_PREFIX if self.userxattr else TRUSTED_PREFIX

    @property
    def stack(self) -> tuple[str, ...]:
        """The layers sandboxd owns, top down: the upper, then the checkpoints newest first (the
        host directory is below them all). ``review.upper.UpperEntry.layer`` indexes this."""
        return (self.upper, *reversed(self.checkpoints))


class _Statfs(ctypes.Structure):
    # struct statfs on 64-bit Linux: f_type is the first word; the rest is read as padding.
    _fields_ = [("f_type", ctypes.c_long), ("rest", ctypes.c_byte * 112)]


def filesystem_type(fd: int) -> int:
    """statfs(2)'s f_type of the file system ``fd`` (an O_PATH descriptor will do) is on."""
    buf = _Statfs()
    if libc.fstatfs(ctypes.c_int(fd), ctypes.byref(buf)) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))
    return int(buf.f_type) & 0xFFFFFFFF


def check_lower(fd: int, path: str) -> None:
    """Refuse ``path`` (opened as ``fd``) as a lower layer, with the reason, where review mode
    cannot trust it (REFUSED_LOWERS)."""
    refused = REFUSED_LOWERS.get(filesystem_type(fd))
    if refused is not None:
        name, why = refused
        raise InvalidPolicy(f"review mode cannot cover {path!r}: it is on {name}, {why}")


def check_upper(fd: int, path: str, *, userxattr: bool) -> None:
    """Refuse a review directory whose file system overlayfs cannot use as an upper layer, or that
    cannot hold overlay's attributes (trusted.* as root, user.* rootless: tmpfs holds user.* only
    from Linux 6.6): found by setting one on ``fd``'s directory, so the mount never fails on it."""
    kind = filesystem_type(fd)
    if kind in REFUSED_UPPERS:
        raise InvalidPolicy(f"review directory {path!r} is on a file system overlayfs cannot write its upper "
                            f"layer to ({REFUSED_LOWERS.get(kind, ('type %#x' % kind, ''))[0]}): "
                            "put it on a local disk")
    name = (USER_PREFIX if userxattr else TRUSTED_PREFIX) + "sandboxd-probe"
    try:
        os.setxattr(fd, name, b"1")
        os.removexattr(fd, name)
    except OSError as exc:
        raise InvalidPolicy(f"review directory {path!r} cannot hold overlayfs's {name.split('.')[0]}.* "
                            f"attributes ({os.strerror(exc.errno or errno.EIO)}): put it on ext4, xfs or btrfs"
                            ) from None


def rootless_supported(release: str | None = None) -> bool:
    """Unprivileged overlayfs (in a user namespace) exists from Linux 5.11."""
    text = release if release is not None else os.uname().release
    numbers = []
    for part in text.split(".")[:2]:
        digits = ""
        for ch in part:
            if not ch.isdigit():
                break
            digits += ch
        numbers.append(int(digits or 0))
    return tuple(numbers) >= ROOTLESS_MIN_KERNEL


def started_now(lower: os.stat_result) -> int:
    """The conflict check's time origin: CLOCK_REALTIME_COARSE now. A change time the kernel sets
    later is never below it: file systems take "now" from that coarse clock (or, with multigrain
    timestamps, a finer one that is never behind it). On a file system that keeps whole seconds
    (ext4 with 128-byte inodes, ext3) it is floored to the second, as the kernel floors its ctimes:
    judged from the lower's root, whose timestamps then all have zero nanoseconds (a file system
    with nanoseconds whose three happen to be zero is floored too: a false alarm at worst)."""
    now = time.clock_gettime_ns(CLOCK_REALTIME_COARSE)
    if all(stamp % 1_000_000_000 == 0 for stamp in (lower.st_atime_ns, lower.st_mtime_ns, lower.st_ctime_ns)):
        now -= now % 1_000_000_000
    return now


def make_review_dir(path: str) -> None:
    """The directory that holds a review session's layers: made 0700 (its parent must exist), or an
    empty directory of this user's that is not a symlink. Nothing else may reach it: the sandbox
    must never see its own change set, nor another user anyone's."""
    try:
        os.mkdir(path, 0o700)
        return
    except FileExistsError:
        pass
    except OSError as exc:
        raise InvalidPolicy(f"cannot make review directory {path!r}: {os.strerror(exc.errno or errno.EIO)}") from None
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or os.listdir(path):
        raise InvalidPolicy(f"review directory {path!r} exists and is not an empty directory of yours: "
                            "name a new one")
    os.chmod(path, 0o700)


def make_layers(review_dir: str, index: int, root: str, root_fd: int, *, userxattr: bool) -> Layers:
    """The upper and work directories of root number ``index`` under ``review_dir`` (made by
    make_review_dir), checked usable; ``root_fd`` is the descriptor the root was opened and checked
    on. The upper directory gets the root's owner and mode: an overlay's top directory shows its
    upper directory's attributes, and the sandbox must see the root's own."""
    check_lower(root_fd, root)
    lower = os.fstat(root_fd)
    if not stat.S_ISDIR(lower.st_mode):
        raise InvalidPolicy(f"review mode covers directories: writable root {root!r} is a file")
    started = started_now(lower)                # before the overlay exists: nothing was changed through it
    base = f"{review_dir}/{index}"
    os.mkdir(base, 0o700)
    upper, work = f"{base}/upper", f"{base}/work"
    os.mkdir(upper, 0o700)
    os.mkdir(work, 0o700)
    fd = os.open(upper, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        check_upper(fd, review_dir, userxattr=userxattr)
        if os.geteuid() == 0:
            os.fchown(fd, lower.st_uid, lower.st_gid)
        os.fchmod(fd, stat.S_IMODE(lower.st_mode))
    finally:
        os.close(fd)
    return Layers(root=root, upper=upper, work=work, userxattr=userxattr, root_dev=lower.st_dev,
                  root_ino=lower.st_ino, started_ns=started)


def make_session_dir(base: str, name: str) -> tuple[str, bool]:
    """A daemon session's review directory ``base/name`` (base: under the state directory, made
    0700 root here if missing): made 0700, or the one an earlier build of the session left (a
    rebuild after a restart or a discard reuses its layers). Returns it and whether it holds the
    layers' record already (False: new; remove it if the build fails)."""
    for path in (base, f"{base}/{name}"):
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            st = os.lstat(path)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o077:
                raise InvalidPolicy(f"review directory {path!r} is not a directory of the daemon's own, mode 0700: "
                                    "move it away") from None
        except OSError as exc:
            raise InvalidPolicy(f"cannot make review directory {path!r}: {os.strerror(exc.errno or errno.EIO)}"
                                ) from None
    path = f"{base}/{name}"
    return path, os.path.lexists(f"{path}/{LAYERS_FILE}")


def remove_if_unchanged(review_dir: str) -> bool:
    """Remove a closed session's review directory when no layer holds anything (nothing to apply or
    keep); True if it was removed. The sandbox must be gone (its overlays unmounted). A checkpoint
    layer holds changes too (review.checkpoints): each the record names is looked into, and one on
    disk that it does not name (a checkpoint cut short froze the upper before the record said so)
    keeps the directory whatever it holds."""
    try:
        layers = load(review_dir)
        if any(os.listdir(path) for layer in layers for path in layer.stack) or \
                any(_unrecorded_checkpoints(layer) or _top_changed(layer) for layer in layers):
            return False
        remove_layers(review_dir)
    except FileNotFoundError:
        return False
    return True


def _top_changed(layer: Layers) -> bool:
    """Whether a layer's top directory (what the sandbox sees of the root: a chmod or chown of the
    root itself) differs from the host root's mode or owner; True as well when the root is not the
    directory the layers were made over (keeping is the safe side)."""
    try:
        host = os.stat(layer.root, follow_symlinks=False)
    except OSError:
        return True
    if (host.st_dev, host.st_ino) != (layer.root_dev, layer.root_ino):
        return True
    wanted = (stat.S_IMODE(host.st_mode), host.st_uid, host.st_gid)
    for path in layer.stack:
        top = os.stat(path, follow_symlinks=False)
        if (stat.S_IMODE(top.st_mode), top.st_uid, top.st_gid) != wanted:
            return True
    return False


def _unrecorded_checkpoints(layer: Layers) -> bool:
    try:
        on_disk = os.listdir(f"{os.path.dirname(layer.upper)}/{CHECKPOINTS_DIR}")
    except FileNotFoundError:
        return False
    return bool(set(on_disk) - {os.path.basename(path) for path in layer.checkpoints})


def reuse_layers(review_dir: str, roots: "tuple[str, ...]", descriptors: "dict[str, int]") -> "dict[str, Layers]":
    """The layers an earlier build of the same session made (its record in ``review_dir``), for the
    same roots, each still the very directory it was (device and inode: a root replaced on the host
    since would have its change set applied to another directory): the rebuilt sandbox sees the
    same upper layers, so pending changes survive a restart. Refused, saying why, otherwise."""
    kept = {layer.root: layer for layer in load(review_dir)}
    if sorted(kept) != sorted(roots):
        raise InvalidPolicy(f"the session's writable roots are not those its change set in {review_dir!r} was made "
                            f"for ({', '.join(sorted(kept))}): apply or discard its changes first")
    for root in roots:
        st = os.fstat(descriptors[root])
        if (st.st_dev, st.st_ino) != (kept[root].root_dev, kept[root].root_ino):
            raise InvalidPolicy(f"{root!r} was replaced or moved on the host since the session started: its change "
                                f"set is kept in {review_dir!r} and cannot be laid over another directory")
        check_lower(descriptors[root], root)
    return {root: kept[root] for root in roots}


def save(review_dir: str, layers: "list[Layers]") -> None:
    """Write the layers' record beside them (written aside, renamed into place): what an apply after
    the sandbox is gone, or after a daemon restart, starts from."""
    write_aside(review_dir, LAYERS_FILE, record_text(layers).encode(), reserve=True)


def write_aside(directory: str, name: str, data: bytes, *, reserve: bool = False) -> None:
    """``directory``/``name`` holds ``data`` (0600): written beside it, synced, renamed into place,
    so a reader (or a restart after a crash) finds the old record or the new one, never half.
    ``reserve``: written over one of a bounded store's reserves in ``directory``
    (kernel.review_space.RESERVES) when there is one and ``data`` fits it, so it needs no new
    space, which the sandbox may have taken already; padded with white space (JSON ignores it) to
    the reserve's size, it gives no page back to the sandbox either. The record it replaces (a
    former reserve, its pages all taken) becomes a reserve again: the next save finds one too."""
    temporary = f"{directory}/.{name}.new"
    taken = False
    if reserve:
        from sandboxd.kernel.review_space import RESERVE_BYTES, RESERVES

        if len(data) <= RESERVE_BYTES:
            for spare in RESERVES:
                try:
                    os.rename(f"{directory}/{spare}", temporary)
                    taken = True
                    break
                except FileNotFoundError:
                    continue
        if taken:
            data = data.ljust(RESERVE_BYTES)
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | (0 if taken else os.O_TRUNC),
                 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    if taken:
        _replace_keeping_reserve(directory, f".{name}.new", name)
    else:
        os.rename(temporary, f"{directory}/{name}")


def _replace_keeping_reserve(directory: str, temporary: str, name: str) -> None:
    """Put ``temporary`` (written over a reserve) in ``name``'s place at once (exchanged: no page
    freed or taken), then keep the old record as a reserve when it is a whole one, else remove it."""
    from sandboxd.kernel import beneath, review_space
    from sandboxd.kernel.review_space import RESERVES

    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        try:
            beneath.exchange(dir_fd, temporary, name)
        except FileNotFoundError:                   # the first save: nothing to keep
            os.rename(temporary, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            return
        free = [spare for spare in RESERVES if beneath.lstat_at(dir_fd, spare) is None]
        if free and review_space.is_whole_reserve(f"{directory}/{temporary}"):
            os.rename(temporary, free[0], src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        else:
            os.unlink(temporary, dir_fd=dir_fd)
    finally:
        os.close(dir_fd)


def record_text(layers: "list[Layers]") -> str:
    """``json.dumps([layer.as_dict() ...], sort_keys=True)``, the same text, without importing json:
    its import (re and enum with it) costs a `sandboxd run --review -- true` more than the rest of
    review mode's set-up. Strings go through the C encoder json itself uses."""
    from _json import encode_basestring_ascii as quoted

    def value(item: object) -> str:
        if isinstance(item, bool):
            return "true" if item else "false"
        if isinstance(item, tuple):                 # Layers.checkpoints
            return "[" + ", ".join(value(inner) for inner in item) + "]"
        return str(item) if isinstance(item, int) else quoted(str(item))
    fields = (", ".join(f"{quoted(name)}: {value(item)}" for name, item in sorted(layer.as_dict().items()))
              for layer in layers)
    return "[" + ", ".join("{" + text + "}" for text in fields) + "]"


def load(review_dir: str) -> "list[Layers]":
    import json

    fd = os.open(f"{review_dir}/{LAYERS_FILE}", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        raw = json.loads(os.read(fd, 1 << 20))
    finally:
        os.close(fd)
    # A record written before checkpoints existed has no "checkpoints": none.
    return [Layers(root=item["root"], upper=item["upper"], work=item["work"], userxattr=item["userxattr"],
                   root_dev=item["root_dev"], root_ino=item["root_ino"], started_ns=item["started_ns"],
                   checkpoints=tuple(item.get("checkpoints", ()))) for item in raw]


def mount_over(target: str, *, lower_fd: int, upper_fd: int, work_fd: int, userxattr: bool, shown: str,
               checkpoint_fds: "tuple[int, ...]" = ()) -> None:
    """Mount the overlay at ``target`` (nosuid, nodev), its layers given by descriptors opened in
    this mount namespace (overlayfs refuses a layer whose mount is in another). ``lower_fd``: the
    root attached at ``target`` already, which the overlay then covers. ``checkpoint_fds``: the
    checkpoint layers, oldest first (Layers.checkpoints), stacked between the upper and the root.
    ``shown``: the path errors name (the root as the user knows it, not the staging path)."""
    if len(checkpoint_fds) > MAX_CHECKPOINTS:
        raise SetupError(STEP, errno.E2BIG, shown, hint=f"more than {MAX_CHECKPOINTS} checkpoint layers")
    lowers = ":".join(f"/proc/self/fd/{fd}" for fd in (*reversed(checkpoint_fds), lower_fd))
    data = (f"lowerdir={lowers},upperdir=/proc/self/fd/{upper_fd},"
            f"workdir=/proc/self/fd/{work_fd},{OPTIONS}" + (",userxattr" if userxattr else ""))
    if len(data) > MAX_OPTIONS:
        raise SetupError(STEP, errno.E2BIG, shown, hint=f"the overlay's options are {len(data)} bytes, over one page")
    result = libc.mount(fsencode("sandboxd-review"), fsencode(target), fsencode("overlay"),
                        ctypes.c_ulong(MS_NOSUID | MS_NODEV), fsencode(data))
    if result != 0:
        code = ctypes.get_errno()
        raise SetupError(STEP, code, shown, hint=_hint(code, userxattr))


def _hint(code: int, userxattr: bool) -> str:
    if code in (errno.EPERM, errno.EACCES) and userxattr:
        return "the kernel refused an overlay in a user namespace: it needs Linux 5.11 or later; run as root"
    if code in (errno.EPERM, errno.EACCES):
        return "mounting was refused: sandboxd needs CAP_SYS_ADMIN (root)"
    if code == errno.ENODEV:
        return "this kernel has no overlayfs (modprobe overlay, or CONFIG_OVERLAY_FS)"
    if code == errno.ELOOP:
        return "the review directory and the root overlap: keep the state directory out of every workspace"
    return "the kernel refused the overlay (its reason is in the kernel log, 'overlayfs:' lines)"


def upper_is_empty(upper_fd: int, root: str, checkpoints: "tuple[str, ...]" = ()) -> bool:
    """Whether the overlay whose upper layer is open as ``upper_fd`` changed nothing of the host
    directory ``root``: no checkpoint layer (``checkpoints``, Layers.checkpoints: each holds changes
    of its own, so any answers "changed", the safe side), no entry in the upper layer, and its top
    directory (which the overlay's top shows, and a chmod or chown there copies up to) with the
    root's own mode and owner. One directory read: no attribute, nothing of the host's tree."""
    if checkpoints:
        return False
    with os.scandir(upper_fd) as listing:
        if next(listing, None) is not None:
            return False
    mine, host = os.fstat(upper_fd), os.stat(root)
    return (stat.S_IMODE(mine.st_mode), mine.st_uid, mine.st_gid) == \
        (stat.S_IMODE(host.st_mode), host.st_uid, host.st_gid)


def remove_layers(review_dir: str) -> None:
    """Remove a review session's layers for good (discarded, expired). overlayfs leaves its work
    directory's inner ``work`` with mode 000: made searchable first, so a plain user (rootless)
    can remove what it made. A bounded store (kernel.review_space) is emptied, then unmounted.
    The record goes first: a removal cut short (a SIGKILL, a reboot) leaves a directory without
    one, which nothing takes for a change set and the daemon's sweep removes (service.review_expiry)."""
    from sandboxd.kernel import beneath, review_space

    fd = os.open(review_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        try:
            os.unlink(LAYERS_FILE, dir_fd=fd)
        except FileNotFoundError:
            pass
        for name in os.listdir(fd):
            try:                                # beneath the directory's descriptor: no symlink followed
                inner = beneath.open_beneath(fd, f"{name}/work/work", os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW)
            except OSError:
                continue
            try:
                os.chmod(f"/proc/self/fd/{inner}", 0o700)      # mode 000: an O_PATH descriptor, by its link
            finally:
                os.close(inner)
        for name in os.listdir(fd):
            beneath.remove_tree(fd, name)
    finally:
        os.close(fd)
    review_space.release(review_dir)
    os.rmdir(review_dir)


def root_attributes(layers: Layers, refused: str) -> os.stat_result:
    """The host root's attributes, read from a descriptor checked to be the very directory the
    layers were made over (never through a name that may have been swapped since); InvalidPolicy
    ending in ``refused`` (what is not done) when it is another."""
    fd = os.open(layers.root, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    if (st.st_dev, st.st_ino) != (layers.root_dev, layers.root_ino):
        raise InvalidPolicy(f"{layers.root!r} is not the directory the session started on (it was replaced or "
                            f"moved on the host): {refused}")
    return st
