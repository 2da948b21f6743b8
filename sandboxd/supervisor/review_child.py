"""A review request's child (fork_protocol.Review): what runs between the fork server and a review
session's change set.

The fork server forks it (``start``) and hands the daemon the read end of a pipe; the child writes
one JSON object there and exits. The loop never waits on it: its pidfd is reaped whenever it goes,
and it is SIGKILLed at its deadline (fork_server._review). In the child, in this order:

1. as root: the layers' record of the session's review directory is read, each selected root's
   layers opened (review.kept.open_stack: the upper, then its checkpoints newest first) and
   scanned as one change set (review.upper.scan_stack: overlay's ``trusted.*`` attributes need
   CAP_SYS_ADMIN), and its conflict baseline loaded; for ``discard``, the selected entries are
   removed from every layer (the daemon closed the session's sandbox first: overlayfs forbids
   changing a layer while it is mounted), and that is all; ``checkpoint``, ``checkpoints`` and
   ``rollback`` (review.checkpoints, the sandbox closed too) are done as root and answered;
2. as the session's owner (its uid, gid and groups; root's own session: the workspace's owner),
   every capability dropped and no_new_privs (kernel.caps.drop_privileges): the host roots are opened by the real paths the session was built on
   (review.changes.Comparison checks each is the very directory its layers were made over), and
   the changes listed, shown or applied (review.apply: every host path walked beneath the root's
   descriptor, never through a symlink);
3. after an apply, the new conflict baselines go back in the answer: the daemon saves them in the
   review directory, which is root's (this child keeps no privilege to write it).

Paths cross as [root, path below it] pairs, the daemon having judged them against the session's
roots; a listing's page token is "ROOT-INDEX:SELECTION-INDEX:AFTER-PATH".
"""

from __future__ import annotations

import json
import os

from sandboxd.errors import InvalidPolicy, SandboxdError, SetupError
from sandboxd.kernel import caps, overlay
from sandboxd.review import checkpoints, conflicts, kept, upper
from sandboxd.review.changes import Change, Comparison, fingerprint, unwire_path

TYPE_CHECKING = False
if TYPE_CHECKING:
    from sandboxd.supervisor.fork_protocol import Review

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
ACTIONS = ("list", "diff", "apply", "discard", "checkpoint", "checkpoints", "rollback", "changed")
MAX_PAGE = 10_000
MAX_DIFF_BYTES = 4 << 20


def start(request: "Review", reviewed_fd: int = -1) -> tuple[int, int, int]:
    """Fork the child for ``request`` (``reviewed_fd``: the memfd of its reviewed triples, -1 none;
    the caller closes its copy): (pid, pidfd, the read end of its answer's pipe)."""
    read_end, write_end = os.pipe2(os.O_CLOEXEC)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child only answers, through the pipe
        os.close(read_end)
        code = 0
        try:
            _answer(write_end, _serve(request, reviewed_fd))
        except BaseException:  # noqa: BLE001 - the daemon reads a short answer and says so
            code = 1
        os._exit(code)
    os.close(write_end)
    return pid, os.pidfd_open(pid), read_end


def _answer(fd: int, result: dict[str, object]) -> None:
    view = memoryview(json.dumps(result).encode())
    while view:
        view = view[os.write(fd, view):]


def _serve(request: "Review", reviewed_fd: int = -1) -> dict[str, object]:
    try:
        return _run(request, _reviewed(reviewed_fd))
    except SandboxdError as exc:
        return {"error": exc.to_dict()}
    except OSError as exc:
        return {"error": SetupError("review", exc.errno or 0, exc.filename,
                                    detail="the change set could not be read").to_dict()}


class _Layer:
    """One root's overlay, opened as root: its layers' descriptors (the upper, then the checkpoints
    newest first), their merged entries and its baseline."""

    def __init__(self, layers: overlay.Layers) -> None:
        self.layers = layers
        self.stack = kept.open_stack(layers)        # left to the child's exit to close
        self.upper_fd, self.checkpoint_fds = self.stack[0], self.stack[1:]
        self.entries = upper.scan_stack(self.stack, prefix=layers.xattr_prefix)
        self.baseline = conflicts.load_baseline(os.path.dirname(layers.upper), layers.started_ns)


MAX_REVIEWED_BYTES = 32 << 20          # the reviewed triples' memfd (service.review_calls makes it)


def _reviewed(fd: int) -> list[list[str]]:
    """The [root, path, fingerprint] triples in the memfd ``fd`` (-1: none), read as JSON."""
    if fd < 0:
        return []
    size = os.fstat(fd).st_size
    if size > MAX_REVIEWED_BYTES:
        raise InvalidPolicy(f"the reviewed changes take {size} bytes, more than {MAX_REVIEWED_BYTES}")
    data = bytearray()
    while len(data) < size:
        block = os.pread(fd, size - len(data), len(data))
        if not block:
            break
        data += block
    triples = json.loads(bytes(data) or b"[]")
    if not isinstance(triples, list) or not all(
            isinstance(item, list) and len(item) == 3 and all(isinstance(part, str) for part in item) for item in triples):
        raise InvalidPolicy("the reviewed changes are not [root, path, fingerprint] triples")
    return triples


