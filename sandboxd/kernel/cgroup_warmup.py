"""Pay the first cgroup migration's RCU grace period while `sandboxd run` does its other work.

Moving a process into a cgroup (a write to ``cgroup.procs``, which a confined `sandboxd run` as
root does once, in its child, before it unshares anything) takes the kernel's global
``cgroup_threadgroup_rwsem`` for writing. That percpu rwsem first waits for an RCU grace period
(``rcu_sync_enter``): 5 to 25 ms on the CI machine, the largest single step of a run and about a
whole bwrap launch. A writer that comes while the rwsem is still in writer mode - during another
writer's grace period, or up to about one grace period after the last writer left - does not wait
again. So `sandboxd run` starts a no-op migration on a thread (its own process into the group
it is already in: nothing moves) once its git guard has walked the workspace (a walk can outlast
the window), imports the spawner meanwhile, waits for the thread just before it plans and forks,
and the child's real move, a few ms later, finds the rwsem ready.

Nothing that is enforced changes: the child joins its groups exactly as before; this only moves
a wait earlier. Where the no-op cannot be written (a group this process may not write, cgroups
not mounted) the thread does nothing and the child pays the wait itself, as it did. The thread
is waited for before the fork (``Warmup.wait``): no thread may run across a fork.
"""

from __future__ import annotations

import _thread
import os


class Warmup:
    """A no-op migration of this process on a thread of its own; ``wait`` before forking."""

    def __init__(self, procs_file: str) -> None:
        self._done = _thread.allocate_lock()
        self._done.acquire()
        _thread.start_new_thread(self._migrate, (procs_file,))

    def _migrate(self, procs_file: str) -> None:
        try:
            fd = os.open(procs_file, os.O_WRONLY | os.O_CLOEXEC)
            try:
                os.write(fd, b"0")
            finally:
                os.close(fd)
        except OSError:
            pass                   # not ours to write: the child's own move pays the wait, as before
        finally:
            self._done.release()

    def wait(self) -> None:
        """Return once the thread is done (idempotent)."""
        with self._done:
            pass


def start() -> Warmup | None:
    """Start the no-op migration into this process's own group of the cgroup2 hierarchy (the rwsem
    is shared by v1 and v2, so this serves the v1 moves too); None as a plain user (no cgroups:
    rootless) or when cgroup2 is not mounted."""
    if os.geteuid() != 0:
        return None
    own: dict[str, str] = {}
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, names, path = line.rstrip("\n").split(":", 2)
                own.setdefault(names, path)
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields = line.split()
                kind = fields[fields.index("-") + 1]
                if kind == "cgroup2" and "" in own:
                    return Warmup(os.path.join(fields[4], own[""].lstrip("/"), "cgroup.procs"))
    except (OSError, ValueError, IndexError):
        pass
    return None
