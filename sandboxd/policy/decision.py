"""The policy engine: one decision for every tool call, from two independent axes.

- The **sandbox** axis (SandboxPolicy) says what is structurally possible. A call
  it rules out is ``DeniedBySandbox``, and no approval can change that: the user
  must switch the sandbox.
- The **approval** axis (ApprovalPolicy) says when to ask. ``never`` runs what the
  sandbox allows without asking (it never widens the sandbox); ``on-request`` asks
  only for a structural reason (destructive, network, an unknown command, an
  untrusted MCP server); ``always`` asks for every call.

``decide`` is pure: no I/O, no clock, no state. Remembered approvals ("allow for
this session", workspace rules) are applied by the caller on top of a
``NeedsApproval``, never on top of a denial.
"""

from __future__ import annotations

from sandboxd._record import Choice, Factory, Record
from sandboxd.errors import InvalidPolicy
from sandboxd.policy.sandbox import DangerFullAccess, ReadOnly, SandboxPolicy
from sandboxd.policy.tools import Category, Effect

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import ClassVar


class ApprovalPolicy(Choice):
    """When to ask a person (the approval axis)."""

    NEVER: ClassVar[ApprovalPolicy]
    ON_REQUEST: ClassVar[ApprovalPolicy]
    ALWAYS: ClassVar[ApprovalPolicy]
    ALL: ClassVar[tuple[ApprovalPolicy, ...]]
    DEFAULT: ClassVar[ApprovalPolicy]


ApprovalPolicy.define(NEVER="never", ON_REQUEST="on-request", ALWAYS="always")
ApprovalPolicy.ALL = ApprovalPolicy.all()
ApprovalPolicy.DEFAULT = ApprovalPolicy.ON_REQUEST


def approval_policy(text: object) -> ApprovalPolicy:
    """The approval policy ``text`` names, or InvalidPolicy saying which there are."""
    try:
        return ApprovalPolicy.parse(text)
    except ValueError:
        raise InvalidPolicy(f"unknown approval policy {text!r}: use {', '.join(ApprovalPolicy.ALL)}") from None


class Reason:
    """Why a call needs approval or was denied: typed, so a UI can render it next to the tool."""

    SANDBOX_REJECTED = "sandbox_rejected"
    POLICY_ALWAYS = "policy_always"
    DESTRUCTIVE_EFFECT = "destructive_effect"
    UNKNOWN_COMMAND = "unknown_command"
    NETWORK_REQUEST = "network_request"
    UNTRUSTED_MCP_SERVER = "untrusted_mcp_server"


class Verdict:
    ALLOWED = "allowed"
    NEEDS_APPROVAL = "needs_approval"
    DENIED_BY_SANDBOX = "denied_by_sandbox"


class Decision(Record):
    verdict: str
    reason: str | None = None
    detail: str = ""

    @property
    def allowed(self) -> bool:
        return self.verdict == Verdict.ALLOWED


ALLOWED = Decision(Verdict.ALLOWED)


class ToolRules(Record):
    """What a permission mode adds on top of the two axes, by tool category: categories
    hidden from the model (and refused if called anyway), and categories asked about on
    every call. Empty for sessions created with the two axes."""

    hidden: frozenset[str] = Factory(frozenset)
    always_ask: frozenset[str] = Factory(frozenset)
    mode: str = ""                                    # the permission mode it came from, for messages


def sandbox_denial(effect: str, sandbox: SandboxPolicy) -> str | None:
    """Why the sandbox structurally rules this effect out, or None."""
    if effect not in Effect.ALL:
        raise InvalidPolicy(f"unknown effect {effect!r}: use one of {', '.join(Effect.ALL)}")
    if isinstance(sandbox, DangerFullAccess):
        return None
    if effect == Effect.DESTRUCTIVE:
        return f"writes outside the writable roots are impossible under {sandbox.name}"
    if effect == Effect.WORKSPACE_WRITE and isinstance(sandbox, ReadOnly):
        return "nothing is writable under read-only: switch the session to workspace-write to write"
    if effect == Effect.NETWORK and not sandbox.network_access:
        return f"the network is off under {sandbox.name}: switch network access on to reach it"
    return None


def structural_reason(effect: str, *, untrusted_mcp: bool = False) -> str | None:
    """The reason on-request asks for (most specific first), or None when it would not ask."""
    if effect == Effect.DESTRUCTIVE:
        return Reason.DESTRUCTIVE_EFFECT
    if untrusted_mcp:
        return Reason.UNTRUSTED_MCP_SERVER
    if effect == Effect.NETWORK:
        return Reason.NETWORK_REQUEST
    if effect == Effect.UNKNOWN_COMMAND:
        return Reason.UNKNOWN_COMMAND
    return None


