"""Each upstream call through the daemon's policy engine: Authorize before it (on the gateway's
own session, so its approval policy, permission mode, standing rules and held-call elicitation
apply as to a built-in tool), ReportToolResult after it (the audit log's end of the call).

The arguments go to the audit log, so they are redacted first: every credential secret of the
gateway file (its value, read from this process's environment as `--credential` reads it) and
every `env` or `pass_env` value whose variable's name says it is a secret (TOKEN, SECRET, KEY,
PASSWORD, CREDENTIAL) becomes "[redacted]" wherever it appears in a string, and a JSON text over
16 KiB is kept as its head (the daemon's audit bounds are wider: this keeps one model's call from
filling them)."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from typing import Any

from sandboxd.mcp.daemon import Daemon
from sandboxd.mcp.gateway.config import SECRET_NAME, GatewayConfig
from sandboxd.mcp.gateway.effects import ToolPolicy
from sandboxd.policy import approval_card
from sandboxd.v1 import sandboxd_pb2 as pb

REDACTED = "[redacted]"
# The card (policy.approval_card.is_cut) knows a cut by this length: the two must agree.
ARGUMENTS_LIMIT = approval_card.RECORDED_ARGUMENTS_CHARS
# A secret shorter than this is replaced only where it is a whole string: "1" or "yes" inside
# every other string would make the audit unreadable and hide nothing.
MIN_SUBSTRING_SECRET = 6


class Redactor:
    """The secret values of one gateway file, and their removal from a call's arguments."""

    def __init__(self, secrets: Iterable[str]) -> None:
        unique = {secret for secret in secrets if secret}
        self._whole = frozenset(unique)
        # Longest first: a secret that contains another is replaced whole.
        self._inside = sorted((secret for secret in unique if len(secret) >= MIN_SUBSTRING_SECRET), key=len,
                              reverse=True)

    @classmethod
    def of(cls, config: GatewayConfig, environ: Mapping[str, str] | None = None) -> "Redactor":
        """The secrets ``config`` names, their values read from ``environ`` (this process's)."""
        environ = os.environ if environ is None else environ
        secrets: list[str] = []
        for upstream in config.upstreams:
            for spec in upstream.credentials:
                variable = spec.partition("=")[0]
                secrets.append(environ.get(variable, ""))
            secrets += [value for name, value in upstream.env.items() if SECRET_NAME.search(name)]
            secrets += [environ.get(name, "") for name in upstream.pass_env if SECRET_NAME.search(name)]
        return cls(secrets)

    def text(self, value: str) -> str:
        if value in self._whole:
            return REDACTED
        for secret in self._inside:
            if secret in value:
                value = value.replace(secret, REDACTED)
        return value

    def value(self, value: Any) -> Any:
        """``value`` (JSON data) with every secret replaced, keys included."""
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, dict):
            return {self.text(str(key)): self.value(item) for key, item in value.items()}
        if isinstance(value, list):
            return [self.value(item) for item in value]
        return value


def arguments_json(arguments: Mapping[str, Any], redactor: Redactor) -> str:
    """The call's arguments for the audit log: redacted, and at most ARGUMENTS_LIMIT bytes of JSON
    (past it: {"truncated": true, "bytes": N, "sha256": of the whole, "head": its first ARGUMENTS_LIMIT
    characters}; the held call's card says that only the start is shown, policy.approval_card).
    Arguments of that shape that fit are the model's, not a cut: the card takes a cut only with a
    head of exactly ARGUMENTS_LIMIT characters, which no arguments of at most that length can hold."""
    # ASCII JSON (\u escapes): a lone surrogate a client sent stays a valid protobuf string.
    text = json.dumps(redactor.value(dict(arguments)), separators=(",", ":"), default=str)
    if len(text) <= ARGUMENTS_LIMIT:
        return text
    # The digest of the whole (redacted) arguments: what was approved can be matched later.
    return json.dumps({"truncated": True, "bytes": len(text), "sha256": hashlib.sha256(text.encode()).hexdigest(),
                       "head": text[:ARGUMENTS_LIMIT]})


async def authorize(daemon: Daemon, session_id: str, *, tool: str, upstream: str, trusted: bool,
                    policy: ToolPolicy, arguments: str, context_id: str, runs_in: str) -> pb.AuthorizeResponse:
    """The daemon's decision on one upstream call; it returns once a person answered a held one.
    ``runs_in``: the upstream's own session, whose sandbox the effect is judged against (the
    approvals, rules, permission mode and audit are the gateway's ``session_id``'s)."""
    answer: pb.AuthorizeResponse = await daemon.stub.Authorize(pb.AuthorizeRequest(
        session_id=session_id, tool=tool, effect=policy.proto_effect, mcp_server=upstream, server_trusted=trusted,
        arguments_json=arguments, execution_context_id=context_id, risk=policy.risk, runs_in_session_id=runs_in))
    return answer


async def report(daemon: Daemon, session_id: str, call_id: str, *, ok: bool, error: str = "",
                 content_bytes: int = 0, is_error: bool = False) -> None:
    """How the call ended, for the audit log (ToolInvocationCompleted or ToolInvocationFailed)."""
    await daemon.stub.ReportToolResult(pb.ReportToolResultRequest(
        session_id=session_id, call_id=call_id, ok=ok, error=error,
        result_json=json.dumps({"content_bytes": content_bytes, "is_error": is_error})))
