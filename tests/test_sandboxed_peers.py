"""The daemon's second wall (service.sandboxed_peers) against real processes, on its own: a process
in a PID namespace the daemon did not make is refused when that namespace's PID 1 is a sandboxd init
(a `sandboxd run` sandbox), by its pid and by its TCP connection; a process of another PID namespace
(unshare) and one of our own are not. What kernel.peers reads through psutil (the pids, a process's
start time and command line) and by hand (NSpid, socket inodes, /proc/net/tcp) is all on this path."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from conftest import BASE_ENV, PY, SANDBOXD, kill_marked, pids_with_marker
from sandboxd.kernel import peers
from sandboxd.service.sandboxed_peers import REASON, UNKNOWN, SandboxedPeers

pytestmark = pytest.mark.timeout(120)

HOLD = ("import socket, sys, time\n"
        "s = socket.create_connection(('127.0.0.1', int(sys.argv[1])))\n"
        "print(s.getsockname()[1], flush=True)\n"
        "time.sleep(60)\n")


def foreign_pids(marker: str) -> list[int]:
    """Pids carrying ``marker`` outside our PID namespace (not the `sandboxd run` that started them)."""
    ours = peers.pid_namespace(os.getpid())
    return [pid for pid in pids_with_marker(marker) if peers.pid_namespace(pid) not in (ours, None)]


def test_a_sandboxd_run_process_is_refused_by_pid_and_by_tcp(workspace: Path, tcp_listener: socket.socket,
                                                              marker: str) -> None:
    server_port = tcp_listener.getsockname()[1]
    inside = subprocess.Popen([SANDBOXD, "run", "--sandbox", "workspace-write", "--network=host", "--workspace",
                               str(workspace), "--", PY, "-c", HOLD, str(server_port), marker],
                              stdout=subprocess.PIPE, text=True, env=BASE_ENV, cwd=workspace)
    host = socket.create_connection(("127.0.0.1", server_port))        # the control: a client on the host
    try:
        assert inside.stdout is not None
        client_port = int(inside.stdout.readline())
        [sandboxed] = foreign_pids(marker)
        judge = SandboxedPeers(set)                   # no namespace of its own: all it knows is /proc
        assert judge.reason_for_pid(sandboxed) == REASON
        assert judge.reason_for_pid(sandboxed) == REASON                   # again, from its verdict cache
        assert judge.reason_for_tcp("127.0.0.1", client_port, server_port) == REASON
        assert judge.reason_for_pid(os.getpid()) == ""
        assert judge.reason_for_tcp("127.0.0.1", host.getsockname()[1], server_port) == ""
        assert peers.start_time(sandboxed) == psutil.Process(sandboxed).create_time()
        init = peers.namespace_init(peers.pid_namespace(sandboxed) or 0)
        assert init is not None and peers.command_line(init).startswith("sandboxd-init")
        assert psutil.Process(init).name() == "sandboxd-init"        # its comm too (process.set_name)
    finally:
        host.close()
        inside.kill()
        inside.wait()
        kill_marked(marker)


def exhausted_descriptors() -> list[int]:
    """Every descriptor this process may still open, taken (as a flood of connections would leave
    the daemon); the caller closes them."""
    taken = []
    try:
        while True:
            taken.append(os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC))
    except OSError:
        return taken


def test_a_judge_short_of_descriptors_refuses_rather_than_passes(workspace: Path, tcp_listener: socket.socket,
                                                                 marker: str) -> None:
    """With no descriptor left to read /proc with, the judge cannot tell a sandboxed peer from
    another: it refuses (UNKNOWN, try again) instead of passing it as "not sandboxed", which it did
    (round 4's second hostile pass: the lookups took "could not open" for "no such socket"). The
    control: with descriptors to spare the same peers are judged as they are."""
    server_port = tcp_listener.getsockname()[1]
    inside = subprocess.Popen([SANDBOXD, "run", "--sandbox", "workspace-write", "--network=host", "--workspace",
                               str(workspace), "--", PY, "-c", HOLD, str(server_port), marker],
                              stdout=subprocess.PIPE, text=True, env=BASE_ENV, cwd=workspace)
    try:
        assert inside.stdout is not None
        client_port = int(inside.stdout.readline())
        [sandboxed] = foreign_pids(marker)
        assert SandboxedPeers(set).reason_for_tcp("127.0.0.1", client_port, server_port) == REASON   # control
        judge = SandboxedPeers(set)
        taken = exhausted_descriptors()
        try:
            by_tcp = judge.reason_for_tcp("127.0.0.1", client_port, server_port)
            by_pid = judge.reason_for_pid(sandboxed)
        finally:
            for fd in taken:
                os.close(fd)
        assert by_tcp == UNKNOWN and by_pid == UNKNOWN
        assert judge.reason_for_tcp("127.0.0.1", client_port, server_port) == REASON   # nothing wrong was kept
    finally:
        inside.kill()
        inside.wait()
        kill_marked(marker)


def test_another_pid_namespace_is_not_a_sandbox(marker: str) -> None:
    """A PID namespace whose PID 1 is not a sandboxd init (a container, here unshare's sleep)."""
    other = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", "--", PY, "-c", "import time; time.sleep(60)",
                              marker])
    try:
        deadline = time.monotonic() + 10
        while not (found := foreign_pids(marker)) and time.monotonic() < deadline:
            time.sleep(0.02)
        [pid] = found
        assert peers.namespace_init(peers.pid_namespace(pid) or 0) == pid
        assert peers.command_line(pid) == f"{PY} -c import time; time.sleep(60) {marker}"
        assert SandboxedPeers(set).reason_for_pid(pid) == ""
    finally:
        other.kill()
        other.wait()
        kill_marked(marker)
    reaped = subprocess.Popen(["true"])
    reaped.wait()
    assert peers.start_time(reaped.pid) is None and peers.command_line(reaped.pid) == ""   # gone: nothing
