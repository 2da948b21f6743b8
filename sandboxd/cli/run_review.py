"""`sandboxd run --review`: where a run's change set goes, and what becomes of it at the end.

``--review`` asks on a terminal (``[a]pply [d]iscard [k]eep [r]eview``) and keeps without one;
``--review=apply``, ``--review=discard`` and ``--review=keep[:DIR]`` decide beforehand. The
change set goes to DIR when named, else to a fresh 0700 directory of the run's own under a base
of the caller's (``$XDG_STATE_HOME/sandboxd/reviews`` when that is set; else for root
``/var/lib/sandboxd/run-reviews``, hidden in every sandbox like the rest of sandboxd's state, and
for a plain user ``~/.local/state/sandboxd/reviews``, or ``/var/tmp/sandboxd-reviews-UID`` when that
is inside a writable root), never inside a writable root (the launch refuses an overlap) nor on the sandbox's
/tmp. The launch hides it from the sandbox.

At the end the summary goes to stderr, then the decision: apply writes as the owner of the host
root (cli.change_sets), and what it skips (conflicts, flagged changes) stays, with the commands
that would take it; discard removes the directory. A command killed (by a signal, the timeout)
or a run interrupted keeps the change set where it is and says so. The command's exit status is
the run's whatever happens here.

The common end, a command that changed nothing, costs a directory read per root (an empty upper
layer whose top has the root's own mode and owner): the listing and comparison code is imported
only when there is something to list.
"""

from __future__ import annotations

import errno
import os
import stat
import sys

from sandboxd import defaults
from sandboxd._record import Record
from sandboxd.errors import InvalidPolicy
from sandboxd.kernel import overlay
from sandboxd.printable import printable

TYPE_CHECKING = False
if TYPE_CHECKING:
    from sandboxd.cli.change_sets import KeptDir
    from sandboxd.kernel.overlay import Layers

ASK, APPLY, DISCARD, KEEP = "ask", "apply", "discard", "keep"
ROOT_BASE = defaults.STATE_DIR + "/run-reviews"
SUMMARY_LINES = 50


class Review(Record):
    decision: str                   # ASK, APPLY, DISCARD or KEEP
    directory: str = ""             # named by the caller (keep:DIR), else chosen at launch
    named: bool = False


def parse(value: object) -> Review:
    """``--review`` (True) or ``--review=VALUE``; ValueError saying what to write instead."""
    if value is True:
        return Review(ASK)
    text = str(value)
    decision, colon, where = text.partition(":")
    if decision == KEEP and colon and where:
        return Review(KEEP, os.path.abspath(where), named=True)
    if text in (APPLY, DISCARD, KEEP):
        return Review(text)
    raise ValueError(f"--review={text}: use --review (ask at the end), --review=apply, --review=discard "
                     "or --review=keep[:DIR]")


def _say(text: str) -> None:
    sys.stderr.write(f"sandboxd run: {printable(text)}\n")


def base_dir(roots: "list[str]") -> str:
    """The caller's base for run change sets (see the module's text), made 0700 when missing;
    InvalidPolicy when it is not the caller's alone."""
    candidates = defaults.review_bases(os.geteuid(), os.path.expanduser("~"), os.environ.get("XDG_STATE_HOME", ""))
    real_roots = [os.path.realpath(root) for root in roots]
    why = "every place for the change set is inside a writable root"
    for base in candidates:
        parent = os.path.realpath(os.path.dirname(base))
        if any(parent == root or parent.startswith(root.rstrip("/") + "/") or root.startswith(parent + "/")
               for root in real_roots):
            continue
        try:
            os.makedirs(os.path.dirname(base), mode=0o755, exist_ok=True)
            os.mkdir(base, 0o700)
        except FileExistsError:
            pass
        except OSError as exc:
            why = f"cannot make {base}: {os.strerror(exc.errno or errno.EIO)}"
            continue
        st = os.lstat(base)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            why = f"{base} is not a 0700 directory of yours"
            continue
        if _filesystem(base) in overlay.REFUSED_UPPERS:     # a container's root is an overlay itself
            why = f"{base} is on a file system overlayfs cannot keep an upper layer on"
            continue
        return base
    raise InvalidPolicy(f"review: {why}: name a directory for the change set on a local disk with "
                        "--review=keep:DIR, or set XDG_STATE_HOME")


def _filesystem(path: str) -> int:
    fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    try:
        return overlay.filesystem_type(fd)
    finally:
        os.close(fd)


def new_directory(review: Review, roots: "list[str]") -> str:
    """The run's review directory: DIR as named, else a new one under the base."""
    if review.named:
        return review.directory
    import time
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime())
    return f"{base_dir(roots)}/{stamp}-{os.getpid()}-{os.urandom(3).hex()}"


def _nothing_changed(layers: "list[Layers]") -> bool:
    for layer in layers:
        fd = os.open(layer.upper, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            if not overlay.upper_is_empty(fd, layer.root, layer.checkpoints):
                return False
        finally:
            os.close(fd)
    return True


def _hint(directory: str) -> str:
    import shlex
    where = shlex.quote(directory)
    return f"see it with `sandboxd changes {where} --diff`; then `sandboxd apply {where}` or `sandboxd discard {where}`"


def finish(review: Review, layers: "list[Layers]", *, killed: str = "") -> None:
    """The run's end in review mode (see the module's text). ``killed``: how the command was
    stopped ("" when it ended by itself)."""
    directory = review.directory
    try:
        if not killed and _nothing_changed(layers):
            if review.named:
                _say(f"review: no changes (the empty change set is in {directory})")
            else:
                overlay.remove_layers(directory)
                _say("review: no changes")
            return
        _decide(review, killed)
    except KeyboardInterrupt:
        _say(f"review: interrupted: the change set is kept in {directory}")
        _say(_hint(directory))
    except (OSError, InvalidPolicy) as exc:
        _say(f"review: {exc}: the change set is kept in {directory}")
    except Exception as exc:    # noqa: BLE001 - SandboxdError and kin: the status stays the command's
        _say(f"review: {exc}: the change set is kept in {directory}")


def _decide(review: Review, killed: str) -> None:
    from sandboxd.cli import review_commands as commands
    from sandboxd.cli.change_sets import KeptDir

    directory = review.directory
    with KeptDir(directory) as kept:
        commands.print_summary(commands.listed(kept, [], limit=SUMMARY_LINES), prefix="sandboxd run: ")
        if killed:
            _say(f"review: {killed}: the change set is kept in {directory}")
            _say(_hint(directory))
            return
        decision = review.decision
        if decision == ASK:
            from sandboxd.cli.keys import person_at_terminal
            decision = _ask(kept) if person_at_terminal() else KEEP
        if decision == KEEP:
            _say(f"review: kept in {directory}")
            _say(_hint(directory))
        elif decision == DISCARD:
            kept.remove()
            _say("review: discarded")
        else:
            outcome = commands.apply(kept, [])
            commands.report_apply(kept, outcome, prefix="sandboxd run: ")
            if commands.remove_if_done(kept):
                return
            _say(f"review: what was not applied is kept in {directory}")
            _say(_hint(directory))


def _ask(kept: "KeptDir") -> str:
    """[a]pply [d]iscard [k]eep [r]eview, on the terminal (cli.keys.ask_review)."""
    from sandboxd.cli import review_commands as commands
    from sandboxd.cli.keys import ask_review
    key = ask_review(lambda: commands.print_diffs(kept, [], sys.stderr))
    return {"a": APPLY, "d": DISCARD}.get(key, KEEP)
