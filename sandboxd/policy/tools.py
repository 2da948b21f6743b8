"""Tools, what they do to the world (their PolicyEffect), and how risky they look to a person.

The engine reads only the effect; ``Risk`` is shown to people (an approval card,
a status line) and never decides anything. Built-in tools have a fixed effect,
except the ones that run a command (``shell.exec``, ``monitor.start``): theirs
comes from the command and the environment it carries, through a deliberately
small classifier that only recognises what it can be sure of (each program's
harmless forms: sandboxd.policy.safe_commands) and calls everything else an
unknown command.
"""

from __future__ import annotations

import os
import shlex

from sandboxd._record import Record
from sandboxd.errors import InvalidPolicy
from sandboxd.policy.command_env import CommandEnv, effective, unknown_variables, untrusted_directories
from sandboxd.policy.safe_commands import read_only, written_paths
from sandboxd.policy.sandbox import is_within
from sandboxd.policy.shell_script import Command, split


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

NETWORK_PROGRAMS = frozenset(("curl", "wget", "ssh", "scp", "sftp", "nc", "ncat", "telnet", "ping", "ftp"))
NETWORK_SUBCOMMANDS = {"git": ("clone", "fetch", "pull", "push", "ls-remote"),
                       "pip": ("install", "download"), "pip3": ("install", "download"),
                       "npm": ("install", "ci", "update", "publish"), "yarn": ("add", "install"),
                       "cargo": ("fetch", "install", "update"), "go": ("get", "mod")}
# The shells whose ``-c STRING`` is looked into (classified, and shown as its script): only these
# spellings, so a program of the agent's own named ``evilsh`` or ``/ws/bash`` is shown and
# classified as the program it is.
SHELLS = frozenset(("/bin/sh", "sh", "/bin/bash", "bash", "/usr/bin/sh", "/usr/bin/bash"))
# Where a known program's name counts as that program: a bare name (looked up in PATH) or these
# system directories, which every sandbox sees read-only. ``./ls`` or ``/ws/cat`` is the agent's
# own file, whatever its name: UNKNOWN_COMMAND.
SYSTEM_BIN_DIRS = frozenset(("/bin", "/usr/bin", "/usr/local/bin", "/sbin", "/usr/sbin", "/usr/local/sbin"))
# The HOME of a confined sandbox's commands (made by service.environment): in the session's own
# /tmp, but not a scratch area a call writes without asking, since programs read their
# configuration there (git's .gitconfig runs core.fsmonitor, less's lesskey sets LESSOPEN).
SANDBOX_HOME = "/tmp/sandboxd-home"
# A script with more possible working directories than this (each ``cd`` may fail) is unknown.
MAX_SCRIPT_CWDS = 8
GIT_DIR_NAME = ".git"
# Programs that are bash builtins in a script: bash evaluates an array subscript in a variable's
# name (``test -v 'a[$(id)]'`` runs id, single quotes and all) and ``printf -v`` assigns any
# variable (PATH, mid-script). The programs in /usr/bin do neither, so this holds in scripts only.
SHELL_BUILTINS = frozenset(("echo", "printf", "test", "[", "true", "false", "pwd"))


class WriteScope(Record):
    """Where a call's writes are workspace-write (allowed without asking unless the sandbox is
    read-only): the writable roots but their protected subpaths (.git/hooks, .git/config), and in
    a confined sandbox its private scratch areas (/tmp, /dev/shm) but the commands' HOME."""

    roots: tuple[str, ...]
    protected: tuple[str, ...] = ()
    scratch: tuple[str, ...] = ()
    writes_allowed: bool = True      # False in a read-only sandbox: no write runs without asking
    # The git guard keeps every repository under the writable roots free of configuration that
    # runs programs (sandboxd/gitguard), or nothing there is writable: git reads only what the
    # person put there. Not in danger-full-access, where nothing inspects a planted .git/config.
    git_guarded: bool = True

    def effect_of(self, paths: "list[str]") -> tuple[str, str]:
        """WORKSPACE_WRITE for writes only there; else DESTRUCTIVE and why."""
        for path in paths:
            inside = [root for root in self.roots if is_within(path, root)]
            if not inside and not any(is_within(path, area) for area in self.scratch):
                return Effect.DESTRUCTIVE, (f"write to {path!r} is outside the workspace and the writable roots "
                                            f"({', '.join(self.roots)})")
            for root in inside:
                for sub in self.protected:
                    if is_within(path, os.path.join(root, sub)):
                        return Effect.DESTRUCTIVE, f"write to {path!r}: {sub} stays read-only inside writable roots"
            if self.scratch and is_within(path, SANDBOX_HOME):
                return Effect.DESTRUCTIVE, (f"write to {path!r}: the commands' HOME holds the configuration "
                                            "programs read, so it is not written without asking")
        return Effect.WORKSPACE_WRITE, ""

    def writes_freely(self, path: str) -> bool:
        """A call may write ``path`` (or below it) without anyone being asked."""
        return self.writes_allowed and self.effect_of([path])[0] == Effect.WORKSPACE_WRITE


