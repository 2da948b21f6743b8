"""The environment of a session's commands: exactly what is named, nothing inherited.

Neither the daemon's own environment nor the client's reaches a command, except what the
client names (ExecStart.caller_env: PATH, LANG, TERM; env_overlay; the session's env). Two
ways per call (the proto's ExecStart.env says the same):

- ``ExecStart.env`` set: exactly that, as before (older clients, an MCP shell tool's env).
- otherwise: the defaults, then the session's env, then the call's env_overlay:

  =====  =====================================================================================
  PATH   the client's entries that are absolute and are directories inside the sandbox, as the
         command's user sees them (checked there, by the file-tool child: a host directory the
         sandbox hides or the user cannot see is dropped, so is a relative entry, which would
         make the cwd's files programs); none left: /usr/local/bin:/usr/bin:/bin.
         danger-full-access: the client's absolute entries as given (the host as it is).
  HOME   confined sandboxes: /tmp/sandboxd-home, in the session's private /tmp (a tmpfs every
         policy has, read-only included), created 0700 by the command's user on first use, so
         it is writable, private to the session and never the host's home (dotfiles, keys,
         credentials stay out). danger-full-access: the owner's own home (the command has the
         owner's rights there anyway; a directory in the host's shared /tmp would be a name any
         user could plant first). Not usable (a workspace mounted over it): /tmp.
  LANG   the client's, else C.UTF-8
  TERM   the client's when it is on a terminal, else dumb
  =====  =====================================================================================

The egress proxy's variables (HTTP_PROXY and friends, with allowed_domains) are added last
in both cases, by the caller (exec_call, background).
"""

from __future__ import annotations

import math
import os
import pwd
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping

from sandboxd.errors import Exhausted, InvalidPolicy
from sandboxd.policy.limits import (MAX_CALLER_PATH_BYTES, MAX_CALLER_VALUE, MAX_ENV_NAME, MAX_ENV_VALUE, MAX_PATH_ENTRIES,
                                    MAX_SESSION_ENV_BYTES, MAX_SESSION_ENV_ENTRIES)
from sandboxd.policy.command_env import CommandEnv
from sandboxd.policy.sandbox import DangerFullAccess
from sandboxd.policy.tools import SANDBOX_HOME
from sandboxd.service.file_calls import run_tool
from sandboxd.service.terminal_call import DEFAULT_TERM
from sandboxd.service.sessions.registry import Session, SessionRegistry
from sandboxd.supervisor.fork_client import ForkServer
from sandboxd.v1 import sandboxd_pb2 as pb

DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"
FALLBACK_HOME = "/tmp"
DEFAULT_LANG = "C.UTF-8"
NO_TERMINAL = "dumb"


def check_variable(name: str, value: str, what: str = "env") -> None:
    """One variable a caller asks for: INVALID_ARGUMENT saying what to fix."""
    if not name or "=" in name or "\0" in name:
        raise InvalidPolicy(f"bad variable name {name[:100]!r} in {what}: a name is not empty and has no '=' "
                            "and no NUL byte")
    if len(name.encode(errors="surrogateescape")) > MAX_ENV_NAME:
        raise InvalidPolicy(f"variable name {name[:100]!r}... in {what} is longer than {MAX_ENV_NAME} bytes")
    if "\0" in value:
        raise InvalidPolicy(f"the value of {name[:100]!r} in {what} has a NUL byte, which the kernel cannot pass")
    size = len(value.encode(errors="surrogateescape"))
    if size > MAX_ENV_VALUE:
        raise InvalidPolicy(f"the value of {name[:100]!r} in {what} is {size} bytes; the limit is {MAX_ENV_VALUE} "
                            "(pass large data in a file)")


