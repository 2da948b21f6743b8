"""What starting a session call costs, by mechanism (issue 18 item 2: who should start a call).

Not a test: it prints numbers. Run as root from a checkout with the helper built:

    .venv/bin/python tests/bench_call_start.py [CALLS] [BLOCKS]     # the mechanisms, end to end
    .venv/bin/python tests/bench_call_start.py --pieces [N]          # the pieces (bench_call_start.c)
    .venv/bin/python tests/bench_call_start.py --running 0,100,400 [CALLS]   # the fork server's loop
                                                                     # while that many calls run
    .venv/bin/python tests/bench_call_start.py --loop-turn [RUNNING]  # one turn of it, piece by piece

It opens one session with the daemon's default kind of limits (a pids and a memory limit, so the
session has a cgroup, as every daemon session does) through ``Spawner`` in this process, as
`sandboxd run` does, and runs ``true`` in it ``CALLS`` times per mechanism, in ``BLOCKS``
interleaved blocks (the machine is shared: noise hits every mechanism alike):

A  today's path: ``Spawner.launch_call`` (the fork server's Python: pipes, the env memfd, the
   posix_spawn of sandboxd-call into the session's PID namespace, the OOM-kill reads, the
   SandboxProcess) + ``wait``. The helper joins the session's cgroup, setns()es into its
   namespaces, drops privileges and forks the command.
E  A's spawn alone, as a plain function (no SandboxProcess, no OOM-kill reads)
F  E without the helper's cgroup join (its cgroup migration)
G  F without the helper's setns (it joins the session's uts namespace only)
B  the option "the session's init starts the call", approximated: a process that already is in the
   session's mount/net/ipc/uts/cgroup namespaces and its cgroup (as the init is; its children go
   to the session's PID namespace) posix_spawns the same helper with G's arguments
C  an inside process that forks itself (Python ``os.fork`` + ``_exit``, nothing else): the floor
   of an init that starts calls without an exec
R  the option "a per-session resident helper", as a prototype (bench_call_start_resident.c: the
   helper's own code plus a request loop, never used by sandboxd): started once in the session's
   namespaces and cgroup, outside its PID namespace; per call this process sends it the helper's
   argv and descriptors, it forks (no exec, no setns, no cgroup join) and sends back the call's
   pidfd. "children" is the resident helper's CPU with its children's (from /proc)
D  a bare ``posix_spawn`` + ``waitpid`` of /bin/true from this process

Per mechanism: wall time per call, this process's CPU (the "fork server" side) and its children's
(helper and command). Numbers for issue 18 are in docs/perf-notes/18-initcall.md.
"""

from __future__ import annotations

import fcntl
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Callable

from sandboxd.kernel import namespaces
from sandboxd.launcher import native_call, sequence
from sandboxd.launcher.plan import LaunchPlan
from sandboxd.policy import LaunchSpec, Limits, WorkspaceWrite
from sandboxd.supervisor.spawner import SPAWN_DEFAULT_SIGNALS, SessionSandbox, Spawner

ENV = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8"}
LIMITS = Limits(pids=1024, memory_bytes=1 << 30)
NAMES = {"A": "A today: spawner -> helper (setns, cgroup)", "E": "E A's spawn alone (no SandboxProcess/OOM)",
         "F": "F E without the cgroup join", "G": "G F without the setns (uts only)",
         "B": "B helper spawned from inside the session", "C": "C Python fork+_exit from inside",
         "R": "R resident per-session helper forks (no exec)", "D": "D bare posix_spawn /bin/true"}
Sample = tuple[float, float, float]     # wall ms, own CPU ms, children's CPU ms, per call