class Classified(Record):
    effect: str
    note: str = ""            # why a command that would be vouched for is not (its environment)


_READ_ONLY = Classified(Effect.READ_ONLY)
_UNKNOWN = Classified(Effect.UNKNOWN_COMMAND)


def classify_command(argv: "list[str] | tuple[str, ...]", *, cwd: str, scope: WriteScope,
                     env: CommandEnv | None = None) -> Classified:
    """The effect of running ``argv`` with ``env``: read-only or workspace-write only in the forms
    sandboxd.policy.safe_commands lists, with an environment sandboxd.policy.command_env accepts.
    A ``sh -c SCRIPT`` is looked into when it is plain commands (sandboxd.policy.shell_script),
    each of them safe. Anything not recognised is UNKNOWN_COMMAND: the engine never guesses in
    the permissive direction."""
    env = env or CommandEnv()
    found = _classify_argv(list(argv), cwd, scope)
    if found.effect not in (Effect.READ_ONLY, Effect.WORKSPACE_WRITE):
        return found
    unknown = unknown_variables(env)
    if unknown:
        return Classified(Effect.UNKNOWN_COMMAND, "the environment sets " + ", ".join(unknown[:8])
                          + (f" and {len(unknown) - 8} more" if len(unknown) > 8 else "")
                          + ": such a variable can make any program run code")
    programs = _programs(list(argv))
    if any("/" not in program for program in programs):
        path = effective(env, "PATH", env.path)
        shadowed = untrusted_directories(path.split(":"), scope.writes_freely)
        if shadowed:
            return Classified(Effect.UNKNOWN_COMMAND, f"PATH has {shadowed[0]!r}, which the agent may write "
                                                      "(or which names another directory): a program there may "
                                                      "be its own")
    if "git" in (os.path.basename(program) for program in programs):
        if not scope.git_guarded:
            return Classified(Effect.UNKNOWN_COMMAND, "nothing keeps this sandbox's repositories free of "
                                                      "configuration git would run (danger-full-access, or no "
                                                      "git guard)")
        home = effective(env, "HOME", env.home)
        if home and untrusted_directories([home], scope.writes_freely):
            return Classified(Effect.UNKNOWN_COMMAND, f"HOME is {home!r}, which the agent may write: git "
                                                      "runs what its configuration there names")
    return found


def _programs(argv: "list[str]") -> list[str]:
    """The programs a command starts by name: its own, and a script's (already split once)."""
    script = _script(argv)
    if script is None:
        return argv[:1]
    return [argv[0], *(command.argv[0] for command in script)]


def _script(argv: "list[str]") -> "list[Command] | None":
    if len(argv) == 3 and argv[0] in SHELLS and argv[1] == "-c":
        return split(argv[2])
    return None


def _classify_argv(argv: "list[str]", cwd: str, scope: WriteScope) -> Classified:
    if len(argv) == 3 and argv[0] in SHELLS and argv[1] == "-c":
        script = split(argv[2])
        return _UNKNOWN if script is None else _classify_script(script, cwd, scope)
    return _classify_one(argv, cwd, scope)


