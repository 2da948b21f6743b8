"""The change set: an overlay's upper layer (review.upper) compared with the host, as typed changes.

Each upper entry is compared with the host object at its path, if the sandbox could see one
there (not under a directory it replaced):

* whiteout: DELETED (nothing when the host has nothing there any more);
* directory: REPLACED when opaque over a host directory, ADDED when the host has none,
  TYPE_CHANGED over a host non-directory, METADATA when merged and its mode or owner differ
  (a merged directory whose attributes are the host's is only a container of changes);
* file, symlink, FIFO: ADDED, TYPE_CHANGED, or compared: a file by size and SHA-256 (both sides
  hashed when the sizes agree: a sandbox can set mtime back), a symlink by target, then mode and
  owner: MODIFIED when the content differs, METADATA when only attributes do; a copy-up that
  changed nothing (opened for writing, touched) is no change.

Every change carries its flags (review.rules) and its conflict (review.conflicts). Listing is
O(upper entries): the host is looked up at those paths only. It is paged (``after``, ``limit``)
and bounded: SHA-256 reads at most ``max_hash_bytes`` per page, past which a file's hash is left
empty (``unhashed``) and, when its size agrees with the host's, it is listed as MODIFIED (content
unknown, never assumed the same).

Host files are read here: run it as the session's owner (the upper entries come from
upper.scan, which needs root to read overlay's trusted.* attributes).
"""

from __future__ import annotations

import errno
import os
import stat

from sandboxd._record import Record
from sandboxd.errors import InvalidPolicy
from sandboxd.kernel import beneath
from sandboxd.kernel.overlay import Layers
from sandboxd.review import rules
from sandboxd.review.conflicts import Baseline, HostLookups, conflict
from sandboxd.review.upper import DIR, FILE, SYMLINK, WHITEOUT, UpperEntry, kind_of

ADDED, MODIFIED, DELETED, REPLACED, TYPE_CHANGED, METADATA = (
    "added", "modified", "deleted", "replaced", "type changed", "metadata")
CONTENT, MODE, OWNER, TARGET = "content", "mode", "owner", "target"
PAGE = 1000
MAX_HASH_BYTES = 256 << 20
CHUNK = 1 << 20
GIT_DIR_MARKS = ("objects", "refs", "commondir", "config")     # with HEAD: git's is_git_directory


class Change(Record):
    path: str                               # relative to the root; "" is the root itself
    kind: str                               # ADDED, MODIFIED, DELETED, REPLACED, TYPE_CHANGED, METADATA
    type: str = ""                          # the sandbox's object: upper.DIR, FILE, SYMLINK, OTHER ("" deleted)
    host_type: str = ""                     # the host's, as the sandbox saw it ("" none)
    aspects: tuple[str, ...] = ()           # MODIFIED, METADATA: which of CONTENT, MODE, OWNER, TARGET
    mode: int = 0                           # permission bits (st_mode & 0o7777)
    host_mode: int = 0
    uid: int = 0
    gid: int = 0
    host_uid: int = 0
    host_gid: int = 0
    size: int = 0
    host_size: int = 0
    sha256: str = ""                        # a file's content ("" not a file, or not hashed)
    host_sha256: str = ""
    target: str = ""                        # a symlink's
    host_target: str = ""
    flags: tuple[str, ...] = ()             # why an apply skips it unless named (review.rules)
    conflict: str = ""                      # why the host counts as changed since the start (review.conflicts)
    stamp: tuple[int, int, int] = (0, 0, 0)  # the upper entry as listed (inode, ctime, size): an apply checks it


