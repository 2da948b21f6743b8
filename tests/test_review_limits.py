"""What a kept change set can make the host hold or its commands fail on (issue 25, the hostile
pass's findings), on the real kernel: the sandbox's commands run as the workspace's owner, a plain
user the tests create; `sandboxd run --review=keep:DIR` and `sandboxd changes|apply|discard DIR` as
root. Each wall is shown next to its control.

A sparse file the sandbox made is applied with its holes (control: a dense copy of it holds every
block), and what one apply writes is bounded by the apparent sizes of its files (control: the same
files under a bound that fits them land).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from conftest import BASE_ENV, SANDBOXD, SLOW, describe
from sandboxd.kernel import overlay
from sandboxd.review import apply as applying
from sandboxd.review import kept
from test_review_overlay import Place, fresh, place, review_run  # noqa: F401 - the module's fixture

pytestmark = pytest.mark.timeout(300)

MiB = 1 << 20
GiB = 1 << 30


def sbx(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([SANDBOXD, *args], capture_output=True, text=True, timeout=120 * SLOW,
                          stdin=subprocess.DEVNULL, env=BASE_ENV)


def dense_copy(source: Path, target: Path) -> None:
    """Every byte read and written, as apply did before it kept holes."""
    with open(source, "rb") as reading, open(target, "wb") as writing:
        while block := reading.read(MiB):
            writing.write(block)


def test_a_sparse_file_is_applied_with_its_holes(place: Place) -> None:
    ws, review_dir = fresh(place, "sparse")
    result = review_run(ws, review_dir, "truncate -s 1G big && printf data | dd of=big bs=1 seek=4096 conv=notrunc "
                                        "2>/dev/null && truncate -s 1G big")
    assert result.returncode == 0, describe(result)
    applied = sbx("apply", str(review_dir))
    assert applied.returncode == 0 and "review: applied 1 change(s)" in applied.stderr, describe(applied)
    big = (ws / "big").stat()
    assert big.st_size == GiB and big.st_uid == place.owner.uid
    assert big.st_blocks * 512 <= MiB, big.st_blocks                   # a few blocks, not a gibibyte
    with open(ws / "big", "rb") as landed:
        assert landed.read(4096) == bytes(4096) and landed.read(4) == b"data"
    # Control: a copy that writes every byte holds every block.
    control = place.base / "sparse-dense-control"
    try:
        dense_copy(ws / "big", control)
        assert control.stat().st_blocks * 512 >= GiB
    finally:
        control.unlink(missing_ok=True)


def test_what_one_apply_writes_is_bounded_by_apparent_sizes(place: Place) -> None:
    ws, review_dir = fresh(place, "bounded")
    # Two names of one inode count twice: a hard link is a second file on the host.
    result = review_run(ws, review_dir, "truncate -s 3M a && truncate -s 3M b && ln b c")
    assert result.returncode == 0, describe(result)
    (layers,) = overlay.load(str(review_dir))

    def under(bound: int) -> applying.ApplyResult:
        return kept._with_comparison(layers, lambda compared: applying.apply(compared, max_written=bound))

    bounded = under(7 * MiB)
    assert sorted(item.path for item in bounded.applied) == ["a", "b"], bounded
    (skip,) = bounded.skipped
    assert skip.path == "c" and "would take this apply past the 7 MiB (apparent sizes, holes counted)" in skip.reason
    assert not (ws / "c").exists() and (ws / "a").stat().st_size == 3 * MiB
    alone = under(2 * MiB)
    assert all("its size, 3 MiB, is past the 2 MiB" in item.reason for item in alone.skipped), alone
    # Control: a bound that fits all three lands the third name.
    fits = under(9 * MiB)
    assert [item.path for item in fits.applied if item.path == "c"] == ["c"], fits
    assert (ws / "c").stat().st_size == 3 * MiB


def test_a_full_store_is_said_in_one_line_and_what_landed_is_not_written_again(place: Place) -> None:
    ws, review_dir = fresh(place, "full-store")
    # A flagged file (.envrc, skipped unless named) fills the 1 MiB store; a host file deleted is a
    # whiteout, which takes no page: dropping it once applied gives the store no room back.
    result = review_run(ws, review_dir, "rm del.txt; head -c 4000000 /dev/zero > .envrc; true", "--review-bytes=1M")
    assert result.returncode == 0, describe(result)
    applied = sbx("apply", str(review_dir), str(ws / "del.txt"))
    lines = applied.stderr.splitlines()
    assert applied.returncode == 2 and len(lines) == 1, describe(applied)
    assert "applied 1 change(s) (1 dropped from the change set)" in lines[0] and "is full" in lines[0], describe(applied)
    assert f"make room with `sandboxd discard {review_dir}" in lines[0] and "Errno" not in lines[0], describe(applied)
    assert not (ws / "del.txt").exists()
    # What landed left the change set: the next apply does not write it again.
    (ws / "del.txt").write_text("the host's again\n")
    again = sbx("apply", str(review_dir), str(ws / "del.txt"))
    assert (ws / "del.txt").read_text() == "the host's again\n", describe(again)
    shown = sbx("changes", str(review_dir))
    assert shown.returncode == 0 and "del.txt" not in shown.stdout and ".envrc" in shown.stdout, describe(shown)
    made_room = sbx("discard", str(review_dir), str(ws / ".envrc"))
    assert made_room.returncode == 0 and "nothing is left" in made_room.stderr, describe(made_room)
    # Control: the same run in a store with room, the same apply records what landed.
    ws2, roomy = fresh(place, "roomy-store")
    result = review_run(ws2, roomy, "rm del.txt; head -c 4000000 /dev/zero > .envrc; true", "--review-bytes=8M")
    assert result.returncode == 0, describe(result)
    applied = sbx("apply", str(roomy), str(ws2 / "del.txt"))
    assert applied.returncode == 0 and applied.stderr == "review: applied 1 change(s)\n", describe(applied)
    assert [path.stat().st_size > 0 for path in roomy.glob("*/baseline.json")] == [True], list(roomy.rglob("*"))[:20]


def test_mode_changes_are_shown_with_the_modes(place: Place) -> None:
    ws, review_dir = fresh(place, "modes")
    odd = ws / "odd\x1b[2Jname"
    odd.write_text("odd\n")
    os.chmod(odd, 0o644)
    os.chown(odd, place.owner.uid, place.owner.gid)
    script = ("chmod 777 chmod.sh; chmod 700 sub; echo more >> mod.txt; chmod 600 mod.txt; echo more >> keep.txt; "
              "chmod 666 odd*")
    result = review_run(ws, review_dir, script)
    assert result.returncode == 0, describe(result)
    summary = result.stderr
    assert "metadata     chmod.sh [mode 0644 -> 0777]" in summary, describe(result)
    assert "metadata     sub [mode 0755 -> 0700]" in summary, describe(result)
    assert "modified     mod.txt [mode 0644 -> 0600]" in summary, describe(result)
    assert "metadata     odd\\x1b[2Jname [mode 0644 -> 0666]" in summary and "\x1b" not in summary, describe(result)
    # Control: a change of content alone says no mode.
    assert "modified     keep.txt\n" in summary, describe(result)
    shown = sbx("changes", str(review_dir))
    assert "  metadata     chmod.sh [mode 0644 -> 0777] [flagged: writable by every user" in shown.stdout, describe(shown)
    assert "  modified     keep.txt\n" in shown.stdout, describe(shown)
    diff = sbx("changes", str(review_dir), "--diff")
    assert "metadata sub: dir mode 0755 -> 0700\n" in diff.stdout, describe(diff)
    assert "metadata chmod.sh: mode 0644 -> 0777\n" in diff.stdout, describe(diff)
    # Content and mode both changed: both shown.
    assert "modified mod.txt: mode 0644 -> 0600\n--- a/mod.txt\n+++ b/mod.txt\n" in diff.stdout, describe(diff)
    assert "+more\n" in diff.stdout and "keep.txt: mode" not in diff.stdout, describe(diff)


def test_an_owner_change_is_shown_with_the_owners() -> None:
    from sandboxd.review.changes import MODE, OWNER, Change, attributes
    change = Change("f", "metadata", type="file", host_type="file", aspects=(MODE, OWNER), mode=0o4755,
                    host_mode=0o755, uid=0, gid=0, host_uid=1000, host_gid=100)
    assert attributes(change) == "mode 0755 -> 4755, owner 1000:100 -> 0:0"
    assert attributes(Change("f", "modified", type="file", host_type="file", aspects=("content",))) == ""


# Directories 200 bytes a name, each made from inside its parent: the deepest path is 5,025 bytes.
DEEP = ("python3 -c 'import os\nfor _ in range(25):\n    os.mkdir(\"d\" * 200); os.chdir(\"d\" * 200)\n"
        "open(\"f\", \"w\").write(\"x\")'")


def test_a_path_longer_than_path_max_is_said_in_one_line_and_discard_removes_it(place: Place) -> None:
    ws, review_dir = fresh(place, "deep")
    result = review_run(ws, review_dir, DEEP)
    assert result.returncode == 0, describe(result)
    (said,) = [line for line in result.stderr.splitlines() if "longer than" in line]
    assert "holds a path longer than the kernel's 4096 bytes" in said and len(said) < 400, describe(result)
    assert "Errno" not in result.stderr and f"kept in {review_dir}" in said, describe(result)
    shown = sbx("changes", str(review_dir))
    lines = shown.stderr.splitlines()
    assert shown.returncode == 2 and len(lines) == 1 and len(lines[0]) < 400, describe(shown)
    assert "cannot be listed or applied path by path; discard it all" in lines[0], describe(shown)
    # Control: the path is real, and past what one system call takes.
    (layer,) = overlay.load(str(review_dir))
    with pytest.raises(OSError) as refused:
        os.stat(f"{layer.upper}/{'/'.join(['d' * 200] * 25)}/f")
    assert refused.value.errno == 36                                    # ENAMETOOLONG
    gone = sbx("discard", str(review_dir))
    assert gone.returncode == 0 and f"review: discarded; removed {review_dir}" in gone.stderr, describe(gone)
    assert not review_dir.exists() and not (ws / ("d" * 200)).exists()
