"""Cost of the git guard (sandboxd/supervisor/git_guard.py), in process, on an empty repository and
on a 10,000-file tree (521 directories, one repository at its root):

* baseline: taking the tree as it is (at session creation, or before `sandboxd run`'s command);
* unchanged: an inspection after a call that changed nothing (what every warm Exec pays);
* commit-like: after index.lock is made and renamed over index;
* new repository: a nested .git made and removed (two inspections).

With inotify (the default) and without (the fallback when fs.inotify.max_user_instances or
max_user_watches is exhausted). Medians; prints one line per case.

    .venv/bin/python tests/bench_git_guard.py
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

from sandboxd.supervisor.git_guard import GitGuard  # noqa: E402


def make_tree(files: int) -> str:
    path = tempfile.mkdtemp(prefix="sbxbench-gg-", dir="/var/tmp")
    subprocess.run(["git", "init", "-q", path], check=True)
    for i in range(files):
        d = f"{path}/d{i // 500}/e{i // 20}"
        os.makedirs(d, exist_ok=True)
        open(f"{d}/f{i}", "w").close()
    return path


def median_us(fn: Callable[[], object], runs: int) -> float:
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e6)
    return statistics.median(samples)


def main() -> None:
    for watch in (True, False):
        for files in (0, 10_000):
            path = make_tree(files)
            try:
                start = time.perf_counter()
                guard = GitGuard([path], watch=watch)
                baseline_ms = (time.perf_counter() - start) * 1e3
                unchanged = median_us(guard.inspect, 200)

                def commit() -> None:
                    open(f"{path}/.git/index.lock", "w").close()
                    os.rename(f"{path}/.git/index.lock", f"{path}/.git/index")
                    guard.inspect()

                def new_repo() -> None:
                    os.makedirs(f"{path}/n/.git")
                    open(f"{path}/n/.git/HEAD", "w").close()
                    guard.inspect()
                    shutil.rmtree(f"{path}/n")
                    guard.inspect()

                committed = median_us(commit, 100)
                made = median_us(new_repo, 50)
                guard.close()
                print(f"inotify={watch!s:5} files={files:5}: baseline {baseline_ms:.1f} ms, unchanged {unchanged:.0f} us, "
                      f"commit-like {committed:.0f} us, new repository (2 inspections) {made:.0f} us")
            finally:
                shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    main()
