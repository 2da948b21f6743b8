"""Memory that stays flat and idle that costs nothing (issue 18, items 6 and 4): the daemon's
allocation tracer (service.memtrace), off unless ``SANDBOXD_TRACEMALLOC`` names a file; the
per-session memory a closed session leaves behind (the PATH checks of service.environment; the
event store's sequences are in test_event_store.py); the daemon's two malloc arenas; its main
thread asleep while nothing happens."""

from __future__ import annotations

import os
import stat
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import pytest

from daemon_fixtures import daemon  # noqa: F401 - pytest fixture
from daemon_helpers import Daemon, DaemonFactory
from sandboxd.client import SandboxClient
from sandboxd.service import environment, memtrace


@pytest.fixture
def not_tracing() -> Iterator[None]:
    """These tests start tracemalloc in the test process: it must not be on before, nor left on."""
    assert not tracemalloc.is_tracing()
    yield
    tracemalloc.stop()


def test_the_tracer_is_off_unless_its_variable_names_a_file(not_tracing: None) -> None:
    assert memtrace.start_from_environment({}) is None
    assert memtrace.start_from_environment({memtrace.ENV_FILE: "", memtrace.ENV_INTERVAL: "1"}) is None
    assert not tracemalloc.is_tracing()


HELD: list[bytearray] = []


def _grow() -> None:
    HELD.extend(bytearray(1024) for _ in range(512))      # 512 KiB that stay: the growth to find


def test_the_tracer_names_what_grew_by_traceback(tmp_path: Path, not_tracing: None) -> None:
    path = tmp_path / "trace.txt"
    tracer = memtrace.start_from_environment({memtrace.ENV_FILE: str(path), memtrace.ENV_INTERVAL: "3600"})
    assert tracer is not None and tracemalloc.is_tracing()
    try:
        _grow()
        tracer.dump()
    finally:
        HELD.clear()
        tracer.stop()
    assert not tracemalloc.is_tracing()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    text = path.read_text()
    assert text.startswith("# sandboxd tracemalloc:") and text.count("\n## t=") == 2     # the dump, the stop
    first_dump = text.split("\n## t=")[1]
    growth = first_dump.split("### top")[1]                # since the first snapshot
    top = growth.split("\n")[1:3]                          # the biggest growth and its most recent frame
    grew_kib = float(top[0].split()[0])                    # 512 buffers of 1 KiB and their objects
    assert 512 <= grew_kib < 600 and "+1024 blocks" in top[0], top
    assert top[1].strip().endswith(f"test_memory_flat.py:{_grow.__code__.co_firstlineno + 1}"), top


def test_the_tracer_never_follows_a_symlink(tmp_path: Path, not_tracing: None) -> None:
    target = tmp_path / "target"
    target.write_text("untouched\n")
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(OSError):
        memtrace.start_from_environment({memtrace.ENV_FILE: str(tmp_path / "link")})
    tracemalloc.stop()
    assert target.read_text() == "untouched\n"
    with pytest.raises(ValueError, match="SANDBOXD_TRACEMALLOC_INTERVAL"):
        memtrace.MemoryTracer(str(tmp_path / "t"), interval=0)


def test_a_daemon_asked_to_trace_writes_its_growth_at_stop(sandboxd_daemon: DaemonFactory) -> None:
    trace = sandboxd_daemon.base / "trace.txt"
    traced = sandboxd_daemon(env={memtrace.ENV_FILE: str(trace), memtrace.ENV_INTERVAL: "3600"})
    with SandboxClient(traced.socket) as client:
        session = client.create_session(str(sandboxd_daemon.workspace()), approval="never")
        assert client.exec(session.id, ["true"]).result.shell_status == 0
        client.close_session(session.id)
    assert traced.stop() == 0
    text = trace.read_text()
    assert text.startswith(f"# sandboxd tracemalloc: pid {traced.pid},") and text.count("\n## t=") == 1
    assert "/sandboxd/service/" in text                    # the daemon's own allocations, by traceback
    assert stat.S_IMODE(os.stat(trace).st_mode) == 0o600


