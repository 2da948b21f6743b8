"""The git guard against git itself: generated layouts a sandbox plants; host git must run none of them.

Hypothesis generates layouts of what git reads beyond a repository's own .git/config: a
`.git` file (sizes up to and past 4096 bytes, trailing LF/CR runs, blanks that are part of
the path, relative and absolute paths, "..", a symlinked component, a NUL, a BOM, a wrong
prefix), a `.git` symlink, a nested repository, a linked-worktree git directory whose
`commondir` names the hidden one, `config.worktree`, a stopped rebase with an `exec` line,
and a .git file the user had before naming a git directory that does not exist yet. The
hidden git directory lives in .git/objects/xx/, .git/modules/, an ordinary directory, or
another writable root, under a name in ASCII, UTF-8, latin-1 bytes or with blanks, and is
made reachable from the outer repository by a gitlink in its index (and a .gitmodules).
Its payload (core.fsmonitor, hooks, core.hooksPath, diff.external, a clean/smudge filter,
or the `exec` line itself) touches a marker file outside the workspace.

Each batch of layouts is planted twice by the same program (tests/git_planter.py):

* through `sandboxd run` with the workspace (and the other writable root) as the plain user
  who owns them: the guard inspects after the command; then host git, run as that user,
  does status, diff, log, rebase --continue, checkout, commit, submodule update --init and
  pull from a local remote, in the outer repository and in the planted one: no marker may fire;
* by that user directly on the host (the control): the same host git commands must fire the
  marker of every layout git accepts (``Layout.live``), so the payloads and the commands are
  real and a green run means the guard removed them.

Sized to about 30 s by default (DEFAULT_LAYOUTS); SANDBOXD_GIT_DIFF_EXAMPLES=N tries N layouts.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from conftest import BASE_ENV, PY, SANDBOXD, describe, make_dir
from test_git_guard import HOST_GIT_ENV, IDENTITY, SANDBOX_ENV, SANDBOX_OPTIONS

PLANTER = Path(__file__).with_name("git_planter.py")
BATCH = 10
DEFAULT_LAYOUTS = 40
LAYOUTS = int(os.environ.get("SANDBOXD_GIT_DIFF_EXAMPLES", DEFAULT_LAYOUTS))

ENTRIES = ("gitfile", "gitfile", "gitfile", "gitfile", "symlink", "nested", "worktree", "worktree_config",
           "sequencer", "prior_gitfile")
HOMES = ("objects", "modules", "plain", "other")
NAMES = (b"evil", "\u00e9vil-\u2603".encode(), b"\xe9vil", b"evil ", b"evil\t", b" evil", b"ev il")
PAYLOADS = ("fsmonitor", "hooks", "hookspath", "diff", "filter")
# With a padded path, 1100 LFs take the file just past 4096 bytes; 5000 take any past it.
TAILS = (b"", b"\n", b"\r\n", b"\n\r\n\r", b"\n" * 1100, b"\n" * 5000, b"\r" * 4100)
PREFIXES = (b"gitdir: ",) * 6 + (b"\xef\xbb\xbfgitdir: ", b"gitdir:", b"GITDIR: ")


@dataclass(frozen=True)
class Layout:
    entry: str
    home: str
    name: bytes
    payload: str
    absolute: bool
    dotdot: bool
    via_symlink: bool
    pad: bool
    tail: bytes
    prefix: bytes
    nul: bool
    todo: str

    @property
    def live(self) -> bool:
        """Whether git accepts it: the control must fire it."""
        return self.prefix == b"gitdir: " or self.entry in ("symlink", "nested", "sequencer")

    def short(self) -> str:
        return (f"{self.entry}/{self.home}/{self.name!r}/{self.payload} abs={self.absolute} dotdot={self.dotdot} "
                f"link={self.via_symlink} pad={self.pad} tail={len(self.tail)}x{self.tail[:1]!r} "
                f"prefix={self.prefix!r} nul={self.nul} todo={self.todo!r}")


layouts = st.builds(
    Layout, entry=st.sampled_from(ENTRIES), home=st.sampled_from(HOMES), name=st.sampled_from(NAMES),
    payload=st.sampled_from(PAYLOADS), absolute=st.booleans(), dotdot=st.booleans(), via_symlink=st.booleans(),
    pad=st.booleans(), tail=st.sampled_from(TAILS), prefix=st.sampled_from(PREFIXES), nul=st.booleans(),
    todo=st.sampled_from(("exec", "x", "  x\t", "exec")))


class Tree:
    """One copy of the cases: ``ws/cN`` repositories (the workspace), ``other/cN`` (another writable
    root) and the marker directory their payloads touch (outside both)."""

    def __init__(self, base: Path, user: tuple[str, int, int], template: Path, count: int) -> None:
        self.ws, self.other, self.markers = base / "ws", base / "other", make_dir(base / "markers", 0o777)
        make_dir(self.ws)
        make_dir(self.other)
        for i in range(count):
            shutil.copytree(template, self.ws / f"c{i}", symlinks=True)
            make_dir(self.other / f"c{i}")
        subprocess.run(["chown", "-R", f"{user[1]}:{user[2]}", str(self.ws), str(self.other)], check=True)

    def fired(self) -> list[str]:
        return sorted(os.listdir(self.markers))


def _b(path: Path) -> bytes:
    return os.fsencode(str(path))


def _rel(target: bytes, start: bytes) -> bytes:
    return os.path.relpath(target, start)


def plan(layout: Layout, tree: Tree, i: int) -> tuple[list[list[Any]], list[list[Any]]]:
    """(what the user had before: host operations; what is planted) for case ``i`` of ``tree``."""
    case, sub = _b(tree.ws / f"c{i}"), _b(tree.ws / f"c{i}" / "sub")
    marker = _b(tree.markers / f"c{i}-{layout.entry}-{layout.payload}")
    parent = {"objects": case + b"/.git/objects/ab", "modules": case + b"/.git/modules", "plain": case + b"/hidden",
              "other": _b(tree.other / f"c{i}")}[layout.home]
    hidden = parent + b"/" + layout.name
    if layout.entry == "sequencer":
        line = f"{layout.todo} touch {os.fsdecode(marker)}\n".encode()
        return [], [["rebase_stop", case, b"break\n" + line]]
    before: list[list[Any]] = []
    ops: list[list[Any]] = [["mkdir", parent]]
    if layout.entry == "nested":
        hidden = sub + b"/.git"
        ops.append(["repo", sub])
    else:
        ops.append(["repo", sub, hidden])
    gitdir = hidden
    if layout.entry == "worktree":               # a linked worktree's git dir; its commondir names the hidden one
        gitdir = hidden + b"/worktrees/w" if layout.home == "modules" else case + b"/hidden-wt"
        ops += [["mkdir", gitdir], ["write", gitdir + b"/HEAD", b"ref: refs/heads/master\n", 0o644],
                ["write", gitdir + b"/commondir", _rel(hidden, gitdir) + b"\n", 0o644],
                ["write", gitdir + b"/gitdir", sub + b"/.git\n", 0o644], ["copy", hidden + b"/index", gitdir + b"/index"]]
    if layout.entry in ("gitfile", "worktree", "worktree_config", "prior_gitfile"):
        links: list[list[Any]] = []
        content = layout.prefix + gitfile_path(layout, gitdir, sub, case, links)
        content += (b"\0" + b"#" * 10 if layout.nul else b"") + layout.tail
        if layout.entry == "prior_gitfile":      # the user's own .git file, naming a directory not there yet
            before += [["mkdir", sub], *links, ["write", sub + b"/.git", content, 0o644]]
            ops = [["mkdir", parent], ["repo", case + b"/made", hidden], ["write", sub + b"/f", b"one\n", 0o644]]
        else:
            ops += [*links, ["write", sub + b"/.git", content, 0o644]]
    elif layout.entry == "symlink":
        ops.append(["symlink", hidden if layout.absolute else _rel(hidden, sub), sub + b"/.git"])
    ops += payload(layout, hidden, sub, marker)
    ops += [["gitlink", case, b"sub", hidden],
            ["write", case + b"/.gitmodules", b'[submodule "sub"]\n\tpath = sub\n\turl = ./sub\n', 0o644],
            ["write", sub + b"/f", b"changed\n", 0o644]]
    return before, ops


def gitfile_path(layout: Layout, gitdir: bytes, sub: bytes, case: bytes, links: list[list[Any]]) -> bytes:
    """The path a .git file at sub/.git names for ``gitdir``, in the layout's form (the symlink it
    goes through is added to ``links``)."""
    head, name = gitdir.rsplit(b"/", 1)
    if layout.via_symlink:                       # through a symlink to the hidden directory's parent
        links.append(["symlink", head, case + b"/lnk"])
        head = case + b"/lnk"
    inside = head.startswith(case + b"/")
    path = head[len(case) + 1:] if inside else head if layout.absolute else _rel(head, sub)
    if layout.dotdot:                            # down into a directory that exists and back up
        path = b"sub/../" + path if inside else path + b"/../" + head.rsplit(b"/", 1)[1]
    if inside:
        path = (case + b"/" if layout.absolute else b"../") + path
    path += b"/" + name
    if layout.pad:                               # a long path (below PATH_MAX: the kernel must still take it)
        path = (b"/" + b"./" * 1500 + path[1:]) if path.startswith(b"/") else b"./" * 1500 + path
    return path


def payload(layout: Layout, hidden: bytes, sub: bytes, marker: bytes) -> list[list[Any]]:
    touch = b'"touch ' + marker + b'; :"'
    config = hidden + b"/config"
    hook = b"#!/bin/sh\ntouch " + marker + b"\n"
    hooks = ("post-checkout", "pre-commit", "post-commit", "reference-transaction", "post-merge", "post-rewrite")
    if layout.entry == "worktree_config":        # the payload in config.worktree, switched on by an extension
        return [["append", config, b"[core]\n\trepositoryformatversion = 1\n[extensions]\n\tworktreeConfig = true\n"],
                ["write", hidden + b"/config.worktree", b"[core]\n\tfsmonitor = " + touch + b"\n", 0o644]]
    if layout.payload == "fsmonitor":
        return [["append", config, b"[core]\n\tfsmonitor = " + touch + b"\n"]]
    if layout.payload == "hooks":
        return [["write", hidden + b"/hooks/" + h.encode(), hook, 0o755] for h in hooks]
    if layout.payload == "hookspath":
        return [["append", config, b'[core]\n\thooksPath = "' + hidden + b'/h"\n'], ["mkdir", hidden + b"/h"],
                *[["write", hidden + b"/h/" + h.encode(), hook, 0o755] for h in hooks]]
    if layout.payload == "diff":
        return [["append", config, b"[diff]\n\texternal = " + touch + b"\n"]]
    return [["append", config, b'[filter "x"]\n\tclean = "touch ' + marker + b'; cat"\n\tsmudge = "touch ' + marker
             + b'; cat"\n'], ["write", sub + b"/.gitattributes", b"* filter=x\n", 0o644]]


HOST_SCRIPT = r'''
g() { timeout 30 git "$@" </dev/null >/dev/null 2>&1; }
for case in "$@"; do
  cd "$case" || continue
  g status; g diff; g log -1; g rebase --continue; g checkout -q -b host; g commit -q --allow-empty -m host
  g submodule update --init; g pull -q --no-rebase --no-edit "$REMOTE" master
  if [ -d sub ]; then
    cd sub
    g status; g diff; g log -1; g rebase --continue; g checkout -q -b host; g commit -qam host
    g pull -q --no-rebase --no-edit --allow-unrelated-histories "$REMOTE" master
  fi
done
exit 0
'''


def host_git(user: str, remote: Path, cases: list[Path]) -> None:
    """What the workspace owner does next, on the host, in every case (and in the repository the
    sandbox planted), with real git and the user's own rights."""
    subprocess.run(["runuser", "-u", user, "--", *HOST_GIT_ENV, f"REMOTE={remote}", "GIT_EDITOR=true",
                    "GIT_TERMINAL_PROMPT=0", "sh", "-c", HOST_SCRIPT, "host-git", *map(str, cases)],
                   check=True, timeout=600, capture_output=True)


