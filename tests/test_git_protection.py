"""Protected subpaths: .git/hooks and .git/config stay read-only while git add/commit keep working.

The repository is created on the host beforehand (``git_workspace``); the
sandboxed command runs real git and shell commands against it; the host then
checks that nothing protected changed.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

import pytest

from conftest import BASE_ENV, EXIT_SETUP, WRITABLE, describe, make_dir, run_sbx

GIT_ENV = {**BASE_ENV, "GIT_CONFIG_NOSYSTEM": "1"}
GIT_OPTIONS = ("--env=GIT_CONFIG_NOSYSTEM=1",)     # `sandboxd run` passes only what is named


def tree_digest(path: Path) -> str:
    """A digest of every name, mode and content under ``path`` (to prove nothing changed)."""
    digest = hashlib.sha256()
    for root, dirs, files in sorted(os.walk(path)):
        dirs.sort()
        for name in sorted(dirs + files):
            full = os.path.join(root, name)
            st = os.lstat(full)
            digest.update(f"{os.path.relpath(full, path)}:{st.st_mode}".encode())
            if os.path.isfile(full) and not os.path.islink(full):
                with open(full, "rb") as f:
                    digest.update(f.read())
    return digest.hexdigest()


def host_git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True,
                          env=GIT_ENV).stdout


@pytest.mark.parametrize("policy", WRITABLE)
def test_git_add_and_commit_work(policy: str, git_workspace: Path) -> None:
    """`git add` and `git commit` succeed inside the sandbox and the commit is visible on the host."""
    result = run_sbx(["sh", "-c", "git add file.txt && git commit -q -m 'from the sandbox' && git log --oneline"],
                     workspace=git_workspace, policy=policy, env=GIT_ENV)
    assert result.returncode == 0, describe(result)
    assert "from the sandbox" in host_git(git_workspace, "log", "--format=%s")


def test_git_branch_tag_and_second_commit_work(git_workspace: Path) -> None:
    """Ordinary history operations (branch, tag, more commits, gc of loose objects) work."""
    script = ("git add file.txt && git commit -qm one && git checkout -qb topic && echo more >> file.txt && "
              "git commit -qam two && git tag v1 && git gc -q && git log --format=%s")
    result = run_sbx(["sh", "-c", script], workspace=git_workspace, env=GIT_ENV, options=GIT_OPTIONS)
    assert result.returncode == 0, describe(result)
    assert result.stdout.split() == ["two", "one"]
    assert host_git(git_workspace, "tag").strip() == "v1"


@pytest.mark.parametrize("policy", WRITABLE)
def test_hooks_are_read_only(policy: str, git_workspace: Path) -> None:
    """Creating, modifying, chmod'ing or deleting anything in .git/hooks fails; the host sees no change."""
    hooks = git_workspace / ".git" / "hooks"
    (hooks / "pre-commit").write_text("#!/bin/sh\nexit 0\n")
    before = tree_digest(hooks)
    script = ("printf '#!/bin/sh\\ntouch /tmp/pwned\\n' > .git/hooks/post-commit && echo CREATED; "
              "echo evil >> .git/hooks/pre-commit && echo APPENDED; chmod 777 .git/hooks/pre-commit && echo CHMOD; "
              "rm -f .git/hooks/pre-commit && echo REMOVED; mkdir .git/hooks/dir && echo MKDIR; "
              "ln -s /bin/sh .git/hooks/post-checkout && echo LINKED; exit 0")
    result = run_sbx(["sh", "-c", script], workspace=git_workspace, policy=policy)
    for word in ("CREATED", "APPENDED", "CHMOD", "REMOVED", "MKDIR", "LINKED"):
        assert word not in result.stdout, describe(result)
    assert tree_digest(hooks) == before


@pytest.mark.parametrize("policy", WRITABLE)
def test_config_is_read_only(policy: str, git_workspace: Path) -> None:
    """.git/config cannot be appended, replaced (git config writes a lock file and renames) or removed."""
    config = git_workspace / ".git" / "config"
    before = config.read_bytes()
    script = ("echo '[core]\\n\\thooksPath = /tmp' >> .git/config && echo APPENDED; "
              "git config core.fsmonitor 'touch /tmp/pwned' && echo GITCONFIG; "
              "echo x > .git/newconfig && mv .git/newconfig .git/config && echo REPLACED; "
              "rm -f .git/config && echo REMOVED; exit 0")
    result = run_sbx(["sh", "-c", script], workspace=git_workspace, policy=policy, env=GIT_ENV, options=GIT_OPTIONS)
    for word in ("APPENDED", "GITCONFIG", "REPLACED", "REMOVED"):
        assert word not in result.stdout, describe(result)
    assert config.read_bytes() == before


