"""A review directory as `sandboxd run --review` and `sandboxd changes|apply|discard` use it: opened
and checked, its overlays' upper layers read, and the work that reads or writes the host done as
the owner of the host root, never as root.

* The directory is the caller's own: opened without following a symlink, it must belong to the
  caller and be writable by nobody else (a plain user's kept change set is theirs alone; root's
  `sandboxd run` makes its own 0700). Each overlay's layers are then reached beneath that
  descriptor (kernel.beneath), whatever paths the layers' record names: a record that points
  elsewhere opens nothing outside the directory.
* The upper layer is scanned by the caller (root reads overlay's trusted.* attributes, a plain
  user its user.* ones); comparing it with the host, showing a diff and applying run as the
  owner of the host root: as root in a forked child that drops every privilege (capabilities,
  groups but the owner's, no_new_privs) before it opens the host, so the kernel's permissions
  decide what it may read and write, and review.apply walks every host path beneath the root's
  descriptor (a symlink swapped in is refused, never followed). A plain user's runs in process.
* What the child hands back is JSON, read as data (never code): change records, diff text,
  what an apply did. What stays root's to do (the conflict baseline beside the layers, the
  upper entries an apply made redundant) is done here, in the caller, beneath descriptors.
"""

from __future__ import annotations

import errno
import json
import os
import stat

from sandboxd.errors import InvalidPolicy, SandboxdError
from sandboxd.kernel import beneath, caps, overlay
from sandboxd.review import conflicts, upper
from sandboxd.review.apply import ApplyResult, Skipped
from sandboxd.review.changes import PAGE, Change, ChangeSet, Comparison
from sandboxd.review.kept import DIR_FLAGS

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Callable

MAX_LISTED = 100_000                 # changes one listing shows at most (review.apply takes as many)
MAX_ANSWER = 256 << 20               # bytes a child's answer may have (diffs are bounded per file)


class ReviewError(SandboxdError):
    """The change set could not be read or worked on: one line that says why."""


def refusal(st: os.stat_result, path: str) -> str:
    """Why ``path`` (lstat ``st``) is not a review directory this caller may use, or ""."""
    if not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a directory"
    if st.st_uid != os.geteuid():
        return f"{path} belongs to uid {st.st_uid}, not to you: only the user who ran the command may use it"
    if st.st_mode & 0o022:
        return f"{path} is writable by others (mode {stat.S_IMODE(st.st_mode):o}): refused, it could hold anything"
    return ""


class Layer:
    """One overlay of a review directory: its record, and its directory and upper layer opened
    beneath the review directory's descriptor."""

    def __init__(self, dir_fd: int, layers: overlay.Layers) -> None:
        index = os.path.basename(os.path.dirname(layers.upper))
        if not index.isdigit():
            raise ReviewError(f"the layers' record names {layers.upper!r}, not a layer of this directory")
        self.layers, self.index = layers, index
        self.fd = beneath.open_beneath(dir_fd, index, DIR_FLAGS)
        try:
            self.upper_fd = beneath.open_beneath(self.fd, "upper", DIR_FLAGS)
        except OSError:
            os.close(self.fd)
            raise

    @property
    def root(self) -> str:
        return self.layers.root

    @property
    def place(self) -> str:
        """The layer's directory, for the functions that take a path (the conflict baseline)."""
        return f"/proc/self/fd/{self.fd}"

    def close(self) -> None:
        os.close(self.upper_fd)
        os.close(self.fd)

    def empty(self) -> bool:
        """Whether the sandbox changed nothing here (kernel.overlay.upper_is_empty)."""
        return overlay.upper_is_empty(self.upper_fd, self.root, self.layers.checkpoints)

    def scan(self) -> "list[upper.UpperEntry]":
        return upper.scan(self.upper_fd, prefix=self.layers.xattr_prefix)

    def as_owner(self, body: "Callable[[Comparison], object]") -> "Any":
        """``body`` over this overlay's Comparison, run as the owner of the host root (see the
        module's text); returns what ``body`` returned, as JSON data."""
        entries = self.scan()
        baseline = conflicts.load_baseline(self.place, self.layers.started_ns)

        def compared() -> object:
            host_fd = os.open(self.root, DIR_FLAGS)   # as the owner; Comparison checks it is the very root
            try:
                with Comparison(entries, upper_fd=self.upper_fd, host_fd=host_fd, layers=self.layers,
                                baseline=baseline) as comparison:
                    return plain(body(comparison))
            finally:
                os.close(host_fd)
        if os.geteuid() != 0:
            return json.loads(json.dumps(compared()))
        return _in_child(compared, self.root)

    def forget(self, paths: "list[str]") -> None:
        """Remove the upper entries at ``paths`` (applied: the host has them now; the overlay is
        not mounted any more)."""
        from sandboxd.review import apply as applying
        entries = self.scan()
        known = {entry.path for entry in entries}
        chosen = tuple(path for path in paths if path and path in known)
        if chosen:
            applying.discard(self.upper_fd, entries, chosen)


