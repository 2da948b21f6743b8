"""Launch-latency benchmark for sandboxd.

Run it from the repository root with the project's venv::

    .venv/bin/python tests/benchmark.py                 # 200 rounds (about 2-3 minutes)
    .venv/bin/python tests/benchmark.py --runs 60       # quicker, noisier
    .venv/bin/python tests/benchmark.py --json out.json # also write every number as JSON

It needs root (the sandboxes unshare namespaces and mount) and bwrap at
/usr/bin/bwrap. It is not a pytest test: the file name does not match
``test_*.py`` and it defines no ``test_`` functions.

What it measures, each as the wall time until ``/bin/true`` (or ``true``) has
exited and been reaped, in milliseconds:

* ``bare exec``: ``os.posix_spawn`` of ``/bin/true`` + ``waitpid``; the floor.
* ``bwrap one-shot``: ``bwrap --ro-bind / / --dev /dev --proc /proc
  --unshare-all --die-with-parent true``; the reference every ratio is taken to.
* ``cli <policy>``: ``sandboxd run --sandbox <policy> --workspace WS -- true``
  end to end, interpreter start and imports included (the CI-runner path).
* ``forkserver <policy>``: ``ForkServer.launch`` + ``ForkServer.wait`` with the
  fork server already running and warmed up (the daemon's path).
* ``spawner <policy>``: ``Spawner.launch`` + ``wait_started`` + ``wait`` in this
  process (what ``sandboxd run`` does once its imports are done).

for the policies read-only, workspace-write, workspace-write + network and
danger-full-access. The variants are interleaved round-robin, in a shuffled
order per round (fixed seed), after a few warm-up rounds, so that the noise of a
shared machine hits all of them alike. ``python -c pass`` (interpreter start
alone) is measured in the first ``--python-runs`` rounds, interleaved the same
way. Once, after the warm-up, ``python -X importtime`` reports the import cost
of ``sandboxd.cli.run`` and ``sandboxd.supervisor.spawner`` (sum of the
cumulative column of the top-level imports, interpreter start-up imports such
as ``site`` included).

The script prints the machine and date, a table (median, p95, ratio to the
bwrap median and to the bare-exec median), and two target checks: fork server
warm launch (workspace-write) <= 2x bwrap, and ``sandboxd run -- true``
(workspace-write) < 5x bwrap. A launch that fails is counted, its first error
is printed, and it is left out of the statistics. Everything it starts is
waited for; the fork server is closed and the workspace removed on exit.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from sandboxd.policy import DangerFullAccess, LaunchSpec, ReadOnly, SandboxPolicy, WorkspaceWrite
from sandboxd.supervisor.forkserver import ForkServer
from sandboxd.supervisor.spawner import Spawner

ROOT = Path(__file__).resolve().parents[1]
BWRAP = "/usr/bin/bwrap"
BWRAP_ARGV = [BWRAP, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc",
              "--unshare-all", "--die-with-parent", "true"]
SANDBOX_ENV = {"PATH": "/usr/bin:/bin"}
IMPORT_MODULES = "import sandboxd.cli.run, sandboxd.supervisor.spawner"
WARMUP_ROUNDS = 3
SHUFFLE_SEED = 20240601

# (label, CLI arguments, policy object) for every measured policy.
POLICIES: list[tuple[str, list[str], Callable[[], SandboxPolicy]]] = [
    ("read-only", ["--sandbox", "read-only"], ReadOnly),
    ("workspace-write", ["--sandbox", "workspace-write"], WorkspaceWrite),
    ("workspace-write+net", ["--sandbox", "workspace-write", "--network"],
     lambda: WorkspaceWrite(network_access=True)),
    ("danger-full-access", ["--sandbox", "danger-full-access"], DangerFullAccess),
]


@dataclass
class Variant:
    """One measured thing: a callable that performs one launch and raises on failure."""

    name: str
    run: Callable[[], None]
    max_samples: int | None = None          # None: every round
    samples_ms: list[float] = field(default_factory=list)
    failures: int = 0
    first_error: str | None = None

    def wanted(self) -> bool:
        return self.max_samples is None or len(self.samples_ms) < self.max_samples

    def measure(self, record: bool) -> None:
        start = time.perf_counter_ns()
        try:
            self.run()
        except Exception as exc:  # noqa: BLE001 - a failed launch is reported, not fatal
            self.failures += 1
            if self.first_error is None:
                self.first_error = f"{type(exc).__name__}: {exc}"
            return
        elapsed_ms = (time.perf_counter_ns() - start) / 1e6
        if record:
            self.samples_ms.append(elapsed_ms)


# --------------------------------------------------------------------------- processes

def venv_bin() -> Path:
    """The venv's bin directory (the repository's .venv, else the running interpreter's)."""
    candidate = ROOT / ".venv" / "bin"
    return candidate if (candidate / "python").exists() else Path(sys.executable).parent


