"""A new daemon adopts what a surviving supervisor kept: sessions, running calls, ended calls.

At start the daemon attaches to the supervisor a previous daemon left (fork_client.ForkServer
.attach) and gets an ``Adoption``. After the registry restored the open sessions from the store
(sessions.lifecycle.restore), ``Adopter.adopt``:

- gives each restored session the sandbox the supervisor kept for it (its newest generation;
  an older one only while a call still runs in it): served again from the facts the fork server
  answered at its build (no rebuild, nothing looked up again), its services restarted
  (lifecycle.adopt_sandbox). A sandbox no open session claims (closed in the store, or built for
  a create the dead daemon never recorded) is closed;
- counts each call still running in its session (and as an untagged command, exec_contexts "":
  its client is gone, so no network question is put to another client's context alone) and
  follows it on a thread of its own until the
  supervisor reports its end (fork_client.ForkServer.wait_held), then records it as the first
  daemon would have: the call's ``ToolInvocationCompleted`` with its exit facts and the tails of
  its output (what no client saw), so the audit log has no "started" without an end; and in
  ``CallResults`` (for WaitCall / ``sandboxctl call result``);
- records the calls that ended while no daemon was attached the same way, at once.

A call's audit identity comes from its tag (``call_tag``), which the first daemon gave the fork
server with the call. A call without one (a file tool, the daemon's own) is only counted.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from sandboxd._record import Record
from sandboxd.audit.store import EventStore, EventType
from sandboxd.errors import SandboxdError
from sandboxd.service.background import BackgroundJob, adopted_job
from sandboxd.service.call_results import DAEMON_STOPPED, CallResults
from sandboxd.service.handover.tags import parse_tag
from sandboxd.service.quotas import owner_key
from sandboxd.service.sessions.registry import Session, SessionRegistry
from sandboxd.supervisor.fork_client import Adoption, ForkServer
from sandboxd.supervisor.fork_protocol import CallEnded, HeldCall
from sandboxd.supervisor.spawner import ExitInfo

log = logging.getLogger("sandboxd")

# What the audit event of an adopted call keeps of each output stream (its last bytes): its client
# never saw them; CallResults keeps the supervisor's whole tail (supervisor.tails.TAIL_BYTES).
AUDIT_TAIL_BYTES = 2048


def _split_name(name: str) -> tuple[str, int] | None:
    """A sandbox's name in the fork server (Session.sandbox_name: ``ID#GENERATION``) split."""
    session_id, _, generation = name.rpartition("#")
    return (session_id, int(generation)) if session_id and generation.isdigit() else None


class Adopted(Record):
    """What an adoption took over (the "serving" log line's and the figures' counts)."""

    sessions: int = 0
    calls_running: int = 0
    calls_ended: int = 0
    sandboxes_closed: int = 0