@pytest.mark.parametrize("policy", WRITABLE)
def test_dot_git_cannot_be_moved_or_replaced(policy: str, git_workspace: Path) -> None:
    """`mv .git .git2`, moving .git/hooks aside and `rm -rf .git` all fail: .git stays with its hooks."""
    before = tree_digest(git_workspace / ".git" / "hooks")
    script = ("mv .git .git2 && echo MOVED; mv .git/hooks .git/hooks.old && echo HOOKS-MOVED; "
              "rm -rf .git 2>/dev/null; test -d .git/hooks && echo STILL-THERE; exit 0")
    result = run_sbx(["sh", "-c", script], workspace=git_workspace, policy=policy)
    assert "MOVED" not in result.stdout and "HOOKS-MOVED" not in result.stdout, describe(result)
    assert "STILL-THERE" in result.stdout, describe(result)
    assert (git_workspace / ".git" / "config").is_file() and not (git_workspace / ".git2").exists()
    assert tree_digest(git_workspace / ".git" / "hooks") == before


def test_workspace_itself_cannot_be_swapped_for_a_new_git(git_workspace: Path) -> None:
    """Building a fresh repository with writable hooks by replacing .git via rename is impossible."""
    script = ("mkdir -p new/hooks && printf '#!/bin/sh\\n' > new/hooks/post-commit && "
              "mv .git old-git; mv -T new .git && echo SWAPPED; exit 0")
    result = run_sbx(["sh", "-c", script], workspace=git_workspace)
    assert "SWAPPED" not in result.stdout, describe(result)
    assert not (git_workspace / ".git" / "hooks" / "post-commit").exists()
    assert (git_workspace / ".git" / "config").is_file() and not (git_workspace / "old-git").exists()


@pytest.mark.parametrize("victim", [".git/config", ".git/hooks/pre-commit"])
def test_protected_file_cannot_be_hardlinked_and_written(victim: str, git_workspace: Path) -> None:
    """A hardlink from a writable name to a protected file cannot be made (so it cannot be written through)."""
    (git_workspace / ".git" / "hooks" / "pre-commit").write_text("#!/bin/sh\n")
    before = (git_workspace / victim).read_bytes()
    result = run_sbx(["sh", "-c", f"ln {victim} alias && echo LINKED; echo evil >> alias; exit 0"],
                     workspace=git_workspace)
    assert "LINKED" not in result.stdout, describe(result)
    assert (git_workspace / victim).read_bytes() == before


def test_git_data_stays_writable_and_control_files_do_not(git_workspace: Path) -> None:
    """What git writes (objects, refs, logs, index, HEAD, lock files) takes writes; the other control
    files of .git (info/, description) are read-only like hooks/ and config."""
    script = ("mkdir -p .git/refs/x .git/objects/zz .git/logs/x && echo x > .git/index.lock && "
              "echo x > .git/FETCH_HEAD && echo OK; "
              "echo '*.o' >> .git/info/exclude && echo INFO; echo x >> .git/description && echo DESC; exit 0")
    result = run_sbx(["sh", "-c", script], workspace=git_workspace)
    assert result.stdout.split() == ["OK"], describe(result)


def test_protection_applies_in_every_writable_root(base_dir: Path, workspace: Path) -> None:
    """A repository in an extra --writable-root gets the same protection."""
    other = make_dir(base_dir / "other")
    subprocess.run(["git", "init", "-q", str(other)], check=True, env=GIT_ENV)
    config_before = (other / ".git" / "config").read_bytes()
    script = (f"echo x > {other}/file && echo FILE; echo x > {other}/.git/hooks/post-commit && echo HOOK; "
              f"echo x >> {other}/.git/config && echo CONFIG; exit 0")
    result = run_sbx(["sh", "-c", script], workspace=workspace, options=("--writable-root", str(other)))
    assert "FILE" in result.stdout, describe(result)
    assert "HOOK" not in result.stdout and "CONFIG" not in result.stdout, describe(result)
    assert not (other / ".git" / "hooks" / "post-commit").exists()
    assert (other / ".git" / "config").read_bytes() == config_before


def test_nested_repository_in_workspace_subdirectory_is_not_a_root(git_workspace: Path) -> None:
    """Protection is per writable root: the root's own .git is protected even when cwd is a subdirectory."""
    sub = make_dir(git_workspace / "sub")
    result = run_sbx(["sh", "-c", "echo x > ../.git/hooks/post-commit && echo HOOK; exit 0"],
                     workspace=git_workspace, options=("--cwd", str(sub)))
    assert "HOOK" not in result.stdout, describe(result)


def test_no_default_protect_makes_hooks_writable(git_workspace: Path) -> None:
    """Control: with --no-default-protect the very same hook write succeeds."""
    result = run_sbx(["sh", "-c", "echo '#!/bin/sh' > .git/hooks/post-commit && echo x >> .git/config && echo OK"],
                     workspace=git_workspace, options=("--no-default-protect",))
    assert result.returncode == 0 and result.stdout == "OK\n", describe(result)
    assert (git_workspace / ".git" / "hooks" / "post-commit").exists()


