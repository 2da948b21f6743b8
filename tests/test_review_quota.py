"""Review mode's disk bound (issue 25, item 7): a review store is a tmpfs of the session's share
(kernel.review_space), so a sandbox writing past it gets ENOSPC inside the sandbox, from the
kernel, and the runner or daemon goes on; an owner's sessions share review.owner_bytes; the store
outlives the run (a SIGKILLed runner too) and leaves no mount once freed.

Each bound is shown next to its control (the same write without the bound, or with the owner's
whole share). Writes are made by the workspace's owner, a plain user the tests create: through
`sandboxd run --review=keep:DIR --review-bytes=SIZE`, or through an overlay mounted directly over
a store in a private mount namespace, as the daemon's session will (its second session's share).
"""

from __future__ import annotations

import errno
import json
import os
import signal
import shutil
import subprocess
import textwrap
import time
from pathlib import Path

import pytest

from conftest import BASE_ENV, PY, REPO, SANDBOXD, SLOW, describe
from daemon_helpers import owned_dir
from sandboxd import config
from sandboxd.config import ConfigError
from sandboxd.errors import Exhausted, InvalidPolicy
from sandboxd.kernel import overlay, review_space
from sandboxd.review import kept
from test_review_overlay import Place, place  # noqa: F401 - the module's fixture: plain users, a local disk

pytestmark = pytest.mark.timeout(300)

MiB = 1 << 20
# Writes 64 KiB at a time into FILE until the kernel refuses one or LIMIT bytes are written; prints
# what it wrote and the refusal's errno name (or "none"), then exits 3: the run's exit must be this.
FILL = textwrap.dedent("""\
    import errno, os, sys
    fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT, 0o644)
    written, refused = 0, "none"
    try:
        while written < int(sys.argv[2]):
            written += os.write(fd, b"x" * 65536)
    except OSError as exc:
        refused = errno.errorcode[exc.errno]
    print(written, refused)
    sys.exit(3)
""")


def mounted(path: Path) -> bool:
    """Whether /proc/self/mountinfo (the test's, the host's namespace) has a mount at ``path``."""
    with open("/proc/self/mountinfo") as info:
        return any(line.split()[4] == str(path) for line in info)


def fill_run(ws: Path, review_dir: Path, limit: int, *extra: str) -> tuple[subprocess.CompletedProcess[str], int, str]:
    result = subprocess.run([SANDBOXD, "run", f"--review=keep:{review_dir}", "--workspace", str(ws), *extra,
                             "--", "python3", "-c", FILL, "big", str(limit)], capture_output=True, text=True,
                            timeout=120 * SLOW, stdin=subprocess.DEVNULL, env=BASE_ENV, cwd=str(ws))
    words = result.stdout.split()
    assert len(words) == 2, describe(result)
    return result, int(words[0]), words[1]


def test_a_write_past_the_session_bound_gets_enospc_in_the_sandbox(place: Place) -> None:
    ws = owned_dir(place.base / "bounded", place.owner)
    review_dir = place.base / "bounded-review"
    result, written, refused = fill_run(ws, review_dir, 16 * MiB, "--review-bytes=4M")
    # Inside: the kernel's ENOSPC at the bound (the layers' record took no byte of it: kernel.overlay.save).
    assert refused == "ENOSPC", describe(result)
    assert written == 4 * MiB, describe(result)
    # The runner is unharmed: the exit status is the command's, the change set was recorded and summarised.
    assert result.returncode == 3, describe(result)
    assert "Traceback" not in result.stderr and "could not" not in result.stderr, result.stderr
    assert "review: 1 change(s) to" in result.stderr, result.stderr
    (change_set,) = kept.list_changes(str(review_dir))
    assert [(change.path, change.kind, change.size) for change in change_set.changes] == [("big", "added", 4 * MiB)]
    assert not (ws / "big").exists()                    # and the host saw nothing
    review_space.free(review_space.Store(path=str(review_dir), size=4 * MiB))
    # Control: the same write with the bound explicitly off lands in full.
    ws2 = owned_dir(place.base / "unbounded", place.owner)
    free_dir = place.base / "unbounded-review"
    result, written, refused = fill_run(ws2, free_dir, 16 * MiB, "--review-bytes=0")
    assert (written, refused, result.returncode) == (16 * MiB, "none", 3), describe(result)
    assert not review_space.is_store(str(free_dir))
    overlay.remove_layers(str(free_dir))


