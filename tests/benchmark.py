"""Launch-latency benchmark for sandboxd.

Run it from the repository root with the project's venv::

    .venv/bin/python tests/benchmark.py                 # 200 rounds (about 2-3 minutes)
    .venv/bin/python tests/benchmark.py --runs 60       # quicker, noisier
    .venv/bin/python tests/benchmark.py --json out.json # also write every number as JSON
    .venv/bin/python tests/benchmark.py --soak 600      # only the soak: 20 clients for 10 minutes (bench_soak.py)
    .venv/bin/python tests/benchmark.py --breakdown     # only where a warm Exec's CPU goes (bench_breakdown.py)

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

for the policies read-only, workspace-write, workspace-write + host network and
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

Then, unless ``--no-daemon``, the daemon section: ``sandboxd serve --socket SOCK``
(SOCK in a fresh directory under /var/tmp) is started as a subprocess, logging
to a file there, and used once it answers the ``grpc.health.v1`` Check with
SERVING. It is measured over the Unix socket with ``sandboxd.client``:

* ``daemon Exec true (warm)``: ``SandboxClient.exec(session, ["true"])`` in a
  session that already ran a few commands; interleaved round-robin (shuffled per
  round) with fresh ``bwrap one-shot`` samples and a CreateSession + CloseSession
  cycle, ``--daemon-runs`` rounds after the warm-up. The ratio warm Exec / bwrap
  is taken to the bwrap median of this phase (target < 1x). It is a phase of its
  own, after the main table, because the gRPC client starts threads in this
  process and the ``spawner`` variants fork it.
* ``daemon CreateSession`` / ``daemon CloseSession``: the round trip of each.
* ``--clients`` (8) threads, each with its own ``SandboxClient`` and session,
  running ``true`` in a loop for ``--concurrency-seconds`` (5): total execs/s; with
  ``--churners N``, N more clients create and close sessions meanwhile (their errors counted).
* stdout throughput of ``head -c 1073741824 /dev/zero`` in a session, bytes
  counted as they arrive, ``--throughput-runs`` (2) times (target >= 200 MiB/s).
  Raw ``Exec`` stub with ``output_limit_bytes`` 2 GiB: ``SandboxClient.exec``
  cannot raise the server's 64 MiB default cap, which would truncate the output.
* VmRSS (and PSS, from smaps_rollup) of ``sandboxd serve`` and of its fork server
  child (``python -m sandboxd.supervisor.fork_server``), separately and summed:
  idle right after start, idle after the load above, with ``--sessions`` (100)
  sessions open, and after closing them. The session sandboxes (descendants of
  the fork server) are reported beside, not in the sum.

The daemon is stopped with SIGTERM (SIGKILL after 20 s); every session the
script opened is closed first; a watchdog SIGKILLs the daemon if a phase hangs.
Failed calls are counted and their first error printed; warnings and errors the
daemon logged are printed; daemon descendants still alive after the stop, and
the daemon's exit status, are checked and reported.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from sandboxd import defaults
from sandboxd.policy import DangerFullAccess, LaunchSpec, ReadOnly, SandboxPolicy, WorkspaceWrite
from sandboxd.supervisor.fork_client import ForkServer
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
    # The host's network (isolated networks are measured in their own section, bench_network.py:
    # interleaved here, their veth and namespace teardown would slow every other variant).
    ("workspace-write+net", ["--sandbox", "workspace-write", "--network=host"],
     lambda: WorkspaceWrite(network_access=True, network_mode="host")),
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
        self.call(self.run, record)

    def call(self, fn: Callable[[], Any], record: bool) -> Any:
        """Time ``fn()``; return its value, or None (counted, first error kept) if it raised."""
        start = time.perf_counter_ns()
        try:
            value = fn()
        except Exception as exc:  # noqa: BLE001 - a failed launch is reported, not fatal
            self.failures += 1
            if self.first_error is None:
                self.first_error = error_text(exc)
            return None
        elapsed_ms = (time.perf_counter_ns() - start) / 1e6
        if record:
            self.samples_ms.append(elapsed_ms)
        return value


def error_text(exc: BaseException) -> str:
    """``Type: message``; for a gRPC error its status code and details, not the whole debug string."""
    code, details = getattr(exc, "code", None), getattr(exc, "details", None)
    if callable(code) and callable(details):
        try:
            return f"{type(exc).__name__}: {code()}: {details()}"
        except Exception:  # noqa: BLE001 - not a call-shaped error after all
            pass
    return f"{type(exc).__name__}: {exc}"


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
    p99 = statistics.quantiles(ordered, n=100, method="inclusive")[98] if len(ordered) > 1 else ordered[0]
    return {"n": len(ordered), "median_ms": statistics.median(ordered), "p95_ms": p95, "p99_ms": p99,
            "mean_ms": statistics.fmean(ordered), "min_ms": ordered[0], "max_ms": ordered[-1]}


def ratio(value: float | None, reference: float | None) -> float | None:
    return value / reference if value is not None and reference else None


def fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def print_table(rows: list[dict[str, Any]], *, with_bare: bool = True) -> None:
    bare_head = f" | {'x bare':>7}" if with_bare else ""
    header = f"{'name':<32} | {'median ms':>9} | {'p95 ms':>8} | {'x bwrap':>7}{bare_head} | {'n':>4} | fail"
    print(header)
    print("-" * len(header))
    for row in rows:
        bare = f" | {fmt(row['x_bare'], '7.2f')}" if with_bare else ""
        print(f"{row['name']:<32} | {fmt(row['median_ms'], '9.2f')} | {fmt(row['p95_ms'], '8.2f')} | "
              f"{fmt(row['x_bwrap'], '7.2f')}{bare} | {row['n']:>4} | {row['failures']}")


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


# --------------------------------------------------------------------------- daemon: processes

ONE_GIB = 1 << 30
DAEMON_STOP_TIMEOUT_S = 20.0
DAEMON_READY_TIMEOUT_S = 60.0
FORK_SERVER_MARK = b"sandboxd.supervisor.fork_server"


def compile_sources() -> dict[str, Any]:
    """Byte-compile the package once, so that no interpreter this script starts compiles it again.

    PYTHONDONTWRITEBYTECODE may be set (then nothing would ever be cached), and the
    sources may have changed since the last run.
    """
    started = time.monotonic()
    done = subprocess.run([str(venv_bin() / "python"), "-m", "compileall", "-q", str(ROOT / "sandboxd")],
                          stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          close_fds=True, timeout=300, check=False)
    return {"exit_code": done.returncode, "seconds": time.monotonic() - started,
            "output": done.stdout.decode(errors="replace").strip()[-2000:]}


def proc_stat(pid: int) -> tuple[int, str, int] | None:
    """(ppid, state, start time in clock ticks) of a process, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), fields[0], int(fields[19])


