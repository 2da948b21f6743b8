"""The git guard's rules as review rules: which changes can plant code that runs on the host later.

In direct mode the git guard (sandboxd/gitguard/guard.py) removes such things after each call. In
review mode nothing reaches the host until a person applies it, so nothing has to be removed:
a change at one of these paths is *flagged* with its reason, and an apply skips it unless the
person names it (``include_flagged``). The reasons follow docs/hardening.md section 1:

* a ``.git`` file (git follows it to another repository) or a ``.git`` symlink;
* in a git directory (a ``.git`` directory, or any directory holding HEAD with objects, refs,
  commondir or config, as the guard and git's is_git_directory judge): hooks, config, commondir
  and config.worktree, sequencer state (rebase-merge, rebase-apply, sequencer: a host
  ``git rebase --continue`` runs their exec lines), info/ (attributes name filters), and every
  other control file outside what git's own commands write (policy.git_config.GIT_DIR_WRITABLE);
  a git directory's modules/ and worktrees/ hold git directories judged the same way;
* a regular file with its set-user-ID or set-group-ID bit;
* the files tools run without being asked that docs/hardening.md lists: ``.envrc`` (direnv runs
  it on cd), ``.gitattributes`` (filter and diff drivers), ``.gitmodules`` (URLs a later
  ``git submodule update`` clones), ``.vscode/tasks.json``, ``.pre-commit-config.yaml``.

Pure: paths and modes only; whether a directory is a git directory is the caller's question
(``is_git_dir``), answered from the upper layer and the host.
"""

from __future__ import annotations

import stat

from sandboxd.policy.git_config import (GIT_DIR_NESTED, GIT_DIR_REDIRECTS, GIT_SEQUENCER_DIRS,
                                        git_dir_entry_writable)

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Callable

HOOK = "a git hook: the host's next git command runs it"
CONFIG = "git config: its keys can name programs git runs"
REDIRECT = "points git at other configuration or another repository"
SEQUENCER = "sequencer state: a host `git rebase --continue` runs its exec lines"
INFO = "git info/: its attributes can name filter and diff programs"
CONTROL = "a git control file that git's own commands do not write"
GITFILE = "a .git file: git follows it to another repository"
GITLINK = "a .git symlink: git follows it to another repository"
SETID = "a set-user-ID or set-group-ID program"
WORLD_WRITABLE = "writable by every user: anyone on the host could change it, or plant beside it, what runs later"
TOOL_LINK = "a symlink where tools look for their configuration: what it points at is run"
TOOL_FILES: dict[str, str] = {
    ".envrc": "direnv runs it when a shell enters the directory",
    ".gitattributes": "it can name git filter and diff programs",
    ".gitmodules": "a later `git submodule update` clones the URLs it names",
    ".pre-commit-config.yaml": "pre-commit runs the hooks it names on the next commit",
}
TOOL_PATHS: dict[str, str] = {
    ".vscode/tasks.json": "VS Code runs its tasks when the folder is opened",
}
# The directories of TOOL_PATHS (".vscode"): a symlink by that name brings its target's files in.
_TOOL_DIRS = frozenset(path.split("/", 1)[0] for path in TOOL_PATHS)
MAX_GIT_DEPTH = 8               # git directories nested in modules/ and worktrees/ judged at most this deep


def _in_git_dir(rest: list[str], depth: int = 0) -> str | None:
    """The reason a change at ``rest`` (path components inside a git directory) is flagged."""
    if not rest:
        return CONTROL                              # the git directory itself (made, replaced, chmod)
    first = rest[0]
    if first == "hooks":
        # What `git init` makes (*.sample) never runs; the guard keeps it too.
        return None if len(rest) == 2 and rest[1].endswith(".sample") else HOOK
    if first == "config":
        return CONFIG
    if first in GIT_DIR_REDIRECTS:
        return REDIRECT
    if first in GIT_SEQUENCER_DIRS:
        return SEQUENCER
    if first == "info":
        return INFO
    if first in GIT_DIR_NESTED and depth < MAX_GIT_DEPTH:
        # modules/<name...>/ or worktrees/<name>/: a git directory whose name may hold slashes; any
        # suffix that starts at a control file is judged as in a git directory.
        for start in range(2, len(rest)):
            reason = _in_git_dir(rest[start:], depth + 1)
            if reason is not None and reason != CONTROL:
                return reason
        return None
    if git_dir_entry_writable(first):
        return None
    return CONTROL


def reasons(path: str, kind: str, mode: int, is_git_dir: "Callable[[str], bool]") -> tuple[str, ...]:
    """Why the change at ``path`` (its upper entry's ``kind`` and ``mode``; upper.DIR, FILE, ...) is
    flagged; () when it is not. ``is_git_dir(dir_path)``: whether that directory, as the sandbox
    sees it, is a git directory (asked only for ancestors not named .git)."""
    found: list[str] = []
    parts = path.split("/") if path else []
    if parts and parts[-1] == ".git" and kind == "file":
        found.append(GITFILE)
    elif parts and parts[-1] == ".git" and kind == "symlink":
        found.append(GITLINK)
    for index in range(len(parts) - 1, -1, -1):
        # The nearest enclosing git directory decides (a repository inside another's work tree).
        named_git = parts[index] == ".git"
        if named_git or (index < len(parts) - 1 and is_git_dir("/".join(parts[:index + 1]))):
            if named_git and index == len(parts) - 1 and kind != "dir":
                break                               # a .git file or symlink: judged above
            reason = _in_git_dir(parts[index + 1:])
            if reason is not None:
                found.append(reason)
            break
    if kind == "file" and mode & (stat.S_ISUID | stat.S_ISGID):
        found.append(SETID)
    if kind in ("file", "dir") and mode & stat.S_IWOTH and not (kind == "dir" and mode & stat.S_ISVTX):
        found.append(WORLD_WRITABLE)
    if kind == "symlink" and parts and parts[-1] in _TOOL_DIRS:
        found.append(f"{parts[-1]}: {TOOL_LINK}")
    if parts and parts[-1] in TOOL_FILES:
        found.append(f"{parts[-1]}: {TOOL_FILES[parts[-1]]}")
    for suffix, why in TOOL_PATHS.items():
        if path == suffix or path.endswith("/" + suffix):
            found.append(f"{suffix}: {why}")
    return tuple(found)