UNLINK_ALL = textwrap.dedent("""\
    import errno, os
    removed, refused = 0, "none"
    for name in sorted(os.listdir(".")):
        try:
            os.unlink(name)
            removed += 1
        except OSError as exc:
            refused = errno.errorcode[exc.errno]
            break
    print(removed, refused)
""")


def test_deletions_count_against_the_bound_as_inodes(place: Place) -> None:
    """Each deletion of a host file is a whiteout in the upper layer: an inode, bounded with the
    store (one per 4 KiB of its size, at least 1024), so a sandbox cannot grow a store's kernel
    memory without bound through empty files either."""
    ws = owned_dir(place.base / "many", place.owner)
    for index in range(1500):
        (ws / f"f{index:04}").touch()
    outcomes = {}
    for size in ("4M", "0"):
        review_dir = place.base / f"many-review-{size}"
        result = subprocess.run([SANDBOXD, "run", f"--review=keep:{review_dir}", f"--review-bytes={size}",
                                 "--workspace", str(ws), "--", "python3", "-c", UNLINK_ALL], capture_output=True,
                                text=True, timeout=120 * SLOW, stdin=subprocess.DEVNULL, env=BASE_ENV, cwd=str(ws))
        assert result.returncode == 0, describe(result)
        removed, refused = result.stdout.split()
        outcomes[size] = (int(removed), refused)
        overlay.remove_layers(str(review_dir))
        assert not mounted(review_dir)
    assert outcomes["4M"][1] == "ENOSPC" and 1000 <= outcomes["4M"][0] < 1040, outcomes
    assert outcomes["0"] == (1500, "none"), outcomes                  # control: unbounded, every one goes
    assert len(os.listdir(ws)) == 1500                                 # and the host kept them all


def test_the_store_outlives_its_runner_and_leaves_nothing_once_freed(place: Place) -> None:
    ws = owned_dir(place.base / "outlive", place.owner)
    review_dir = place.base / "outlive-review"
    script = "echo kept > kept.txt && sleep 600"
    # No limits, so no cgroup: a SIGKILLed run's groups are swept by a daemon's fork server, and
    # the VM leg's guest has none.
    runner = subprocess.Popen([SANDBOXD, "run", "--no-default-limits", f"--review=keep:{review_dir}",
                               "--review-bytes=8M", "--workspace", str(ws), "--", "sh", "-c", script],
                              stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=BASE_ENV, cwd=str(ws))
    try:
        deadline = time.monotonic() + 120 * SLOW
        record = review_dir / overlay.LAYERS_FILE
        while not (record.exists() and (review_dir / "0" / "upper" / "kept.txt").exists()):
            assert runner.poll() is None, runner.communicate()
            assert time.monotonic() < deadline, "the run never wrote kept.txt"
            time.sleep(0.05)
        runner.send_signal(signal.SIGKILL)               # as a daemon killed mid-session
    finally:
        if runner.poll() is None:
            runner.kill()
        runner.communicate(timeout=60)
    # The store is still mounted in the host's namespace, its change set listed again.
    assert mounted(review_dir) and review_space.is_store(str(review_dir))
    assert review_space.reserved(str(review_dir)) == review_space.charge(8 * MiB)     # its bytes and its inodes
    (change_set,) = kept.list_changes(str(review_dir))
    assert [(change.path, change.kind) for change in change_set.changes] == [("kept.txt", "added")]
    # Sealed, its bound shrinks to what it holds: the rest goes back to the owner's share.
    assert review_space.seal(str(review_dir)) < MiB
    review_space.free(review_space.Store(path=str(review_dir), size=8 * MiB))
    assert not mounted(review_dir) and not review_dir.exists()
    with open("/proc/self/mountinfo") as info:
        assert str(review_dir) not in info.read()