def _cpu(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def measure(calls: int, one: Callable[[], None]) -> Sample:
    own, children, wall = _cpu(resource.RUSAGE_SELF), _cpu(resource.RUSAGE_CHILDREN), time.perf_counter()
    for _ in range(calls):
        one()
    return ((time.perf_counter() - wall) / calls * 1e3, (_cpu(resource.RUSAGE_SELF) - own) / calls * 1e3,
            (_cpu(resource.RUSAGE_CHILDREN) - children) / calls * 1e3)


def spawn_helper(helper: str, session: SessionSandbox, plan: LaunchPlan, null: int, nsflags: int,
                 cgroup_dirs: list[str], pid_namespace: "namespaces.PidNamespaceForNextChild | None") -> None:
    """One call by the helper, its descriptors laid out as Spawner._spawn_native does, waited for."""
    report_r, report_w = os.pipe2(os.O_CLOEXEC)
    status_r, status_w = os.pipe2(os.O_CLOEXEC)
    program_r, program_w = os.pipe2(os.O_CLOEXEC)
    os.write(program_w, plan.seccomp_program)
    environment = native_call.environment_file(plan.env)
    closing = [report_w, status_w, program_r, program_w, environment]
    sources = [null, null, null, report_w, status_w, session.pidfd,
               session.intake.fileno() if session.intake else None, program_r, environment]
    actions = []
    for target, source in enumerate(sources):
        if source is not None:
            high = fcntl.fcntl(source, fcntl.F_DUPFD_CLOEXEC, 64)
            closing.append(high)
            actions.append((os.POSIX_SPAWN_DUP2, high, target))
    argv = native_call.command_line(helper, plan, namespaces=nsflags, cgroup_dirs=cgroup_dirs)
    if pid_namespace is not None:
        pid_namespace.enter(session.pidfd)
    try:
        pid = os.posix_spawn(helper, argv, {}, file_actions=actions, setsigmask=(), setsigdef=SPAWN_DEFAULT_SIGNALS)
    finally:
        if pid_namespace is not None:
            pid_namespace.leave()
        for fd in closing:
            os.close(fd)
    report = b""
    while more := os.read(report_r, 4096):
        report += more
    os.waitpid(pid, 0)
    status = os.read(status_r, 4096)
    os.close(report_r)
    os.close(status_r)
    if not report.startswith(b"pid") or b"status\x1f0\x1e" not in status:
        raise RuntimeError(f"the call failed: report {report!r}, status {status!r}")


def inside(session: SessionSandbox, helper: str, workspace: str, null: int, per_block: int,
           requests: int, answers: int) -> None:
    """The inside process (B, C): in the session's cgroup and namespaces, its children in its PID
    namespace; runs a block of B or C per request byte and answers with the sample."""
    assert session.cgroup is not None
    for directory in session.cgroup.dirs:                 # before the cgroup namespace hides the host's paths
        with open(os.path.join(directory, "cgroup.procs"), "w") as f:
            f.write("0")
    namespaces.setns(session.pidfd, sequence.CALL_NAMESPACES | namespaces.CLONE_NEWPID)
    os.chdir(workspace)
    plan = session.plan.replace(argv=("true",), env=dict(ENV), cwd=workspace)

    def fork_once() -> None:
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)

    while kind := os.read(requests, 1):
        if kind == b"B":
            sample = measure(per_block, lambda: spawn_helper(helper, session, plan, null, namespaces.CLONE_NEWUTS,
                                                             [], None))
        else:
            sample = measure(per_block, fork_once)
        os.write(answers, repr(sample).encode())


