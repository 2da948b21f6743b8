"""The daemon as `sandboxd mcp` talks to it: an asyncio gRPC channel on the caller's socket (so
the daemon sees the caller's own uid through SO_PEERCRED), the session to create from the
command line's flags, and a denial read back from a failed call."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any, Callable

import grpc
import grpc.aio

from sandboxd.client import (CHANNEL_OPTIONS, DrainWait, approval_policy, refused_for_requests_in_progress,
                             retry_delays, sandbox_policy)
from sandboxd.v1 import sandboxd_pb2 as pb
from sandboxd.v1 import sandboxd_pb2_grpc as pb_grpc

DENIAL_METADATA = "sandboxd-permission-denied"   # the trailing metadata a policy denial carries


@dataclass(frozen=True)
class SessionSpec:
    """What to open for each MCP connection (or `attach`: an existing session, never closed)."""

    workspace: str
    sandbox: str = "workspace-write"
    network: bool = False
    writable_roots: tuple[str, ...] = ()
    approval: str = "on-request"
    permission_mode: str = ""
    attach: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    review: bool | None = None          # None: the daemon's review.default
    checkpoint_calls: bool = False      # a review session: each shell call marks a checkpoint first
    # The network flags (cli.network_args): the session's policy's network fields, and the
    # credentials' secrets (never printed: left out of the repr).
    network_policy: pb.SandboxPolicy | None = None
    credential_secrets: dict[str, pb.CredentialSecret] = field(default_factory=dict, repr=False)
    # The owner's home covered by an empty read-only directory (SandboxPolicy.hide_home): an MCP
    # gateway's upstream server never reads the person's keys (~/.ssh, ~/.aws, ~/.config).
    hide_home: bool = False

    def request(self) -> pb.CreateSessionRequest:
        # close_with_caller: a `sandboxd mcp` killed before it could close its sessions (SIGKILL,
        # the OOM killer) leaves none open; the daemon closes them when this process exits.
        policy = sandbox_policy(self.sandbox, network=self.network, writable_roots=self.writable_roots)
        if self.network_policy is not None:
            policy.MergeFrom(self.network_policy)
        policy.hide_home = policy.hide_home or self.hide_home
        return pb.CreateSessionRequest(
            workspace=self.workspace, permission_mode=self.permission_mode, labels=self.labels, close_with_caller=True,
            credential_secrets=self.credential_secrets, sandbox_policy=policy,
            approval_policy=approval_policy(self.approval) if not self.permission_mode else pb.APPROVAL_POLICY_UNSPECIFIED,
            review=self.review)


class RetryRequestsInProgress(grpc.aio.UnaryUnaryClientInterceptor):
    """sandboxd.client.RetryRequestsInProgress for the asyncio channel: an MCP client's concurrent
    tool calls and listings are a burst of this process's own requests; a draining daemon's
    refusal waits for the next daemon (sandboxd.client.DrainWait)."""

    async def intercept_unary_unary(self, continuation: Callable[[Any, Any], Any], client_call_details: Any,
                                    request: Any) -> Any:
        call = await continuation(client_call_details, request)
        if await call.code() == grpc.StatusCode.OK:
            return call                           # every call but a refused one: no retry state to build
        delays, drain = retry_delays(), DrainWait()
        while True:
            code = await call.code()
            if refused_for_requests_in_progress(code, await call.details()):
                delay = next(delays, None)
            else:
                delay = drain.delay(code, await call.trailing_metadata())
            if delay is None:
                return call
            await asyncio.sleep(delay)
            call = await continuation(client_call_details, request)


class Daemon:
    """One asyncio channel to the daemon (created in the running event loop)."""

    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path
        self.channel = grpc.aio.insecure_channel(f"unix:{socket_path}", options=CHANNEL_OPTIONS,
                                                 interceptors=[RetryRequestsInProgress()])
        self.stub = pb_grpc.SandboxStub(self.channel)

    async def open(self, spec: SessionSpec) -> tuple[pb.Session, bool]:
        """The session for one connection, and whether it is ours to close."""
        if spec.attach:
            return await self.stub.GetSession(pb.GetSessionRequest(session_id=spec.attach)), False
        return await self.stub.CreateSession(spec.request()), True

    async def close(self) -> None:
        await self.channel.close()


def denial(error: grpc.RpcError) -> dict[str, str] | None:
    """The PermissionDenied (call_id, tool, reason, by, detail, message) a denied call carries."""
    if not isinstance(error, grpc.aio.AioRpcError) or error.code() != grpc.StatusCode.PERMISSION_DENIED:
        return None
    for key, value in error.trailing_metadata() or ():
        if key == DENIAL_METADATA:
            try:
                data = json.loads(value)
            except ValueError:
                return None
            return {name: str(data.get(name) or "") for name in ("call_id", "tool", "reason", "by", "detail",
                                                                 "message")}
    return None