def planter() -> list[str]:
    """argv running tests/git_planter.py (its source passed inline: the sandbox may not see tests/)."""
    return [PY, "-c", PLANTER.read_text()]


def encode(ops: list[list[Any]]) -> str:
    """The planter's input: bytes spelled as latin-1."""
    return json.dumps([[o.decode("latin-1") if isinstance(o, bytes) else o for o in op] for op in ops])


def plant_as(user: str, ops: list[list[Any]]) -> None:
    """The planter run on the host by ``user`` (the control, and what the user had before)."""
    result = subprocess.run(["runuser", "-u", user, "--", "env", "-i", *(f"{k}={v}" for k, v in SANDBOX_ENV.items()),
                             *planter()], capture_output=True, text=True, timeout=300, input=encode(ops))
    assert result.returncode == 0 and "planter: 0 operations failed" in result.stdout, describe(result)


@pytest.fixture
def world(base_dir: Path, plain_users: "Callable[[int], list[Any]]") -> dict[str, Any]:
    """The plain user owning everything, a committed template repository and a local remote with one
    commit more (what `git pull` fetches)."""
    user = plain_users(1)[0]
    env = {**BASE_ENV, "GIT_CONFIG_NOSYSTEM": "1", **IDENTITY}
    template = make_dir(base_dir / "template")
    subprocess.run(["git", "init", "-q", "-b", "master", str(template)], check=True, env=env)
    (template / "file.txt").write_text("hello\n")
    subprocess.run(["git", "-C", str(template), "add", "file.txt"], check=True, env=env)
    subprocess.run(["git", "-C", str(template), "commit", "-qm", "base"], check=True, env=env)
    remote = base_dir / "remote.git"
    subprocess.run(["git", "clone", "-q", "--bare", str(template), str(remote)], check=True, env=env)
    upstream = base_dir / "upstream"
    subprocess.run(["git", "clone", "-q", str(remote), str(upstream)], check=True, env=env)
    (upstream / "file.txt").write_text("hello\nupstream\n")
    subprocess.run(["git", "-C", str(upstream), "commit", "-qam", "upstream"], check=True, env=env)
    subprocess.run(["git", "-C", str(upstream), "push", "-q", "origin", "master"], check=True, env=env)
    subprocess.run(["chmod", "-R", "a+rX", str(remote)], check=True)
    return {"user": (user.name, user.uid, user.gid), "template": template, "remote": remote, "base": base_dir,
            "tried": 0, "live": 0, "runs": 0}


