"""`sandboxctl changes|apply|discard`: a review session's change set, shown and decided on, and
`sandboxctl checkpoint|checkpoints|rollback`: its checkpoints (docs/review-mode.md). Every path,
reason, diff line and checkpoint label is a caller's (the sandbox or a client chose it): each is
printed through ``printable``, one line each."""

from __future__ import annotations

import argparse
import json
import sys

from sandboxd.client import SandboxClient
from sandboxd.printable import printable
from sandboxd.v1 import sandboxd_pb2 as pb

TYPE_CHECKING = False
if TYPE_CHECKING:
    from argparse import _SubParsersAction
    from collections.abc import Iterable

    from sandboxd.client import Reviewed

# One letter per kind, as `git status --short` shows them.
MARKS = {pb.FileChange.ADDED: "A", pb.FileChange.MODIFIED: "M", pb.FileChange.DELETED: "D",
         pb.FileChange.REPLACED: "R", pb.FileChange.TYPE_CHANGED: "T", pb.FileChange.METADATA: "m"}
COMMANDS = ("changes", "apply", "discard")
CHECKPOINT_COMMANDS = ("checkpoint", "checkpoints", "rollback")


def add_commands(commands: "_SubParsersAction[argparse.ArgumentParser]") -> None:
    paths_help = "host paths under the session's roots: absolute, or relative to its workspace (none: all)"
    changes = commands.add_parser("changes", help="a review session's changes (not on the host yet)")
    changes.add_argument("session_id")
    changes.add_argument("paths", nargs="*", metavar="PATH", help=paths_help)
    shown = changes.add_mutually_exclusive_group()
    shown.add_argument("--stat", action="store_true", help="counts by kind, flagged and conflicting")
    shown.add_argument("--diff", action="store_true", help="a unified diff (binary files: one line each)")
    shown.add_argument("--json", action="store_true", help="one JSON object per change")
    apply = commands.add_parser("apply", help="write a review session's changes to the host, as its owner")
    apply.add_argument("session_id")
    apply.add_argument("paths", nargs="*", metavar="PATH", help=paths_help)
    apply.add_argument("--force", action="store_true", help="overwrite what changed on the host meanwhile")
    apply.add_argument("--include-flagged", action="append", default=[], metavar="PATH",
                       help="apply this flagged change (planted code) all the same; repeat per path")
    apply.add_argument("--reviewed", metavar="FILE",
                       help="apply only the changes in FILE (`sandboxctl changes S --json` output), each "
                            "only if it is still as listed there; the others stay")
    discard = commands.add_parser("discard", help="drop a review session's changes: it sees the host again")
    discard.add_argument("session_id")
    discard.add_argument("paths", nargs="*", metavar="PATH", help=paths_help)
    checkpoint = commands.add_parser("checkpoint", help="mark a checkpoint of a review session's changes")
    checkpoint.add_argument("session_id")
    checkpoint.add_argument("--label", default="", help="a note shown with it (at most 256 characters)")
    listing = commands.add_parser("checkpoints", help="a review session's checkpoints, oldest first")
    listing.add_argument("session_id")
    rollback = commands.add_parser("rollback", help="return a review session's view to a checkpoint")
    rollback.add_argument("session_id")
    rollback.add_argument("checkpoint_id", type=int, metavar="ID", help="a checkpoint's id (0: the session's start)")


def shown_path(root: str, path: str, workspace: str) -> str:
    """A change's path as a person names it: relative to the workspace, else absolute."""
    if root == workspace:
        return path or "."
    return f"{root}/{path}" if path else root


def change_line(change: pb.FileChange, workspace: str) -> str:
    line = f"{MARKS.get(change.kind, '?')} {printable(shown_path(change.root, change.path, workspace))}"
    if change.kind in (pb.FileChange.MODIFIED, pb.FileChange.METADATA) and change.aspects:
        line += f"  ({printable(', '.join(change.aspects))})"
    if change.flags:
        line += f"  [flagged: {printable('; '.join(change.flags))}]"
    if change.conflict:
        line += f"  [conflict: {printable(change.conflict)}]"
    return line


def checkpoint_line(item: pb.Checkpoint) -> str:
    import time

    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(item.created_at))
    label = f"  {printable(item.label)}" if item.label else ""
    return f"{item.id}  {when}  {item.changes} change(s){label}"


def run_checkpoints(client: SandboxClient, args: argparse.Namespace) -> int:
    if args.command == "checkpoint":
        print(checkpoint_line(client.create_checkpoint(args.session_id, args.label)))
        return 0
    if args.command == "rollback":
        if args.checkpoint_id < 0:
            raise SystemExit("sandboxctl: a checkpoint's id is 0 (the session's start) or more")
        done = client.rollback_changes(args.session_id, args.checkpoint_id)
        print(f"rolled back to {'the start' if not done.checkpoint_id else f'checkpoint {done.checkpoint_id}'}"
              f" (dropped {len(done.dropped)} checkpoint(s))")
        return 0
    for item in client.list_checkpoints(args.session_id):
        print(checkpoint_line(item))
    return 0


def run(client: SandboxClient, args: argparse.Namespace) -> int:
    if args.command in CHECKPOINT_COMMANDS:
        return run_checkpoints(client, args)
    workspace = client.get_session(args.session_id).workspace
    if args.command == "changes":
        return _changes(client, args, workspace)
    if args.command == "apply":
        reviewed = _reviewed_file(args.reviewed) if args.reviewed else None
        result = client.apply_changes(args.session_id, args.paths, force=args.force,
                                      include_flagged=args.include_flagged, reviewed=reviewed)
        for applied in result.applied:
            note = f"  ({printable(applied.note)})" if applied.note else ""
            print(f"applied {printable(shown_path(applied.root, applied.path, workspace))}{note}")
        _skipped(result.skipped, workspace)
        return 1 if result.skipped else 0
    result_discard = client.discard_changes(args.session_id, args.paths)
    for dropped in result_discard.discarded:
        print(f"discarded {printable(shown_path(dropped.root, dropped.path, workspace))}")
    _skipped(result_discard.skipped, workspace)
    return 1 if result_discard.skipped else 0


