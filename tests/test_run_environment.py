"""What `sandboxd run` gives its command besides the walls (sandboxd/cli/run_env.py): only the
named variables of its caller's environment, and a private HOME. The third-party MCP server recipe
(tests/test_mcp_recipe.py) shows both against a server; these are the edges."""

from __future__ import annotations

import json
import os
import pwd
import subprocess
from pathlib import Path

import pytest

from conftest import BASE_ENV, EXIT_SETUP, describe, py, run_sbx, sbx_cli
from daemon_helpers import plain_users

pytestmark = pytest.mark.timeout(120)

SHOW = "import json, os; print(json.dumps(dict(os.environ)))"


def test_only_named_variables_reach_the_command(workspace: Path) -> None:
    env = {**BASE_ENV, "GITHUB_TOKEN": "ghp-secret", "SHARED": "yes", "LC_MESSAGES": "C"}
    result = sbx_cli("run", "--workspace", str(workspace), "--pass-env", "SHARED", "--pass-env", "UNSET",
                     "--env", "SET=here", "--", *py(SHOW), env=env)
    assert result.returncode == 0, describe(result)
    inside = json.loads(result.stdout)
    assert "GITHUB_TOKEN" not in inside and "UNSET" not in inside, inside
    assert inside["SHARED"] == "yes" and inside["SET"] == "here" and inside["LC_MESSAGES"] == "C"
    assert inside["PATH"] == BASE_ENV["PATH"] and inside["USER"] == "root"
    control = sbx_cli("run", "--workspace", str(workspace), "--host-home", "--sandbox", "danger-full-access",
                      "--pass-env", "GITHUB_TOKEN", "--", *py(SHOW), env=env)
    assert json.loads(control.stdout)["GITHUB_TOKEN"] == "ghp-secret"          # named: passed, in every policy


def test_clear_env_starts_from_nothing(workspace: Path) -> None:
    result = run_sbx(["/usr/bin/env"], workspace=workspace, options=["--clear-env", "--env", "ONLY=this"])
    assert result.returncode == 0, describe(result)
    assert result.stdout == "ONLY=this\n"


@pytest.mark.parametrize("flag, value, message", [
    ("--pass-env", "A=B", "--pass-env 'A=B' must be a variable name"),
    ("--env", "NOVALUE", "--env 'NOVALUE' must look like NAME=VALUE"),
])
def test_bad_variables_say_what_to_fix(workspace: Path, flag: str, value: str, message: str) -> None:
    result = run_sbx(["true"], workspace=workspace, options=[flag, value])
    assert result.returncode == EXIT_SETUP and message in result.stderr, describe(result)


def test_a_system_users_home_is_not_covered(workspace: Path) -> None:
    """Daemon users have homes such as /usr/sbin: never hidden (the command still gets its new
    HOME in its private /tmp, writable)."""
    daemon = pwd.getpwnam("daemon")
    assert daemon.pw_dir.startswith(("/usr", "/var", "/nonexistent")), daemon.pw_dir
    result = run_sbx(["/bin/sh", "-c", 'echo "HOME=$HOME"; ls /usr/sbin | grep -c . ; touch "$HOME/x" && echo wrote'],
                     workspace=workspace, options=["--user", "daemon"])
    assert result.returncode == 0, describe(result)
    home, count, wrote = result.stdout.split()
    assert home == "HOME=/tmp/home" and int(count) > 0 and wrote == "wrote"


def test_the_home_is_private_unless_kept(base_dir: Path) -> None:
    with plain_users(1) as (user,):
        home = base_dir / "home"
        (home / "project").mkdir(parents=True)
        (home / ".netrc").write_text("machine example.org password hunter2\n")
        for path in (home, home / "project", home / ".netrc"):
            os.chown(path, user.uid, user.gid)
        subprocess.run(["usermod", "-d", str(home), user.name], check=True, capture_output=True, timeout=60)
        netrc = home / ".netrc"
        show = ["/bin/sh", "-c", f'echo "$HOME"; cat {netrc}; echo x > {netrc} && echo wrote; '
                                 'echo y > "$HOME/cache" && echo home-writable']
        private = run_sbx(show, workspace=home / "project")
        kept = run_sbx(show, workspace=home / "project", options=["--host-home"])
    # Hidden: empty and read-only; HOME is a new private directory, writable.
    assert private.stdout.split() == ["/tmp/home", "home-writable"], describe(private)
    assert "Read-only file system" in private.stderr, describe(private)
    # Kept: the host's home as it is, read-only like the rest of the host.
    assert kept.stdout.split()[:1] == [str(home)] and "hunter2" in kept.stdout, describe(kept)
    assert "wrote" not in kept.stdout and "home-writable" not in kept.stdout, describe(kept)
    assert netrc.read_text() == "machine example.org password hunter2\n"


def test_a_cwd_in_a_hidden_home_stays_visible_read_only(base_dir: Path) -> None:
    """A CI runner's layout: the checkout in the runner's home, the build directory the workspace,
    the checkout the cwd (README's CI recipe). The checkout is read, the build written, the rest
    of the home hidden."""
    with plain_users(1) as (user,):
        home = base_dir / "home"
        checkout = home / "work" / "repo"
        (checkout / "build").mkdir(parents=True)
        (checkout / "src.txt").write_text("source\n")
        (home / ".git-credentials").write_text("https://user:token@example.org\n")
        for path in (home, home / "work", checkout, checkout / "build", checkout / "src.txt",
                     home / ".git-credentials"):
            os.chown(path, user.uid, user.gid)
        subprocess.run(["usermod", "-d", str(home), user.name], check=True, capture_output=True, timeout=60)
        script = (f"cp src.txt build/out.txt && echo built; echo x > src.txt || echo src-read-only; "
                  f"cat {home}/.git-credentials || echo no-credentials")
        result = run_sbx(["/bin/sh", "-c", script], workspace=checkout / "build", options=["--cwd", str(checkout)])
    assert result.stdout.split() == ["built", "src-read-only", "no-credentials"], describe(result)
    assert (checkout / "build" / "out.txt").read_text() == "source\n"
    assert (checkout / "src.txt").read_text() == "source\n"
