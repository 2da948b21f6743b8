"""An overlay's upper layer, read into typed entries.

What overlayfs (with the options of kernel.overlay: no index, no metacopy, no redirects) leaves
in an upper layer is the change set itself:

* a regular file, symlink, FIFO: written by the sandbox, either new or a full copy-up of a host
  file (then with an ``origin`` attribute: the host file's handle when it was copied);
* a directory: merged with the host's directory of that name (copied up: it holds changed
  entries, its own attributes are the sandbox's), or *opaque* (``opaque`` = "y": the host's
  directory of that name is hidden, the sandbox replaced it), or new;
* a whiteout: a character device 0/0 (what overlayfs makes), or a zero-size regular file with
  the ``whiteout`` attribute in a directory whose ``opaque`` is "x" (the form the documentation
  also allows): the host's entry of that name is deleted.

Attributes are ``trusted.overlay.*`` (root's overlays: only a process with CAP_SYS_ADMIN sees
them, so this reading runs as root) or ``user.overlay.*`` (``userxattr``, rootless). The sandbox
cannot forge either: overlayfs refuses its own attribute names through the overlay, and trusted.*
needs CAP_SYS_ADMIN besides.

The walk is O(entries): only what the upper layer holds is listed, never the host's tree. Each
directory is opened beneath the upper layer's descriptor (kernel.beneath.STRICT: never through a
symlink, never into another mount), names are read with lstat, attributes of a non-directory
through its parent's descriptor without following it. A sandbox still running can change the
layer meanwhile: what is read is then either before or after, never outside.

With checkpoints (review.checkpoints) the overlay has several layers of sandboxd's over the host:
the upper, then the checkpoint layers newest first (kernel.overlay.Layers.stack), each a former
upper. ``scan_stack`` reads each and ``merge`` makes them one change set against the host, as
overlayfs's lookup sees them: the topmost entry at a path decides; a directory merges with the
directories below it down to the first opaque one; a whiteout, a non-directory or an opaque
directory hides everything below it in lower layers. A merged directory is opaque when the last
directory of its chain is (it replaced the host's), and its ``origin`` is that last directory's:
a copy-up from a checkpoint layer stores the handle of the checkpoint's directory (overlayfs
names the lower it copied from), while the conflict check needs the host's, which only the
bottom of the chain holds.
"""

from __future__ import annotations

import errno
import os
import stat

from sandboxd._record import Record
from sandboxd.errors import Exhausted
from sandboxd.kernel import beneath
from sandboxd.policy.limits import PATH_MAX

# Entries of one upper layer read at most (a listing past it is refused, saying so).
MAX_ENTRIES = 200_000
DIR, FILE, SYMLINK, WHITEOUT, OTHER = "dir", "file", "symlink", "whiteout", "other"


class UpperEntry(Record):
    path: str                   # relative to the root, "/"-separated; "" is the root itself
    kind: str                   # DIR, FILE, SYMLINK, WHITEOUT, OTHER
    mode: int = 0               # st_mode, type bits included
    uid: int = 0
    gid: int = 0
    size: int = 0
    ino: int = 0                # with ctime_ns: the entry as it was read, which an apply checks again
    ctime_ns: int = 0
    opaque: bool = False        # a directory that hides the host's directory of its name
    target: str = ""            # a symlink's target
    # The copy-up origin: None for an entry the sandbox made; b"" for a copy-up whose host file
    # system gives no handles; else overlay's encoded handle of the host object (conflicts.origin_handle).
    origin: bytes | None = None
    layer: int = 0              # which layer holds it: an index into Layers.stack (0: the upper)


GONE = UpperEntry(path="", kind="")


def kind_of(mode: int, rdev: int = -1) -> str:
    if stat.S_ISDIR(mode):
        return DIR
    if stat.S_ISREG(mode):
        return FILE
    if stat.S_ISLNK(mode):
        return SYMLINK
    if stat.S_ISCHR(mode) and rdev == 0:
        return WHITEOUT
    return OTHER


def _xattr(path_or_fd: "str | int", name: str) -> bytes | None:
    try:
        return os.getxattr(path_or_fd, name, follow_symlinks=False) if isinstance(path_or_fd, str) \
            else os.getxattr(path_or_fd, name)
    except OSError as exc:
        if exc.errno in (errno.ENODATA, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOENT):
            return None
        raise


def _entry(rel: str, st: os.stat_result, *, target: str = "", origin: bytes | None = None) -> UpperEntry:
    return UpperEntry(path=rel, kind=kind_of(st.st_mode, st.st_rdev), mode=st.st_mode, uid=st.st_uid,
                      gid=st.st_gid, size=st.st_size, ino=st.st_ino, ctime_ns=st.st_ctime_ns, target=target,
                      origin=origin)