OVERLAY_FILL = textwrap.dedent("""\
    import json, os, sys
    from sandboxd.kernel import caps, overlay
    store, ws, uid, gid, limit = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    root_fd = os.open(ws, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    layers = overlay.make_layers(store, 0, ws, root_fd, userxattr=False)
    overlay.save(store, [layers])
    upper = os.open(layers.upper, os.O_PATH | os.O_DIRECTORY)
    work = os.open(layers.work, os.O_PATH | os.O_DIRECTORY)
    overlay.mount_over(ws, lower_fd=root_fd, upper_fd=upper, work_fd=work, userxattr=False, shown=ws)
    caps.drop_privileges(uid, gid)                      # the sandbox's user writes
    os.chdir(ws)
    os.execv(sys.executable, [sys.executable, "-c", sys.argv[6], "big", limit])
""")


def fill_through_overlay(store: str, ws: Path, place: Place, limit: int) -> tuple[int, str]:
    """The owner writes into ``ws`` covered, in a private mount namespace, by an overlay whose
    layers are in ``store`` (as a session's sandbox would): what it wrote, and the refusal."""
    env = {**BASE_ENV, "PYTHONPATH": str(REPO)}
    result = subprocess.run(["unshare", "-m", "--propagation", "private", PY, "-c", OVERLAY_FILL, store, str(ws),
                             str(place.owner.uid), str(place.owner.gid), str(limit), FILL],
                            capture_output=True, text=True, timeout=120 * SLOW, env=env, cwd="/")
    words = result.stdout.split()
    assert result.returncode == 3 and len(words) == 2, describe(result)
    return int(words[0]), words[1]


def test_an_owners_second_session_is_bounded_by_what_the_first_leaves(place: Place) -> None:
    # Each store takes its bytes and its inodes' kernel memory (review_space.charge): room for 4 + 2 MiB.
    owner_bytes, session_bytes = review_space.charge(4 * MiB) + review_space.charge(2 * MiB), 4 * MiB
    stores: list[review_space.Store] = []
    try:
        first = review_space.make_store(str(place.base / "owner-1"), session_bytes=session_bytes,
                                        owner_bytes=owner_bytes, owner_total=0)
        stores.append(first)
        total = review_space.reserved(first.path)
        second = review_space.make_store(str(place.base / "owner-2"), session_bytes=session_bytes,
                                         owner_bytes=owner_bytes, owner_total=total)
        stores.append(second)
        assert (first.size, second.size) == (4 * MiB, 2 * MiB)
        ws = owned_dir(place.base / "owner-ws", place.owner)
        assert fill_through_overlay(second.path, ws, place, 16 * MiB) == (2 * MiB, "ENOSPC")
        assert not (ws / "big").exists()
        # The owner's share is used up: a third session is refused, in one line naming the key.
        total += review_space.reserved(second.path)
        with pytest.raises(Exhausted, match=r"^review: this owner's review stores hold 8 MiB of the 8 MiB "
                                            r"review.owner_bytes allows \(their bytes and their files' kernel "
                                            r"memory\): apply or discard kept change sets$"):
            review_space.make_store(str(place.base / "owner-3"), session_bytes=session_bytes,
                                    owner_bytes=owner_bytes, owner_total=total)
        assert not (place.base / "owner-3").exists()
        # Control: the first session, with the session's whole bound, takes 4 MiB.
        ws1 = owned_dir(place.base / "owner-ws1", place.owner)
        assert fill_through_overlay(first.path, ws1, place, 16 * MiB) == (4 * MiB, "ENOSPC")
    finally:
        for store in stores:
            review_space.free(store)
    for name in ("owner-1", "owner-2"):
        assert not mounted(place.base / name) and not (place.base / name).exists()


