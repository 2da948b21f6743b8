"""A Python client of the sandboxd daemon (what `sandboxctl` uses).

    from sandboxd.client import SandboxClient
    with SandboxClient() as client:                       # /run/sandboxd/sandboxd.sock
        session = client.create_session("/home/me/project")
        outcome = client.exec(session.id, shell="pytest -q")
        print(outcome.result.shell_status, outcome.stdout.decode())
"""

from __future__ import annotations

import os
import random
import sys
import time
from typing import Any, Callable, Iterator

import grpc

from sandboxd import defaults
from sandboxd.v1 import sandboxd_pb2 as pb
from sandboxd.v1 import sandboxd_pb2_grpc as pb_grpc

# What a person was shown of a review session's changes: (root, path) -> the change's fingerprint
# (FileChange.fingerprint, DiffChangesResponse.shown).
Reviewed = dict[tuple[str, str], str]
REVIEWED_PART = 2_000           # reviewed changes per ApplyChanges (the server takes 10,000 and 4 MiB)

DEFAULT_SOCKET = defaults.SOCKET
_MODES = {"read-only": pb.SandboxPolicy.READ_ONLY, "workspace-write": pb.SandboxPolicy.WORKSPACE_WRITE,
          "danger-full-access": pb.SandboxPolicy.DANGER_FULL_ACCESS}
_APPROVALS = {"never": pb.NEVER, "on-request": pb.ON_REQUEST, "always": pb.ALWAYS}


def sandbox_policy(name: str = "workspace-write", *, network: bool = False,
                   writable_roots: tuple[str, ...] | list[str] = ()) -> pb.SandboxPolicy:
    if name not in _MODES:
        raise ValueError(f"unknown sandbox policy {name!r}: use one of {', '.join(_MODES)}")
    return pb.SandboxPolicy(mode=_MODES[name], network_access=network, writable_roots=list(writable_roots))


def approval_policy(name: str) -> pb.ApprovalPolicy:
    if name not in _APPROVALS:
        raise ValueError(f"unknown approval policy {name!r}: use one of {', '.join(_APPROVALS)}")
    return _APPROVALS[name]


class ExecOutcome:
    def __init__(self, started_pid: int, stdout: bytes, stderr: bytes, result: pb.ExecResult,
                 call_id: str = "") -> None:
        self.started_pid = started_pid
        self.call_id = call_id                # what WaitCall asks by
        self.stdout = stdout
        self.stderr = stderr
        self.result = result