class KeptDir:
    """A review directory, opened and checked (see the module's text), with its overlays."""

    def __init__(self, path: str) -> None:
        self.path = os.path.abspath(path)
        try:
            self.fd = os.open(self.path, DIR_FLAGS)
        except OSError as exc:
            raise InvalidPolicy(f"cannot open review directory {self.path}: "
                                f"{os.strerror(exc.errno or errno.EIO)}") from None
        self.layers: list[Layer] = []
        try:
            why = refusal(os.fstat(self.fd), self.path)
            if why:
                raise InvalidPolicy(why)
            try:
                records = overlay.load(f"/proc/self/fd/{self.fd}")
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise InvalidPolicy(f"{self.path} holds no change set of `sandboxd run --review` "
                                    f"(its layers' record: {exc})") from None
            for record in records:
                self.layers.append(Layer(self.fd, record))
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for layer in self.layers:
            layer.close()
        self.layers = []
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "KeptDir":
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def empty(self) -> bool:
        return all(layer.empty() for layer in self.layers)

    def remove(self) -> None:
        """Remove the change set for good (the directory too)."""
        self.close()
        overlay.remove_layers(self.path)

    def locate(self, path: str) -> "tuple[Layer, str]":
        """The overlay a host ``path`` (absolute, or relative to the current directory) is in, and
        the path relative to its root; InvalidPolicy when it is in none."""
        for candidate in dict.fromkeys((os.path.abspath(path), os.path.realpath(path))):
            for layer in sorted(self.layers, key=lambda item: -len(item.root)):
                if candidate == layer.root:
                    return layer, ""
                if candidate.startswith(layer.root.rstrip("/") + "/"):
                    return layer, candidate[len(layer.root.rstrip("/")) + 1:]
        roots = ", ".join(layer.root for layer in self.layers)
        raise InvalidPolicy(f"{path} is in none of this change set's roots ({roots})")

    def select(self, paths: "list[str]") -> "list[tuple[Layer, tuple[str, ...]]]":
        """Each overlay with the paths chosen in it ("": all); with no ``paths``, every overlay, all."""
        if not paths:
            return [(layer, ("",)) for layer in self.layers]
        chosen: dict[str, list[str]] = {}
        for path in paths:
            layer, rel = self.locate(path)
            chosen.setdefault(layer.index, []).append(rel)
        return [(layer, tuple(dict.fromkeys(chosen[layer.index]))) for layer in self.layers if layer.index in chosen]


def list_all(comparison: Comparison, paths: "tuple[str, ...]", limit: int = MAX_LISTED) -> ChangeSet:
    """The changes at ``paths`` and below ("": all), at most ``limit`` (next_after says more)."""
    found: list[Change] = []
    seen: set[str] = set()                          # a path under two of ``paths`` is listed once
    unhashed, more = 0, ""
    for under in paths:
        after = ""
        while len(found) < limit:
            page = comparison.list(after=after, limit=min(PAGE, limit - len(found)), under=under)
            fresh = [change for change in page.changes if change.path not in seen]
            seen.update(change.path for change in fresh)
            found += fresh
            unhashed += page.unhashed
            if not page.next_after:
                break
            after = more = page.next_after
        if len(found) >= limit:
            break
        more = ""
    return ChangeSet(root=comparison.layers.root, changes=tuple(found), next_after=more, unhashed=unhashed)


