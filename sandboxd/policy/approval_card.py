"""What a person is shown about a held call besides its one-line summary (policy.tools.summary_of):
the whole command, when the summary shows less of it (a ``sh -c`` shown by its script, a command
cut at SUMMARY_CHARS), and the environment the call sets (its overlay, or the whole env a client
sent), which can change what any program runs (``BASH_ENV``, ``LD_PRELOAD``). Every card reads
it from here: sandboxctl's in-place prompt, its hint and ``approvals`` listing, the MCP
elicitation and hint.

Everything is the caller's choice, so it is shown through sandboxd.printable, and bounded: a
command may be 2 MiB, and an overlay 128 KiB. A part longer than its bound shows its start and its
end around a marker that says how much is not shown (``... [1,835,030 characters not shown:
approve only what you have read] ...``): the approval is of the whole call, which runs all of it,
so a person who cannot read it all is told so rather than shown an innocent head. Variables are
listed unknown ones first (those outside policy.command_env's safe set: whatever else is cut,
``LD_PRELOAD`` is not), names before values when the values do not fit.
"""

from __future__ import annotations

import json
import shlex
from typing import Any, TypeGuard

from sandboxd.policy.command_env import SAFE_VARIABLES
from sandboxd.printable import printable

COMMAND_CHARS = 8192       # of the whole command, as shown (a terminal's 100 lines of 80)
ENV_CHARS = 4096           # of the variables, as shown
CWD_CHARS = 1024           # of the working directory, as shown (PATH_MAX is 4096)
ARGUMENTS_CHARS = 4096     # of an external tool's arguments (JSON), as shown
TAIL_SHARE = 4             # the end keeps a quarter of a bound part
# An external tool's arguments the MCP gateway records whole (JSON characters); past it, only their
# start, in the form cut_arguments() recognizes (mcp.gateway.authorize.arguments_json).
RECORDED_ARGUMENTS_CHARS = 16 << 10
_CUT_KEYS = frozenset(("truncated", "bytes", "sha256", "head"))


def whole_command(summary: str, arguments: dict[str, Any]) -> str:
    """The argv as it will run, escaped and bounded, when ``summary`` shows less; else ""."""
    argv = arguments.get("argv")
    if not isinstance(argv, list) or not argv or not all(isinstance(arg, str) for arg in argv):
        return ""
    whole = shlex.join(argv)
    return "" if summary == f"Execute: {whole}" else bounded(whole, COMMAND_CHARS)


