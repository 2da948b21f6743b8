"""Tools, what they do to the world (their PolicyEffect), and how risky they look to a person.

The engine reads only the effect; ``Risk`` is shown to people (an approval card,
a status line) and never decides anything. Built-in tools have a fixed effect,
except the ones that run a command (``shell.exec``, ``monitor.start``): theirs
comes from the command, through a deliberately small classifier that only
recognises what it can be sure of and calls everything else an unknown command.
"""

from __future__ import annotations

import os
import shlex

from sandboxd._record import Record
from sandboxd.errors import InvalidPolicy
from sandboxd.policy.sandbox import is_within


class Effect:
    """What a tool call does, as far as the policy engine is concerned."""

    READ_ONLY = "read-only"
    WORKSPACE_WRITE = "workspace-write"      # writes inside the writable roots only
    NETWORK = "network"
    DESTRUCTIVE = "destructive"              # writes outside the writable roots
    UNKNOWN_COMMAND = "unknown-command"      # anything the engine cannot vouch for

    ALL = (READ_ONLY, WORKSPACE_WRITE, NETWORK, DESTRUCTIVE, UNKNOWN_COMMAND)


class Risk:
    LOW = "low"
    MEDIUM = "medium"
    HIGH = "high"


class Category:
    """What a permission mode (read_only / auto / full) hides or asks about."""

    READ = "read"
    FILE_WRITE = "file-write"
    EXECUTION = "execution"                  # runs a program: shell, code, a background process
    MONITOR = "monitor"                      # looks at or stops background processes
    EXTERNAL = "external"                    # a tool outside sandboxd (MCP, browser, desktop)


# The longest tool name a caller may give (Authorize, a standing rule): it is a column of every
# event of the call and of the rule's row, so it is bounded at the door, not clipped (MCP names
# tools in at most 128 characters).
MAX_TOOL_NAME = 256


def check_tool_name(tool: str) -> None:
    """InvalidPolicy unless ``tool`` names a tool in 1 to MAX_TOOL_NAME bytes."""
    if not tool:
        raise InvalidPolicy("name the tool (for example browser.action)")
    size = len(tool.encode(errors="surrogateescape"))
    if size > MAX_TOOL_NAME:
        raise InvalidPolicy(f"the tool name is {size} bytes long; the limit is {MAX_TOOL_NAME}")


class ToolSpec(Record):
    name: str
    risk: str
    effect: str | None                       # None: from the command (shell.exec, monitor.start)
    category: str
    description: str


BUILTIN_TOOLS: dict[str, ToolSpec] = {spec.name: spec for spec in (
    ToolSpec("shell.exec", Risk.HIGH, None, Category.EXECUTION, "Run a command in the session's sandbox."),
    ToolSpec("fs.read", Risk.LOW, Effect.READ_ONLY, Category.READ, "Read a file."),
    ToolSpec("fs.write", Risk.MEDIUM, Effect.WORKSPACE_WRITE, Category.FILE_WRITE,
             "Create or overwrite a file."),
    ToolSpec("fs.list", Risk.LOW, Effect.READ_ONLY, Category.READ, "List a directory."),
    ToolSpec("patch.apply", Risk.MEDIUM, Effect.WORKSPACE_WRITE, Category.FILE_WRITE,
             "Apply a unified diff to one or more files, all or nothing."),
    ToolSpec("search", Risk.LOW, Effect.READ_ONLY, Category.READ, "Search the workspace with a regex."),
    ToolSpec("monitor.start", Risk.LOW, None, Category.EXECUTION, "Start a background process."),
    ToolSpec("monitor.list", Risk.LOW, Effect.READ_ONLY, Category.MONITOR, "List background processes."),
    ToolSpec("monitor.stop", Risk.LOW, Effect.READ_ONLY, Category.MONITOR, "Stop a background process."),
)}

# Programs that only read, whatever their arguments (apart from the exceptions below).
READ_ONLY_PROGRAMS = frozenset((
    "cat", "ls", "head", "tail", "wc", "grep", "egrep", "fgrep", "rg", "pwd", "echo", "true", "false",
    "stat", "file", "which", "whoami", "id", "date", "uname", "tree", "du", "df", "diff", "cmp", "sort",
    "uniq", "cut", "tr", "basename", "dirname", "realpath", "readlink", "nl", "od", "xxd", "sha256sum",
    "sha1sum", "md5sum", "hostname", "printf", "test", "[",
))
READ_ONLY_GIT = frozenset(("status", "log", "diff", "show", "rev-parse", "ls-files", "blame", "grep", "describe"))
# Options that make an otherwise reading program write or run something.
WRITING_OPTIONS = {"find": ("-delete", "-exec", "-execdir", "-ok", "-okdir", "-fprint", "-fprint0", "-fprintf",
                            "-fls"),
                   "sort": ("-o", "--output"), "sed": ("-i", "--in-place")}
