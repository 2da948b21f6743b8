"""What an upstream tool does as the policy engine sees it (its effect and risk), and whether the
gateway's own session shows it.

The effect comes from, first to last: the gateway file's `[upstreams.NAME.tools.TOOL] effect`; a
TRUSTED upstream's annotations (readOnlyHint -> read-only, destructiveHint -> destructive); else
unknown-command. An untrusted upstream's annotations are its own claim about itself, so they
count for nothing: a server that says "read-only" of its delete tool gains nothing by it.

What the list shows: every tool, but under permission mode read_only only the read-only ones (an
unknown effect included in what it hides); a hidden tool is refused if called by name
(mcp.gateway.router). The daemon's read_only mode hides no external tool and never asks, so this
is the only wall there. The sandbox decides the rest, at the call: Authorize judges the effect
against the sandbox of the upstream's own session (runs_in_session_id), and a tool it rules out
(a destructive effect under anything but danger-full-access, the network for an upstream without
it) is shown and gets the typed sandbox_rejected denial, as the integrator decided (19:02).
"""

from __future__ import annotations

from dataclasses import dataclass

import mcp_types as types

from sandboxd.mcp.gateway.config import UpstreamConfig
from sandboxd.policy.decision import PermissionMode
from sandboxd.policy.tools import Effect, Risk
from sandboxd.v1 import sandboxd_pb2 as pb

PROTO_EFFECTS = {Effect.READ_ONLY: pb.EFFECT_READ_ONLY, Effect.WORKSPACE_WRITE: pb.EFFECT_WORKSPACE_WRITE,
                 Effect.NETWORK: pb.EFFECT_NETWORK, Effect.DESTRUCTIVE: pb.EFFECT_DESTRUCTIVE,
                 Effect.UNKNOWN_COMMAND: pb.EFFECT_UNKNOWN_COMMAND}
# Without a risk in the file: what the effect suggests (the daemon's default, high, for the rest).
_RISK_OF = {Effect.READ_ONLY: Risk.LOW, Effect.WORKSPACE_WRITE: Risk.MEDIUM}


@dataclass(frozen=True)
class ToolPolicy:
    effect: str          # one of policy.tools.Effect.ALL
    risk: str            # low, medium, high
    source: str          # "override", "annotations" or "default": why the effect is what it is

    @property
    def proto_effect(self) -> "pb.PolicyEffect":
        return PROTO_EFFECTS[self.effect]


def tool_policy(config: UpstreamConfig, tool: str, annotations: types.ToolAnnotations | None) -> ToolPolicy:
    """The effect and risk of the upstream's tool ``tool`` (its own name, not the exposed one)."""
    override = config.tools.get(tool)
    effect, source = Effect.UNKNOWN_COMMAND, "default"
    if override is not None and override.effect:
        effect, source = override.effect, "override"
    elif config.trusted and annotations is not None:
        if annotations.read_only_hint is True:
            effect, source = Effect.READ_ONLY, "annotations"
        elif annotations.destructive_hint is True:
            effect, source = Effect.DESTRUCTIVE, "annotations"
    risk = (override.risk if override is not None and override.risk else None) or _RISK_OF.get(effect, Risk.HIGH)
    return ToolPolicy(effect, risk, source)


# What a trusted upstream is taken to say of its resources/read and prompts/get.
_A_READ = types.ToolAnnotations(read_only_hint=True)


def request_policy(config: UpstreamConfig, request: str) -> ToolPolicy:
    """The effect and risk of the upstream's ``request`` (resources/read or prompts/get): a read
    by the protocol's name, but the upstream's own code decides what it does, so the rule of its
    tools holds: read-only for a TRUSTED upstream, unknown-command (asked under on-request,
    hidden under read_only) for an untrusted one, unless the file's
    ``[upstreams.NAME.tools."resources/read"]`` (or ``"prompts/get"``) says otherwise."""
    return tool_policy(config, request, _A_READ)


def hidden_because(session: pb.Session, policy: ToolPolicy) -> str | None:
    """Why the gateway's ``session`` does not show a tool of this effect, or None when it does."""
    if PermissionMode.parse(session.permission_mode) == PermissionMode.READ_ONLY and policy.effect != Effect.READ_ONLY:
        return f"permission mode read_only shows only read-only tools (this one's effect: {policy.effect})"
    return None