def wire_path(path: str) -> str:
    """``path`` as text a protobuf string can carry: as it is when it is UTF-8, else each byte
    that is not shown as ``\\xHH`` (a file name is bytes; the sandbox chose it). ``unwire_path``
    reverses it, so the name a listing gave names that path again."""
    try:
        path.encode("utf-8")
        return path
    except UnicodeEncodeError:
        return path.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def unwire_path(text: str) -> str:
    """The path ``wire_path`` gave ``text`` for: each ``\\xHH`` of a byte from 0x80 up (what no
    UTF-8 text has as one byte) back to that byte. A name that is valid UTF-8 and spells such an
    escape itself is read as the escape: name its directory instead."""
    if "\\x" not in text:
        return text
    import re
    raw = re.sub(rb"\\x([89a-f][0-9a-f])", lambda found: bytes([int(found.group(1), 16)]), text.encode("utf-8"))
    return raw.decode("utf-8", "surrogateescape")


def fingerprint(change: Change, sha256: "str | None" = None) -> str:
    """What a person was shown of ``change``, as one SHA-256 (hex): its path, kind, the sandbox's
    object (type, mode, owner, size, target) and its content's hash (``sha256``: that of the bytes a
    diff showed, when not the listed one). An apply given the fingerprints a person saw applies a
    change only while its fingerprint is the same (review.apply): a file rewritten after the
    review, and put back or not, is not applied unseen. The host's side is left out on purpose:
    a host that changed is a conflict, judged separately."""
    import hashlib
    import json
    content = change.sha256 if sha256 is None else sha256
    if not content and change.type == FILE and any(change.stamp):
        # Not hashed (past a listing page's hash budget, or unreadable): the upper entry as listed
        # stands for it, its inode and ctime, which every write changes and nobody can set back.
        content = "entry:" + ":".join(str(part) for part in change.stamp)
    shown = [change.path, change.kind, change.type, change.mode, change.uid, change.gid, change.size,
             content, change.target]
    return hashlib.sha256(json.dumps(shown, ensure_ascii=True).encode()).hexdigest()


def attributes(change: Change) -> str:
    """What ``change`` does to the mode and owner, for a person ("" neither):
    ``mode 0644 -> 0777, owner 1000:1000 -> 0:0``. Numbers only: nothing to escape."""
    shown = []
    if MODE in change.aspects:
        shown.append(f"mode {change.host_mode:04o} -> {change.mode:04o}")
    if OWNER in change.aspects:
        shown.append(f"owner {change.host_uid}:{change.host_gid} -> {change.uid}:{change.gid}")
    return ", ".join(shown)


class ChangeSet(Record):
    root: str                               # the host directory these changes are for (Layers.root)
    changes: tuple[Change, ...]
    next_after: str = ""                    # pass as ``after`` for the next page; "" when this was the last
    unhashed: int = 0                       # files left without a hash (the page's hash budget)


class _Budget:
    def __init__(self, limit: int) -> None:
        self.left = limit
        self.unhashed = 0


