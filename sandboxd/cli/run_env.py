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
a daemon session's ``hide_home`` too.
"""

from __future__ import annotations

import os

from sandboxd.errors import InvalidPolicy
from sandboxd.launcher.homes import coverable_home, home_of

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


def hidden_homes(target: tuple[int, int] | None, caller_env: dict[str, str]) -> tuple[str, ...]:
    """The homes to hide: the command user's, the caller's (by uid and by $HOME), deduplicated,
    the command user's first."""
    caller = os.getuid()
    owners = (caller,) if target is None else (target[0], caller)
    candidates = [home_of(target[0]) if target else None, home_of(caller), caller_env.get("HOME")]
    found = [coverable_home(path, owners) for path in candidates]
    return tuple(dict.fromkeys(home for home in found if home))


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
         host_home: bool, clear: bool, passes: list[str],
         sets: list[str]) -> tuple[dict[str, str], tuple[str, ...], str]:
    """For `sandboxd run`'s options: the command's environment, the homes to hide, and the HOME to
    make in the sandbox's /tmp ("": none)."""
    target = command_user(workspace, user)
    if confined and not host_home:
        hidden, private = hidden_homes(target, caller_env), PRIVATE_HOME
        home: str | None = PRIVATE_HOME
    else:
        hidden, private = (), ""
        own = home_of(target[0]) if target else None
        home = own if own and os.path.isdir(own) else caller_env.get("HOME")
    return environment(caller_env, clear=clear, passes=passes, sets=sets, home=home, user=target), hidden, private
