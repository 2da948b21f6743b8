"""`sandboxd changes|apply|discard DIR`: a change set kept by `sandboxd run --review`, shown,
applied or dropped later; and the same three at the end of a run (cli.run_review).

PATHs are host paths (absolute, or relative to the current directory) inside the change set's
roots. Apply writes as the owner of the host root, never as root (cli.change_sets); a conflict
is applied only with --force, a flagged change only when named with --include-flagged PATH.
Every string the sandbox chose (paths, link targets, file contents, reasons that quote them) is
shown through ``sandboxd.printable``.
"""

from __future__ import annotations

import errno
import sys

from sandboxd.cli.change_sets import MAX_LISTED, KeptDir, ReviewError, apply_result, change_set, list_all
from sandboxd.errors import SandboxdError
from sandboxd.printable import printable
from sandboxd.review.apply import Skipped
from sandboxd.review.changes import ChangeSet, Comparison, attributes

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

USAGE = """usage: sandboxd changes DIR [--stat|--diff|--json] [PATH...]
       sandboxd apply DIR [PATH...] [--force] [--include-flagged PATH]...
       sandboxd discard DIR [PATH...]

DIR is a change set `sandboxd run --review` kept (yours only). PATHs are host paths in its roots
(default: everything). apply writes as the owner of each root, never as root; it skips a conflict
(the host changed there since the run started) unless --force, and a flagged change (planted
git hooks or config, .envrc, set-ID files...) unless that path is named with --include-flagged.
Applied and discarded changes leave DIR; DIR goes when nothing is left.
Exit status: 0 done; 1 something was skipped (each listed, with why); 2 bad usage or DIR unusable.
"""
FLAGGED, CONFLICT = "flagged: ", "conflict: "      # how review.apply starts those skip reasons


def say(text: str, prefix: str = "") -> None:
    """One line on stderr, whatever it quotes escaped."""
    sys.stderr.write(prefix + printable(text) + "\n")
    sys.stderr.flush()


def listed(kept: KeptDir, paths: "list[str]", limit: int = 0) -> "list[ChangeSet]":
    """Each selected overlay's changes (all of them, or the first ``limit``)."""
    found = []
    for layer, chosen in kept.select(paths):
        def body(comparison: Comparison, chosen: "tuple[str, ...]" = chosen) -> ChangeSet:
            return list_all(comparison, chosen, limit or MAX_LISTED)
        found.append(change_set(layer.as_owner(body)))
    return found


def marks(change: "Any") -> str:
    """What a change's one line says after its path: its mode and owner changes, why it is flagged,
    its conflict (every string the sandbox chose escaped by the caller's ``printable``)."""
    modes = attributes(change)
    return ((f" [{modes}]" if modes else "")
            + (f" [flagged: {'; '.join(change.flags)}]" if change.flags else "")
            + (f" [conflict: {change.conflict}]" if change.conflict else ""))


def print_summary(sets: "list[ChangeSet]", *, prefix: str = "") -> None:
    """One line per change under one per root, on stderr (the run's end)."""
    for found in sets:
        more = "+" if found.next_after else ""
        say(f"review: {len(found.changes)}{more} change(s) to {found.root}", prefix)
        for change in found.changes:
            say(f"  {change.kind:<12} {change.path or '.'}{marks(change)}", prefix)


def _stat(sets: "list[ChangeSet]") -> None:
    for found in sets:
        counts: dict[str, int] = {}
        for change in found.changes:
            counts[change.kind] = counts.get(change.kind, 0) + 1
            sizes = f"{change.host_size} -> {change.size} bytes" if change.type == "file" else change.type or "-"
            print(printable(f"{change.kind:<12} {change.path or '.'}  ({sizes}){marks(change)}"))
        total = ", ".join(f"{count} {kind}" for kind, count in sorted(counts.items())) or "no changes"
        print(printable(f"{found.root}: {total}" + (" (more not listed)" if found.next_after else "")))


