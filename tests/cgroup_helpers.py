"""Real cgroups for tests that need a cgroup of their own: a systemd-like slice on cgroup v2
(``v2_slice``), and ``own_parent``, a fresh parent group in whichever hierarchy enforces memory and
pids for this process (v1 here, v2 in the matrix guests), for a daemon or `sandboxd run` whose
ceiling (the caps on its ``sandboxd`` base group) a test sets low without touching the base group
every other sandboxd on the machine shares."""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from conftest import SLOW
from sandboxd.kernel import cgroups

# The file that holds each controller's limit, per hierarchy.
LIMIT_FILES = {("memory", "v2"): "memory.max", ("memory", "v1"): "memory.limit_in_bytes",
               ("pids", "v2"): "pids.max", ("pids", "v1"): "pids.max"}


def read(path: Path) -> str:
    return path.read_text().strip()


def remove_group(group: Path) -> None:
    """Kill what is left in ``group`` and below, then rmdir bottom-up."""
    if not group.exists():
        return
    for dirpath, _, _ in sorted(os.walk(group), key=lambda e: -e[0].count("/")):
        path = Path(dirpath)
        for _ in range(200):
            try:
                pids = read(path / "cgroup.procs").split()
            except OSError:
                break
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(int(pid), 9)
                except ProcessLookupError:
                    pass
            time.sleep(0.01)
        try:
            path.rmdir()
        except OSError:
            pass


@contextlib.contextmanager
def v2_slice(mount: str) -> Iterator[Path]:
    """What systemd does above a unit: a parent group with +memory +pids +cpu handed down (the root
    enables them first when it has not: systemd does that at boot). Removed afterwards."""
    root = Path(mount)
    wanted = [c for c in ("cpu", "memory", "pids") if c in read(root / "cgroup.controllers").split()]
    if set(wanted) - set(read(root / "cgroup.subtree_control").split()):
        (root / "cgroup.subtree_control").write_text(" ".join("+" + c for c in wanted))
    group = root / f"sbxt-{uuid.uuid4().hex[:8]}.slice"
    group.mkdir()
    try:
        (group / "cgroup.subtree_control").write_text(" ".join("+" + c for c in wanted))
        yield group
    finally:
        remove_group(group)
        assert not group.exists()


@dataclass
class ParentGroup:
    """Where a process started through ``wrapper`` lives, and so where its sandboxes' base groups are."""

    joins: list[Path] = field(default_factory=list)         # the groups the wrapper moves the process into
    bases: dict[str, tuple[Path, str]] = field(default_factory=dict)   # controller -> (base group, "v1"/"v2")

    @property
    def wrapper(self) -> list[str]:
        """An argv prefix that moves itself into the groups, then execs the rest; on v2, once an earlier
        sandboxd made the unit hand controllers down, into its leaf (as another process of the unit)."""
        script = ('IFS=:; for g in $0; do [ -d "$g/sandboxd-supervisor" ] && g="$g/sandboxd-supervisor"; '
                  'echo $$ > "$g/cgroup.procs" || exit 9; done; unset IFS; exec "$@"')
        return ["sh", "-c", script, ":".join(str(g) for g in self.joins)]

    def cap(self, controller: str) -> str:
        """The ceiling on the base group (what ``sandboxd`` wrote), as the kernel reports it."""
        base, version = self.bases[controller]
        return read(base / LIMIT_FILES[controller, version])

    def sandbox_limits(self, controller: str) -> list[str]:
        """The limit of each sandbox group (``run-*``) below the base group now, in it or in an owner's group."""
        base, version = self.bases[controller]
        groups = sorted([*base.glob("run-*"), *base.glob(cgroups.OWNER_PREFIX + "*/run-*")])
        return [read(group / LIMIT_FILES[controller, version]) for group in groups]

    def owner_group(self, controller: str, key: str) -> Path:
        """The group of owner ``key`` (LaunchSpec.owner) below the base group."""
        return self.bases[controller][0] / (cgroups.OWNER_PREFIX + key)

    def owner_groups(self) -> list[Path]:
        """Every owner group below the base groups now."""
        return sorted(group for base, _ in self.bases.values() for group in base.glob(cgroups.OWNER_PREFIX + "*"))