def _classify_script(script: "list[Command]", cwd: str, scope: WriteScope) -> Classified:
    """Every command read-only: read-only; every one read-only or workspace-write: workspace-write.
    ``cd DIR`` (not in a pipeline) moves the commands after it, but each may run where the shell
    was before, if the ``cd`` failed: paths are judged from every directory possible."""
    cwds = [cwd]
    effects = []
    for position, command in enumerate(script):
        piped = command.joined_by == "|" or (position + 1 < len(script) and script[position + 1].joined_by == "|")
        if command.argv[0] == "cd":
            if piped or len(command.argv) != 2 or not command.argv[1] or command.argv[1].startswith("-"):
                return _UNKNOWN
            moved = [os.path.normpath(os.path.join(where, command.argv[1])) for where in cwds]
            if not all(any(is_within(where, root) for root in scope.roots) for where in moved):
                return _UNKNOWN                  # elsewhere git would read a repository the guard does not watch
            cwds = list(dict.fromkeys(cwds + moved))
            if len(cwds) > MAX_SCRIPT_CWDS:
                return _UNKNOWN
            continue
        if command.argv[0] in SHELL_BUILTINS and not _plain_builtin(command.argv):
            return _UNKNOWN
        effect = max((_classify_one(list(command.argv), where, scope).effect for where in cwds), key=_RANK.__getitem__)
        if effect not in (Effect.READ_ONLY, Effect.WORKSPACE_WRITE):
            return _UNKNOWN
        effects.append(effect)
    if Effect.WORKSPACE_WRITE in effects and any(os.path.basename(command.argv[0]) == "git" for command in script):
        return _UNKNOWN          # it may write a repository's configuration, then run git on it
    return Classified(Effect.WORKSPACE_WRITE if Effect.WORKSPACE_WRITE in effects else Effect.READ_ONLY)


def _plain_builtin(argv: "tuple[str, ...]") -> bool:
    """A builtin's arguments that bash reads as text only: no variable named (``-v``, ``-R``) and
    nothing a subscript or an expansion could be made of."""
    return not any(arg in ("-v", "-R") or arg.startswith("-v") or any(char in arg for char in "[$`")
                   for arg in argv[1:])


_RANK = {Effect.READ_ONLY: 0, Effect.WORKSPACE_WRITE: 1, Effect.NETWORK: 2, Effect.DESTRUCTIVE: 3,
         Effect.UNKNOWN_COMMAND: 4}


def _classify_one(argv: "list[str]", cwd: str, scope: WriteScope) -> Classified:
    if not argv or not argv[0]:
        return _UNKNOWN
    if "/" in argv[0] and os.path.dirname(argv[0]) not in SYSTEM_BIN_DIRS:
        return _UNKNOWN
    program, args = os.path.basename(argv[0]), argv[1:]
    first = next((a for a in args if not a.startswith("-")), "")
    if program in NETWORK_PROGRAMS or first in NETWORK_SUBCOMMANDS.get(program, ()):
        return Classified(Effect.NETWORK)
    if read_only(program, args):
        return _READ_ONLY
    written = written_paths(program, args)
    if written is None:
        return _UNKNOWN
    paths = [os.path.normpath(os.path.join(cwd, path)) for path in written]
    effect, note = scope.effect_of(paths)
    if effect == Effect.WORKSPACE_WRITE:
        for path in paths:
            if GIT_DIR_NAME in path.split("/"):
                # A nested repository's .git/config (or a .git copied or moved into place) names
                # programs git runs; the git guard removes them after the call, and until then
                # they are a person's call. Asked, not refused: the kernel lets the write happen.
                return Classified(Effect.UNKNOWN_COMMAND, f"it writes {path!r}, inside a repository's .git")
            if scope.scratch and is_within(SANDBOX_HOME, path):
                return Classified(Effect.UNKNOWN_COMMAND, f"it writes {path!r}, which holds the commands' HOME "
                                                          "(a directory's contents copied there would fill it)")
    return Classified(effect, note)


SUMMARY_CHARS = 200


def summary_of(tool: str, argv: "list[str] | tuple[str, ...]" = (), path: str = "", command: str = "") -> str:
    """The one line an approval card shows: ``Execute: pytest -q``, ``Write: src/a.py``, ``Stop: ID
    (NAME: ARGV)`` (``path``: what the tool acts on, a background process for monitor.stop); at most
    SUMMARY_CHARS characters. A longer line says so, with its whole length, so that a person
    asked about it knows there is more than shown (the call runs all of it; the approval is of
    the call, never of this text): ``Execute: python3 -c '... ... [cut: 160 of 1835030 characters shown]``."""
    if argv or command:
        if not command:
            command = argv[2] if len(argv) == 3 and argv[1] == "-c" and argv[0] in SHELLS else shlex.join(argv)
        line = f"Execute: {command}"
    elif path:
        verb = {"fs.write": "Write", "fs.read": "Read", "fs.list": "List", "patch.apply": "Patch",
                "search": "Search", "monitor.stop": "Stop"}.get(tool, tool)
        line = f"{verb}: {path}"
    else:
        line = tool
    if len(line) <= SUMMARY_CHARS:
        return line
    marker = f" ... [cut: {{}} of {len(line)} characters shown]"
    keep = SUMMARY_CHARS - len(marker.format(SUMMARY_CHARS))
    return line[:keep] + marker.format(keep)
