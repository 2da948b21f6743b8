"""The second hostile pass's B1 and B2, measured (issue 25), as root in a private mount namespace
of the bench's own (re-executed under ``unshare -m``: its stores vanish with it):

* B2: what summing one owner's stores costs the fork server's loop, for N stores of 1 MiB: each
  store's mount found by reading /proc/self/mountinfo again (``reserved(path)`` one by one, as
  r5-fix's fork server did) against one read for all (``review_space.owner_stores``);
* B1: a 1 GiB store holding 100,000 empty files: its kernel memory (Slab growth), what the
  bytes-only accounting charged once sealed (r5-fix), and what the store is charged now.

Medians of ``--runs`` (default 3). Not a test: nothing is asserted.

    .venv/bin/python tests/bench_review_stores.py [--stores 500,1000,2000] [--runs 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from sandboxd.kernel import review_space  # noqa: E402

MIB = 1 << 20


def slab_kib() -> int:
    with open("/proc/meminfo") as info:
        return next(int(line.split()[1]) for line in info if line.startswith("Slab:"))


def owner_total(counts: list[int], runs: int) -> None:
    for count in counts:
        with tempfile.TemporaryDirectory(prefix="sbxbench-", dir="/var/tmp") as base:
            stores = [f"{base}/{index}" for index in range(count)]
            for path in stores:
                os.mkdir(path, 0o700)
                review_space.bound(path, MIB)
            each, once = [], []
            for _ in range(runs):
                start = time.perf_counter()
                sum(review_space.reserved(path) for path in stores)
                each.append(time.perf_counter() - start)
                start = time.perf_counter()
                review_space.owner_stores(stores)
                once.append(time.perf_counter() - start)
            print(f"B2 {count} stores: one mountinfo read per store {statistics.median(each):.3f} s, "
                  f"one read for all {statistics.median(once) * 1000:.1f} ms")
            for path in stores:
                review_space.release(path)


def empty_files(count: int) -> None:
    with tempfile.TemporaryDirectory(prefix="sbxbench-", dir="/var/tmp") as base:
        path = f"{base}/store"
        os.mkdir(path, 0o700)
        review_space.bound(path, 1 << 30)
        before = slab_kib()
        os.mkdir(f"{path}/many")
        for index in range(count):
            os.close(os.open(f"{path}/many/{index}", os.O_WRONLY | os.O_CREAT, 0o600))
        grown = slab_kib() - before
        open_charge = review_space.reserved(path)
        sealed = review_space.seal(path, MIB)
        st = os.statvfs(path)
        bytes_only = st.f_blocks * st.f_frsize - len(review_space.RESERVES) * review_space.RESERVE_BYTES
        print(f"B1 {count} empty files in a 1 GiB store: Slab +{grown >> 10} MiB; charged open "
              f"{open_charge >> 20} MiB (bytes alone: 1024 MiB); sealed: nr_inodes {st.f_files}, charged "
              f"{sealed >> 20} MiB (bytes alone, r5-fix's accounting: {bytes_only >> 10} KiB)")
        review_space.release(path)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stores", default="500,1000,2000")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--files", type=int, default=100_000)
    args = parser.parse_args()
    if os.environ.get("SBX_BENCH_NAMESPACE") != "1":
        env = {**os.environ, "SBX_BENCH_NAMESPACE": "1"}
        sys.exit(subprocess.run(["unshare", "-m", "--propagation", "private", sys.executable, *sys.argv],
                                env=env).returncode)
    owner_total([int(item) for item in args.stores.split(",")], args.runs)
    empty_files(args.files)


if __name__ == "__main__":
    main()
