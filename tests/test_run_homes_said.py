"""`sandboxd run` says when it cannot hide a home (round 10), instead of passing over it in silence.

A plain user's `sandboxd run` hides the command user's home, the caller's and $HOME, but only a
directory owned by one of them that is not a system directory (launcher.homes). $HOME pointing at
root's directory, at /etc or at another user's directory stayed visible without a word. Now each
such candidate is one line on stderr naming it (escaped) and why, and the run goes on;
`--strict-homes` refuses the run instead (125), before anything runs.

Rootless runs by a plain user made here, on the real kernel; the control: $HOME owned by the user
is hidden (its file unreadable in the sandbox) and nothing is said, while the same file in another
user's directory named by $HOME is read by the command (the line is not idle talk)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest

from conftest import BASE_ENV, EXIT_SETUP, PY, REPO, SLOW, describe, make_dir
from daemon_helpers import PlainUser, plain_users
from test_rootless_run import WARM_FILTERS

pytestmark = pytest.mark.timeout(int(300 * SLOW))
NOTES = "notes: readable by anyone who can see this directory\n"
# Prints the file it is given, or says it cannot; never fails (the runs' statuses are sandboxd's).
SHOW = "import sys\ntry:\n    print(open(sys.argv[1]).read(), end='')\nexcept OSError as e:\n    print('unreadable', e.errno)\n"


class Homes(NamedTuple):
    user: PlainUser          # runs sandboxd run
    base: Path               # 0755, root's
    code: Path               # the sandboxd package, readable by every user
    workspace: Path          # the user's
    own: Path                # a directory of the user's, with a readable file
    others: Path             # the other user's, 0755, with a readable file


@pytest.fixture(scope="module")
def homes() -> Iterator[Homes]:
    subprocess.run([sys.executable, "-c", WARM_FILTERS], check=True, timeout=120 * SLOW, cwd=REPO)
    with plain_users(2) as (user, other):
        base = Path(tempfile.mkdtemp(prefix="sbxhomes-", dir="/var/tmp"))
        try:
            os.chmod(base, 0o755)
            code = make_dir(base / "code")
            shutil.copytree(REPO / "sandboxd", code / "sandboxd", ignore=shutil.ignore_patterns("__pycache__"))
            subprocess.run(["chmod", "-R", "a+rX", str(code)], check=True)
            workspace, own, others = (make_dir(base / name) for name in ("ws", "own", "others\x1b[2Jhome"))
            for directory, owner in ((workspace, user), (own, user), (others, other)):
                (directory / "notes").write_text(NOTES)
                os.chmod(directory / "notes", 0o644)
                os.chown(directory / "notes", owner.uid, owner.gid)
                os.chown(directory, owner.uid, owner.gid)
            yield Homes(user, base, code, workspace, own, others)
        finally:
            shutil.rmtree(base, ignore_errors=True)


def run_with_home(h: Homes, home: str, *options: str, show: str = "") -> subprocess.CompletedProcess[str]:
    """``sandboxd run OPTIONS -- python3 SHOW FILE`` as the plain user, with $HOME ``home``."""
    return subprocess.run([PY, "-m", "sandboxd.cli.main", "run", "--workspace", str(h.workspace), *options, "--",
                           PY, "-c", SHOW, show or "/etc/passwd"],
                          capture_output=True, text=True, timeout=120 * SLOW, stdin=subprocess.DEVNULL,
                          user=h.user.uid, group=h.user.gid, extra_groups=[], cwd=str(h.workspace),
                          env={**BASE_ENV, "HOME": home, "PYTHONPATH": str(h.code)})


def said(result: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("sandboxd run: ")]


@pytest.mark.parametrize("home, why", [("/root", "owned by uid 0"), ("/etc", "/etc is a system directory")])
def test_a_home_of_roots_or_the_systems_is_said(homes: Homes, home: str, why: str) -> None:
    result = run_with_home(homes, home)
    assert result.returncode == 0 and result.stdout.strip() and "unreadable" not in result.stdout, describe(result)
    (line,) = said(result)
    assert line.startswith(f"sandboxd run: $HOME {home} cannot be hidden: ") and why in line, line
    assert "--strict-homes" in line and "set HOME to a directory of yours" in line, line


def test_another_users_directory_is_said_escaped_and_the_command_reads_it(homes: Homes) -> None:
    """The attack the line reports: the command reads the file in the other user's directory that
    $HOME names. The name's escape sequence is shown escaped, so it cannot clear the terminal."""
    result = run_with_home(homes, str(homes.others), show=str(homes.others / "notes"))
    assert result.returncode == 0 and result.stdout == NOTES, describe(result)
    (line,) = said(result)
    assert "\x1b" not in result.stderr and "others\\x1b[2Jhome cannot be hidden: it is owned by uid" in line, line


def test_control_an_own_home_is_hidden_and_nothing_is_said(homes: Homes) -> None:
    result = run_with_home(homes, str(homes.own), show=str(homes.own / "notes"))
    assert result.returncode == 0 and result.stdout.startswith("unreadable"), describe(result)
    assert said(result) == [], describe(result)


def test_strict_homes_refuses_before_anything_runs(homes: Homes) -> None:
    """--strict-homes: 125 and one line saying what to do; the command never ran. Control: the same
    flag with an own home runs."""
    refused = run_with_home(homes, "/etc", "--strict-homes")
    assert refused.returncode == EXIT_SETUP and refused.stdout == "", describe(refused)
    (line,) = refused.stderr.splitlines()
    assert "$HOME /etc cannot be hidden" in line and "--strict-homes refuses to run" in line, line
    runs = run_with_home(homes, str(homes.own), "--strict-homes")
    assert runs.returncode == 0 and runs.stdout.strip() and runs.stderr == "", describe(runs)


def test_host_home_asks_for_no_hiding_and_nothing_is_said(homes: Homes) -> None:
    """--host-home keeps the homes as they are: nothing to hide, so nothing to say, strict or not."""
    result = run_with_home(homes, "/etc", "--host-home", "--strict-homes")
    assert result.returncode == 0 and said(result) == [], describe(result)
