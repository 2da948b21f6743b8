"""Warnings the gateway prints at start about a gateway file that works but is likely a mistake
(each a printable line on stderr; the person decides, nothing is refused):

- an upstream's program (its ``command``'s argv[0] as found on PATH, and the first argument that
  names a file, an interpreter's script) that someone else, or a sandbox, may rewrite: others may
  write it or a directory above it, or it lies inside a workspace or writable root of an upstream
  or of the gateway's own session. Its code runs with the upstream's credentials and tools.
- a writable root under ``~/.ssh``, ``~/.aws``, ``~/.gnupg`` or ``~/.config``: the upstream's
  session hides the home, and such a root shows the keys in it again, writable (a copy-paste slip
  more often than a wish).
"""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Mapping, Sequence

from sandboxd.mcp.gateway.config import GatewayConfig, UpstreamConfig
from sandboxd.printable import printable

KEY_DIRECTORIES = (".ssh", ".aws", ".gnupg", ".config")


def _inside(path: str, root: str) -> bool:
    root = os.path.realpath(root)
    return path == root or path.startswith(root.rstrip("/") + "/")


def _writable_paths(upstream: UpstreamConfig) -> tuple[str, ...]:
    """Where an upstream's server may write (danger-full-access: everywhere you may, not listed)."""
    if upstream.sandbox != "workspace-write":
        return ()
    return (upstream.workspace, *upstream.writable_roots)


def _programs(upstream: UpstreamConfig, environ: Mapping[str, str]) -> list[str]:
    """The files an upstream's command runs: argv[0] as PATH finds it, and the first argument that
    is a file (an interpreter's script; relative ones from its workspace, where it starts)."""
    if not upstream.command:
        return []
    found = []
    program = upstream.command[0]
    resolved = program if "/" in program else shutil.which(program, path=environ.get("PATH", os.defpath))
    if resolved:
        found.append(os.path.join(upstream.workspace, resolved))
    for argument in upstream.command[1:]:
        if argument.startswith("-"):
            continue
        candidate = os.path.join(upstream.workspace, argument)
        if os.path.isfile(candidate):
            found.append(candidate)
        break
    return [os.path.realpath(path) for path in found if os.path.exists(path)]


def _others_may_write(path: str) -> str:
    """The file or directory above it that someone but you and root may write, "" if none (a
    sticky directory, /tmp, lets others replace only their own entries)."""
    mine = (os.geteuid(), 0)
    current = path
    while True:
        try:
            info = os.stat(current)
        except OSError:
            return ""
        sticky = stat.S_ISDIR(info.st_mode) and info.st_mode & stat.S_ISVTX
        if info.st_uid not in mine or (info.st_mode & 0o022 and not sticky):
            return current
        if current == "/":
            return ""
        current = os.path.dirname(current)


def cautions(config: GatewayConfig, gateway_writable: Sequence[str], environ: Mapping[str, str] | None = None,
             home: str | None = None) -> list[str]:
    """One printable line per likely mistake of the gateway file; ``gateway_writable``: the
    gateway's own session's workspace and writable roots (empty if its commands write nothing)."""
    environ = os.environ if environ is None else environ
    home = os.path.normpath(os.path.expanduser("~") if home is None else home)
    lines = []
    writable = [(f"[upstreams.{other.name}]", path) for other in config.upstreams for path in _writable_paths(other)]
    writable += [("the gateway's own session", path) for path in gateway_writable]
    for upstream in config.upstreams:
        for program in _programs(upstream, environ):
            writer = _others_may_write(program)
            if writer:
                lines.append(f"[upstreams.{upstream.name}] runs {program}, and others may write "
                             f"{'it' if writer == program else writer}: they could change the code that runs with "
                             "its credentials (install the server where only you or root write)")
            for holder, path in writable:
                if _inside(program, path):
                    lines.append(f"[upstreams.{upstream.name}] runs {program}, inside {path}, which {holder} may "
                                 "write: a sandboxed command could change the code that runs with its credentials "
                                 "(install the server outside every workspace)")
                    break
        for root in upstream.writable_roots:
            keys = [name for name in KEY_DIRECTORIES if _inside(os.path.realpath(root), os.path.join(home, name))]
            if keys:
                lines.append(f"[upstreams.{upstream.name}] writable_roots: {root} is under ~/{keys[0]}, which the "
                             "upstream's session otherwise hides: its server may read and change your keys there "
                             "(was that meant?)")
    return [printable(line) for line in lines]
