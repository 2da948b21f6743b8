"""Apply and discard a change set, per path or all.

``apply`` writes the selected changes of a Comparison (review.changes) into the host directory.
It is meant to run in a child that has dropped to the session owner's uid, gid and groups (never
root: the kernel's permissions then decide what it may write, as they did for the sandbox), and
it is safe against a host path swapped meanwhile:

* every host path is reached beneath the host directory's descriptor with kernel.beneath.STRICT:
  a component that became a symlink (to /etc, to the owner's ~/.ssh) or a mount point is refused
  (ELOOP, EXDEV), never followed; the last name is used only with calls that do not follow it
  (openat O_CREAT|O_EXCL|O_NOFOLLOW of a new name, renameat, unlinkat, a descriptor's chmod);
* each file is written beside its place (a new name, O_EXCL) and renamed over it: nobody sees
  half a file; a directory replaced or deleted is renamed aside first, then removed without
  following anything (kernel.beneath.remove_tree);
* the upper entry must still be the one listed (inode, ctime, size), and its content the SHA-256
  listed, else it is skipped as changed since (a sandbox still writing);
* a conflict (review.conflicts) is skipped unless ``force``; a flagged change (review.rules)
  unless its path is in ``include_flagged``; the descendants of a directory change that was
  skipped are skipped too.

Modes are preserved (set-ID bits only on an included flagged change, since a set-ID file is
always flagged); an owner other than the applier's is kept where the kernel lets it (chown to
oneself, or a group one is in), else the change says so.

``discard`` removes entries from an upper layer. overlayfs does not allow its layers to change
while mounted: discard runs with the overlay unmounted (between calls, then mounted again), as do
the removals of what an apply landed (ApplyResult.forgettable).
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat

from sandboxd._record import Record
from sandboxd.errors import Exhausted
from sandboxd.kernel import beneath
from sandboxd.kernel._libc import libc
from sandboxd.review.changes import (CHUNK, DELETED, METADATA, OWNER, REPLACED, TYPE_CHANGED, Change, Comparison,
                                     check_layers, fingerprint)
from sandboxd.review.conflicts import Baseline, HostLookups
from sandboxd.review.upper import DIR, FILE, OTHER, SYMLINK, UpperEntry, kind_of

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Callable

MAX_CHANGES = 100_000               # changes one apply takes at most (a bigger one is applied by path)
MAX_BYTES = 64 << 30                # hashed at most while listing what an apply takes
# Apparent sizes (holes counted) one apply writes at most: a sparse file costs the sandbox's store a
# few bytes whatever its size, and the host's disk is not the sandbox's to fill. Holes are kept, but
# a host file system without them (or a later copy) would hold every byte. Hard links count per name.
MAX_WRITTEN = 64 << 30
_ZEROS = bytes(CHUNK)


class Applied(Record):
    path: str
    kind: str
    sha256: str = ""                # a file's content, as written
    note: str = ""                  # what differs from the sandbox's (an owner the kernel did not allow)


class Skipped(Record):
    path: str
    reason: str


class ApplyResult(Record):
    applied: tuple[Applied, ...]
    skipped: tuple[Skipped, ...]
    created: tuple[str, ...]        # parent directories made so that a selected path had its place
    baseline: Baseline              # the conflict baseline after this apply (save it: conflicts.save_baseline)
    # Applied paths whose upper entries may now go (discard, overlay unmounted): nothing below them
    # was skipped.
    forgettable: tuple[str, ...]


class _Stale(Exception):
    """The upper entry is no longer the one listed."""


def _selected(path: str, paths: tuple[str, ...]) -> bool:
    return any(chosen == "" or path == chosen or path.startswith(chosen + "/") for chosen in paths)


def _below(path: str, top: str) -> bool:
    return top == "" or path == top or path.startswith(top + "/")


def _temporary_name() -> str:
    return f".sandboxd-apply-{os.urandom(8).hex()}"


def apply(comparison: Comparison, paths: tuple[str, ...] = ("",), *, reviewed: "dict[str, str] | None" = None,
          force: bool = False, include_flagged: frozenset[str] = frozenset(),
          max_written: int = MAX_WRITTEN) -> ApplyResult:
    """Apply the changes at ``paths`` and below ("": all) to the host (see the module's text).
    ``reviewed``: path -> the fingerprint (review.changes.fingerprint) of the change the person
    was shown; given, a change not among them, or whose fingerprint differs now, is skipped.
    ``max_written``: the files' apparent sizes this apply writes at most; a file past it is skipped."""
    listing = comparison.list(limit=MAX_CHANGES, max_hash_bytes=MAX_BYTES, under=paths[0] if len(paths) == 1 else "")
    if listing.next_after:
        raise Exhausted(f"the change set has more than {MAX_CHANGES} changes: apply it a directory at a time")
    changes = [change for change in listing.changes if _selected(change.path, paths)]
    applied: list[Applied] = []
    skipped: list[Skipped] = []
    created: list[str] = []
    blocked: list[str] = []                             # directory changes skipped: their contents wait
    written = 0                                         # apparent sizes of the files written so far
    for change in changes:
        reason = _refusal(change, blocked, reviewed, force=force, include_flagged=include_flagged) or \
            _past_bound(change, written, max_written)
        if not reason and _writes(change):
            written += change.size
        if not reason:
            try:
                applied.append(_apply_one(comparison, change, created))
                continue
            except _Stale:
                reason = "changed in the sandbox since it was listed: list it again"
            except OSError as exc:
                reason = _why(exc)
        skipped.append(Skipped(change.path, reason))
        if change.type == DIR or change.kind in (REPLACED, TYPE_CHANGED):
            blocked.append(change.path)
    if applied or created:
        libc.syncfs(comparison.host_fd)                 # once, not per file: the renames are what is atomic
    baseline = _baseline_after(comparison, [item.path for item in applied] + created)
    forgettable = tuple(item.path for item in applied
                        if item.path and not any(_below(skip.path, item.path) for skip in skipped))
    return ApplyResult(applied=tuple(applied), skipped=tuple(skipped), created=tuple(created), baseline=baseline,
                       forgettable=forgettable)


def _refusal(change: Change, blocked: list[str], reviewed: "dict[str, str] | None", *, force: bool,
             include_flagged: frozenset[str]) -> str:
    for top in blocked:
        if _below(change.path, top):
            return f"its directory {top or '(the root)'} was not applied"
    if change.flags and change.path not in include_flagged:
        return "flagged: " + "; ".join(change.flags)
    if change.conflict and not force:
        return f"conflict: {change.conflict}"
    if reviewed is not None:
        if change.path not in reviewed:
            return "not among the changes reviewed: review it, then apply it"
        # Either as hashed here or, for a file the listing left unhashed, as its upper entry then.
        if reviewed[change.path] not in (fingerprint(change), fingerprint(change, "")):
            return "changed since it was reviewed: review it again"
    return ""


def _writes(change: Change) -> bool:
    return change.type == FILE and change.kind not in (DELETED, METADATA)


def _past_bound(change: Change, written: int, max_written: int) -> str:
    if not _writes(change) or written + change.size <= max_written:
        return ""
    bound = f"the {_size(max_written)} (apparent sizes, holes counted) one apply writes at most"
    if change.size > max_written:
        return f"its size, {_size(change.size)}, is past {bound}"
    return f"its {_size(change.size)} would take this apply past {bound}: apply it by itself"


def _size(count: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if count >= 1 << shift and count % (1 << shift) == 0:
            return f"{count >> shift} {unit}"
    return f"{count} bytes"


def _why(exc: OSError) -> str:
    if exc.errno in (errno.ELOOP, errno.EXDEV):
        return "the host path goes through a symlink or another mount: refused, not followed"
    return os.strerror(exc.errno or errno.EIO)


def _apply_one(comparison: Comparison, change: Change, created: list[str]) -> Applied:
    host_fd = comparison.host_fd
    if change.path == "":
        return _set_attributes(comparison, host_fd, ".", change)
    parent, name = _host_parent(comparison, change.path, created)
    try:
        if change.kind == DELETED:
            _remove(parent, name)
            return Applied(change.path, change.kind)
        if change.kind == METADATA:
            return _set_attributes(comparison, parent, name, change)
        if change.type == FILE:
            return _write_file(comparison, parent, name, change)
        if change.type == SYMLINK:
            _replace_with(parent, name, lambda temporary: os.symlink(change.target, temporary, dir_fd=parent))
            return Applied(change.path, change.kind)
        if change.type == DIR:
            existing = beneath.lstat_at(parent, name)
            if existing is not None and (change.kind in (REPLACED, TYPE_CHANGED) or not stat.S_ISDIR(existing.st_mode)):
                _remove(parent, name)
                existing = None
            if existing is None:
                os.mkdir(name, 0o700, dir_fd=parent)
            return _set_attributes(comparison, parent, name, change, made=True)
        if change.type == OTHER and stat.S_ISFIFO(comparison.by_path[change.path].mode):
            _replace_with(parent, name, lambda temporary: os.mkfifo(temporary, 0o600, dir_fd=parent))
            return _set_attributes(comparison, parent, name, change, made=True)
        raise OSError(errno.EOPNOTSUPP, "only files, directories, symlinks and FIFOs are applied")
    finally:
        os.close(parent)


def _host_parent(comparison: Comparison, path: str, created: list[str]) -> tuple[int, str]:
    """The host directory that holds ``path`` (beneath the host's descriptor, STRICT) and its last
    name; a missing directory on the way is made when the sandbox has one there (its mode)."""
    parts = path.split("/")
    fd = beneath.open_beneath(comparison.host_fd, "", beneath.DIRECTORY)
    try:
        for index, part in enumerate(parts[:-1]):
            try:
                inner = beneath.open_beneath(fd, part, beneath.DIRECTORY)
            except FileNotFoundError:
                above = "/".join(parts[:index + 1])
                entry = comparison.by_path.get(above)
                if entry is None or entry.kind != DIR:
                    raise
                os.mkdir(part, 0o700, dir_fd=fd)
                inner = beneath.open_beneath(fd, part, beneath.DIRECTORY)
                _chmod(inner, stat.S_IMODE(entry.mode))
                created.append(above)
            os.close(fd)
            fd = inner
    except BaseException:
        os.close(fd)
        raise
    return fd, parts[-1]


def _chmod(fd: int, mode: int) -> None:
    """chmod of the object ``fd`` is open on (an O_PATH descriptor will do): through its /proc link,
    which names that very inode."""
    os.chmod(f"/proc/self/fd/{fd}", mode)


def _set_attributes(comparison: Comparison, parent: int, name: str, change: Change, *, made: bool = False) -> Applied:
    """Mode (set-ID bits as the sandbox left them: an apply of a flagged change is named by the
    person) and, where the kernel allows it, owner of the host's ``name``, which must be of the
    sandbox's type."""
    fd = beneath.open_beneath(parent, name, os.O_PATH | os.O_NOFOLLOW)
    note = ""
    try:
        kind = os.fstat(fd).st_mode
        if stat.S_ISLNK(kind):
            return Applied(change.path, change.kind)    # a symlink has no mode of its own
        if change.type and kind_of(kind) != change.type:
            raise _Stale()
        _chmod(fd, change.mode)
        if OWNER in change.aspects or made:
            note = _chown(fd, change)
    finally:
        os.close(fd)
    return Applied(change.path, change.kind, note=note)


def _chown(fd: int, change: Change) -> str:
    st = os.fstat(fd)
    if (st.st_uid, st.st_gid) == (change.uid, change.gid):
        return ""
    try:
        os.chown(f"/proc/self/fd/{fd}", change.uid, change.gid)
    except PermissionError:
        return f"owner {st.st_uid}:{st.st_gid} (the sandbox's {change.uid}:{change.gid} is not the applier's to give)"
    return ""


def _write_file(comparison: Comparison, parent: int, name: str, change: Change) -> Applied:
    source = beneath.open_beneath(comparison.layer_fd(change.path), change.path, os.O_RDONLY | os.O_NONBLOCK)
    temporary = _temporary_name()
    try:
        before = os.fstat(source)
        if not stat.S_ISREG(before.st_mode) or (before.st_ino, before.st_ctime_ns, before.st_size) != change.stamp:
            raise _Stale()
        out = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                      dir_fd=parent)
        try:
            digest = _copy_keeping_holes(source, out, before.st_size)
            after = os.fstat(source)
            if (after.st_ino, after.st_ctime_ns, after.st_size) != change.stamp or \
                    (change.sha256 and digest.hexdigest() != change.sha256):
                raise _Stale()
            os.fchmod(out, change.mode)
            note = _chown(out, change)
        finally:
            os.close(out)
        existing = beneath.lstat_at(parent, name)
        if existing is not None and stat.S_ISDIR(existing.st_mode):
            _remove(parent, name)                   # a type change: the host's directory goes first
        os.rename(temporary, name, src_dir_fd=parent, dst_dir_fd=parent)
        temporary = ""
        return Applied(change.path, change.kind, sha256=digest.hexdigest(), note=note)
    finally:
        os.close(source)
        if temporary:
            try:
                os.unlink(temporary, dir_fd=parent)
            except FileNotFoundError:
                pass


def _copy_keeping_holes(source: int, out: int, size: int) -> "hashlib._Hash":
    """Copy ``size`` bytes of ``source`` to ``out`` (both at offset 0), writing only its data
    extents (SEEK_DATA/SEEK_HOLE): a hole stays a hole (out is sized by ftruncate), so a sparse
    file costs the host what it cost the sandbox. Returns the content's SHA-256 (holes read as
    zeros). A file system without SEEK_DATA reports the whole file as data: a dense copy."""
    digest = hashlib.sha256()
    position = 0
    while position < size:
        try:
            data = min(os.lseek(source, position, os.SEEK_DATA), size)
        except OSError as exc:
            if exc.errno != errno.ENXIO:                # ENXIO: no data past position
                raise
            data = size
        _hash_zeros(digest, data - position)
        if data >= size:
            break
        hole = min(os.lseek(source, data, os.SEEK_HOLE), size)
        while data < hole:
            block = os.pread(source, min(CHUNK, hole - data), data)
            if not block:
                raise _Stale()                          # shorter than listed: the sandbox truncated it
            digest.update(block)
            view, done = memoryview(block), 0
            while done < len(block):
                done += os.pwrite(out, view[done:], data + done)
            data += len(block)
        position = hole
    os.ftruncate(out, size)
    return digest


def _hash_zeros(digest: "hashlib._Hash", count: int) -> None:
    while count > 0:
        step = min(count, len(_ZEROS))
        digest.update(_ZEROS[:step] if step < len(_ZEROS) else _ZEROS)
        count -= step


def _replace_with(parent: int, name: str, make: "Callable[[str], None]") -> None:
    """Make a new object beside ``name`` (``make(temporary_name)``) and rename it over ``name``; a
    directory there is removed first."""
    temporary = _temporary_name()
    make(temporary)
    try:
        existing = beneath.lstat_at(parent, name)
        if existing is not None and stat.S_ISDIR(existing.st_mode):
            _remove(parent, name)
        os.rename(temporary, name, src_dir_fd=parent, dst_dir_fd=parent)
    except BaseException:
        os.unlink(temporary, dir_fd=parent)
        raise


def _remove(parent: int, name: str) -> None:
    """Remove the host's ``name``: a directory is renamed aside first (it leaves at once, whatever
    removing its contents then takes), then removed without following anything."""
    existing = beneath.lstat_at(parent, name)
    if existing is None:
        return
    if not stat.S_ISDIR(existing.st_mode):
        os.unlink(name, dir_fd=parent)
        return
    aside = _temporary_name()
    os.rename(name, aside, src_dir_fd=parent, dst_dir_fd=parent)
    beneath.remove_tree(parent, aside)


def _baseline_after(comparison: Comparison, landed: list[str]) -> Baseline:
    """The baseline with each landed path, and every directory above it, at its ctime now: a later
    apply compares with these (conflicts.Baseline)."""
    applied = dict(comparison.baseline.applied)
    fresh = HostLookups(comparison.host_fd)
    try:
        todo = set(landed)
        for path in landed:
            parts = path.split("/")
            todo.update("/".join(parts[:index]) for index in range(1, len(parts)))
        todo.add("")
        for path in sorted(todo):
            st = fresh.stat(path)
            if isinstance(st, os.stat_result):
                applied[path] = st.st_ctime_ns
            else:
                applied.pop(path, None)
    finally:
        fresh.close()
    return comparison.baseline.replace(applied=applied)


class DiscardResult(Record):
    removed: tuple[str, ...]
    skipped: tuple[Skipped, ...]


def discard(upper_fd: int, entries: "list[UpperEntry]", paths: tuple[str, ...] = ("",), *,
            checkpoint_fds: "tuple[int, ...]" = ()) -> DiscardResult:
    """Remove the upper entries at ``paths`` and below ("": all but the root itself), so the sandbox
    sees the host there again once the overlay is mounted again (it must not be mounted now: see
    the module's text). A path inside a directory the sandbox replaced is refused: the host's
    entry there stays hidden by that directory, discard the directory. With checkpoints,
    ``entries`` are upper.scan_stack's and ``checkpoint_fds`` its checkpoint layers (newest first):
    the path goes from every layer (a discarded change does not come back on a rollback)."""
    check_layers(entries, (upper_fd, *checkpoint_fds))
    by_path = {entry.path: entry for entry in entries}
    removed: list[str] = []
    skipped: list[Skipped] = []
    tops = sorted({path for path in paths if not any(_below(path, other) and other != path for other in paths)})
    for top in tops:
        names = [entry.path for entry in entries if entry.path and "/" not in entry.path] if top == "" else [top]
        parts = top.split("/") if top else []
        opaque = next(("/".join(parts[:index]) for index in range(1, len(parts))
                       if by_path.get("/".join(parts[:index]), UpperEntry("", "")).opaque), "")
        if opaque:
            skipped.append(Skipped(top, f"inside {opaque}, which the sandbox replaced: discard {opaque}"))
            continue
        for path in names:
            try:
                for layer_fd in (upper_fd, *checkpoint_fds):
                    _remove_in_layer(layer_fd, path)
                removed.append(path)
            except OSError as exc:
                skipped.append(Skipped(path, _why(exc)))
    return DiscardResult(removed=tuple(removed), skipped=tuple(skipped))


def _remove_in_layer(layer_fd: int, path: str) -> None:
    """Remove ``path`` and what is below it from one layer; nothing when the layer has none."""
    try:
        parent, name = beneath.open_parent(layer_fd, path)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENOTDIR):
            return                                      # this layer has nothing on that path
        raise
    try:
        beneath.remove_tree(parent, name)
    finally:
        os.close(parent)
