"""Is a host path changed since the session started, or since its last apply?

The test, for a change at path P, without walking the workspace:

1. **Which host directory the sandbox started from.** A copy-up stores the host object's file
   handle in the upper entry's ``origin`` attribute (overlayfs does so on every copy-up; a host
   file system without handles gets an empty one). The handle names the inode and its generation,
   so it is not fooled by a reused inode number. The deepest directory on P's path (P included)
   that has one is the *anchor*: the host directory now at that path must be the same
   (``name_to_handle_at`` of it compared with the stored handle), else it was replaced or moved on
   the host. Only directories: without redirects a directory the host has cannot be renamed in the
   sandbox (EXDEV), so its origin is what the host had at that very path, while a file's origin
   names what it was copied from, which ``mv`` in the sandbox may have brought from elsewhere. The
   workspace root is the anchor of last resort (its device and inode are recorded when the layers
   were made, kernel.overlay.Layers).
2. **Whether it changed since.** Below the anchor, every component that exists on the host (and P
   itself) must have a change time (ctime) from before the session started, or exactly the one
   recorded after its last apply. The kernel sets ctime to "now" on every change of the content or
   the attributes of an inode, and on every change of the name binding that involves it (rename
   moves the renamed inode's ctime on ext4, xfs, btrfs, tmpfs and f2fs; link changes its link
   count): no one can set it back (utimensat sets atime and mtime only), short of setting the
   system clock, which only root can. So a host object at P that was changed, or moved or linked
   there, after the start has ctime >= start, and a new one too.

Why this is sound: the sandbox saw, at P, the host object reached through the anchor (unchanged
identity) and the components below it. If none of those components changed since the start
(their ctimes), nothing was created, removed, renamed or rewritten at P on the host since then,
and the host object at P is still what the sandbox based its change on. The anchor itself may
gain and lose other entries (a sibling file the host adds is no conflict): only its identity is
checked. Where there are no handles (the lower's file system gives none), the anchor is the root,
and every component's ctime is checked: still sound, with false alarms when the host added or
removed entries in a parent directory.

The start (Layers.started_ns) is CLOCK_REALTIME_COARSE, taken before the overlay was mounted
(kernel.overlay.started_now: floored to the second on a file system that keeps whole seconds); a
host change in the same clock tick as the start (or second, there) is then a conflict too: a
false alarm, never a missed one.
"""

from __future__ import annotations

import ctypes
import errno
import os

from sandboxd._record import Factory, Record
from sandboxd.kernel import beneath, overlay
from sandboxd.kernel._libc import libc

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping

MAX_HANDLE_BYTES = 128
AT_EMPTY_PATH = 0x1000
OVERLAY_HANDLE_MAGIC = 0xFB
OVERLAY_HANDLE_HEADER = 21      # struct ovl_fb: version, magic, len, flags, type, 16-byte uuid; then the fid
BASELINE_FILE = "baseline.json"


class Baseline(Record):
    """What the conflict check compares the host with, per overlay: the start, and for each path
    applied since, the host's ctime right after that apply."""

    started_ns: int
    applied: dict[str, int] = Factory(dict)

    def unchanged(self, path: str, st: os.stat_result) -> bool:
        recorded = self.applied.get(path)
        if recorded is not None:
            return st.st_ctime_ns == recorded
        return st.st_ctime_ns < self.started_ns


