"""The `sandboxd` command line: exit statuses, error messages, help, stdio and signal forwarding."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from conftest import (
    ALL_POLICIES,
    BASE_ENV,
    EXIT_SETUP,
    SANDBOXD,
    describe,
    make_dir,
    py,
    run_sbx,
    sbx_cli,
)


def assert_setup_error(result: subprocess.CompletedProcess[str], *needles: str) -> None:
    """Exit 125 with exactly one stderr line, beginning 'sandboxd run:' and containing every needle."""
    assert result.returncode == EXIT_SETUP, describe(result)
    lines = result.stderr.splitlines()
    assert len(lines) == 1, f"expected one stderr line: {describe(result)}"
    assert lines[0].startswith("sandboxd run:"), describe(result)
    for needle in needles:
        assert needle in lines[0], f"{needle!r} missing from {lines[0]!r}"
    assert result.stdout == ""


# --------------------------------------------------------------------------- exit statuses


@pytest.mark.parametrize("policy", ALL_POLICIES)
@pytest.mark.parametrize("code", [0, 1, 3, 42, 255])
def test_exit_status_is_the_commands(policy: str, code: int, workspace: Path) -> None:
    """The command's own exit status is sandboxd's."""
    result = run_sbx(["sh", "-c", f"exit {code}"], workspace=workspace, policy=policy)
    assert result.returncode == code, describe(result)


@pytest.mark.parametrize("policy", ALL_POLICIES)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL, signal.SIGSEGV, signal.SIGINT])
def test_killed_by_signal_is_128_plus_n(policy: str, sig: signal.Signals, workspace: Path) -> None:
    """A command killed by signal N gives 128+N (`kill -TERM $$` => 143)."""
    result = run_sbx(["sh", "-c", f"kill -{sig.name[3:]} $$; sleep 5"], workspace=workspace, policy=policy)
    assert result.returncode == 128 + sig, describe(result)


def test_output_and_input_pass_through(workspace: Path) -> None:
    """stdin, stdout and stderr of the command are the caller's."""
    result = run_sbx(["sh", "-c", "tr a-z A-Z; echo to-stderr >&2"], workspace=workspace, input="hello\n")
    assert result.returncode == 0, describe(result)
    assert result.stdout == "HELLO\n" and result.stderr == "to-stderr\n"


def test_command_starts_in_workspace_by_default(workspace: Path) -> None:
    """Without --workspace the current directory is the workspace and the starting directory."""
    result = subprocess.run([SANDBOXD, "run", "--", "sh", "-c", "pwd; echo hi > made.txt"], capture_output=True,
                            text=True, env=BASE_ENV, cwd=workspace, timeout=60)
    assert result.returncode == 0 and result.stdout == f"{workspace}\n", describe(result)
    assert (workspace / "made.txt").exists()


def test_cwd_option(workspace: Path) -> None:
    """--cwd sets where the command starts, the workspace stays the writable root."""
    sub = make_dir(workspace / "sub")
    result = run_sbx(["sh", "-c", "pwd; echo x > here.txt"], workspace=workspace, options=("--cwd", str(sub)))
    assert result.returncode == 0 and result.stdout == f"{sub}\n", describe(result)
    assert (sub / "here.txt").exists()


def test_cwd_outside_workspace_is_read_only(workspace: Path, outside: Path) -> None:
    """A --cwd outside the workspace is allowed but stays read-only."""
    result = run_sbx(["sh", "-c", "pwd; echo x > here.txt"], workspace=workspace, options=("--cwd", str(outside)))
    assert result.stdout == f"{outside}\n", describe(result)
    assert result.returncode != 0 and not (outside / "here.txt").exists()


