"""The RPCs of the policy engine and the audit log: approvals, external tools (Authorize,
ReportToolResult), the tool list, events (watch and query) and standing rules."""

from __future__ import annotations

import json
import math
import os
import threading
from typing import Callable, Iterator

from sandboxd.audit.store import PERMISSION_NAMESPACE, Event, EventStore, EventType, MemoryRow
from sandboxd.errors import Forbidden, InvalidPolicy, NotFound, PermissionDenied
from sandboxd.policy.tools import BUILTIN_TOOLS, Category, Effect, Risk, check_tool_name, summary_of
from sandboxd.service.approvals import ApprovalGate, Granted, ToolCall, rule_key
from sandboxd.service.callers import Caller
from sandboxd.service.convert import check_text
from sandboxd.service.sessions.registry import SessionRegistry
from sandboxd.service.watch_filter import WatchFilter
from sandboxd.v1 import sandboxd_pb2 as pb

EFFECTS = {pb.POLICY_EFFECT_UNSPECIFIED: None, pb.EFFECT_READ_ONLY: Effect.READ_ONLY,
           pb.EFFECT_WORKSPACE_WRITE: Effect.WORKSPACE_WRITE, pb.EFFECT_NETWORK: Effect.NETWORK,
           pb.EFFECT_DESTRUCTIVE: Effect.DESTRUCTIVE, pb.EFFECT_UNKNOWN_COMMAND: Effect.UNKNOWN_COMMAND}
WATCH_POLL_SECONDS = 0.5


def denied_to_proto(error: PermissionDenied) -> pb.PermissionDenied:
    return pb.PermissionDenied(call_id=error.call_id, tool=error.tool, reason=error.reason or "", by=error.by,
                               detail=error.detail, message=str(error))


def event_to_proto(event: Event) -> pb.Event:
    return pb.Event(id=event.id, session_id=event.session_id, sequence=event.sequence, type=event.type,
                    time=event.time, call_id=event.call_id, tool=event.tool,
                    data_json=json.dumps(event.data, separators=(",", ":"), default=str), hash=event.hash,
                    prev_hash=event.prev_hash, session_prev_hash=event.session_prev_hash)


MAX_EVENT_ID = (1 << 63) - 1             # SQLite's integers
MAX_PAGE_SIZE = 1000


def _page_token(token: str) -> int:
    """The event id a page token names (a previous response's next_page_token)."""
    if not token:
        return 0
    if len(token) > 19 or not token.isdigit() or not token.isascii() or int(token) > MAX_EVENT_ID:
        raise InvalidPolicy(f"bad page_token {token[:40]!r}: pass next_page_token as given")
    return int(token)


