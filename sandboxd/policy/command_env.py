"""What the environment a command carries allows the classifier to vouch for.

A variable can make any program run code or write files: the dynamic loader's (``LD_PRELOAD``,
``LD_AUDIT``, ``GCONV_PATH``, ``GLIBC_TUNABLES``), the shells' (``BASH_ENV``, ``ENV``,
``SHELLOPTS`` with ``PS4``, ``BASH_FUNC_ls%%``), git's (``GIT_CONFIG_*``, ``GIT_DIR``,
``GIT_EXTERNAL_DIFF``, ``GIT_PAGER``), ``PAGER``, ``EDITOR``, ``TMPDIR``, ``RIPGREP_CONFIG_PATH``,
interpreters' (``PYTHON*``, ``PERL5*``, ``NODE_OPTIONS``) and more. So only the variables below
are known; any other makes every command an unknown command (the engine asks about it, the
call's note names the variables). Their values are checked too: a locale or a terminal name with
a ``/`` would name a file to load.

Two more things decide what a known command really runs, and both are checked here:

* ``PATH``: a bare program name (``ls``) is the first one found in PATH. When a PATH directory is
  one the agent can write without being asked (inside a writable root, or a confined sandbox's
  scratch ``/tmp``), the ``ls`` found there may be its own program, so bare names are not vouched
  for (``/usr/bin/ls`` still is). A PATH given by the call itself (the overlay, which the agent
  chooses through the MCP shell tool's ``env``) is not accepted at all: a directory such as
  ``/proc/self/cwd/bin`` is the workspace under another name.
* ``HOME``: git reads ``$HOME/.gitconfig`` (``core.fsmonitor``, ``core.pager``,
  ``diff.external`` ... run programs). git is vouched for only when HOME is a directory the agent
  cannot write without being asked (the session's private HOME is not one: sandboxd.policy.tools
  keeps it out of the scratch areas).

The session's own env (set by its owner at creation, never by the agent) counts like the call's,
except that its PATH and HOME are judged by the two rules above: its names are the owner's
choice, but its values can name files the agent writes (``PATH=/ws/.venv/bin``,
``BASH_ENV=.envrc``), and no list could tell a credential from a preload.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping

from sandboxd._record import Record

_ALNUM = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789")
LOCALE_CHARS = _ALNUM | frozenset("_.@:+-")         # en_US.UTF-8, C.UTF-8, de_DE@euro, fr:en (LANGUAGE)
TERM_CHARS = _ALNUM | frozenset("_.+-")             # xterm-256color, screen.xterm
WORD_CHARS = _ALNUM | frozenset("_.,:+-")           # truecolor, 1, always
TZ_CHARS = _ALNUM | frozenset("_+-/")               # UTC, Europe/Paris (no "." so no ".."; not "/" first)
MAX_VALUE = 128

LOCALE_NAMES = ("LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE", "LC_NUMERIC", "LC_TIME", "LC_COLLATE", "LC_MONETARY",
                "LC_MESSAGES", "LC_PAPER", "LC_NAME", "LC_ADDRESS", "LC_TELEPHONE", "LC_MEASUREMENT",
                "LC_IDENTIFICATION")
# The variables a command may carry and still be vouched for, with the characters their values
# may hold.
SAFE_VARIABLES: dict[str, frozenset[str]] = {
    **{name: LOCALE_CHARS for name in LOCALE_NAMES},
    "TERM": TERM_CHARS, "COLORTERM": WORD_CHARS, "NO_COLOR": WORD_CHARS, "CLICOLOR": WORD_CHARS,
    "CLICOLOR_FORCE": WORD_CHARS, "FORCE_COLOR": WORD_CHARS, "COLUMNS": frozenset("0123456789"),
    "LINES": frozenset("0123456789"), "TZ": TZ_CHARS,
}
DIRECTORY_VARIABLES = ("PATH", "HOME")
# Directories whose names lead elsewhere: /proc/self/cwd is the cwd, /dev/fd/N an open directory.
INDIRECT_ROOTS = ("/proc", "/dev")


def safe_value(name: str, value: str) -> bool:
    chars = SAFE_VARIABLES.get(name)
    return (chars is not None and len(value) <= MAX_VALUE and all(char in chars for char in value)
            and not value.startswith("/"))


class CommandEnv(Record):
    """The environment a command will get, as far as the classifier needs it."""

    overlay: Mapping[str, str] = {}          # the call's own variables (ExecStart.env_overlay)
    configured: Mapping[str, str] = {}       # the session's env, or the whole env a client sent
    path: str = "/usr/local/bin:/usr/bin:/bin"   # PATH when neither sets it (the client's entries)
    home: str = ""                           # HOME when neither sets it (the daemon's choice)


def unknown_variables(env: CommandEnv) -> list[str]:
    """The variables (names, sorted) that keep the classifier from vouching for any command."""
    bad = {name for name, value in env.overlay.items() if not safe_value(name, value)}
    bad |= {name for name, value in env.configured.items()
            if name not in DIRECTORY_VARIABLES and not safe_value(name, value)}
    return sorted(bad)


def effective(env: CommandEnv, name: str, default: str) -> str:
    return env.overlay.get(name, env.configured.get(name, default))


def untrusted_directories(paths: list[str], writes_freely: Callable[[str], bool]) -> list[str]:
    """The directories of ``paths`` a program or a configuration file could be the agent's in: a
    relative one, one under /proc or /dev, one the agent writes without being asked."""
    bad = []
    for path in paths:
        normal = "/" + os.path.normpath(path).lstrip("/") if path.startswith("/") else ""
        if (not normal or any(normal == root or normal.startswith(root + "/") for root in INDIRECT_ROOTS)
                or writes_freely(normal)):
            bad.append(path)
    return bad