def hash_file(dir_fd: int, rel: str, budget: "_Budget | None" = None,
              expect: tuple[int, int] | None = None) -> str:
    """SHA-256 of the regular file ``rel`` beneath ``dir_fd`` (never through a symlink, never a
    FIFO's open), "" when over the budget or unreadable. ``expect``: its (inode, size) must still be
    these, else "" (it changed since it was listed)."""
    try:
        fd = beneath.open_beneath(dir_fd, rel, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return ""
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or (expect is not None and (st.st_ino, st.st_size) != expect):
            return ""
        import hashlib                          # when a file is hashed: a listing with none pays nothing
        if budget is not None:
            if st.st_size > budget.left:
                budget.unhashed += 1
                return ""
            budget.left -= st.st_size
        digest = hashlib.sha256()
        while True:
            block = os.read(fd, CHUNK)
            if not block:
                return digest.hexdigest()
            digest.update(block)
    except OSError:
        return ""
    finally:
        os.close(fd)


class Comparison:
    """The upper entries of one overlay and the host they are compared with (see the module's
    text); ``list`` pages through the changes, ``change_at`` gives one."""

    def __init__(self, entries: "list[UpperEntry]", *, upper_fd: int, host_fd: int, layers: Layers,
                 baseline: Baseline, checkpoint_fds: "tuple[int, ...]" = ()) -> None:
        """``entries``: upper.scan's, or upper.scan_stack's with ``checkpoint_fds`` the checkpoint
        layers' descriptors in its order (Layers.stack[1:], newest first)."""
        host_root = os.fstat(host_fd)
        if (host_root.st_dev, host_root.st_ino) != (layers.root_dev, layers.root_ino):
            raise InvalidPolicy(f"{layers.root!r} is not the directory the session started on (it was replaced "
                                "or moved on the host): nothing of its change set can be compared or applied")
        self.entries = entries
        self.by_path = {entry.path: entry for entry in entries}
        # Directories only: a file's origin names what it was copied from, which a rename in the
        # sandbox may have brought from another path; a directory the host has cannot be renamed
        # in the sandbox (no redirects: EXDEV), so its origin is what the host had at its path.
        self.origins = {entry.path: entry.origin for entry in entries if entry.kind == DIR and entry.origin is not None}
        self.upper_fd, self.host_fd, self.layers, self.baseline = upper_fd, host_fd, layers, baseline
        self.layer_fds = (upper_fd, *checkpoint_fds)
        check_layers(entries, self.layer_fds)
        self.host = HostLookups(host_fd)
        self._git_dirs: dict[str, bool] = {}

    def close(self) -> None:
        self.host.close()

    def __enter__(self) -> "Comparison":
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def hidden(self, path: str) -> bool:
        """Whether the host's object at ``path`` was out of the sandbox's sight: under a directory
        the sandbox replaced (opaque). (Under one it made where the host had none, the host has
        nothing to look up.)"""
        parts = path.split("/")
        for index in range(1, len(parts)):
            above = self.by_path.get("/".join(parts[:index]))
            if above is not None and above.opaque:
                return True
        return False

    def layer_fd(self, path: str) -> int:
        """The descriptor of the layer that holds the entry at ``path`` (an entry's content is read there)."""
        return self.layer_fds[self.by_path[path].layer]

    def _host(self, path: str) -> "os.stat_result | None":
        st = self.host.stat(path)
        return st if isinstance(st, os.stat_result) else None

    def _visible(self, path: str) -> bool:
        """Whether ``path`` exists as the sandbox sees it now."""
        entry = self.by_path.get(path)
        if entry is not None:
            return entry.kind != WHITEOUT
        return not self.hidden(path) and self._host(path) is not None

    def is_git_dir(self, path: str) -> bool:
        if path not in self._git_dirs:
            self._git_dirs[path] = self._visible(f"{path}/HEAD") and any(
                self._visible(f"{path}/{mark}") for mark in GIT_DIR_MARKS)
        return self._git_dirs[path]

    def change_at(self, entry: UpperEntry, budget: _Budget) -> Change | None:
        """The change the upper ``entry`` makes to the host, or None when it changes nothing."""
        path = entry.path
        host = None if self.hidden(path) else self._host(path)
        host_kind = kind_of(host.st_mode) if host is not None else ""
        more: dict[str, object] = {}
        aspects: tuple[str, ...] = ()
        if entry.kind == WHITEOUT:
            if host is None:
                return None                             # gone on the host too: nothing to do
            kind = DELETED
        elif host is None:
            kind = ADDED
        elif host_kind != entry.kind:
            kind = TYPE_CHANGED
        elif entry.kind == DIR:
            kind = REPLACED if entry.opaque else METADATA
            aspects = self._attributes(entry, host)
            if kind == METADATA and not aspects:
                return None                             # a merged directory: only holds changes
        else:
            kind, aspects, more = self._compare_content(entry, host, budget)
            if not aspects:
                return None                             # copied up, changed nothing
        if entry.kind == FILE and "sha256" not in more:
            more["sha256"] = hash_file(self.layer_fd(path), path, budget, expect=(entry.ino, entry.size))
        if entry.kind == SYMLINK and host_kind == SYMLINK:
            more["host_target"] = _readlink(self.host_fd, path)
        if host is not None:
            more.update(host_mode=stat.S_IMODE(host.st_mode), host_uid=host.st_uid, host_gid=host.st_gid,
                        host_size=host.st_size)
        change = Change(path=path, kind=kind, type="" if entry.kind == WHITEOUT else entry.kind, host_type=host_kind,
                        aspects=aspects, mode=stat.S_IMODE(entry.mode), uid=entry.uid, gid=entry.gid,
                        size=entry.size, target=entry.target, stamp=(entry.ino, entry.ctime_ns, entry.size),
                        flags=rules.reasons(path, entry.kind, entry.mode, self.is_git_dir),
                        conflict=self._conflict(path))
        return change.replace(**more)

    def _conflict(self, path: str) -> str:
        if path == "":
            st = self._host("")
            return "" if st is None or self.baseline.unchanged("", st) else "the root changed on the host"
        return conflict(path, self.origins, self.host, self.baseline)

    @staticmethod
    def _attributes(entry: UpperEntry, host: os.stat_result) -> tuple[str, ...]:
        aspects = []
        if stat.S_IMODE(entry.mode) != stat.S_IMODE(host.st_mode):
            aspects.append(MODE)
        if (entry.uid, entry.gid) != (host.st_uid, host.st_gid):
            aspects.append(OWNER)
        return tuple(aspects)

    def _compare_content(self, entry: UpperEntry, host: os.stat_result,
                         budget: _Budget) -> tuple[str, tuple[str, ...], dict[str, object]]:
        more: dict[str, object] = {}
        differs = False
        if entry.kind == FILE:
            if entry.size != host.st_size:
                differs = True
            else:
                mine = hash_file(self.layer_fd(entry.path), entry.path, budget, expect=(entry.ino, entry.size))
                theirs = hash_file(self.host_fd, entry.path, budget, expect=(host.st_ino, host.st_size))
                more.update(sha256=mine, host_sha256=theirs)
                differs = not mine or not theirs or mine != theirs
        elif entry.kind == SYMLINK:
            differs = _readlink(self.host_fd, entry.path) != entry.target
        aspects = ((CONTENT if entry.kind == FILE else TARGET,) if differs else ()) + self._attributes(entry, host)
        return (MODIFIED if differs else METADATA), aspects, more

    def list(self, *, after: str = "", limit: int = PAGE, max_hash_bytes: int = MAX_HASH_BYTES,
             under: str = "") -> ChangeSet:
        """The changes with paths after ``after`` (in path order), at most ``limit``; ``under``: only
        that path and what is below it."""
        budget = _Budget(max_hash_bytes)
        found: list[Change] = []
        next_after = ""
        for entry in self.entries:
            if entry.path <= after and not (after == "" and entry.path == ""):
                continue
            if under and entry.path != under and not entry.path.startswith(under + "/"):
                continue
            if len(found) == limit:
                next_after = found[-1].path
                break
            change = self.change_at(entry, budget)
            if change is not None:
                found.append(change)
        return ChangeSet(root=self.layers.root, changes=tuple(found), next_after=next_after,
                         unhashed=budget.unhashed)


def check_layers(entries: "list[UpperEntry]", layer_fds: "tuple[int, ...]") -> None:
    """Entries of a stack must come with a descriptor for each of its layers: read without them, a
    change in a checkpoint layer would be looked for in the upper (and a discard would leave it)."""
    deepest = max((entry.layer for entry in entries), default=0)
    if deepest >= len(layer_fds):
        raise ValueError(f"the entries come from {deepest + 1} layers, {len(layer_fds)} descriptors given "
                         "(pass checkpoint_fds: the layers of upper.scan_stack)")


def _readlink(dir_fd: int, rel: str) -> str:
    """A symlink's target, read through its parent beneath ``dir_fd``; "" when it is not one."""
    try:
        parent, name = beneath.open_parent(dir_fd, rel)
    except OSError:
        return ""
    try:
        return os.readlink(name, dir_fd=parent)
    except OSError as exc:
        if exc.errno in (errno.EINVAL, errno.ENOENT):
            return ""
        raise
    finally:
        os.close(parent)
