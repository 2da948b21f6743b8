"""A held call, answered where the person is.

When the MCP client declared the elicitation capability, a held call becomes an elicitation
(allow once, allow for this session, deny; with the tool, the summary and the typed reason) and
the answer goes to the daemon with ResolveApproval. Otherwise, or when the client cannot answer,
the call waits for `sandboxctl approve`, and a progress message says exactly how.

The tool, summary and reason are the agent's choice: the elicitation and the hint show them
printable, so a command cannot redraw the dialog or the terminal, nor add lines of its own. Like
sandboxctl's prompt, they add the whole command when the summary shows less of it (a command cut
at 200 characters: a tail after the cut would otherwise run unseen) and the environment the call
sets (policy.approval_card, both bounded), read from the daemon's held call, not from the event
(whose arguments are the audit's bounded form)."""

from __future__ import annotations

import logging
import sys
from typing import Any

import grpc
import mcp_types as types

from sandboxd.mcp.binding import Binding, HeldCalls
from sandboxd.policy import approval_card
from sandboxd.printable import printable
from sandboxd.v1 import sandboxd_pb2 as pb

TYPE_CHECKING = False
if TYPE_CHECKING:
    from mcp.server.context import ServerRequestContext

log = logging.getLogger("sandboxd.mcp")
CHOICES = ("allow_once", "allow_session", "deny")
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"decision": {
        "type": "string", "title": "Decision", "enum": list(CHOICES),
        "enumNames": ["Allow once", "Allow this tool for the rest of the session", "Deny"],
        "description": "allow_once: run this call; allow_session: also later calls of this tool in this session (a "
                       "network question: its proposed rule is added to the session's policy); "
                       "deny: refuse it (the model is told why)"}},
    "required": ["decision"],
}


class Progress:
    """Progress notifications of one tool call (a no-op when the client gave no progress token)."""

    def __init__(self, ctx: "ServerRequestContext[Any, Any]") -> None:
        self._ctx, self._count = ctx, 0

    async def say(self, message: str) -> None:
        self._count += 1
        await self._ctx.session.report_progress(self._count, None, message)


def _elicits(ctx: "ServerRequestContext[Any, Any]") -> bool:
    capabilities = ctx.session.client_capabilities
    return capabilities is not None and capabilities.elicitation is not None and ctx.session.can_send_request


async def answer_held(ctx: "ServerRequestContext[Any, Any]", binding: Binding, held: HeldCalls,
                      progress: Progress, ctl: str) -> None:
    """Runs beside a tool call until it ends: asks about each of its calls held for approval."""
    while True:
        event = await held.events.get()
        call = await _held_call(binding, event.call_id)
        if call is None:
            continue                                    # answered elsewhere, timed out, or gone
        card = [f"{label}: {text}" for label, text in approval_card.lines(call.summary, call.arguments_json)]
        summary, reason = call.summary or call.tool, call.reason
        if _elicits(ctx) and await _elicit(ctx, binding, call.call_id, call.tool, summary, card, reason):
            continue
        session_id, call_id = printable(binding.session_id), printable(call.call_id)
        hint = (f"waiting for approval ({printable(reason)}): {printable(summary)}"
                f"{''.join(f'; {line}' for line in card)}; answer with `{ctl} approve "
                f"{session_id} {call_id}` (add --session-wide for the rest of the session) or `{ctl} deny "
                f"{session_id} {call_id}`")
        sys.stderr.write(f"sandboxd mcp: {hint}\n")
        sys.stderr.flush()
        await progress.say(hint)


async def _held_call(binding: Binding, call_id: str) -> pb.PendingApproval | None:
    """The held call as the daemon keeps it (whole: an event's arguments are the audit's bounded
    form, a long command clipped), or None once it is no longer held."""
    try:
        listed = await binding.daemon.stub.ListPendingApprovals(pb.ListPendingApprovalsRequest(
            session_id=binding.session_id))
    except grpc.RpcError as error:
        log.warning("sandboxd mcp: could not read held call %s (%s)", printable(call_id), printable(str(error.code())))
        return None
    return next((call for call in listed.approvals if call.call_id == call_id), None)


async def _elicit(ctx: "ServerRequestContext[Any, Any]", binding: Binding, call_id: str, tool: str, summary: str,
                  card: list[str], reason: str) -> bool:
    """Ask the client's user; True once the answer reached the daemon (or the call was answered
    elsewhere meanwhile). ``card``: the card's lines below the summary, escaped already."""
    message = (f"sandboxd: a {printable(tool)} call needs your approval ({printable(reason)}).\n"
               f"{printable(summary)}\n" + "".join(f"{line}\n" for line in card) +
               f"Session {printable(binding.session_id)}, call {printable(call_id)}.")
    try:
        result = await ctx.session.elicit_form(message, SCHEMA, related_request_id=ctx.request_id)
    except Exception as error:                      # noqa: BLE001 - a client that cannot answer: fall back
        log.warning("sandboxd mcp: the client did not answer the elicitation (%s); waiting for sandboxctl", error)
        return False
    decision = "deny"
    if result.action == "accept" and result.content and result.content.get("decision") in CHOICES:
        decision = str(result.content["decision"])
    try:
        await binding.daemon.stub.ResolveApproval(pb.ResolveApprovalRequest(
            session_id=binding.session_id, call_id=call_id, decision=decision))
    except grpc.RpcError as error:
        if error.code() != grpc.StatusCode.NOT_FOUND:   # NOT_FOUND: answered elsewhere or timed out
            raise
    return True


def denied_result(denial: dict[str, str]) -> types.CallToolResult:
    """A denial as a tool error the model can re-plan from: the typed reason and who denied it."""
    text = (f"{denial['message'] or 'denied'} (reason: {denial['reason'] or 'unknown'}; by: {denial['by']}"
            + (f"; {denial['detail']}" if denial["detail"] else "") + ")")
    return types.CallToolResult(content=[types.TextContent(text=text)], is_error=True,
                                structured_content={"denied": True, **denial})