def test_a_closed_sessions_path_checks_are_forgotten() -> None:
    prepared = environment._Prepared()
    for session_id in ("a", "b"):
        for generation in (1, 2):
            prepared.put((session_id, generation, 1, "/usr/bin"), ["/usr/bin"], "/home/sandbox", complete=True)
    assert len(prepared) == 4
    prepared.forget("a")
    assert len(prepared) == 2
    assert prepared.get(("a", 1, 1, "/usr/bin")) is None
    assert prepared.get(("b", 2, 1, "/usr/bin")) == (["/usr/bin"], "/home/sandbox")


ARENAS_PROBE = """
import ctypes, sys, threading
from sandboxd.kernel.malloc_arenas import limit_arenas
print(limit_arenas(environ={}) if sys.argv[1] == "limit" else "unlimited", flush=True)
barrier, held = threading.Barrier(8), []
def allocate():
    held.append(bytearray(64 * 1024))       # from the thread's arena (below the mmap threshold)
    barrier.wait()                          # all eight alive at once: none inherits a freed arena
threads = [threading.Thread(target=allocate) for _ in range(8)]
[t.start() for t in threads]
[t.join() for t in threads]
ctypes.CDLL(None).malloc_stats()            # "Arena N:" per arena, on stderr
"""


@pytest.mark.parametrize("mode, most", [("limit", 2), ("unlimited", 16)])
def test_the_daemons_threads_share_two_malloc_arenas(mode: str, most: int) -> None:
    """glibc only: another C library has no mallopt(M_ARENA_MAX) and the daemon changes nothing."""
    import subprocess
    import sys

    probe = subprocess.run([sys.executable, "-c", ARENAS_PROBE, mode], capture_output=True, text=True, timeout=60,
                           check=True)
    arenas = probe.stderr.count("Arena ")
    assert probe.stdout.strip() == ("True" if mode == "limit" else "unlimited")
    if mode == "limit":
        assert arenas == 2, probe.stderr
    else:
        assert 2 < arenas <= most, probe.stderr          # the control: eight threads, eight arenas more


def test_malloc_arena_max_in_the_environment_wins() -> None:
    from sandboxd.kernel.malloc_arenas import limit_arenas

    assert limit_arenas(environ={"MALLOC_ARENA_MAX": "4"}) is False


def _switches(pid: int, tid: int) -> int:
    with open(f"/proc/{pid}/task/{tid}/status", encoding="ascii") as status:
        return sum(int(line.split()[1]) for line in status
                   if line.startswith(("voluntary_ctxt_switches:", "nonvoluntary_ctxt_switches:")))


def test_an_idle_daemons_main_thread_sleeps_until_a_signal(daemon: Daemon) -> None:  # noqa: F811
    """It used to wake five times a second to look at its stop flag; now a signal's byte on a
    pipe (signal.set_wakeup_fd) or the fork server's pidfd wakes it, and nothing else."""
    before = _switches(daemon.pid, daemon.pid)
    time.sleep(3)
    assert _switches(daemon.pid, daemon.pid) - before <= 2          # polling every 0.2 s: 15


def test_the_fork_servers_sweep_reads_each_creator_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The minutely sweep of stale sandbox groups looked at its creator's /proc entry once per
    group: with 1,000 idle sessions, 1,000 reads a minute (5 ticks of the fork server's CPU)."""
    from sandboxd.kernel import cgroups, creators

    for n in range(50):
        (tmp_path / cgroups.group_name(str(n))).mkdir()               # a live creator's groups
    looked_at: list[int] = []
    real = creators.start_time
    monkeypatch.setattr(cgroups, "_sweep_bases", lambda _h: [str(tmp_path)])
    monkeypatch.setattr(creators, "start_time", lambda pid: looked_at.append(pid) or real(pid))
    assert cgroups.stale_groups() == []
    assert looked_at == [os.getpid()]
    assert len(list(tmp_path.iterdir())) == 50                        # a live creator's groups stay