@contextlib.contextmanager
def own_parent() -> Iterator[ParentGroup]:
    """A fresh group per hierarchy that enforces memory or pids for this process: on v1 a child of
    this process's group in each; on v2 a delegated unit (trusted.delegate, as systemd's
    Delegate=yes) in a slice of its own. Killed and removed afterwards."""
    h = cgroups.detect()
    tag = f"sbxt-{uuid.uuid4().hex[:8]}"
    parent = ParentGroup()
    with contextlib.ExitStack() as stack:
        v2 = [c for c in ("memory", "pids") if c in h.unified_controllers]
        if v2:
            assert h.unified
            unit = stack.enter_context(v2_slice(h.unified)) / "agent.service"
            unit.mkdir()
            os.setxattr(unit, "trusted.delegate", b"1")
            parent.joins.append(unit)
            for controller in v2:
                parent.bases[controller] = (unit / cgroups.BASE_NAME, "v2")
        for controller in ("memory", "pids"):
            if controller in v2 or controller not in h.v1:
                continue
            point, own = h.v1[controller]
            group = Path(point, own.lstrip("/"), tag)
            group.mkdir()
            stack.callback(remove_group, group)
            parent.joins.append(group)
            parent.bases[controller] = (group / cgroups.BASE_NAME, "v1")
        yield parent


# Forks up to argv[1] children that wait on a pipe, says how many it got ("FORKED n ERRNO e", e 0 when
# all were made, 11 for EAGAIN), writes n to the file argv[2], and holds the children until the file
# argv[3] exists (at most 600 s: the test makes it, also when it fails); they end with it (their pipe's
# last writer is gone).
HOLDING_FORKS = ("import os, sys, time\n"
                 "r, w = os.pipe()\n"
                 "n = err = 0\n"
                 "try:\n"
                 "    for _ in range(int(sys.argv[1])):\n"
                 "        if os.fork() == 0:\n"
                 "            os.close(w); os.read(r, 1); os._exit(0)\n"
                 "        n += 1\n"
                 "except OSError as e:\n"
                 "    err = e.errno\n"
                 "print('FORKED', n, 'ERRNO', err, flush=True)\n"
                 "with open(sys.argv[2] + '.tmp', 'w') as f: f.write(str(n))\n"
                 "os.rename(sys.argv[2] + '.tmp', sys.argv[2])\n"
                 "deadline = time.monotonic() + 600\n"
                 "while not os.path.exists(sys.argv[3]) and time.monotonic() < deadline: time.sleep(0.05)\n")


def forked(output: str | bytes) -> tuple[int, int]:
    """(children made, errno of the fork that failed or 0) from HOLDING_FORKS's output."""
    text = output.decode() if isinstance(output, bytes) else output
    words = text.split()
    assert words[:1] == ["FORKED"] and words[2:3] == ["ERRNO"], text
    return int(words[1]), int(words[3])


def wait_for(path: Path, within: float = 120.0 * SLOW) -> None:
    """Until ``path`` exists (a sandboxed command made it); AssertionError after ``within`` seconds."""
    deadline = time.monotonic() + within
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear within {within}s"
        time.sleep(0.05)


@contextlib.contextmanager
def private_base(where: str) -> Iterator[Path]:
    """A group standing in for a base group, ``<own>/sbxt-<random>`` in ``where`` ("v2", "v1 memory",
    "v1 pids"; skip without it), that no sandboxd on the machine looks at (each sweeps only
    ``<own>/sandboxd``): for the sweep's tests, which other daemons beside them, older ones judging by
    pid alone among them, must not race. Killed and removed afterwards."""
    import pytest

    h = cgroups.hierarchies()
    if where == "v2":
        if not h.unified:
            pytest.skip("no cgroup v2 hierarchy mounted")
        own = Path(h.unified) / h.unified_own.lstrip("/")
    else:
        controller = where.split()[-1]
        if controller not in h.v1:
            pytest.skip(f"no cgroup v1 {controller} hierarchy mounted")
        point, path = h.v1[controller]
        own = Path(point) / path.lstrip("/")
    base = own / f"sbxt-{uuid.uuid4().hex[:8]}"
    base.mkdir()
    try:
        yield base
    finally:
        remove_group(base)


class LeftoversLoop:
    """The fork server's leftovers (supervisor.waits.Leftovers) on a poll loop of the test's own: its
    poller, its timers, and ``turn``, which waits as the fork server's loop does (at most until the
    next timer) and hands each ready descriptor and due timer on."""

    def __init__(self) -> None:
        import select

        from sandboxd.supervisor.waits import Leftovers, Timers

        self.poller = select.poll()
        self.timers = Timers()
        self.leftovers = Leftovers(self.poller, self.timers)
        self.turns = 0

    def turn(self, longest: float = 0.1) -> None:
        due = self.timers.deadline()
        wait = longest if due is None else max(0.0, min(longest, due - time.monotonic()))
        for fd, _ in self.poller.poll(int(wait * 1000)):
            self.leftovers.ready(fd)
        self.timers.run_due(time.monotonic())
        self.turns += 1

    def run_until_empty(self, within: float = 60.0 * SLOW) -> bool:
        """Turn until every group handed over is removed (True) or ``within`` seconds pass."""
        deadline = time.monotonic() + within
        while len(self.leftovers) and time.monotonic() < deadline:
            self.turn()
        return not len(self.leftovers)