def _run(request: "Review", reviewed: "list[list[str]] | None" = None) -> dict[str, object]:
    if request.action not in ACTIONS:
        raise InvalidPolicy(f"review action {request.action!r} is not one of {', '.join(ACTIONS)}")
    if request.action in ("checkpoint", "checkpoints", "rollback", "changed"):
        return _checkpoints(request)
    kept_layers = {layer.root: layer for layer in overlay.load(request.review_dir)}
    missing = [root for root in request.roots if root not in kept_layers]
    if missing:
        raise InvalidPolicy(f"the session's change set has no layer for {missing[0]!r}")
    layers = [_Layer(kept_layers[root]) for root in request.roots]
    selected = _selection(request.roots, request.paths)
    if request.action == "discard":
        return _discard(layers, selected)
    _become_owner(request, layers[0].layers)
    if request.action == "apply":
        return _apply(request, layers, selected, reviewed or [])
    return _list(request, layers, selected)


def _selection(roots: list[str], pairs: list[list[str]]) -> list[tuple[str, ...]]:
    """Per root, the paths selected below it ("": all of it); () for a root none was selected in."""
    if not pairs:
        return [("",) for _ in roots]
    chosen: list[list[str]] = [[] for _ in roots]
    for pair in pairs:
        if len(pair) != 2 or pair[0] not in roots:
            raise InvalidPolicy(f"review path {pair!r} is not [root, path] of one of the session's roots")
        chosen[roots.index(pair[0])].append(unwire_path(pair[1]))     # as a listing named it
    return [tuple(sorted(set(paths))) for paths in chosen]


def _become_owner(request: "Review", workspace: overlay.Layers) -> None:
    """The session owner's uid, gid and groups, every capability dropped and no_new_privs
    (kernel.caps.drop_privileges): the kernel's permissions decide what it may read and write.
    Root's own session acts as its workspace's owner, as its commands do (sessions.access.command_user);
    a root-owned workspace's as uid 0 without capabilities (only its own files' rights)."""
    caller = request.caller
    groups: tuple[int, ...]
    if caller is None:
        # By a descriptor checked to be the directory the session started on: a name on the way
        # there (one its owner may rename) must not pick whose rights the apply has.
        st = overlay.root_attributes(workspace, "nothing of its change set is shown or applied")
        uid, gid, groups = st.st_uid, st.st_gid, (st.st_gid,)
    else:
        uid, gid, groups = caller.uid, caller.gid, tuple(caller.groups)
    caps.drop_privileges(uid, gid, groups)


def _comparison(layer: _Layer) -> Comparison:
    host_fd = os.open(layer.layers.root, DIR_FLAGS)   # as the owner; Comparison checks it is the same directory
    try:
        return Comparison(layer.entries, upper_fd=layer.upper_fd, host_fd=host_fd, layers=layer.layers,
                          baseline=layer.baseline, checkpoint_fds=layer.checkpoint_fds)
    except BaseException:
        os.close(host_fd)
        raise


def change_dict(root: str, change: Change) -> dict[str, object]:
    fields = change.as_dict()
    fields.pop("stamp", None)
    return {"root": root, **fields, "fingerprint": fingerprint(change)}


def parse_page(token: str, roots: int) -> tuple[int, int, str]:
    """A page token: (root index, selection index, the last path listed)."""
    if not token:
        return 0, 0, ""
    parts = token.split(":", 2)
    try:
        root, selection = int(parts[0]), int(parts[1])
        after = parts[2]
    except (IndexError, ValueError):
        raise InvalidPolicy(f"page token {token!r} is not one a listing gave") from None
    if not 0 <= root < roots or selection < 0:
        raise InvalidPolicy(f"page token {token!r} is not one a listing gave")
    return root, selection, after


def _list(request: "Review", layers: list[_Layer], selected: list[tuple[str, ...]]) -> dict[str, object]:
    """A page of changes (``list``) or of their diff (``diff``), root by root, selection by
    selection: at most ``limit`` changes, and for a diff about ``max_bytes`` of text (one change's
    diff at least; each side of one read up to review.diff.MAX_BYTES)."""
    from sandboxd.review import diff

    limit = max(1, min(request.limit or 1000, MAX_PAGE))
    budget = max(1, min(request.max_bytes or (1 << 20), MAX_DIFF_BYTES))
    start_root, start_selection, after = parse_page(request.page, len(layers))
    changes: list[dict[str, object]] = []
    text: list[str] = []
    seen: list[list[str]] = []              # a diff's [root, path, fingerprint] for what it shows
    unhashed = 0
    for index in range(start_root, len(layers)):
        layer = layers[index]
        with _comparison(layer) as compared:
            for position, under in enumerate(selected[index]):
                if (index, position) < (start_root, start_selection):
                    continue
                mark = after if (index, position) == (start_root, start_selection) else ""
                room = limit - len(changes) - len(text)
                if room <= 0 or budget <= 0:
                    return _page(request.action, changes, text, seen, unhashed, f"{index}:{position}:{mark}")
                page = compared.list(after=mark, limit=room, under=under)
                unhashed += page.unhashed
                for change in page.changes:
                    if request.action == "diff":
                        shown = diff.shown(compared, change, max_bytes=min(budget, diff.MAX_BYTES))
                        # Past what is left of the page (too big for the page's rest only, or
                        # longer): on the next page, where it has the whole budget.
                        if text and (len(shown.text) > budget or (shown.too_big and budget < diff.MAX_BYTES)):
                            return _page(request.action, changes, text, seen, unhashed,
                                         f"{index}:{position}:{mark}")
                        budget -= len(shown.text)
                        text.append(shown.text)
                        if shown.fingerprint:                   # shown in full: vouched for
                            seen.append([layer.layers.root, change.path, shown.fingerprint])
                    else:
                        changes.append(change_dict(layer.layers.root, change))
                    mark = change.path
                if page.next_after:
                    return _page(request.action, changes, text, seen, unhashed, f"{index}:{position}:{mark}")
    return _page(request.action, changes, text, seen, unhashed, "")


