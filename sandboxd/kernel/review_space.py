"""Review mode's disk bound: a review directory is a tmpfs of its own whose ``size=`` is the
session's share, so a sandbox writing past it gets ENOSPC from the kernel, inside the sandbox,
and nothing else (the daemon, the runner, other sessions) notices.

Why a tmpfs (docs/review-mode.md, "The disk bound", has the whole comparison): it is the one bound
that works wherever review mode does, the 6.1 guest included (no loop devices, /var an overlay over
tmpfs), needs one mount(2) and no helper program (the daemon never forks), and is exact whoever
writes: overlayfs writes the upper layer with its mounter's credentials (root's), and root's
CAP_SYS_RESOURCE passes an ext4 project quota's hard limit and a disk's root reserve, never a
tmpfs's size. It lives in the host's mount namespace, so it survives the runner's exit, a daemon
restart and a SIGKILL; not a reboot. It is memory (and swap): the pages are charged to the memory
cgroup of the sandbox that wrote them (a session's store counts in its memory limit) and, like page
cache, stay charged to it once it is removed, counted in its parent's until freed.

The per-owner bound: a new store's size is the smaller of the session's bound and what the owner's
other stores leave of the owner's (``share``); ``seal`` shrinks a store whose sandbox is gone to
what it holds, its bytes and its inodes, giving the rest back. What a store takes of the owner's
bound (``charge``, ``reserved``) is its bytes and its inodes' kernel memory: tmpfs keeps each inode
(an empty file, a directory, a whiteout) in unswappable memory, INODE_CHARGE bytes, with no page,
so a bound on bytes alone let empty files hold memory nobody counted. The fork server sums what an
owner's stores take (``owner_stores``), reading /proc/self/mountinfo once.

Small reserve files (``RESERVES``) are made with the store, outside the share: the records a store
keeps (kernel.overlay.save's layers, review.checkpoints's list) are written into their pages, and
the record each replaces becomes the next reserve (kernel.overlay.write_aside), so a sandbox that
filled its store cannot stop its own change set being recorded, at the first save or any later one.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat

from sandboxd._record import Record
from sandboxd.errors import Exhausted, InvalidPolicy, SetupError
from sandboxd.kernel import mounts, paths
from sandboxd.kernel._libc import fsencode, libc
from sandboxd.kernel.overlay import TRUSTED_PREFIX
from sandboxd.policy.limits import DEFAULT_REVIEW_SESSION_BYTES

STEP = "mount review store"
SOURCE = "sandboxd-review"              # the mount's source, as /proc/self/mountinfo names it
PAGE = 4096
MIN_SHARE = 1 << 20                     # a smaller share holds nothing useful: refused instead
INODE_BYTES = PAGE                      # one inode per page of the bound: every file takes a page anyway;
                                        # directories and whiteouts (deletions) count too
MIN_INODES = 1024
INODE_CHARGE = 1024                     # unswappable kernel memory of one tmpfs inode and its dentry (measured:
                                        # 100,000 empty files, Slab +96 MiB); what each inode a store may hold
                                        # takes of the owner's review.owner_bytes
RESERVE = ".sandboxd-reserve"           # pages the records are written into (kernel.overlay.write_aside)
# Three: the layers' record and the checkpoints' each take one at their first save, and one stays
# spare, which each later save takes while the record it replaces becomes the spare.
RESERVES = (RESERVE, RESERVE + "-2", RESERVE + "-3")
RESERVE_BYTES = 64 << 10
RESERVE_INODES = 16                     # slack for the reserves and the layers' first directories
# Inodes held for mounting the session's overlays: overlayfs makes a file and a whiteout in its
# work directory at each mount (its rename-whiteout check), so a store whose sandbox took every
# inode could not be mounted again (a rebuild after a checkpoint, a discard, a restart). Empty
# files in LENT_DIR, removed just before a build mounts the overlays and made again as soon as it
# is done (``lend_inodes``, ``settle_inodes``): the sandbox runs no command in between.
LENT_DIR = ".sandboxd-inodes"
LENT_INODES = 8
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class Store(Record):
    """A review directory and its bound in bytes (0: none, review.session_bytes = 0)."""

    path: str
    size: int


def inodes_for(size: int) -> int:
    """The inodes (``nr_inodes=``) a store of ``size`` bytes may hold: those its sandbox may
    take, and the store's own (reserves, directories, LENT_DIR and the inodes it holds)."""
    return max(MIN_INODES, size // INODE_BYTES) + RESERVE_INODES + LENT_INODES + 1


def charge(size: int, inodes: int | None = None) -> int:
    """What a store of ``size`` bytes and ``inodes`` inodes (default: ``inodes_for(size)``) takes
    of its owner's review.owner_bytes: its bytes and its inodes' kernel memory."""
    return size + (inodes_for(size) if inodes is None else inodes) * INODE_CHARGE


def share(session_bytes: int, owner_bytes: int, owner_total: int) -> int:
    """A new session's bound in bytes: the session's, or the most whose ``charge`` fits in what the
    owner's stores (``owner_total`` charged now) leave of ``owner_bytes``, whichever is smaller.
    RESOURCE_EXHAUSTED when that is under MIN_SHARE."""
    left = owner_bytes - owner_total
    if charge(session_bytes) <= left:
        return session_bytes
    # The charge is linear in the size above MIN_INODES pages, constant below: the largest fitting
    # size is one of these two.
    own = inodes_for(0) - MIN_INODES            # the store's own inodes, whatever its size
    linear = (left - own * INODE_CHARGE) * INODE_BYTES // (INODE_BYTES + INODE_CHARGE)
    flat = left - inodes_for(0) * INODE_CHARGE
    fitting = [size - size % PAGE for size in (linear, flat) if size > 0 and charge(size - size % PAGE) <= left]
    size = max(fitting, default=0)
    if size < MIN_SHARE:
        raise Exhausted(f"review: this owner's review stores hold {owner_total >> 20} MiB of the "
                        f"{owner_bytes >> 20} MiB review.owner_bytes allows (their bytes and their files' "
                        "kernel memory): apply or discard kept change sets")
    return size


def make_store(path: str, *, session_bytes: int, owner_bytes: int, owner_total: int) -> Store:
    """The daemon's session code calls this to make a review session's directory ``path`` (under
    the state directory; its parent exists): made 0700 (kernel.overlay.make_review_dir), then bound
    to ``share(session_bytes, owner_bytes, owner_total)`` bytes. ``session_bytes`` 0: the limit is
    off by configuration, and the directory is a plain one on the state directory's disk.
    Raises Exhausted (the owner's share is used up), SetupError (the kernel refused the tmpfs), or
    InvalidPolicy (the directory); on any of them nothing is left. Free it with ``free``."""
    from sandboxd.kernel import overlay

    size = share(session_bytes, owner_bytes, owner_total) if session_bytes else 0
    overlay.make_review_dir(path)
    if size:
        try:
            bound(path, size)
        except BaseException:
            os.rmdir(path)
            raise
    return Store(path=path, size=size)


def bound_run(path: str, size_text: object) -> None:
    """`sandboxd run --review=keep:DIR [--review-bytes=SIZE]`: root's DIR (just made, empty) is
    bounded to SIZE (default: review.session_bytes's; 0: no bound, said on the command line). A plain user's
    DIR is its own directory, written with its own rights and counted in its own disk quota:
    nothing of root's to bound, and a SIZE for it is refused."""
    from sandboxd.policy.limits import parse_size

    if os.geteuid() != 0:
        if size_text is not None:
            raise InvalidPolicy("--review-bytes bounds root's review stores: a plain user's review directory is "
                                "its own, counted in its own disk quota")
        return
    text = DEFAULT_REVIEW_SESSION_BYTES if size_text is None else str(size_text)
    size = 0 if text.strip() == "0" else parse_size(text, "--review-bytes")
    if size:
        if size < MIN_SHARE:
            raise InvalidPolicy(f"--review-bytes={text}: a review store needs at least {MIN_SHARE >> 20} MiB")
        bound(path, size)


def bound(path: str, size: int) -> None:
    """Mount a tmpfs of ``size`` bytes (plus the reserve) on the empty review directory ``path``
    (root only: in this mount namespace, which should be the host's), then make the reserve. The
    directory is opened without following a link and checked to be root's, 0700 and empty, and the
    tmpfs mounted on that very directory (/proc/self/fd/N): a parent swapped for a symlink since it
    was made cannot move the mount elsewhere. The tmpfs is nosuid, nodev and noexec on the host
    (nothing in a change set runs there; the sandbox sees it through its overlay, whose own flags
    decide)."""
    inodes = inodes_for(size)
    flags = mounts.MS_NOSUID | mounts.MS_NODEV | mounts.MS_NOEXEC
    try:
        fd = os.open(path, DIR_FLAGS)
    except OSError as exc:
        raise InvalidPolicy(f"review directory {path!r} cannot be bounded: {os.strerror(exc.errno or errno.EIO)} "
                            "(it must be a directory, not a symlink)") from None
    try:
        st = os.fstat(fd)
        if st.st_uid != 0 or stat.S_IMODE(st.st_mode) != 0o700 or os.listdir(fd):
            raise InvalidPolicy(f"review directory {path!r} is not an empty directory of root's, mode 0700: name a new one")
        try:
            mounts.mount(SOURCE, f"/proc/self/fd/{fd}", "tmpfs", flags,
                         f"size={size + len(RESERVES) * RESERVE_BYTES},nr_inodes={inodes},mode=0700,uid=0,gid=0,huge=never", step=STEP)
        except SetupError as exc:
            raise SetupError(STEP, exc.errno, path, hint=_hint(exc.errno)) from None
    finally:
        os.close(fd)
    try:
        _probe_attributes(path)
        _make_reserve(path)
        os.mkdir(f"{path}/{LENT_DIR}", 0o700)
        settle_inodes(path)
    except BaseException:
        release(path)
        raise


def _hint(code: int) -> str:
    if code in (errno.EPERM, errno.EACCES):
        return "bounding a review store needs root (CAP_SYS_ADMIN); review.session_bytes = 0 turns the bound off"
    if code == errno.ENODEV:
        return "this kernel has no tmpfs (CONFIG_SHMEM); review.session_bytes = 0 turns the bound off"
    return "the kernel refused the tmpfs; review.session_bytes = 0 turns the bound off"


def _probe_attributes(path: str) -> None:
    """overlayfs keeps its whiteouts and opaque marks as trusted.* attributes: a tmpfs without them
    (a kernel built without CONFIG_TMPFS_XATTR) cannot hold an upper layer."""
    name = TRUSTED_PREFIX + "sandboxd-probe"
    try:
        os.setxattr(path, name, b"1", follow_symlinks=False)
        os.removexattr(path, name, follow_symlinks=False)
    except OSError as exc:
        raise SetupError(STEP, exc.errno or errno.EIO, path,
                         hint="this kernel's tmpfs keeps no trusted.* attributes (CONFIG_TMPFS_XATTR), which "
                              "an overlay's upper layer needs; review.session_bytes = 0 turns the bound off") from None


def _make_reserve(path: str) -> None:
    for name in RESERVES:
        fd = os.open(f"{path}/{name}", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, bytes(RESERVE_BYTES))      # written, not sparse: its pages are taken now
        finally:
            os.close(fd)


def lend_inodes(path: str) -> bool:
    """Free the inodes a store (``path``) holds for mounting its overlays (LENT_DIR), just before a
    build mounts them; False (nothing done) when ``path`` is no store. ``settle_inodes`` takes
    them back once the build is done or failed, before its sandbox runs a command."""
    if not is_store(path):
        return False
    fd = os.open(f"{path}/{LENT_DIR}", DIR_FLAGS)
    try:
        for name in os.listdir(fd):
            os.unlink(name, dir_fd=fd)
    finally:
        os.close(fd)
    return True


def settle_inodes(path: str) -> None:
    """Hold LENT_INODES inodes of the store ``path`` again for the next mount (as many as are
    free: a mount frees what it took, so all of them after a build)."""
    fd = os.open(f"{path}/{LENT_DIR}", DIR_FLAGS)
    try:
        for index in range(LENT_INODES):
            try:
                os.close(os.open(str(index), os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                                 dir_fd=fd))
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                break
    finally:
        os.close(fd)


def is_store(path: str) -> bool:
    """Whether ``path`` (its last component not followed) is a bounded review store: the root of a
    tmpfs mounted as SOURCE."""
    try:
        fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        return _is_store_root(fd)
    finally:
        os.close(fd)


def _is_store_root(fd: int, table: "dict[str, list[str]] | None" = None) -> bool:
    """Whether ``fd`` is the root of a store; ``table``: /proc/self/mountinfo read once already
    (paths.mount_table), for a caller asking about many."""
    fields = paths.mount_fields(fd) if table is None else table.get(paths.mount_id_of(fd) or "")
    if not fields or "-" not in fields or fields[3] != "/":
        return False
    if fields[fields.index("-") + 1:][:2] != ["tmpfs", SOURCE]:
        return False
    parent = os.open("..", os.O_PATH | os.O_CLOEXEC, dir_fd=fd)
    try:
        return os.fstat(parent).st_dev != os.fstat(fd).st_dev      # the mount's root, not a directory in it
    finally:
        os.close(parent)


def reserved(path: str, table: "dict[str, list[str]] | None" = None) -> int:
    """What the store at ``path`` takes of its owner's review.owner_bytes (0: not a store): its
    bound in bytes (the reserves not counted) and its bound in inodes, each INODE_CHARGE.
    ``table``: /proc/self/mountinfo read once (paths.mount_table; ``owner_stores`` passes it)."""
    try:
        fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return 0
    try:
        if not _is_store_root(fd, table):
            return 0
        st = os.fstatvfs(fd)
    finally:
        os.close(fd)
    return charge(max(0, st.f_blocks * st.f_frsize - len(RESERVES) * RESERVE_BYTES), st.f_files)


def owner_stores(candidates: "list[str]") -> tuple[int, int]:
    """How many of ``candidates`` (an owner's review directories) are stores, and what they take of
    the owner's bound together (``reserved``): /proc/self/mountinfo read once for all of them, so
    the cost is O(stores + mounts), not their product."""
    table = paths.mount_table()
    charges = [reserved(path, table) for path in candidates]
    return sum(1 for item in charges if item), sum(charges)


def used(path: str) -> int:
    """Bytes the store at ``path`` holds (whole pages, its reserves and the records in them not
    counted)."""
    st = os.statvfs(path)
    return max(0, (st.f_blocks - st.f_bfree) * st.f_frsize - len(RESERVES) * RESERVE_BYTES)


def inodes_used(path: str) -> int:
    """Inodes the store at ``path`` holds (its own included: reserves, directories, LENT_DIR)."""
    st = os.statvfs(path)
    return st.f_files - st.f_ffree


def seal(path: str, slack: int = 0) -> int:
    """Shrink the store at ``path`` to what it holds now plus ``slack`` bytes, and its inodes to
    those in use plus one per INODE_BYTES of ``slack`` (at least RESERVE_INODES), once nothing
    writes to it (its sandbox is gone, the change set is kept): the rest of its bound goes back to
    the owner's share. Returns what it takes now (``reserved``). A store that grew meanwhile keeps
    its bound (the remount is refused; nothing lost)."""
    size = max(used(path) + slack, PAGE)
    inodes = inodes_used(path) + max(RESERVE_INODES, slack // INODE_BYTES)
    try:
        mounts.mount(None, path, None, mounts.MS_REMOUNT | mounts.MS_NOSUID | mounts.MS_NODEV | mounts.MS_NOEXEC,
                     f"size={size + len(RESERVES) * RESERVE_BYTES},nr_inodes={inodes}", step=STEP)
    except SetupError:
        pass
    return reserved(path)


def check_room(path: str, *, inodes: int, records: "tuple[str, ...]", what: str) -> None:
    """Refuse (RESOURCE_EXHAUSTED, saying what to do) to ``what`` (a checkpoint, a rollback: work
    that makes ``inodes`` entries in the store at ``path`` and then saves ``records``, the names of
    its record files, in that order, each with kernel.overlay.write_aside's reserve) when the store
    has not the room: fewer free inodes, or a save finding no reserve and no free pages for it.
    Called before anything is changed, with nothing else writing the store (its sandbox's overlays
    unmounted), so what it finds holds until the work is done. Nothing on a directory that is no
    store (review.session_bytes = 0: the disk's own bound decides)."""
    if not is_store(path):
        return
    st = os.statvfs(path)
    spares = sum(1 for name in RESERVES if os.path.lexists(f"{path}/{name}"))
    whole = {name for name in set(records) if is_whole_reserve(f"{path}/{name}")}
    pages = 0
    for name in records:                # as write_aside goes: a spare taken, the record replaced given back
        if spares:
            spares -= 0 if name in whole else 1
            whole.add(name)
        else:
            pages += RESERVE_BYTES // PAGE
    if st.f_ffree < inodes or st.f_bavail < pages:
        full = "inodes (its files, directories and deletions)" if st.f_ffree < inodes else "bytes"
        raise Exhausted(f"review: this session's change set fills its store (all its {full}), so {what} could "
                        "not be recorded: discard some changes (sandboxctl discard SESSION PATH...) or apply them, "
                        "then try again. Nothing was changed")


def is_whole_reserve(path: str) -> bool:
    """Whether the file at ``path`` is a reserve's size with every page taken (a record written over
    a reserve, which becomes a reserve again when replaced)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_size == RESERVE_BYTES and st.st_blocks * 512 >= RESERVE_BYTES


def release(path: str) -> None:
    """Unmount the store at ``path`` (kernel.overlay.remove_layers calls this once the layers are
    removed, so its memory is already free), checked to be one by its descriptor and unmounted
    through it; nothing when ``path`` is no store. A sandbox still holding it (a mount namespace
    that copied it) keeps only an empty tmpfs, which goes with that namespace."""
    try:
        fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    try:
        if not _is_store_root(fd):
            return
        target = fsencode(f"/proc/self/fd/{fd}")
        if libc.umount2(target, ctypes.c_int(0)) == 0:
            return
        code = ctypes.get_errno()
        if code == errno.EBUSY and libc.umount2(target, ctypes.c_int(mounts.MNT_DETACH)) == 0:
            return
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), path)
    finally:
        os.close(fd)


def free(store: Store) -> None:
    """Remove a store for good (discarded, applied in full, expired): its layers, its tmpfs, its
    directory (kernel.overlay.remove_layers)."""
    from sandboxd.kernel import overlay

    overlay.remove_layers(store.path)