def session_env(env: Mapping[str, str]) -> dict[str, str]:
    """A session's own variables (CreateSessionRequest.env), checked and bounded: it is kept for
    the session's life and in the store."""
    if len(env) > MAX_SESSION_ENV_ENTRIES:
        raise Exhausted(f"the session's env has {len(env)} variables; the limit is {MAX_SESSION_ENV_ENTRIES}")
    total = 0
    for name, value in env.items():
        check_variable(name, value, "the session's env")
        total += len(name.encode(errors="surrogateescape")) + len(value.encode(errors="surrogateescape")) + 1
    if total > MAX_SESSION_ENV_BYTES:
        raise Exhausted(f"the session's env takes {total} bytes (NAME=value, all variables); the limit is "
                        f"{MAX_SESSION_ENV_BYTES}: put large data in a file")
    return dict(env)


def path_candidates(path: str) -> list[str]:
    """The client's PATH entries worth checking: absolute ones, normalised, first occurrence kept.
    A relative or empty entry (the cwd) is dropped: it would run whatever the cwd holds."""
    size = len(path.encode(errors="surrogateescape"))
    if size > MAX_CALLER_PATH_BYTES:
        raise InvalidPolicy(f"caller_env.path is {size} bytes; the limit is {MAX_CALLER_PATH_BYTES}")
    entries = path.split(":") if path else []
    if len(entries) > MAX_PATH_ENTRIES:
        raise InvalidPolicy(f"caller_env.path has {len(entries)} entries; the limit is {MAX_PATH_ENTRIES}")
    kept: list[str] = []
    for entry in entries:
        if entry.startswith("/") and "\0" not in entry:
            normal = os.path.normpath(entry)
            if normal.startswith("//"):
                normal = "/" + normal.lstrip("/")
            if normal not in kept:
                kept.append(normal)
    return kept


def check_start(start: pb.ExecStart) -> None:
    """The call's environment fields alone: not mixed, each bounded (the whole environment is
    checked against the kernel's limits by the caller, on ``worst_case``)."""
    caller = start.caller_env
    if start.env and (start.env_overlay or caller.path or caller.lang or caller.term):
        raise InvalidPolicy("give either env (the command's whole environment) or env_overlay / caller_env "
                            "(added to the defaults and the session's env), not both")
    for name, value in start.env_overlay.items():
        check_variable(name, value, "env_overlay")
    for what, value in (("caller_env.lang", caller.lang), ("caller_env.term", caller.term)):
        if len(value.encode(errors="surrogateescape")) > MAX_CALLER_VALUE or "\0" in value or "\n" in value:
            raise InvalidPolicy(f"{what} must be a short name (at most {MAX_CALLER_VALUE} bytes, one line)")
    path_candidates(caller.path)


def compose(session: Session, start: pb.ExecStart, *, path: str, home: str) -> dict[str, str]:
    """Defaults, then the session's env, then the call's overlay (``start.env`` empty)."""
    caller = start.caller_env
    # A call on a terminal: the terminal's type (the client's TERM) unless the session or the
    # overlay names one; without a terminal, the client's TERM only if its output is a terminal.
    term = (start.terminal.term or caller.term or DEFAULT_TERM) if start.HasField("terminal") \
        else (caller.term or NO_TERMINAL)
    defaults = {"PATH": path or DEFAULT_PATH, "HOME": home, "LANG": caller.lang or DEFAULT_LANG, "TERM": term}
    return {**defaults, **session.env, **start.env_overlay}


def worst_case(session: Session, start: pb.ExecStart) -> dict[str, str]:
    """The largest environment the call can get (every PATH entry kept), to check before it runs."""
    if start.env:
        return dict(start.env)
    return compose(session, start, path=":".join(path_candidates(start.caller_env.path)), home=SANDBOX_HOME)


def for_classifier(session: Session, start: pb.ExecStart) -> CommandEnv:
    """What the command classifier (policy.tools.classify_command) needs of the environment the
    call will carry: its overlay, the session's env (or the whole env the client sent), the PATH
    searched when neither sets one (the client's entries, before the sandbox drops those it
    hides: a superset) and the HOME the daemon gives."""
    if start.env:
        return CommandEnv(configured=dict(start.env), path=DEFAULT_PATH)
    home = _owner_home(session.owner.uid) if isinstance(session.policy, DangerFullAccess) else SANDBOX_HOME
    return CommandEnv(overlay=dict(start.env_overlay), configured=dict(session.env),
                      path=":".join(path_candidates(start.caller_env.path)) or DEFAULT_PATH, home=home)


