"""`packaging/setup.sh` makes a .venv plain users can run, or says exactly why they cannot.

Plain users run the checkout's commands too: `sandboxd run` rootless, `sandboxd mcp` as themselves,
the MCP-server recipe. A venv only links to the interpreter it was made from, and set-up made it
from root's `python3`, here a pyenv under /root (mode 0700): every plain user got "bad interpreter".
Set-up now makes it from the system's python3, remakes one made from another interpreter, and
when plain users still cannot run it (a checkout under a directory they cannot enter) names that
directory. Each case runs setup.sh on a copy of the checkout in a directory of the test's, with a
venv laid out as a former install left it (no download: the copy's own sandboxd, and pyseccomp,
the one dependency `sandboxd run` needs), then runs the commands as a user the test makes.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import BASE_ENV, REPO
from daemon_helpers import PlainUser

pytestmark = pytest.mark.timeout(300)
SYSTEM_PYTHON = os.path.realpath("/usr/bin/python3")


def checkout_copy(where: Path) -> Path:
    """What setup.sh reads of a checkout: itself, pyproject.toml, the package and its command."""
    repo = where / "sandboxd-checkout"
    (repo / "packaging" / "bin").mkdir(parents=True)
    for name in ("packaging/setup.sh", "packaging/bin/sandboxd", "pyproject.toml"):
        shutil.copy2(REPO / name, repo / name)
    shutil.copytree(REPO / "sandboxd", repo / "sandboxd", ignore=shutil.ignore_patterns("__pycache__"))
    return repo


def former_install(repo: Path, python: str) -> Path:
    """repo/.venv as `setup.sh install` left it, made from ``python``: the package (by a .pth, as an
    editable install has it), pyseccomp, the `sandboxd` command and the install stamp."""
    import pyseccomp

    venv = repo / ".venv"
    subprocess.run([python, "-m", "venv", "--without-pip", str(venv)], check=True, capture_output=True, timeout=120)
    site = Path(subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               check=True, capture_output=True, text=True).stdout.strip())
    (site / "sandboxd-checkout.pth").write_text(f"{repo}\n")
    shutil.copy2(pyseccomp.__file__, site)
    command = (REPO / "packaging" / "bin" / "sandboxd").read_text().split("\n", 1)[1]
    (venv / "bin" / "sandboxd").write_text(f"#!{venv}/bin/python3\n{command}")
    os.chmod(venv / "bin" / "sandboxd", 0o755)
    (venv / ".sandboxd-installed").write_text(hashlib.sha256((repo / "pyproject.toml").read_bytes()).hexdigest() + "\n")
    return venv


def setup_install(repo: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(repo / "packaging" / "setup.sh"), "install"], capture_output=True, text=True,
                          timeout=240, env={**BASE_ENV, "SANDBOXD_BIN_DIR": str(repo.parent / "bin")})


def as_user(user: PlainUser, *argv: str, cwd: str = "/") -> subprocess.CompletedProcess[str]:
    """``argv`` run by a shell as ``user`` (no supplementary groups): a command that cannot start is
    the shell's exit 126 and its one line, as a person sees it."""
    return subprocess.run(["/bin/sh", "-c", '"$@"', "sh", *argv], capture_output=True, text=True, timeout=120,
                          user=user.uid, group=user.gid, extra_groups=[], cwd=cwd,
                          env={**BASE_ENV, "HOME": cwd}, stdin=subprocess.DEVNULL)


def test_a_venv_made_from_roots_own_python_is_remade_for_every_user(
        base_dir: Path, plain_users: Callable[[int], list[PlainUser]]) -> None:
    """A former install's venv, made from a Python only root can reach (a copy of the system's in a
    0700 directory, as a pyenv under /root is): a plain user gets "bad interpreter" (the control).
    setup.sh remakes it from the system's python3, in place (the same X.Y: the installed packages
    stay), and the same user then runs `sandboxd`, and `sandboxd run` rootless."""
    (user,) = plain_users(1)
    private = base_dir / "roots-own"
    private.mkdir(mode=0o700)
    shutil.copy2(SYSTEM_PYTHON, private / "python3")
    repo = checkout_copy(base_dir)
    venv = former_install(repo, str(private / "python3"))
    before = as_user(user, str(venv / "bin" / "sandboxd"), "version")
    assert before.returncode == 126 and "Permission denied" in before.stderr, before

    done = setup_install(repo)
    assert done.returncode == 0, done.stderr
    assert f"{venv} was made from the Python in {private}" in done.stderr, done.stderr
    assert "plain users cannot" not in done.stderr, done.stderr
    assert f"home = {os.path.dirname(SYSTEM_PYTHON)}\n" in (venv / "pyvenv.cfg").read_text()
    assert (venv / ".sandboxd-installed").exists()                  # remade in place: nothing to download

    after = as_user(user, str(venv / "bin" / "sandboxd"), "version")
    assert after.returncode == 0 and after.stdout.startswith("sandboxd "), after
    workspace = base_dir / "ws"
    workspace.mkdir(mode=0o700)
    os.chown(workspace, user.uid, user.gid)
    run = as_user(user, str(base_dir / "bin" / "sandboxd"), "run", "--", "sh", "-c", "id -u; echo made > here; cat here",
                  cwd=str(workspace))
    assert run.returncode == 0 and run.stdout == f"{user.uid}\nmade\n", run
    again = setup_install(repo)                                       # the venv is right now: left as it is
    assert again.returncode == 0 and "made from" not in again.stderr and "plain users" not in again.stderr, again


