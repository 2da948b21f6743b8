"""Background processes of a session: started, listed, read or followed, stopped.

Each is a call in the session (so the same sandbox, the same kill-the-tree
guarantee) whose stdout and stderr share one pipe. A reader thread keeps the
last BUFFER_BYTES of output and wakes followers; memory per process is bounded
whatever the process prints.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from typing import Callable, Iterator

from sandboxd.errors import Exhausted, NotFound
from sandboxd.service import environment
from sandboxd.service.handover.tags import background_tag
from sandboxd.service.quotas import owner_key
from sandboxd.service.sessions.registry import Session, SessionRegistry, cwd_inside
from sandboxd.supervisor.fork_client import ForkServer
from sandboxd.supervisor.spawner import ExitInfo
from sandboxd.v1 import sandboxd_pb2 as pb

BUFFER_BYTES = 4 << 20
CHUNK = 64 * 1024


class BackgroundJob:
    def __init__(self, session: Session, name: str, argv: list[str]) -> None:
        self.id = secrets.token_hex(6)
        self.session = session
        self.name = name
        self.argv = argv
        self.pid = 0
        self.started_at = time.time()
        self.result: ExitInfo | None = None
        self._cond = threading.Condition()
        self._buffer = bytearray()
        self._base = 0                     # offset of _buffer[0] in the total output
        self.call_id: int | None = None

    @property
    def total(self) -> int:
        return self._base + len(self._buffer)

    def append(self, data: bytes) -> None:
        with self._cond:
            self._buffer += data
            extra = len(self._buffer) - BUFFER_BYTES
            if extra > 0:
                del self._buffer[:extra]
                self._base += extra
            self._cond.notify_all()

    def finish(self, result: ExitInfo) -> None:
        with self._cond:
            self.result = result
            self._cond.notify_all()

    def read(self, offset: int, follow: bool, active: "Callable[[], bool]") -> Iterator[tuple[int, bytes, int]]:
        """(offset, data, dropped) from ``offset``; with ``follow``, until the job ends or ``active()`` is false."""
        while True:
            with self._cond:
                dropped = max(0, self._base - offset)
                offset = max(offset, self._base)
                data = bytes(self._buffer[offset - self._base:])
                ended = self.result is not None
                if not data and follow and not ended:
                    self._cond.wait(timeout=1.0)
                    if not active():
                        return
                    continue
            for start in range(0, len(data), CHUNK):
                yield offset + start, data[start:start + CHUNK], dropped if start == 0 else 0
            offset += len(data)
            if not follow or ended:
                if ended:
                    with self._cond:      # anything appended after the snapshot above
                        rest = bytes(self._buffer[offset - self._base:]) if offset >= self._base else b""
                    if rest:
                        yield offset, rest, 0
                return


def adopted_job(session: Session, job_id: str, name: str, pid: int, started_at: float, call_id: int) -> BackgroundJob:
    """A background process a surviving supervisor kept through a daemon restart
    (handover.adopt), listed in its session again; its end and output's tail come from there."""
    job = BackgroundJob(session, name, [name])
    job.id, job.pid, job.call_id = job_id, pid, call_id
    job.started_at = started_at or job.started_at
    with session.lock:
        session.jobs[job.id] = job
    return job


