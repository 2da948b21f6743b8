"""What review mode's core costs (issue 25), as root, on bench_git_guard's 20,000-directory workspace:

* `sandboxd run -- true` against `sandboxd run --review -- true` (end to end, from outside;
  direct mode walks the tree for the git guard, review mode mounts an overlay instead and at the
  end finds the change set empty and removes it), in that workspace and in an empty one;
* listing 10 changed files (review.kept.list_changes: the upper layer scanned and compared with
  the host, hashes included);
* applying 1,000 changed files (1 KiB each, in 50 directories): scan, compare, write beside,
  rename, one syncfs; and the same apply of one of them.

Medians of ``--runs`` (default 15; direct and review runs alternate); one line per figure. Not a
test: nothing is asserted.

    .venv/bin/python tests/bench_review.py [--runs 15]
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_git_guard import count_dirs, make_big_workspace, median_us  # noqa: E402
from sandboxd.kernel import overlay  # noqa: E402
from sandboxd.review import apply as applying  # noqa: E402
from sandboxd.review import conflicts, kept, upper  # noqa: E402
from sandboxd.review.changes import Comparison  # noqa: E402
from review_helpers import release_stores  # noqa: E402

SANDBOXD = os.path.join(os.path.dirname(sys.executable), "sandboxd")


def median_ms(action: Callable[[], object], runs: int) -> float:
    return median_us(action, runs) / 1e3


def paired_ms(first: Callable[[], object], second: Callable[[], object], runs: int) -> tuple[float, float]:
    """Medians of ``first`` and ``second`` run alternately: a load that changes over the
    measurement (other engineers' tests, the CI VM) weighs on both alike."""
    samples: tuple[list[float], list[float]] = ([], [])
    for _ in range(runs):
        for action, into in ((first, samples[0]), (second, samples[1])):
            start = time.perf_counter()
            action()
            into.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples[0]), statistics.median(samples[1])


def run(workspace: str, *options: str, script: str = "true") -> None:
    done = subprocess.run([SANDBOXD, "run", *options, "--workspace", workspace, "--", "sh", "-c", script],
                          capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        raise SystemExit(f"sandboxd run failed: {done.stderr}")


def apply_all(review_dir: str, paths: tuple[str, ...] = ("",)) -> applying.ApplyResult:
    (layers,) = overlay.load(review_dir)
    upper_fd = os.open(layers.upper, os.O_RDONLY | os.O_DIRECTORY)
    host_fd = os.open(layers.root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        entries = upper.scan(upper_fd, prefix=layers.xattr_prefix)
        with Comparison(entries, upper_fd=upper_fd, host_fd=host_fd, layers=layers,
                        baseline=conflicts.Baseline(started_ns=layers.started_ns)) as compared:
            return applying.apply(compared, paths)
    finally:
        os.close(upper_fd)
        os.close(host_fd)


def main() -> None:
    runs = int(sys.argv[sys.argv.index("--runs") + 1]) if "--runs" in sys.argv else 15
    big = make_big_workspace()
    scratch = tempfile.mkdtemp(prefix="sbxbench-review-", dir="/var/tmp")
    try:
        print(f"workspace: {count_dirs(big)} directories; {runs} runs each; load {os.getloadavg()[0]:.1f}")
        direct, review = paired_ms(lambda: run(big), lambda: run(big, "--review"), runs)
        print(f"sandboxd run -- true, 20,000 directories: direct {direct:.0f} ms, --review {review:.0f} ms "
              f"({review / direct:.2f}x)")
        empty = tempfile.mkdtemp(prefix="sbxbench-empty-", dir="/var/tmp")
        try:
            direct, review = paired_ms(lambda: run(empty), lambda: run(empty, "--review"), runs)
        finally:
            shutil.rmtree(empty, ignore_errors=True)
        print(f"sandboxd run -- true, empty workspace: direct {direct:.0f} ms, --review {review:.0f} ms "
              f"({review / direct:.2f}x)")

        ten = " ".join(f"node_modules/pkg{i * 100}/lib/util/changed.js" for i in range(10))
        listed_dir = f"{scratch}/ten"
        run(big, f"--review=keep:{listed_dir}", script=f"for f in {ten}; do echo change > $f; done")
        (page,) = kept.list_changes(listed_dir)
        assert len(page.changes) == 10, page
        print(f"list 10 changed files: {median_ms(lambda: kept.list_changes(listed_dir), runs):.1f} ms")

        files = tempfile.mkdtemp(prefix="sbxbench-apply-", dir="/var/tmp")
        try:
            for d in range(50):
                os.makedirs(f"{files}/d{d}")
                for f in range(20):
                    with open(f"{files}/d{d}/f{f}", "wb") as out:
                        out.write(b"o" * 1024)
            times, one = [], []
            for round_ in range(max(3, runs // 3)):
                review_dir = f"{scratch}/apply-{round_}"
                run(files, f"--review=keep:{review_dir}",
                    script="for f in d*/f*; do head -c 1024 /dev/urandom > $f; done")
                start = time.perf_counter()
                result = apply_all(review_dir, ("d7/f3",))
                one.append((time.perf_counter() - start) * 1e3)
                start = time.perf_counter()
                result = apply_all(review_dir)
                times.append((time.perf_counter() - start) * 1e3)
                assert len(result.applied) == 999 and not result.skipped, (len(result.applied), result.skipped[:3])
            print(f"apply 1,000 changed files: {statistics.median(times):.0f} ms; one of them: "
                  f"{statistics.median(one):.1f} ms ({len(times)} rounds)")
        finally:
            shutil.rmtree(files, ignore_errors=True)
    finally:
        release_stores(scratch)                         # root's review directories are tmpfs (review_space)
        subprocess.run(["chmod", "-R", "u+rwx", scratch], capture_output=True)
        shutil.rmtree(scratch, ignore_errors=True)
        shutil.rmtree(big, ignore_errors=True)


if __name__ == "__main__":
    main()