@pytest.mark.parametrize("handler, expected", [
    ("", 143),                                                                # default action: killed by SIGTERM
    ("signal.signal(signal.SIGTERM, lambda *a: sys.exit(9))\n", 9),          # its own handler runs
])
def test_sigterm_to_sandboxd_reaches_the_command(workspace: Path, handler: str, expected: int) -> None:
    """SIGTERM sent to the sandboxd process is forwarded to the command as-is: without a handler it
    dies of it (143); with one, it exits on its own terms."""
    script = "import signal, sys, time\n" + handler + "print('ready', flush=True)\ntime.sleep(30)"
    proc = subprocess.Popen([SANDBOXD, "run", "--workspace", str(workspace), "--", *py(script)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=BASE_ENV)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == expected
    finally:
        proc.kill()
        proc.wait()


# --------------------------------------------------------------------------- setup failures (125)


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_missing_workspace_is_125(policy: str, base_dir: Path) -> None:
    """A workspace that does not exist: 125, one line naming it."""
    missing = base_dir / "nope"
    result = run_sbx(["true"], workspace=missing, policy=policy)
    assert_setup_error(result, str(missing))


def test_workspace_that_is_a_file_is_125(base_dir: Path) -> None:
    """A workspace that is a regular file: 125."""
    (base_dir / "file").write_text("x")
    assert_setup_error(run_sbx(["true"], workspace=base_dir / "file"), "not a directory")


@pytest.mark.parametrize("policy", ALL_POLICIES)
@pytest.mark.parametrize("program", ["/nonexistent/program", "no-such-program-sbx"])
def test_missing_program_is_125(policy: str, program: str, workspace: Path) -> None:
    """A program that does not exist: 125, one line mentioning exec and ENOENT."""
    result = run_sbx([program, "arg"], workspace=workspace, policy=policy)
    assert_setup_error(result, "exec", "ENOENT", program)


@pytest.mark.parametrize("policy", ["workspace-write", "danger-full-access"])
def test_program_not_executable_is_125(policy: str, workspace: Path) -> None:
    """A program without execute permission: 125 mentioning exec and EACCES."""
    script = workspace / "script.sh"
    script.write_text("#!/bin/sh\necho ran\n")
    os.chmod(script, 0o644)
    assert_setup_error(run_sbx([str(script)], workspace=workspace, policy=policy), "exec", "EACCES")


@pytest.mark.parametrize("root, needle", [
    ("relative/dir", "relative"),
    ("/nonexistent-sbx-root", "does not exist"),
    ("/", "/"),
    ("/proc", "/proc"),
    ("/sys/fs", "/sys"),
    ("/dev", "/dev"),
])
def test_bad_writable_root_is_125(root: str, needle: str, workspace: Path) -> None:
    """Relative, missing, '/', and kernel-filesystem writable roots: 125 with a clear one-line reason."""
    assert_setup_error(run_sbx(["true"], workspace=workspace, options=("--writable-root", root)), needle)


def test_writable_root_resolving_to_slash_is_125(base_dir: Path, workspace: Path) -> None:
    """A writable root that is a symlink to / is refused once resolved."""
    (base_dir / "to-root").symlink_to("/")
    assert_setup_error(run_sbx(["true"], workspace=workspace, options=("--writable-root", str(base_dir / "to-root"))),
                       "/")


@pytest.mark.parametrize("options, needle", [
    (("--sandbox", "bogus"), "bogus"),
    (("--sandbox", "read-only", "--network"), "network"),
    (("--sandbox", "read-only", "--writable-root", "/var/tmp"), "writable root"),
    (("--memory", "lots"), "--memory"),
    (("--memory", "1M"), "memory"),
    (("--tmp-size", "0"), "--tmp-size"),
    (("--timeout", "0"), "timeout"),
    (("--pids", "0"), "pids"),
    (("--open-files", "3"), "open-files"),
    (("--env", "NOEQUALS"), "NOEQUALS"),
    (("--user", "no-such-user-sbx"), "no-such-user-sbx"),
    (("--protect", "/abs"), "protected subpath"),
    (("--protect", "../up"), "protected subpath"),
])
def test_bad_options_are_125(options: tuple[str, ...], needle: str, workspace: Path) -> None:
    """Invalid option values: 125 with one line saying what is wrong; the command never runs."""
    result = run_sbx(["sh", "-c", "echo RAN"], workspace=workspace, options=options)
    assert_setup_error(result, needle)


def test_no_program_is_125(workspace: Path) -> None:
    """Nothing after '--': 125."""
    result = subprocess.run([SANDBOXD, "run", "--workspace", str(workspace)], capture_output=True, text=True,
                            env=BASE_ENV, timeout=60)
    assert_setup_error(result, "no program")


@pytest.mark.parametrize("args", [["--pids", "abc"], ["--no-such-option"], ["--network", "--no-network"]])
def test_unparsable_options_are_125(args: list[str], workspace: Path) -> None:
    """Options argparse cannot parse: 125 and a line beginning 'sandboxd run:' (after the usage line)."""
    result = subprocess.run([SANDBOXD, "run", "--workspace", str(workspace), *args, "--", "true"],
                            capture_output=True, text=True, env=BASE_ENV, timeout=60)
    assert result.returncode == EXIT_SETUP, describe(result)
    assert any(line.startswith("sandboxd run:") for line in result.stderr.splitlines()), describe(result)


# --------------------------------------------------------------------------- help and subcommands


def test_run_help() -> None:
    """`sandboxd run --help` exits 0 and documents the policies and the exit statuses."""
    result = sbx_cli("run", "--help")
    assert result.returncode == 0, describe(result)
    for needle in ("read-only", "workspace-write", "danger-full-access", "--writable-root", "--timeout", "124",
                   "125"):
        assert needle in result.stdout, needle


@pytest.mark.parametrize("args", [[], ["--help"], ["help"], ["-h"]])
def test_top_level_help(args: list[str]) -> None:
    """`sandboxd` (or --help) prints the usage listing `run` and exits 0."""
    result = sbx_cli(*args)
    assert result.returncode == 0 and "run" in result.stdout, describe(result)


def test_unknown_subcommand() -> None:
    """An unknown subcommand exits 2 naming it."""
    result = sbx_cli("frobnicate")
    assert result.returncode == 2 and "frobnicate" in result.stderr, describe(result)


def test_version() -> None:
    """`sandboxd version` prints the package version."""
    from sandboxd import __version__
    result = sbx_cli("version")
    assert result.returncode == 0 and result.stdout == f"sandboxd {__version__}\n", describe(result)
