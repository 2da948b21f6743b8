"""A one-shot launch through the warm fork server, in pieces (docs/benchmark.md, the launch table's
regression since 2026-11-30).

Not a test (no ``test_`` in its name). As root, from the repository root::

    .venv/bin/python tests/bench_forkserver_launch.py [ROUNDS]      # default 150

Interleaved round-robin in a shuffled order, ``true`` under workspace-write each time (the launch
table's ``forkserver workspace-write`` row):

* ``fork server``: ``ForkServer.launch`` + ``wait`` of a fork server started as the daemon starts it;
* ``fork server, paths opened inline``: the same loop (``fork_server.serve``, forked from this
  process) with ``access.PendingOpen`` replaced by a stand-in that opens the caller's paths in the
  fork server itself, as before 2026-12-01 (the child that opens them as the caller, so that a path
  on a file system that does not answer holds only its own request, came with issue 16);
* ``spawner in-process``: ``Spawner.launch`` in this process (what ``sandboxd run`` does);
* ``PendingOpen cycle``: that child alone (fork, open and walk the paths as the caller, answer,
  reap), and ``fork + exit + wait`` of this process, for scale;
* ``bwrap one-shot`` and ``bare exec /bin/true``, the references.
"""

from __future__ import annotations

import os
import random
import select
import socket
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

from benchmark import BWRAP_ARGV, SANDBOX_ENV, SHUFFLE_SEED, forkserver_launch, spawn_and_wait, spawner_launch
from sandboxd.kernel import access
from sandboxd.launcher.plan import path_check, path_requests
from sandboxd.policy import LaunchSpec, WorkspaceWrite
from sandboxd.supervisor import fork_server
from sandboxd.supervisor.fork_client import ForkServer
from sandboxd.supervisor.spawner import Spawner


class OpenedInline:
    """``access.PendingOpen``'s interface, opening the paths in this process (no child)."""

    def __init__(self, caller: access.Caller, requests: list[access.PathRequest],
                 check: Callable[[list[int]], None] | None = None) -> None:
        self._fds = access._open_here(list(requests))
        if check is not None:
            check(self._fds)
        self._ready, done = os.pipe2(os.O_CLOEXEC)       # readable at once: the loop's poller takes it
        os.write(done, b"x")
        os.close(done)
        self.pidfd = -1

    def fileno(self) -> int:
        return self._ready

    def step(self) -> bool:
        return True

    def take(self) -> list[int]:
        fds, self._fds = self._fds, []
        return fds

    def waiting_on(self) -> None:
        return None

    def abandon(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []
        if self._ready >= 0:
            os.close(self._ready)
            self._ready = -1

    def reap(self, *, block: bool = False) -> bool:
        return True


def inline_fork_server() -> ForkServer:
    """The fork server's loop in a child of this process (single-threaded: no thread started yet),
    with the caller's paths opened in the loop's own process."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    pid = os.fork()
    if pid == 0:
        ours.close()
        access.PendingOpen = OpenedInline                 # type: ignore[misc, assignment]
        try:
            fork_server.serve(theirs)
        finally:
            os._exit(0)
    theirs.close()
    return ForkServer(ours, pid)


def main() -> int:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 150
    workspace = tempfile.mkdtemp(prefix="sandboxd-bench-launch-", dir="/var/tmp")
    devnull = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    spec = LaunchSpec(argv=("/bin/true",), workspace=workspace, env=dict(SANDBOX_ENV), policy=WorkspaceWrite())
    inline = inline_fork_server()
    current = ForkServer.start()
    spawner = Spawner()

    def pending_cycle() -> None:
        pending = access.PendingOpen(access.Caller(0, 0, ()), path_requests(spec), path_check(spec))
        poller = select.poll()
        poller.register(pending.fileno(), select.POLLIN)
        try:
            while not pending.step():
                poller.poll()
            for fd in pending.take():
                os.close(fd)
        finally:
            pending.abandon()
            pending.reap(block=True)

    def fork_exit_wait() -> None:
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)

    variants: dict[str, Callable[[], Any]] = {
        "bwrap one-shot": lambda: spawn_and_wait(BWRAP_ARGV, devnull),
        "bare exec /bin/true": lambda: spawn_and_wait(["/bin/true"], devnull),
        "fork server": lambda: forkserver_launch(current, spec, devnull),
        "fork server, paths opened inline": lambda: forkserver_launch(inline, spec, devnull),
        "spawner in-process": lambda: spawner_launch(spawner, spec, devnull),
        "PendingOpen cycle": pending_cycle,
        "fork + exit + wait of this process": fork_exit_wait,
    }
    samples: dict[str, list[float]] = {name: [] for name in variants}
    rng = random.Random(SHUFFLE_SEED)
    order = list(variants)
    print(f"load {open('/proc/loadavg').read().split()[:3]}, {rounds} rounds after 5")
    try:
        for round_no in range(rounds + 5):
            rng.shuffle(order)
            for name in order:
                began = time.perf_counter()
                variants[name]()
                if round_no >= 5:
                    samples[name].append((time.perf_counter() - began) * 1e3)
    finally:
        current.close()
        inline.close()
        os.waitpid(inline.pid, 0)                         # our child (the other is its ForkServer's)
        os.close(devnull)
        os.rmdir(workspace)
    bwrap = statistics.median(samples["bwrap one-shot"])
    for name, values in samples.items():
        median = statistics.median(values)
        print(f"{name:<36} median {median:7.2f} ms   x bwrap {median / bwrap:5.2f}")
    print(f"load {open('/proc/loadavg').read().split()[:3]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
