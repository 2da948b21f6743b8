"""Checkpoints of a review session: a point the session's view can be rolled back to.

A checkpoint costs O(changes since the last one), never a copy of the workspace: for each overlay
of the session, the upper directory is renamed into a read-only layer (``N/checkpoints/<id>``:
one rename) and an empty upper takes its place (the old upper's root attributes, which are what
the sandbox sees of the root). The overlay is then mounted with the checkpoint layers stacked
between the upper and the host (kernel.overlay.mount_over, ``lowerdir=ckN:...:ck1:HOST``), so the
sandbox sees the same tree; the change set against the host is all layers merged
(review.upper.scan_stack), which listing, apply and discard read (review.kept). The layer just
frozen is read once, to count its changes: O(its entries).

Rollback to checkpoint K drops the layers above K and the current upper (each renamed aside at
once, then removed: O(the changes dropped)); K = 0 is the start (all layers dropped). What an
apply already wrote to the host stays there: a rollback returns the sandbox's view of the changes
not applied.

Past ``limit`` checkpoints (config review.max_checkpoints) the oldest two are merged: the newer
layer's entries are moved into the older one (renames; a directory both have is walked into),
which then takes the newer one's place. The oldest point is forgotten, its changes stay, and a
long session (a checkpoint per call) keeps its most recent points. O(the newer layer's entries,
and what of the older's they replace), never the workspace.

Every function here changes layers overlayfs must not see change while mounted: call them with
the session's overlays unmounted (between calls, no command running), as apply.discard. Run as the
owner of the review directory (root for a daemon's session: the layers are 0700 root, and the
change count reads trusted.overlay.* attributes; the user for a rootless run's).

On disk, beside kernel.overlay's record (which names the layers a mount stacks, and is written
first), ``checkpoints.json`` keeps each checkpoint's id, time, label and change count, and the
next id (ids are never reused: a rolled-back id never names a second state). A crash part-way
is repaired by ``recover``: a create that renamed some overlays' uppers is completed, a rollback
that saved the record is finished.
"""

from __future__ import annotations

import os
import stat
import time

from sandboxd._record import Record
from sandboxd.errors import Exhausted, InvalidPolicy, NotFound
from sandboxd.kernel import beneath, overlay
from sandboxd.review import upper

CHECKPOINTS_FILE = "checkpoints.json"
DEFAULT_LIMIT = overlay.DEFAULT_CHECKPOINTS     # config review.max_checkpoints; at most overlay.MAX_CHECKPOINTS
MAX_LABEL = 256                     # characters of a checkpoint's label
LAYERS_DIR = overlay.CHECKPOINTS_DIR        # in each overlay's directory, beside upper/ and work/
FRESH = "upper.new"                 # the empty upper being made (a leftover is finished or removed)
ASIDE = ".dropped-"                 # a layer being removed (renamed aside first: gone from view at once)
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class Checkpoint(Record):
    id: int                         # 1, 2, ...: never reused within a session
    time_ns: int                    # when it was made (CLOCK_REALTIME, nanoseconds since the epoch)
    label: str                      # the caller's (a call's id, a person's note): shown escaped
    changes: int                    # paths its layer changed, all overlays together (count_changes)
    call_id: str = ""               # the call it was marked before (ExecStart.checkpoint), "" by request


class Rollback(Record):
    to: int                         # the checkpoint now in view (0: the start)
    dropped: tuple[int, ...]        # checkpoints gone with it (above ``to``)
    removed: int                    # entries removed from the layers dropped (the cost)


class _State(Record):
    next_id: int
    checkpoints: tuple[Checkpoint, ...]


def count_changes(layer_fd: int, prefix: str) -> int:
    """The paths one layer changed: its files, symlinks, whiteouts and other entries, and its
    directories that are new or replaced (no copy-up origin, or opaque); a directory copied up
    only to hold a change below it is not one. O(the layer's entries); a layer of more than
    upper.MAX_ENTRIES entries counts as that many (a floor: counting never fails a checkpoint)."""
    try:
        return sum(1 for entry in upper.scan(layer_fd, prefix=prefix) if _counts(entry))
    except Exhausted:
        return upper.MAX_ENTRIES


