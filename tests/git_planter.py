"""Plant git layouts: the program tests/test_git_guard_differential.py runs, inside a sandbox and (as
the control) as the workspace owner on the host, so that both plant exactly the same thing.

Reads a JSON list of operations on stdin; every string in it is bytes spelled as latin-1 (paths
and contents may hold any byte). An operation that fails is reported on stderr and the rest go on
(inside the sandbox some are refused: a read-only .git/config, say). Standard library only: it
runs with the system python inside the sandbox.
"""

import json
import os
import subprocess
import sys
import tempfile


def git(*args, cwd=None, env=None):
    return subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True).stdout


def repo(path, gitdir=None):
    """A repository with one committed file ``f``; its git directory made at ``gitdir`` if given
    (made there, not moved there: .git/objects is a mount of its own inside the sandbox)."""
    os.makedirs(path, exist_ok=True)
    git("init", "-q", "-b", "master", *(["--separate-git-dir", gitdir] if gitdir else []), path)
    with open(path + b"/f", "wb") as f:
        f.write(b"one\n")
    git("-C", path, "add", "f")
    git("-C", path, "commit", "-qm", "planted")


def rebase_stop(path, todo):
    """A real interactive rebase of the repository's HEAD, left stopped at its first `break`."""
    with tempfile.NamedTemporaryFile(delete=False) as f:
        f.write(todo)
    env = dict(os.environ, GIT_SEQUENCE_EDITOR="cp " + f.name, GIT_EDITOR="true")
    git("-C", path, "rebase", "-q", "-i", "HEAD", env=env)


def gitlink(case, sub, gitdir):
    """A gitlink for ``sub`` in the outer repository's index, and its .gitmodules staged."""
    sha = git("--git-dir=" + os.fsdecode(gitdir), "rev-parse", "HEAD").strip().decode()
    git("-C", case, "update-index", "--add", "--cacheinfo", "160000," + sha + "," + os.fsdecode(sub))


def write(path, data, mode, flags=os.O_WRONLY | os.O_CREAT | os.O_TRUNC):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, flags, mode)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.chmod(path, mode)


def symlink(target, path):
    """``path`` made a symlink to ``target``, replacing a file there (the .git file of a repository
    made with --separate-git-dir)."""
    if os.path.lexists(path) and not os.path.isdir(path):
        os.unlink(path)
    os.symlink(target, path)


def copy(src, dst):
    with open(src, "rb") as f:
        data = f.read()
    write(dst, data, 0o644)


OPS = {
    "repo": repo,
    "rebase_stop": rebase_stop,
    "gitlink": gitlink,
    "mkdir": lambda path: os.makedirs(path, exist_ok=True),
    "rename": lambda src, dst: os.rename(src, dst),
    "symlink": symlink,
    "copy": copy,
    "write": write,
    "append": lambda path, data: write(path, data, 0o644, os.O_WRONLY | os.O_APPEND),
}


def main():
    failed = 0
    for op in json.load(sys.stdin):
        name, args = op[0], [a.encode("latin-1") if isinstance(a, str) else a for a in op[1:]]
        try:
            OPS[name](*args)
        except (OSError, subprocess.CalledProcessError) as exc:
            failed += 1
            detail = getattr(exc, "stderr", b"") or b""
            sys.stdout.write("planter: %s %r: %s %s\n" % (name, args[:1], exc, detail.decode(errors="replace")[-200:]))
    sys.stdout.write("planter: %d operations failed\n" % failed)


main()