def _reviewed_file(path: str) -> "Reviewed":
    """``sandboxctl changes S --json`` output, as the fingerprints a person was shown; SystemExit(2)
    saying what is wrong with it."""
    reviewed: Reviewed = {}
    try:
        with open(path, encoding="utf-8") as listing:
            for number, line in enumerate(listing, 1):
                if not line.strip():
                    continue
                try:
                    item = json.loads(line)
                    reviewed[(str(item["root"]), str(item.get("path", "")))] = str(item["fingerprint"])
                except (ValueError, KeyError, TypeError):
                    raise SystemExit(f"sandboxctl: --reviewed {printable(path)}: line {number} is not a change "
                                     "of `sandboxctl changes S --json`") from None
    except OSError as exc:
        raise SystemExit(f"sandboxctl: --reviewed {printable(path)}: {exc.strerror}") from None
    return reviewed


def _skipped(skipped: "Iterable[pb.SkippedChange]", workspace: str) -> None:
    for item in skipped:
        print(f"skipped {printable(shown_path(item.root, item.path, workspace))}: {printable(item.reason)}")


def _changes(client: SandboxClient, args: argparse.Namespace, workspace: str) -> int:
    if args.diff:
        for text in client.diff_changes(args.session_id, args.paths):
            for line in text.splitlines():
                print(printable(line))
        return 0
    changes, unhashed = client.list_changes(args.session_id, args.paths)
    if args.json:
        from google.protobuf.json_format import MessageToDict
        for change in changes:
            print(json.dumps(MessageToDict(change, preserving_proto_field_name=True)))
        return 0
    if args.stat:
        counts: dict[str, int] = {}
        for change in changes:
            name = pb.FileChange.Kind.Name(change.kind).lower().replace("_", " ")
            counts[name] = counts.get(name, 0) + 1
        kinds = ", ".join(f"{count} {name}" for name, count in sorted(counts.items())) or "no changes"
        flagged = sum(1 for change in changes if change.flags)
        conflicts = sum(1 for change in changes if change.conflict)
        print(f"{len(changes)} change(s): {kinds}; {flagged} flagged, {conflicts} conflicting")
    else:
        for change in changes:
            print(change_line(change, workspace))
    if unhashed:
        print(f"({unhashed} file(s) of the same size as the host's were not hashed: listed as modified)")
    return 0


SUMMARY_LINES = 20               # changes shown above the end-of-session question


def end_of_session(client: SandboxClient, session_id: str) -> None:
    """On a terminal, after `sandboxctl shell`, `exec -t`, or before `session close`: a review
    session with pending changes asks the person in place, `[a]pply [d]iscard [k]eep [r]eview`
    (r shows the diff and asks again; Ctrl-C, Ctrl-D or the terminal's end keep). Anything that
    goes wrong here keeps the changes and says so: the command's own status is never changed."""
    from sandboxd.cli.keys import person_at_terminal
    if not person_at_terminal():
        return
    import grpc
    try:
        session = client.get_session(session_id)
        if not session.review:
            return
        changes, _ = client.list_changes(session_id)
        if not changes:
            return
        # What the person is shown is what an apply may write: a change made or remade after this
        # listing (a background process of the session) is skipped, not applied unseen.
        seen: Reviewed = {(change.root, change.path): change.fingerprint for change in changes}
        _say(f"review: {len(changes)} pending change(s) in session {printable(session_id)}, not on the host yet:")
        for change in changes[:SUMMARY_LINES]:
            _say("  " + change_line(change, session.workspace))
        if len(changes) > SUMMARY_LINES:
            _say(f"  ... and {len(changes) - SUMMARY_LINES} more ([r]eview shows them all)")
        decision = _ask(client, session_id, seen)
        if decision == "a":
            result = client.apply_changes(session_id, reviewed=seen)
            for applied in result.applied:
                _say(f"applied {printable(shown_path(applied.root, applied.path, session.workspace))}")
            for item in result.skipped:
                _say(f"skipped {printable(shown_path(item.root, item.path, session.workspace))}: "
                     f"{printable(item.reason)}")
            if result.skipped:
                _say(f"review: what was skipped stays; see `sandboxctl changes {printable(session_id)}`, "
                     "then `sandboxctl apply` with --force or --include-flagged PATH")
        elif decision == "d":
            result_discard = client.discard_changes(session_id)
            _say(f"review: {len(result_discard.discarded)} change(s) discarded")
            for item in result_discard.skipped:
                _say(f"skipped {printable(shown_path(item.root, item.path, session.workspace))}: "
                     f"{printable(item.reason)}")
        else:
            _say(f"review: kept; `sandboxctl changes {printable(session_id)} --diff`, then "
                 f"`sandboxctl apply` or `sandboxctl discard` {printable(session_id)}")
    except grpc.RpcError as error:
        _say(f"review: {error.code().name}: {printable(error.details() or '')}: the changes are kept")


def _say(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _ask(client: SandboxClient, session_id: str, seen: "Reviewed") -> str:
    """The person's key: a, d or k (r shows the diff first and asks again: cli.keys.ask_review);
    ``seen`` takes the fingerprints of what the diff showed."""
    from sandboxd.cli.keys import ask_review

    def show_diff() -> None:
        for text in client.diff_changes(session_id, seen=seen):
            for line in text.splitlines():
                _say(printable(line))
    return ask_review(show_diff)