def command_env(registry: SessionRegistry, fork: ForkServer, session: Session, start: pb.ExecStart) -> dict[str, str]:
    """The environment a call's command gets (without the proxy variables, added by the caller)."""
    if start.env:
        return dict(start.env)
    kept, home = prepare(registry, fork, session, path_candidates(start.caller_env.path))
    return compose(session, start, path=":".join(kept), home=home)


class _Prepared:
    """What ``prepare`` found, by (session, sandbox generation, sandbox build, client PATH): asking
    costs a call into the sandbox (about as long as a short command), and a sandbox's HOME stays
    made for its life. A new generation or a rebuilt sandbox (policy change, daemon restart, fork
    server loss) is a new key. When every entry was kept the answer stands (a directory removed
    later only costs execvp a failed lookup); when some were dropped it is asked again after
    RECHECK_SECONDS, so a directory made meanwhile (a venv's bin) is found. Bounded: the oldest
    entries go first (at worst a caller cycling PATHs makes others ask again). With a PATH of at
    most MAX_CALLER_PATH_BYTES, that is at most about 2 x 16 MiB."""

    MAX_ENTRIES = 1024
    RECHECK_SECONDS = 2.0

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._found: OrderedDict[tuple[str, int, int, str], tuple[list[str], str, float]] = OrderedDict()

    def get(self, key: tuple[str, int, int, str]) -> tuple[list[str], str] | None:
        with self._lock:
            found = self._found.get(key)
            if found is None or time.monotonic() > found[2]:
                return None
            self._found.move_to_end(key)
            return found[0], found[1]

    def put(self, key: tuple[str, int, int, str], kept: list[str], home: str, *, complete: bool) -> None:
        with self._lock:
            self._found[key] = (kept, home, math.inf if complete else time.monotonic() + self.RECHECK_SECONDS)
            self._found.move_to_end(key)
            while len(self._found) > self.MAX_ENTRIES:
                self._found.popitem(last=False)

    def forget(self, session_id: str) -> None:
        """Drop a closed session's entries: they could never be asked for again, and would stay
        until evicted (up to MAX_ENTRIES of them under session churn)."""
        with self._lock:
            for key in [key for key in self._found if key[0] == session_id]:
                del self._found[key]

    def __len__(self) -> int:
        with self._lock:
            return len(self._found)


_prepared = _Prepared()


def prepare(registry: SessionRegistry, fork: ForkServer, session: Session,
            candidates: list[str]) -> tuple[list[str], str]:
    """Inside the session's sandbox, as its commands' user: create the private HOME (confined
    sandboxes) and keep the PATH entries that are directories there. Returns (kept, HOME)."""
    with session.lock:
        key = (session.id, session.generation, session.sandbox_builds, ":".join(candidates))
    found = _prepared.get(key)
    if found is not None:
        return list(found[0]), found[1]
    if isinstance(session.policy, DangerFullAccess):
        # The host as it is, as the owner: the client's own view of it. Nothing to check (a missing
        # entry costs execvp a failed lookup), and file tools do not run there.
        return candidates, _owner_home(session.owner.uid)
    home = SANDBOX_HOME
    _, out = run_tool(registry, fork, session, {"op": "environment", "path": home, "dirs": candidates})
    first, *rest = out.decode().splitlines() or ["0"]
    kept = [os.fsdecode(bytes.fromhex(line)) for line in rest if line]
    home = home if first == "1" else FALLBACK_HOME
    with session.lock:                                # built again meanwhile: what it found may be gone
        current = (session.generation, session.sandbox_builds) == key[1:3]
    if current:
        _prepared.put(key, kept, home, complete=len(kept) == len(candidates))
    return list(kept), home


def forget_session(session_id: str) -> None:
    """The session closed: what was found for it goes."""
    _prepared.forget(session_id)


def _owner_home(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_dir or FALLBACK_HOME
    except KeyError:
        return FALLBACK_HOME
