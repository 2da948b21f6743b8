"""Cost of the git guard (sandboxd/gitguard/guard.py), in process, on an empty repository and
on a 10,000-file tree (521 directories, one repository at its root):

* baseline: taking the tree as it is (at session creation, or before `sandboxd run`'s command);
* unchanged: an inspection after a call that changed nothing (what every warm Exec pays);
* commit-like: after index.lock is made and renamed over index;
* new repository: a nested .git made and removed (two inspections).

With inotify (the default) and without (the fallback when fs.inotify.max_user_instances or
max_user_watches is exhausted). Medians; prints one line per case.

    .venv/bin/python tests/bench_git_guard.py

``--workspace`` measures issue 18's big workspace instead: a generated tree of 20,000 directories
(a node_modules-like tree, a git checkout with 256 loose-object directories and three nested
repositories) against an empty one. In process: the guard's baseline walk (with and without
inotify) and the build's walk (launcher.rootfs._find_git_dirs). End to end, as root: `sandboxd
run -- true` in each workspace and a daemon's CreateSession + CloseSession on each; with
``--before DIR`` (a checkout of the code to compare, e.g. `git archive main | tar -x -C DIR`),
both codes in the same run, interleaved round by round. Medians of ``--runs`` (default 20).

    .venv/bin/python tests/bench_git_guard.py --workspace --before /tmp/before [--runs 20]
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from sandboxd.gitguard.guard import GitGuard  # noqa: E402


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


def make_big_workspace(dirs: int = 20_000) -> str:
    """A git checkout with three nested repositories and 256 loose-object directories, and a
    node_modules-like tree of packages (lib/, dist/, test/, a nested node_modules/) up to ``dirs``
    directories in all."""
    path = tempfile.mkdtemp(prefix="sbxbench-ws-", dir="/var/tmp")
    subprocess.run(["git", "init", "-q", path], check=True)
    for i in range(3):
        os.makedirs(f"{path}/vendor/lib{i}")
        subprocess.run(["git", "init", "-q", f"{path}/vendor/lib{i}"], check=True)
    for i in range(256):
        os.makedirs(f"{path}/.git/objects/{i:02x}", exist_ok=True)
    count = count_dirs(path)
    package = 0
    while count < dirs:
        base = f"{path}/node_modules/pkg{package}"
        for sub in ("lib/util", "dist/esm", "test", "node_modules/dep/lib"):
            os.makedirs(f"{base}/{sub}", exist_ok=True)
        with open(f"{base}/package.json", "w") as f:
            f.write("{}")
        count += 9 if package else 10
        package += 1
    return path


def count_dirs(path: str) -> int:
    return 1 + sum(len(subdirs) for _, subdirs, _ in os.walk(path))


def in_process(workspaces: dict[str, str], runs: int) -> None:
    from sandboxd.launcher.rootfs import _find_git_dirs
    for name, path in workspaces.items():
        inotify = median_us(lambda path=path: GitGuard([path]).close(), runs) / 1e3  # type: ignore[misc]
        plain = median_us(lambda path=path: GitGuard([path], watch=False).close(), runs) / 1e3  # type: ignore[misc]
        build = median_us(lambda path=path: _find_git_dirs(path), runs) / 1e3  # type: ignore[misc]
        guard = GitGuard([path], watch=False)
        full = median_us(guard.inspect, runs) / 1e3
        guard.close()
        print(f"in process, {name} ({count_dirs(path)} directories): guard baseline {inotify:.1f} ms with inotify, "
              f"{plain:.1f} ms without; an inspection walking everything {full:.1f} ms; build walk {build:.1f} ms")


def sandboxd_argv(code: str) -> list[str]:
    return [sys.executable, "-c", f"import sys; sys.path.insert(0, {code!r}); "
                                  "from sandboxd.cli.main import entry; entry()"]


def end_to_end(workspaces: dict[str, str], codes: dict[str, str], runs: int) -> None:
    """`sandboxd run -- true` and CreateSession + CloseSession, per code and workspace, interleaved."""
    from sandboxd.client import SandboxClient
    base = tempfile.mkdtemp(prefix="sbxbench-daemons-", dir="/var/tmp")
    daemons: dict[str, subprocess.Popen[bytes]] = {}
    clients: dict[str, Any] = {}
    try:
        for code_name, code in codes.items():
            sock = f"{base}/{code_name}/run/sandboxd.sock"
            os.makedirs(os.path.dirname(sock))
            daemons[code_name] = subprocess.Popen([*sandboxd_argv(code), "serve", "--socket", sock,
                                                   "--state-dir", f"{base}/{code_name}/state"],
                                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for _ in range(600):
                if os.path.exists(sock):
                    break
                time.sleep(0.1)
            clients[code_name] = SandboxClient(sock)
            clients[code_name].close_session(clients[code_name].create_session(workspaces["empty"],
                                                                                approval="never").id)
        samples: dict[tuple[str, str, str], list[float]] = {}
        for _ in range(runs):
            for ws_name, path in workspaces.items():
                for code_name, code in codes.items():
                    start = time.perf_counter()
                    subprocess.run([*sandboxd_argv(code), "run", "--", "true"], cwd=path, check=True)
                    samples.setdefault(("run", ws_name, code_name), []).append(time.perf_counter() - start)
                    client = clients[code_name]
                    start = time.perf_counter()
                    session = client.create_session(path, approval="never")
                    samples.setdefault(("create", ws_name, code_name), []).append(time.perf_counter() - start)
                    client.close_session(session.id)
        for what, label in (("run", "sandboxd run -- true"), ("create", "CreateSession")):
            for code_name in codes:
                empty = statistics.median(samples[(what, "empty", code_name)]) * 1e3
                big = statistics.median(samples[(what, "big", code_name)]) * 1e3
                print(f"{label:22} {code_name:6}: empty {empty:7.1f} ms, 20,000 directories {big:7.1f} ms, "
                      f"added {big - empty:7.1f} ms (medians of {runs})")
    finally:
        for proc in daemons.values():
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(base, ignore_errors=True)


def workspace_main(args: list[str]) -> None:
    runs = int(args[args.index("--runs") + 1]) if "--runs" in args else 20
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    codes = {"after": os.path.realpath(here)}
    if "--before" in args:
        codes = {"before": os.path.realpath(args[args.index("--before") + 1]), **codes}
    workspaces = {"empty": tempfile.mkdtemp(prefix="sbxbench-empty-", dir="/var/tmp"), "big": make_big_workspace()}
    try:
        print(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
        in_process(workspaces, max(3, runs // 4))
        end_to_end(workspaces, codes, runs)
        print(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    finally:
        for path in workspaces.values():
            shutil.rmtree(path, ignore_errors=True)


def main() -> None:
    if "--workspace" in sys.argv:
        workspace_main(sys.argv[1:])
        return
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