def build_resident(directory: str) -> str:
    """bench_call_start_resident.c, with the generated header of the helper it includes."""
    with open(os.path.join(directory, native_call.HEADER_NAME), "w") as f:
        f.write(native_call.header())
    program = os.path.join(directory, "bench_call_start_resident")
    subprocess.run(["cc", "-O2", "-iquote", directory, f'-DSANDBOXD_CALL_SOURCE="{native_call.SOURCE}"', "-o", program,
                    os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_call_start_resident.c")], check=True)
    return program


class Resident:
    """The running prototype: its control socket and its pid (for its CPU)."""

    def __init__(self, program: str, session: SessionSandbox) -> None:
        import socket

        assert session.cgroup is not None
        self.control, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        actions = [(os.POSIX_SPAWN_DUP2, theirs.fileno(), 3), (os.POSIX_SPAWN_DUP2, session.pidfd, 4)]
        self.pid = os.posix_spawn(program, [program, str(sequence.CALL_NAMESPACES), *session.cgroup.dirs], {},
                                  file_actions=actions, setsigdef=SPAWN_DEFAULT_SIGNALS)
        theirs.close()

    def cpu(self) -> float:
        fields = open(f"/proc/{self.pid}/stat").read().rsplit(")", 1)[1].split()
        return sum(int(value) for value in fields[11:15]) / os.sysconf("SC_CLK_TCK")

    def call(self, session: SessionSandbox, plan: LaunchPlan, helper: str, null: int) -> None:
        import select
        import socket

        report_r, report_w = os.pipe2(os.O_CLOEXEC)
        status_r, status_w = os.pipe2(os.O_CLOEXEC)
        program_r, program_w = os.pipe2(os.O_CLOEXEC)
        os.write(program_w, plan.seccomp_program)
        environment = native_call.environment_file(plan.env)
        assert session.intake is not None
        argv = native_call.command_line(helper, plan, namespaces=namespaces.CLONE_NEWUTS, cgroup_dirs=[])
        socket.send_fds(self.control, [b"\0".join(os.fsencode(arg) for arg in argv)],
                        [null, null, null, report_w, status_w, session.intake.fileno(), program_r, environment])
        for fd in (report_w, status_w, program_r, program_w, environment):
            os.close(fd)
        _, fds, _, _ = socket.recv_fds(self.control, 16, 1)
        pidfd = fds[0]
        report = b""
        while more := os.read(report_r, 4096):
            report += more
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        poller.poll()
        status = os.read(status_r, 4096)
        for fd in (report_r, status_r, pidfd):
            os.close(fd)
        if not report.startswith(b"pid") or b"status\x1f0\x1e" not in status:
            raise RuntimeError(f"the call failed: report {report!r}, status {status!r}")

    def close(self) -> None:
        self.control.close()                              # EOF: it exits
        os.waitpid(self.pid, 0)


def measure_resident(calls: int, resident: Resident, one: Callable[[], None]) -> Sample:
    own, theirs, wall = _cpu(resource.RUSAGE_SELF), resident.cpu(), time.perf_counter()
    for _ in range(calls):
        one()
    return ((time.perf_counter() - wall) / calls * 1e3, (_cpu(resource.RUSAGE_SELF) - own) / calls * 1e3,
            (resident.cpu() - theirs) / calls * 1e3)


def mechanisms(calls: int, blocks: int) -> None:
    helper = native_call.helper_path()
    if helper is None:
        sys.exit("sandboxd-call is not built (packaging/setup.sh, or python -m sandboxd.launcher.native_call build)")
    workspace = tempfile.mkdtemp(prefix="sandboxd-bench-call-start-")
    spawner = Spawner(native_helper=helper)
    session = spawner.open_session(LaunchSpec(argv=("true",), workspace=workspace, env=dict(ENV),
                                              policy=WorkspaceWrite(), limits=LIMITS))
    null = os.open("/dev/null", os.O_RDWR)
    per_block = max(1, calls // blocks)
    samples: dict[str, list[Sample]] = {kind: [] for kind in NAMES}
    to_inside, requests = os.pipe()                    # the inside process reads, this one writes
    answers_r, answers_w = os.pipe()
    child = os.fork()
    if child == 0:
        try:
            os.close(requests)
            os.close(answers_r)
            inside(session, helper, workspace, null, per_block, to_inside, answers_w)
        finally:
            os._exit(0)
    os.close(to_inside)
    os.close(answers_w)
    load_before = open("/proc/loadavg").read().strip()
    build = tempfile.mkdtemp(prefix="sandboxd-bench-call-start-")
    resident = Resident(build_resident(build), session)
    try:
        assert session.cgroup is not None
        plan = session.plan.replace(argv=("true",), env=dict(ENV), cwd=workspace)
        pid_namespace = spawner._new_pid_namespace
        dirs = list(session.cgroup.dirs)

        def today() -> None:
            proc = spawner.launch_call(session, ("true",), dict(ENV), workspace, stdio=(null, null, null))
            proc.wait_started()
            if proc.wait().exit_code != 0:
                raise RuntimeError("true failed")

        def bare() -> None:
            os.waitpid(os.posix_spawn("/bin/true", ["true"], ENV), 0)

        for _ in range(blocks):
            samples["A"].append(measure(per_block, today))
            samples["E"].append(measure(per_block, lambda: spawn_helper(
                helper, session, plan, null, sequence.CALL_NAMESPACES, dirs, pid_namespace)))
            samples["F"].append(measure(per_block, lambda: spawn_helper(
                helper, session, plan, null, sequence.CALL_NAMESPACES, [], pid_namespace)))
            samples["G"].append(measure(per_block, lambda: spawn_helper(
                helper, session, plan, null, namespaces.CLONE_NEWUTS, [], pid_namespace)))
            for kind in "BC":
                os.write(requests, kind.encode())
                samples[kind].append(eval(os.read(answers_r, 4096)))
            samples["R"].append(measure_resident(per_block, resident,
                                                 lambda: resident.call(session, plan, helper, null)))
            samples["D"].append(measure(per_block, bare))
    finally:
        resident.close()
        shutil.rmtree(build, ignore_errors=True)
        os.close(requests)
        os.waitpid(child, 0)
        os.close(null)
        session.close()
        shutil.rmtree(workspace, ignore_errors=True)
    print(f"{per_block * blocks} calls per mechanism in {blocks} interleaved blocks; "
          f"loadavg before {load_before}, after {open('/proc/loadavg').read().strip()}")
    print(f"{'mechanism':<44} {'wall ms':>8} {'own CPU':>8} {'children':>9} {'total CPU':>10}   wall per block")
    for kind, rows in samples.items():
        wall, own, children = (sum(row[i] for row in rows) / len(rows) for i in range(3))
        print(f"{NAMES[kind]:<44} {wall:8.3f} {own:8.3f} {children:9.3f} {own + children:10.3f}   "
              + ", ".join(f"{row[0]:.2f}" for row in rows))


def pieces(n: int) -> None:
    """bench_call_start.c against a live session: the helper's exec, a small fork, setns, cgroup join."""
    helper = native_call.helper_path()
    if helper is None:
        sys.exit("sandboxd-call is not built")
    build = tempfile.mkdtemp(prefix="sandboxd-bench-call-start-")
    workspace = tempfile.mkdtemp(prefix="sandboxd-bench-call-start-")
    program = os.path.join(build, "bench_call_start")
    subprocess.run(["cc", "-O2", "-Wall", "-o", program, os.path.join(os.path.dirname(__file__), "bench_call_start.c")],
                   check=True)
    session = Spawner(native_helper=helper).open_session(LaunchSpec(argv=("true",), workspace=workspace, env=dict(ENV),
                                                                    policy=WorkspaceWrite(), limits=LIMITS))
    try:
        assert session.cgroup is not None
        print(f"loadavg before {open('/proc/loadavg').read().strip()}")
        subprocess.run([program, str(n), helper, str(session.pidfd), str(sequence.CALL_NAMESPACES),
                        *session.cgroup.dirs], pass_fds=(session.pidfd,), check=True)
        print(f"loadavg after {open('/proc/loadavg').read().strip()}")
    finally:
        session.close()
        shutil.rmtree(build, ignore_errors=True)
        shutil.rmtree(workspace, ignore_errors=True)


def _fork_server_cpu(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def while_running(running_counts: list[int], calls: int) -> None:
    """The fork server's CPU per warm call of ``true`` while other calls (``sleep``) are running:
    the cost of its loop per event grows with what it holds (``_Server._collect_exits``)."""
    from sandboxd.supervisor.fork_client import ForkServer

    server = ForkServer.start()
    workspace = tempfile.mkdtemp(prefix="sandboxd-bench-call-start-")
    null = os.open("/dev/null", os.O_RDWR)
    try:
        server.open_session("busy", LaunchSpec(argv=("true",), workspace=workspace, env=dict(ENV),
                                               policy=WorkspaceWrite(), limits=Limits(pids=4096, memory_bytes=1 << 30)))
        server.open_session("warm", LaunchSpec(argv=("true",), workspace=workspace, env=dict(ENV),
                                               policy=WorkspaceWrite(), limits=LIMITS))
        print(f"loadavg before {open('/proc/loadavg').read().strip()}")
        for count in running_counts:
            sleepers = [server.call("busy", ["sleep", "3600"], dict(ENV), workspace, None, (null, null, null))[0]
                        for _ in range(count)]
            cpu, wall = _fork_server_cpu(server.pid), time.perf_counter()
            for _ in range(calls):
                call_id, _ = server.call("warm", ["true"], dict(ENV), workspace, None, (null, null, null))
                if server.wait(call_id).exit_code != 0:
                    raise RuntimeError("true failed")
            cpu, wall = _fork_server_cpu(server.pid) - cpu, time.perf_counter() - wall
            print(f"{count:5d} calls running: fork server CPU {cpu / calls * 1e3:.3f} ms per warm call, "
                  f"wall {wall / calls * 1e3:.3f} ms")
            for call_id in sleepers:
                server.cancel(call_id)
            for call_id in sleepers:
                server.wait(call_id)
        print(f"loadavg after {open('/proc/loadavg').read().strip()}")
    finally:
        os.close(null)
        server.close()
        shutil.rmtree(workspace, ignore_errors=True)


def loop_turn(count: int, turns: int = 300) -> None:
    """One turn of the fork server's loop with ``count`` calls running, piece by piece: real
    SandboxProcess objects around real children (``sleep``; their plan is not used here)."""
    import select

    from sandboxd.supervisor.spawner import SandboxProcess

    procs = []
    try:
        for _ in range(count):
            pid = os.posix_spawn("/bin/sleep", ["sleep", "600"], {})
            report_r, _ = os.pipe()
            status_r, _ = os.pipe()
            procs.append(SandboxProcess(None, pid, report_r, status_r, None))  # type: ignore[arg-type]
        running = {call_id: (proc, None) for call_id, proc in enumerate(procs)}
        poller = select.poll()
        for proc in procs:
            poller.register(proc.fileno(), select.POLLIN)

        def scan() -> None:                    # _Server.serve: the next deadline
            [d for d in (proc.wake_at(limit) for proc, limit in running.values()) if d is not None]

        def poll_each() -> None:               # _collect_exits before this branch
            for proc, limit in list(running.values()):
                proc.poll(limit)

        def ready_only() -> None:              # _collect_exits now, with no pidfd ready
            now, ready = time.monotonic(), set()
            for proc, limit in list(running.values()):
                if proc.fileno() not in ready:
                    wake = proc.wake_at(limit)
                    if wake is None or wake > now:
                        continue

        print(f"loadavg {open('/proc/loadavg').read().strip()}; {count} calls running, {turns} turns each")
        for name, piece in (("poll() of every pidfd", lambda: poller.poll(0)), ("the deadline scan", scan),
                            ("_collect_exits, a waitpid per call (before)", poll_each),
                            ("_collect_exits, ready pidfds only (now)", ready_only)):
            cpu = time.process_time()
            for _ in range(turns):
                piece()
            print(f"  {name:<44} {(time.process_time() - cpu) / turns * 1e6:8.1f} us per turn")
    finally:
        for proc in procs:
            os.kill(proc.pid, 9)
            os.waitpid(proc.pid, 0)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--loop-turn"]:
        loop_turn(int(sys.argv[2]) if len(sys.argv) > 2 else 400)
    elif sys.argv[1:2] == ["--running"]:
        while_running([int(n) for n in sys.argv[2].split(",")] if len(sys.argv) > 2 else [0, 100, 400, 0],
                      int(sys.argv[3]) if len(sys.argv) > 3 else 300)
    elif sys.argv[1:2] == ["--pieces"]:
        pieces(int(sys.argv[2]) if len(sys.argv) > 2 else 2000)
    else:
        mechanisms(int(sys.argv[1]) if len(sys.argv) > 1 else 800, int(sys.argv[2]) if len(sys.argv) > 2 else 8)
