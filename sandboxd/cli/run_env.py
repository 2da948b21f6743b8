"""What `sandboxd run` gives its command besides the walls: its environment and a private HOME.

A command under `sandboxd run` is often code nobody reviewed (a third-party MCP server fetched by
`npx -y`, a build step). Its caller's environment holds tokens (GITHUB_TOKEN, AWS_*, an MCP
client's API keys) and its home holds keys and credentials (~/.ssh, ~/.aws, ~/.npmrc, ~/.netrc),
all readable on the host's read-only view. So by default:

- the environment is PATH, the locale (LANG, LANGUAGE, LC_*), TERM, COLORTERM, NO_COLOR and TZ
  from the caller, HOME, and USER and LOGNAME of the command's user; nothing else, unless named:
  ``--pass-env NAME`` (the caller's value: a secret never appears on a command line, which every
  local user can read in /proc) or ``--env NAME=VALUE``;
- the home directories of the command's user and of the caller are hidden: an empty, read-only
  directory (launcher.rootfs steps 7b, 8d). A workspace or writable root inside stays visible.
  They are read-only rather than private and writable: a write there could not be told from a
  write to the real home (a planted ~/.bashrc), which is what a sandbox is checked for;
- HOME is PRIVATE_HOME, a new directory of the command's user in the sandbox's private /tmp:
  writable, empty, gone with the sandbox (caches, ~/.npm, ~/.config);
- ``--host-home`` keeps the host's homes and HOME as they are (for tools installed in the home,
  e.g. by nvm).

Homes are hidden only when they are real directories owned by their user and not system trees
(daemon users have homes such as /usr/sbin or /var/www: never hidden): launcher.homes decides, for
a daemon session's ``hide_home`` too. A candidate that is there but cannot be hidden ($HOME naming
someone else's directory or /etc) is said, one line each, not passed over in silence: the run goes
on with it visible, read-only, unless ``--strict-homes`` makes that a refusal (exit 125).
"""

from __future__ import annotations

import os

from sandboxd.errors import InvalidPolicy
from sandboxd.launcher.homes import home_of, home_verdict
from sandboxd.policy.sandbox import is_within

# The caller's variables every command gets: where programs are, how to print. Never a secret.
PASSED = ("PATH", "LANG", "LANGUAGE", "TERM", "COLORTERM", "NO_COLOR", "TZ")
PASSED_PREFIXES = ("LC_",)
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# The command's HOME: a new directory in the sandbox's private /tmp (a fresh tmpfs, so nothing on
# the host can be planted there).
PRIVATE_HOME = "/tmp/home"


def command_user(workspace: str, user: tuple[int, int] | None) -> tuple[int, int] | None:
    """Whom the command runs as: --user, else the workspace's owner (as launcher.plan decides);
    None when the workspace cannot be read (the launch then says why)."""
    if user is not None:
        return user
    try:
        st = os.stat(workspace)
    except OSError:
        return None
    return st.st_uid, st.st_gid


# A home to hide that cannot be: (what it is and why, what would hide it). A plain tuple: typing's
# NamedTuple imports collections, which `sandboxd run`'s path does not load (tests/test_oneshot_speed.py).
Unhidden = tuple[str, str]


def hidden_homes(target: tuple[int, int] | None,
                 caller_env: dict[str, str]) -> tuple[tuple[str, ...], tuple[Unhidden, ...]]:
    """The homes to hide: the command user's, the caller's (by uid and by $HOME), deduplicated,
    the command user's first; and each candidate that is there but cannot be hidden (not one
    inside a hidden home, which its cover hides)."""
    caller = os.getuid()
    owners = (caller,) if target is None else (target[0], caller)
    candidates = [("the command user's home", home_of(target[0]) if target else None,
                   "run as a user whose home is their own directory (--user)"),
                  ("your home", home_of(caller), "run as a user whose home is their own directory"),
                  ("$HOME", caller_env.get("HOME"), "set HOME to a directory of yours")]
    hidden: dict[str, None] = {}
    refused: dict[str, Unhidden] = {}             # by real path: $HOME and a home that are one said once
    for whose, path, remedy in candidates:
        real, why = home_verdict(path, owners)
        if real:
            hidden[real] = None
        elif why and path:
            refused.setdefault(os.path.realpath(path), (f"{whose} {path} cannot be hidden: {why}", remedy))
    said = tuple(home for real, home in refused.items() if not any(is_within(kept, real) for kept in hidden))
    return tuple(hidden), said


def environment(caller_env: dict[str, str], *, clear: bool, passes: list[str], sets: list[str],
                home: str | None, user: tuple[int, int] | None) -> dict[str, str]:
    """The command's environment: PASSED from ``caller_env`` (nothing with ``clear``), HOME/USER/
    LOGNAME, then --pass-env names, then --env NAME=VALUE (last wins)."""
    env: dict[str, str] = {}
    if not clear:
        env = {key: value for key, value in caller_env.items()
               if key in PASSED or key.startswith(PASSED_PREFIXES)}
        env.setdefault("PATH", DEFAULT_PATH)
        if home:
            env["HOME"] = home
        name = _user_name(user[0]) if user else None
        if name:
            env["USER"] = env["LOGNAME"] = name
    for name in passes:
        if not name or "=" in name or "\0" in name:
            raise InvalidPolicy(f"--pass-env {name!r} must be a variable name (set a value with --env NAME=VALUE)")
        if name in caller_env:                       # unset in the caller: unset in the command, as env(1) does
            env[name] = caller_env[name]
    for item in sets:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise InvalidPolicy(f"--env {item!r} must look like NAME=VALUE")
        env[key] = value
    return env


def _user_name(uid: int) -> str | None:
    import pwd
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return None


def plan(caller_env: dict[str, str], *, workspace: str, user: tuple[int, int] | None, confined: bool,
         host_home: bool, clear: bool, passes: list[str], sets: list[str],
         strict_homes: bool = False) -> tuple[dict[str, str], tuple[str, ...], str, tuple[str, ...]]:
    """For `sandboxd run`'s options: the command's environment, the homes to hide, the HOME to
    make in the sandbox's /tmp ("": none), and one line for each home that stays visible though
    hiding was asked for. ``strict_homes``: such a home is InvalidPolicy instead."""
    target = command_user(workspace, user)
    notes: tuple[str, ...] = ()
    if confined and not host_home:
        (hidden, refused), private = hidden_homes(target, caller_env), PRIVATE_HOME
        home: str | None = PRIVATE_HOME
        if refused and strict_homes:
            text, remedy = refused[0]
            raise InvalidPolicy(f"{text}; --strict-homes refuses to run with it visible: {remedy}, or leave out "
                                "--strict-homes")
        notes = tuple(f"{text}; the command sees it, read-only ({remedy}, or add --strict-homes to refuse such "
                      "a run)" for text, remedy in refused)
    else:
        hidden, private = (), ""
        own = home_of(target[0]) if target else None
        home = own if own and os.path.isdir(own) else caller_env.get("HOME")
    return environment(caller_env, clear=clear, passes=passes, sets=sets, home=home, user=target), hidden, private, notes
