"""The policy engine (sandboxd.policy.decision): the decision matrix, the invariants, the
command classifier and the permission modes. Pure: no daemon, no kernel."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from sandboxd.errors import InvalidPolicy
from sandboxd.policy import DangerFullAccess, ReadOnly, WorkspaceWrite
from sandboxd.policy.decision import (
    ApprovalPolicy,
    PermissionMode,
    Reason,
    ToolRules,
    Verdict,
    axes_for,
    decide,
)
from sandboxd.policy.tools import BUILTIN_TOOLS, Category, Effect, WriteScope, classify_command, summary_of

SANDBOXES = {"read-only": ReadOnly(), "workspace-write": WorkspaceWrite(),
             "workspace-write+network": WorkspaceWrite(network_access=True), "danger-full-access": DangerFullAccess()}

# sandbox, effect: (never, on-request, always). "allow", "ask REASON", "deny REASON".
MATRIX = """
read-only               | read-only       | allow | allow                  | ask policy_always
read-only               | workspace-write | deny sandbox_rejected | deny sandbox_rejected | deny sandbox_rejected
read-only               | network         | deny sandbox_rejected | deny sandbox_rejected | deny sandbox_rejected
read-only               | destructive     | deny sandbox_rejected | deny sandbox_rejected | deny sandbox_rejected
read-only               | unknown-command | allow | ask unknown_command    | ask unknown_command
workspace-write         | read-only       | allow | allow                  | ask policy_always
workspace-write         | workspace-write | allow | allow                  | ask policy_always
workspace-write         | network         | deny sandbox_rejected | deny sandbox_rejected | deny sandbox_rejected
workspace-write         | destructive     | deny sandbox_rejected | deny sandbox_rejected | deny sandbox_rejected
workspace-write         | unknown-command | allow | ask unknown_command    | ask unknown_command
workspace-write+network | read-only       | allow | allow                  | ask policy_always
workspace-write+network | workspace-write | allow | allow                  | ask policy_always
workspace-write+network | network         | allow | ask network_request    | ask network_request
workspace-write+network | destructive     | deny sandbox_rejected | deny sandbox_rejected | deny sandbox_rejected
workspace-write+network | unknown-command | allow | ask unknown_command    | ask unknown_command
danger-full-access      | read-only       | allow | allow                  | ask policy_always
danger-full-access      | workspace-write | allow | allow                  | ask policy_always
danger-full-access      | network         | allow | ask network_request    | ask network_request
danger-full-access      | destructive     | allow | ask destructive_effect | ask destructive_effect
danger-full-access      | unknown-command | allow | ask unknown_command    | ask unknown_command
"""


def parse_matrix(text: str) -> dict[tuple[str, str, str], str]:
    cells = {}
    for line in text.strip().splitlines():
        sandbox, effect, *answers = [part.strip() for part in line.split("|")]
        assert len(answers) == 3, line
        for approval, answer in zip(ApprovalPolicy.ALL, answers):
            cells[(sandbox, effect, approval)] = answer
    return cells


def rendered(effect: str, sandbox: str, approval: str) -> str:
    decision = decide(effect, "shell.exec", SANDBOXES[sandbox], approval, category=Category.EXECUTION)
    word = {Verdict.ALLOWED: "allow", Verdict.NEEDS_APPROVAL: "ask", Verdict.DENIED_BY_SANDBOX: "deny"}
    return word[decision.verdict] + (f" {decision.reason}" if decision.reason else "")


EXPECTED = parse_matrix(MATRIX)


def test_the_matrix_covers_every_cell() -> None:
    assert len(EXPECTED) == len(SANDBOXES) * len(Effect.ALL) * len(ApprovalPolicy.ALL)


@pytest.mark.parametrize("cell", sorted(EXPECTED), ids=lambda c: "/".join(c))
def test_decision_matrix(cell: tuple[str, str, str]) -> None:
    sandbox, effect, approval = cell
    assert rendered(effect, sandbox, approval) == EXPECTED[cell]


def test_the_docs_show_the_same_matrix() -> None:
    """Users read the matrix in docs/approvals-and-audit.md: it must be this one."""
    page = (Path(__file__).resolve().parent.parent / "docs" / "approvals-and-audit.md").read_text()
    rows = re.findall(r"^\| `([a-z+-]+)` \| `([a-z-]+)` \| ([^|]+) \| ([^|]+) \| ([^|]+) \|$", page, re.M)
    shown = {}
    for sandbox, effect, *answers in rows:
        for approval, answer in zip(ApprovalPolicy.ALL, answers):
            shown[(sandbox, effect, approval)] = answer.strip().replace("**", "")
    assert shown == EXPECTED


# ---- the invariants ----------------------------------------------------------------------------

@pytest.mark.parametrize("approval", ApprovalPolicy.ALL)
@pytest.mark.parametrize("effect", Effect.ALL)
def test_never_never_widens_the_sandbox(effect: str, approval: str) -> None:
    """Whatever the sandbox denies under some approval policy, it denies under `never` too."""
    for sandbox in SANDBOXES.values():
        strict = decide(effect, "t", sandbox, approval)
        relaxed = decide(effect, "t", sandbox, ApprovalPolicy.NEVER)
        if strict.verdict == Verdict.DENIED_BY_SANDBOX:
            assert relaxed.verdict == Verdict.DENIED_BY_SANDBOX


def test_the_sandbox_decides_before_the_approval_policy() -> None:
    """A denial never depends on the approval axis: it is structural."""
    for sandbox in SANDBOXES.values():
        for effect in Effect.ALL:
            verdicts = {decide(effect, "t", sandbox, a).verdict == Verdict.DENIED_BY_SANDBOX
                        for a in ApprovalPolicy.ALL}
            assert len(verdicts) == 1


def test_a_tool_without_an_effect_is_an_unknown_command() -> None:
    decision = decide(None, "mcp.some_tool", WorkspaceWrite(), ApprovalPolicy.ON_REQUEST)
    assert (decision.verdict, decision.reason) == (Verdict.NEEDS_APPROVAL, Reason.UNKNOWN_COMMAND)


def test_an_untrusted_mcp_server_is_asked_about_even_for_reads() -> None:
    asked = decide(Effect.READ_ONLY, "mcp.read", WorkspaceWrite(), ApprovalPolicy.ON_REQUEST, untrusted_mcp=True)
    assert (asked.verdict, asked.reason) == (Verdict.NEEDS_APPROVAL, Reason.UNTRUSTED_MCP_SERVER)
    trusted = decide(Effect.READ_ONLY, "mcp.read", WorkspaceWrite(), ApprovalPolicy.ON_REQUEST)
    assert trusted.verdict == Verdict.ALLOWED
    # `never` silences it; the sandbox still rules.
    assert decide(Effect.READ_ONLY, "mcp.read", WorkspaceWrite(), ApprovalPolicy.NEVER, untrusted_mcp=True).allowed
    denied = decide(Effect.NETWORK, "mcp.fetch", WorkspaceWrite(), ApprovalPolicy.NEVER, untrusted_mcp=True)
    assert denied.verdict == Verdict.DENIED_BY_SANDBOX


def test_bad_input_is_refused_with_what_to_use() -> None:
    with pytest.raises(InvalidPolicy, match="never, on-request, always"):
        decide(Effect.READ_ONLY, "t", ReadOnly(), "sometimes")
    with pytest.raises(InvalidPolicy, match="read-only, workspace-write"):
        decide("explosive", "t", ReadOnly(), ApprovalPolicy.NEVER)


# ---- permission modes --------------------------------------------------------------------------

@pytest.mark.parametrize("value, mode", [
    ("read_only", "read_only"), ("readonly", "read_only"), ("read-only", "read_only"), ("READ-ONLY", "read_only"),
    ("auto", "auto"), ("full", "full"), ("full_access", "full"), ("full-access", "full"),
    ("", "full"), (None, "full"), ("whatever", "full"),
])
def test_permission_mode_aliases(value: str | None, mode: str) -> None:
    assert PermissionMode.parse(value) == mode


def tool_decision(mode: str, tool: str, effect: str | None = None) -> str:
    sandbox, approval, rules = axes_for(mode)
    spec = BUILTIN_TOOLS[tool]
    decision = decide(effect or spec.effect, tool, sandbox, approval, category=spec.category, rules=rules)
    return decision.verdict


def test_read_only_mode_hides_writes_and_execution() -> None:
    assert tool_decision("read_only", "fs.read") == Verdict.ALLOWED
    assert tool_decision("read_only", "search") == Verdict.ALLOWED
    for tool in ("fs.write", "patch.apply"):
        assert tool_decision("read_only", tool) == Verdict.DENIED_BY_SANDBOX
    for tool in ("shell.exec", "monitor.start"):
        assert tool_decision("read_only", tool, Effect.READ_ONLY) == Verdict.DENIED_BY_SANDBOX


def test_auto_mode_asks_for_every_write_and_execution() -> None:
    assert tool_decision("auto", "fs.read") == Verdict.ALLOWED
    assert tool_decision("auto", "fs.write") == Verdict.NEEDS_APPROVAL
    assert tool_decision("auto", "shell.exec", Effect.READ_ONLY) == Verdict.NEEDS_APPROVAL


def test_full_mode_asks_nothing_but_keeps_the_sandbox() -> None:
    sandbox, approval, _ = axes_for("full")
    assert sandbox == WorkspaceWrite() and approval == ApprovalPolicy.NEVER
    assert tool_decision("full", "shell.exec", Effect.UNKNOWN_COMMAND) == Verdict.ALLOWED
    assert tool_decision("full", "fs.write", Effect.DESTRUCTIVE) == Verdict.DENIED_BY_SANDBOX


@pytest.mark.parametrize("shell, write, mode", [(False, False, "read_only"), (True, True, "full"),
                                                (True, False, "shell_only"), (False, True, "file_write_only")])
def test_legacy_booleans(shell: bool, write: bool, mode: str) -> None:
    assert PermissionMode.from_legacy(shell, write) == mode
    sandbox, _, rules = axes_for(mode)
    assert (Category.FILE_WRITE in rules.hidden) == (not write)
    assert (Category.EXECUTION in rules.hidden) == (not shell)
    assert isinstance(sandbox, WorkspaceWrite) == write


def test_rules_never_override_a_denial() -> None:
    rules = ToolRules(always_ask=frozenset((Category.FILE_WRITE,)))
    decision = decide(Effect.WORKSPACE_WRITE, "fs.write", ReadOnly(), ApprovalPolicy.NEVER,
                      category=Category.FILE_WRITE, rules=rules)
    assert decision.verdict == Verdict.DENIED_BY_SANDBOX


# ---- the command classifier --------------------------------------------------------------------

SCOPE = WriteScope(roots=("/ws", "/cache"), protected=(".git/hooks", ".git/config"), scratch=("/tmp", "/dev/shm"))


@pytest.mark.parametrize("argv, effect", [
    (["ls", "-la"], Effect.READ_ONLY),
    (["/bin/cat", "a.txt"], Effect.READ_ONLY),
    (["git", "status"], Effect.READ_ONLY),
    (["git", "-C", "sub", "log"], Effect.UNKNOWN_COMMAND),       # not sure what -C takes: unknown
    (["git", "commit", "-m", "x"], Effect.UNKNOWN_COMMAND),
    (["git", "push"], Effect.NETWORK),
    (["curl", "https://example.org"], Effect.NETWORK),
    (["pip", "install", "requests"], Effect.NETWORK),
    (["find", ".", "-name", "*.py"], Effect.READ_ONLY),
    (["find", ".", "-delete"], Effect.UNKNOWN_COMMAND),
    (["sed", "-i", "s/a/b/", "f"], Effect.UNKNOWN_COMMAND),
    (["sed", "-n", "1p", "f"], Effect.READ_ONLY),
    (["mkdir", "-p", "build/out"], Effect.WORKSPACE_WRITE),
    (["rm", "-rf", "/cache/old"], Effect.WORKSPACE_WRITE),
    (["rm", "-rf", "/etc"], Effect.DESTRUCTIVE),
    (["cp", "a", "../elsewhere/b"], Effect.DESTRUCTIVE),
    (["pytest", "-q"], Effect.UNKNOWN_COMMAND),
    (["/bin/sh", "-c", "ls -la"], Effect.READ_ONLY),
    (["/bin/sh", "-c", "ls; rm -rf /"], Effect.UNKNOWN_COMMAND),
    (["/bin/sh", "-c", "cat a > /etc/passwd"], Effect.UNKNOWN_COMMAND),
    (["/bin/sh", "-c", "echo $(id)"], Effect.UNKNOWN_COMMAND),
    (["/bin/sh", "-c", "echo 'unterminated"], Effect.UNKNOWN_COMMAND),
    ([], Effect.UNKNOWN_COMMAND),
    # A known name outside the system's directories is the agent's own program: the control is
    # the same name where the system keeps it.
    (["/usr/bin/cat", "a"], Effect.READ_ONLY),
    (["./cat", "a"], Effect.UNKNOWN_COMMAND),
    (["/ws/bin/ls"], Effect.UNKNOWN_COMMAND),
    (["/ws/evilsh", "-c", "ls"], Effect.UNKNOWN_COMMAND),
    (["/ws/bash", "-c", "ls"], Effect.UNKNOWN_COMMAND),
])
def test_classify_command(argv: list[str], effect: str) -> None:
    assert classify_command(argv, cwd="/ws", scope=SCOPE).effect == effect


def test_summaries() -> None:
    assert summary_of("shell.exec", ["/bin/sh", "-c", "pytest -q"]) == "Execute: pytest -q"
    assert summary_of("shell.exec", ["ls", "my dir"]) == "Execute: ls 'my dir'"
    assert summary_of("fs.write", path="src/a.py") == "Write: src/a.py"
    long = summary_of("shell.exec", ["x" * 500])
    assert len(long) <= 200 and long.startswith("Execute: xxx")
    assert long.endswith(f" ... [cut: {long.index(' ...')} of 509 characters shown]"), long
    # Only a system shell's script is shown alone: a program of the agent's named like a shell is
    # shown whole, or the card would read `Execute: ls` while /ws/evilsh runs.
    assert summary_of("shell.exec", ["/ws/evilsh", "-c", "ls"]) == "Execute: /ws/evilsh -c ls"
    assert summary_of("shell.exec", ["./bash", "-c", "ls"]) == "Execute: ./bash -c ls"