class Adopter:
    def __init__(self, registry: SessionRegistry, fork: ForkServer, store: EventStore, results: CallResults) -> None:
        self._registry, self._fork, self._store, self._results = registry, fork, store, results
        self._stopping: str | None = None             # why the daemon stops (None while it serves)

    def adopt(self, adoption: Adoption) -> Adopted:
        """Take over ``adoption`` (see the module's doc); the listeners it holds are closed here."""
        by_session: dict[str, list[tuple[int, str]]] = {}
        for name in adoption.sessions:
            split = _split_name(name)
            if split is not None:
                by_session.setdefault(split[0], []).append((split[1], name))
        running_in = {call.session for call in adoption.running}
        adopted = closed = 0
        placed: dict[str, tuple[Session, int]] = {}   # sandbox name -> its session, generation
        for name, info in adoption.sessions.items():
            split = _split_name(name)
            session = self._registry.find(split[0]) if split else None
            newest = max(generation for generation, _ in by_session[split[0]]) if split else 0
            current = split is not None and split[1] == newest
            if session is not None and split is not None and (current or name in running_in) and \
                    self._registry.adopt_sandbox(session, split[1], info, current):
                placed[name] = (session, split[1])
                adopted += current
                continue
            for fd in (info.proxy_listener, info.transparent_listener):
                if fd >= 0:
                    _close(fd)
            if session is None or not current:
                closed += 1
                self._close_quietly(name)
        for call in adoption.running:
            self._follow(call, placed.get(call.session))
        for ended in adoption.ended:
            split, tag = _split_name(ended.session), parse_tag(ended.tag)
            if split is not None and tag.get("call"):
                self._results.started(tag["call"], split[0], self._owner_of(split[0]))
            job = self._job(ended, placed.get(ended.session) or self._place_of(ended.session))
            self._record_end(ended, "it ended while no daemon was attached", job=job)
        return Adopted(adopted, len(adoption.running), len(adoption.ended), closed)

    def stopping(self, why: str) -> None:
        """The daemon stops (``why``: "handover" keeps every adopted call running for the next
        daemon, which adopts it again; anything else: they are killed with everything else)."""
        self._stopping = why

    # -- one call ----------------------------------------------------------------------------------

    def _place_of(self, name: str) -> "tuple[Session, int] | None":
        split = _split_name(name)
        session = self._registry.find(split[0]) if split is not None and self._registry is not None else None
        return (session, split[1]) if session is not None and split is not None else None

    @staticmethod
    def _job(call: "HeldCall | CallEnded", place: "tuple[Session, int] | None") -> BackgroundJob | None:
        """A background process of an open session listed again (ListBackground, ReadBackground)."""
        tag = parse_tag(call.tag)
        if tag.get("kind") != "background" or not tag.get("job") or place is None:
            return None
        pid = call.inner_pid or 0 if isinstance(call, HeldCall) else 0
        return adopted_job(place[0], tag["job"], tag.get("name", ""), pid, call.started_at, call.call)

    def _follow(self, call: HeldCall, place: "tuple[Session, int] | None") -> None:
        tag = parse_tag(call.tag)
        split = _split_name(call.session)
        session_id = split[0] if split else ""
        if place is not None:
            self._registry.adopt_call(*place)
            # Its client's stream went with the old daemon: whatever context it ran in, it counts
            # as untagged while it runs, so a network question (its connection's, as likely as
            # anyone's) is never put to a new client's context alone (Session.only_context).
            place[0].context_began("")
        if tag.get("call") and session_id:
            self._results.started(tag["call"], session_id, self._owner_of(session_id))
        job = self._job(call, place)
        threading.Thread(target=self._wait, args=(call, place, job), name=f"sandboxd-adopted-{call.call}",
                         daemon=True).start()

    def _wait(self, call: HeldCall, place: "tuple[Session, int] | None", job: BackgroundJob | None) -> None:
        try:
            try:
                ended = self._fork.wait_held(call.call)
            except SandboxdError as exc:
                if self._stopping == "handover":
                    return                            # it runs on: the next daemon adopts it again
                reason = f"the daemon stopped ({self._stopping})" if self._stopping else f"the supervisor is gone: {exc}"
                ended = CallEnded(call.call, None, 9, False, 0.0, None, None, False, call=call.call,
                                  session=call.session, started_at=call.started_at, tag=call.tag)
                self._record_end(ended, reason, failed=True, job=job)
                return
            self._record_end(ended, f"the daemon stopped ({self._stopping})" if self._stopping
                             else "it ran on while the daemon restarted", job=job)
        finally:
            if place is not None:
                session, generation = place
                session.context_ended("")
                if not self._stopping:
                    self._registry.call_ended(session)     # the git guard looks, as after any call
                self._registry.end_call(session, generation)

    def _record_end(self, ended: CallEnded, reason: str, failed: bool = False,
                    job: BackgroundJob | None = None) -> None:
        """The call's end in the audit log (as its first daemon would have written it) and in
        CallResults; a background process's in its job (its output's tail, how it ended); a call
        with neither only logged."""
        tag = parse_tag(ended.tag)
        split = _split_name(ended.session)
        out, err = ended.stdout_tail.encode("latin-1"), ended.stderr_tail.encode("latin-1")
        if job is not None:
            job.append(out + err)
            job.finish(ExitInfo(ended.exit_code, ended.signal, ended.timed_out, ended.wall_seconds,
                                ended.cpu_seconds, ended.peak_memory_bytes, ended.oom_killed))
        call_id = tag.get("call", "")
        if call_id:
            self._results.output(call_id, 1, out)
            self._results.output(call_id, 2, err)
            self._results.finished(call_id, ended.exit_code, ended.signal, ended.timed_out, _result_reason(reason))
        if not call_id or split is None:
            log.info("an adopted call ended", extra={"fields": {"fork_call": ended.call, "sandbox": ended.session,
                                                                 "exit_code": ended.exit_code, "signal": ended.signal}})
            return
        data: dict[str, Any] = {
            "exit_code": ended.exit_code or 0, "signal": ended.signal or 0, "timed_out": ended.timed_out,
            "wall_seconds": round(ended.wall_seconds, 6), "oom_killed": ended.oom_killed,
            "adopted": True, "reason": reason, "kind": tag.get("kind", "exec"),
            "stdout_tail": out[-AUDIT_TAIL_BYTES:].decode("utf-8", "replace"),
            "stderr_tail": err[-AUDIT_TAIL_BYTES:].decode("utf-8", "replace"),
            "output_dropped_bytes": ended.dropped}
        kind = EventType.TOOL_FAILED if failed else EventType.TOOL_COMPLETED
        if failed:
            data["error"] = reason
        try:
            self._store.append(split[0], kind, call_id=call_id, tool=tag.get("tool", ""), data=data)
        except Exception as exc:  # noqa: BLE001 - logged: the store refused (its owner's budget, a full disk)
            log.error("the end of an adopted call could not be recorded: %s", exc)

    def _owner_of(self, session_id: str) -> str:
        """The owner key (quotas.owner_key) of an open session; "" for one that is not open."""
        session = self._registry.find(session_id) if self._registry is not None else None
        return owner_key(session.owner) if session is not None else ""

    def _close_quietly(self, name: str) -> None:
        try:
            self._fork.close_session(name)
        except SandboxdError as exc:
            log.warning("closing the kept sandbox %s failed: %s", name, exc)


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def _result_reason(reason: str) -> str:
    """The word WaitCall's ``reason`` says for an adopted call's end (``reason``: the audit log's
    sentence): ``adopted`` (it ran on across a restart and ended by itself), ``daemon_stopped``,
    or ``supervisor_gone``."""
    if reason.startswith("it ran on"):
        return "adopted"
    return DAEMON_STOPPED if reason.startswith("the daemon stopped") else "supervisor_gone"
