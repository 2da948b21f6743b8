"""`sandboxd run -- true`, before and after, against bwrap and bare exec (issue 18, item 7).

Run it as root from the repository root with the project's venv::

    .venv/bin/python tests/bench_oneshot.py                    # 40 rounds, baseline `main`
    .venv/bin/python tests/bench_oneshot.py --runs 60 --baseline ef4d94e --json out.json
    .venv/bin/python tests/bench_oneshot.py --phases 30        # only the in-process phase timeline

Not a pytest test (no ``test_`` in its name). What it measures, each the wall time until the
command has exited and been reaped, in milliseconds, interleaved round-robin in a shuffled order
per round (benchmark.run_rounds) so that a shared machine's noise hits every variant alike:

* ``bare exec`` and ``bwrap one-shot`` (benchmark.BWRAP_ARGV) as root; the same two through
  ``setpriv`` as a plain user made for the run (plain_users), whose ratios take those;
* ``python -c pass`` of the interpreter the CLI runs on (interpreter start alone);
* ``sandboxd run -- true`` (workspace-write, the default) of two trees, ``before`` (the
  ``--baseline`` revision, from ``git archive``) and ``after`` (this working tree's
  ``sandboxd/``), each extracted under /var/tmp with its bytecode compiled and started as
  ``PYTHON TREE/sandboxd-cli run ...`` (packaging/bin/sandboxd's text: the tree is the script's
  directory, first on sys.path, so nothing else is needed), with an empty workspace and with this
  checkout (its .venv included) as the workspace; as root on the venv's interpreter (the installed
  CLI's) and as the plain user on /usr/bin/python3 (the venv's is under /root, out of its reach),
  rootless; and the after tree's empty-workspace run as root with ``--host-home`` (no private
  home, homes not hidden: what issue 17's environment and hidden homes cost).

``--phases N`` then runs the after tree's CLI steps in N fresh processes, timing each step with
perf_counter, in the CLI's order: interpreter start (spawn to the first line), the import of
cli.run, the spec (run_env, limits), the git guard's baseline walk, the start of the cgroup
warm-up (kernel.cgroup_warmup), the spawner's import, what is left of the warm-up's wait, Spawner.launch (paths, mount trees,
seccomp, cgroups, fork), the child's setup until the command's exec (wait_started), the command
and the teardown (wait: reap, cgroup removal) and the guard's inspection, and the interpreter's
exit (the last step to the reaped exit).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmark import (BWRAP, BWRAP_ARGV, ROOT, SHUFFLE_SEED, WARMUP_ROUNDS, Variant, build_rows, fmt,
                       machine_info, print_table, run_rounds, spawn_and_wait, summarize)
from plain_users import plain_user

SYSTEM_PYTHON = "/usr/bin/python3"
ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}
CLI_SCRIPT = (ROOT / "packaging" / "bin" / "sandboxd").read_text().split("\n", 1)[1]

# The CLI's steps, timed in a fresh process (--phases); sys.argv[1] is the workspace.
PHASES_DRIVER = """\
import time
marks = [("start", time.perf_counter())]
import sys
from sandboxd.cli import run
marks.append(("import cli.run", time.perf_counter()))
spec = run.spec_from_args(run.parse_args(["--workspace", sys.argv[1], "--", "true"]))
marks.append(("spec (run_env, limits)", time.perf_counter()))
guard = run._git_guard(spec) if hasattr(run, "_git_guard") else None   # since issue 16
marks.append(("git guard baseline walk", time.perf_counter()))
try:                                          # since issue 18: the cgroup move's wait, paid early
    from sandboxd.kernel import cgroup_warmup
    # since issue 24: only when the child's join will wait (a v2 group with a limit)
    warmup = cgroup_warmup.start() if getattr(run, "_waits_to_join", lambda spec: True)(spec) else None
except ImportError:
    warmup = None
marks.append(("start cgroup warm-up", time.perf_counter()))
from sandboxd.supervisor.spawner import Spawner
marks.append(("import spawner", time.perf_counter()))
if warmup is not None:
    warmup.wait()
marks.append(("wait for the warm-up", time.perf_counter()))
sandbox = Spawner().launch(spec)
marks.append(("Spawner.launch", time.perf_counter()))
sandbox.wait_started()
marks.append(("child setup until exec", time.perf_counter()))
info = sandbox.wait(None)
marks.append(("command + reap + cgroups", time.perf_counter()))
if guard is not None:
    list(guard.inspect())