# The daemon answers a ReadFile with up to 64 MiB when asked (its maximum); gRPC clients accept
# 4 MiB by default. Ours take the daemon's maximum plus room for the message around it.
MAX_READ_BYTES = 64 << 20
MAX_RECEIVE_BYTES = MAX_READ_BYTES + (1 << 20)
# Reconnect soon after the daemon's socket comes back (a restart: DrainWait tries again meanwhile);
# gRPC's default backoff grows to 120 s, longer than the whole wait.
CHANNEL_OPTIONS = (("grpc.max_receive_message_length", MAX_RECEIVE_BYTES),
                   ("grpc.initial_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 2000))

# A request the daemon refused because its owner already had quotas.requests_per_uid requests in
# progress did nothing: the bound is on how many at once, not how many in all, so a client's own
# burst (an MCP server's concurrent tool listings, a script's threads) waits and tries again, about
# 4 s in all with jitter, instead of failing. Every other refusal is returned at once.
REQUEST_QUOTA_KEY = "quotas.requests_per_uid"
RETRY_DELAYS = (0.02, 0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0)


# The longest one WaitCall waits for a running call's end (the daemon's bound: service.call_results).
MAX_WAIT_SECONDS = 300.0


# A daemon that drains (a restart, an upgrade: service.drain) refuses new sessions and calls with
# UNAVAILABLE and this trailing metadata (whole seconds to wait); nothing started. The clients wait
# and try again until the next daemon serves, DRAIN_WAIT_SECONDS in all, saying so on stderr once;
# after such a refusal, a socket nobody answers on is that restart too. A call that started is never
# tried again, and an UNAVAILABLE without a drain's refusal first (no daemon at all) is returned.
RETRY_AFTER_METADATA = "sandboxd-retry-after"
DRAIN_WAIT_SECONDS = 120.0
_DRAIN_BACKOFF = (0.25, 0.5, 1.0, 2.0)


def drain_hint(code: "grpc.StatusCode | None", metadata: Any) -> int | None:
    """The retry hint (seconds) of a draining daemon's refusal, else None."""
    if code != grpc.StatusCode.UNAVAILABLE:
        return None
    for key, value in metadata or ():
        if key == RETRY_AFTER_METADATA:
            try:
                return max(0, min(int(value), 60))
            except ValueError:
                return 1
    return None


def say_on_stderr(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


class DrainWait:
    """One call's waits for the next daemon (above): ``delay`` says how long to sleep before the next
    try, or None to give up and return the error as it is."""

    def __init__(self, say: Callable[[str], None] = say_on_stderr, budget: float = DRAIN_WAIT_SECONDS) -> None:
        self._say, self._budget = say, budget
        self._deadline: float | None = None
        self._tries = 0

    @property
    def waiting(self) -> bool:
        """A draining daemon refused this call already."""
        return self._deadline is not None

    def delay(self, code: "grpc.StatusCode | None", metadata: Any) -> float | None:
        hint = drain_hint(code, metadata)
        if hint is None and (self._deadline is None or code != grpc.StatusCode.UNAVAILABLE):
            return None
        now = time.monotonic()
        if self._deadline is None:
            self._deadline = now + self._budget
            self._say(f"sandboxd is draining (a restart or an upgrade): trying again once the next daemon serves, "
                      f"for up to {self._budget:g} s")
        if now >= self._deadline:
            return None
        backoff = _DRAIN_BACKOFF[min(self._tries, len(_DRAIN_BACKOFF) - 1)]
        self._tries += 1
        wait = (hint if hint else backoff) * random.uniform(0.8, 1.2)
        return max(0.0, min(wait, self._deadline - now))


def refused_for_requests_in_progress(code: "grpc.StatusCode | None", details: "str | None") -> bool:
    return code == grpc.StatusCode.RESOURCE_EXHAUSTED and REQUEST_QUOTA_KEY in (details or "")


def retry_delays() -> Iterator[float]:
    """The waits between tries, each jittered (so a burst refused together does not come back together)."""
    for delay in RETRY_DELAYS:
        yield delay * random.uniform(0.5, 1.5)


class RetryRequestsInProgress(grpc.UnaryUnaryClientInterceptor):
    """Unary requests refused for the owner's requests in progress, or by a draining daemon, are
    tried again (above)."""

    def intercept_unary_unary(self, continuation: Callable[[Any, Any], Any], client_call_details: Any,
                              request: Any) -> Any:
        outcome = continuation(client_call_details, request)
        delays, drain = retry_delays(), DrainWait()
        while True:
            if refused_for_requests_in_progress(outcome.code(), outcome.details()):
                delay = next(delays, None)
            else:
                delay = drain.delay(outcome.code(), _trailing(outcome))
            if delay is None:
                return outcome
            time.sleep(delay)
            outcome = continuation(client_call_details, request)


def _trailing(outcome: Any) -> Any:
    """A finished call's trailing metadata (none for a call that never reached a daemon)."""
    try:
        return outcome.trailing_metadata()
    except Exception:  # noqa: BLE001 - an outcome without it
        return ()


def request_channel(socket_path: str) -> grpc.Channel:
    """A channel on the daemon's socket whose unary requests ride out a burst of the caller's own."""
    return grpc.intercept_channel(grpc.insecure_channel(f"unix:{socket_path}", options=CHANNEL_OPTIONS),
                                  RetryRequestsInProgress())


class SandboxClient:
    def __init__(self, socket_path: str = DEFAULT_SOCKET) -> None:
        self._channel = request_channel(socket_path)
        self.stub = pb_grpc.SandboxStub(self._channel)
        self._run_supported = True          # until a daemon older than the Run RPC says otherwise

    @property
    def channel(self) -> grpc.Channel:
        """The channel, for the standard services (health, reflection)."""
        return self._channel

    def __enter__(self) -> "SandboxClient":
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def create_session(self, workspace: str, *, policy: pb.SandboxPolicy | None = None,
                       approval: str = "on-request", limits: pb.Limits | None = None,
                       labels: dict[str, str] | None = None, env: dict[str, str] | None = None,
                       review: bool | None = None,
                       credential_secrets: "dict[str, pb.CredentialSecret] | None" = None) -> pb.Session:
        """``env``: variables every command of the session gets (see CreateSessionRequest.env);
        ``review``: review mode (None: the daemon's review.default); ``credential_secrets``: the
        secrets of the policy's credentials (cli.network_args)."""
        request = pb.CreateSessionRequest(
            workspace=workspace, sandbox_policy=policy or sandbox_policy(), approval_policy=approval_policy(approval),
            limits=limits or pb.Limits(), labels=labels or {}, env=env or {},
            credential_secrets=credential_secrets or {})
        if review is not None:
            request.review = review
        return self.stub.CreateSession(request)

    def get_session(self, session_id: str) -> pb.Session:
        return self.stub.GetSession(pb.GetSessionRequest(session_id=session_id))

    def list_sessions(self) -> list[pb.Session]:
        return list(self.stub.ListSessions(pb.ListSessionsRequest()).sessions)

    def close_session(self, session_id: str) -> None:
        self.stub.CloseSession(pb.CloseSessionRequest(session_id=session_id))

    def update_policy(self, session_id: str, *, policy: pb.SandboxPolicy | None = None,
                      approval: str | None = None,
                      credential_secrets: "dict[str, pb.CredentialSecret] | None" = None) -> pb.Session:
        request = pb.UpdateSessionPolicyRequest(session_id=session_id, credential_secrets=credential_secrets or {})
        if policy is not None:
            request.sandbox_policy.CopyFrom(policy)
        if approval is not None:
            request.approval_policy = approval_policy(approval)
        return self.stub.UpdateSessionPolicy(request)

    # -- review mode: each page followed to the end -------------------------------------------------

    def list_changes(self, session_id: str, paths: "list[str] | None" = None) -> tuple[list[pb.FileChange], int]:
        """Every change (and how many files were left without a hash) of a review session."""
        changes: list[pb.FileChange] = []
        unhashed, token = 0, ""
        while True:
            page = self.stub.ListChanges(pb.ListChangesRequest(session_id=session_id, paths=paths or [],
                                                               page_token=token))
            changes += page.changes
            unhashed += page.unhashed
            token = page.next_page_token
            if not token:
                return changes, unhashed

    def diff_changes(self, session_id: str, paths: "list[str] | None" = None, *,
                     seen: "Reviewed | None" = None) -> "Iterator[str]":
        """The diff, page by page; ``seen`` gets each shown change's fingerprint (for ``apply_changes``)."""
        token = ""
        while True:
            page = self.stub.DiffChanges(pb.DiffChangesRequest(session_id=session_id, paths=paths or [],
                                                               page_token=token))
            if seen is not None:
                seen.update({(item.root, item.path): item.fingerprint for item in page.shown})
            yield page.diff
            token = page.next_page_token
            if not token:
                return

    def apply_changes(self, session_id: str, paths: "list[str] | None" = None, *, force: bool = False,
                      include_flagged: "list[str] | None" = None,
                      reviewed: "Reviewed | None" = None) -> pb.ApplyChangesResponse:
        """``reviewed``: (root, path) -> the fingerprint a person was shown; given (even empty), only
        those changes are applied, each while it is still what was shown. More than one request
        carries (REVIEWED_PART) are sent as several, each naming its own paths (parents first),
        and answered as one."""
        if reviewed is not None and not paths and len(reviewed) > REVIEWED_PART:
            return self._apply_in_parts(session_id, reviewed, force=force, include_flagged=include_flagged)
        return self.stub.ApplyChanges(pb.ApplyChangesRequest(
            session_id=session_id, paths=paths or [], force=force, include_flagged=include_flagged or [],
            reviewed=[pb.ReviewedChange(root=root, path=path, fingerprint=mark)
                      for (root, path), mark in (reviewed or {}).items()],
            only_reviewed=reviewed is not None))

    def _apply_in_parts(self, session_id: str, reviewed: "Reviewed", *, force: bool,
                        include_flagged: "list[str] | None") -> pb.ApplyChangesResponse:
        order = sorted(reviewed)                      # a directory before what is in it
        applied: list[pb.AppliedChange] = []
        skipped: dict[tuple[str, str], pb.SkippedChange] = {}
        for start in range(0, len(order), REVIEWED_PART):
            part = order[start:start + REVIEWED_PART]
            answer = self.stub.ApplyChanges(pb.ApplyChangesRequest(
                session_id=session_id, paths=[f"{root}/{path}" if path else root for root, path in part], force=force,
                include_flagged=include_flagged or [], only_reviewed=True,
                reviewed=[pb.ReviewedChange(root=root, path=path, fingerprint=reviewed[(root, path)])
                          for root, path in part]))
            applied += answer.applied
            for item in answer.applied:
                skipped.pop((item.root, item.path), None)
            for item in answer.skipped:               # one below a part's path is another part's
                if (item.root, item.path) not in reviewed or (item.root, item.path) in part:
                    skipped[(item.root, item.path)] = item
        done = {(item.root, item.path) for item in applied}
        return pb.ApplyChangesResponse(applied=applied, skipped=[item for key, item in skipped.items() if key not in done])

    def discard_changes(self, session_id: str, paths: "list[str] | None" = None) -> pb.DiscardChangesResponse:
        return self.stub.DiscardChanges(pb.DiscardChangesRequest(session_id=session_id, paths=paths or []))

    def create_checkpoint(self, session_id: str, label: str = "") -> pb.Checkpoint:
        return self.stub.CreateCheckpoint(pb.CreateCheckpointRequest(session_id=session_id, label=label))

    def list_checkpoints(self, session_id: str) -> list[pb.Checkpoint]:
        return list(self.stub.ListCheckpoints(pb.ListCheckpointsRequest(session_id=session_id)).checkpoints)

    def rollback_changes(self, session_id: str, checkpoint_id: int) -> pb.RollbackChangesResponse:
        return self.stub.RollbackChanges(pb.RollbackChangesRequest(session_id=session_id, checkpoint_id=checkpoint_id))

    # ``context_id`` (each call that can be held for approval): its execution_context_id, by which
    # the client that made a held call finds it among the session's (ListPendingApprovals).

    def read_file(self, session_id: str, path: str, max_bytes: int = 0, *,
                  context_id: str = "") -> pb.ReadFileResponse:
        return self.stub.ReadFile(pb.ReadFileRequest(session_id=session_id, path=path, max_bytes=max_bytes,
                                                     execution_context_id=context_id))

    def write_file(self, session_id: str, path: str, data: bytes, *, mode: int = 0,
                   create_parents: bool = False, context_id: str = "") -> int:
        return self.stub.WriteFile(pb.WriteFileRequest(session_id=session_id, path=path, data=data, mode=mode,
                                                       create_parents=create_parents,
                                                       execution_context_id=context_id)).bytes_written

    def list_dir(self, session_id: str, path: str = "", *, context_id: str = "") -> list[pb.DirEntry]:
        return list(self.stub.ListDir(pb.ListDirRequest(session_id=session_id, path=path,
                                                        execution_context_id=context_id)).entries)

    def apply_patch(self, session_id: str, patch: str, strip: int = 0, *, context_id: str = "") -> list[pb.PatchedFile]:
        return list(self.stub.ApplyPatch(pb.ApplyPatchRequest(session_id=session_id, patch=patch, strip=strip,
                                                              execution_context_id=context_id)).files)

    def search(self, session_id: str, pattern: str, path: str = "", *, max_results: int = 0,
               case_insensitive: bool = False) -> pb.SearchResponse:
        return self.stub.Search(pb.SearchRequest(session_id=session_id, pattern=pattern, path=path,
                                                 max_results=max_results, case_insensitive=case_insensitive))

    def start_background(self, session_id: str, argv: list[str] | None = None, *, shell: str = "",
                         cwd: str = "", name: str = "", context_id: str = "") -> pb.BackgroundProcess:
        return self.stub.StartBackground(pb.StartBackgroundRequest(session_id=session_id, argv=argv or [],
                                                                   shell=shell, cwd=cwd, name=name,
                                                                   execution_context_id=context_id))

    def list_background(self, session_id: str, *, context_id: str = "") -> list[pb.BackgroundProcess]:
        return list(self.stub.ListBackground(pb.ListBackgroundRequest(session_id=session_id,
                                                                      execution_context_id=context_id)).processes)

    def stop_background(self, session_id: str, job_id: str, *, context_id: str = "") -> pb.BackgroundProcess:
        return self.stub.StopBackground(pb.StopBackgroundRequest(session_id=session_id, id=job_id,
                                                                 execution_context_id=context_id))

    def wait_call(self, session_id: str, call_id: str, timeout: float = 0.0) -> pb.WaitCallResponse:
        """A call's outcome by id (ExecResponse.call_id): RUNNING after ``timeout`` seconds (at most
        MAX_WAIT_SECONDS), or FINISHED with its exit and output tails; NOT_FOUND if not known."""
        return self.stub.WaitCall(pb.WaitCallRequest(session_id=session_id, call_id=call_id,
                                                     timeout_seconds=timeout), timeout=timeout + 30)

    def _run(self, start: pb.ExecStart) -> Iterator[pb.ExecResponse]:
        """Everything is in `start` (stdin included, then closed), so the call needs no request
        stream: Run, which spares both sides the stream's threads and messages. A daemon older
        than Run answers UNIMPLEMENTED before anything ran: then Exec with the same `start`."""
        drain = DrainWait()
        while self._run_supported:
            answered = False
            try:
                for response in self.stub.Run(start):
                    answered = True
                    yield response
                return
            except grpc.RpcError as error:
                delay = None if answered else drain.delay(error.code(), _trailing(error))
                if delay is not None:             # refused by a draining daemon before it ran: again
                    time.sleep(delay)
                    continue
                if answered or error.code() != grpc.StatusCode.UNIMPLEMENTED:
                    raise
                self._run_supported = False
        yield from self.stub.Exec(iter([pb.ExecRequest(start=start)]))

    def exec(self, session_id: str, argv: list[str] | None = None, *, shell: str = "", cwd: str = "",
             env: dict[str, str] | None = None, timeout: float = 0, stdin: bytes = b"", output_limit: int = 0,
             on_output: Callable[[int, bytes], None] | None = None, env_overlay: dict[str, str] | None = None,
             caller_env: pb.CallerEnvironment | None = None) -> ExecOutcome:
        """Run a command and wait for it. ``on_output(1 or 2, chunk)`` sees output as it comes;
        without it, output is collected into the outcome. ``output_limit``: the call's output cap
        in bytes (0: the server's default). ``env``: the command's whole environment; or, instead,
        ``env_overlay`` and ``caller_env`` (see ``caller_environment``) on top of the defaults and
        the session's env (ExecStart in the proto)."""
        start = pb.ExecStart(session_id=session_id, argv=argv or [], shell=shell, cwd=cwd, env=env or {},
                             timeout_seconds=timeout, stdin=stdin, close_stdin=True, output_limit_bytes=output_limit,
                             env_overlay=env_overlay or {}, caller_env=caller_env)
        chunks: dict[int, list[bytes]] = {1: [], 2: []}
        pid, result, call_id = 0, None, ""
        for response in self._run(start):
            kind = response.WhichOneof("kind")
            if kind == "started_pid":
                pid, call_id = response.started_pid, response.call_id
            elif kind in ("stdout", "stderr"):
                stream = 1 if kind == "stdout" else 2
                data = getattr(response, kind)
                if on_output is not None:
                    on_output(stream, data)
                else:
                    chunks[stream].append(data)
            elif kind == "result":
                result = response.result
        if result is None:
            raise RuntimeError("the daemon ended the Exec stream without a result")
        return ExecOutcome(pid, b"".join(chunks[1]), b"".join(chunks[2]), result, call_id)


def caller_environment(on_terminal: bool) -> pb.CallerEnvironment:
    """What a client passes of its own environment: PATH (the daemon keeps the entries the sandbox
    has), LANG, and TERM when on a terminal. Nothing else: no token or key leaves by accident."""
    return pb.CallerEnvironment(path=os.environ.get("PATH", ""), lang=os.environ.get("LANG", ""),
                                term=os.environ.get("TERM", "") if on_terminal else "")


def write_through(stream: int, data: bytes) -> None:
    target = sys.stdout.buffer if stream == 1 else sys.stderr.buffer
    target.write(data)
    target.flush()