def run_batch(world: dict[str, Any], batch: list[Layout]) -> None:
    name, uid, gid = world["user"]
    world["runs"] += 1
    base = make_dir(world["base"] / f"run{world['runs']}")
    guarded, control = (Tree(make_dir(base / k), world["user"], world["template"], len(batch)) for k in ("g", "c"))
    plans = {id(tree): [plan(layout, tree, i) for i, layout in enumerate(batch)] for tree in (guarded, control)}
    for tree in (guarded, control):                      # what the user had before the sandbox ran
        plant_as(name, [op for prior, _ in plans[id(tree)] for op in prior])
    result = subprocess.run(
        [SANDBOXD, "run", "--sandbox", "workspace-write", "--workspace", str(guarded.ws),
         "--writable-root", str(guarded.other), *SANDBOX_OPTIONS, "--", *planter()],
        capture_output=True, text=True, timeout=300, env=SANDBOX_ENV,
        input=encode([op for _, ops in plans[id(guarded)] for op in ops]))
    assert result.returncode == 0 and "planter: 0 operations failed" in result.stdout, describe(result)
    plant_as(name, [op for _, ops in plans[id(control)] for op in ops])
    for tree in (guarded, control):
        host_git(name, world["remote"], [tree.ws / f"c{i}" for i in range(len(batch))])
    fired, control_fired = guarded.fired(), control.fired()
    layouts_of = {f"c{i}": layout.short() for i, layout in enumerate(batch)}
    assert fired == [], (f"planted code ran on the host: {[(m, layouts_of[m.split('-')[0]]) for m in fired]}\n"
                         f"{describe(result)}")
    silent = [layout.short() for i, layout in enumerate(batch)
              if layout.live and not any(m.startswith(f"c{i}-") for m in control_fired)]
    assert silent == [], f"the control did not fire (the payload or the git command is not real): {silent}"
    world["tried"] += len(batch)
    world["live"] += sum(layout.live for layout in batch)
    shutil.rmtree(base, ignore_errors=True)


