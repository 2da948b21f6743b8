"""A change set kept in a review directory (`sandboxd run --review=keep:DIR`; a session's under the
daemon's state directory): its overlays' records (kernel.overlay.save), their upper layers and
conflict baselines, opened and compared with the host here.

Run it as the process that may read the upper layers' attributes (root for a root run's layers:
trusted.overlay.*; the user for a rootless run's: user.overlay.*). A daemon splits the two halves
(upper.scan as root, then changes and apply as the owner) across one forked child.
"""

from __future__ import annotations

import os

from sandboxd.kernel import overlay
from sandboxd.review import conflicts, upper
from sandboxd.review.changes import PAGE, ChangeSet, Comparison

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Callable, TypeVar

    from sandboxd.review.apply import ApplyResult

    T = TypeVar("T")

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def open_stack(layers: overlay.Layers) -> "tuple[int, ...]":
    """Descriptors of the layers sandboxd owns, in Layers.stack's order (the upper, then the
    checkpoints newest first): what upper.scan_stack reads, Comparison and discard take."""
    fds: list[int] = []
    try:
        for path in layers.stack:
            fds.append(os.open(path, DIR_FLAGS))
    except BaseException:
        close_stack(tuple(fds))
        raise
    return tuple(fds)


def close_stack(fds: "tuple[int, ...]") -> None:
    for fd in fds:
        os.close(fd)


def _with_comparison(layers: overlay.Layers, body: "Callable[[Comparison], T]") -> "T":
    stack = open_stack(layers)
    try:
        # By path: Comparison then checks it is the very directory the layers were made over.
        host_fd = os.open(layers.root, DIR_FLAGS)
        try:
            entries = upper.scan_stack(stack, prefix=layers.xattr_prefix)
            baseline = conflicts.load_baseline(os.path.dirname(layers.upper), layers.started_ns)
            with Comparison(entries, upper_fd=stack[0], host_fd=host_fd, layers=layers, baseline=baseline,
                            checkpoint_fds=stack[1:]) as compared:
                return body(compared)
        finally:
            os.close(host_fd)
    finally:
        close_stack(stack)


def list_changes(review_dir: str, *, limit: int = PAGE) -> "list[ChangeSet]":
    """The first page of each overlay's changes, from the layers' record in ``review_dir``."""
    return list_layers(overlay.load(review_dir), limit=limit)


def list_layers(layers: "list[overlay.Layers]", *, limit: int = PAGE) -> "list[ChangeSet]":
    """The first page of each of these overlays' changes."""
    return [_with_comparison(item, lambda compared: compared.list(limit=limit)) for item in layers]


def apply_changes(review_dir: str, root: str, paths: tuple[str, ...] = ("",), *, force: bool = False,
                  include_flagged: frozenset[str] = frozenset()) -> "ApplyResult":
    """Apply ``paths`` of the overlay over ``root``; its baseline is saved after."""
    from sandboxd.review import apply as applying

    for layers in overlay.load(review_dir):
        if layers.root == root:
            result = _with_comparison(layers, lambda compared: applying.apply(
                compared, paths, force=force, include_flagged=include_flagged))
            conflicts.save_baseline(os.path.dirname(layers.upper), result.baseline)
            return result
    raise KeyError(root)
