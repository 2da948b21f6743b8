"""ApplyPatch and Search, run inside the session's sandbox.

ApplyPatch is `git apply`: a well-kept tool that checks every hunk of every file
before it writes anything (all-or-nothing), refuses paths that leave the
working tree, and works outside a repository too. It runs as the session's
user in the session's sandbox, so the kernel confines what it writes; the
policy refuses up front, with a reason, any target it forbids.

Search is ripgrep when the sandbox can see it, otherwise the built-in search
in sandboxd.launcher.file_tools (Python's `re` over the tree).
"""

from __future__ import annotations

import json
import os
import shutil

from sandboxd.errors import DeadlineExceeded, InvalidPolicy
from sandboxd.launcher.patch_tool import EXIT_NOT_RESTORED, EXIT_RESTORED
from sandboxd.printable import printable
from sandboxd.service import patch_parts
from sandboxd.service.file_calls import (DEFAULT_READ_LIMIT, TOOL_ARGV, TOOL_TIMEOUT, resolve, run_in_session,
                                         run_tool)
from sandboxd.service.sessions.registry import Session, SessionRegistry
from sandboxd.supervisor.fork_client import ForkServer
from sandboxd.v1 import sandboxd_pb2 as pb

PATCH_LIMIT = 32 << 20
DEFAULT_MAX_RESULTS = 1000
MAX_RESULTS = 100_000
# The answer fits a default gRPC client (4 MiB); matches past it are dropped (truncated).
RESPONSE_LIMIT = DEFAULT_READ_LIMIT
# ripgrep's JSON is several times the answer: collected up to this, the rest dropped.
RIPGREP_OUTPUT_LIMIT = 4 * RESPONSE_LIMIT
# Python's re backtracks: a pattern like (a+)+$ can take for ever. Linear-time engines are not
# importable in the sandbox (nothing is imported after the fork), so the built-in search gets
# a short time budget instead; past it the call is DEADLINE_EXCEEDED, saying why.
BUILTIN_SEARCH_TIMEOUT = 10.0
# git apply as a plain patch tool, never a repository's: in a workspace inside a git repository git
# would read a diff --git part's names relative to the repository's top (and silently skip parts
# outside the workspace's directory), and apply the repository's config and .gitattributes (filters,
# eol, ident) to what it writes. GIT_DIR naming something that is not a repository (and never can be:
# /dev/null) makes git apply work outside any repository (setup's "gently" mode): names are relative
# to the workspace and no attributes apply. No config or attributes from the system or a home
# either (HOME=/dev/null: no ~/.config/git/attributes a sandboxed command could have written).
GIT_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/dev/null", "LANG": "C.UTF-8",
           "GIT_DIR": "/dev/null", "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": "/dev/null",
           "GIT_ATTR_NOSYSTEM": "1"}


def patched_files(patch: str, strip: int) -> tuple[list[pb.PatchedFile], int]:
    """Every path the patch makes git write, with what it does there (service.patch_parts: also
    the git-format parts without ---/+++ headers); and the -p level (auto: a/ b/ prefixes)."""
    if len(patch) > PATCH_LIMIT:
        raise InvalidPolicy(f"the patch is larger than {PATCH_LIMIT >> 20} MiB")
    found, strip = patch_parts.changes(patch, strip)
    return [pb.PatchedFile(path=change.path, action=change.action) for change in found], strip


def apply_patch(registry: SessionRegistry, fork: ForkServer, session: Session, patch: str,
                files: list[pb.PatchedFile], strip: int) -> list[pb.PatchedFile]:
    """git apply in the session's sandbox, all-or-nothing (launcher.patch_tool: every target is
    kept before git writes, and put back if git fails part way). ``files`` and ``strip``: what
    patched_files found in ``patch``, as judged and shown."""
    targets = [resolve(session, f.path) for f in files]
    info, out, err = run_in_session(
        registry, fork, session, TOOL_ARGV, data=patch.encode(),
        tool={"op": "patch", "path": session.workspace, "targets": targets, "env": GIT_ENV,
              "argv": ["git", "apply", "--whitespace=nowarn", f"-p{strip}", "-"]})
    if info.exit_code == 0:
        return files
    said = err.decode(errors="replace").strip()
    code, tab, rest = said.partition("\t")               # the tool's own failure: "ERRNO<TAB>message"
    if info.exit_code not in (EXIT_RESTORED, EXIT_NOT_RESTORED) and tab and code.isdigit():
        said = rest
    message = printable(said[:4000]) or f"git apply failed ({info.shell_status})"
    if info.exit_code == EXIT_NOT_RESTORED:
        left = [os.fsdecode(bytes.fromhex(line)) for line in out.decode().split()]
        raise InvalidPolicy(f"the patch failed part way and {len(left)} file(s) could not be put back as they "
                            f"were: {printable(', '.join(left))[:4000]}: {message}")
    if info.exit_code == EXIT_RESTORED:
        raise InvalidPolicy(f"the patch does not apply; nothing was changed: {message}")
    if info.timed_out:
        raise DeadlineExceeded(f"git apply ran past its {TOOL_TIMEOUT:g} s budget and was stopped: a file it "
                               f"was writing may be part written ({printable(', '.join(f.path for f in files))[:4000]})")
    raise InvalidPolicy(f"the patch could not be applied: {message}")