def test_protect_adds_a_subpath(git_workspace: Path) -> None:
    """--protect SUB keeps SUB read-only (in addition to the defaults) while the rest stays writable."""
    make_dir(git_workspace / "secrets")
    (git_workspace / "secrets" / "key").write_text("k\n")
    script = ("echo x >> secrets/key && echo KEY; echo x > secrets/new && echo NEW; "
              "echo x > .git/hooks/h && echo HOOK; echo x > free.txt && echo FREE; exit 0")
    result = run_sbx(["sh", "-c", script], workspace=git_workspace, options=("--protect", "secrets"))
    assert result.stdout.split() == ["FREE"], describe(result)
    assert (git_workspace / "secrets" / "key").read_text() == "k\n"


def test_protect_with_no_default_protect(git_workspace: Path) -> None:
    """--no-default-protect --protect SUB protects only SUB."""
    make_dir(git_workspace / "secrets")
    script = "echo x > secrets/new && echo NEW; echo x > .git/hooks/h && echo HOOK; exit 0"
    result = run_sbx(["sh", "-c", script], workspace=git_workspace,
                     options=("--no-default-protect", "--protect", "secrets"))
    assert result.stdout.split() == ["HOOK"], describe(result)


@pytest.mark.parametrize("link", [".git/hooks", ".git/config", ".git"])
def test_protected_path_that_is_a_symlink_is_refused(link: str, git_workspace: Path, outside: Path) -> None:
    """If a protected path (or its ancestor .git) is a symlink, the launch fails with 125; nothing runs."""
    target = git_workspace / link
    moved = outside / "moved"
    os.rename(target, moved)
    target.symlink_to(moved)
    result = run_sbx(["sh", "-c", f"echo RAN > {git_workspace}/ran.txt"], workspace=git_workspace)
    assert result.returncode == EXIT_SETUP, describe(result)
    assert result.stderr.startswith("sandboxd run:") and "symlink" in result.stderr, describe(result)
    assert not (git_workspace / "ran.txt").exists()


def test_read_only_policy_cannot_commit(git_workspace: Path) -> None:
    """Under read-only git can read the repository but not commit."""
    result = run_sbx(["sh", "-c", "git status --short && git add file.txt"], workspace=git_workspace,
                     policy="read-only", env=GIT_ENV)
    assert result.returncode != 0, describe(result)
    assert "file.txt" in result.stdout
    assert host_git(git_workspace, "status", "--short").startswith("??")


def test_every_existing_git_directory_is_protected(git_workspace: Path) -> None:
    """Nested repositories and submodules' git directories (.git/modules/NAME) that exist when the
    sandbox is built get the same read-only control files as the root's .git; their data stays
    writable (a commit in the nested repository works)."""
    nested = git_workspace / "vendor" / "lib"
    subprocess.run(["git", "init", "-q", str(nested)], check=True, env=GIT_ENV)
    module = git_workspace / ".git" / "modules" / "dep"
    subprocess.run(["git", "init", "-q", "--bare", str(module)], check=True, env=GIT_ENV)
    (nested / "x.txt").write_text("x\n")
    before = {path: tree_digest(path) for path in (nested / ".git" / "hooks", module / "hooks")}
    script = ("for d in vendor/lib/.git .git/modules/dep; do "
              "echo x >> $d/config && echo CONFIG; echo x > $d/hooks/post-checkout && echo HOOK; "
              "echo x > $d/info/attributes && echo INFO; mv $d $d.moved && echo MOVED; done; "
              "cd vendor/lib && git add x.txt && git commit -qm nested && echo COMMIT")
    env = {**GIT_ENV, "GIT_AUTHOR_NAME": "a", "GIT_AUTHOR_EMAIL": "a@b", "GIT_COMMITTER_NAME": "a",
           "GIT_COMMITTER_EMAIL": "a@b"}
    result = run_sbx(["sh", "-c", script], workspace=git_workspace, env=env,
                     options=[f"--pass-env={key}" for key in env if key not in BASE_ENV])
    assert result.stdout.split() == ["COMMIT"], describe(result)
    assert {path: tree_digest(path) for path in before} == before
    assert "nested" in host_git(nested, "log", "--format=%s")


def test_missing_hooks_and_info_are_made_and_read_only(workspace: Path) -> None:
    """A repository made without a template has no hooks/ nor info/: both are made (empty, owned
    like .git) at sandbox build and are read-only inside, so no hook can appear in them."""
    subprocess.run(["git", "init", "-q", "--template=", str(workspace)], check=True, env=GIT_ENV)
    os.chown(workspace / ".git", 65534, 65534)
    assert not (workspace / ".git" / "hooks").exists()
    result = run_sbx(["sh", "-c", "echo x > .git/hooks/post-checkout && echo HOOK; "
                                  "echo x > .git/info/exclude && echo INFO; exit 0"], workspace=workspace)
    assert "HOOK" not in result.stdout and "INFO" not in result.stdout, describe(result)
    for name in ("hooks", "info"):
        st = (workspace / ".git" / name).stat()
        assert os.listdir(workspace / ".git" / name) == [] and (st.st_uid, st.st_gid) == (65534, 65534)