def test_the_bound_is_refused_where_it_cannot_be_made_and_configured_with_checks(place: Place) -> None:
    # A plain user's run: its review directory is its own; a bound for it is refused in one line.
    ws = owned_dir(place.base / "plain", place.owner)
    parent = owned_dir(place.base / "plain-reviews", place.owner)
    user = {"user": place.owner.uid, "group": place.owner.gid, "extra_groups": []}
    env = {**BASE_ENV, "HOME": str(ws), "PYTHONPATH": str(REPO)}
    result = subprocess.run([PY, "-m", "sandboxd.cli.main", "run", f"--review=keep:{parent}/review",
                             "--review-bytes=4M", "--", "true"], capture_output=True, text=True,
                            timeout=120 * SLOW, stdin=subprocess.DEVNULL, cwd=str(ws), env=env, **user)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 125 and len(lines) == 1 and "--review-bytes bounds root's" in lines[0], describe(result)
    # Root's: a bound without a review directory, or not a size, is refused in one line.
    for options, said in ((["--review-bytes=4M"], "--review-bytes bounds a review's change set"),
                          ([f"--review=keep:{place.base}/bad-size", "--review-bytes=lots"], "bad --review-bytes 'lots'"),
                          ([f"--review=keep:{place.base}/too-small", "--review-bytes=64K"], "at least 1 MiB")):
        result = subprocess.run([SANDBOXD, "run", *options, "--workspace", str(ws), "--", "true"], capture_output=True,
                                text=True, timeout=60 * SLOW, stdin=subprocess.DEVNULL, env=BASE_ENV)
        said_lines = [line for line in result.stderr.splitlines() if not line.startswith("usage:")]
        assert result.returncode == 125 and len(said_lines) == 1 and said in said_lines[0], describe(result)
    assert not mounted(place.base / "bad-size") and not mounted(place.base / "too-small")
    # A review directory swapped for a symlink once made is not followed: the mount goes nowhere.
    target = place.base / "swap-target"
    target.mkdir(mode=0o700)
    (place.base / "swapped").symlink_to(target)
    with pytest.raises(InvalidPolicy, match="cannot be bounded: .*not a symlink"):
        review_space.bound(str(place.base / "swapped"), 4 * MiB)
    assert not mounted(target) and not mounted(place.base / "swapped")
    review_space.bound(str(target), 4 * MiB)                          # control: the directory itself is bounded
    assert review_space.is_store(str(target)) and not review_space.is_store(str(place.base / "swapped"))
    review_space.release(str(target))
    assert not mounted(target)
    with pytest.raises(Exhausted):
        review_space.share(4 * MiB, 4 * MiB, 4 * MiB - review_space.charge(MiB) + 1)
    # Control: exactly the floor's charge left (its bytes and its 1040 inodes' memory), the floor is given.
    assert review_space.share(4 * MiB, 4 * MiB, 4 * MiB - review_space.charge(MiB)) == MiB
    settings = config.load("/dev/null", environ={})
    assert (settings.review_session_bytes, settings.review_owner_bytes) == (1 << 30, 4 << 30)
    assert config.load("/dev/null", environ={"SANDBOXD_REVIEW_SESSION_BYTES": "0"}).review_session_bytes == 0
    assert settings.review_owner_stores == 128
    assert config.load("/dev/null", environ={"SANDBOXD_REVIEW_OWNER_STORES": "0"}).review_owner_stores == 0
    with pytest.raises(ConfigError, match="review.owner_stores"):
        config.load("/dev/null", environ={"SANDBOXD_REVIEW_OWNER_STORES": "-1"})
    for key, value in (("SESSION", "512K"), ("OWNER", "0"), ("OWNER", "lots")):
        with pytest.raises(ConfigError, match=f"review.{key.lower()}_bytes: must be a size of at least 1M"):
            config.load("/dev/null", environ={f"SANDBOXD_REVIEW_{key}_BYTES": value})



TOUCH = textwrap.dedent("""\
    import errno, os, sys
    made, refused = 0, "none"
    try:
        os.mkdir("many")
        for index in range(int(sys.argv[1])):
            os.close(os.open(f"many/{index}", os.O_WRONLY | os.O_CREAT, 0o644))
            made += 1
    except OSError as exc:
        refused = errno.errorcode[exc.errno]
    print(made, refused)
""")


def touch_in(directory: Path, count: int) -> int:
    """Empty files made as root in ``directory`` until ``count`` or ENOSPC: how many."""
    directory.mkdir()
    made = 0
    try:
        for index in range(count):
            (directory / str(index)).touch()
            made += 1
    except OSError as exc:
        assert exc.errno == errno.ENOSPC, exc
    return made