def change_set(data: "dict[str, Any]") -> ChangeSet:
    """A ChangeSet from a child's JSON (checked: unknown fields refused by the records)."""
    fields: "list[dict[str, Any]]" = [{key: tuple(value) if isinstance(value, list) else value
                                       for key, value in item.items()} for item in data["changes"]]
    changes = tuple(Change(**item) for item in fields)
    return ChangeSet(root=str(data["root"]), changes=changes, next_after=str(data["next_after"]),
                     unhashed=int(data["unhashed"]))


def apply_result(data: "dict[str, Any]") -> ApplyResult:
    """The parts of an ApplyResult from a child's JSON that the caller acts on."""
    baseline = conflicts.Baseline(started_ns=int(data["baseline"]["started_ns"]),
                                  applied={str(key): int(value) for key, value in data["baseline"]["applied"].items()})
    from sandboxd.review.apply import Applied
    return ApplyResult(applied=tuple(Applied(str(item["path"]), str(item["kind"])) for item in data["applied"]),
                       skipped=tuple(Skipped(str(item["path"]), str(item["reason"])) for item in data["skipped"]),
                       created=tuple(str(path) for path in data["created"]), baseline=baseline,
                       forgettable=tuple(str(path) for path in data["forgettable"]))


def plain(value: object) -> object:
    """A record as JSON data: fields by name, tuples as lists."""
    if hasattr(value, "as_dict"):
        return {key: plain(item) for key, item in value.as_dict().items()}
    if isinstance(value, (tuple, list)):
        return [plain(item) for item in value]
    if isinstance(value, dict):
        return {str(key): plain(item) for key, item in value.items()}
    return value


def _owner(root: str) -> "tuple[int, int, tuple[int, ...]]":
    """The host root's owner, its group and the owner's groups (none when it has no account)."""
    st = os.stat(root)
    import pwd
    try:
        name = pwd.getpwuid(st.st_uid).pw_name
        groups = tuple(os.getgrouplist(name, st.st_gid))
    except KeyError:
        groups = ()
    return st.st_uid, st.st_gid, groups


def _in_child(work: "Callable[[], object]", root: str) -> "Any":
    """``work()`` in a forked child that became the owner of ``root`` (caps.drop_privileges: no
    capability, no_new_privs); its JSON answer, or ReviewError with the child's one line."""
    uid, gid, groups = _owner(root)      # uid 0 too: without capabilities, only its own files' rights
    read, write = os.pipe2(os.O_CLOEXEC)
    pid = os.fork()
    if pid == 0:                                                  # pragma: no cover - the child
        code = 0
        try:
            os.close(read)
            caps.drop_privileges(uid, gid, groups)
            answer: object = {"ok": work()}
        except BaseException as exc:  # noqa: BLE001 - reported to the parent as one line
            answer, code = {"error": str(exc) or type(exc).__name__}, 1
        try:
            data = json.dumps(answer).encode()
            view = memoryview(data)
            while view:
                view = view[os.write(write, view):]
        finally:
            os._exit(code)
    os.close(write)
    chunks, total = [], 0
    try:
        while chunk := os.read(read, 1 << 16):
            total += len(chunk)
            if total > MAX_ANSWER:
                raise ReviewError("the change set's answer is too big to show: name fewer paths")
            chunks.append(chunk)
    finally:
        os.close(read)
        os.waitpid(pid, 0)
    try:
        answer = json.loads(b"".join(chunks))
    except ValueError:
        raise ReviewError("the review's worker ended without an answer") from None
    if not isinstance(answer, dict) or "ok" not in answer:
        raise ReviewError(str(answer.get("error", "no answer") if isinstance(answer, dict) else "no answer"))
    return answer["ok"]