def load_baseline(layer_dir: str, started_ns: int) -> Baseline:
    """The baseline saved beside an overlay's layers (save_baseline), or a fresh one."""
    try:
        fd = os.open(f"{layer_dir}/{BASELINE_FILE}", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return Baseline(started_ns=started_ns)
    import json                                 # only when there is one: `sandboxd run`'s summary has none

    try:
        raw = json.loads(os.read(fd, 64 << 20))
    finally:
        os.close(fd)
    return Baseline(started_ns=int(raw["started_ns"]), applied={str(k): int(v) for k, v in raw["applied"].items()})


def save_baseline(layer_dir: str, baseline: Baseline) -> None:
    import json

    overlay.write_aside(layer_dir, BASELINE_FILE,
                        json.dumps({"started_ns": baseline.started_ns, "applied": baseline.applied}).encode())


class _FileHandle(ctypes.Structure):
    _fields_ = [("handle_bytes", ctypes.c_uint), ("handle_type", ctypes.c_int),
                ("f_handle", ctypes.c_ubyte * MAX_HANDLE_BYTES)]


def handle_of(fd: int) -> tuple[int, bytes] | None:
    """(type, bytes) of the object ``fd`` is open on (name_to_handle_at); None where its file system
    gives no handles."""
    handle = _FileHandle(MAX_HANDLE_BYTES, 0)
    mount_id = ctypes.c_int(0)
    if libc.name_to_handle_at(ctypes.c_int(fd), b"", ctypes.byref(handle), ctypes.byref(mount_id),
                              ctypes.c_int(AT_EMPTY_PATH)) != 0:
        code = ctypes.get_errno()
        if code in (errno.EOPNOTSUPP, errno.ENOTSUP, errno.EOVERFLOW, errno.ENOSYS):
            return None
        raise OSError(code, os.strerror(code))
    return handle.handle_type, bytes(handle.f_handle[:handle.handle_bytes])


def origin_handle(origin: bytes | None) -> tuple[int, bytes] | None:
    """(type, bytes) of the host object an upper entry was copied up from, read from overlay's
    ``origin`` attribute (struct ovl_fb); None when there is none usable (an empty one: the host's
    file system gives no handles)."""
    if origin is None or len(origin) < OVERLAY_HANDLE_HEADER or origin[1] != OVERLAY_HANDLE_MAGIC:
        return None
    length = origin[2]
    if length < OVERLAY_HANDLE_HEADER or length > len(origin):
        return None
    return origin[4], bytes(origin[OVERLAY_HANDLE_HEADER:length])


class HostLookups:
    """Lookups of host paths beneath the workspace's descriptor, never through a symlink or another
    mount (kernel.beneath): a path that would go through one is BLOCKED, which is a conflict."""

    BLOCKED = "blocked"

    def __init__(self, host_fd: int) -> None:
        self.host_fd = host_fd
        self._parent: tuple[str, int] | None = None     # the last parent opened (siblings come together)
        self._stats: dict[str, "os.stat_result | None | str"] = {}

    def close(self) -> None:
        if self._parent is not None:
            os.close(self._parent[1])
            self._parent = None

    def _parent_fd(self, parent: str) -> int:
        if self._parent is not None and self._parent[0] == parent:
            return self._parent[1]
        fd = beneath.open_beneath(self.host_fd, parent, beneath.PATH_ONLY | os.O_DIRECTORY)
        self.close()
        self._parent = (parent, fd)
        return fd

    def stat(self, path: str) -> "os.stat_result | None | str":
        """lstat of the host's ``path`` ("" is the root), None when nothing is there, BLOCKED when the
        way to it goes through a symlink or another mount."""
        if path in self._stats:
            return self._stats[path]
        result: "os.stat_result | None | str"
        if path == "":
            result = os.fstat(self.host_fd)
        else:
            parent, name = beneath.split(path)
            try:
                result = beneath.lstat_at(self._parent_fd(parent), name)
            except OSError as exc:
                if exc.errno in (errno.ENOENT, errno.ENOTDIR):
                    result = None
                elif exc.errno in (errno.ELOOP, errno.EXDEV):
                    result = self.BLOCKED
                else:
                    raise
        if len(self._stats) > 4096:
            self._stats.clear()
        self._stats[path] = result
        return result

    def handle(self, path: str) -> tuple[int, bytes] | None:
        try:
            fd = beneath.open_beneath(self.host_fd, path, os.O_PATH | os.O_NOFOLLOW)
        except OSError:
            return None
        try:
            return handle_of(fd)
        finally:
            os.close(fd)


def conflict(path: str, origins: "Mapping[str, bytes | None]", host: HostLookups, baseline: Baseline) -> str:
    """Why the host's ``path`` counts as changed since the session started (or since its last
    apply), or "" when it does not (see the module's text). ``origins``: the upper layer's copy-up
    origin of each directory, by path (upper.UpperEntry.origin)."""
    parts = path.split("/")
    chain = ["/".join(parts[:index + 1]) for index in range(len(parts))]
    anchor = -1
    for index in range(len(chain) - 1, -1, -1):
        stored = origin_handle(origins.get(chain[index]))
        if stored is None:
            continue
        current = host.handle(chain[index])
        if current is None and host.stat(chain[index]) is None:
            return f"{chain[index]} was removed on the host"
        if current is None:
            continue                                # no handle now: judged by its change time below
        if current != stored:
            return f"{chain[index]} was replaced or moved on the host"
        anchor = index
        break
    for index in range(anchor + 1, len(chain)):
        st = host.stat(chain[index])
        if st is HostLookups.BLOCKED:
            return f"{chain[index]} on the host goes through a symlink or another mount"
        if st is None:
            continue
        assert not isinstance(st, str)
        if not baseline.unchanged(chain[index], st):
            return f"{chain[index]} changed on the host"
    if anchor == len(chain) - 1:
        st = host.stat(path)
        if isinstance(st, os.stat_result) and not baseline.unchanged(path, st):
            return f"{path} changed on the host"
    return ""