NETWORK_PROGRAMS = frozenset(("curl", "wget", "ssh", "scp", "sftp", "nc", "ncat", "telnet", "ping", "ftp"))
NETWORK_SUBCOMMANDS = {"git": ("clone", "fetch", "pull", "push", "ls-remote"),
                       "pip": ("install", "download"), "pip3": ("install", "download"),
                       "npm": ("install", "ci", "update", "publish"), "yarn": ("add", "install"),
                       "cargo": ("fetch", "install", "update"), "go": ("get", "mod")}
# Programs that write the paths they are given (every non-option argument).
PATH_WRITING_PROGRAMS = frozenset(("mkdir", "touch", "cp", "mv", "rm", "rmdir", "ln", "chmod", "truncate"))
# A shell string with any of these is more than one plain command (or expands something).
SHELL_SYNTAX = frozenset(";&|<>$`(){}\n*?[]~!#\\")
# The shells whose ``-c STRING`` is looked into (classified, and shown as its script): only these
# spellings, so a program of the agent's own named ``evilsh`` or ``/ws/bash`` is shown and
# classified as the program it is.
SHELLS = frozenset(("/bin/sh", "sh", "/bin/bash", "bash", "/usr/bin/sh", "/usr/bin/bash"))
# Where a known program's name counts as that program: a bare name (looked up in PATH) or these
# system directories, which every sandbox sees read-only. ``./ls`` or ``/ws/cat`` is the agent's
# own file, whatever its name: UNKNOWN_COMMAND.
SYSTEM_BIN_DIRS = frozenset(("/bin", "/usr/bin", "/usr/local/bin", "/sbin", "/usr/sbin", "/usr/local/sbin"))


def classify_command(argv: "list[str] | tuple[str, ...]", *, cwd: str, writable_roots: "list[str]") -> str:
    """The effect of running ``argv`` (a ``/bin/sh -c STRING`` is looked into when it is one
    plain command). Anything not recognised is UNKNOWN_COMMAND: the engine never guesses
    in the permissive direction."""
    argv = list(argv)
    if len(argv) == 3 and argv[0] in SHELLS and argv[1] == "-c":
        script = argv[2]
        if any(ch in SHELL_SYNTAX for ch in script) or not script.strip():
            return Effect.UNKNOWN_COMMAND
        try:
            argv = shlex.split(script)
        except ValueError:
            return Effect.UNKNOWN_COMMAND
    if not argv:
        return Effect.UNKNOWN_COMMAND
    if "/" in argv[0] and os.path.dirname(argv[0]) not in SYSTEM_BIN_DIRS:
        return Effect.UNKNOWN_COMMAND
    program, args = os.path.basename(argv[0]), argv[1:]
    first = next((a for a in args if not a.startswith("-")), "")
    if program in NETWORK_PROGRAMS or first in NETWORK_SUBCOMMANDS.get(program, ()):
        return Effect.NETWORK
    if program == "git":
        return Effect.READ_ONLY if first in READ_ONLY_GIT else Effect.UNKNOWN_COMMAND
    if program in READ_ONLY_PROGRAMS or program in WRITING_OPTIONS:
        writing = WRITING_OPTIONS.get(program, ())
        if any(a == w or a.startswith(w + "=") or (w == "-i" and a.startswith("-i")) for a in args for w in writing):
            return Effect.UNKNOWN_COMMAND
        return Effect.READ_ONLY
    if program in PATH_WRITING_PROGRAMS:
        targets = [a for a in args if not a.startswith("-")]
        if not targets:
            return Effect.UNKNOWN_COMMAND
        return write_effect([os.path.normpath(os.path.join(cwd, t)) for t in targets], writable_roots)
    return Effect.UNKNOWN_COMMAND


def write_effect(paths: "list[str]", writable_roots: "list[str]") -> str:
    """WORKSPACE_WRITE when every path is inside a writable root, else DESTRUCTIVE."""
    inside = all(any(is_within(path, root) for root in writable_roots) for path in paths)
    return Effect.WORKSPACE_WRITE if inside else Effect.DESTRUCTIVE


SUMMARY_CHARS = 200


def summary_of(tool: str, argv: "list[str] | tuple[str, ...]" = (), path: str = "", command: str = "") -> str:
    """The one line an approval card shows: ``Execute: pytest -q``, ``Write: src/a.py``; at most
    SUMMARY_CHARS characters. A longer line says so, with its whole length, so that a person
    asked about it knows there is more than shown (the call runs all of it; the approval is of
    the call, never of this text): ``Execute: python3 -c '... ... [cut: 160 of 1835030 characters shown]``."""
    if argv or command:
        if not command:
            command = argv[2] if len(argv) == 3 and argv[1] == "-c" and argv[0] in SHELLS else shlex.join(argv)
        line = f"Execute: {command}"
    elif path:
        verb = {"fs.write": "Write", "fs.read": "Read", "fs.list": "List", "patch.apply": "Patch",
                "search": "Search"}.get(tool, tool)
        line = f"{verb}: {path}"
    else:
        line = tool
    if len(line) <= SUMMARY_CHARS:
        return line
    marker = f" ... [cut: {{}} of {len(line)} characters shown]"
    keep = SUMMARY_CHARS - len(marker.format(SUMMARY_CHARS))
    return line[:keep] + marker.format(keep)