def environment(arguments: dict[str, Any]) -> str:
    """The variables the call sets, ``NAME=value`` (the value quoted as a shell would need it),
    escaped and bounded; "" when it sets none."""
    env = arguments.get("env")
    if not isinstance(env, dict) or not env:
        return ""
    names = sorted((str(name) for name in env), key=lambda name: (name in SAFE_VARIABLES, name))
    shown: list[str] = []
    used = 0
    for index, name in enumerate(names):
        pair = printable(f"{name}={shlex.quote(str(env[name]))}")
        if used + len(pair) > ENV_CHARS:
            rest = bounded(" ".join(names[index:]), ENV_CHARS // 2)
            return " ".join(shown + [f"[{len(names) - index} more, values not shown: {rest}]"])
        shown.append(pair)
        used += len(pair) + 1
    return " ".join(shown)


def written(arguments: dict[str, Any]) -> str:
    """What a WriteFile writes besides its path (its summary): ``19 bytes, mode 0755`` (the mode
    only when the call gives one: a script made executable); "" for any other call."""
    size, mode = arguments.get("bytes"), arguments.get("mode")
    if type(size) is not int:                  # bool is an int: never a size
        return ""
    return f"{size:,} bytes" + (f", mode {mode:04o}" if type(mode) is int else "")


def external_arguments(arguments: dict[str, Any]) -> str:
    """An external tool's arguments (Authorize's, kept as {"arguments": ...}: an MCP server's tool
    behind `sandboxd mcp --gateway`) as compact JSON, escaped and bounded; "" when there are none.
    Its summary is the bare tool name: without this a person would approve a merge of some pull
    request, or a deletion of some repository, without seeing which."""
    given = arguments.get("arguments")
    if not isinstance(given, (dict, list)) or not given:
        return ""
    if is_cut(given):
        # The gateway kept only the start of arguments too long to record (mcp.gateway.authorize):
        # their end is nowhere to be read, so the card must not look whole.
        head = given["head"]
        shown = _fitting(head, ARGUMENTS_CHARS)
        return (f"[{given.get('bytes', '?')} bytes of arguments: only the first {len(shown):,} characters are shown "
                f"and recorded; deny unless you expect this much] {printable(shown)} ...")
    return bounded(json.dumps(given, ensure_ascii=False, separators=(", ", ": ")), ARGUMENTS_CHARS)


def is_cut(given: Any) -> TypeGuard[dict[str, Any]]:
    """Whether ``given`` is the gateway's record of arguments it could keep only the start of:
    {"truncated": true, "bytes": N, "sha256": hex, "head": the first RECORDED_ARGUMENTS_CHARS
    characters of their JSON}, exactly. The model's own arguments can never take this form: any
    object holding a head that long is itself longer than RECORDED_ARGUMENTS_CHARS as JSON, so the
    gateway records it cut, its own text in the head (round 9's hostile pass forged a short one
    and the card showed "hello" for a call that ran DROP TABLE)."""
    return (isinstance(given, dict) and set(given) == _CUT_KEYS and given["truncated"] is True
            and isinstance(given["bytes"], int) and given["bytes"] > RECORDED_ARGUMENTS_CHARS
            and isinstance(given["sha256"], str) and len(given["sha256"]) == 64
            and isinstance(given["head"], str) and len(given["head"]) == RECORDED_ARGUMENTS_CHARS)


def patch_changes(summary: str, arguments: dict[str, Any]) -> str:
    """What a patch does to each path (``a.py: modified; b: renamed to c; c: renamed from b``),
    escaped and bounded, when the summary shows less of it; else ""."""
    given = arguments.get("changes")
    if not isinstance(given, list) or not given or not all(isinstance(change, str) for change in given):
        return ""
    whole = "; ".join(given)
    return "" if summary == f"Patch: {whole}" else bounded(whole, COMMAND_CHARS)


def lines(summary: str, arguments_json: str) -> list[tuple[str, str]]:
    """(label, text) for each line a card adds below the summary: ``argv``, ``cwd``, ``env``,
    ``writes`` (a file write's size and mode), ``arguments`` (an external tool's), ``changes`` (a patch's)."""
    try:
        arguments = json.loads(arguments_json or "{}")
    except (ValueError, RecursionError):
        return []
    if not isinstance(arguments, dict):
        return []
    cwd = arguments.get("cwd")
    # Where it runs: `./test.sh` or `rm -rf build` names another file in another directory.
    where = bounded(str(cwd), CWD_CHARS) if isinstance(cwd, str) and cwd else ""
    found = [("argv", whole_command(summary, arguments)), ("cwd", where), ("env", environment(arguments)),
             ("writes", written(arguments)), ("arguments", external_arguments(arguments)),
             ("changes", patch_changes(summary, arguments))]
    return [(label, text) for label, text in found if text]


def bounded(text: str, limit: int) -> str:
    """``text`` through printable, at most about ``limit`` characters shown: its start and its end
    around a marker saying how many characters are not shown."""
    shown = printable(text)
    if len(shown) <= limit:
        return shown
    head = _fitting(text, limit - limit // TAIL_SHARE)
    tail = _fitting(text[::-1], limit // TAIL_SHARE)[::-1]        # escapes are per character: same length
    hidden = len(text) - len(head) - len(tail)
    return (f"{printable(head)} ... [{hidden:,} of {len(text):,} characters not shown: approve only what you "
            f"have read] ... {printable(tail)}")


def _fitting(text: str, limit: int) -> str:
    """The longest start of ``text`` whose escaped form takes at most ``limit`` characters (whole
    characters are escaped, so an escape is never cut in two)."""
    low, high = 0, min(len(text), limit)
    while low < high:
        middle = (low + high + 1) // 2
        if len(printable(text[:middle])) <= limit:
            low = middle
        else:
            high = middle - 1
    return text[:low]