class BackgroundJobs:
    """Background jobs: each session keeps its own (``Session.jobs``, under the session's lock),
    and they go with it. Each session owner (but root) keeps at most ``per_owner`` of them over
    all its sessions, running or ended: each holds a thread while it runs and its output buffer
    until forgotten, so without a bound one user could fill the daemon's memory."""

    def __init__(self, registry: SessionRegistry, fork: ForkServer, per_owner: int = 16) -> None:
        self._registry = registry
        self._fork = fork
        self._per_owner = per_owner
        self._lock = threading.Lock()
        self._kept: dict[str, list[BackgroundJob]] = {}   # owner -> its kept jobs, oldest first

    def _admit(self, job: BackgroundJob) -> str | None:
        """Count ``job`` against its session's owner (returned; None for root), making room by
        forgetting the owner's oldest ended job; Exhausted when all it keeps are running."""
        session = job.session
        if session.owner.is_root:
            return None
        owner = owner_key(session.owner)
        with self._lock:
            kept = self._kept.setdefault(owner, [])
            kept[:] = [job for job in kept if not job.session.closed]      # closed sessions took theirs
            if len(kept) >= self._per_owner:
                ended = next((job for job in kept if job.result is not None), None)
                if ended is None:
                    raise Exhausted(f"{owner} already has {self._per_owner} background processes running, its "
                                    "limit (quotas.background_per_uid): stop one (StopBackground) first")
                kept.remove(ended)
                with ended.session.lock:
                    ended.session.jobs.pop(ended.id, None)
            kept.append(job)                       # counted from now: two starts at once cannot both fit
            return owner

    def _release(self, owner: str | None, job: BackgroundJob) -> None:
        """A job that did not start after all."""
        if owner is not None:
            with self._lock:
                kept = self._kept.get(owner, [])
                if job in kept:
                    kept.remove(job)

    def start(self, session: Session, argv: list[str], cwd: str, start: pb.ExecStart, name: str) -> BackgroundJob:
        """``start``: the environment fields (env, or env_overlay and caller_env), checked by the caller."""
        job = BackgroundJob(session, name or " ".join(argv)[:80], argv)
        owner = self._admit(job)
        try:
            out_r, generation, pid = self._launch(job, cwd, start)
        except BaseException:
            self._release(owner, job)
            raise
        job.pid = pid or 0
        with session.lock:
            session.jobs[job.id] = job
        threading.Thread(target=self._pump, args=(job, out_r, generation), name=f"sandboxd-bg-{job.id}",
                         daemon=True).start()
        return job

    def _launch(self, job: BackgroundJob, cwd: str, start: pb.ExecStart) -> tuple[int, int, int | None]:
        """The job's call started: (its output's read end, the sandbox generation, its pid)."""
        session = job.session
        env = environment.command_env(self._registry, self._fork, session, start)
        out_r, out_w = os.pipe2(os.O_CLOEXEC)
        null = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)
        generation = self._registry.begin_call(session)
        try:
            try:
                job.call_id, pid = self._fork.call(session.sandbox_name(generation), job.argv,
                                                   {**env, **session.extra_env},
                                                   cwd_inside(session.workspace, cwd), None, (null, out_w, out_w),
                                                   tag=background_tag(job.id, job.name), taps=(out_r,))
            finally:
                os.close(out_w)
                os.close(null)
        except BaseException:
            os.close(out_r)
            self._registry.end_call(session, generation)
            raise
        return out_r, generation, pid

    def _pump(self, job: BackgroundJob, out_r: int, generation: int) -> None:
        try:
            while True:
                data = os.read(out_r, CHUNK)
                if not data:
                    break
                job.append(data)
        finally:
            os.close(out_r)
            assert job.call_id is not None
            try:
                result = self._fork.wait(job.call_id)
            except Exception:  # noqa: BLE001 - the fork server went away: the job is over all the same
                result = ExitInfo(exit_code=None, signal=9, timed_out=False, wall_seconds=0.0, cpu_seconds=None,
                                  peak_memory_bytes=None, oom_killed=False)
            self._registry.call_ended(job.session)           # before a follower hears the job ended
            job.finish(result)
            self._registry.end_call(job.session, generation)

    def get(self, session: Session, job_id: str) -> BackgroundJob:
        with session.lock:
            job = session.jobs.get(job_id)
        if job is None:
            raise NotFound(f"no background process {job_id!r} in session {session.id!r}")
        return job

    def list(self, session: Session) -> list[BackgroundJob]:
        with session.lock:
            jobs = list(session.jobs.values())
        return sorted(jobs, key=lambda j: j.started_at)

    def stop(self, session: Session, job_id: str, timeout: float = 10.0) -> BackgroundJob:
        job = self.get(session, job_id)
        if job.result is None and job.call_id is not None:
            self._fork.cancel(job.call_id)
            with job._cond:                                    # noqa: SLF001 - same module family
                job._cond.wait_for(lambda: job.result is not None, timeout=timeout)
        return job