marks.append(("git guard inspect", time.perf_counter()))
assert info.shell_status == 0, info
sys.stdout.write(repr(marks))
from sandboxd.cli import main                 # its way out (since issue 18: _leave, no teardown)
if hasattr(main, "_leave"):
    main._leave(0)
"""


def extract_trees(base: Path, baseline: str) -> dict[str, Path]:
    """``before``: the baseline revision's sandboxd/ (git archive); ``after``: this tree's. Each
    with the CLI script at its top and its bytecode compiled, all readable by everyone."""
    trees = {"before": base / "before", "after": base / "after"}
    for tree in trees.values():
        tree.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", baseline, "sandboxd"],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(trees["before"])], input=archive, check=True)
    shutil.copytree(ROOT / "sandboxd", trees["after"] / "sandboxd",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for tree in trees.values():
        (tree / "sandboxd-cli").write_text(CLI_SCRIPT)
        subprocess.run([sys.executable, "-m", "compileall", "-q", str(tree / "sandboxd")], check=True)
    subprocess.run(["chmod", "-R", "a+rX", str(base)], check=True)
    return trees


def as_user(uid: int, gid: int, argv: list[str]) -> list[str]:
    return ["/usr/bin/setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", *argv]


def build_variants(trees: dict[str, Path], workspaces: dict[str, str], user_ws: str, uid: int, gid: int,
                   devnull: int, python_runs: int) -> list[Variant]:
    venv_python = sys.executable
    variants = [
        Variant("bare exec /bin/true", lambda: spawn_and_wait(["/bin/true"], devnull)),
        Variant("bwrap one-shot", lambda: spawn_and_wait(BWRAP_ARGV, devnull)),
        Variant("python -c pass", lambda: spawn_and_wait([venv_python, "-c", "pass"], devnull),
                max_samples=python_runs),
        Variant("user: bare exec /bin/true", lambda: spawn_and_wait(as_user(uid, gid, ["/bin/true"]), devnull)),
        Variant("user: bwrap one-shot", lambda: spawn_and_wait(as_user(uid, gid, BWRAP_ARGV), devnull)),
        Variant("user: python -c pass",
                lambda: spawn_and_wait(as_user(uid, gid, [SYSTEM_PYTHON, "-c", "pass"]), devnull),
                max_samples=python_runs),
    ]
    for label, tree in trees.items():
        cli = str(tree / "sandboxd-cli")
        for ws_label, ws in workspaces.items():
            argv = [venv_python, cli, "run", "--workspace", ws, "--", "true"]
            variants.append(Variant(f"run {ws_label} {label}", lambda a=argv: spawn_and_wait(a, devnull)))
            user_argv = as_user(uid, gid, [SYSTEM_PYTHON, cli, "run", "--workspace",
                                           user_ws if ws_label == "empty" else ws, "--", "true"])
            variants.append(Variant(f"user: run {ws_label} {label}",
                                    lambda a=user_argv: spawn_and_wait(a, devnull)))
    # What issue 17's private environment and hidden homes cost: the same run with --host-home.
    argv = [venv_python, str(trees["after"] / "sandboxd-cli"), "run", "--host-home", "--workspace",
            workspaces["empty"], "--", "true"]
    variants.append(Variant("run empty after --host-home", lambda: spawn_and_wait(argv, devnull)))
    return variants


def print_ratios(variants: list[Variant]) -> dict[str, Any]:
    """Each run's median against bwrap and bare exec of the same user, and after/before."""
    medians = {v.name: (summarize(v.samples_ms) or {}).get("median_ms") for v in variants}
    out: dict[str, Any] = {}
    print(f"\n{'variant':<32} | {'median':>7} | {'x bwrap':>7} | {'x bare':>7} | {'x before':>8}")
    for v in variants:
        if "run " not in v.name:
            continue
        prefix = "user: " if v.name.startswith("user: ") else ""
        median = medians[v.name]
        bwrap, bare = medians[f"{prefix}bwrap one-shot"], medians[f"{prefix}bare exec /bin/true"]
        before = medians.get(v.name.replace(" after", " before")) if " after" in v.name else None
        row = {"median_ms": median, "x_bwrap": median / bwrap if median and bwrap else None,
               "x_bare": median / bare if median and bare else None,
               "x_before": median / before if median and before else None}
        out[v.name] = row
        print(f"{v.name:<32} | {fmt(median, '7.2f')} | {fmt(row['x_bwrap'], '7.2f')} | "
              f"{fmt(row['x_bare'], '7.2f')} | {fmt(row['x_before'], '8.2f')}")
    return out