def test_a_stores_inodes_count_against_the_owner_and_a_sealed_store_keeps_no_more(place: Place) -> None:
    """Empty files take no page but an inode each, about 1 KiB of unswappable kernel memory: a
    store's charge counts the inodes it may hold, and sealing a closed store shrinks its inodes to
    those it holds, so a kept change set of empty files is counted at what it holds in memory."""
    ws = owned_dir(place.base / "inodes", place.owner)
    review_dir = place.base / "inodes-review"
    result = subprocess.run([SANDBOXD, "run", f"--review=keep:{review_dir}", "--review-bytes=8M", "--workspace",
                             str(ws), "--", "python3", "-c", TOUCH, "1500"], capture_output=True, text=True,
                            timeout=120 * SLOW, stdin=subprocess.DEVNULL, env=BASE_ENV, cwd=str(ws))
    assert result.returncode == 0 and result.stdout.split() == ["1500", "none"], describe(result)
    path = str(review_dir)
    try:
        held = review_space.inodes_used(path)
        assert 1500 < held < 1600
        assert review_space.used(path) < 64 << 10                   # 1,500 files, hardly a page: bytes alone say ~0
        # Open, the store is charged its whole bound: 8 MiB and its 2,073 inodes' memory (2,048, one per
        # page, and the store's own).
        assert review_space.reserved(path) == review_space.charge(8 * MiB) == 8 * MiB + 2073 * 1024
        # Control: unsealed, the store takes more inodes (up to its bound of 2,064).
        assert touch_in(review_dir / "before-seal", 100) == 100
        shutil.rmtree(review_dir / "before-seal")
        sealed = review_space.seal(path)
        st = os.statvfs(path)
        assert st.f_files == held + review_space.RESERVE_INODES          # nr_inodes shrunk to what it holds
        assert sealed == review_space.reserved(path) >= held * review_space.INODE_CHARGE
        assert sealed - held * review_space.INODE_CHARGE < 128 << 10     # and its bytes to almost nothing
        # The wall: sealed, it holds no more inodes than it is charged for (its slack only).
        assert touch_in(review_dir / "after-seal", 100) == review_space.RESERVE_INODES - 1
        # What the owner has left is what that memory leaves: 16 such kept stores leave no 1 MiB share.
        owner_bytes = 16 * sealed + review_space.charge(MiB) - 1
        with pytest.raises(Exhausted, match="review.owner_bytes"):
            review_space.share(8 * MiB, owner_bytes, 16 * sealed)
        assert review_space.share(8 * MiB, owner_bytes + 1, 16 * sealed) == MiB      # control: one byte more
    finally:
        overlay.remove_layers(path)
    assert not mounted(review_dir)


def test_an_owners_total_reads_the_mount_table_once_whatever_the_stores(place: Place,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The second hostile pass's B2: the fork server sums an owner's stores on its loop; each used to
    read /proc/self/mountinfo again (O(stores x mounts)). Now one read answers for all of them, and
    what they take is the same as asked one by one."""
    from sandboxd.kernel import paths

    made = [str(place.base / f"table-{index}") for index in range(12)]
    for path in made:
        os.mkdir(path, 0o700)
        review_space.bound(path, MiB)
    try:
        candidates = [*made, str(place.base / "table-absent"), str(place.base)]      # no stores: counted 0
        one_by_one = sum(review_space.reserved(path) for path in candidates)
        reads: list[int] = []
        real = paths.mount_table

        def counted() -> dict[str, list[str]]:
            reads.append(1)
            return real()
        monkeypatch.setattr(paths, "mount_table", counted)
        assert review_space.owner_stores(candidates) == (12, one_by_one)
        assert len(reads) == 1
        assert one_by_one == 12 * review_space.charge(MiB)
        # Control: asked one by one, the table is read once per store.
        reads.clear()
        sum(review_space.reserved(path) for path in made)
        assert len(reads) == len(made)
    finally:
        for path in made:
            overlay.remove_layers(path)
    assert not any(mounted(Path(path)) for path in made)
