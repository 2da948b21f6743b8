"""The gRPC servicer: each RPC checks who is calling, does its work through the session
registry and the fork server, and turns any error into a status (sandboxd.service.status)."""

from __future__ import annotations

import time
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, NoReturn, TypeVar

import grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2

from sandboxd.errors import Forbidden, InvalidPolicy, NotFound, WrongState
from sandboxd.policy.network import CredentialState
from sandboxd.policy.session_defaults import SessionDefaults
from sandboxd.kernel import ancestor_limits
from sandboxd.kernel.pod_placement import UNIFIED
from sandboxd.service import ancestor_fit, convert, environment, exec_call, file_calls, patch_search, tool_calls
from sandboxd.service.approvals import ApprovalGate, ToolCall
from sandboxd.service.audit_calls import AuditService
from sandboxd.service.audit_verify import AuditVerification
from sandboxd.service.handover.tags import call_tag
from sandboxd.service.background import BackgroundJob, BackgroundJobs
from sandboxd.service.call_results import FINISHED, MAX_WAIT_SECONDS, CallRecord, CallResults
from sandboxd.service.drain import DrainGate
from sandboxd.service.callers import Caller, Callers
from sandboxd.network.front_door import FrontDoor
from sandboxd.service.quotas import CALLS, REQUESTS, STREAMS, Quotas, owner_key
from sandboxd.service.review_calls import ReviewCalls
from sandboxd.service.sandbox_hooks import WhenClosed
from sandboxd.service.sessions.placement import placement_for
from sandboxd.service.sessions.registry import Session, SessionRegistry, cwd_inside
from sandboxd.service.status import abort, code_for
from sandboxd.supervisor.fork_client import ForkServer
from sandboxd.v1 import sandboxd_pb2 as pb
from sandboxd.v1 import sandboxd_pb2_grpc as pb_grpc


if TYPE_CHECKING:
    from sandboxd.service.approval_channels import ApprovalChannels
    from sandboxd.service.daemon_status import ConnectionCounts
    from sandboxd.service.metrics import Metrics
    from sandboxd.service.sessions.tied import TiedSessions

R = TypeVar("R")   # what a unary call's work returns
MAX_DRAIN_SECONDS = 86400


def session_to_proto(session: Session, closed_at: float = 0.0) -> pb.Session:
    return pb.Session(
        id=session.id, workspace=session.workspace, sandbox_policy=convert.policy_to_proto(session.policy),
        approval_policy=convert.approval_to_proto(session.approval),
        limits=convert.limits_to_proto(session.limits), labels=session.labels, owner_uid=session.owner.uid,
        owner_gid=session.owner.gid, owner_principal=session.owner.principal, created_at=session.created_at, running_calls=session.running_calls,
        sandbox_generation=session.generation, permission_mode=session.rules.mode, closed_at=closed_at or 0.0,
        sandbox_ready=session.sandbox_ready and not closed_at, env_names=sorted(session.env), review=session.review,
        credential_states=convert.credential_states_to_proto(_credential_states(session, closed_at)))


def _credential_states(session: Session, closed_at: float) -> list[CredentialState]:
    """What a person may see of its credentials (never a secret); a closed one holds none."""
    with session.lock:
        credentials = session.credentials
    if credentials is not None and not closed_at:
        return credentials.states()
    return [CredentialState(name=spec.name, upstream=spec.upstream,
                            source=f"daemon:{session.daemon_secrets[spec.name]}" if spec.name in session.daemon_secrets
                            else "caller", usable=False)
            for spec in session.policy.network_rules.credentials]


def job_to_proto(job: BackgroundJob) -> pb.BackgroundProcess:
    message = pb.BackgroundProcess(id=job.id, session_id=job.session.id, name=job.name, argv=job.argv, pid=job.pid,
                                   running=job.result is None, output_bytes=job.total, started_at=job.started_at)
    if job.result is not None:
        message.result.CopyFrom(exec_call.result_to_proto(job.result, truncated=False))
    return message