def spawn_and_wait(argv: list[str], devnull: int) -> None:
    """posix_spawn argv with stdio on /dev/null, wait for it; raise if it did not exit 0.

    Only inheritable descriptors pass to the child, and Python opens everything
    close-on-exec, so this is the close_fds behaviour without subprocess' cost.
    """
    actions = [(os.POSIX_SPAWN_DUP2, devnull, 0), (os.POSIX_SPAWN_DUP2, devnull, 1),
               (os.POSIX_SPAWN_DUP2, devnull, 2)]
    pid = os.posix_spawn(argv[0], argv, os.environ, file_actions=actions)
    try:
        _, status = os.waitpid(pid, 0)
    except BaseException:
        _kill_and_reap(pid)
        raise
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise RuntimeError(f"{' '.join(argv)} exited with {code}: {explain_failure(argv)}")


def _kill_and_reap(pid: int) -> None:
    try:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass


def leftover_children() -> list[int]:
    """Pids of our own children still present (should be none once everything is closed)."""
    me, found = str(os.getpid()), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[1] == me:
            found.append(int(entry))
    return found


def explain_failure(argv: list[str]) -> str:
    """Run a failed command again, untimed, to capture what it said on stderr."""
    try:
        done = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, close_fds=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"(rerun failed: {exc})"
    text = done.stderr.decode(errors="replace").strip()
    return text.splitlines()[-1] if text else f"(no stderr; rerun exited {done.returncode})"


def forkserver_launch(fs: ForkServer, spec: LaunchSpec, devnull: int) -> None:
    call_id = fs.launch(spec, stdio=(devnull, devnull, devnull))
    info = fs.wait(call_id)
    if info.shell_status != 0:
        raise RuntimeError(f"fork server launch ended with {info}")


def spawner_launch(spawner: Spawner, spec: LaunchSpec, devnull: int) -> None:
    proc = spawner.launch(spec, stdio=(devnull, devnull, devnull))
    try:
        proc.wait_started()
        info = proc.wait()
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    if info.shell_status != 0:
        raise RuntimeError(f"spawner launch ended with {info}")


# --------------------------------------------------------------------------- variants

def build_variants(ws: str, devnull: int, fs: ForkServer, spawner: Spawner,
                   python_runs: int) -> tuple[list[Variant], Variant]:
    """The measured variants, and separately ``python -c pass`` (fewer samples)."""
    bin_dir = venv_bin()
    cli = str(bin_dir / "sandboxd")
    variants = [
        Variant("bare exec /bin/true", lambda: spawn_and_wait(["/bin/true"], devnull)),
        Variant("bwrap one-shot", lambda: spawn_and_wait(BWRAP_ARGV, devnull)),
    ]
    for label, cli_args, _ in POLICIES:
        argv = [cli, "run", *cli_args, "--workspace", ws, "--", "true"]
        variants.append(Variant(f"cli {label}", lambda a=argv: spawn_and_wait(a, devnull)))
    for prefix, launcher in (("forkserver", lambda s: forkserver_launch(fs, s, devnull)),
                             ("spawner", lambda s: spawner_launch(spawner, s, devnull))):
        for label, _, make_policy in POLICIES:
            spec = LaunchSpec(argv=("/bin/true",), workspace=ws, env=dict(SANDBOX_ENV), policy=make_policy())
            variants.append(Variant(f"{prefix} {label}", lambda s=spec, f=launcher: f(s)))
    python = str(bin_dir / "python")
    python_pass = Variant("python -c pass", lambda: spawn_and_wait([python, "-c", "pass"], devnull),
                          max_samples=python_runs)
    return variants, python_pass


