"""The tools `sandboxd mcp` offers a model: names, descriptions and JSON schemas.

Each MCP tool maps to one built-in daemon tool (the name the policy engine, the approvals and
the audit log use). The list follows the session's policy as the daemon's ListTools does, and
hides what a read-only sandbox could never do (shell, writes, patches, starting processes), so
a model is not shown tools that only fail."""

from __future__ import annotations

from typing import Any

import mcp_types as types

from sandboxd.v1 import sandboxd_pb2 as pb

_STR = {"type": "string"}


def _schema(properties: dict[str, dict[str, Any]], required: list[str]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


class ToolDef:
    def __init__(self, name: str, daemon_tool: str, description: str, schema: dict[str, Any], *,
                 read_only: bool, policy_in_description: bool = False) -> None:
        self.name, self.daemon_tool, self.description, self.schema = name, daemon_tool, description, schema
        self.read_only, self.policy_in_description = read_only, policy_in_description


TOOLS: tuple[ToolDef, ...] = (
    ToolDef("shell", "shell.exec",
            "Run a shell command (/bin/sh -c) in the sandboxed workspace and wait for it. Output is streamed as "
            "progress notifications; the result gives stdout, stderr, the exit status, the signal that killed it, "
            "whether it timed out and whether output was cut.",
            _schema({"command": {"type": "string", "description": "The shell command, e.g. `pytest -q`."},
                     "timeout": {"type": "number", "exclusiveMinimum": 0, "maximum": 604800,
                                 "description": "Seconds before the command's whole process tree is killed "
                                                "(default: the session's limit, if any)."},
                     "cwd": {"type": "string", "description": "Working directory, absolute or relative to the "
                                                              "workspace (default: the workspace)."},
                     "env": {"type": "object", "additionalProperties": _STR,
                             "description": "Variables added to the session's environment (PATH, HOME, LANG are set already)."}}, ["command"]),
            read_only=False, policy_in_description=True),
    ToolDef("read_file", "fs.read", "Read a text file (absolute, or relative to the workspace).",
            _schema({"path": _STR, "max_bytes": {"type": "integer", "minimum": 1, "maximum": 64 << 20,
                                                  "description": "Read at most this many bytes (default 4 MiB)."}},
                    ["path"]), read_only=True),
    ToolDef("write_file", "fs.write",
            "Write a whole file atomically (created or replaced). Missing parent directories are created.",
            _schema({"path": _STR, "content": {"type": "string", "description": "The file's new content."}},
                    ["path", "content"]), read_only=False, policy_in_description=True),
    ToolDef("list_dir", "fs.list", "List a directory: name, type, size and mode of each entry.",
            _schema({"path": {"type": "string", "description": "Default: the workspace."}}, []), read_only=True),
    ToolDef("apply_patch", "patch.apply",
            "Apply a unified diff (git diff or diff -u) to one or more files, all-or-nothing: every hunk must "
            "apply or nothing is written. Paths are relative to the workspace.",
            _schema({"patch": {"type": "string", "description": "The unified diff."},
                     "strip": {"type": "integer", "minimum": 0, "description": "Leading path components to "
                                                                               "strip (default: auto)."}},
                    ["patch"]), read_only=False, policy_in_description=True),
    ToolDef("search", "search", "Search files with a regular expression (ripgrep syntax); returns path:line: text.",
            _schema({"pattern": _STR, "path": {"type": "string", "description": "Default: the workspace."},
                     "case_insensitive": {"type": "boolean"},
                     "max_results": {"type": "integer", "minimum": 1, "maximum": 100000}}, ["pattern"]),
            read_only=True),
    ToolDef("start_process", "monitor.start",
            "Start a long-running shell command in the background (a dev server, a watcher); returns its id. "
            "It keeps running after this call; read its output with read_process_output, stop it with "
            "stop_process. It dies with the session.",
            _schema({"command": _STR, "name": {"type": "string", "description": "A label."},
                     "cwd": _STR, "env": {"type": "object", "additionalProperties": _STR}}, ["command"]),
            read_only=False, policy_in_description=True),
    ToolDef("list_processes", "monitor.list", "List the background processes: id, pid, running or exit status.",
            _schema({}, []), read_only=True),
    ToolDef("read_process_output", "monitor.list",
            "Read a background process's combined stdout and stderr from a byte offset (the last 4 MiB are kept).",
            _schema({"id": _STR, "offset": {"type": "integer", "minimum": 0,
                                            "description": "From this byte of its output (default 0); pass the "
                                                           "returned next_offset to read only what is new."}},
                    ["id"]), read_only=True),
    ToolDef("stop_process", "monitor.stop", "Stop a background process (its whole process tree).",
            _schema({"id": _STR}, ["id"]), read_only=True),
)
# Review mode's tools (a session created with review): the model may look at its own change set,
# never apply or discard it (a person's decision, through sandboxctl or the end-of-session prompt).
# They name no daemon tool: the daemon serves them to the session's owner, outside the policy engine,
# and they change nothing.
_REVIEW_SCHEMA = _schema({
    "paths": {"type": "array", "items": _STR, "maxItems": 100,
              "description": "Only these paths (absolute, or relative to the workspace); default: all."},
    "page_token": {"type": "string", "description": "next_page_token of the previous page."}}, [])
REVIEW_TOOLS: tuple[ToolDef, ...] = (
    ToolDef("list_changes", "",
            "List this session's pending changes: its writes are kept for a person's review and have not reached "
            "the host. Each line: kind (added, modified, deleted, replaced, type_changed, metadata), path, and why "
            "it is flagged or in conflict, if it is. Only a person can apply or discard them.",
            _REVIEW_SCHEMA,
            read_only=True),
    ToolDef("diff_changes", "",
            "Show this session's pending changes as a unified diff (binary files, types and modes as one line "
            "each), paged. Only a person can apply or discard them.",
            _REVIEW_SCHEMA,
            read_only=True),
)
BY_NAME = {tool.name: tool for tool in TOOLS + REVIEW_TOOLS}
# What a read-only sandbox hides: the daemon's permission mode read_only hides the same tools.
_NEEDS_WRITE = frozenset(("shell.exec", "fs.write", "patch.apply", "monitor.start"))


def policy_text(session: pb.Session) -> str:
    """The session's policy in one paragraph, for a model."""
    policy = session.sandbox_policy
    mode = policy.mode or pb.SandboxPolicy.WORKSPACE_WRITE
    if mode == pb.SandboxPolicy.READ_ONLY:
        files = "read-only sandbox: nothing can be written anywhere"
    elif mode == pb.SandboxPolicy.DANGER_FULL_ACCESS:
        files = "full access: no sandbox walls"
    else:
        roots = [session.workspace, *policy.writable_roots]
        files = f"writes allowed only under {', '.join(roots)} (the kernel refuses writes elsewhere)"
        if session.review:
            files += ("; review mode: writes are kept for a person's review and reach the host only when the "
                      "person applies them (list_changes, diff_changes show them)")
    network = ("network: on" if policy.network_access or mode == pb.SandboxPolicy.DANGER_FULL_ACCESS
               else "network: off (no connections leave the sandbox)")
    approval = {pb.NEVER: "never asks a person (what the policy forbids is denied)",
                pb.ALWAYS: "a person approves every call",
                }.get(session.approval_policy, "calls the policy cannot vouch for wait for a person's approval")
    return f"Policy: workspace {session.workspace}; {files}; {network}; approvals: {approval}."


def visible(session: pb.Session, daemon_tools: list[str]) -> list[types.Tool]:
    """The MCP tools to list: those whose daemon tool ListTools shows, less what a read-only
    sandbox hides."""
    shown = set(daemon_tools)
    if session.sandbox_policy.mode == pb.SandboxPolicy.READ_ONLY:
        shown -= _NEEDS_WRITE
    policy = policy_text(session)
    offered = [tool for tool in TOOLS if tool.daemon_tool in shown] + (list(REVIEW_TOOLS) if session.review else [])
    return [types.Tool(name=tool.name,
                       description=f"{tool.description} {policy}" if tool.policy_in_description else tool.description,
                       input_schema=tool.schema,
                       annotations=types.ToolAnnotations(read_only_hint=tool.read_only,
                                                         open_world_hint=bool(session.sandbox_policy.network_access)))
            for tool in offered]
