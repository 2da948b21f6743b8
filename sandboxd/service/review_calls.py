"""Review mode's RPCs: ListChanges, DiffChanges, ApplyChanges, DiscardChanges (docs/review-mode.md).

Each request is judged here (who may, which session, which paths) and carried out by a child of
the fork server (fork_protocol.Review, supervisor.review_child): the daemon's gRPC process never
forks nor reads a change set itself. Paths are judged against what the fork server built for the
session (its real roots: Session.built), never looked up again here: a path names a host path
under one of the session's roots, absolute or relative to the workspace, and crosses as
[root, path below it]. Callers: the session's owner, root and the admin group (sessions.access:
anyone else's is NOT_FOUND). Every apply and discard is an audit event (EventType.CHANGES_APPLIED,
CHANGES_DISCARDED) naming the paths and content hashes, never contents. A closed session's kept
change set takes the same four, without a sandbox (Target.session None: its roots from its layers'
record); one its apply or discard leaves empty is removed, its store with it (docs/review-mode.md,
"After the close"). CreateCheckpoint, ListCheckpoints and RollbackChanges (review.checkpoints, in
the same child, as root) take an open session only; a checkpoint and a rollback are between calls
and audit events (EventType.CHECKPOINT_CREATED, CHANGES_ROLLED_BACK).
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable, Iterable
from typing import NamedTuple, TypeVar

from sandboxd.audit.store import EventStore, EventType
from sandboxd.errors import Exhausted, InvalidPolicy, NotFound, SandboxdError, SetupError, WrongState
from sandboxd.kernel import overlay
from sandboxd.policy.sandbox import is_within
from sandboxd.review import conflicts
from sandboxd.review.changes import wire_path
from sandboxd.review.checkpoints import MAX_LABEL
from sandboxd.service.callers import Caller, acted_by, session_owner
from sandboxd.service.quotas import cgroup_owner
from sandboxd.service.sessions.access import rights_of, visible_ids
from sandboxd.service.sessions.registry import SessionRegistry
from sandboxd.service.sessions.state import Session
from sandboxd.supervisor.fork_client import ForkServer
from sandboxd.supervisor.fork_protocol import REVIEW_SECONDS, CallerRecord, Review
from sandboxd.v1 import sandboxd_pb2 as pb

T = TypeVar("T")

DEFAULT_PAGE = 1000
MAX_PAGE = 10_000
DEFAULT_DIFF_BYTES = 1 << 20
MAX_DIFF_BYTES = 4 << 20
MAX_PATHS = 10_000                  # paths one request may name (each crosses to the fork server)
# How long the daemon reads a review child's answer: the fork server SIGKILLs it at REVIEW_SECONDS.
ANSWER_SECONDS = REVIEW_SECONDS + 5

KINDS = {"added": pb.FileChange.ADDED, "modified": pb.FileChange.MODIFIED, "deleted": pb.FileChange.DELETED,
         "replaced": pb.FileChange.REPLACED, "type changed": pb.FileChange.TYPE_CHANGED,
         "metadata": pb.FileChange.METADATA}
NUMBERS = ("mode", "host_mode", "uid", "gid", "host_uid", "host_gid", "size", "host_size")
TEXTS = ("type", "host_type", "sha256", "host_sha256", "target", "host_target", "conflict", "fingerprint")
MAX_REVIEWED = 10_000                   # ApplyChangesRequest.reviewed (sandboxd.client sends more in parts)


Pairs = list[list[str]]                 # [root, path below it], as targets() makes them


def targets(roots: list[str], paths: "list[str] | tuple[str, ...]", what: str = "path") -> Pairs:
    """``paths`` (absolute, or relative to the workspace ``roots[0]``) as [root, path below it],
    each under the deepest of the session's ``roots`` that holds it; InvalidPolicy naming the roots
    for one under none."""
    if len(paths) > MAX_PATHS:
        raise InvalidPolicy(f"at most {MAX_PATHS} paths at once, got {len(paths)}: name their directories instead")
    pairs: list[list[str]] = []
    for path in paths:
        if not path or "\0" in path:
            raise InvalidPolicy(f"{what} {path!r} must be a path (absolute, or relative to the workspace) without NUL")
        full = os.path.normpath(path if path.startswith("/") else os.path.join(roots[0], path))
        holders = [root for root in roots if is_within(full, root)]
        if not holders:
            raise InvalidPolicy(f"{what} {path!r} is not under one of the session's roots ({', '.join(roots)}): name a "
                                "path in the workspace or a writable root")
        root = max(holders, key=len)
        pairs.append([root, "" if full == root else os.path.relpath(full, root)])
    return pairs


def _named(paths: "Pairs") -> list[str]:
    """The paths a request named, as an audit event keeps them ("(all)": none named)."""
    return [f"{root}/{path}" if path else root for root, path in paths] or ["(all)"]


def _memfd(triples: "list[list[str]]") -> int:
    """The reviewed triples as JSON in a sealed memfd, for the review child (fork_protocol.Review.reviewed_fd)."""
    import json
    fd = os.memfd_create("sandboxd-reviewed", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        view = memoryview(json.dumps(triples).encode())
        while view:
            view = view[os.write(fd, view):]
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _reviewed(roots: list[str], given: "Iterable[pb.ReviewedChange]") -> "list[list[str]]":
    """ApplyChangesRequest.reviewed as [root, path below it, fingerprint]; InvalidPolicy saying what
    to fix for a root not the session's, a path that is not one, or a fingerprint that is not one."""
    items = list(given)
    if len(items) > MAX_REVIEWED:
        raise InvalidPolicy(f"reviewed names at most {MAX_REVIEWED} changes, got {len(items)}: apply a "
                            "directory at a time")
    triples: list[list[str]] = []
    for item in items:
        if item.root not in roots:
            raise InvalidPolicy(f"reviewed root {item.root!r} is not one of the session's roots "
                                f"({', '.join(roots)}): pass what ListChanges or DiffChanges gave")
        if "\0" in item.path or item.path.startswith("/") or ".." in item.path.split("/") or \
                (item.path and os.path.normpath(item.path) != item.path):
            raise InvalidPolicy(f"reviewed path {item.path!r} is not a change's path: pass what ListChanges "
                                "or DiffChanges gave")
        if len(item.fingerprint) != 64 or not all(c in "0123456789abcdef" for c in item.fingerprint):
            raise InvalidPolicy(f"reviewed fingerprint {item.fingerprint[:80]!r} of {item.path!r} is not a "
                                "SHA-256 in hex: pass what ListChanges or DiffChanges gave")
        triples.append([item.root, item.path, item.fingerprint])
    return triples