def scan(upper_fd: int, *, prefix: str, max_entries: int = MAX_ENTRIES, layer: int = 0) -> list[UpperEntry]:
    """Every entry of the upper layer at ``upper_fd`` (the root's own first), sorted by path.
    ``prefix``: overlay's attribute prefix (kernel.overlay.Layers.xattr_prefix). ``layer``: the
    layer's index in Layers.stack, given to every entry. Raises Exhausted past ``max_entries``,
    OSError when the layer cannot be read."""
    opaque_name, whiteout_name, origin_name = prefix + "opaque", prefix + "whiteout", prefix + "origin"
    found: list[UpperEntry] = []
    directories: dict[str, int] = {}            # a directory's place in ``found``, completed when opened
    pending = [""]
    while pending:
        rel = pending.pop()
        try:
            fd = beneath.open_beneath(upper_fd, rel, beneath.DIRECTORY)
        except FileNotFoundError:
            if rel == "":
                raise
            found[directories.pop(rel)] = GONE      # removed meanwhile (a sandbox still running)
            continue
        except OSError as exc:
            if exc.errno != errno.ENAMETOOLONG:
                raise
            # A sandbox can make a tree deeper than any path names (mkdir, cd, mkdir...): its paths
            # can be neither shown nor applied, and the raw error would quote kilobytes of them.
            raise Exhausted(f"the change set holds a path longer than the kernel's {PATH_MAX} bytes (in "
                            f"{rel[:60]}...): it cannot be listed or applied path by path; discard it all") from None
        try:
            st = os.fstat(fd)
            marker = _xattr(fd, opaque_name)
            if rel == "":
                found.append(_entry("", st))
            else:
                index = directories.pop(rel)
                found[index] = found[index].replace(opaque=marker == b"y", origin=_xattr(fd, origin_name))
            # "x": a merged directory holding whiteouts of the attribute form (not opaque itself).
            attribute_whiteouts = marker == b"x"
            names = sorted(os.listdir(fd))
            if len(found) + len(names) > max_entries:
                raise Exhausted(f"the change set has more than {max_entries} entries: list a path inside it, "
                                "or discard what is not wanted")
            subdirs = []
            for name in names:
                child = f"{rel}/{name}" if rel else name
                entry_st = beneath.lstat_at(fd, name)
                if entry_st is None:
                    continue                            # gone meanwhile (a sandbox still running)
                kind = kind_of(entry_st.st_mode, entry_st.st_rdev)
                at = f"/proc/self/fd/{fd}/{name}"       # the entry itself, in this very directory
                if kind == DIR:
                    directories[child] = len(found)
                    found.append(_entry(child, entry_st))
                    subdirs.append(child)
                    continue
                if kind == FILE and attribute_whiteouts and entry_st.st_size == 0 \
                        and _xattr(at, whiteout_name) is not None:
                    found.append(_entry(child, entry_st).replace(kind=WHITEOUT))
                    continue
                if kind == WHITEOUT:
                    found.append(_entry(child, entry_st))
                    continue
                target = os.readlink(name, dir_fd=fd) if kind == SYMLINK else ""
                found.append(_entry(child, entry_st, target=target, origin=_xattr(at, origin_name)))
            pending.extend(reversed(subdirs))       # depth first, in name order
        finally:
            os.close(fd)
    present = [entry.replace(layer=layer) if layer else entry for entry in found if entry is not GONE]
    present.sort(key=lambda entry: entry.path)
    return present


def scan_stack(layer_fds: "tuple[int, ...]", *, prefix: str, max_entries: int = MAX_ENTRIES) -> list[UpperEntry]:
    """The merged change set of the layers at ``layer_fds`` (Layers.stack's order: the upper first,
    then the checkpoints newest first), sorted by path; ``max_entries`` bounds all layers together.
    One layer: exactly ``scan``."""
    layers: list[list[UpperEntry]] = []
    left = max_entries
    for index, fd in enumerate(layer_fds):
        layers.append(scan(fd, prefix=prefix, max_entries=left, layer=index))
        left -= len(layers[-1])
    return merge(layers)


def below_any(path: str, cut: "set[str]") -> bool:
    """Whether ``path`` or a directory above it is in ``cut``."""
    if path in cut:
        return True
    end = path.rfind("/")
    while end > 0:
        if path[:end] in cut:
            return True
        end = path.rfind("/", 0, end)
    return False


def merge(layers: "list[list[UpperEntry]]") -> list[UpperEntry]:
    """The entries of stacked layers (top first) as one layer over the host (see the module's text)."""
    if len(layers) == 1:
        return layers[0]
    merged: dict[str, UpperEntry] = {}
    cut: set[str] = set()                       # paths the layers below the current one cannot show
    for entries in layers:
        cut_here: list[str] = []
        for entry in entries:
            if entry.path and below_any(entry.path, cut):
                continue
            above = merged.get(entry.path)
            if above is None:
                merged[entry.path] = entry
            elif entry.kind == DIR:
                # The chain of a merged directory goes on: the host-side facts are the lowest one's.
                merged[entry.path] = above.replace(opaque=entry.opaque, origin=entry.origin)
            else:
                # A directory over a non-directory or a whiteout: overlayfs's lookup stops there,
                # so the directory hides whatever the host has at its path.
                merged[entry.path] = above.replace(opaque=True, origin=None)
            now = merged[entry.path]
            if entry.path and (now.kind != DIR or now.opaque):
                cut_here.append(entry.path)
        cut.update(cut_here)
    return sorted(merged.values(), key=lambda entry: entry.path)