def _page(action: str, changes: list[dict[str, object]], text: list[str], seen: list[list[str]], unhashed: int,
          token: str) -> dict[str, object]:
    if action == "diff":
        return {"diff": "".join(text), "shown": seen, "next": token}
    return {"changes": changes, "next": token, "unhashed": unhashed}


def _apply(request: "Review", layers: list[_Layer], selected: list[tuple[str, ...]],
           triples: "list[list[str]]") -> dict[str, object]:
    from sandboxd.review import apply as applying

    flagged: dict[str, set[str]] = {}
    for pair in request.include_flagged:
        if len(pair) == 2:
            flagged.setdefault(pair[0], set()).add(pair[1])
    reviewed: dict[str, dict[str, str]] = {}            # root -> path -> fingerprint the person saw
    for triple in triples:
        if len(triple) == 3:
            reviewed.setdefault(triple[0], {})[unwire_path(triple[1])] = triple[2]
    applied: list[dict[str, object]] = []
    skipped: list[dict[str, object]] = []
    forgettable: dict[str, list[str]] = {}
    baselines: list[dict[str, object]] = []
    for layer, paths in zip(layers, selected, strict=True):
        if not paths:
            continue
        root = layer.layers.root
        with _comparison(layer) as compared:
            result = applying.apply(compared, paths, force=request.force,
                                    include_flagged=frozenset(flagged.get(root, ())),
                                    reviewed=reviewed.get(root, {}) if request.only_reviewed else None)
        applied += [{"root": root, **item.as_dict()} for item in result.applied]
        skipped += [{"root": root, **item.as_dict()} for item in result.skipped]
        forgettable[root] = list(result.forgettable)
        # Saved by the daemon (the review directory is root's; this child is not).
        baselines.append({"layer": os.path.basename(os.path.dirname(layer.layers.upper)),
                          "started_ns": result.baseline.started_ns,
                          "applied": dict(result.baseline.applied)})
    return {"applied": applied, "skipped": skipped, "forgettable": forgettable, "baselines": baselines}


def _discard(layers: list[_Layer], selected: list[tuple[str, ...]]) -> dict[str, object]:
    from sandboxd.review import apply as applying

    removed: list[dict[str, object]] = []
    skipped: list[dict[str, object]] = []
    for layer, paths in zip(layers, selected, strict=True):
        if not paths:
            continue
        root = layer.layers.root
        kinds = {entry.path: entry.kind for entry in layer.entries}
        result = applying.discard(layer.upper_fd, layer.entries, paths, checkpoint_fds=layer.checkpoint_fds)
        removed += [{"root": root, "path": path, "type": kinds.get(path, "")} for path in result.removed]
        skipped += [{"root": root, **item.as_dict()} for item in result.skipped]
    return {"discarded": removed, "skipped": skipped}


def checkpoint_dict(item: checkpoints.Checkpoint) -> dict[str, object]:
    return item.as_dict()


def _checkpoints(request: "Review") -> dict[str, object]:
    """As root, the session's sandbox closed (the daemon's between_calls): mark a checkpoint
    (``label``; ``limit``: review.max_checkpoints), list them, or roll back to ``checkpoint``."""
    review_dir = request.review_dir
    if request.action == "changed":             # read only: the overlays may stay mounted
        return {"changed": any(checkpoints.changed_since_last(layers) for layers in overlay.load(review_dir))}
    if request.action == "checkpoint":
        made = (checkpoints.create_if_changed(review_dir, request.label, limit=request.limit,
                                              call_id=request.before_call)
                if request.before_call else checkpoints.create(review_dir, request.label, limit=request.limit))
        return {"checkpoint": None if made is None else checkpoint_dict(made)}
    if request.action == "rollback":
        done = checkpoints.rollback(review_dir, request.checkpoint)
        return {"rollback": done.as_dict(),
                "checkpoints": [checkpoint_dict(item) for item in checkpoints.list_checkpoints(review_dir)]}
    return {"checkpoints": [checkpoint_dict(item) for item in checkpoints.list_checkpoints(review_dir)]}