class SandboxServicer(pb_grpc.SandboxServicer):
    def __init__(self, registry: SessionRegistry, fork: ForkServer, callers: "Callers | FrontDoor",
                 gate: ApprovalGate, metrics: "Metrics | None" = None,
                 defaults: "SessionDefaults | None" = None, quotas: Quotas | None = None,
                 connections: "ConnectionCounts | None" = None, tied: "TiedSessions | None" = None,
                 channels: "ApprovalChannels | None" = None, results: CallResults | None = None,
                 drain: DrainGate | None = None, on_drain: "Callable[[float | None], tuple[int, float]] | None" = None,
                 ) -> None:
        self._tied, self._channels = tied, channels       # close_with_caller; RegisterApprovalChannel
        self._results = results if results is not None else CallResults(registry.store)   # WaitCall
        # While draining, no new session or call starts (service.drain); on_drain(timeout or None)
        # begins one (the daemon's): (running calls, the timeout it drains with).
        self._drain, self._on_drain = drain or DrainGate(), on_drain
        self._quotas = quotas or registry.quotas
        self._metrics = metrics
        self._defaults = defaults or SessionDefaults()
        self._registry = registry
        self._fork = fork
        self._callers = callers if isinstance(callers, Callers) else Callers(callers)
        self._jobs = BackgroundJobs(registry, fork, self._quotas.limits.background_per_uid)
        self._gate = gate
        self._connections = connections                   # the front door's counts, for GetStatus
        self._audit = AuditService(registry, gate)
        self._verification = AuditVerification(registry)
        self._review = ReviewCalls(registry, fork, registry.store, max_checkpoints=self._defaults.max_checkpoints)
        for forget in (gate.forget_session, self._audit.forget_session, environment.forget_session):
            registry.add_hooks(WhenClosed(forget))            # a closed session is forgotten (sandbox_hooks)

    def _abort(self, context: grpc.ServicerContext, error: BaseException) -> NoReturn:
        """status.abort, the refusal counted first (metrics: a quota's, by its key)."""
        if self._metrics is not None:
            self._metrics.refused(code_for(error).name, str(error))
        abort(context, error)

    def _unary(self, context: grpc.ServicerContext, work: Callable[[Caller], R], kind: str = REQUESTS) -> R:
        """A unary RPC: ``work`` for the caller, holding a slot of ``kind`` (quotas: every RPC holds
        one, so no owner holds more workers than its quotas, whatever it calls): REQUESTS, or CALLS
        for the built-in tools and Authorize, which may run or wait for approval for minutes."""
        try:
            who = self._callers(context)
            with self._quotas.hold(who, kind):
                return work(who)
        except Exception as error:  # noqa: BLE001 - mapped to a status, never a traceback
            self._abort(context, error)

    def _tool(self, context: grpc.ServicerContext, session: Session, call: ToolCall, body: Callable[[], R]) -> R:
        """Run a built-in tool call through the policy engine: decided, recorded, maybe held for
        approval (PermissionDenied if refused), then run; its end is recorded too. Its RPC holds one
        of the caller's running calls meanwhile (``_unary(..., CALLS)``)."""
        with self._gate.authorize(session, call, still_wanted=context.is_active):
            return body()

    def CreateSession(self, request: pb.CreateSessionRequest, context: grpc.ServicerContext) -> pb.Session:
        def work(who: Caller) -> pb.Session:
            self._drain.refuse_new("new session")
            convert.check_path(request.workspace, "workspace")
            policy, approval, rules = convert.axes_from_create_request(request, self._defaults)
            labels = convert.labels_from_proto(request.labels)
            if self._tied is not None:
                labels = self._tied.labels(who, labels, request.close_with_caller)
            elif request.close_with_caller:
                raise InvalidPolicy("this daemon cannot close a session with its caller")
            # Unset: the daemon's review.default, for the sessions that have writes to review.
            review = request.review if request.HasField("review") else (
                self._defaults.review and policy.workspace_writable)
            secrets = convert.credential_secrets_from_proto(request.credential_secrets, policy)
            # A caller in a pod (limits.charge_pods): its session goes in the pod, held to the pod's limits.
            pod, labels = placement_for(who, labels, self._defaults.charge_pods)
            above = (ancestor_limits.limits_above(unified_group=pod.get(UNIFIED, "/"), v1_groups=pod) if pod
                     else ancestor_limits.limits_above())
            limits, limit_notes = ancestor_fit.fit(convert.limits_from_proto(request.limits, self._defaults),
                                                   request.limits.memory_bytes, request.limits.pids, above)
            session = self._registry.create(who, request.workspace, policy, approval, limits,
                                            labels, rules, env=environment.session_env(request.env), review=review,
                                            secrets=secrets, limit_notes=limit_notes)
            if self._tied is not None:
                self._tied.tie(session)
            return session_to_proto(session)
        return self._unary(context, work)

    def GetSession(self, request: pb.GetSessionRequest, context: grpc.ServicerContext) -> pb.Session:
        return self._unary(context, lambda who: session_to_proto(self._registry.get(who, request.session_id, seeing=True)))

    def ListSessions(self, request: pb.ListSessionsRequest, context: grpc.ServicerContext) -> pb.ListSessionsResponse:
        def work(who: Caller) -> pb.ListSessionsResponse:
            sessions = [session_to_proto(s) for s in self._registry.list(who)]
            if request.include_closed:
                sessions += [session_to_proto(s, closed_at) for s, closed_at in self._registry.list_closed(who)]
            return pb.ListSessionsResponse(sessions=sessions)
        return self._unary(context, work)

    def CloseSession(self, request: pb.CloseSessionRequest, context: grpc.ServicerContext) -> pb.CloseSessionResponse:
        def work(who: Caller) -> pb.CloseSessionResponse:
            self._registry.close(who, request.session_id)
            return pb.CloseSessionResponse()
        return self._unary(context, work)

    def UpdateSessionPolicy(self, request: pb.UpdateSessionPolicyRequest,
                            context: grpc.ServicerContext) -> pb.Session:
        def work(who: Caller) -> pb.Session:
            policy = (convert.policy_from_proto(request.sandbox_policy)
                      if request.HasField("sandbox_policy") else None)
            approval = (convert.approval_from_proto(request.approval_policy)
                        if request.approval_policy != pb.APPROVAL_POLICY_UNSPECIFIED else None)
            secrets = None
            if request.credential_secrets or (policy is not None and policy.credentials):
                session = self._registry.get(who, request.session_id)
                with session.lock:
                    target, held = policy or session.policy, session.credentials
                # A secret kept follows the whole credential (credential_vault): only unchanged ones.
                known = held.known_names(target.network_rules.credentials) if held is not None else frozenset()
                secrets = convert.credential_secrets_from_proto(request.credential_secrets, target, known)
                policy = target
            return session_to_proto(self._registry.update_policy(who, request.session_id, policy, approval, secrets))
        return self._unary(context, work)

    # -- review mode (service/review_calls.py): each holds one of the caller's CALLS slots, as a
    #    change set's listing or apply may take a while (the fork server's child does the work).

    def ListChanges(self, request: pb.ListChangesRequest, context: grpc.ServicerContext) -> pb.ListChangesResponse:
        return self._unary(context, lambda who: self._review.list(who, request), CALLS)

    def DiffChanges(self, request: pb.DiffChangesRequest, context: grpc.ServicerContext) -> pb.DiffChangesResponse:
        return self._unary(context, lambda who: self._review.diff(who, request), CALLS)

    def ApplyChanges(self, request: pb.ApplyChangesRequest,
                     context: grpc.ServicerContext) -> pb.ApplyChangesResponse:
        return self._unary(context, lambda who: self._review.apply(who, request), CALLS)

    def DiscardChanges(self, request: pb.DiscardChangesRequest,
                       context: grpc.ServicerContext) -> pb.DiscardChangesResponse:
        return self._unary(context, lambda who: self._review.discard(who, request), CALLS)

    def CreateCheckpoint(self, request: pb.CreateCheckpointRequest, context: grpc.ServicerContext) -> pb.Checkpoint:
        return self._unary(context, lambda who: self._review.create_checkpoint(who, request), CALLS)

    def ListCheckpoints(self, request: pb.ListCheckpointsRequest,
                        context: grpc.ServicerContext) -> pb.ListCheckpointsResponse:
        return self._unary(context, lambda who: self._review.list_checkpoints(who, request), CALLS)

    def RollbackChanges(self, request: pb.RollbackChangesRequest,
                        context: grpc.ServicerContext) -> pb.RollbackChangesResponse:
        return self._unary(context, lambda who: self._review.rollback(who, request), CALLS)

    def ReadFile(self, request: pb.ReadFileRequest, context: grpc.ServicerContext) -> pb.ReadFileResponse:
        def work(who: Caller) -> pb.ReadFileResponse:
            self._drain.refuse_new("new call")
            session = self._registry.get(who, request.session_id)
            limit = file_calls.read_limit(request.max_bytes)
            path = file_calls.resolve(session, request.path)
            code, data = self._tool(context, session, tool_calls.read(
                session, "fs.read", path, context_id=request.execution_context_id), lambda: (
                file_calls.run_tool(self._registry, self._fork, session, {
                    "op": "read", "path": path, "max_bytes": limit}, limit=limit)))
            return pb.ReadFileResponse(data=data, truncated=code == 3)
        return self._unary(context, work, CALLS)

    def WriteFile(self, request: pb.WriteFileRequest, context: grpc.ServicerContext) -> pb.WriteFileResponse:
        def work(who: Caller) -> pb.WriteFileResponse:
            self._drain.refuse_new("new call")
            session = self._registry.get(who, request.session_id)
            path = file_calls.resolve(session, request.path)
            if request.mode > 0o7777:
                raise InvalidPolicy(f"mode {request.mode:o} is not a permission mode (at most 7777 octal)")
            if request.mode & 0o6000:                      # S_ISUID | S_ISGID
                raise InvalidPolicy(f"mode {request.mode:o} has the set-uid or set-gid bit: a file written "
                                    f"through the daemon may not have them (use {request.mode & 0o1777:o})")
            self._registry.ready(session)                 # its paths judged on what was built
            # The card shows how much it writes and, when given, the mode (an executable script).
            given_mode = {"mode": request.mode} if request.mode else {}
            call = tool_calls.write(session, "fs.write", [path], bytes=len(request.data), **given_mode,
                                    context_id=request.execution_context_id)
            _, out = self._tool(context, session, call, lambda: file_calls.run_tool(
                self._registry, self._fork, session, {
                    "op": "write", "path": path, "mode": request.mode, "create_parents": request.create_parents},
                data=request.data))
            return pb.WriteFileResponse(bytes_written=int(out or b"0"))
        return self._unary(context, work, CALLS)

    def ListDir(self, request: pb.ListDirRequest, context: grpc.ServicerContext) -> pb.ListDirResponse:
        def work(who: Caller) -> pb.ListDirResponse:
            self._drain.refuse_new("new call")
            session = self._registry.get(who, request.session_id)
            path = file_calls.resolve(session, request.path)
            _, out = self._tool(context, session, tool_calls.read(
                session, "fs.list", path, context_id=request.execution_context_id), lambda: (
                file_calls.run_tool(self._registry, self._fork, session, {"op": "list", "path": path})))
            return pb.ListDirResponse(entries=file_calls.parse_listing(out))
        return self._unary(context, work, CALLS)

    def ApplyPatch(self, request: pb.ApplyPatchRequest, context: grpc.ServicerContext) -> pb.ApplyPatchResponse:
        def work(who: Caller) -> pb.ApplyPatchResponse:
            self._drain.refuse_new("new call")
            session = self._registry.get(who, request.session_id)
            # every path git would write (renames, copies, modes, creations too), each judged and shown
            files, strip = patch_search.patched_files(request.patch, request.strip)
            targets = [file_calls.resolve(session, f.path) for f in files]
            self._registry.ready(session)
            return pb.ApplyPatchResponse(files=self._tool(
                context, session, tool_calls.patch(session, targets, [f"{f.path}: {f.action}" for f in files],
                                                   context_id=request.execution_context_id),
                lambda: patch_search.apply_patch(self._registry, self._fork, session, request.patch, files, strip)))
        return self._unary(context, work, CALLS)

    def Search(self, request: pb.SearchRequest, context: grpc.ServicerContext) -> pb.SearchResponse:
        def work(who: Caller) -> pb.SearchResponse:
            self._drain.refuse_new("new call")
            session = self._registry.get(who, request.session_id)
            call = tool_calls.read(session, "search", file_calls.resolve(session, request.path),
                                   pattern=request.pattern, context_id=request.execution_context_id)
            return self._tool(context, session, call, lambda: patch_search.search(
                self._registry, self._fork, session, request.pattern, request.path, request.max_results,
                request.case_insensitive, request.engine))
        return self._unary(context, work, CALLS)

    def StartBackground(self, request: pb.StartBackgroundRequest, context: grpc.ServicerContext) -> pb.BackgroundProcess:
        def work(who: Caller) -> pb.BackgroundProcess:
            self._drain.refuse_new("new call")
            session = self._registry.get(who, request.session_id)
            start = pb.ExecStart(argv=request.argv, shell=request.shell, env=request.env,
                                 env_overlay=request.env_overlay, caller_env=request.caller_env)
            argv = exec_call.command_of(start)
            exec_call.check_start(start, argv, session)
            convert.check_text(request.name, "name")
            self._registry.ready(session)
            call = tool_calls.command(session, "monitor.start", argv,
                                      cwd_inside(session.workspace, convert.check_path(request.cwd, "cwd")), start,
                                      context_id=request.execution_context_id)
            return job_to_proto(self._tool(context, session, call, lambda: self._jobs.start(
                session, argv, request.cwd, start, request.name)))
        return self._unary(context, work, CALLS)

    def ListBackground(self, request: pb.ListBackgroundRequest,
                       context: grpc.ServicerContext) -> pb.ListBackgroundResponse:
        def work(who: Caller) -> pb.ListBackgroundResponse:
            session = self._registry.get(who, request.session_id)
            jobs = self._tool(context, session, tool_calls.read(session, "monitor.list", "",
                                                                 context_id=request.execution_context_id),
                              lambda: self._jobs.list(session))
            return pb.ListBackgroundResponse(processes=[job_to_proto(j) for j in jobs])
        return self._unary(context, work, CALLS)

    def StopBackground(self, request: pb.StopBackgroundRequest, context: grpc.ServicerContext) -> pb.BackgroundProcess:
        def work(who: Caller) -> pb.BackgroundProcess:
            session = self._registry.get(who, request.session_id)
            call = tool_calls.stop(session, self._jobs.get(session, request.id), context_id=request.execution_context_id)
            return job_to_proto(self._tool(context, session, call, lambda: self._jobs.stop(session, request.id)))
        return self._unary(context, work, CALLS)

    def ReadBackgroundOutput(self, request: pb.ReadBackgroundOutputRequest,
                             context: grpc.ServicerContext) -> Iterator[pb.BackgroundOutput]:
        try:
            who = self._callers(context)
            job = self._jobs.get(self._registry.get(who, request.session_id), request.id)
            with self._quotas.hold(who, STREAMS if request.follow else CALLS):
                for offset, data, dropped in job.read(request.offset, request.follow, context.is_active):
                    yield pb.BackgroundOutput(offset=offset, data=data, dropped=dropped)
        except Exception as error:  # noqa: BLE001 - mapped to a status, never a traceback
            self._abort(context, error)

    def Exec(self, request_iterator: Iterator[pb.ExecRequest],
             context: grpc.ServicerContext) -> Iterator[pb.ExecResponse]:
        yield from self._exec_rpc(context, None, request_iterator)

    def Run(self, request: pb.ExecStart, context: grpc.ServicerContext) -> Iterator[pb.ExecResponse]:
        """Exec without a request stream: the same path (_exec), with nothing to read after `start`."""
        yield from self._exec_rpc(context, request, None)

    def _exec_rpc(self, context: grpc.ServicerContext, start: pb.ExecStart | None,
                  request_iterator: Iterator[pb.ExecRequest] | None) -> Iterator[pb.ExecResponse]:
        received = time.monotonic()
        try:
            who = self._callers(context)
            yield from self._exec(who, start, request_iterator, context, received)
        except Exception as error:  # noqa: BLE001 - mapped to a status, never a traceback
            self._abort(context, error)

    def _exec(self, who: Caller, start: pb.ExecStart | None, request_iterator: Iterator[pb.ExecRequest] | None,
              context: grpc.ServicerContext, received: float) -> Iterator[pb.ExecResponse]:
        """Exec (``start`` None: it is the stream's first message) or Run (``request_iterator`` None)."""
        self._drain.refuse_new("new call")
        with self._quotas.hold(who, CALLS), ExitStack() as terminal:
            if start is None:
                assert request_iterator is not None
                first = next(request_iterator, None)
                if first is None or first.WhichOneof("kind") != "start":
                    raise InvalidPolicy("the first Exec message must be `start` (session, argv or shell, ...)")
                start = first.start
            session = self._registry.get(who, start.session_id)
            argv, cwd = exec_call.command_of(start), cwd_inside(session.workspace, convert.check_path(start.cwd, "cwd"))
            exec_call.check_start(start, argv, session)
            if request_iterator is None:
                exec_call.check_unstreamed(start)
            if start.HasField("terminal"):                # a pty of its session's devpts, counted apart too
                terminal.enter_context(self._quotas.terminal(who))
            self._registry.ready(session)
            call = tool_calls.command(session, "shell.exec", argv, cwd, start, context_id=start.execution_context_id)
            with self._gate.authorize(session, call, still_wanted=context.is_active) as granted:
                if start.checkpoint:                      # a point to roll this call back to
                    self._review.checkpoint_call(session, granted.call_id, call.summary)
                # Its network questions are shown to this caller (service.network_questions).
                terminal.enter_context(session.running_in(start.execution_context_id))
                record = CallRecord(self._results, granted.call_id, session.id, owner_key(who), context.is_active)
                for response in exec_call.run(self._registry, self._fork, session, start, argv, cwd, request_iterator,
                                              context, record, tag=call_tag(granted.call_id, call.tool)):
                    kind = response.WhichOneof("kind")
                    if kind == "started_pid" and self._metrics is not None:
                        self._metrics.queue_seconds.observe(time.monotonic() - received)
                    elif kind in ("stdout", "stderr") and self._metrics is not None:
                        self._metrics.output_bytes.inc(len(getattr(response, kind)))
                    elif kind == "result":
                        granted.completed(exec_call.result_summary(response.result))
                        if self._metrics is not None:
                            self._metrics.exec_seconds.observe(time.monotonic() - received)
                    yield response

    # ---- policy, approvals and the audit log ----

    def ResolveApproval(self, request: pb.ResolveApprovalRequest,
                        context: grpc.ServicerContext) -> pb.ResolveApprovalResponse:
        return self._unary(context, lambda who: self._audit.resolve(who, request))

    def ListPendingApprovals(self, request: pb.ListPendingApprovalsRequest,
                             context: grpc.ServicerContext) -> pb.ListPendingApprovalsResponse:
        return self._unary(context, lambda who: self._audit.pending(who, request.session_id))

    def Authorize(self, request: pb.AuthorizeRequest, context: grpc.ServicerContext) -> pb.AuthorizeResponse:
        # may be held for approval, holding a worker: one of the caller's running calls
        def work(who: Caller) -> pb.AuthorizeResponse:
            self._drain.refuse_new("new call")
            return self._audit.authorize(who, request, context.is_active)
        return self._unary(context, work, CALLS)

    def ReportToolResult(self, request: pb.ReportToolResultRequest,
                         context: grpc.ServicerContext) -> pb.ReportToolResultResponse:
        return self._unary(context, lambda who: self._audit.report(who, request))

    def ListTools(self, request: pb.ListToolsRequest, context: grpc.ServicerContext) -> pb.ListToolsResponse:
        return self._unary(context, lambda who: self._audit.tools(who, request.session_id))

    def QueryEvents(self, request: pb.QueryEventsRequest, context: grpc.ServicerContext) -> pb.QueryEventsResponse:
        return self._unary(context, lambda who: self._audit.query(who, request))

    def WatchEvents(self, request: pb.WatchEventsRequest, context: grpc.ServicerContext) -> Iterator[pb.Event]:
        try:
            who = self._callers(context)
            with self._quotas.hold(who, STREAMS):
                yield from self._audit.watch(who, request, context.is_active)
        except Exception as error:  # noqa: BLE001 - mapped to a status, never a traceback
            self._abort(context, error)

    def VerifyAudit(self, request: pb.VerifyAuditRequest, context: grpc.ServicerContext) -> pb.VerifyAuditResponse:
        return self._unary(context, lambda who: self._verification.verify(who, request, context.is_active))

    def AddStandingRule(self, request: pb.StandingRule, context: grpc.ServicerContext) -> pb.StandingRule:
        def work(who: Caller) -> pb.StandingRule:
            convert.check_path(request.workspace, "workspace")
            return self._audit.add_rule(who, request)
        return self._unary(context, work)

    def ListStandingRules(self, request: pb.ListStandingRulesRequest,
                          context: grpc.ServicerContext) -> pb.ListStandingRulesResponse:
        return self._unary(context, lambda who: self._audit.rules(
            who, convert.check_path(request.workspace, "workspace")))

    def RegisterApprovalChannel(self, request: pb.RegisterApprovalChannelRequest,
                                context: grpc.ServicerContext) -> pb.ApprovalChannel:
        def work(who: Caller) -> pb.ApprovalChannel:
            if self._channels is None:
                raise InvalidPolicy("this daemon keeps no approval channels")
            return self._channels.register(who)
        return self._unary(context, work)

    def GetStatus(self, request: pb.GetStatusRequest, context: grpc.ServicerContext) -> pb.DaemonStatus:
        from sandboxd.service import daemon_status
        return self._unary(context, lambda who: daemon_status.status(self._registry, self._gate, who,
                                                                      self._connections, self._defaults))

    def WaitCall(self, request: pb.WaitCallRequest, context: grpc.ServicerContext) -> pb.WaitCallResponse:
        """A call's outcome by id (service.call_results); waits hold one of the caller's CALLS slots."""
        def work(who: Caller) -> pb.WaitCallResponse:
            timeout = request.timeout_seconds
            if not 0 <= timeout <= MAX_WAIT_SECONDS:          # NaN fails both
                raise InvalidPolicy(f"timeout_seconds must be 0 to {MAX_WAIT_SECONDS:g} (seconds to wait for a "
                                    f"running call's end), not {timeout}")
            convert.check_text(request.call_id, "call_id")
            self._registry.visible_ids(who, request.session_id)      # NOT_FOUND unless the caller's
            result = self._results.wait(request.call_id, timeout, context.is_active) if request.call_id else None
            if result is None or result.session_id != request.session_id:
                raise NotFound(f"no call {request.call_id!r} in session {request.session_id!r} (a finished call's "
                               "result is kept a day, and only its owner's last 64)")
            return pb.WaitCallResponse(
                state=pb.CALL_STATE_FINISHED if result.state == FINISHED else pb.CALL_STATE_RUNNING,
                exit_code=result.exit_code, signal=result.signal, timed_out=result.timed_out,
                shell_status=result.shell_status, stdout_tail=result.stdout_tail, stderr_tail=result.stderr_tail,
                reason=result.reason, finished_at=result.finished_at)
        return self._unary(context, work, CALLS)

    def Drain(self, request: pb.DrainRequest, context: grpc.ServicerContext) -> pb.DrainResponse:
        def work(who: Caller) -> pb.DrainResponse:
            if not who.is_admin:
                raise Forbidden("only root or a member of listen.admin_group may drain the daemon")
            timeout = request.timeout_seconds
            if not 0 <= timeout <= MAX_DRAIN_SECONDS:
                raise InvalidPolicy(f"timeout_seconds must be 0 (drain.timeout_seconds) to {MAX_DRAIN_SECONDS}, "
                                    f"not {timeout}")
            if self._on_drain is None:
                raise WrongState("this daemon cannot be drained (it is not `sandboxd serve`)")
            running, timeout = self._on_drain(timeout or None)
            return pb.DrainResponse(running_calls=running, timeout_seconds=timeout)
        return self._unary(context, work)

    def RemoveStandingRule(self, request: pb.StandingRule,
                           context: grpc.ServicerContext) -> pb.RemoveStandingRuleResponse:
        def work(who: Caller) -> pb.RemoveStandingRuleResponse:
            convert.check_path(request.workspace, "workspace")
            return self._audit.remove_rule(who, request)
        return self._unary(context, work)


class Reflection(reflection.ReflectionServicer):
    """Server reflection (grpcurl and the like), its streams counted as the caller's: each waits on
    its client's next request, holding a worker meanwhile, like a WatchEvents."""

    def __init__(self, service_names: Iterable[str], callers: Callers, quotas: Quotas,
                 metrics: "Metrics | None" = None) -> None:
        super().__init__(tuple(service_names))
        self._callers = callers
        self._quotas = quotas
        self._metrics = metrics

    def ServerReflectionInfo(self, request_iterator: Iterable[reflection_pb2.ServerReflectionRequest],
                             context: "grpc.ServicerContext | grpc.aio.ServicerContext[Any, Any]",
                             ) -> Iterator[reflection_pb2.ServerReflectionResponse]:
        assert isinstance(context, grpc.ServicerContext)  # the daemon's server is not asyncio's
        try:
            with self._quotas.hold(self._callers(context), STREAMS):
                yield from super().ServerReflectionInfo(request_iterator, context)
        except Exception as error:  # noqa: BLE001 - mapped to a status, never a traceback
            if self._metrics is not None:
                self._metrics.refused(code_for(error).name, str(error))
            abort(context, error)