def run_rounds(variants: list[Variant], runs: int, warmup: int, rng: random.Random) -> None:
    """Warm up, then ``runs`` rounds, one sample of each wanted variant per round, shuffled order."""
    progress = sys.stderr.isatty()
    total = warmup + runs
    for round_no in range(total):
        record = round_no >= warmup
        order = [v for v in variants if not record or v.wanted()]
        rng.shuffle(order)
        for variant in order:
            variant.measure(record)
        if progress and record and (round_no - warmup + 1) % max(1, runs // 20) == 0:
            sys.stderr.write(f"\r  round {round_no - warmup + 1}/{runs}")
            sys.stderr.flush()
    if progress and runs:
        sys.stderr.write("\n")


# --------------------------------------------------------------------------- import cost

def import_cost_us(python: str) -> dict[str, Any]:
    """One ``python -X importtime`` run; the sum of the top-level cumulative times."""
    done = subprocess.run([python, "-X", "importtime", "-c", IMPORT_MODULES],
                          stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          close_fds=True, timeout=60, check=False)
    top: list[tuple[str, int]] = []
    for line in done.stderr.decode(errors="replace").splitlines():
        parsed = _parse_importtime(line)
        if parsed is not None and parsed[2] == 0:
            top.append((parsed[0], parsed[1]))
    return {
        "exit_code": done.returncode,
        "total_us": sum(us for _, us in top),
        "sandboxd_us": sum(us for name, us in top if name.startswith("sandboxd")),
        "top_level": sorted(top, key=lambda item: -item[1]),
    }


def _parse_importtime(line: str) -> tuple[str, int, int] | None:
    """(module, cumulative us, nesting depth) of one ``import time:`` line, or None."""
    if not line.startswith("import time:"):
        return None
    parts = line[len("import time:"):].split("|")
    if len(parts) != 3 or not parts[1].strip().isdigit():
        return None
    name_field = parts[2][1:]                      # one separator space after the bar
    depth = (len(name_field) - len(name_field.lstrip(" "))) // 2
    return name_field.strip(), int(parts[1]), depth


# --------------------------------------------------------------------------- reporting

def machine_info() -> dict[str, Any]:
    model = "unknown"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "nproc": len(os.sched_getaffinity(0)),
        "cpu_model": model,
        "kernel": platform.release(),
        "python": sys.version.split()[0],
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "loadavg_start": list(os.getloadavg()),
    }


def summarize(samples: list[float]) -> dict[str, float] | None:
    if not samples:
        return None
    ordered = sorted(samples)
    p95 = statistics.quantiles(ordered, n=20, method="inclusive")[18] if len(ordered) > 1 else ordered[0]
    return {"n": len(ordered), "median_ms": statistics.median(ordered), "p95_ms": p95,
            "mean_ms": statistics.fmean(ordered), "min_ms": ordered[0], "max_ms": ordered[-1]}


def ratio(value: float | None, reference: float | None) -> float | None:
    return value / reference if value is not None and reference else None


def fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def print_table(rows: list[dict[str, Any]]) -> None:
    header = f"{'name':<32} | {'median ms':>9} | {'p95 ms':>8} | {'x bwrap':>7} | {'x bare':>7} | {'n':>4} | fail"
    print(header)
    print("-" * len(header))
    for row in rows:
        print(f"{row['name']:<32} | {fmt(row['median_ms'], '9.2f')} | {fmt(row['p95_ms'], '8.2f')} | "
              f"{fmt(row['x_bwrap'], '7.2f')} | {fmt(row['x_bare'], '7.2f')} | {row['n']:>4} | {row['failures']}")


def build_rows(variants: list[Variant]) -> list[dict[str, Any]]:
    stats = {v.name: summarize(v.samples_ms) for v in variants}
    bwrap = (stats.get("bwrap one-shot") or {}).get("median_ms")
    bare = (stats.get("bare exec /bin/true") or {}).get("median_ms")
    rows = []
    for v in variants:
        s = stats[v.name] or {}
        median = s.get("median_ms")
        rows.append({"name": v.name, **s, "median_ms": median, "p95_ms": s.get("p95_ms"),
                     "n": len(v.samples_ms), "x_bwrap": ratio(median, bwrap), "x_bare": ratio(median, bare),
                     "failures": v.failures, "first_error": v.first_error})
    return rows