def proc_cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return handle.read()
    except OSError:
        return b""


def descendants(root: int) -> dict[int, int]:
    """{pid: start time} of every live descendant of ``root`` (one pass over /proc)."""
    parents: dict[int, int] = {}
    starts: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = proc_stat(int(entry))
            if stat is not None and stat[1] != "Z":
                parents[int(entry)], starts[int(entry)] = stat[0], stat[2]
    found: dict[int, int] = {}
    frontier = [root]
    while frontier:
        parent = frontier.pop()
        for pid, ppid in parents.items():
            if ppid == parent and pid not in found:
                found[pid] = starts[pid]
                frontier.append(pid)
    return found


def still_alive(processes: dict[int, int]) -> list[int]:
    """Those of {pid: start time} that still exist (same start time: not a reused pid) and are not zombies."""
    alive = []
    for pid, start in processes.items():
        stat = proc_stat(pid)
        if stat is not None and stat[2] == start and stat[1] != "Z":
            alive.append(pid)
    return sorted(alive)


def memory_kib(pid: int) -> dict[str, int | None]:
    """VmRSS and Threads from /proc/PID/status, Pss from /proc/PID/smaps_rollup (kB; None if unreadable)."""
    out: dict[str, int | None] = {"rss_kib": None, "pss_kib": None, "threads": None}
    try:
        with open(f"/proc/{pid}/status", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("VmRSS:"):
                    out["rss_kib"] = int(line.split()[1])
                elif line.startswith("Threads:"):
                    out["threads"] = int(line.split()[1])
    except (OSError, ValueError):
        pass
    try:
        with open(f"/proc/{pid}/smaps_rollup", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("Pss:"):
                    out["pss_kib"] = int(line.split()[1])
                    break
    except (OSError, ValueError):
        pass
    return out


def _set_parent_death_signal() -> None:
    """In the daemon, before exec: SIGTERM if this script dies without stopping it (PR_SET_PDEATHSIG)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)


class DaemonProcess:
    """``sandboxd serve`` on ``<base>/run/sandboxd.sock`` (a directory of its own: the daemon hides it in
    every sandbox, so no workspace may be in it), state in ``<base>/state``, stdout and stderr to
    ``<base>/daemon.log``. ``tree``: a source tree of another revision (its ``sandboxd`` package,
    with its call helper built) to run the daemon from instead of this checkout's, for before/after
    figures."""

    def __init__(self, base: str, tree: str | None = None) -> None:
        self.base = base
        self.tree = tree
        self.socket = os.path.join(base, "run", "sandboxd.sock")
        self.log_path = os.path.join(base, "daemon.log")
        self.proc: subprocess.Popen[bytes] | None = None
        self.exit_code: int | None = None
        self.stop_seconds: float | None = None
        self.killed = False
        self.watchdog_fired: list[str] = []
        self.seen: dict[int, int] = {}              # every descendant ever observed: {pid: start time}

    def start(self) -> float:
        """Start it and wait for SERVING; return the seconds that took. Raises if it does not get there."""
        import grpc                                 # only now: the gRPC client starts threads in this process
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        started = time.monotonic()
        with open(self.log_path, "ab") as log:
            # Benchmarks open many of root's sessions: this checkout holds root to quotas.root_sessions
            # (an older tree, run for a comparison, exempts root and may not know the key).
            env = ({**os.environ, "SANDBOXD_QUOTAS_ROOT_SESSIONS": "100000"} if self.tree is None
                   else {**os.environ, "PYTHONPATH": self.tree})
            self.proc = subprocess.Popen([str(venv_bin() / "sandboxd"), "serve", "--socket", self.socket, "--state-dir", os.path.join(self.base, "state")],
                                         env=env,
                                         stdin=subprocess.DEVNULL, stdout=log, stderr=log, close_fds=True,
                                         preexec_fn=_set_parent_death_signal)
        deadline = started + DAEMON_READY_TIMEOUT_S
        last_error = "the socket never appeared"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sandboxd serve exited with {self.proc.returncode} before serving; "
                                   f"log: {self.log_tail()}")
            if os.path.exists(self.socket):
                channel = grpc.insecure_channel(f"unix:{self.socket}")
                try:
                    reply = health_pb2_grpc.HealthStub(channel).Check(
                        health_pb2.HealthCheckRequest(service=""), timeout=2)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return time.monotonic() - started
                    last_error = f"health status {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}"
                except grpc.RpcError as exc:
                    last_error = error_text(exc)
                finally:
                    channel.close()
            time.sleep(0.02)
        raise RuntimeError(f"sandboxd serve not SERVING within {DAEMON_READY_TIMEOUT_S:.0f} s ({last_error}); "
                           f"log: {self.log_tail()}")

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def observe(self) -> dict[int, int]:
        """The daemon's live descendants now (and remember them, for the check after the stop)."""
        if not self.running():
            return {}
        found = descendants(self.pid)
        self.seen.update(found)
        return found

    def fork_server_pid(self) -> int | None:
        for pid in self.observe():
            stat = proc_stat(pid)
            if stat is not None and stat[0] == self.pid and FORK_SERVER_MARK in proc_cmdline(pid):
                return pid
        return None

    def memory(self) -> dict[str, Any]:
        """Memory of the daemon, of its fork server, their sum, and (beside) the session sandboxes."""
        if not self.running():
            return {"error": "the daemon is not running"}
        everything = self.observe()
        fork = self.fork_server_pid()
        serve_mem, fork_mem = memory_kib(self.pid), memory_kib(fork) if fork else {}
        sandboxes = descendants(fork) if fork else {}
        box_rss = [memory_kib(pid)["rss_kib"] for pid in sandboxes]
        box_pss = [memory_kib(pid)["pss_kib"] for pid in sandboxes]
        def total(*values: int | None) -> int | None:
            return None if any(v is None for v in values) else sum(v for v in values if v is not None)
        return {
            "serve_pid": self.pid, "fork_server_pid": fork,
            "serve": serve_mem, "fork_server": fork_mem,
            "sum_rss_kib": total(serve_mem.get("rss_kib"), fork_mem.get("rss_kib")),
            "sum_pss_kib": total(serve_mem.get("pss_kib"), fork_mem.get("pss_kib")),
            "sandbox_processes": len(sandboxes),
            "sandbox_rss_kib": sum(v for v in box_rss if v is not None),
            "sandbox_pss_kib": sum(v for v in box_pss if v is not None),
            "other_descendants": len(everything) - len(sandboxes) - (1 if fork else 0),
        }

    def kill(self, why: str) -> None:
        """The watchdog's way out of a hung phase: SIGKILL (the fork server and sandboxes die with it)."""
        self.watchdog_fired.append(why)
        if self.running():
            self.killed = True
            self.proc.kill()                        # type: ignore[union-attr]

    def stop(self) -> None:
        """SIGTERM and wait; SIGKILL if it has not exited after DAEMON_STOP_TIMEOUT_S."""
        if self.proc is None:
            return
        self.observe()
        started = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(DAEMON_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.killed = True
                self.proc.kill()
                self.proc.wait()
        self.stop_seconds = time.monotonic() - started
        self.exit_code = self.proc.returncode

    def log_text(self) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as handle:
                return handle.read()
        except OSError:
            return ""

    def log_tail(self, lines: int = 5) -> str:
        return " | ".join(self.log_text().strip().splitlines()[-lines:]) or "(empty)"

    def log_problems(self) -> list[str]:
        """Log lines at level warning or worse, and lines that are not JSON (tracebacks, stray prints)."""
        problems = []
        for line in self.log_text().splitlines():
            if not line.strip():
                continue
            try:
                level = json.loads(line).get("level", "")
            except (ValueError, AttributeError):
                problems.append(line)
                continue
            if level not in ("info", "debug"):
                problems.append(line)
        return problems


class Watchdog:
    """SIGKILLs the daemon if a phase has not finished after ``seconds``: a hung call then fails instead."""

    def __init__(self, daemon: DaemonProcess, phase: str, seconds: float) -> None:
        self._timer = threading.Timer(seconds, daemon.kill, args=(f"{phase} (after {seconds:.0f} s)",))
        self._timer.daemon = True

    def __enter__(self) -> "Watchdog":
        self._timer.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._timer.cancel()
        self._timer.join()


# --------------------------------------------------------------------------- daemon: measurements

class Sessions:
    """Sessions this script opened and has not closed yet (closed at the end whatever happens)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.open: set[str] = set()

    def add(self, session_id: str) -> None:
        with self._lock:
            self.open.add(session_id)

    def discard(self, session_id: str) -> None:
        with self._lock:
            self.open.discard(session_id)

    def close_all(self, socket_path: str) -> tuple[int, str | None]:
        """Close what is left (same uid, so any client may); (how many could not be closed, the first error)."""
        with self._lock:
            left = sorted(self.open)
        if not left:
            return 0, None
        from sandboxd.client import SandboxClient

        failed, first = 0, None
        with SandboxClient(socket_path) as client:
            for session_id in left:
                try:
                    client.close_session(session_id)
                    self.discard(session_id)
                except Exception as exc:  # noqa: BLE001 - reported
                    failed += 1
                    first = first or error_text(exc)
        return failed, first


def exec_true(client: Any, session_id: str) -> None:
    """``true`` in the session through ``SandboxClient.exec``; raise unless a result with status 0 came back."""
    outcome = client.exec(session_id, ["true"])
    result = outcome.result
    if result.wall_seconds <= 0 or result.shell_status != 0:   # no result message at all: all fields zero
        raise RuntimeError(f"Exec true: started_pid={outcome.started_pid} shell_status={result.shell_status} "
                           f"wall_seconds={result.wall_seconds} stderr={outcome.stderr[-200:]!r}")


def create_session(client: Any, sessions: Sessions, workspace: str) -> str:
    session = client.create_session(workspace, approval="never")
    sessions.add(session.id)
    return session.id


def close_session(client: Any, sessions: Sessions, session_id: str) -> None:
    client.close_session(session_id)
    sessions.discard(session_id)


def interleaved_daemon_rounds(daemon: DaemonProcess, client: Any, sessions: Sessions, workspace: str,
                              devnull: int, runs: int, warmup: int) -> dict[str, Variant]:
    """Warm calls (sandboxd.client's, which uses Run; and both RPCs through the generated stubs,
    as a gRPC runtime drives them: bench_rpcs), CreateSession + CloseSession and bwrap one-shot,
    round-robin in a shuffled order per round."""
    import bench_rpcs

    out = {name: Variant(name, lambda: None) for name in
           ("bwrap one-shot (daemon phase)", "daemon Exec true (warm)", "daemon CreateSession",
            "daemon CloseSession", f"daemon {bench_rpcs.EXEC}", f"daemon {bench_rpcs.RUN}")}
    bwrap, warm, create, close, raw_exec, raw_run = out.values()
    session_id = create.call(lambda: create_session(client, sessions, workspace), record=False)
    if session_id is None:
        return out
    raw = bench_rpcs.RawCalls(daemon.socket)
    for _ in range(5):                                           # warm: the session has run commands
        warm.call(lambda: exec_true(client, session_id), record=False)
        raw_exec.call(lambda: raw.exec_true(session_id), record=False)
        raw_run.call(lambda: raw.run_true(session_id), record=False)

    def cycle(record: bool) -> None:
        new_id = create.call(lambda: create_session(client, sessions, workspace), record)
        if new_id is not None:
            close.call(lambda: close_session(client, sessions, new_id), record)

    actions: list[Callable[[bool], None]] = [
        lambda record: bwrap.call(lambda: spawn_and_wait(BWRAP_ARGV, devnull), record),
        lambda record: warm.call(lambda: exec_true(client, session_id), record),
        lambda record: raw_exec.call(lambda: raw.exec_true(session_id), record),
        lambda record: raw_run.call(lambda: raw.run_true(session_id), record),
        cycle,
    ]
    rng = random.Random(SHUFFLE_SEED + 1)
    with Watchdog(daemon, "interleaved Exec/CreateSession rounds", 120 + 2.0 * (runs + warmup)):
        for round_no in range(warmup + runs):
            rng.shuffle(actions)
            for action in actions:
                action(round_no >= warmup)
    raw.close()
    close.call(lambda: close_session(client, sessions, session_id), record=False)
    return out


def concurrent_execs(daemon: DaemonProcess, socket_path: str, sessions: Sessions, workspace: str,
                     clients: int, seconds: float, churners: int = 0) -> dict[str, Any]:
    """``clients`` threads, each with its own SandboxClient and session, running ``true`` for ``seconds``;
    beside them ``churners`` threads, each with its own SandboxClient, creating and closing sessions
    (CreateSession, one ``true``, CloseSession) for as long."""
    from sandboxd.client import SandboxClient

    start_at: list[float] = []
    barrier = threading.Barrier(clients + churners + 1, action=lambda: start_at.append(time.perf_counter()))
    results: list[dict[str, Any]] = [{"ok": 0, "failures": 0, "first_error": None, "setup_error": None,
                                      "latencies_ms": [], "end": None} for _ in range(clients)]
    churned: list[dict[str, Any]] = [{"cycles": 0, "failures": 0, "first_error": None} for _ in range(churners)]

    def churner(slot: dict[str, Any]) -> None:
        with SandboxClient(socket_path) as client:
            try:
                barrier.wait(timeout=120)
            except threading.BrokenBarrierError:
                slot["first_error"] = "the start barrier broke"
                return
            deadline = start_at[0] + seconds
            while time.perf_counter() < deadline and daemon.running():
                try:
                    session_id = create_session(client, sessions, workspace)
                    exec_true(client, session_id)
                    close_session(client, sessions, session_id)
                    slot["cycles"] += 1
                except Exception as exc:  # noqa: BLE001 - counted
                    slot["failures"] += 1
                    slot["first_error"] = slot["first_error"] or error_text(exc)

    def worker(slot: dict[str, Any]) -> None:
        client = session_id = None
        try:
            client = SandboxClient(socket_path)
            session_id = create_session(client, sessions, workspace)
            exec_true(client, session_id)                        # warm
        except Exception as exc:  # noqa: BLE001 - reported
            slot["setup_error"] = error_text(exc)
        try:
            barrier.wait(timeout=120)
            if slot["setup_error"] is None:
                deadline = start_at[0] + seconds
                while time.perf_counter() < deadline:
                    begun = time.perf_counter()
                    try:
                        exec_true(client, session_id)
                    except Exception as exc:  # noqa: BLE001 - counted
                        slot["failures"] += 1
                        slot["first_error"] = slot["first_error"] or error_text(exc)
                        if not daemon.running():             # no point spinning on a dead daemon
                            break
                        continue
                    slot["end"] = time.perf_counter()
                    slot["ok"] += 1
                    slot["latencies_ms"].append((slot["end"] - begun) * 1e3)
        except threading.BrokenBarrierError:
            slot["setup_error"] = slot["setup_error"] or "the start barrier broke"
        finally:
            if client is not None and session_id is not None:
                try:
                    close_session(client, sessions, session_id)
                except Exception as exc:  # noqa: BLE001 - Sessions.close_all retries it at the end
                    slot["first_error"] = slot["first_error"] or f"CloseSession: {error_text(exc)}"
            if client is not None:
                client.close()

    threads = [threading.Thread(target=worker, args=(slot,), name=f"bench-client-{i}", daemon=True)
               for i, slot in enumerate(results)]
    threads += [threading.Thread(target=churner, args=(slot,), name=f"bench-churner-{i}", daemon=True)
                for i, slot in enumerate(churned)]
    connections: int | None = None
    with Watchdog(daemon, "concurrent execs", seconds + 180):
        for thread in threads:
            thread.start()
        try:
            barrier.wait(timeout=120)
            time.sleep(min(1.0, seconds / 2))
            relay_dir = os.path.join(defaults.private_dir(socket_path), "relay")
            try:                                                 # one relay socket per live connection
                connections = sum(1 for name in os.listdir(relay_dir) if name.endswith(".sock"))
            except OSError:
                connections = None
        except threading.BrokenBarrierError:
            pass
        for thread in threads:
            thread.join(seconds + 170)
    hung = sum(1 for thread in threads if thread.is_alive())
    ends = [slot["end"] for slot in results if slot["end"] is not None]
    wall = (max(ends) - start_at[0]) if ends and start_at else None
    total = sum(slot["ok"] for slot in results)
    latencies = [ms for slot in results for ms in slot["latencies_ms"]]
    return {
        "clients": clients, "seconds_target": seconds, "wall_s": wall, "execs": total,
        "execs_per_s": (total / wall) if wall else None,
        "per_client_execs": [slot["ok"] for slot in results],
        "latency": summarize(latencies),
        "failures": sum(slot["failures"] for slot in results),
        "setup_failures": sum(1 for slot in results if slot["setup_error"]),
        "hung_threads": hung,
        "first_error": next((slot["first_error"] for slot in results if slot["first_error"]), None),
        "first_setup_error": next((slot["setup_error"] for slot in results if slot["setup_error"]), None),
        "front_door_connections": connections,
        "churners": churners, "churn_cycles": sum(slot["cycles"] for slot in churned),
        "churn_failures": sum(slot["failures"] for slot in churned),
        "churn_first_error": next((slot["first_error"] for slot in churned if slot["first_error"]), None),
    }


def stdout_throughput(daemon: DaemonProcess, client: Any, sessions: Sessions, workspace: str,
                      runs: int) -> dict[str, Any]:
    """``head -c 1 GiB /dev/zero`` in a session, counting stdout bytes as they arrive; MiB/s per run."""
    from sandboxd.v1 import sandboxd_pb2 as pb

    report: dict[str, Any] = {"runs": [], "failures": 0, "first_error": None}
    if runs <= 0:
        return report
    try:
        session_id = create_session(client, sessions, workspace)
    except Exception as exc:  # noqa: BLE001 - reported
        report["failures"], report["first_error"] = runs, f"CreateSession: {error_text(exc)}"
        return report
    start = pb.ExecStart(session_id=session_id, argv=["head", "-c", str(ONE_GIB), "/dev/zero"],
                         close_stdin=True, output_limit_bytes=2 * ONE_GIB)
    for _ in range(runs):
        counted = {1: 0, 2: 0}

        def on_output(stream: int, chunk: bytes) -> None:
            counted[stream] += len(chunk)

        result = None
        begun = time.perf_counter()
        try:
            with Watchdog(daemon, "1 GiB stdout", 300):
                for response in client.stub.Exec(iter([pb.ExecRequest(start=start)]), timeout=280):
                    kind = response.WhichOneof("kind")
                    if kind == "stdout":
                        on_output(1, response.stdout)
                    elif kind == "stderr":
                        on_output(2, response.stderr)
                    elif kind == "result":
                        result = response.result
            seconds = time.perf_counter() - begun
            if result is None or result.shell_status != 0 or result.output_truncated or counted[1] != ONE_GIB:
                raise RuntimeError(f"got {counted[1]} stdout bytes (want {ONE_GIB}), {counted[2]} stderr bytes, "
                                   f"result {'missing' if result is None else f'shell_status={result.shell_status} truncated={result.output_truncated}'}")
        except Exception as exc:  # noqa: BLE001 - counted
            report["failures"] += 1
            report["first_error"] = report["first_error"] or error_text(exc)
            continue
        report["runs"].append({"seconds": seconds, "mib_per_s": counted[1] / (1 << 20) / seconds,
                               "command_wall_s": result.wall_seconds, "command_cpu_s": result.cpu_seconds})
    try:
        close_session(client, sessions, session_id)
    except Exception as exc:  # noqa: BLE001 - Sessions.close_all retries it
        report["failures"] += 1
        report["first_error"] = report["first_error"] or f"CloseSession: {error_text(exc)}"
    rates = [run["mib_per_s"] for run in report["runs"]]
    report["median_mib_per_s"] = statistics.median(rates) if rates else None
    return report


def many_sessions(daemon: DaemonProcess, client: Any, sessions: Sessions, workspace: str,
                  count: int) -> dict[str, Any]:
    """Open ``count`` sessions, take the daemon's memory, close them, take it again."""
    create, close = Variant("CreateSession (filling)", lambda: None), Variant("CloseSession (emptying)", lambda: None)
    opened: list[str] = []
    with Watchdog(daemon, f"{count} sessions", 120 + 2.0 * count):
        for _ in range(count):
            session_id = create.call(lambda: create_session(client, sessions, workspace), record=True)
            if session_id is not None:
                opened.append(session_id)
        full = daemon.memory()
        for session_id in opened:
            close.call(lambda s=session_id: close_session(client, sessions, s), record=True)
    time.sleep(0.2)                                              # let the last session inits be reaped
    return {"count": count, "opened": len(opened), "memory_full": full, "memory_after": daemon.memory(),
            "create": {**(summarize(create.samples_ms) or {}), "failures": create.failures,
                       "first_error": create.first_error},
            "close": {**(summarize(close.samples_ms) or {}), "failures": close.failures,
                      "first_error": close.first_error}}


def run_daemon_section(args: argparse.Namespace, main_bwrap_median: float | None) -> dict[str, Any]:
    """Start the daemon, measure everything, stop it, clean up; print the section; return the JSON part."""
    base = tempfile.mkdtemp(prefix="sandboxd-bench-daemon-", dir="/var/tmp")
    os.chmod(base, 0o755)
    workspace = os.path.join(base, "ws")
    os.mkdir(workspace)
    daemon = DaemonProcess(base)
    sessions = Sessions()
    devnull = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    report: dict[str, Any] = {"socket": daemon.socket, "errors": []}
    client = None
    started = time.monotonic()
    os.chdir(workspace)
    try:
        try:
            report["ready_s"] = daemon.start()
        except Exception as exc:  # noqa: BLE001 - reported, the section is skipped
            report["errors"].append(f"start: {error_text(exc)}")
        if daemon.running() and not report["errors"]:
            from sandboxd.client import SandboxClient

            time.sleep(0.2)
            report["memory_idle_fresh"] = daemon.memory()
            client = SandboxClient(daemon.socket)
            rounds = interleaved_daemon_rounds(daemon, client, sessions, workspace, devnull,
                                               args.daemon_runs, args.warmup)
            report["rounds"] = {"runs": args.daemon_runs, "warmup": args.warmup, "seed": SHUFFLE_SEED + 1,
                                "variants": build_daemon_rows(list(rounds.values()))}
            report["concurrency"] = concurrent_execs(daemon, daemon.socket, sessions, workspace,
                                                     args.clients, args.concurrency_seconds, args.churners)
            report["throughput"] = stdout_throughput(daemon, client, sessions, workspace, args.throughput_runs)
            time.sleep(0.2)
            report["memory_idle_after_load"] = daemon.memory()
            report["sessions"] = many_sessions(daemon, client, sessions, workspace, args.sessions)
    except Exception as exc:  # noqa: BLE001 - an unexpected error still gets reported and cleaned up
        report["errors"].append(f"unexpected: {error_text(exc)}")
    finally:
        unclosed, unclosed_error = 0, None
        try:
            if daemon.running():
                unclosed, unclosed_error = sessions.close_all(daemon.socket)
            # else: it was killed, or never started, and its sessions went with it
            if client is not None:
                client.close()
        except Exception as exc:  # noqa: BLE001 - still stop the daemon and clean up
            unclosed, unclosed_error = len(sessions.open), error_text(exc)
        finally:
            daemon.stop()
            os.close(devnull)
            os.chdir("/")
            report["log_problems"] = daemon.log_problems()
            report["log_tail"] = daemon.log_tail(8)
            socket_left = os.path.exists(daemon.socket)
            shutil.rmtree(base, ignore_errors=True)
    report.update({
        "pid": daemon.proc.pid if daemon.proc else None, "exit_code": daemon.exit_code,
        "stop_s": daemon.stop_seconds, "killed": daemon.killed, "watchdog_fired": daemon.watchdog_fired,
        "sessions_left_unclosed": unclosed, "unclosed_error": unclosed_error,
        "survivors": still_alive(daemon.seen), "socket_left_behind": socket_left,
        "elapsed_s": time.monotonic() - started, "main_bwrap_median_ms": main_bwrap_median,
    })
    report["targets"] = print_daemon_section(report)
    report["failures"] = daemon_failures(report)
    return report


# --------------------------------------------------------------------------- daemon: reporting

def build_daemon_rows(variants: list[Variant]) -> list[dict[str, Any]]:
    bwrap = (summarize(variants[0].samples_ms) or {}).get("median_ms")
    rows = []
    for v in variants:
        s = summarize(v.samples_ms) or {}
        rows.append({"name": v.name, **s, "median_ms": s.get("median_ms"), "p95_ms": s.get("p95_ms"),
                     "n": len(v.samples_ms), "x_bwrap": ratio(s.get("median_ms"), bwrap),
                     "failures": v.failures, "first_error": v.first_error})
    return rows


def daemon_failures(report: dict[str, Any]) -> int:
    """Every failed call or check of the daemon section, in one number."""
    total = len(report["errors"]) + len(report["watchdog_fired"]) + report["sessions_left_unclosed"]
    total += sum(row["failures"] for row in report.get("rounds", {}).get("variants", []))
    conc = report.get("concurrency") or {}
    total += conc.get("failures", 0) + conc.get("setup_failures", 0) + conc.get("hung_threads", 0)
    total += (report.get("throughput") or {}).get("failures", 0)
    many = report.get("sessions") or {}
    total += (many.get("create") or {}).get("failures", 0) + (many.get("close") or {}).get("failures", 0)
    total += len(report["survivors"]) + (1 if report["socket_left_behind"] else 0)
    total += 0 if report["exit_code"] in (0, None) else 1
    return total


def _mib(kib: int | None) -> str:
    return "n/a" if kib is None else f"{kib / 1024:.1f}"


def print_daemon_section(report: dict[str, Any]) -> dict[str, float | None]:
    print()
    print(f"daemon: sandboxd serve (pid {report['pid']}) on {report['socket']}; "
          f"SERVING after {fmt((report.get('ready_s') or 0) * 1e3 if 'ready_s' in report else None, '.0f')} ms")
    for error in report["errors"]:
        print(f"DAEMON FAILURE {error}")
    rows = (report.get("rounds") or {}).get("variants", [])
    targets: dict[str, float | None] = {"warm_exec_x_bwrap": None, "stdout_1gib_mib_per_s": None}
    if rows:
        rounds = report["rounds"]
        print(f"rounds: {rounds['runs']} measured after {rounds['warmup']} warm-up, warm calls / CreateSession+"
              f"CloseSession / bwrap interleaved in a shuffled order (seed {rounds['seed']}); 'daemon Exec true "
              "(warm)' is sandboxd.client's exec (Run), the raw stub rows a runtime's (bench_rpcs)")
        print_table(rows, with_bare=False)
        by_name = {row["name"]: row for row in rows}
        for label, name in (("warm Exec of true (the stream, raw stub)", "daemon Exec stream (raw stub)"),
                            ("warm Run of true (raw stub)", "daemon Run (raw stub)"),
                            ("warm client exec of true (Run)", "daemon Exec true (warm)")):
            warm = by_name.get(name, {}).get("x_bwrap")
            if name == "daemon Exec stream (raw stub)":
                targets["warm_exec_x_bwrap"] = warm                  # the stream's, as issue 24 measures it
            print(f"{label} vs bwrap one-shot: {fmt(warm, '.2f')}x (target < 1x)"
                  f"{'' if warm is None else ('  OK' if warm < 1 else '  MISSED')}")
        print(f"  bwrap one-shot median: {fmt(rows[0]['median_ms'], '.2f')} ms in this phase, "
              f"{fmt(report['main_bwrap_median_ms'], '.2f')} ms in the main table")
        for row in rows:
            if row["failures"]:
                print(f"FAILURES {row['name']}: {row['failures']}, first: {row['first_error']}")
    conc = report.get("concurrency")
    if conc:
        lat = conc["latency"] or {}
        print(f"{conc['clients']} concurrent clients (a thread, a SandboxClient and a session each), `true` in a loop "
              f"for {conc['seconds_target']:.0f} s: {conc['execs']} execs in {fmt(conc['wall_s'], '.2f')} s = "
              f"{fmt(conc['execs_per_s'], '.1f')} execs/s; per exec median {fmt(lat.get('median_ms'), '.1f')} ms, "
              f"p95 {fmt(lat.get('p95_ms'), '.1f')} ms, p99 {fmt(lat.get('p99_ms'), '.1f')} ms; per client {conc['per_client_execs']}; "
              f"front-door connections {fmt(conc['front_door_connections'], 'd')}")
        if conc["churners"]:
            print(f"  beside them {conc['churners']} clients churning sessions (CreateSession, `true`, CloseSession): "
                  f"{conc['churn_cycles']} sessions, {conc['churn_failures']} errors"
                  + (f"; first: {conc['churn_first_error']}" if conc["churn_first_error"] else ""))
        if conc["failures"] or conc["setup_failures"] or conc["hung_threads"]:
            print(f"FAILURES concurrent execs: {conc['failures']} execs, {conc['setup_failures']} client setups, "
                  f"{conc['hung_threads']} hung threads; first: {conc['first_error'] or conc['first_setup_error']}")
    tput = report.get("throughput")
    if tput:
        runs = ", ".join(f"{run['mib_per_s']:.0f} MiB/s ({run['seconds']:.2f} s; command cpu "
                         f"{run['command_cpu_s']:.2f} s)" for run in tput["runs"])
        print(f"stdout of `head -c {ONE_GIB} /dev/zero` in a session, bytes counted as they arrive: {runs or 'no run'}")
        median = tput.get("median_mib_per_s")
        targets["stdout_1gib_mib_per_s"] = median
        print(f"1 GiB stdout: {fmt(median, '.0f')} MiB/s (target >= 200 MiB/s)"
              f"{'' if median is None else ('  OK' if median >= 200 else '  MISSED')}"
              f"{'' if len(tput['runs']) < 2 else '  (median of %d runs)' % len(tput['runs'])}")
        if tput["failures"]:
            print(f"FAILURES 1 GiB stdout: {tput['failures']}, first: {tput['first_error']}")
    many = report.get("sessions") or {}
    states = [("idle, fresh", report.get("memory_idle_fresh")),
              ("idle, after the load above", report.get("memory_idle_after_load")),
              (f"{many.get('opened', 0)} open sessions" + ("" if many.get("opened") == many.get("count")
                                                            else f" (of {many.get('count')})"),
               many.get("memory_full")),
              ("after closing them", many.get("memory_after"))]
    if any(mem for _, mem in states):
        print("daemon memory, MiB (VmRSS; PSS in brackets):")
        header = (f"{'state':<28} | {'sandboxd serve':>16} | {'fork server':>16} | {'sum':>16} | "
                  f"{'threads':>7} | sandbox processes (not in the sum)")
        print(header)
        print("-" * len(header))
        for label, mem in states:
            if not mem:
                continue
            if "error" in mem:
                print(f"{label:<28} | {mem['error']}")
                continue
            serve, fork = mem["serve"], mem["fork_server"]
            print(f"{label:<28} | {_mib(serve.get('rss_kib')):>7} [{_mib(serve.get('pss_kib')):>6}] | "
                  f"{_mib(fork.get('rss_kib')):>7} [{_mib(fork.get('pss_kib')):>6}] | "
                  f"{_mib(mem['sum_rss_kib']):>7} [{_mib(mem['sum_pss_kib']):>6}] | "
                  f"{fmt(serve.get('threads'), 'd'):>7} | {mem['sandbox_processes']}: RSS {_mib(mem['sandbox_rss_kib'])}, "
                  f"PSS {_mib(mem['sandbox_pss_kib'])}")
    if many:
        create, close = many["create"], many["close"]
        print(f"while filling to {many['count']} sessions: CreateSession median {fmt(create.get('median_ms'), '.2f')} ms, "
              f"p95 {fmt(create.get('p95_ms'), '.2f')} ms; CloseSession median {fmt(close.get('median_ms'), '.2f')} ms, "
              f"p95 {fmt(close.get('p95_ms'), '.2f')} ms")
        for name, part in (("CreateSession (filling)", create), ("CloseSession (emptying)", close)):
            if part["failures"]:
                print(f"FAILURES {name}: {part['failures']}, first: {part['first_error']}")
    if report["pid"] is None:
        print(f"daemon never started; daemon section {report['elapsed_s']:.1f} s")
    else:
        stop = "killed (SIGKILL)" if report["killed"] else f"exit status {report['exit_code']}"
        print(f"daemon stopped with SIGTERM in {fmt(report['stop_s'], '.2f')} s: {stop}; "
              f"daemon section {report['elapsed_s']:.1f} s")
    for why in report["watchdog_fired"]:
        print(f"DAEMON FAILURE watchdog killed the daemon: {why}")
    if report["exit_code"] != 0 and not report["errors"]:
        print(f"DAEMON FAILURE exit status {report['exit_code']}; log tail: {report['log_tail']}")
    if report["sessions_left_unclosed"]:
        print(f"DAEMON FAILURE {report['sessions_left_unclosed']} sessions could not be closed: "
              f"{report['unclosed_error']}")
    if report["survivors"]:
        print(f"DAEMON FAILURE daemon descendants alive after the stop: {report['survivors']}")
    if report["socket_left_behind"]:
        print("DAEMON FAILURE the daemon left its socket behind")
    if report["log_problems"]:
        print(f"daemon log: {len(report['log_problems'])} lines at warning or worse (or not JSON); first ones:")
        for line in report["log_problems"][:5]:
            print(f"  {line[:300]}")
    return targets


# --------------------------------------------------------------------------- main

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=200, help="measured rounds (default 200)")
    p.add_argument("--warmup", type=int, default=WARMUP_ROUNDS, help=f"warm-up rounds (default {WARMUP_ROUNDS})")
    p.add_argument("--python-runs", type=int, default=30, help="samples of `python -c pass` (default 30)")
    p.add_argument("--json", metavar="FILE", help="also write all numbers as JSON to FILE")
    p.add_argument("--no-daemon", action="store_true", help="skip the daemon section")
    p.add_argument("--daemon-runs", type=int, default=None,
                   help="measured rounds of warm Exec / CreateSession+CloseSession / bwrap (default: --runs)")
    p.add_argument("--clients", type=int, default=8, help="concurrent clients (default 8)")
    p.add_argument("--churners", type=int, default=0,
                   help="more clients that create and close sessions while the concurrent clients run (default 0)")
    p.add_argument("--concurrency-seconds", type=float, default=5.0,
                   help="how long the concurrent clients run (default 5)")
    p.add_argument("--throughput-runs", type=int, default=2, help="runs of the 1 GiB stdout command (default 2)")
    p.add_argument("--sessions", type=int, default=100, help="sessions open for the memory figure (default 100)")
    p.add_argument("--no-store", action="store_true", help="skip the event store section")
    p.add_argument("--no-network", action="store_true", help="skip the network section")
    p.add_argument("--network-runs", type=int, default=30, help="sessions opened per network mode (default 30)")
    p.add_argument("--requests", type=int, default=300, help="HTTP requests per network mode (default 300)")
    p.add_argument("--store-sessions", type=int, default=1000,
                   help="sessions in the large event store (default 1000; x --store-events = 1,000,000 events)")
    p.add_argument("--store-events", type=int, default=1000, help="events per session there (default 1000)")
    p.add_argument("--soak", type=float, metavar="SECONDS", nargs="?", const=600.0, default=None,
                   help="run only the soak benchmark (tests/bench_soak.py) for SECONDS (default 600 when given "
                        "without a value)")
    p.add_argument("--soak-clients", type=int, default=20, help="soak: concurrent clients (default 20)")
    p.add_argument("--soak-interval", type=float, default=5.0, help="soak: seconds between samples (default 5)")
    p.add_argument("--breakdown", type=int, metavar="CALLS", nargs="?", const=1000, default=None,
                   help="run only the CPU breakdown of a warm Exec (tests/bench_breakdown.py) over CALLS calls "
                        "(default 1000 when given without a value)")
    p.add_argument("--breakdown-blocks", type=int, default=4,
                   help="breakdown: blocks the calls are split into, each followed by bare and bwrap (default 4)")
    p.add_argument("--breakdown-profile-calls", type=int, default=500,
                   help="breakdown: Execs run under py-spy, if it is installed (default 500; 0: no profile)")
    p.add_argument("--breakdown-cli-runs", type=int, default=20,
                   help="breakdown: rounds of `sandboxd run -- true` in this checkout vs an empty workspace "
                        "(default 20)")
    p.add_argument("--fuzz", type=int, metavar="EXAMPLES", default=0,
                   help="instead of timing: the RPC fuzz test (tests/test_fuzz_rpcs.py) with EXAMPLES requests per "
                        "RPC and batch, 5 batches (CI runs 40 x 2)")
    args = p.parse_args(argv)
    if args.daemon_runs is None:
        args.daemon_runs = args.runs
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.soak is not None:
        return soak_main(args)
    if args.breakdown is not None:
        return breakdown_main(args)
    if args.fuzz:
        env = {**os.environ, "SANDBOXD_FUZZ_EXAMPLES": str(args.fuzz), "SANDBOXD_FUZZ_BATCHES": "5"}
        return subprocess.call([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
                                str(Path(__file__).with_name("test_fuzz_rpcs.py"))], env=env)
    if not os.path.exists(BWRAP):
        sys.stderr.write(f"benchmark: {BWRAP} is missing\n")
        return 2
    compiled = compile_sources()                   # before anything starts an interpreter that imports sandboxd
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
        if compiled["exit_code"] != 0:
            print(f"WARNING: compileall exited with {compiled['exit_code']}: {compiled['output']}")
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
    sys.stdout.flush()

    daemon: dict[str, Any] | None = None
    if not args.no_daemon:
        bwrap_row = next(row for row in rows if row["name"] == "bwrap one-shot")
        daemon = run_daemon_section(args, bwrap_row["median_ms"])
        leftovers_end = leftover_children()
        if leftovers_end:
            print(f"WARNING: children still present after the daemon section: {leftovers_end}")
        daemon["leftover_children"] = leftovers_end
        print(f"daemon section: {daemon['failures']} failures in all")
    store: dict[str, Any] | None = None
    if not args.no_store:
        from bench_store import run_store_section

        print()
        warm_rows = (daemon or {}).get("rounds", {}).get("variants", []) if daemon else []
        store = run_store_section(exec_median_ms=warm_rows[1]["median_ms"] if len(warm_rows) > 1 else None,
                                  runs=min(args.runs, 100), sessions=args.store_sessions,
                                  per_session=args.store_events, sandboxd=str(venv_bin() / "sandboxd"))
    network: dict[str, Any] | None = None
    if not args.no_network:
        from bench_network import run_network_section

        print()
        network = run_network_section(runs=args.network_runs, requests=args.requests,
                                      sandboxd=str(venv_bin() / "sandboxd"))
    machine["loadavg_end"] = list(os.getloadavg())
    total = time.monotonic() - started
    daemon_part = "" if daemon is None else f" + {daemon['elapsed_s']:.1f} s daemon"
    print(f"elapsed {elapsed:.1f} s main table{daemon_part} = {total:.1f} s; loadavg at end "
          f"{' '.join(f'{x:.2f}' for x in machine['loadavg_end'])}")

    if args.json:
        report = {"machine": machine, "runs": args.runs, "warmup": args.warmup, "seed": SHUFFLE_SEED,
                  "elapsed_s": elapsed, "total_elapsed_s": total, "leftover_children": leftovers,
                  "variants": rows, "targets": targets, "import_cost": imports,
                  "python_pass_median_ms": pass_median, "compileall": compiled, "daemon": daemon,
                  "event_store": store, "network": network}
        if daemon is not None:
            report["targets"].update(daemon["targets"])
        if store is not None:
            report["targets"].update(store["targets"])
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(report, handle, indent=2)
    failed = any(row["failures"] for row in rows) or (daemon is not None and daemon["failures"] > 0)
    return 1 if failed else 0


def soak_main(args: argparse.Namespace) -> int:
    """``--soak``: the soak benchmark alone (bench_soak.py); 1 if any call failed or the daemon left something."""
    from bench_soak import run_soak

    machine = machine_info()
    print(f"sandboxd soak benchmark  {machine['date']}")
    print(f"machine: nproc={machine['nproc']}  cpu={machine['cpu_model']}  kernel={machine['kernel']}  "
          f"loadavg={' '.join(f'{x:.2f}' for x in machine['loadavg_start'])}")
    report = run_soak(args.soak, clients=args.soak_clients, interval=args.soak_interval)
    machine["loadavg_end"] = list(os.getloadavg())
    print(f"loadavg at end {' '.join(f'{x:.2f}' for x in machine['loadavg_end'])}; soak: {report['failures']} failures")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"machine": machine, "soak": report}, handle, indent=2)
    return 1 if report["failures"] else 0


def breakdown_main(args: argparse.Namespace) -> int:
    """``--breakdown``: where a warm Exec's CPU goes (bench_breakdown.py); 1 if anything failed."""
    from bench_breakdown import print_breakdown, run_breakdown

    compile_sources()
    machine = machine_info()
    print(f"sandboxd warm Exec CPU breakdown  {machine['date']}")
    print(f"machine: nproc={machine['nproc']}  cpu={machine['cpu_model']}  kernel={machine['kernel']}  "
          f"loadavg={' '.join(f'{x:.2f}' for x in machine['loadavg_start'])}")
    sys.stdout.flush()
    report = run_breakdown(args.breakdown, args.breakdown_blocks, args.breakdown_profile_calls,
                           args.breakdown_cli_runs)
    print_breakdown(report)
    machine["loadavg_end"] = list(os.getloadavg())
    print(f"loadavg at end {' '.join(f'{x:.2f}' for x in machine['loadavg_end'])}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"machine": machine, "breakdown": report}, handle, indent=2)
    failed = report["errors"] or report["survivors"] or any(
        row["failures"] for row in (report.get("cli") or {}).get("rows", []))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
