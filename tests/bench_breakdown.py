"""Where a warm Exec's CPU goes (``tests/benchmark.py --breakdown [CALLS]``, issue 18 item 1).

Not a test: it prints numbers. One ``sandboxd serve`` (benchmark.DaemonProcess), one session,
``CALLS`` (1,000) warm ``Exec true`` calls from this process through ``SandboxClient.exec``, in
``--breakdown-blocks`` (4) blocks interleaved with as many bare ``posix_spawn`` + ``waitpid`` of
``/bin/true`` and one-shot bwrap calls (the same-run baselines), so that the noise of a shared
machine hits all three alike. Over each block it takes CPU time (utime + stime, clock ticks) from:

* the daemon, ``/proc/<serve>/task/<tid>/stat`` per thread, each thread named by ``py-spy dump``
  (Python's threads have no kernel name on 3.11): the front door's relay thread
  (``sandboxd-frontdoor``), grpc's worker pool (``sandboxd-rpc_N``, the servicer runs there),
  grpc's Python poll thread (``Thread-N (_serve)``), grpc's C-core threads (no Python: kernel names
  such as ``grpc_global_tim``, ``event_engine``), the main thread and any other; the process total
  from ``/proc/<serve>/stat``: threads that ended in between (the per-call stdin feeders of
  exec_call.py, one per Exec) show only there, as the rest;
* the fork server, ``/proc/<fork server>/stat`` utime + stime (its own work);
* the call helpers (``sandboxd-call``, one per call, short-lived) and the commands together: the
  fork server's ``cutime + cstime`` (the helper is its child and is reaped by it; the command is
  the helper's child and is reaped by the helper, so its time is in there too); the command alone
  is the sum of ``ExecResult.cpu_seconds`` (the helper's ``wait4`` rusage of the command), and the
  helper is the difference;
* the session's other processes (its init, descendants of the fork server that stay alive);
* the client: this process (``os.times()``, every thread: the calling thread and grpc's);
* the whole machine: ``/proc/stat`` busy time (everything, other users' work included; what is
  left after the parties above is kernel work no process is charged for, such as namespace
  teardown in kworkers, plus whatever else ran).

The baselines are charged the same way: their CPU is this process's children time (bare: just
``/bin/true``; bwrap: bwrap and everything below it) plus this process's own time.

With py-spy on PATH or in the venv (``.venv/bin/pip install py-spy``), a second loop of
``--breakdown-profile-calls`` (500) Execs runs under ``py-spy record --native --threads`` of the
daemon and of the fork server (separately; the sampling slows both, so it is not in the timed
blocks) and the top frames by self time are printed, per process and per daemon thread (the raw
stacks stay in /var/tmp/sandboxd-bench-breakdown-*/; everything else there is removed). py-spy
counts blocked threads as active here, so each sample is sorted by its innermost native frames
(``sample_kind``): waiting (a lock, a poll), in a read (a wait or a copy: counted apart) or running;
only the running ones are ranked. ``perf`` would give the kernel's side too, but records no samples
on this machine (its kernel offers no perf events to it).

Last, ``sandboxd run --sandbox workspace-write -- true`` with this checkout (``.venv`` included)
as the workspace against an empty one, interleaved with bwrap, ``--breakdown-cli-runs`` (20) times.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections import Counter, defaultdict
from typing import Any

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
FRONT_DOOR_THREAD = "sandboxd-frontdoor"
RPC_THREAD_PREFIX = "sandboxd-rpc"
STDIN_THREAD_PREFIX = "sandboxd-stdin-"    # exec_call.py starts one per Exec; it ends with the call
PROFILE_RATE_HZ = 250
TOP_FRAMES = 12


# --------------------------------------------------------------------------- /proc readers

def _stat_fields(path: str) -> list[str] | None:
    """The fields of a /proc stat file after the command name (field 3 of proc(5) is [0])."""
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def cpu_ticks(path: str) -> tuple[int, int] | None:
    """(utime + stime, cutime + cstime) of /proc/<pid>/stat or /proc/<pid>/task/<tid>/stat."""
    fields = _stat_fields(path)
    if fields is None:
        return None
    return int(fields[11]) + int(fields[12]), int(fields[13]) + int(fields[14])


def comm(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read().strip()
    except OSError:
        return "?"


def thread_ticks(pid: int) -> dict[int, int]:
    """{tid: utime + stime} of every thread of ``pid`` now."""
    out: dict[int, int] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        ticks = cpu_ticks(f"/proc/{pid}/task/{tid}/stat")
        if ticks is not None:
            out[int(tid)] = ticks[0]
    return out


def machine_busy_ticks() -> int:
    """Busy clock ticks of all CPUs (/proc/stat ``cpu`` line without idle and iowait)."""
    with open("/proc/stat", encoding="utf-8") as handle:
        values = [int(v) for v in handle.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = values[:8]
    return user + nice + system + irq + softirq + steal


class Snapshot:
    """CPU counters of every party at one moment."""

    def __init__(self, serve: int, fork_server: int) -> None:
        self.taken = time.perf_counter()
        self.machine = machine_busy_ticks()
        times = os.times()
        self.self_s = times.user + times.system
        self.children_s = times.children_user + times.children_system
        self.serve = cpu_ticks(f"/proc/{serve}/stat") or (0, 0)
        self.threads = thread_ticks(serve)
        self.fork = cpu_ticks(f"/proc/{fork_server}/stat") or (0, 0)
        from benchmark import descendants

        self.session_processes = {pid: (cpu_ticks(f"/proc/{pid}/stat") or (0, 0))[0]
                                  for pid in descendants(fork_server)}


# --------------------------------------------------------------------------- thread names

def python_thread_names(pid: int, py_spy: str | None) -> dict[int, str]:
    """{native tid: Python thread name} from ``py-spy dump`` (empty without py-spy)."""
    if py_spy is None:
        return {}
    done = subprocess.run([py_spy, "dump", "--pid", str(pid)], stdin=subprocess.DEVNULL, capture_output=True,
                          timeout=60, check=False)
    names: dict[int, str] = {}
    for line in done.stdout.decode(errors="replace").splitlines():
        # Thread 13626 (active+gil): "spinner"
        if line.startswith("Thread ") and '"' in line:
            head, _, name = line.partition('"')
            tid = head.split()[1]
            if tid.isdigit():
                names[int(tid)] = name.rstrip('"')
    return names


def thread_group(pid: int, tid: int, python_names: dict[int, str]) -> str:
    """Which part of the daemon a thread is."""
    if tid == pid:
        return "daemon: main thread"
    name = python_names.get(tid)
    if name == FRONT_DOOR_THREAD:
        return "daemon: front door relay thread"
    if name is not None and name.startswith(RPC_THREAD_PREFIX):
        return "daemon: grpc worker pool (servicer)"
    if name is not None and name.endswith("(_serve)"):
        return "daemon: grpc server poll thread (Python)"    # grpc/_server.py's completion-queue loop
    if name is not None and name.startswith(STDIN_THREAD_PREFIX):
        return "daemon: per-call stdin feeder threads"
    if name is not None:
        return "daemon: other Python threads"
    # py-spy names every thread that runs Python; the rest are grpc's C-core threads.
    return "daemon: grpc C-core threads" if python_names else "daemon: threads other than main (no py-spy)"


# --------------------------------------------------------------------------- the loops

class Tally:
    """Per-party CPU seconds and wall seconds, summed over blocks."""

    def __init__(self) -> None:
        self.cpu_s: defaultdict[str, float] = defaultdict(float)
        self.wall_s = 0.0
        self.calls = 0
        self.block_ms: list[float] = []       # wall per call of each block

    def add_block(self, wall_s: float, calls: int) -> None:
        self.wall_s += wall_s
        self.calls += calls
        self.block_ms.append(wall_s / calls * 1e3)


def exec_block(client: Any, session_id: str, calls: int, serve: int, fork_server: int,
               python_names: dict[int, str], tally: Tally) -> None:
    """``calls`` warm ``Exec true``; charge every party's CPU delta to ``tally``."""
    command_s = 0.0
    before = Snapshot(serve, fork_server)
    for _ in range(calls):
        outcome = client.exec(session_id, ["true"])
        if outcome.result.shell_status != 0 or outcome.result.wall_seconds <= 0:
            raise RuntimeError(f"Exec true failed: {outcome.result}")
        command_s += outcome.result.cpu_seconds
    after = Snapshot(serve, fork_server)
    tally.add_block(after.taken - before.taken, calls)
    per_thread = 0
    for tid, ticks in after.threads.items():
        delta = ticks - before.threads.get(tid, 0)
        per_thread += delta
        tally.cpu_s[thread_group(serve, tid, python_names)] += delta * TICK_S
    serve_total = after.serve[0] - before.serve[0]
    # Mostly the per-call stdin feeders: each ends with its call, so its time is only in the total.
    tally.cpu_s["daemon: threads that ended during the block"] += max(0, serve_total - per_thread) * TICK_S
    tally.cpu_s["fork server (Python loop)"] += (after.fork[0] - before.fork[0]) * TICK_S
    helpers_and_commands = (after.fork[1] - before.fork[1]) * TICK_S
    tally.cpu_s["sandboxd-call helpers"] += helpers_and_commands - command_s
    tally.cpu_s["the command (true)"] += command_s
    tally.cpu_s["session init and other session processes"] += sum(
        ticks - before.session_processes.get(pid, 0) for pid, ticks in after.session_processes.items()) * TICK_S
    tally.cpu_s["client (this process, all threads)"] += after.self_s - before.self_s
    tally.cpu_s["(machine busy, all CPUs)"] += (after.machine - before.machine) * TICK_S