def test_a_checkout_plain_users_cannot_enter_is_named(base_dir: Path, plain_users: Callable[[int], list[PlainUser]]) -> None:
    """A checkout under a directory plain users cannot enter (a clone in /root): set-up still installs
    (root's daemon works), and says why plain users cannot run it, naming that directory and the fix.
    The control: they really cannot."""
    (user,) = plain_users(1)
    closed = base_dir / "closed"
    closed.mkdir(mode=0o700)
    repo = checkout_copy(closed)
    venv = former_install(repo, "/usr/bin/python3")
    done = setup_install(repo)
    assert done.returncode == 0, done.stderr
    assert (f"plain users cannot run {venv}/bin/sandboxd: they cannot enter {closed} (mode 700, owner root)"
            in done.stderr), done.stderr
    assert f"or let them through {closed} (chmod o+x)" in done.stderr and "made from" not in done.stderr
    refused = as_user(user, str(venv / "bin" / "sandboxd"), "version")
    assert refused.returncode == 126, refused


def test_serve_as_a_plain_user_says_it_needs_root(base_dir: Path, plain_users: Callable[[int], list[PlainUser]]) -> None:
    """`sandboxd serve` as a plain user: one message saying it needs root and why, exit status 1, and
    nothing made (before, it started, failed its self-test and blamed the self-test's workspace).
    `sandboxd serve --help` still answers anyone (the control that the user runs sandboxd at all)."""
    (user,) = plain_users(1)
    repo = checkout_copy(base_dir)
    venv = former_install(repo, "/usr/bin/python3")
    own = base_dir / "own"                                               # where the user may make things
    own.mkdir()
    os.chown(own, user.uid, user.gid)
    refused = as_user(user, str(venv / "bin" / "sandboxd"), "serve", "--socket", str(own / "run" / "sandboxd.sock"),
                      "--state-dir", str(own / "state"), cwd=str(own))
    assert refused.returncode == 1 and refused.stdout == "", refused
    assert refused.stderr.startswith(f"sandboxd serve: needs root (you are uid {user.uid}): ") and \
        len(refused.stderr.splitlines()) == 1, refused.stderr
    assert "selftest" not in refused.stderr and "Traceback" not in refused.stderr
    assert list(own.iterdir()) == []
    helped = as_user(user, str(venv / "bin" / "sandboxd"), "serve", "--help")
    assert helped.returncode == 0 and "usage: sandboxd serve" in helped.stdout, helped


def test_this_checkouts_venv_runs_for_every_user() -> None:
    """The venv this suite runs in, as setup.sh made it: its interpreter is one every user may run,
    by every directory on its way (a pyenv under /root was not)."""
    interpreter = Path(os.path.realpath(REPO / ".venv" / "bin" / "python"))
    for path in (interpreter, *interpreter.parents):
        assert os.stat(path).st_mode & 0o001, f"{path} is closed to other users: {oct(os.stat(path).st_mode)}"


def test_a_checkout_with_no_venv_installs(base_dir: Path) -> None:
    """What CI and every newcomer start from: a clone with no .venv at all. setup.sh makes one from
    the system's python3 (it once stopped with status 2 and no word, reading the missing venv's
    pyvenv.cfg under `set -e`)."""
    repo = checkout_copy(base_dir)
    assert not (repo / ".venv").exists()
    done = setup_install(repo)
    assert done.returncode == 0, done.stderr
    assert f"home = {os.path.dirname(SYSTEM_PYTHON)}\n" in (repo / ".venv" / "pyvenv.cfg").read_text()
    assert (repo / ".venv" / ".sandboxd-installed").exists()
