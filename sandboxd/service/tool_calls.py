"""Each built-in RPC as the policy engine sees it: which tool it is, its effect, its arguments
and the one-line summary an approval card shows. One function per kind of call.

Each carries the request's execution_context_id (the client's tag for the agent turn or tool
call that made it): a held call's PendingApproval, PermissionRequested event and audit record name
it, so that the client that made the call, and no other on the same session, asks about it."""

from __future__ import annotations

import shlex

from sandboxd.policy.tools import BUILTIN_TOOLS, Classified, Effect, classify_command, summary_of
from sandboxd.service import environment
from sandboxd.service.approvals import ToolCall
from sandboxd.service.background import BackgroundJob
from sandboxd.service.convert import check_text
from sandboxd.service.file_calls import write_effect, write_scope
from sandboxd.service.sessions.registry import Session
from sandboxd.v1 import sandboxd_pb2 as pb


def _call(name: str, effect: str | None, arguments: dict[str, object], summary: str, *, note: str = "",
          context_id: str = "") -> ToolCall:
    spec = BUILTIN_TOOLS[name]
    check_text(context_id, "execution_context_id")     # kept with a held call and its events: bounded
    return ToolCall(tool=name, effect=effect, category=spec.category, arguments=arguments, summary=summary,
                    risk=spec.risk, execution_context_id=context_id, note=note)


def command(session: Session, tool: str, argv: list[str], cwd: str, start: pb.ExecStart, *,
            context_id: str = "") -> ToolCall:
    """shell.exec or monitor.start: the effect comes from the command and the environment it
    carries. That environment is part of the call: the variables the call sets (its overlay, or
    the whole env a client sent) are in its arguments, so every approval card shows them and the
    audit log records them (the session's own env is not: its values stay root-only, and only its
    names are recorded, when the session is created)."""
    found = classify_command(argv, cwd=cwd, scope=write_scope(session),
                             env=environment.for_classifier(session, start))
    if start.HasField("terminal") and found.effect in (Effect.READ_ONLY, Effect.WORKSPACE_WRITE):
        # On a terminal the caller's keystrokes drive the program: git starts its pager there, and
        # less runs a shell command for "!cmd". What the program will be made to do is not in its argv.
        found = Classified(Effect.UNKNOWN_COMMAND, "it runs on a terminal, where the caller's keystrokes drive "
                                                   "it (a pager's shell escape): such a call is not vouched for")
    arguments: dict[str, object] = {"argv": argv, "cwd": cwd}
    carried = dict(start.env or start.env_overlay)
    if carried:
        arguments["env"] = carried
    return _call(tool, found.effect, arguments, summary_of(tool, argv), context_id=context_id, note=found.note)


def read(session: Session, tool: str, path: str, *, context_id: str = "", **extra: object) -> ToolCall:
    """fs.read, fs.list, search, monitor.list: read-only (their fixed effect)."""
    return _call(tool, BUILTIN_TOOLS[tool].effect, {"path": path, **extra}, summary_of(tool, path=path),
                 context_id=context_id)


def stop(session: Session, job: BackgroundJob, *, context_id: str = "") -> ToolCall:
    """monitor.stop: its card names what it stops, ``Stop: ID (NAME: ARGV)``, not the bare tool:
    a person asked to stop "a78ec51560a1" cannot tell the test server from the database."""
    command = shlex.join(job.argv)
    shown = f"{job.name}: {command}" if job.name and job.name != command else command
    return _call("monitor.stop", BUILTIN_TOOLS["monitor.stop"].effect, {"path": "", "id": job.id, "name": job.name},
                 summary_of("monitor.stop", path=f"{job.id} ({shown})"), context_id=context_id)


def write(session: Session, tool: str, paths: list[str], *, context_id: str = "", **extra: object) -> ToolCall:
    """fs.write: workspace-write, or destructive outside the writable roots."""
    effect, note = write_effect(session, paths)
    return _call(tool, effect, {"paths": paths, **extra}, summary_of(tool, path=", ".join(paths)), note=note,
                 context_id=context_id)


def patch(session: Session, targets: list[str], changes: list[str], *, context_id: str = "") -> ToolCall:
    """patch.apply: judged as a write of every target; its summary (and, when the summary is cut,
    the card's ``changes`` line: policy.approval_card) says what the patch does to each path."""
    effect, note = write_effect(session, targets)
    return _call("patch.apply", effect, {"paths": targets, "changes": changes},
                 summary_of("patch.apply", path="; ".join(changes)), note=note, context_id=context_id)
