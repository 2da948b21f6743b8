"""Review mode's checkpoints on the real kernel: layers stacked under the upper, the merged change
set, rollback, apply after checkpoints, and the cost of a checkpoint.

Each step runs its commands as the workspace's owner inside a private mount namespace where the
session's overlay is mounted exactly as a sandbox's is (kernel.overlay.mount_over from the
layers' record, checkpoint layers stacked: ``lowerdir=ckN:...:ck1:HOST``); between steps the
overlay is unmounted (the namespace is gone), which is when review.checkpoints runs. The view the
commands saw at each checkpoint is kept (a snapshot taken inside the overlay) and compared with
what a rollback shows.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from conftest import BASE_ENV, PY, REPO, SLOW, describe
from daemon_helpers import PlainUser, owned_dir, plain_users
from review_helpers import as_owner, kinds, scan_kept, snapshot
from sandboxd.errors import Exhausted, InvalidPolicy, NotFound, SetupError
from sandboxd.kernel import beneath, overlay, review_space
from sandboxd.review import apply as applying
from sandboxd.review import changes as listing
from sandboxd.review import checkpoints, conflicts, kept, upper
from test_review_overlay import Place, code_for_plain_users, place, rootless_state  # noqa: F401 - a fixture

pytestmark = pytest.mark.timeout(int(300 * SLOW))       # the VM matrix's TCG guest: SLOW = 10
MIB = 1 << 20


HOST_FILES = {"a.txt": "a0\n", "b.txt": "b0\n", "c.txt": "c0\n", "keep.txt": "keep\n", "mid/m1": "m1\n",
              "mid/m2": "m2\n", "opq/o1": "o1\n", "opq/o2": "o2\n", "sub/inner.txt": "inner\n",
              "deep/x": "x\n", "deep/y": "y\n"}


def workspace(place: Place, name: str, files: "dict[str, str] | None" = None, *,
              layers: bool = True, size: int = 0) -> tuple[Path, Path]:
    """A workspace of the owner's and an empty review session over it (kernel.overlay's layers and
    record, as a review session's are made; ``layers`` False: only its path; ``size``: its review
    directory a bounded store of that many bytes, kernel.review_space, as a daemon session's is)."""
    ws = owned_dir(place.base / name, place.owner)
    for rel, text in (HOST_FILES if files is None else files).items():
        path = ws / rel
        if not path.parent.exists():
            path.parent.mkdir(parents=True)
            os.chown(path.parent, place.owner.uid, place.owner.gid)
        path.write_text(text)
        os.chmod(path, 0o644)
        os.chown(path, place.owner.uid, place.owner.gid)
    # The session starts after the last write: the conflict check takes a ctime in the start's
    # clock tick for a change (a false alarm), so wait for the coarse clock to pass it.
    newest = max(path.lstat().st_ctime_ns for path in (ws, *ws.rglob("*")))
    while time.clock_gettime_ns(overlay.CLOCK_REALTIME_COARSE) <= newest:
        time.sleep(0.002)
    review_dir = place.base / f"{name}-review"
    if not layers:
        return ws, review_dir
    overlay.make_review_dir(str(review_dir))
    if size:
        review_space.bound(str(review_dir), size)
    fd = os.open(ws, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        layers = overlay.make_layers(str(review_dir), 0, str(ws), fd, userxattr=False)
    finally:
        os.close(fd)
    overlay.save(str(review_dir), [layers])
    return ws, review_dir


# Mounts the overlay of the record in argv[1] over its root (in this private mount namespace),
# runs argv[4] there as uid argv[2], gid argv[3], and prints the command's result and the view.
IN_OVERLAY = textwrap.dedent("""\
    import json, os, stat, subprocess, sys
    from sandboxd.kernel import overlay
    review_dir, uid, gid, script = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
    user = {} if uid == "-" else {"user": int(uid), "group": int(gid), "extra_groups": []}   # "-": as it is
    (layers,) = overlay.load(review_dir)
    fds = [os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW)
           for path in (layers.upper, layers.work, *layers.checkpoints)]
    lower = os.open(layers.root, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW)
    overlay.mount_over(layers.root, lower_fd=lower, upper_fd=fds[0], work_fd=fds[1], userxattr=layers.userxattr,
                       shown=layers.root, checkpoint_fds=tuple(fds[2:]))
    ran = subprocess.run(["sh", "-c", script], cwd=layers.root, capture_output=True, text=True, **user)
    view = {}
    for dirpath, dirnames, filenames in os.walk(layers.root):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            body = (os.readlink(path) if stat.S_ISLNK(st.st_mode) else open(path, "rb").read().decode("latin-1")
                    if stat.S_ISREG(st.st_mode) else None)
            view[os.path.relpath(path, layers.root)] = [stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode),
                                                        st.st_uid, st.st_gid, body]
    print(json.dumps({"returncode": ran.returncode, "stdout": ran.stdout, "stderr": ran.stderr, "view": view}))
""")


def in_overlay(place: Place, review_dir: Path, script: str = "true") -> dict[str, Any]:
    """Run ``script`` as the owner in the session's overlay (every layer of the record stacked);
    returns its result and the tree it left, as seen through the overlay."""
    result = subprocess.run(["unshare", "-m", "--propagation", "private", sys.executable, "-c", IN_OVERLAY,
                             str(review_dir), str(place.owner.uid), str(place.owner.gid), script],
                            capture_output=True, text=True, timeout=120 * SLOW, env=BASE_ENV, cwd=REPO)
    assert result.returncode == 0, describe(result)
    ran: dict[str, Any] = json.loads(result.stdout)
    assert ran["returncode"] == 0, ran
    return ran


def host_view(ws: Path) -> dict[str, list[object]]:
    """The host tree in in_overlay's form."""
    return {path: [kind, mode, uid, gid, body.decode("latin-1") if isinstance(body, bytes) else body]
            for path, (kind, mode, uid, gid, body) in snapshot(ws).items()}


STEP1 = "echo a1 > a.txt; echo new > new1.txt; rm b.txt; mkdir made && echo f > made/f; echo x1 > deep/x\n"
# A whiteout in the middle layer over a file the first layer made (new1.txt) and over a host
# directory (mid); an opaque directory in the middle layer over a host directory (opq).
STEP2 = "echo a2 > a.txt; rm new1.txt; rm -rf mid; rm -rf opq && mkdir opq && echo n > opq/n; echo c2 > c.txt\n"
# Over the middle layer: a file made again where the first layer deleted it, a file added to the
# opaque directory, one to the directory the first layer made, one beside a file the first layer changed.
STEP3 = "echo a3 > a.txt; echo b3 > b.txt; echo more > opq/more; echo g > made/g; echo y3 > deep/y; " \
        "echo i3 > sub/inner.txt\n"
AFTER = {1: {("a.txt", listing.MODIFIED), ("new1.txt", listing.ADDED), ("b.txt", listing.DELETED),
             ("made", listing.ADDED), ("made/f", listing.ADDED), ("deep/x", listing.MODIFIED)}}
AFTER[2] = (AFTER[1] - {("new1.txt", listing.ADDED)}) | {
    ("mid", listing.DELETED), ("opq", listing.REPLACED), ("opq/n", listing.ADDED), ("c.txt", listing.MODIFIED)}
AFTER[3] = (AFTER[2] - {("b.txt", listing.DELETED)}) | {
    ("b.txt", listing.MODIFIED), ("opq/more", listing.ADDED), ("made/g", listing.ADDED),
    ("deep/y", listing.MODIFIED), ("sub/inner.txt", listing.MODIFIED)}


def three_checkpoints(place: Place, name: str) -> tuple[Path, Path, dict[int, dict[str, Any]]]:
    """A workspace after STEP1..3, a checkpoint after each, and the view at each (0: the start)."""
    ws, review_dir = workspace(place, name)
    views = {0: host_view(ws)}
    for number, step in enumerate((STEP1, STEP2, STEP3), start=1):
        views[number] = in_overlay(place, review_dir, step)["view"]
        made = checkpoints.create(str(review_dir), label=f"after step {number}")
        assert made.id == number
    return ws, review_dir, views


def test_three_checkpoints_the_merged_change_set_and_rollback_to_each(place: Place) -> None:
    ws, review_dir, views = three_checkpoints(place, "rollback")
    control = snapshot(ws)
    # The layers are stacked: the sandbox sees what it left, the host nothing.
    assert in_overlay(place, review_dir)["view"] == views[3]
    assert snapshot(ws) == control
    listed = checkpoints.list_checkpoints(str(review_dir))
    assert [(item.id, item.label) for item in listed] == [(1, "after step 1"), (2, "after step 2"), (3, "after step 3")]
    # What each layer changed: files, whiteouts, directories made or replaced (not deep/ nor made/
    # in the third: copied up only to hold a change).
    assert [item.changes for item in listed] == [6, 6, 6]
    assert all(a.time_ns <= b.time_ns for a, b in zip(listed, listed[1:], strict=False))
    assert kinds(as_owner(place.owner, review_dir, "list")) == AFTER[3]
    # Changes after the last checkpoint, then back to each checkpoint in turn.
    in_overlay(place, review_dir, "echo a4 > a.txt; rm c.txt; mkdir late")
    assert ("late", listing.ADDED) in kinds(as_owner(place.owner, review_dir, "list"))
    for target, dropped in ((3, ()), (2, (3,)), (1, (2,))):
        done = checkpoints.rollback(str(review_dir), target)
        assert done.to == target and done.dropped == dropped, done
        assert in_overlay(place, review_dir)["view"] == views[target], target
        assert kinds(as_owner(place.owner, review_dir, "list")) == AFTER[target], target
        assert [item.id for item in checkpoints.list_checkpoints(str(review_dir))] == list(range(1, target + 1))
        (layers,) = overlay.load(str(review_dir))
        assert [os.path.basename(path) for path in layers.checkpoints] == [str(n) for n in range(1, target + 1)]
        assert sorted(os.listdir(Path(layers.upper).parent / checkpoints.LAYERS_DIR)) == \
            [str(n) for n in range(1, target + 1)]                # the dropped layers are gone from disk
    with pytest.raises(NotFound, match="no checkpoint 3"):
        checkpoints.rollback(str(review_dir), 3)                  # dropped: no longer there
    # Ids are never reused: the next checkpoint is 4, and the start (0) drops everything.
    assert checkpoints.create(str(review_dir), "again").id == 4
    checkpoints.rollback(str(review_dir), 0)
    assert in_overlay(place, review_dir)["view"] == views[0]
    assert as_owner(place.owner, review_dir, "list")["changes"] == []
    assert checkpoints.list_checkpoints(str(review_dir)) == [] and snapshot(ws) == control


def test_changes_only_in_a_checkpoint_layer_are_not_taken_for_none(place: Place) -> None:
    """A session's end asks whether anything changed (overlay.upper_is_empty, remove_if_unchanged):
    a checkpoint leaves the upper empty, its changes in the layer below."""
    ws, review_dir = workspace(place, "only-in-checkpoint")
    in_overlay(place, review_dir, STEP1)
    checkpoints.create(str(review_dir), label="all of it")
    (layers,) = overlay.load(str(review_dir))
    fd = os.open(layers.upper, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert os.listdir(fd) == []                                  # the upper alone says "nothing"
        assert overlay.upper_is_empty(fd, layers.root) is True       # control: the check without the layers
        assert overlay.upper_is_empty(fd, layers.root, layers.checkpoints) is False
    finally:
        os.close(fd)
    assert overlay.remove_if_unchanged(str(review_dir)) is False
    assert kinds(as_owner(place.owner, review_dir, "list")) == AFTER[1]
    # Control: a session that changed nothing is removed.
    _, untouched = workspace(place, "untouched")
    assert overlay.remove_if_unchanged(str(untouched)) is True and not untouched.exists()


def test_apply_after_checkpoints_lands_exactly_the_merged_state(place: Place) -> None:
    ws, review_dir, views = three_checkpoints(place, "apply")
    in_overlay(place, review_dir, "echo a4 > a.txt; ln -s keep.txt link")     # and some in the upper
    seen = in_overlay(place, review_dir)["view"]
    done = as_owner(place.owner, review_dir, "apply")
    assert done["skipped"] == [], done["skipped"]
    assert host_view(ws) == seen                                  # type, mode, owner and content of each
    assert (ws / "a.txt").read_text() == "a4\n" and (ws / "b.txt").read_text() == "b3\n"
    assert not (ws / "mid").exists() and sorted(os.listdir(ws / "opq")) == ["more", "n"]
    # What landed is dropped from every layer (the daemon does so, overlay unmounted): nothing is
    # left to list, and the sandbox sees the host, which is what it saw.
    (layers,) = overlay.load(str(review_dir))
    _, entries = scan_kept(review_dir)
    fds = kept.open_stack(layers)
    try:
        forgotten = applying.discard(fds[0], entries, tuple(done["forgettable"]), checkpoint_fds=fds[1:])
    finally:
        kept.close_stack(fds)
    assert forgotten.skipped == ()
    assert as_owner(place.owner, review_dir, "list")["changes"] == []
    assert in_overlay(place, review_dir)["view"] == seen


def test_a_middle_layers_whiteout_and_opaque_directory_hide_what_is_below(place: Place) -> None:
    ws, review_dir, _ = three_checkpoints(place, "middle")
    layers, entries = scan_kept(review_dir)
    by_path = {entry.path: entry for entry in entries}
    # The whiteouts and the opaque directory are in the middle layer (checkpoint 2: stack index 2).
    assert (by_path["mid"].kind, by_path["mid"].layer) == (upper.WHITEOUT, 2)
    assert (by_path["new1.txt"].kind, by_path["new1.txt"].layer) == (upper.WHITEOUT, 2)
    assert by_path["opq"].opaque and by_path["opq"].layer == 1 and by_path["opq/n"].layer == 2
    # Nothing under them from the layers below or the host.
    assert not [path for path in by_path if path.startswith(("mid/", "opq/o"))]
    # The layer on its own: checkpoint 3's opq/ is a plain copy-up (overlayfs does not copy the
    # opaque mark), so read alone the stack's top says nothing of the replacement: control.
    fd = os.open(layers.stack[1], os.O_RDONLY | os.O_DIRECTORY)
    try:
        alone = {entry.path: entry for entry in upper.scan(fd, prefix=layers.xattr_prefix)}
    finally:
        os.close(fd)
    assert "opq" in alone and not alone["opq"].opaque
    # The view agrees: the host's mid/ and opq/o1 are not seen, opq/ holds the sandbox's own.
    view = in_overlay(place, review_dir)["view"]
    assert "mid" not in view and "new1.txt" not in view and sorted(p for p in view if p.startswith("opq/")) == \
        ["opq/more", "opq/n"]


def test_a_directory_made_over_a_lower_layers_whiteout(place: Place) -> None:
    """overlayfs makes a directory over a lower layer's whiteout without the opaque mark (over its
    upper's own whiteout it sets one): its lookup stops at the whiteout. The merged change set must
    say the host's directory was replaced (control: the upper alone says a merged directory), and
    merging the two layers marks the directory opaque, the view and the change set unchanged."""
    ws, review_dir = workspace(place, "over-whiteout")
    in_overlay(place, review_dir, "rm -rf mid; rm a.txt")
    checkpoints.create(str(review_dir))
    seen = in_overlay(place, review_dir, "mkdir mid && echo q > mid/q; mkdir a.txt")["view"]
    assert "mid/m1" not in seen and "mid/q" in seen
    layers, _ = scan_kept(review_dir)
    fd = os.open(layers.upper, os.O_RDONLY | os.O_DIRECTORY)
    try:
        alone = {entry.path: entry for entry in upper.scan(fd, prefix=layers.xattr_prefix)}
    finally:
        os.close(fd)
    assert alone["mid"].kind == upper.DIR and not alone["mid"].opaque
    expected = {("mid", listing.REPLACED), ("mid/q", listing.ADDED), ("a.txt", listing.TYPE_CHANGED)}
    assert kinds(as_owner(place.owner, review_dir, "list")) == expected
    checkpoints.create(str(review_dir), limit=1)                  # frozen, then merged into checkpoint 1
    (layers,) = overlay.load(str(review_dir))
    assert [os.path.basename(path) for path in layers.checkpoints] == ["2"]
    fd = os.open(layers.checkpoints[0], os.O_RDONLY | os.O_DIRECTORY)
    try:
        merged = {entry.path: entry for entry in upper.scan(fd, prefix=layers.xattr_prefix)}
    finally:
        os.close(fd)
    assert merged["mid"].opaque and merged["a.txt"].opaque and "mid/m1" not in merged
    assert in_overlay(place, review_dir)["view"] == seen
    assert kinds(as_owner(place.owner, review_dir, "list")) == expected
    done = as_owner(place.owner, review_dir, "apply")
    assert done["skipped"] == [], done
    assert host_view(ws) == seen


def test_conflicts_still_work_across_checkpoints(place: Place) -> None:
    """deep/ was copied up from the host into checkpoint 1 (its origin: the host's deep/) and from
    checkpoint 1 into checkpoint 3 (its origin there: checkpoint 1's directory). The conflict
    check must use the host's: a sibling the host adds is no conflict, a host edit is one."""
    ws, review_dir, _ = three_checkpoints(place, "conflicts")
    layers, entries = scan_kept(review_dir)
    deep = {entry.path: entry for entry in entries}["deep"]
    fd = os.open(layers.stack[1], os.O_RDONLY | os.O_DIRECTORY)
    try:
        top_origin = {entry.path: entry for entry in upper.scan(fd, prefix=layers.xattr_prefix)}["deep"].origin
    finally:
        os.close(fd)
    assert deep.origin and top_origin and deep.origin != top_origin
    (ws / "deep" / "added-on-host").write_text("host\n")           # moves deep/'s ctime
    (ws / "c.txt").write_text("the host's own edit\n")
    listed = {change["path"]: change for change in as_owner(place.owner, review_dir, "list")["changes"]}
    assert listed["deep/x"]["conflict"] == "" and listed["deep/y"]["conflict"] == ""
    assert "changed on the host" in listed["c.txt"]["conflict"]
    assert listed["a.txt"]["conflict"] == ""
    # Control: with the top layer's origin (a checkpoint's directory), deep/ looks replaced on the host.
    host_fd = os.open(ws, os.O_RDONLY | os.O_DIRECTORY)
    lookups = conflicts.HostLookups(host_fd)
    try:
        naive = conflicts.conflict("deep/y", {"deep": top_origin}, lookups,
                                   conflicts.Baseline(started_ns=layers.started_ns))
    finally:
        lookups.close()
        os.close(host_fd)
    assert "replaced or moved" in naive
    done = as_owner(place.owner, review_dir, "apply")
    assert {item["path"] for item in done["skipped"]} == {"c.txt"}
    assert (ws / "deep" / "y").read_text() == "y3\n" and (ws / "c.txt").read_text() == "the host's own edit\n"


def test_discard_takes_a_path_out_of_every_layer(place: Place) -> None:
    ws, review_dir, _ = three_checkpoints(place, "discard")
    (layers,) = overlay.load(str(review_dir))
    _, entries = scan_kept(review_dir)
    fds = kept.open_stack(layers)
    try:
        # Merged entries without the checkpoint layers' descriptors: refused, not the upper alone.
        with pytest.raises(ValueError, match="from 4 layers, 1 descriptors"):
            applying.discard(fds[0], entries, ("a.txt",))
        inside = applying.discard(fds[0], entries, ("opq/n",), checkpoint_fds=fds[1:])
        assert inside.removed == () and "opq" in inside.skipped[0].reason
        # a.txt is in all three layers, made/ in the first and third.
        done = applying.discard(fds[0], entries, ("a.txt", "made"), checkpoint_fds=fds[1:])
        assert set(done.removed) == {"a.txt", "made"} and done.skipped == ()
    finally:
        kept.close_stack(fds)
    assert kinds(as_owner(place.owner, review_dir, "list")) == AFTER[3] - {
        ("a.txt", listing.MODIFIED), ("made", listing.ADDED), ("made/f", listing.ADDED), ("made/g", listing.ADDED)}
    view = in_overlay(place, review_dir)["view"]
    assert view["a.txt"][4] == "a0\n" and "made" not in view
    # A rollback does not bring a discarded change back.
    checkpoints.rollback(str(review_dir), 1)
    view = in_overlay(place, review_dir)["view"]
    assert view["a.txt"][4] == "a0\n" and "made" not in view and view["deep/x"][4] == "x1\n"


def _counted(monkeypatch: pytest.MonkeyPatch, calls: list[str]) -> None:
    """Record every file-system call review.checkpoints makes (directly or through kernel.beneath
    and review.upper): the entries it touches."""
    for module, names in ((os, ("open", "stat", "lstat", "listdir", "scandir", "rename", "mkdir", "rmdir", "unlink",
                                "getxattr", "readlink", "fchown", "fchmod")),
                          (beneath, ("open_beneath",))):
        for name in names:
            real = getattr(module, name)

            def counting(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
                calls.append(_name)
                return _real(*args, **kwargs)
            monkeypatch.setattr(module, name, counting)


def test_a_checkpoint_costs_the_changes_not_the_workspace(place: Place, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same changes in a workspace of 11 files and in one of 10,000 files in 2,000 directories:
    making a checkpoint, rolling back and merging two checkpoints touch exactly as many entries
    (file-system calls, counted) in both."""
    big = dict(HOST_FILES)
    big.update({f"tree/d{n // 5}/f{n}": "x\n" for n in range(10_000)})
    costs = []
    for name, files in (("small", HOST_FILES), ("big", big)):
        _, review_dir = workspace(place, f"cost-{name}", files)
        in_overlay(place, review_dir, "echo a1 > a.txt; rm b.txt; mkdir made; echo x > made/x")
        creating: list[str] = []
        with monkeypatch.context() as patch:
            _counted(patch, creating)
            made = checkpoints.create(str(review_dir))
        in_overlay(place, review_dir, "echo a2 > a.txt")
        rolling: list[str] = []
        with monkeypatch.context() as patch:
            _counted(patch, rolling)
            done = checkpoints.rollback(str(review_dir), made.id)
        # Past the limit (1 here): the new checkpoint is merged into the one before.
        in_overlay(place, review_dir, "echo a3 > a.txt; echo y > made/y")
        merging: list[str] = []
        with monkeypatch.context() as patch:
            _counted(patch, merging)
            checkpoints.create(str(review_dir), limit=1)
        (merged,) = checkpoints.list_checkpoints(str(review_dir))
        costs.append((made.changes, sorted(creating), sorted(rolling), done.removed, sorted(merging), merged.changes))
    small, large = costs
    assert small[0] == 4                    # a.txt, b.txt's whiteout, made/, made/x
    assert small[3] == 2                    # the dropped upper: a.txt and the directory itself
    assert small[5] == 5                    # and made/y
    assert small == large, costs
    assert max(len(small[1]), len(small[2]), len(small[4])) < 300, costs    # tens of calls, not one per entry


def test_past_the_limit_the_oldest_two_are_merged(place: Place) -> None:
    """With room for two, the third checkpoint merges the first into the second: the view, the
    change set and the second's point are unchanged, the first's is gone, and the merged layer's
    count is what counting it afresh says. Its whiteouts (new1.txt, mid) and opaque directory
    (opq) landed over the first layer's entries."""
    ws, review_dir = workspace(place, "limit")
    views = {}
    for number, step in enumerate((STEP1, STEP2, STEP3), start=1):
        views[number] = in_overlay(place, review_dir, step)["view"]
        checkpoints.create(str(review_dir), label=f"after step {number}", limit=2)
    listed = checkpoints.list_checkpoints(str(review_dir))
    assert [(item.id, item.label) for item in listed] == [(2, "after step 2"), (3, "after step 3")]
    (layers,) = overlay.load(str(review_dir))
    assert [os.path.basename(path) for path in layers.checkpoints] == ["2", "3"]
    assert sorted(os.listdir(Path(layers.upper).parent / checkpoints.LAYERS_DIR)) == ["2", "3"]
    fd = os.open(layers.checkpoints[0], os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert listed[0].changes == checkpoints.count_changes(fd, layers.xattr_prefix)
        merged = {entry.path: entry for entry in upper.scan(fd, prefix=layers.xattr_prefix)}
    finally:
        os.close(fd)
    assert merged["new1.txt"].kind == upper.WHITEOUT and merged["b.txt"].kind == upper.WHITEOUT
    assert merged["opq"].opaque and merged["deep"].origin and merged["a.txt"].size == 3
    assert in_overlay(place, review_dir)["view"] == views[3]
    assert kinds(as_owner(place.owner, review_dir, "list")) == AFTER[3]
    # deep/ keeps the host's origin (the older layer's directory stayed): a sibling on the host is no conflict.
    (ws / "deep" / "added-on-host").write_text("host\n")
    assert all(change["conflict"] == "" for change in as_owner(place.owner, review_dir, "list")["changes"])
    checkpoints.rollback(str(review_dir), 2)
    assert in_overlay(place, review_dir)["view"] == {**views[2],
                                                     "deep/added-on-host": host_view(ws)["deep/added-on-host"]}
    with pytest.raises(NotFound, match="no checkpoint 1"):
        checkpoints.rollback(str(review_dir), 1)


def test_bad_labels_and_limits_are_refused_saying_so(place: Place) -> None:
    _, review_dir = workspace(place, "bad", {"f": "f\n"})
    with pytest.raises(InvalidPolicy, match="at most 256 characters"):
        checkpoints.create(str(review_dir), "x" * 257)
    with pytest.raises(InvalidPolicy, match="1 to 64"):
        checkpoints.create(str(review_dir), limit=65)
    assert checkpoints.list_checkpoints(str(review_dir)) == []


ROOTLESS_SETUP = textwrap.dedent("""\
    import os, sys
    from sandboxd.kernel import overlay
    ws, review_dir = sys.argv[1], sys.argv[2]
    overlay.make_review_dir(review_dir)
    fd = os.open(ws, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    overlay.save(review_dir, [overlay.make_layers(review_dir, 0, ws, fd, userxattr=True)])
""")
ROOTLESS_DO = textwrap.dedent("""\
    import json, sys
    from sandboxd.review import checkpoints, kept
    review_dir, what = sys.argv[1], sys.argv[2]
    if what == "create":
        print(checkpoints.create(review_dir, limit=2).id)
    elif what == "rollback":
        print(checkpoints.rollback(review_dir, int(sys.argv[3])).to)
    else:
        (listed,) = kept.list_changes(review_dir)
        print(json.dumps(sorted([change.path, change.kind] for change in listed.changes)))
""")


def test_rootless_checkpoints_as_a_plain_user(place: Place) -> None:
    """A plain user's review session (user.overlay.* attributes, the overlay mounted in its own user
    namespace): checkpoints, the merge past the limit, the merged change set and rollback, all as
    that user."""
    state = rootless_state(place, "rootless-checkpoints")
    code = code_for_plain_users(place)
    ws, _ = workspace(place, "rootless", layers=False)
    review_dir = state / "review"
    env = {**BASE_ENV, "HOME": str(ws), "PYTHONPATH": str(code)}

    def as_user(*argv: str) -> str:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=120 * SLOW, cwd=str(ws), env=env,
                              user=place.owner.uid, group=place.owner.gid, extra_groups=[])
        assert done.returncode == 0, describe(done)
        return done.stdout

    def view(script: str = "true") -> dict[str, Any]:
        ran = json.loads(as_user("unshare", "--user", "--map-root-user", "--mount", "--propagation", "private",
                                 PY, "-c", IN_OVERLAY, str(review_dir), "-", "-", script))
        assert ran["returncode"] == 0, ran
        return dict(ran["view"])

    as_user(PY, "-c", ROOTLESS_SETUP, str(ws), str(review_dir))
    control = snapshot(ws)
    views = {}
    for step in (STEP1, STEP2, STEP3):
        views[len(views) + 1] = view(step)
        as_user(PY, "-c", ROOTLESS_DO, str(review_dir), "create")
    assert snapshot(ws) == control
    (layers,) = overlay.load(str(review_dir))
    assert layers.userxattr and [os.path.basename(path) for path in layers.checkpoints] == ["2", "3"]
    assert view() == views[3]
    assert {tuple(item) for item in json.loads(as_user(PY, "-c", ROOTLESS_DO, str(review_dir), "list"))} == AFTER[3]
    assert as_user(PY, "-c", ROOTLESS_DO, str(review_dir), "rollback", "2").strip() == "2"
    assert view() == views[2]
    assert {tuple(item) for item in json.loads(as_user(PY, "-c", ROOTLESS_DO, str(review_dir), "list"))} == AFTER[2]


def test_more_layers_than_a_mount_takes_are_refused_before_the_kernel() -> None:
    with pytest.raises(SetupError, match="more than 64 checkpoint layers"):
        overlay.mount_over("/nonexistent", lower_fd=3, upper_fd=4, work_fd=5, userxattr=False, shown="/ws",
                           checkpoint_fds=tuple(range(10, 75)))
    # At the limit the options fit one page even with five-digit descriptors.
    lowers = ":".join(f"/proc/self/fd/{fd}" for fd in range(10_000, 10_000 + overlay.MAX_CHECKPOINTS + 1))
    assert len(f"lowerdir={lowers},upperdir=/proc/self/fd/99999,workdir=/proc/self/fd/99999,"
               f"{overlay.OPTIONS},userxattr") < overlay.MAX_OPTIONS


def test_a_checkpoint_cut_short_is_recovered(place: Place) -> None:
    """A daemon killed between freezing the upper and writing the records: recover() finishes it,
    and the change set and the view are what they were."""
    ws, review_dir = workspace(place, "crash")
    in_overlay(place, review_dir, STEP1)
    before = in_overlay(place, review_dir)["view"]
    (layers,) = overlay.load(str(review_dir))
    checkpoints._freeze(layers, 1)                                # the renames done, no record written
    checkpoints.recover(str(review_dir))
    (listed,) = checkpoints.list_checkpoints(str(review_dir))
    assert (listed.id, listed.label, listed.changes) == (1, "(recovered)", 6)
    assert in_overlay(place, review_dir)["view"] == before
    assert kinds(as_owner(place.owner, review_dir, "list")) == AFTER[1]
    # A rollback cut short after its record: the layer it dropped is removed on the next start.
    in_overlay(place, review_dir, STEP2)
    checkpoints.create(str(review_dir))
    (layers,) = overlay.load(str(review_dir))
    overlay.save(str(review_dir), [layers.replace(checkpoints=layers.checkpoints[:1])])
    checkpoints.recover(str(review_dir))
    assert [item.id for item in checkpoints.list_checkpoints(str(review_dir))] == [1]
    assert sorted(os.listdir(Path(layers.upper).parent / checkpoints.LAYERS_DIR)) == ["1"]


def spares(review_dir: Path) -> int:
    return sum(1 for name in review_space.RESERVES if (review_dir / name).exists())


FILL_STORE = "echo precious > work.txt; head -c 8000000 /dev/zero > big 2>/dev/null; test -s work.txt"


def test_checkpoints_on_a_store_the_sandbox_filled_keep_a_reserve_every_time(place: Place) -> None:
    """The second hostile pass's B3: the first save took the one reserve, so the next checkpoint's
    save failed with ENOSPC half-done. Now each save's replaced record becomes the next reserve:
    checkpoint after checkpoint on a full store, and a rollback, are recorded."""
    ws, review_dir = workspace(place, "full-bytes", {"keep.txt": "keep\n"}, size=2 * MIB)
    try:
        in_overlay(place, review_dir, FILL_STORE)
        assert os.statvfs(review_dir).f_bavail == 0                # full: not a page left
        for index in range(1, 6):
            made = checkpoints.create(str(review_dir), f"c{index}")
            assert made.id == index
            assert spares(review_dir) >= 1                          # a reserve for the next save
        assert [item.id for item in checkpoints.list_checkpoints(str(review_dir))] == [1, 2, 3, 4, 5]
        assert checkpoints.rollback(str(review_dir), 1).dropped == (2, 3, 4, 5)
        (change_set,) = kept.list_changes(str(review_dir))
        assert {change.path for change in change_set.changes} == {"work.txt", "big"}
        assert in_overlay(place, review_dir, "cat work.txt")["stdout"] == "precious\n"
        # Control: a store whose reserves are gone (as one made before there were three, its one
        # reserve taken) has no room to record a checkpoint: refused before anything changes.
        for name in review_space.RESERVES:
            (review_dir / name).unlink(missing_ok=True)
        record = (review_dir / overlay.LAYERS_FILE).read_bytes()
        upper_before = sorted(os.listdir(review_dir / "0" / "upper"))
        with pytest.raises(Exhausted, match="fills its store .*discard some changes.*Nothing was changed"):
            checkpoints.create(str(review_dir), "refused")
        with pytest.raises(Exhausted, match="a rollback could not be recorded"):
            checkpoints.rollback(str(review_dir), 0)
        assert (review_dir / overlay.LAYERS_FILE).read_bytes() == record
        assert sorted(os.listdir(review_dir / "0" / "upper")) == upper_before
        assert os.listdir(review_dir / "0" / "checkpoints") == ["1"]
        assert [item.id for item in checkpoints.list_checkpoints(str(review_dir))] == [1]
        assert not overlay.remove_if_unchanged(str(review_dir))     # and a close keeps it all
    finally:
        overlay.remove_layers(str(review_dir))
    assert not ws.joinpath("work.txt").exists()


def test_a_checkpoint_layer_no_record_names_keeps_the_change_set_at_close(place: Place) -> None:
    """A checkpoint cut short after freezing the upper (the record naming no checkpoint, the upper
    empty) must not read as "unchanged": closing the session would delete the frozen changes."""
    ws, review_dir = workspace(place, "unrecorded", {"keep.txt": "keep\n"})
    in_overlay(place, review_dir, "echo precious > work.txt")
    base = review_dir / "0"
    (base / "checkpoints").mkdir(mode=0o700)
    os.rename(base / "upper", base / "checkpoints" / "1")           # as _freeze does, the record not yet saved
    (base / "upper").mkdir()
    shutil.copystat(base / "checkpoints" / "1", base / "upper")
    os.chown(base / "upper", place.owner.uid, place.owner.gid)
    assert overlay.load(str(review_dir))[0].checkpoints == ()
    assert not overlay.remove_if_unchanged(str(review_dir))
    assert (base / "checkpoints" / "1" / "work.txt").read_text() == "precious\n"
    # Control: the layer recorded (recover names it) and then emptied by a discard of everything,
    # the directory holds nothing and is removed.
    checkpoints.recover(str(review_dir))
    assert [path.rsplit("/", 1)[1] for path in overlay.load(str(review_dir))[0].checkpoints] == ["1"]
    os.unlink(base / "checkpoints" / "1" / "work.txt")
    assert overlay.remove_if_unchanged(str(review_dir))
    assert not review_dir.exists()