@pytest.mark.timeout(max(300, 10 * LAYOUTS))          # a big run (SANDBOXD_GIT_DIFF_EXAMPLES) takes its time
@settings(max_examples=max(1, -(-LAYOUTS // BATCH)), deadline=None, database=None,
          phases=[Phase.explicit, Phase.generate],     # no shrinking: each try plants a whole batch; the
          # failure message names the layouts that fired
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large, HealthCheck.large_base_example])
@given(batch=st.lists(layouts, min_size=BATCH, max_size=BATCH))
def test_generated_git_layouts_never_run_on_the_host(world: dict[str, Any], batch: list[Layout]) -> None:
    run_batch(world, batch)
    print(f"git differential: {world['tried']} layouts tried ({world['live']} live in the control), "
          "none ran under the guard")


# --------------------------------------------------------------------------- the reader alone


@settings(max_examples=100, deadline=None, database=None)
@given(name=st.sampled_from(NAMES), tail=st.sampled_from(TAILS[:4] + (b"\n" * 5000,)), prefix=st.sampled_from(PREFIXES),
       lead=st.sampled_from((b"", b" ", b"./", b"../w/")), absolute=st.booleans(), nul=st.booleans(),
       junk=st.binary(max_size=8))
def test_gitfile_reader_agrees_with_git(tmp_path_factory: pytest.TempPathFactory, name: bytes, tail: bytes,
                                        prefix: bytes, lead: bytes, absolute: bool, nul: bool, junk: bytes) -> None:
    """Wherever git itself follows a .git file (`git rev-parse --absolute-git-dir` in its directory),
    policy.git_config.gitfile_target names the same git directory once resolved."""
    from sandboxd.policy.git_config import gitfile_target
    base = tmp_path_factory.mktemp("reader")
    work = base / "w"
    work.mkdir()
    target = os.fsencode(str(base)) + b"/" + name
    subprocess.run(["git", "init", "-q", "--bare", target], check=True, capture_output=True)
    path = target if absolute else lead + b"../" + name if lead != b"../w/" else lead + b"../" + name
    data = prefix + path + (b"\0" + junk if nul else b"") + tail
    with open(work / ".git", "wb") as f:
        f.write(data)
    git = subprocess.run(["git", "rev-parse", "--absolute-git-dir"], cwd=work, capture_output=True,
                         env={**BASE_ENV, "GIT_CONFIG_NOSYSTEM": "1", "GIT_CEILING_DIRECTORIES": str(base)})
    ours = gitfile_target(data, os.fsencode(str(work / ".git")))
    if git.returncode == 0:
        assert ours is not None and os.path.realpath(ours) == git.stdout.rstrip(b"\n"), (data[:200], git.stdout)