def search(registry: SessionRegistry, fork: ForkServer, session: Session, pattern: str, path: str,
           max_results: int, case_insensitive: bool, engine: str = "") -> pb.SearchResponse:
    if not pattern:
        raise InvalidPolicy("an empty pattern matches everything: give a regular expression")
    if engine not in ("", "ripgrep", "builtin"):
        raise InvalidPolicy(f"unknown search engine {engine!r}: leave it empty, or use ripgrep or builtin")
    if engine == "ripgrep" and not shutil.which("rg"):
        raise InvalidPolicy("ripgrep is not installed (apt-get install ripgrep), use the builtin engine")
    if len(pattern) > 65536:
        raise InvalidPolicy(f"the pattern is {len(pattern)} characters long: give at most 65536")
    if "\0" in pattern:
        raise InvalidPolicy("the pattern may not contain NUL bytes (ripgrep takes it as an argument)")
    if max_results > MAX_RESULTS:
        raise InvalidPolicy(f"max_results {max_results} is above the daemon's maximum of {MAX_RESULTS}")
    limit = max_results or DEFAULT_MAX_RESULTS
    target = resolve(session, path)
    if engine != "builtin" and shutil.which("rg"):        # the sandbox sees the host's /usr/bin
        argv = ["rg", "--json", "--no-config", "--max-columns", "4096"] + (["-i"] if case_insensitive else [])
        info, out, err = run_in_session(registry, fork, session, argv + ["-e", pattern, "--", target],
                                        env={"PATH": "/usr/local/bin:/usr/bin:/bin"}, limit=RIPGREP_OUTPUT_LIMIT)
        if info.timed_out:
            raise DeadlineExceeded(f"the search ran past its {TOOL_TIMEOUT:g} s budget and was stopped: "
                                   "search a smaller path")
        if info.exit_code not in (0, 1) and not (info.signal and len(out) >= RIPGREP_OUTPUT_LIMIT):
            # 1: no match; killed by SIGPIPE: we stopped reading past the output limit
            raise InvalidPolicy(f"search failed: {err.decode(errors='replace').strip()[:500]}")
        matches = _ripgrep_matches(out)
        engine = "ripgrep"
    else:
        _, out = run_tool(registry, fork, session, {"op": "search", "path": target, "pattern": pattern,
                                                    "case_insensitive": case_insensitive,
                                                    "max_results": limit + 1},
                          limit=RIPGREP_OUTPUT_LIMIT, timeout=BUILTIN_SEARCH_TIMEOUT)
        matches = _builtin_matches(out)
        engine = "builtin"
    kept, size = [], 0
    for match in matches[:limit]:
        size += match.ByteSize() + 8
        if size > RESPONSE_LIMIT:
            break
        kept.append(match)
    return pb.SearchResponse(matches=kept, truncated=len(matches) > len(kept), engine=engine)


def _ripgrep_matches(out: bytes) -> list[pb.SearchMatch]:
    matches = []
    for line in out.splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue                                      # the last line, cut at the output limit
        if event.get("type") != "match":
            continue
        data = event["data"]
        text = data["lines"].get("text", "")
        matches.append(pb.SearchMatch(path=data["path"].get("text", ""), line=data["line_number"],
                                      text=text.rstrip("\n")))
    return matches


def _builtin_matches(out: bytes) -> list[pb.SearchMatch]:
    matches = []
    for line in out.decode().splitlines():
        fields = line.split("\t")
        if len(fields) != 3 or not fields[1].isdigit():
            continue                                      # the last line, cut at the output limit
        path, number, text = fields
        if len(path) % 2 or len(text) % 2:
            continue
        matches.append(pb.SearchMatch(path=os.fsdecode(bytes.fromhex(path)), line=int(number),
                                      text=bytes.fromhex(text).decode(errors="replace")))
    return matches