def target_lines(rows: list[dict[str, Any]]) -> dict[str, float | None]:
    by_name = {row["name"]: row for row in rows}
    fork = by_name["forkserver workspace-write"]["x_bwrap"]
    cli = by_name["cli workspace-write"]["x_bwrap"]
    print(f"fork server warm launch (workspace-write) vs bwrap one-shot: {fmt(fork, '.2f')}x (target <= 2x)"
          f"{'' if fork is None else ('  OK' if fork <= 2 else '  MISSED')}")
    print(f"sandboxd run -- true (workspace-write) vs bwrap: {fmt(cli, '.2f')}x (target < 5x)"
          f"{'' if cli is None else ('  OK' if cli < 5 else '  MISSED')}")
    return {"forkserver_workspace_write_x_bwrap": fork, "cli_workspace_write_x_bwrap": cli}


# --------------------------------------------------------------------------- main

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=200, help="measured rounds (default 200)")
    p.add_argument("--warmup", type=int, default=WARMUP_ROUNDS, help=f"warm-up rounds (default {WARMUP_ROUNDS})")
    p.add_argument("--python-runs", type=int, default=30, help="samples of `python -c pass` (default 30)")
    p.add_argument("--json", metavar="FILE", help="also write all numbers as JSON to FILE")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not os.path.exists(BWRAP):
        sys.stderr.write(f"benchmark: {BWRAP} is missing\n")
        return 2
    machine = machine_info()
    ws = tempfile.mkdtemp(prefix="sandboxd-bench-", dir="/var/tmp")
    os.chdir(ws)                                   # every spawned command starts in the workspace
    devnull = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    fs = ForkServer.start()                        # before any thread exists (there never is one)
    started = time.monotonic()
    try:
        variants, python_pass = build_variants(ws, devnull, fs, Spawner(), args.python_runs)
        print(f"sandboxd launch benchmark  {machine['date']}")
        print(f"machine: nproc={machine['nproc']}  cpu={machine['cpu_model']}  kernel={machine['kernel']}  "
              f"python={machine['python']}  loadavg={' '.join(f'{x:.2f}' for x in machine['loadavg_start'])}")
        print(f"rounds: {args.runs} measured after {args.warmup} warm-up, shuffled order (seed {SHUFFLE_SEED}); "
              f"workspace {ws}")
        sys.stdout.flush()
        rng = random.Random(SHUFFLE_SEED)
        run_rounds(variants + [python_pass], 0, args.warmup, rng)
        imports = import_cost_us(str(venv_bin() / "python"))
        run_rounds(variants + [python_pass], args.runs, 0, rng)
    finally:
        fs.close()
        os.close(devnull)
        os.chdir("/")
        shutil.rmtree(ws, ignore_errors=True)
    elapsed = time.monotonic() - started
    leftovers = leftover_children()
    machine["loadavg_end"] = list(os.getloadavg())

    rows = build_rows(variants + [python_pass])
    print()
    print_table(rows)
    print()
    targets = target_lines(rows)
    pass_median = rows[-1]["median_ms"]
    print(f"one-shot import cost ({IMPORT_MODULES}): {imports['total_us']} us top-level cumulative "
          f"({imports['sandboxd_us']} us in sandboxd.*); python -c pass median {fmt(pass_median, '.2f')} ms")
    print("  largest top-level imports: "
          + ", ".join(f"{name} {us} us" for name, us in imports["top_level"][:6]))
    for row in rows:
        if row["failures"]:
            print(f"FAILURES {row['name']}: {row['failures']}, first: {row['first_error']}")
    if leftovers:
        print(f"WARNING: children still present after cleanup: {leftovers}")
    if imports["exit_code"] != 0:
        print(f"WARNING: the importtime run exited with {imports['exit_code']}")
    print(f"elapsed {elapsed:.1f} s; loadavg at end "
          f"{' '.join(f'{x:.2f}' for x in machine['loadavg_end'])}")

    if args.json:
        report = {"machine": machine, "runs": args.runs, "warmup": args.warmup, "seed": SHUFFLE_SEED,
                  "elapsed_s": elapsed, "leftover_children": leftovers, "variants": rows, "targets": targets,
                  "import_cost": imports, "python_pass_median_ms": pass_median}
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(report, handle, indent=2)
    return 1 if any(row["failures"] for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