def baseline_block(argv: list[str], calls: int, devnull: int, tally: Tally) -> None:
    """``calls`` spawn + wait of ``argv``; children's CPU and this process's own CPU."""
    from benchmark import spawn_and_wait

    before_times, before_machine, started = os.times(), machine_busy_ticks(), time.perf_counter()
    for _ in range(calls):
        spawn_and_wait(argv, devnull)
    wall, after_times, after_machine = time.perf_counter() - started, os.times(), machine_busy_ticks()
    tally.add_block(wall, calls)
    tally.cpu_s["children (the spawned tree)"] += (after_times.children_user + after_times.children_system
                                                   - before_times.children_user - before_times.children_system)
    tally.cpu_s["parent (this process)"] += (after_times.user + after_times.system
                                             - before_times.user - before_times.system)
    tally.cpu_s["(machine busy, all CPUs)"] += (after_machine - before_machine) * TICK_S


# --------------------------------------------------------------------------- the profile

def find_py_spy() -> str | None:
    from benchmark import venv_bin

    candidate = venv_bin() / "py-spy"
    return str(candidate) if candidate.exists() else shutil.which("py-spy")


def profile(py_spy: str, client: Any, session_id: str, calls: int, targets: dict[str, int],
            out_dir: str) -> dict[str, Any]:
    """``calls`` Execs with ``py-spy record`` attached to each target; the raw stack files and their summary."""
    recorders: dict[str, tuple[subprocess.Popen[bytes], str]] = {}
    for label, pid in targets.items():
        out = os.path.join(out_dir, f"{label}.raw")
        proc = subprocess.Popen([py_spy, "record", "--native", "--threads", "--format", "raw", "--rate",
                                 str(PROFILE_RATE_HZ), "-o", out, "--pid", str(pid)],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        recorders[label] = (proc, out)
    time.sleep(1.0)                                 # let both attach before the loop
    started = time.perf_counter()
    for _ in range(calls):
        client.exec(session_id, ["true"])
    wall = time.perf_counter() - started
    summaries: dict[str, Any] = {"calls": calls, "wall_s": wall, "rate_hz": PROFILE_RATE_HZ}
    for label, (proc, out) in recorders.items():
        proc.send_signal(signal.SIGINT)             # py-spy writes its file on Ctrl-C
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        summaries[label] = summarize_raw(out) if os.path.exists(out) else {
            "error": err.decode(errors="replace").strip()[-500:]}
        summaries[label]["file"] = out
    return summaries


# py-spy 0.4 under --native counts most blocked threads as active here (its idle check races its
# own pause), so the summary sorts each sample by its innermost native frames: waiting in one of
# these is not CPU time.
WAITING_FRAMES = ("PyThread_acquire_lock_timed", "pthread_cond_wait", "pthread_cond_timedwait", "epoll_wait",
                  "epoll_pwait", "poll", "ppoll", "select", "clock_nanosleep", "nanosleep", "sigwaitinfo",
                  "sigtimedwait", "accept", "accept4", "waitpid", "wait4", "waitid", "pause")
# A read of a blocking descriptor is a wait when nothing has arrived yet, a copy when it has.
READ_FRAMES = ("recvmsg", "recv", "recvfrom", "read")


def sample_kind(frames: list[str]) -> str:
    """``waiting``, ``reading`` (a read that may be a wait) or ``running``, by the innermost frames."""
    names = [frame.partition(" (")[0] for frame in frames[-3:]]
    if any(name in WAITING_FRAMES for name in names):
        return "waiting"
    if names[-1] in READ_FRAMES:
        return "reading"
    return "running"


def summarize_raw(path: str) -> dict[str, Any]:
    """Samples per thread and kind; the top frames by self time of the running samples, overall and
    per thread, and the innermost Python frame of each running sample."""
    kinds: Counter[str] = Counter()
    running_by_thread: Counter[str] = Counter()
    self_frames: Counter[str] = Counter()
    self_by_thread: dict[str, Counter[str]] = defaultdict(Counter)
    python_self: Counter[str] = Counter()
    reading: Counter[str] = Counter()
    with open(path, encoding="utf-8", errors="replace") as handle:
        for line in handle:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not count.isdigit():
                continue
            n, frames = int(count), stack.split(";")
            kind = sample_kind(frames)
            kinds[kind] += n
            python_leaf = next((f for f in reversed(frames[1:]) if ".py:" in f), None)
            python_name = _short(python_leaf) if python_leaf else "(no Python frame)"
            if kind == "reading":
                reading[python_name] += n
            if kind != "running":
                continue
            thread, leaf = _thread_label(frames[0]), _leaf(frames)
            running_by_thread[thread] += n
            self_frames[leaf] += n
            self_by_thread[thread][leaf] += n
            python_self[python_name] += n
    return {"samples": sum(kinds.values()), "kinds": dict(kinds), "running_by_thread": running_by_thread.most_common(),
            "top_self": self_frames.most_common(TOP_FRAMES), "top_python": python_self.most_common(TOP_FRAMES),
            "reading_in": reading.most_common(5),
            "top_self_by_thread": {thread: frames.most_common(6) for thread, frames in self_by_thread.items()}}


def _thread_label(frame: str) -> str:
    """``thread (123): sandboxd-rpc_3`` -> ``sandboxd-rpc`` (the pool's threads together)."""
    name = frame.split(": ", 1)[1] if ": " in frame else frame
    return RPC_THREAD_PREFIX if name.startswith(RPC_THREAD_PREFIX) else name


def _leaf(frames: list[str]) -> str:
    """The innermost frame; an unsymbolized one (stripped libc) named by its nearest named caller."""
    leaf = _short(frames[-1])
    if not leaf.startswith("? "):
        return leaf
    caller = next((f for f in reversed(frames[1:-1]) if not f.startswith("0x")), None)
    return f"{leaf} in {_short(caller)}" if caller else leaf


def _short(frame: str) -> str:
    """Drop the address of unsymbolized native frames and the directories of files."""
    name, _, where = frame.partition(" (")
    where = where.rstrip(")")
    if name.startswith("0x"):
        return f"? ({where})"
    return f"{name} ({os.path.basename(where)})" if where else name


# --------------------------------------------------------------------------- one-shot CLI

def cli_workspaces(runs: int, devnull: int, empty: str) -> dict[str, Any]:
    """``sandboxd run -- true`` in this checkout vs an empty workspace, interleaved with bwrap."""
    from benchmark import BWRAP_ARGV, ROOT, Variant, spawn_and_wait, summarize, venv_bin

    cli = str(venv_bin() / "sandboxd")
    variants = [
        Variant("bwrap one-shot", lambda: spawn_and_wait(BWRAP_ARGV, devnull)),
        Variant("sandboxd run -- true, empty workspace",
                lambda: spawn_and_wait([cli, "run", "--sandbox", "workspace-write", "--workspace", empty,
                                        "--", "true"], devnull)),
        Variant(f"sandboxd run -- true, workspace {ROOT}",
                lambda: spawn_and_wait([cli, "run", "--sandbox", "workspace-write", "--workspace", str(ROOT),
                                        "--", "true"], devnull)),
    ]
    for round_no in range(runs + 1):                # round 0 warms up
        for variant in variants:
            variant.measure(record=round_no > 0)
    directories = sum(len(dirs) for _, dirs, _ in os.walk(ROOT))
    return {"runs": runs, "checkout_directories": directories,
            "rows": [{"name": v.name, **(summarize(v.samples_ms) or {}), "failures": v.failures,
                      "first_error": v.first_error} for v in variants]}


# --------------------------------------------------------------------------- the section

def run_breakdown(calls: int, blocks: int, profile_calls: int, cli_runs: int) -> dict[str, Any]:
    """Start a daemon, run the blocks, the profile and the CLI comparison; stop it; return everything."""
    from benchmark import BWRAP_ARGV, DaemonProcess, Watchdog, error_text, still_alive
    from sandboxd.client import SandboxClient

    base = tempfile.mkdtemp(prefix="sandboxd-bench-breakdown-", dir="/var/tmp")
    os.chmod(base, 0o755)
    workspace = os.path.join(base, "ws")
    os.mkdir(workspace)
    daemon = DaemonProcess(base)
    devnull = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    py_spy = find_py_spy()
    report: dict[str, Any] = {"calls": calls, "blocks": blocks, "py_spy": py_spy, "errors": []}
    exec_tally, bare_tally, bwrap_tally = Tally(), Tally(), Tally()
    try:
        report["ready_s"] = daemon.start()
        fork_server = daemon.fork_server_pid()
        if fork_server is None:
            raise RuntimeError("no fork server under the daemon")
        report["pids"] = {"serve": daemon.pid, "fork_server": fork_server}
        with SandboxClient(daemon.socket) as client, Watchdog(daemon, "breakdown", 1800):
            session_id = client.create_session(workspace, approval="never").id
            try:
                for _ in range(20):                 # warm: the grpc pool's threads exist, caches are hot
                    client.exec(session_id, ["true"])
                names = python_thread_names(daemon.pid, py_spy)
                report["daemon_threads"] = {str(tid): [thread_group(daemon.pid, tid, names), names.get(tid),
                                                       comm(f"/proc/{daemon.pid}/task/{tid}/comm")]
                                            for tid in sorted(thread_ticks(daemon.pid))}
                per_block = max(1, calls // blocks)
                for _ in range(blocks):
                    exec_block(client, session_id, per_block, daemon.pid, fork_server, names, exec_tally)
                    baseline_block(["/bin/true"], per_block, devnull, bare_tally)
                    baseline_block(BWRAP_ARGV, per_block, devnull, bwrap_tally)
                if py_spy is not None and profile_calls > 0:
                    report["profile"] = profile(py_spy, client, session_id, profile_calls,
                                                {"daemon": daemon.pid, "fork_server": fork_server}, base)
            finally:
                client.close_session(session_id)
        report["cli"] = cli_workspaces(cli_runs, devnull, workspace)
    except Exception as exc:  # noqa: BLE001 - reported; the daemon is still stopped
        report["errors"].append(error_text(exc))
    finally:
        daemon.stop()
        os.close(devnull)
        report["survivors"] = still_alive(daemon.seen)
        report["daemon_exit_code"] = daemon.exit_code
        report["log_problems"] = daemon.log_problems()[:5]
        report["profile_dir"] = base if "profile" in report else None
        _keep_only_profiles(base)
    report["exec"] = _tally_report(exec_tally)
    report["bare"] = _tally_report(bare_tally)
    report["bwrap"] = _tally_report(bwrap_tally)
    return report


def _keep_only_profiles(base: str) -> None:
    """Remove the daemon's state, socket directory and workspace; keep the py-spy files (if any) for the reader."""
    kept = False
    for entry in os.listdir(base):
        path = os.path.join(base, entry)
        if entry.endswith(".raw"):
            kept = True
        elif os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.unlink(path)
    if not kept:
        os.rmdir(base)


def _tally_report(tally: Tally) -> dict[str, Any]:
    calls = max(1, tally.calls)
    return {"calls": tally.calls, "wall_ms_per_call": tally.wall_s / calls * 1e3,
            "block_wall_ms": tally.block_ms,
            "cpu_ms_per_call": {party: seconds / calls * 1e3 for party, seconds in tally.cpu_s.items()}}


# --------------------------------------------------------------------------- printing

def print_breakdown(report: dict[str, Any]) -> None:
    for error in report["errors"]:
        print(f"BREAKDOWN FAILURE {error}")
    exec_part, bare, bwrap = report["exec"], report["bare"], report["bwrap"]
    if not exec_part["calls"]:
        return
    print(f"CPU breakdown of a warm `Exec true`: {exec_part['calls']} calls in {report['blocks']} blocks, "
          f"interleaved with as many bare spawn+wait and one-shot bwrap calls (ms per call)")
    parties = exec_part["cpu_ms_per_call"]
    rows = sorted(((p, ms) for p, ms in parties.items() if not p.startswith("(")), key=lambda item: -item[1])
    attributed = sum(ms for _, ms in rows)
    wall = exec_part["wall_ms_per_call"]
    width = max(len(p) for p, _ in rows) + 2
    print(f"{'party':<{width}} | {'CPU ms':>7} | {'share':>6}")
    print("-" * (width + 20))
    for party, ms in rows:
        print(f"{party:<{width}} | {ms:7.3f} | {ms / attributed * 100 if attributed else 0:5.1f}%")
    machine = parties.get("(machine busy, all CPUs)", 0.0)
    print(f"{'sum of the parties':<{width}} | {attributed:7.3f} |")
    print(f"{'wall time per call':<{width}} | {wall:7.3f} | (blocks: "
          f"{', '.join(f'{ms:.2f}' for ms in exec_part['block_wall_ms'])})")
    print(f"{'machine busy per call':<{width}} | {machine:7.3f} | (all CPUs, other users included; "
          f"{machine - attributed:+.3f} ms not charged to these parties)")
    for label, part in (("bare posix_spawn+waitpid /bin/true", bare), ("bwrap one-shot", bwrap)):
        cpu = part["cpu_ms_per_call"]
        own = cpu.get("children (the spawned tree)", 0.0) + cpu.get("parent (this process)", 0.0)
        print(f"{label}: wall {part['wall_ms_per_call']:.3f} ms, CPU {own:.3f} ms "
              f"(children {cpu.get('children (the spawned tree)', 0.0):.3f} + parent "
              f"{cpu.get('parent (this process)', 0.0):.3f}), machine busy {cpu.get('(machine busy, all CPUs)', 0):.3f}"
              f" ms; blocks {', '.join(f'{ms:.2f}' for ms in part['block_wall_ms'])}")
        if part["wall_ms_per_call"] and own:
            print(f"  warm Exec / {label}: wall {wall / part['wall_ms_per_call']:.2f}x, CPU {attributed / own:.2f}x")
    threads = report.get("daemon_threads") or {}
    if threads:
        groups = Counter(group for group, _, _ in threads.values())
        print("daemon threads: " + ", ".join(f"{group.removeprefix('daemon: ')} x{n}" for group, n in groups.items()))
    prof = report.get("profile")
    if prof:
        print(f"py-spy record --native --threads --rate {prof['rate_hz']}: {prof['calls']} Execs in "
              f"{prof['wall_s']:.2f} s (slowed by the sampling); raw stacks in {report['profile_dir']}")
        for label in ("daemon", "fork_server"):
            part = prof.get(label) or {}
            if "error" in part:
                print(f"  {label}: py-spy failed: {part['error']}")
                continue
            kinds, running = part.get("kinds", {}), part.get("kinds", {}).get("running", 0) or 1
            print(f"  {label}: {part.get('samples')} samples: {kinds.get('running', 0)} running, "
                  f"{kinds.get('waiting', 0)} waiting, {kinds.get('reading', 0)} in a read (waiting or copying: "
                  + ", ".join(f"{frame} {n}" for frame, n in part.get("reading_in", [])[:3]) + ")")
            print("    running samples by thread: " + ", ".join(
                f"{name} {n / running * 100:.0f}%" for name, n in part.get("running_by_thread", [])[:6]))
            print("    top frames by self time (running): " + "; ".join(
                f"{frame} {n / running * 100:.1f}%" for frame, n in part.get("top_self", [])[:TOP_FRAMES]))
            print("    innermost Python frame (running): " + "; ".join(
                f"{frame} {n / running * 100:.1f}%" for frame, n in part.get("top_python", [])[:TOP_FRAMES]))
            for thread, frames in sorted(part.get("top_self_by_thread", {}).items()):
                print(f"    {thread}: " + "; ".join(f"{frame} {n}" for frame, n in frames))
    cli = report.get("cli")
    if cli:
        rows_cli = cli["rows"]
        bwrap_median = rows_cli[0].get("median_ms")
        print(f"one-shot CLI, {cli['runs']} interleaved rounds (this checkout has {cli['checkout_directories']} "
              f"directories, .venv included):")
        for row in rows_cli:
            median = row.get("median_ms")
            ratio = f"{median / bwrap_median:.1f}x bwrap" if median and bwrap_median else "n/a"
            print(f"  {row['name']}: median {median if median is None else round(median, 2)} ms, p95 "
                  f"{row.get('p95_ms') if row.get('p95_ms') is None else round(row['p95_ms'], 2)} ms, {ratio}"
                  f"{'' if not row['failures'] else '; FAILURES %d: %s' % (row['failures'], row['first_error'])}")
    if report["survivors"]:
        print(f"BREAKDOWN FAILURE daemon descendants alive after the stop: {report['survivors']}")
    for line in report["log_problems"]:
        print(f"daemon log: {line[:300]}")