def phases(tree: Path, workspace: str) -> dict[str, list[float]]:
    """One run of the CLI's steps in a fresh process (see PHASES_DRIVER): each step's ms."""
    spawned = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", PHASES_DRIVER, workspace], cwd=str(tree),
                          capture_output=True, text=True, env={**ENV, "PYTHONPATH": str(tree)}, check=True)
    ended = time.perf_counter()
    marks: list[tuple[str, float]] = [("spawn", spawned), *ast.literal_eval(done.stdout), ("exit", ended)]
    steps: dict[str, float] = {}
    for (_, previous), (name, at) in zip(marks, marks[1:], strict=False):
        name = {"start": "interpreter start", "exit": "interpreter exit + reap"}.get(name, name)
        steps[name] = (at - previous) * 1e3
    steps["total"] = (ended - spawned) * 1e3
    return steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=40, help="measured rounds (default 40)")
    parser.add_argument("--python-runs", type=int, default=20, help="rounds with python -c pass (default 20)")
    parser.add_argument("--baseline", default="main", help="the revision measured as 'before' (default main)")
    parser.add_argument("--phases", type=int, default=0, metavar="N",
                        help="only the phase timeline of the after tree, N runs per workspace")
    parser.add_argument("--json", help="also write every number to this file")
    args = parser.parse_args(argv)
    if os.geteuid() != 0 or not os.path.exists(BWRAP):
        sys.stderr.write("bench_oneshot: needs root and /usr/bin/bwrap\n")
        return 2
    os.environ.clear()
    os.environ.update(ENV)
    report: dict[str, Any] = {"machine": machine_info(), "baseline": args.baseline,
                              "uptime_start": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()}
    print(f"{report['machine']}\nuptime: {report['uptime_start']}")
    base = Path(tempfile.mkdtemp(prefix="sbx-oneshot-", dir="/var/tmp"))
    try:
        trees = extract_trees(base, args.baseline)
        empty = base / "empty"
        empty.mkdir()
        workspaces = {"empty": str(empty), "checkout": str(ROOT)}
        if args.phases:
            timelines: dict[str, dict[str, float]] = {}
            for _ in range(args.phases):               # the trees and workspaces interleaved, one run each
                for tree_label, tree in trees.items():
                    for label, ws in workspaces.items():
                        one = phases(tree, ws)
                        for name, value in one.items():
                            timelines.setdefault(f"{tree_label} {label}", {}).setdefault(name, []).append(value)
            columns = list(timelines)
            print(f"\nphases, median of {args.phases} runs, ms (empty: {workspaces['empty']}; "
                  f"checkout: {workspaces['checkout']}):")
            print(f"  {'step':<28}" + "".join(f" {column:>16}" for column in columns))
            names = list(timelines[columns[-1]])
            for name in names:
                cells = [statistics.median(timelines[c][name]) if name in timelines[c] else None for c in columns]
                print(f"  {name:<28}" + "".join(f" {fmt(cell, '16.2f')}" for cell in cells))
            report["phases"] = {c: {n: statistics.median(v) for n, v in t.items()} for c, t in timelines.items()}
        else:
            with plain_user() as (uid, gid), open(os.devnull, "wb") as null:
                user_ws = base / "user-empty"
                user_ws.mkdir()
                os.chown(user_ws, uid, gid)
                variants = build_variants(trees, workspaces, str(user_ws), uid, gid, null.fileno(),
                                          args.python_runs)
                run_rounds(variants, args.runs, WARMUP_ROUNDS, random.Random(SHUFFLE_SEED))
            rows = build_rows(variants)
            print()
            print_table(rows)
            report["rows"] = rows
            report["ratios"] = print_ratios(variants)
            failures = [row for row in rows if row["failures"]]
            for row in failures:
                print(f"{row['name']}: {row['failures']} failed; first: {row['first_error']}")
    finally:
        shutil.rmtree(base, ignore_errors=True)
    report["uptime_end"] = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"uptime: {report['uptime_end']}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