def diffs(kept: KeptDir, paths: "list[str]") -> "list[tuple[str, str]]":
    """(root, diff text) of each selected overlay's changes."""
    from sandboxd.review import diff

    shown = []
    for layer, chosen in kept.select(paths):
        def body(comparison: Comparison, chosen: "tuple[str, ...]" = chosen) -> str:
            return "".join(diff.show(comparison, change) for change in
                           list_all(comparison, chosen, MAX_LISTED).changes)
        shown.append((layer.root, str(layer.as_owner(body))))
    return shown


def print_diffs(kept: KeptDir, paths: "list[str]", out: "Any") -> None:
    for root, text in diffs(kept, paths):
        out.write(printable(f"# {root}") + "\n")
        for line in text.splitlines():
            out.write(printable(line) + "\n")
    out.flush()


class Outcome:
    """What an apply did, over every overlay."""

    def __init__(self) -> None:
        self.applied = 0
        self.skipped: list[tuple[str, Skipped]] = []     # (root, skipped)


def apply(kept: KeptDir, paths: "list[str]", *, force: bool = False,
          include_flagged: "tuple[str, ...]" = ()) -> Outcome:
    """Apply the selected changes as each root's owner; the baseline is saved and the applied
    upper entries forgotten here (the caller's)."""
    named: dict[str, set[str]] = {}
    for path in include_flagged:
        layer, rel = kept.locate(path)
        named.setdefault(layer.index, set()).add(rel)
    outcome = Outcome()
    for layer, chosen in kept.select(paths):
        included = frozenset(named.get(layer.index, ()))

        def body(comparison: Comparison, chosen: "tuple[str, ...]" = chosen,
                 included: "frozenset[str]" = included) -> object:
            from sandboxd.review import apply as applying
            return applying.apply(comparison, chosen, force=force, include_flagged=included)
        result = apply_result(layer.as_owner(body))
        _record(kept, layer, result, outcome)
        outcome.applied += len(result.applied)
        outcome.skipped += [(layer.root, skipped) for skipped in result.skipped]
    return outcome


def _record(kept: KeptDir, layer: "Any", result: "Any", outcome: Outcome) -> None:
    """Drop the upper entries that landed, then save the conflict baseline. In that order: the
    entries dropped give their room back to a full store (the sandbox may have filled it), and an
    entry dropped is never written again, where a baseline unsaved only makes conflicts of what
    landed. A store still full says so in one line: what landed, and to discard to make room."""
    from sandboxd.review import conflicts
    try:
        layer.forget(list(result.forgettable))
        conflicts.save_baseline(layer.place, result.baseline)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        landed = outcome.applied + len(result.applied)
        raise ReviewError(f"applied {landed} change(s) ({len(result.forgettable)} dropped from the change set), "
                          f"but {kept.path} is full and cannot record what landed in {layer.root}: the next "
                          f"apply may count them as conflicts; make room with `sandboxd discard {kept.path} "
                          "PATH...` (or discard it all)") from None


def report_apply(kept: KeptDir, outcome: Outcome, prefix: str = "") -> None:
    """The skipped changes, each with why, and the commands that would take them."""
    say(f"review: applied {outcome.applied} change(s)", prefix)
    if not outcome.skipped:
        return
    say(f"review: skipped {len(outcome.skipped)}:", prefix)
    for root, skipped in outcome.skipped:
        say(f"  {skipped.path or '.'} ({root}): {skipped.reason}", prefix)
    flagged = [_host_path(root, item.path) for root, item in outcome.skipped if item.reason.startswith(FLAGGED)]
    conflicted = [_host_path(root, item.path) for root, item in outcome.skipped if item.reason.startswith(CONFLICT)]
    import shlex
    if conflicted:
        say(f"review: to overwrite the host's changes: sandboxd apply {shlex.quote(kept.path)} --force "
            + " ".join(shlex.quote(path) for path in conflicted), prefix)
    if flagged:
        say(f"review: to apply a flagged change, name it: sandboxd apply {shlex.quote(kept.path)} "
            + " ".join(f"--include-flagged {shlex.quote(path)}" for path in flagged), prefix)