def change_to_proto(item: dict[str, object]) -> pb.FileChange:
    change = pb.FileChange(root=_text(item.get("root", "")), path=_text(item.get("path", "")),
                           kind=KINDS.get(str(item.get("kind")), pb.FileChange.KIND_UNSPECIFIED))
    for name in NUMBERS:
        value = item.get(name)
        if isinstance(value, int) and value >= 0:
            setattr(change, name, value)
    for name in TEXTS:
        setattr(change, name, _text(item.get(name) or ""))
    change.aspects.extend(str(aspect) for aspect in _items(item.get("aspects")))
    change.flags.extend(str(flag) for flag in _items(item.get("flags")))
    return change


def _items(value: object) -> list[object]:
    return list(value) if isinstance(value, (list, tuple)) else []


def _dicts(value: object) -> list[dict[str, object]]:
    return [item for item in _items(value) if isinstance(item, dict)]


class Target(NamedTuple):
    """What a review request acts on: an open session (``session``), or a closed one whose change
    set is kept (``session`` None: no sandbox, nothing to build or close)."""

    id: str
    owner: Caller
    review_dir: str
    roots: list[str]                    # the real roots its sandbox was built on, the workspace first
    session: "Session | None"


class ReviewCalls:
    def __init__(self, registry: SessionRegistry, fork: ForkServer, store: EventStore, *,
                 max_checkpoints: "int | None" = None) -> None:
        self._registry, self._fork, self._store = registry, fork, store
        self._max_checkpoints = max_checkpoints or overlay.DEFAULT_CHECKPOINTS     # review.max_checkpoints

    def _target(self, who: Caller, session_id: str) -> Target:
        """The open session, or the closed one (its owner, root, the admin group: NOT_FOUND for
        anyone else, as for an open one) whose change set is still kept."""
        try:
            session = self._registry.get(who, session_id)       # NOT_FOUND for anyone but its owner, root, admins
        except NotFound:
            return self._closed(who, session_id)
        if not session.review:
            raise WrongState(f"session {session.id} is not in review mode: its writes reach the host directly "
                             "(create it with review)")
        return Target(session.id, session.owner, self._registry.review_dir(session), self._roots(session), session)

    def _closed(self, who: Caller, session_id: str) -> Target:
        """A closed review session's change set: its roots are those its layers' record names (the
        real paths the fork server built the overlays on, written by it), the workspace first."""
        visible_ids(self._store, who, session_id, acting=True)  # NOT_FOUND unless the caller may act on it
        row = self._store.session(session_id)
        if row.closed_at is None:                               # open, but not served (being built or closed now)
            raise NotFound(f"no session {session_id!r}")
        if not row.review:
            raise WrongState(f"session {session_id} is not in review mode: its writes reached the host directly")
        review_dir = self._registry.review_dir_of(session_id)
        try:
            roots = [layer.root for layer in overlay.load(review_dir)]
        except FileNotFoundError:
            raise NotFound(f"session {session_id} is closed and keeps no change set (applied, discarded or "
                           "expired)") from None
        roots.sort(key=lambda root: root != row.workspace)      # the workspace first: relative paths are in it
        return Target(session_id, session_owner(row.owner_uid, row.owner_gid, row.owner_principal), review_dir,
                      roots, None)

    def _roots(self, session: Session) -> list[str]:
        """The session's real roots as its sandbox was built (built now if it was resumed)."""
        self._registry.ready(session)
        facts = session.facts
        if facts is None:
            raise WrongState(f"session {session.id} has no sandbox now: try again")
        return [facts.workspace, *facts.writable_roots]

    def _run(self, target: Target, action: str, roots: list[str], paths: list[list[str]], *,
             include_flagged: "list[list[str]] | None" = None, page: str = "", limit: int = DEFAULT_PAGE,
             max_bytes: int = DEFAULT_DIFF_BYTES, force: bool = False, label: str = "",
             checkpoint: int = 0, reviewed: "list[list[str]] | None" = None,
             only_reviewed: bool = False, before_call: str = "") -> dict[str, object]:
        rights = rights_of(target.owner)
        caller = None if rights is None else CallerRecord(rights[0], rights[1], list(rights[2]))
        carried = _memfd(reviewed) if reviewed else -1
        try:
            return self._fork.review(lambda call_id: Review(
                call_id, target.review_dir, caller, cgroup_owner(target.owner), action, roots, paths,
                include_flagged or [], page, limit, max_bytes, force, label, checkpoint, carried >= 0,
                only_reviewed, before_call), ANSWER_SECONDS, [carried] if carried >= 0 else None)
        finally:
            if carried >= 0:
                os.close(carried)

    def _between_calls(self, target: Target, work: "Callable[[], T]") -> "T":
        """``work`` with the session's sandbox closed (registry.between_calls); a closed session has none."""
        return work() if target.session is None else self._registry.between_calls(target.session, work)

    def _starting(self, who: Caller, target: Target, kind: str, action: str, paths: "Pairs", *,
                  force: bool = False) -> None:
        """The audit event that an apply or discard begins, before its child touches anything: the
        child finishes what it started even if this daemon is killed meanwhile (or the owner kills
        this request), and the log must not lack what reached the host. The event after it says
        what landed."""
        self._store.append(target.id, kind, data={
            **acted_by(who),
            "summary": f"{action} started" + (" (forced)" if force else ""), "phase": "started",
            "paths": _named(paths),
            **({"force": True} if force else {})})

    def _free_if_empty(self, target: Target) -> None:
        """A closed session's change set that holds nothing now goes, its store with it: the owner's
        review.owner_bytes gets its share back."""
        if target.session is None:
            overlay.remove_if_unchanged(target.review_dir)

    def _read(self, who: Caller, session_id: str, paths: "Iterable[str]", action: str, *, page: str,
              limit: int = DEFAULT_PAGE, max_bytes: int = DEFAULT_DIFF_BYTES) -> dict[str, object]:
        """A page of a listing or a diff of the paths asked for."""
        target = self._target(who, session_id)
        return self._run(target, action, target.roots, targets(target.roots, list(paths)), page=page, limit=limit,
                         max_bytes=max_bytes)

    # -- the RPCs --------------------------------------------------------------------------------

    def list(self, who: Caller, request: pb.ListChangesRequest) -> pb.ListChangesResponse:
        if request.page_size > MAX_PAGE:
            raise InvalidPolicy(f"page_size is at most {MAX_PAGE}, got {request.page_size}")
        answer = self._read(who, request.session_id, request.paths, "list", page=request.page_token,
                            limit=request.page_size or DEFAULT_PAGE)
        unhashed = answer.get("unhashed")
        return pb.ListChangesResponse(changes=[change_to_proto(item) for item in _dicts(answer.get("changes"))],
                                      next_page_token=str(answer.get("next") or ""),
                                      unhashed=unhashed if isinstance(unhashed, int) and unhashed >= 0 else 0)

    def diff(self, who: Caller, request: pb.DiffChangesRequest) -> pb.DiffChangesResponse:
        if request.max_bytes > MAX_DIFF_BYTES:
            raise InvalidPolicy(f"max_bytes is at most {MAX_DIFF_BYTES} (4 MiB), got {request.max_bytes}")
        answer = self._read(who, request.session_id, request.paths, "diff", page=request.page_token,
                            max_bytes=request.max_bytes or DEFAULT_DIFF_BYTES)
        return pb.DiffChangesResponse(
            diff=str(answer.get("diff") or ""), next_page_token=str(answer.get("next") or ""),
            shown=[pb.ReviewedChange(root=_text(item[0]), path=_text(item[1]), fingerprint=_text(item[2]))
                   for item in _items(answer.get("shown")) if isinstance(item, list) and len(item) == 3])

    def apply(self, who: Caller, request: pb.ApplyChangesRequest) -> pb.ApplyChangesResponse:
        target = self._target(who, request.session_id)
        self._store.admit(target.owner.uid, target.owner.principal)     # recorded: the owner's budget
        roots = target.roots
        paths = targets(roots, list(request.paths))
        flagged = targets(roots, list(request.include_flagged), "include_flagged path")
        reviewed = _reviewed(roots, request.reviewed)
        only_reviewed = request.only_reviewed or bool(reviewed)
        # Between calls, like discard (FAILED_PRECONDITION naming what runs): no process of the
        # sandbox may change a file while it is applied, nor watch the apply read it (atime).
        return self._between_calls(target, lambda: self._apply(who, target, paths, flagged, request.force,
                                                               reviewed, only_reviewed))

    def _apply(self, who: Caller, target: Target, paths: "Pairs", flagged: "Pairs", force: bool,
               reviewed: "Pairs", only_reviewed: bool) -> pb.ApplyChangesResponse:
        self._starting(who, target, EventType.CHANGES_APPLIED, "apply", paths, force=force)
        answer = self._run(target, "apply", target.roots, paths, include_flagged=flagged, force=force,
                           reviewed=reviewed, only_reviewed=only_reviewed)
        applied, skipped = _dicts(answer.get("applied")), _dicts(answer.get("skipped"))
        named = {(pair[0], pair[1]) for pair in flagged}
        self._store.append(target.id, EventType.CHANGES_APPLIED, data={
            **acted_by(who),
            "summary": f"applied {len(applied)}, skipped {len(skipped)}" + (" (forced)" if force else ""),
            "force": force, "paths": _named(paths),
            **({"only_reviewed": len(reviewed)} if only_reviewed else {}),
            "applied": [{key: item.get(key) for key in ("root", "path", "kind", "sha256") if item.get(key)}
                        for item in applied],
            "skipped": [{key: item.get(key) for key in ("root", "path", "reason")} for item in skipped],
            # Flagged changes (planted code: review.rules): those held back, and those a person named.
            "flagged": [{"root": item.get("root"), "path": item.get("path"), "applied": False,
                         "reason": item.get("reason")} for item in skipped
                        if str(item.get("reason", "")).startswith("flagged")] +
                       [{"root": item.get("root"), "path": item.get("path"), "applied": True} for item in applied
                        if (item.get("root"), item.get("path")) in named]})
        # After the audit event: what landed is recorded even when its baseline cannot be kept.
        # What landed is dropped from the change set first: that frees the store's pages the
        # baseline's record then takes (a closed session's store is sealed with little room).
        self._forget(target, answer.get("forgettable"))
        self._save_baselines(target, answer.get("baselines"))
        if target.session is None:
            self._free_if_empty(target)
        return pb.ApplyChangesResponse(
            applied=[pb.AppliedChange(root=_text(item.get("root", "")), path=_text(item.get("path", "")),
                                      kind=KINDS.get(str(item.get("kind")), pb.FileChange.KIND_UNSPECIFIED),
                                      note=_text(item.get("note") or "")) for item in applied],
            skipped=[_skipped(item) for item in skipped])

    def _save_baselines(self, target: Target, baselines: object) -> None:
        """The conflict baselines after an apply (review.conflicts), each beside its overlay's layers in
        the session's review directory: root's, which the apply's child (the owner) cannot write."""
        review_dir = target.review_dir
        for item in _dicts(baselines):
            layer, started, applied = item.get("layer"), item.get("started_ns"), item.get("applied")
            if not isinstance(layer, str) or not layer.isdigit() or not isinstance(started, int) or \
                    not isinstance(applied, dict):
                raise SetupError("review", detail="an apply's answer carried a malformed conflict baseline")
            try:
                conflicts.save_baseline(os.path.join(review_dir, layer), conflicts.Baseline(
                    started_ns=started, applied={str(path): int(ctime) for path, ctime in applied.items()
                                                 if isinstance(ctime, int)}))
            except OSError as exc:          # ENOSPC: the sandbox filled its store (review.session_bytes)
                raise Exhausted(f"session {target.id}: the apply landed, but its conflict baseline could not be "
                                f"kept in the review store ({os.strerror(exc.errno or 0)}): discard changes to "
                                "make room before the next apply") from None

    def _forget(self, target: Target, forgettable: object) -> None:
        """Drop the upper entries of what an apply landed (they equal the host now), so that the
        sandbox follows the host there again (its sandbox, closed for the apply, is rebuilt)."""
        if not isinstance(forgettable, dict):
            return
        pairs = [[str(root), str(path)] for root, paths in forgettable.items() for path in _items(paths)]
        if pairs:
            self._run(target, "discard", [str(root) for root in forgettable], pairs)

    def discard(self, who: Caller, request: pb.DiscardChangesRequest) -> pb.DiscardChangesResponse:
        target = self._target(who, request.session_id)
        self._store.admit(target.owner.uid, target.owner.principal)
        roots = target.roots
        paths = targets(roots, list(request.paths))
        def discard() -> dict[str, object]:
            self._starting(who, target, EventType.CHANGES_DISCARDED, "discard", paths)
            return self._run(target, "discard", roots, paths)
        answer = self._between_calls(target, discard)
        discarded, skipped = _dicts(answer.get("discarded")), _dicts(answer.get("skipped"))
        self._store.append(target.id, EventType.CHANGES_DISCARDED, data={
            **acted_by(who),
            "summary": f"discarded {len(discarded)}, skipped {len(skipped)}",
            "paths": _named(paths),
            "discarded": [{"root": item.get("root"), "path": item.get("path")} for item in discarded],
            "skipped": [{key: item.get(key) for key in ("root", "path", "reason")} for item in skipped]})
        self._free_if_empty(target)
        return pb.DiscardChangesResponse(
            discarded=[pb.AppliedChange(root=_text(item.get("root", "")), path=_text(item.get("path", "")))
                       for item in discarded],
            skipped=[_skipped(item) for item in skipped])


    # -- checkpoints (review.checkpoints) ----------------------------------------------------------

    def _open(self, who: Caller, session_id: str, what: str) -> Target:
        """An open review session: a closed one's change set has no sandbox to return to a point."""
        target = self._target(who, session_id)
        if target.session is None:
            raise WrongState(f"session {session_id} is closed: its change set has no {what} (apply or discard it)")
        return target

    def create_checkpoint(self, who: Caller, request: pb.CreateCheckpointRequest) -> pb.Checkpoint:
        if len(request.label) > MAX_LABEL:
            raise InvalidPolicy(f"a checkpoint's label has at most {MAX_LABEL} characters, got {len(request.label)}")
        target = self._open(who, request.session_id, "checkpoints")
        self._store.admit(target.owner.uid, target.owner.principal)
        answer = self._between_calls(target, lambda: self._run(
            target, "checkpoint", target.roots, [], limit=self._max_checkpoints, label=request.label))
        made = _checkpoint(answer.get("checkpoint"))
        self._store.append(target.id, EventType.CHECKPOINT_CREATED, data={
            **acted_by(who),
            "summary": f"checkpoint {made.id} ({made.changes} changes)", "checkpoint": made.id,
            "label": made.label, "changes": made.changes})
        return made

    def checkpoint_call(self, session: Session, call_id: str, summary: str) -> None:
        """ExecStart.checkpoint: a checkpoint labelled with the call, marked before it runs, when
        anything changed since the last one. Never fails the call: with another call or a background
        process running (a checkpoint is made between calls), or the checkpoint refused, the audit
        log says it was skipped and why."""
        label = f"before {call_id}: {summary}"[:MAX_LABEL]
        event: dict[str, object] = {"by_uid": session.owner.uid, "call_id": call_id}
        try:
            target = Target(session.id, session.owner, self._registry.review_dir(session), self._roots(session),
                            session)
            # Looked at first, the sandbox left standing: a call after one that changed nothing
            # costs a directory read per root, not the sandbox's close and rebuild.
            if self._run(target, "changed", target.roots, []).get("changed") is False:
                return
            answer = self._between_calls(target, lambda: self._run(
                target, "checkpoint", target.roots, [], limit=self._max_checkpoints, label=label, before_call=call_id))
        except SandboxdError as skipped:
            self._store.append(session.id, EventType.CHECKPOINT_CREATED, call_id=call_id, data={
                **event, "summary": f"checkpoint before {call_id} skipped", "skipped": str(skipped)})
            return
        if answer.get("checkpoint") is None:                # nothing changed since the last one
            return
        made = _checkpoint(answer.get("checkpoint"))
        self._store.append(target.id, EventType.CHECKPOINT_CREATED, call_id=call_id, data={
            **event, "summary": f"checkpoint {made.id} before {call_id} ({made.changes} changes)",
            "checkpoint": made.id, "label": made.label, "changes": made.changes})

    def list_checkpoints(self, who: Caller, request: pb.ListCheckpointsRequest) -> pb.ListCheckpointsResponse:
        target = self._open(who, request.session_id, "checkpoints")
        answer = self._run(target, "checkpoints", target.roots, [])
        return pb.ListCheckpointsResponse(checkpoints=[_checkpoint(item) for item in _dicts(answer.get("checkpoints"))])

    def rollback(self, who: Caller, request: pb.RollbackChangesRequest) -> pb.RollbackChangesResponse:
        target = self._open(who, request.session_id, "checkpoint to roll back to")
        self._store.admit(target.owner.uid, target.owner.principal)
        answer = self._between_calls(target, lambda: self._run(
            target, "rollback", target.roots, [], checkpoint=request.checkpoint_id))
        done = answer.get("rollback")
        if not isinstance(done, dict):
            raise SetupError("review", detail="a rollback's answer carried no result")
        dropped = [int(item) for item in _items(done.get("dropped")) if isinstance(item, int) and item > 0]
        removed = done.get("removed")
        removed = removed if isinstance(removed, int) and removed >= 0 else 0
        self._store.append(target.id, EventType.CHANGES_ROLLED_BACK, data={
            **acted_by(who),
            "summary": f"rolled back to checkpoint {request.checkpoint_id}, dropped {len(dropped)} checkpoints, "
                       f"removed {removed} entries",
            "checkpoint": request.checkpoint_id, "dropped": dropped, "removed": removed})
        return pb.RollbackChangesResponse(
            checkpoint_id=request.checkpoint_id, dropped=dropped, removed=min(removed, 0xFFFFFFFF),
            checkpoints=[_checkpoint(item) for item in _dicts(answer.get("checkpoints"))])


def _checkpoint(item: object) -> pb.Checkpoint:
    """A review child's checkpoint (review.checkpoints.Checkpoint.as_dict) as the proto's."""
    if not isinstance(item, dict) or not isinstance(item.get("id"), int):
        raise SetupError("review", detail="a checkpoint answer was malformed")
    time_ns, changes = item.get("time_ns"), item.get("changes")
    return pb.Checkpoint(id=int(item["id"]), created_at=time_ns / 1e9 if isinstance(time_ns, int) else 0.0,
                         label=str(item.get("label") or ""), call_id=str(item.get("call_id") or ""),
                         changes=min(changes, 0xFFFFFFFF) if isinstance(changes, int) and changes >= 0 else 0)


def _skipped(item: dict[str, object]) -> pb.SkippedChange:
    return pb.SkippedChange(root=_text(item.get("root", "")), path=_text(item.get("path", "")),
                            reason=_text(item.get("reason") or ""))


def _text(value: object) -> str:
    """A value of the review child's answer as a proto string: a file name is bytes the sandbox
    chose, and one that is no UTF-8 is carried as review.changes.wire_path shows it (never INTERNAL)."""
    return wire_path(str(value))