def decide(effect: str | None, tool: str, sandbox: SandboxPolicy, approval: ApprovalPolicy, *,
           category: str = Category.EXTERNAL, untrusted_mcp: bool = False, rules: ToolRules | None = None) -> Decision:
    """Allowed, NeedsApproval(reason) or DeniedBySandbox(reason) for one call of ``tool``.
    ``effect`` None (a tool that declares none) counts as an unknown command."""
    approval = approval_policy(approval)
    effect = effect or Effect.UNKNOWN_COMMAND
    rules = rules or ToolRules()
    if category in rules.hidden:
        return Decision(Verdict.DENIED_BY_SANDBOX, Reason.SANDBOX_REJECTED,
                        f"{tool} is not available in permission mode {rules.mode}")
    denial = sandbox_denial(effect, sandbox)
    if denial is not None:
        return Decision(Verdict.DENIED_BY_SANDBOX, Reason.SANDBOX_REJECTED, f"{tool}: {denial}")
    if approval is ApprovalPolicy.NEVER:
        return ALLOWED
    reason = structural_reason(effect, untrusted_mcp=untrusted_mcp)
    if approval is ApprovalPolicy.ALWAYS or category in rules.always_ask:
        return Decision(Verdict.NEEDS_APPROVAL, reason or Reason.POLICY_ALWAYS)
    if reason is not None:
        return Decision(Verdict.NEEDS_APPROVAL, reason)
    return ALLOWED


# ---- permission modes (the single-axis clients) ----------------------------------------------

class PermissionMode:
    READ_ONLY = "read_only"
    AUTO = "auto"
    FULL = "full"

    ALIASES = {"read_only": READ_ONLY, "readonly": READ_ONLY, "read-only": READ_ONLY, "auto": AUTO,
               "full": FULL, "full_access": FULL, "full-access": FULL}

    @classmethod
    def parse(cls, value: str | None) -> str:
        """Missing or unrecognised means full, so old clients keep working."""
        return cls.ALIASES.get((value or "").strip().lower(), cls.FULL)

    @classmethod
    def from_legacy(cls, allow_shell: bool, allow_file_write: bool) -> str:
        """The old booleans: both off is read_only, both on full; a mix is a custom mode
        (``rules_for`` handles each half)."""
        if allow_shell and allow_file_write:
            return cls.FULL
        if not allow_shell and not allow_file_write:
            return cls.READ_ONLY
        return "shell_only" if allow_shell else "file_write_only"


def axes_for(mode: str, *, network_access: bool = False) -> tuple[SandboxPolicy, ApprovalPolicy, ToolRules]:
    """The two axes and the tool rules a permission mode stands for (see the table in docs/approvals-and-audit.md).

    - read_only: read-only sandbox, never ask, file-write and execution tools hidden.
    - auto: workspace-write sandbox, on-request, and every file-write or execution call asked.
    - full: workspace-write sandbox, never ask. Never danger-full-access: the kernel sandbox
      stays; "full" only silences the prompts.
    - the legacy mixes: shell without file writes is a read-only sandbox with file-write tools
      hidden; file writes without shell is workspace-write with execution tools hidden.
    """
    from sandboxd.policy.sandbox import WorkspaceWrite

    write_and_exec = frozenset((Category.FILE_WRITE, Category.EXECUTION))
    if mode == PermissionMode.READ_ONLY:
        return ReadOnly(), ApprovalPolicy.NEVER, ToolRules(hidden=write_and_exec, mode=mode)
    if mode == PermissionMode.AUTO:
        return (WorkspaceWrite(network_access=network_access), ApprovalPolicy.ON_REQUEST,
                ToolRules(always_ask=write_and_exec, mode=mode))
    if mode == "shell_only":
        return ReadOnly(), ApprovalPolicy.NEVER, ToolRules(hidden=frozenset((Category.FILE_WRITE,)), mode=mode)
    if mode == "file_write_only":
        return (WorkspaceWrite(network_access=network_access), ApprovalPolicy.NEVER,
                ToolRules(hidden=frozenset((Category.EXECUTION,)), mode=mode))
    return WorkspaceWrite(network_access=network_access), ApprovalPolicy.NEVER, ToolRules(mode=PermissionMode.FULL)