def _host_path(root: str, rel: str) -> str:
    return f"{root.rstrip('/')}/{rel}" if rel else root


def discard(kept: KeptDir, paths: "list[str]") -> "list[tuple[str, Skipped]]":
    """Drop the selected changes (all: the whole directory goes); what could not be dropped."""
    if not paths:
        kept.remove()
        return []
    from sandboxd.review import apply as applying
    refused: list[tuple[str, Skipped]] = []
    for layer, chosen in kept.select(paths):
        result = applying.discard(layer.upper_fd, layer.scan(), chosen)
        refused += [(layer.root, skipped) for skipped in result.skipped]
    return refused


def remove_if_done(kept: KeptDir) -> bool:
    """Remove the directory when no change is left in it."""
    if kept.empty() or not any(found.changes for found in listed(kept, [], limit=1)):
        kept.remove()
        return True
    return False


def main(command: str, argv: "list[str]") -> int:
    """`sandboxd changes|apply|discard`: 0 done, 1 something skipped (listed), 2 bad usage or an
    unusable DIR."""
    options: dict[str, Any] = {"view": "", "force": False, "include_flagged": [], "paths": []}
    rest = list(argv)
    allowed = {"changes": ("--stat", "--diff", "--json"), "apply": ("--force", "--include-flagged"),
               "discard": ()}[command]
    while rest:
        arg = rest.pop(0)
        flag, has_value, value = arg.partition("=")
        if arg in ("-h", "--help"):
            sys.stdout.write(USAGE)
            return 0
        if arg == "--":
            options["paths"] += rest
            break
        if not arg.startswith("-"):
            options["paths"].append(arg)
        elif flag not in allowed:
            say(f"sandboxd {command}: unknown option {arg} (see sandboxd {command} --help)")
            return 2
        elif flag == "--include-flagged":
            if not has_value:
                if not rest:
                    say("sandboxd apply: --include-flagged needs a PATH")
                    return 2
                value = rest.pop(0)
            options["include_flagged"].append(value)
        elif flag == "--force":
            options["force"] = True
        elif options["view"]:
            say(f"sandboxd changes: one of --stat, --diff, --json (not {options['view']} and {flag})")
            return 2
        else:
            options["view"] = flag
    if not options["paths"]:
        sys.stderr.write(USAGE)
        return 2
    directory, paths = options["paths"][0], options["paths"][1:]
    try:
        with KeptDir(directory) as kept:
            return _carry_out(command, kept, paths, options)
    except (SandboxdError, OSError) as exc:
        say(f"sandboxd {command}: {exc}")
        return 2


def _carry_out(command: str, kept: KeptDir, paths: "list[str]", options: "dict[str, Any]") -> int:
    if command == "changes":
        view = options["view"]
        if view == "--diff":
            print_diffs(kept, paths, sys.stdout)
            return 0
        sets = listed(kept, paths)
        if view == "--json":
            import json
            from sandboxd.cli.change_sets import plain
            print(json.dumps(plain(sets)))
        elif view == "--stat":
            _stat(sets)
        else:
            for found in sets:
                print(printable(f"{found.root}: {len(found.changes)}{'+' if found.next_after else ''} change(s)"))
                for change in found.changes:
                    print(printable(f"  {change.kind:<12} {change.path or '.'}{marks(change)}"))
        return 0
    if command == "apply":
        outcome = apply(kept, paths, force=options["force"], include_flagged=tuple(options["include_flagged"]))
        report_apply(kept, outcome)
        if remove_if_done(kept):
            say(f"review: nothing is left: removed {kept.path}")
        return 1 if outcome.skipped else 0
    refused = discard(kept, paths)
    for root, skipped in refused:
        say(f"review: not discarded: {skipped.path or '.'} ({root}): {skipped.reason}")
    if paths and remove_if_done(kept):
        say(f"review: nothing is left: removed {kept.path}")
    elif not paths:
        say(f"review: discarded; removed {kept.path}")
    return 1 if refused else 0