def _load(review_dir: str) -> _State:
    import json

    try:
        fd = os.open(f"{review_dir}/{CHECKPOINTS_FILE}", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return _State(next_id=1, checkpoints=())
    try:
        raw = json.loads(os.read(fd, 1 << 20))
    finally:
        os.close(fd)
    return _State(next_id=int(raw["next_id"]), checkpoints=tuple(
        Checkpoint(id=int(item["id"]), time_ns=int(item["time_ns"]), label=str(item["label"]),
                   changes=int(item["changes"]), call_id=str(item.get("call_id", "")))
        for item in raw["checkpoints"]))


def _save(review_dir: str, state: _State) -> None:
    import json

    data = {"next_id": state.next_id, "checkpoints": [item.as_dict() for item in state.checkpoints]}
    overlay.write_aside(review_dir, CHECKPOINTS_FILE, json.dumps(data, sort_keys=True).encode(), reserve=True)


def _check_room(review_dir: str, overlays: int, saves: int, what: str) -> None:
    """Refuse ``what`` before anything changes when the session's store (kernel.review_space) has
    not the room for its new directories (two per overlay: the checkpoints directory, the empty
    upper) and ``saves`` saves of both records: a checkpoint half made on a full store would leave
    a frozen layer no record names."""
    from sandboxd.kernel import review_space

    review_space.check_room(review_dir, inodes=2 * overlays + 2,
                            records=(overlay.LAYERS_FILE, CHECKPOINTS_FILE) * saves, what=what)


def list_checkpoints(review_dir: str) -> list[Checkpoint]:
    """The session's checkpoints, oldest first. Reads the record only: O(checkpoints)."""
    return list(_load(review_dir).checkpoints)


def _layer_id(path: str) -> int:
    return int(os.path.basename(path))


def _base(layers: overlay.Layers) -> str:
    return os.path.dirname(layers.upper)


def _fresh_upper(base_fd: int, like: os.stat_result) -> None:
    """An empty FRESH directory in ``base_fd`` with ``like``'s owner and mode (the root the
    sandbox sees: an overlay's top directory shows its upper's attributes)."""
    os.mkdir(FRESH, 0o700, dir_fd=base_fd)
    fd = beneath.open_beneath(base_fd, FRESH, beneath.DIRECTORY)
    try:
        if os.geteuid() == 0:
            os.fchown(fd, like.st_uid, like.st_gid)
        os.fchmod(fd, stat.S_IMODE(like.st_mode))
    finally:
        os.close(fd)


def _freeze(layers: overlay.Layers, checkpoint_id: int) -> tuple[overlay.Layers, int]:
    """One overlay's part of a checkpoint: its upper renamed to checkpoints/<id>, an empty upper
    in its place. Returns the layers with the new checkpoint, and the frozen layer's change count."""
    base = _base(layers)
    base_fd = os.open(base, DIR_FLAGS)
    try:
        try:
            os.mkdir(LAYERS_DIR, 0o700, dir_fd=base_fd)
        except FileExistsError:
            pass
        _fresh_upper(base_fd, os.stat("upper", dir_fd=base_fd, follow_symlinks=False))
        frozen = f"{LAYERS_DIR}/{checkpoint_id}"
        os.rename("upper", frozen, src_dir_fd=base_fd, dst_dir_fd=base_fd)
        os.rename(FRESH, "upper", src_dir_fd=base_fd, dst_dir_fd=base_fd)
        layer_fd = beneath.open_beneath(base_fd, frozen, beneath.DIRECTORY)
        try:
            counted = count_changes(layer_fd, layers.xattr_prefix)
        finally:
            os.close(layer_fd)
    finally:
        os.close(base_fd)
    return layers.replace(checkpoints=(*layers.checkpoints, f"{base}/{frozen}")), counted


def changed_since_last(layers: overlay.Layers) -> bool:
    """Whether the overlay changed anything since its last checkpoint (since the start when it has
    none): an entry in its upper layer, or its top directory's mode or owner unlike the layer
    below's. One directory read."""
    fd = os.open(layers.upper, DIR_FLAGS)
    try:
        if not layers.checkpoints:
            return not overlay.upper_is_empty(fd, layers.root)
        with os.scandir(fd) as listing:
            if next(listing, None) is not None:
                return True
        mine, below = os.fstat(fd), os.stat(layers.checkpoints[-1], follow_symlinks=False)
        return (stat.S_IMODE(mine.st_mode), mine.st_uid, mine.st_gid) != \
            (stat.S_IMODE(below.st_mode), below.st_uid, below.st_gid)
    finally:
        os.close(fd)


def create_if_changed(review_dir: str, label: str, *, call_id: str, limit: int = DEFAULT_LIMIT) -> "Checkpoint | None":
    """A checkpoint before the call ``call_id`` (ExecStart.checkpoint), as ``create``; None, and
    nothing marked, when no overlay changed since the last one (changed_since_last): a point equal
    to the one before is no point."""
    recover(review_dir)
    if not any(changed_since_last(layers) for layers in overlay.load(review_dir)):
        return None
    return create(review_dir, label, limit=limit, call_id=call_id)


def create(review_dir: str, label: str = "", *, limit: int = DEFAULT_LIMIT, call_id: str = "") -> Checkpoint:
    """Mark a checkpoint of every overlay in ``review_dir`` (kernel.overlay's record there), the
    overlays unmounted; at ``limit`` checkpoints the oldest two are merged first (merge_oldest;
    Exhausted, and no checkpoint, when the newer of them has more than upper.MAX_ENTRIES).
    Raises InvalidPolicy for a label over MAX_LABEL characters or a limit out of 1..MAX_CHECKPOINTS."""
    if len(label) > MAX_LABEL:
        raise InvalidPolicy(f"a checkpoint's label has at most {MAX_LABEL} characters (this one {len(label)})")
    if not 1 <= limit <= overlay.MAX_CHECKPOINTS:
        raise InvalidPolicy(f"review.max_checkpoints is 1 to {overlay.MAX_CHECKPOINTS} (not {limit})")
    recover(review_dir)
    state = _load(review_dir)
    _check_room(review_dir, len(overlay.load(review_dir)), 3 if len(state.checkpoints) >= max(limit, 2) else 2,
                "a checkpoint")
    # Room first: should a merge fail (a layer past upper.MAX_ENTRIES), nothing was frozen, and
    # the layers a mount stacks stay within the limit.
    while len(state.checkpoints) >= max(limit, 2):
        state = _merge_oldest(review_dir, state)
    checkpoint_id = state.next_id
    made: list[overlay.Layers] = []
    changes = 0
    for layers in overlay.load(review_dir):
        frozen, counted = _freeze(layers, checkpoint_id)
        made.append(frozen)
        changes += counted
    overlay.save(review_dir, made)              # first: what a mount stacks (recover finishes the rest)
    checkpoint = Checkpoint(id=checkpoint_id, time_ns=time.time_ns(), label=label, changes=changes, call_id=call_id)
    state = _State(next_id=checkpoint_id + 1, checkpoints=(*state.checkpoints, checkpoint))
    _save(review_dir, state)
    if len(state.checkpoints) > limit:          # a limit of 1: the new one merged into the one before
        state = _merge_oldest(review_dir, state)
    return checkpoint


def merge_oldest(review_dir: str) -> list[Checkpoint]:
    """Merge the oldest two checkpoints into one, in every overlay (the overlays unmounted): the
    older one's point is forgotten (a rollback can no longer reach it), its changes stay, under
    the newer one's id, time and label. O(the newer layer's entries, and what of the older's they
    replace). Returns the checkpoints after; InvalidPolicy when there are fewer than two."""
    recover(review_dir)
    state = _load(review_dir)
    if len(state.checkpoints) < 2:
        raise InvalidPolicy(f"merging needs two checkpoints (this session has {len(state.checkpoints)})")
    return list(_merge_oldest(review_dir, state).checkpoints)


def _merge_oldest(review_dir: str, state: _State) -> _State:
    older, newer = state.checkpoints[0], state.checkpoints[1]
    everything = overlay.load(review_dir)
    delta = 0
    for layers in everything:
        base_fd = os.open(_base(layers), DIR_FLAGS)
        try:
            older_name, newer_name = f"{LAYERS_DIR}/{older.id}", f"{LAYERS_DIR}/{newer.id}"
            older_fd = beneath.open_beneath(base_fd, older_name, beneath.DIRECTORY)
            try:
                newer_fd = beneath.open_beneath(base_fd, newer_name, beneath.DIRECTORY)
                try:
                    delta += _fold(older_fd, newer_fd, layers.xattr_prefix)
                finally:
                    os.close(newer_fd)
            finally:
                os.close(older_fd)
            # The merged layer takes the newer one's place (what is left of the newer one, only
            # directories that the merged layer has too, the older's: it is dropped below).
            beneath.exchange(base_fd, older_name, newer_name)
        finally:
            os.close(base_fd)
    kept = [layers.replace(checkpoints=tuple(path for path in layers.checkpoints if _layer_id(path) != older.id))
            for layers in everything]
    overlay.save(review_dir, kept)
    state = state.replace(checkpoints=(newer.replace(changes=older.changes + delta), *state.checkpoints[2:]))
    _save(review_dir, state)
    for layers in kept:
        _remove_dropped(layers)
    return state


def _counts(entry: upper.UpperEntry) -> bool:
    """Whether a layer's entry is one of its changes (count_changes)."""
    return bool(entry.path) and (entry.kind != upper.DIR or entry.opaque or entry.origin is None)


def _count_at(parent_fd: int, name: str, prefix: str) -> int:
    """count_changes of the entry ``name`` in ``parent_fd`` and what is below it."""
    st = beneath.lstat_at(parent_fd, name)
    if st is None:
        return 0
    if not stat.S_ISDIR(st.st_mode):
        return 1
    fd = beneath.open_beneath(parent_fd, name, beneath.DIRECTORY)
    try:
        top = upper.UpperEntry(path=name, kind=upper.DIR, opaque=_attribute(fd, prefix + "opaque") == b"y",
                               origin=_attribute(fd, prefix + "origin"))
        return int(_counts(top)) + count_changes(fd, prefix)
    finally:
        os.close(fd)


def _attribute(fd: int, name: str) -> bytes | None:
    try:
        return os.getxattr(fd, name)
    except OSError:
        return None


def _take_attributes(fd: int, entry: upper.UpperEntry) -> None:
    """Give the directory ``fd`` the mode and owner of ``entry`` (the layer above's, which the
    sandbox saw)."""
    if os.geteuid() == 0:
        os.fchown(fd, entry.uid, entry.gid)
    os.fchmod(fd, stat.S_IMODE(entry.mode))


def _fold(older_fd: int, newer_fd: int, prefix: str) -> int:
    """Move the newer layer's entries into the older one, so that the older alone reads as the
    newer stacked over it: a directory in both (the newer's not opaque) stays the older's (its
    origin, its opaque mark) with the newer's mode and owner, and is walked into; anything else
    of the newer's replaces what the older has at its path, whole (a rename). A directory the
    newer has over an older non-directory or whiteout is marked opaque: overlayfs's lookup
    stopped there. Each step leaves the two stacked reading the same, so a crash part-way changes
    nothing the sandbox sees. Returns how count_changes of the older layer moved."""
    delta = 0
    moved: set[str] = set()
    for entry in upper.scan(newer_fd, prefix=prefix):
        if entry.path == "":
            _take_attributes(older_fd, entry)
            continue
        if upper.below_any(entry.path, moved):
            delta += _counts(entry)             # moved with its directory
            continue
        newer_parent, name = beneath.open_parent(newer_fd, entry.path)
        try:
            older_parent, _ = beneath.open_parent(older_fd, entry.path)     # a directory in both: walked into
            try:
                there = beneath.lstat_at(older_parent, name)
                if entry.kind == upper.DIR and not entry.opaque and there is not None and stat.S_ISDIR(there.st_mode):
                    fd = beneath.open_beneath(older_parent, name, beneath.DIRECTORY)
                    try:
                        _take_attributes(fd, entry)
                    finally:
                        os.close(fd)
                    continue
                if entry.kind == upper.DIR and not entry.opaque and there is not None:
                    # Marked before it moves: stacked, the lookup stops at it either way.
                    fd = beneath.open_beneath(newer_parent, name, beneath.DIRECTORY)
                    try:
                        os.setxattr(fd, prefix + "opaque", b"y")
                    finally:
                        os.close(fd)
                    entry = entry.replace(opaque=True)
                if there is not None:
                    delta -= _count_at(older_parent, name, prefix)
                    beneath.remove_tree(older_parent, name)
                os.rename(name, name, src_dir_fd=newer_parent, dst_dir_fd=older_parent)
                moved.add(entry.path)
                delta += _counts(entry)
            finally:
                os.close(older_parent)
        finally:
            os.close(newer_parent)
    return delta


def rollback(review_dir: str, checkpoint_id: int) -> Rollback:
    """Return every overlay's view to checkpoint ``checkpoint_id`` (0: the start), the overlays
    unmounted: the upper is emptied and the checkpoints above it dropped. Raises NotFound for an
    id the session does not have (listing those it has)."""
    recover(review_dir)
    state = _load(review_dir)
    ids = [item.id for item in state.checkpoints]
    if checkpoint_id != 0 and checkpoint_id not in ids:
        raise NotFound(f"this session has no checkpoint {checkpoint_id} (it has: "
                       f"{', '.join(map(str, ids)) or 'none'}; 0 is the start)")
    everything = overlay.load(review_dir)
    _check_room(review_dir, len(everything), 1, "a rollback")
    kept: list[overlay.Layers] = []
    for layers in everything:
        staying = tuple(path for path in layers.checkpoints if _layer_id(path) <= checkpoint_id)
        # The new upper shows the root as the checkpoint left it (or as the host has it: the start).
        like = os.stat(staying[-1], follow_symlinks=False) if staying else overlay.root_attributes(layers, "its view cannot be rolled back to the start")
        base_fd = os.open(_base(layers), DIR_FLAGS)
        try:
            _fresh_upper(base_fd, like)
            os.rename("upper", f"{ASIDE}upper", src_dir_fd=base_fd, dst_dir_fd=base_fd)
            os.rename(FRESH, "upper", src_dir_fd=base_fd, dst_dir_fd=base_fd)
        finally:
            os.close(base_fd)
        kept.append(layers.replace(checkpoints=staying))
    overlay.save(review_dir, kept)              # first: recover removes what it no longer names
    dropped = tuple(item for item in ids if item > checkpoint_id)
    _save(review_dir, state.replace(checkpoints=tuple(item for item in state.checkpoints if item.id <= checkpoint_id)))
    removed = sum(_remove_dropped(layers) for layers in kept)
    return Rollback(to=checkpoint_id, dropped=dropped, removed=removed)


def _remove_dropped(layers: overlay.Layers) -> int:
    """Remove the layers of one overlay that its record no longer names (dropped by a rollback, or
    left by one cut short): each renamed aside, then removed. Returns the entries removed."""
    base_fd = os.open(_base(layers), DIR_FLAGS)
    removed = 0
    try:
        named = {os.path.basename(path) for path in layers.checkpoints}
        for name in _on_disk(base_fd):
            if name not in named:
                os.rename(f"{LAYERS_DIR}/{name}", f"{ASIDE}{name}", src_dir_fd=base_fd, dst_dir_fd=base_fd)
        for name in os.listdir(base_fd):
            if name.startswith(ASIDE):
                removed += beneath.remove_tree(base_fd, name)
    finally:
        os.close(base_fd)
    return removed


def _on_disk(base_fd: int) -> list[str]:
    """The names in one overlay's checkpoints directory."""
    try:
        fd = beneath.open_beneath(base_fd, LAYERS_DIR, beneath.DIRECTORY)
    except FileNotFoundError:
        return []
    try:
        return os.listdir(fd)
    finally:
        os.close(fd)


def _finish_upper(layers: overlay.Layers) -> None:
    """An empty upper left half made: in place when the upper is missing (renamed away just
    before), else removed."""
    base_fd = os.open(_base(layers), DIR_FLAGS)
    try:
        if beneath.lstat_at(base_fd, FRESH) is None:
            return
        if beneath.lstat_at(base_fd, "upper") is None:
            os.rename(FRESH, "upper", src_dir_fd=base_fd, dst_dir_fd=base_fd)
        else:
            beneath.remove_tree(base_fd, FRESH)
    finally:
        os.close(base_fd)


def recover(review_dir: str) -> None:
    """Repair what a crash (a daemon SIGKILLed part-way) left, from what is on disk: an empty upper
    half made is put in place or removed; a create that froze some overlays' uppers is completed
    on the others and recorded (label "(recovered)"); the layers a rollback dropped are removed,
    and the record lists exactly the layers there are. Cheap when nothing was cut short (the
    records and one directory listing per overlay). Call it, like everything here, with the
    overlays unmounted: after a restart, before mounting them again."""
    everything = overlay.load(review_dir)
    state = _load(review_dir)
    for layers in everything:
        _finish_upper(layers)
    pending: set[int] = set()
    for layers in everything:
        base_fd = os.open(_base(layers), DIR_FLAGS)
        try:
            pending.update(int(name) for name in _on_disk(base_fd) if name.isdigit() and int(name) >= state.next_id)
        finally:
            os.close(base_fd)
    for checkpoint_id in sorted(pending):
        made, changes = [], 0
        for layers in everything:
            frozen = f"{_base(layers)}/{LAYERS_DIR}/{checkpoint_id}"
            if os.path.isdir(frozen) and not os.path.islink(frozen):
                layer_fd = os.open(frozen, DIR_FLAGS)
                try:
                    changes += count_changes(layer_fd, layers.xattr_prefix)
                finally:
                    os.close(layer_fd)
                if frozen not in layers.checkpoints:
                    layers = layers.replace(checkpoints=(*layers.checkpoints, frozen))
            else:
                layers, counted = _freeze(layers, checkpoint_id)
                changes += counted
            made.append(layers)
        everything = made
        overlay.save(review_dir, everything)
        state = _State(next_id=checkpoint_id + 1, checkpoints=(*state.checkpoints, Checkpoint(
            id=checkpoint_id, time_ns=time.time_ns(), label="(recovered)", changes=changes)))
        _save(review_dir, state)
    named = {_layer_id(path) for layers in everything for path in layers.checkpoints}
    if any(item.id not in named for item in state.checkpoints):
        _save(review_dir, state.replace(checkpoints=tuple(item for item in state.checkpoints if item.id in named)))
    for layers in everything:
        _remove_dropped(layers)
