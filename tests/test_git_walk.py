"""One walk for big workspaces (issue 18, item 5): the git guard's baseline walk finds the git
directories the sandbox's build protects (GitGuard.found_git_dirs, LaunchSpec.git_dirs), and
every walk opens a directory from its parent's descriptor.

What stays as strong as before: the build protects every ``.git`` its own walk would have
found, on another filesystem mounted under the workspace too (the guard does not enter it: the
build walks it), and the guard keeps neutralising below depths where the walk stops holding
descriptors open (MAX_OPEN_DEPTH).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Iterator

import pytest

from conftest import BASE_ENV, describe, run_sbx
from sandboxd.launcher import rootfs
from sandboxd.gitguard import guard as git_guard
from sandboxd.gitguard.guard import GitGuard

GIT_ENV = {**BASE_ENV, "GIT_CONFIG_NOSYSTEM": "1"}


def git_init(path: Path, *options: str) -> None:
    subprocess.run(["git", "init", "-q", *options, str(path)], check=True, env=GIT_ENV)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture
def mounted_tmpfs(workspace: Path) -> Iterator[Path]:
    """A tmpfs mounted at ``workspace/mnt`` (another filesystem under the workspace), unmounted after."""
    path = workspace / "mnt"
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m,mode=0755", "sbxtest-walk", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def test_the_guard_finds_what_the_build_walk_finds(workspace: Path, outside: Path, mounted_tmpfs: Path) -> None:
    """The guard's baseline lists exactly the ``.git`` directories rootfs's own walk finds on the
    root's filesystem (nested repositories, not a .git symlink, file, or a git directory inside
    another .git), and names the other filesystem, where the build's walk then finds the rest."""
    git_init(workspace)
    git_init(workspace / "vendor" / "lib")
    git_init(workspace / ".git" / "modules" / "dep", "--bare")
    git_init(workspace / "node_modules" / "a" / "node_modules" / "b")
    git_init(outside / "repo")
    (workspace / "linked").mkdir()
    os.symlink(outside / "repo" / ".git", workspace / "linked" / ".git")
    (workspace / "worktree").mkdir()
    (workspace / "worktree" / ".git").write_text(f"gitdir: {workspace}/.git\n")
    git_init(mounted_tmpfs / "other")
    before = open_fds()
    guard = GitGuard([str(workspace)], watch=False)
    try:
        found = guard.found_git_dirs()[str(workspace)]
    finally:
        guard.close()
    assert open_fds() == before
    assert found.other_filesystems == ("mnt",)
    on_root = [f"{workspace}/{rel}" for rel in found.git_dirs]
    assert on_root == [f"{workspace}/.git", f"{workspace}/node_modules/a/node_modules/b/.git",
                       f"{workspace}/vendor/lib/.git"]
    on_other = rootfs._find_git_dirs(str(mounted_tmpfs))                  # noqa: SLF001 - the build's walk
    assert sorted(on_root + on_other) == rootfs._find_git_dirs(str(workspace))   # noqa: SLF001


def test_a_repository_on_another_filesystem_under_the_workspace_stays_protected(
        workspace: Path, mounted_tmpfs: Path) -> None:
    """Attack: plant a hook and a config key in a repository on a filesystem mounted inside the
    workspace, which the guard's walk does not enter. The build still walks it: both fail.
    Control: a file next to that repository is written."""
    git_init(workspace)
    git_init(mounted_tmpfs / "other")
    script = ("echo x > mnt/other/.git/hooks/post-checkout && echo HOOK; "
              "echo '[core] fsmonitor = evil' >> mnt/other/.git/config && echo CONFIG; "
              "echo ok > mnt/other/file && echo FILE")
    result = run_sbx(["sh", "-c", script], workspace=workspace)
    assert result.stdout.split() == ["FILE"], describe(result)
    assert not (mounted_tmpfs / "other" / ".git" / "hooks" / "post-checkout").exists()
    assert "fsmonitor" not in (mounted_tmpfs / "other" / ".git" / "config").read_text()


def test_a_repository_deeper_than_the_old_build_walk_is_protected(workspace: Path) -> None:
    """The build's own walk stops at depth 16 (GIT_WALK_MAX_DEPTH); the guard's walk, which the
    build now uses, does not: a repository at depth 20 gets read-only control files. Attack: a
    hook and a config key planted there fail; control: its data (a commit) is written."""
    deep = workspace.joinpath(*[f"d{i}" for i in range(20)])
    git_init(deep)
    env = {**GIT_ENV, "GIT_AUTHOR_NAME": "a", "GIT_AUTHOR_EMAIL": "a@b", "GIT_COMMITTER_NAME": "a",
           "GIT_COMMITTER_EMAIL": "a@b"}
    rel = os.path.relpath(deep, workspace)
    script = (f"cd {rel} && echo x > .git/hooks/post-checkout && echo HOOK; "
              "echo '[core] fsmonitor = evil' >> .git/config && echo CONFIG; "
              "echo x > f && git add f && git commit -qm deep && echo COMMIT")
    result = run_sbx(["sh", "-c", script], workspace=workspace, env=env,
                     options=[f"--pass-env={key}" for key in env if key not in BASE_ENV])
    assert result.stdout.split() == ["COMMIT"], describe(result)
    assert not (deep / ".git" / "hooks" / "post-checkout").exists()
    assert "fsmonitor" not in (deep / ".git" / "config").read_text()


@pytest.mark.parametrize("watch", [True, False])
def test_the_guard_neutralises_below_the_depth_it_holds_open(workspace: Path, watch: bool) -> None:
    """Past MAX_OPEN_DEPTH levels the walk opens directories from the root again: a hook planted
    in a repository 10 levels deeper is still removed, the one that was there stays, and no
    descriptor is left open."""
    deep = workspace.joinpath(*["d"] * (git_guard.MAX_OPEN_DEPTH + 10))
    git_init(deep)
    (deep / ".git" / "hooks" / "pre-commit").write_text("#!/bin/sh\n")
    before = open_fds()
    guard = GitGuard([str(workspace)], watch=watch)
    try:
        rel = os.path.relpath(deep / ".git", workspace)
        assert guard.found_git_dirs()[str(workspace)].git_dirs == (rel,)
        (deep / ".git" / "hooks" / "post-checkout").write_text("#!/bin/sh\n")
        (deep / "new").mkdir()                        # a new directory: the walk goes down again
        found = guard.inspect()
    finally:
        guard.close()
    assert open_fds() == before
    assert [(item.what, item.key) for item in found] == [("hook", "post-checkout")]
    assert (deep / ".git" / "hooks" / "pre-commit").exists()


def test_a_repository_past_path_max_does_not_break_the_build(workspace: Path) -> None:
    """The guard's walk reaches a ``.git`` at any depth (descriptor-relative), but a git directory
    is judged, and protected at build, by path: one whose path is longer than PATH_MAX is not in
    what the guard hands to the build, and the sandbox still builds (the build's own walk
    stopped at depth 16, so it never met one)."""
    fd = os.open(workspace, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(20):                            # 20 x 251 bytes: past PATH_MAX (4096)
            os.mkdir("d" * 250, dir_fd=fd)
            fd, parent = os.open("d" * 250, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd), fd
            os.close(parent)
        os.mkdir(".git", dir_fd=fd)
    finally:
        os.close(fd)
    result = run_sbx(["sh", "-c", "echo ok > file && echo WROTE"], workspace=workspace)
    assert result.stdout.split() == ["WROTE"], describe(result)