class AuditService:
    def __init__(self, registry: SessionRegistry, gate: ApprovalGate) -> None:
        self._registry = registry
        self._store: EventStore = registry.store
        self._gate = gate
        self._external: dict[tuple[str, str], Granted] = {}
        self._lock = threading.Lock()

    # -- approvals -------------------------------------------------------------------------------

    def resolve(self, who: Caller, request: pb.ResolveApprovalRequest) -> pb.ResolveApprovalResponse:
        session = self._registry.get(who, request.session_id)
        return pb.ResolveApprovalResponse(decision=self._gate.resolve(session.id, request.call_id, request.decision,
                                                                      request.rule, who))

    def pending(self, who: Caller, session_id: str) -> pb.ListPendingApprovalsResponse:
        session = self._registry.get(who, session_id)
        return pb.ListPendingApprovalsResponse(approvals=[
            pb.PendingApproval(call_id=call_id, tool=call.tool, summary=call.summary, reason=reason or "",
                               risk=call.risk, arguments_json=json.dumps(call.arguments, default=str),
                               execution_context_id=call.execution_context_id,
                               proposal=self._gate.proposal(session.id, call_id))
            for call_id, call, reason in self._gate.pending(session.id)])

    # -- external tools --------------------------------------------------------------------------

    def authorize(self, who: Caller, request: pb.AuthorizeRequest,
                  still_wanted: Callable[[], bool]) -> pb.AuthorizeResponse:
        session = self._registry.get(who, request.session_id)
        # The session the tool runs in (an MCP gateway's upstream server's): its sandbox is what the
        # effect is judged against; found as this caller's, so another owner's is NOT_FOUND.
        runs_in = self._registry.get(who, request.runs_in_session_id) if request.runs_in_session_id else None
        check_tool_name(request.tool)
        check_text(request.execution_context_id, "execution_context_id")   # kept with a held call: bounded
        if request.tool in BUILTIN_TOOLS:
            raise InvalidPolicy(f"{request.tool} is a built-in tool: call its RPC, which is authorized itself")
        if request.effect not in EFFECTS:
            raise InvalidPolicy(f"unknown effect {request.effect}")
        if request.risk and request.risk not in (Risk.LOW, Risk.MEDIUM, Risk.HIGH):
            raise InvalidPolicy(f"unknown risk {request.risk!r}: use low, medium or high")
        try:
            arguments = json.loads(request.arguments_json) if request.arguments_json else {}
        except RecursionError:
            raise InvalidPolicy("arguments_json is nested too deeply: flatten it") from None
        except ValueError as exc:
            raise InvalidPolicy(f"arguments_json is not JSON: {exc}") from None
        summary = summary_of(request.tool, command=request.command)
        call = ToolCall(tool=request.tool, effect=EFFECTS[request.effect], category=Category.EXTERNAL,
                        arguments={"arguments": arguments, "command": request.command} if request.command
                        else {"arguments": arguments},
                        summary=summary, risk=request.risk or Risk.HIGH,
                        execution_context_id=request.execution_context_id, mcp_server=request.mcp_server,
                        untrusted_mcp=bool(request.mcp_server) and not request.server_trusted,
                        runs_in_session=runs_in.id if runs_in is not None else "",
                        runs_in_policy=runs_in.policy if runs_in is not None else None)
        try:
            granted = self._gate.authorize(session, call, still_wanted=still_wanted)
        except PermissionDenied as denied:
            return pb.AuthorizeResponse(allowed=False, call_id=denied.call_id, reason=denied.reason or "",
                                        denied=denied_to_proto(denied))
        with self._lock:
            self._external[(session.id, granted.call_id)] = granted
        return pb.AuthorizeResponse(allowed=True, call_id=granted.call_id, granted_by=granted.granted_by,
                                    reason=granted.reason or "")

    def report(self, who: Caller, request: pb.ReportToolResultRequest) -> pb.ReportToolResultResponse:
        session = self._registry.get(who, request.session_id)
        with self._lock:
            granted = self._external.pop((session.id, request.call_id), None)
        if granted is None:
            raise NotFound(f"no authorized call {request.call_id!r} without a result in session {session.id!r}")
        try:
            details = json.loads(request.result_json) if request.result_json else {}
        except (ValueError, RecursionError) as exc:
            with self._lock:
                self._external[(session.id, request.call_id)] = granted
            raise InvalidPolicy(f"result_json is not JSON (or nested too deeply): {exc}") from None
        if request.ok:
            granted.completed({"result": details})
        else:
            granted.failed(request.error or "the tool reported a failure")
        return pb.ReportToolResultResponse()

    def forget_session(self, session_id: str) -> None:
        with self._lock:
            for key in [k for k in self._external if k[0] == session_id]:
                self._external.pop(key).failed("the session was closed before a result was reported")

    # -- tools -----------------------------------------------------------------------------------

    def tools(self, who: Caller, session_id: str) -> pb.ListToolsResponse:
        session = self._registry.get(who, session_id)
        return pb.ListToolsResponse(tools=[
            pb.ToolInfo(name=spec.name, description=spec.description, risk=spec.risk, effect=spec.effect or "",
                        category=spec.category)
            for spec in BUILTIN_TOOLS.values() if spec.category not in session.rules.hidden])

    # -- events ----------------------------------------------------------------------------------

    def query(self, who: Caller, request: pb.QueryEventsRequest) -> pb.QueryEventsResponse:
        visible = self._registry.visible_ids(who, request.session_id)
        after = _page_token(request.page_token)
        for name in ("since", "until"):
            if not math.isfinite(getattr(request, name)) or getattr(request, name) < 0:
                raise InvalidPolicy(f"{name} must be a finite time in seconds since the epoch (0: no bound)")
        if request.page_size > MAX_PAGE_SIZE:
            raise InvalidPolicy(f"page_size {request.page_size} is above the maximum of {MAX_PAGE_SIZE}")
        size = request.page_size or 100
        events = self._store.query(session_ids=visible, types=list(request.types) or None, tool=request.tool,
                                   since=request.since or None, until=request.until or None, after_id=after,
                                   limit=size)
        token = str(events[-1].id) if len(events) == min(max(size, 1), 1000) else ""
        return pb.QueryEventsResponse(events=[event_to_proto(e) for e in events], next_page_token=token)

    def watch(self, who: Caller, request: pb.WatchEventsRequest,
              active: Callable[[], bool]) -> Iterator[pb.Event]:
        """Past events after ``from_sequence`` and ``after_id``, then live ones until the caller leaves."""
        if request.from_sequence > MAX_EVENT_ID:
            raise InvalidPolicy(f"from_sequence {request.from_sequence} is past any event (at most 2^63-1)")
        if request.after_id > MAX_EVENT_ID:
            raise InvalidPolicy(f"after_id {request.after_id} is past any event (at most 2^63-1): pass the id "
                                "of the last event you saw")
        after_id = int(request.after_id)
        visible = self._registry.visible_ids(who, request.session_id)
        types = set(request.types)
        unknown = types - set(EventType.ALL)
        if unknown:
            raise InvalidPolicy(f"unknown event type(s) {sorted(unknown)}")
        single = request.session_id or None
        wants = WatchFilter(self._store, who, visible, types=types, after_id=after_id, single=single,
                            from_sequence=int(request.from_sequence))

        subscription = self._store.subscribe(wants)
        try:
            after = max(after_id, 0 if single else int(request.from_sequence))
            while True:                                   # the past, up to the subscription's start
                page = self._store.query(session_ids=[single] if single else visible, types=list(types) or None,
                                         after_id=after, limit=1000)
                page = [e for e in page if e.id <= subscription.high_water]
                for event in page:
                    if wants(event):
                        yield event_to_proto(event)
                if len(page) < 1000:
                    break
                after = page[-1].id
            while active():                               # then live
                if subscription.overflowed:
                    raise InvalidPolicy("the watcher fell too far behind: watch again from the last sequence seen")
                live = subscription.next(WATCH_POLL_SECONDS)
                if live is not None:
                    yield event_to_proto(live)
        finally:
            self._store.unsubscribe(subscription)

    # -- standing rules --------------------------------------------------------------------------
    # A rule is its maker's: (uid, TLS principal). It applies only to that owner's sessions (see
    # ApprovalGate._remembered). Adding needs a workspace the caller could write; listing and
    # removing one's own rules need only the path. Root and the admin group list every owner's
    # rules and remove any by naming owner_uid; they cannot make a rule apply to someone else.

    def add_rule(self, who: Caller, rule: pb.StandingRule) -> pb.StandingRule:
        workspace = self._registry.check_workspace(who, rule.workspace)
        check_tool_name(rule.tool)
        if rule.HasField("owner_uid") and (rule.owner_uid, rule.owner_principal) != (who.uid, who.principal):
            raise InvalidPolicy("a standing rule is always its caller's own: leave owner_uid and owner_principal "
                                "unset (a rule for another user is that user's to add)")
        self._store.admit(who.uid, who.principal)          # the rule's row is spent from the owner's budget
        self._store.remember(PERMISSION_NAMESPACE, workspace, rule_key(rule.tool), {"tool": rule.tool,
                                                                                    "by_uid": who.uid},
                             owner_uid=who.uid, owner_principal=who.principal)
        row = self._store.recall(PERMISSION_NAMESPACE, workspace, owner_uid=who.uid, owner_principal=who.principal)
        return next(_rule_to_proto(r) for r in row if r.key == rule_key(rule.tool))

    def rules(self, who: Caller, workspace: str) -> pb.ListStandingRulesResponse:
        """The caller's own rules; every owner's for an administrator."""
        where = _rule_path(workspace) if workspace else None
        if who.is_admin:
            rows = self._store.recall(PERMISSION_NAMESPACE, where)
        else:
            rows = self._store.recall(PERMISSION_NAMESPACE, where, owner_uid=who.uid, owner_principal=who.principal)
        return pb.ListStandingRulesResponse(rules=[_rule_to_proto(r) for r in rows])

    def remove_rule(self, who: Caller, rule: pb.StandingRule) -> pb.RemoveStandingRuleResponse:
        workspace = _rule_path(rule.workspace)
        owner_uid, owner_principal = who.uid, who.principal
        if rule.HasField("owner_uid") and (rule.owner_uid, rule.owner_principal) != (who.uid, who.principal):
            if not who.is_admin:
                raise Forbidden("only root and the admin group may remove another user's standing rule: "
                                        "leave owner_uid unset to remove your own")
            owner_uid, owner_principal = rule.owner_uid, rule.owner_principal
        return pb.RemoveStandingRuleResponse(removed=self._store.forget(
            PERMISSION_NAMESPACE, workspace, rule_key(rule.tool), owner_uid=owner_uid,
            owner_principal=owner_principal))


def _rule_path(workspace: str) -> str:
    """A workspace as rules store it: the real path AddStandingRule's lookup found, as its caller
    (ListStandingRules shows it), named as it is. Never looked up here, as root: a path on a file
    system that does not answer would hold this thread, and symlinks would be followed with root's
    rights."""
    if not workspace.startswith("/") or "\0" in workspace:
        raise InvalidPolicy(f"workspace {workspace!r} must be an absolute path")
    return os.path.normpath(workspace)


def _rule_to_proto(row: MemoryRow) -> pb.StandingRule:
    return pb.StandingRule(workspace=row.workspace, tool=str(row.value.get("tool", "")), created_at=row.created_at,
                           owner_uid=row.owner_uid if row.owner_uid >= 0 else None,
                           owner_principal=row.owner_principal)
