"""What `sandboxd run` does to be fast (issue 18, item 7) keeps its guarantees.

- It leaves by ``os._exit`` (cli.main._leave): the atexit handlers still run (kernel.cgroups
  removes the base groups it made there), what the CLI wrote is still flushed, and the exit status
  is the run's.
- The cgroup warm-up (kernel.cgroup_warmup) moves nothing: this process stays in its groups, the
  command's sandbox still has its own memory and pids groups; a plain user gets no warm-up; a
  group it may not write is harmless.
- The lazy imports hold: a plain `sandboxd run -- true` does not load ipaddress, collections or
  array, and a plan with sandboxd listeners to refuse has the address module loaded before init is
  forked (init may not be able to import it: connect_broker).
"""

from __future__ import annotations

import os
import subprocess
import textwrap
import time
from pathlib import Path

from conftest import BASE_ENV, PY, REPO, SLOW, make_dir
from daemon_helpers import descendants
from plain_users import plain_user


def _python(code: str, **options: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PY, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60,
                          env={**BASE_ENV, "PYTHONPATH": str(REPO)}, **options)  # type: ignore[call-overload]


def test_leave_runs_atexit_handlers_flushes_and_keeps_the_status() -> None:
    done = _python("""
        import atexit, sys
        atexit.register(lambda: sys.stdout.write("atexit ran\\n"))
        sys.stdout.write("written before ")              # still in the buffer (a pipe: block-buffered)
        from sandboxd.cli.main import _leave
        _leave(7)
        sys.stdout.write("never\\n")
        """)
    assert done.returncode == 7, done.stderr
    assert done.stdout == "written before atexit ran\n"


def test_run_exit_status_and_messages_survive_the_fast_exit(tmp_path: Path) -> None:
    """Control and subject in one: the command's status comes back, and the CLI's own message (a
    timeout, written after the sandbox is gone) reaches a piped stderr."""
    ws = make_dir(tmp_path / "ws")
    run = [PY, str(REPO / "packaging" / "bin" / "sandboxd"), "run", "--workspace", str(ws)]
    env = {**BASE_ENV, "PYTHONPATH": str(REPO)}
    ok = subprocess.run([*run, "--", "sh", "-c", "echo out; exit 3"], capture_output=True, text=True,
                        timeout=60, env=env)
    assert (ok.returncode, ok.stdout) == (3, "out\n"), ok.stderr
    late = subprocess.run([*run, "--timeout", "0.2", "--", "sleep", "30"], capture_output=True, text=True,
                          timeout=60, env=env)
    assert late.returncode == 124
    assert "timed out after 0.2s" in late.stderr


def test_the_cgroup_warmup_moves_nothing_and_the_sandbox_still_joins_its_groups(tmp_path: Path) -> None:
    done = _python("""
        from sandboxd.kernel import cgroup_warmup
        before = open("/proc/self/cgroup").read()
        warmup = cgroup_warmup.start()
        assert warmup is not None, "root with cgroup2 mounted gets a warm-up"
        warmup.wait()
        warmup.wait()                                  # idempotent
        assert open("/proc/self/cgroup").read() == before
        broken = cgroup_warmup.Warmup("/proc/sandboxd-no-such-dir/cgroup.procs")
        broken.wait()                                  # a file it cannot write: nothing raised
        print("ok")
        """)
    assert done.stdout == "ok\n", done.stderr
    # The command is still moved into its own groups (the warm-up only moved a wait): its pids
    # group, seen from outside, is the run's and has the run's limit.
    ws = make_dir(tmp_path / "ws")
    run = subprocess.Popen([PY, str(REPO / "packaging" / "bin" / "sandboxd"), "run", "--workspace", str(ws),
                            "--pids", "77", "--", "sleep", "30"], stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, env={**BASE_ENV, "PYTHONPATH": str(REPO)})
    try:
        command = _descendant_running(run.pid, b"sleep\x0030")
        groups = dict(line.split(":", 2)[1:] for line in Path(f"/proc/{command}/cgroup").read_text().splitlines())
        mine = dict(line.split(":", 2)[1:] for line in Path("/proc/self/cgroup").read_text().splitlines())
        assert groups["pids"] != mine["pids"] and "/sandboxd/" in groups["pids"], groups
        assert Path(f"/sys/fs/cgroup/pids{groups['pids']}/pids.max").read_text().strip() == "77"
    finally:
        run.terminate()
        run.wait(timeout=60)


def _descendant_running(root: int, cmdline: bytes) -> int:
    """The pid of a descendant of ``root`` whose command line is ``cmdline``, once it runs."""
    deadline = time.monotonic() + 30 * SLOW
    while time.monotonic() < deadline:
        for pid, info in descendants(root).items():
            if info.cmdline == cmdline:
                return pid
        time.sleep(0.05)
    raise AssertionError(f"no descendant of {root} ran {cmdline!r}")


def test_a_plain_user_gets_no_warmup() -> None:
    with plain_user() as (uid, gid):
        done = _python("""
            from sandboxd.kernel import cgroup_warmup
            print(cgroup_warmup.start())
            """, user=uid, group=gid, extra_groups=[], cwd="/")
    assert done.stdout == "None\n", done.stderr


def test_run_loads_no_address_module_unless_a_plan_refuses_sandboxd_listeners(tmp_path: Path) -> None:
    ws = make_dir(tmp_path / "ws")
    done = _python(f"""
        import sys
        from sandboxd.cli import run
        status = run.main(["--workspace", {str(ws)!r}, "--", "true"])
        print(status, sorted(m for m in ("ipaddress", "collections", "array", "sandboxd.kernel.addresses")
                             if m in sys.modules))
        from sandboxd.launcher import plan
        from sandboxd.policy import LaunchSpec, WorkspaceWrite
        spec = LaunchSpec(argv=("true",), workspace={str(ws)!r}, env={{}}, policy=WorkspaceWrite(),
                          denied_listeners=("127.0.0.1:7443",))
        prepared = plan.prepare(spec)
        prepared.close_trees()
        print("sandboxd.kernel.addresses" in sys.modules)
        """)
    assert done.stdout.splitlines() == ["0 []", "True"], done.stderr
    assert os.path.isdir(ws)
