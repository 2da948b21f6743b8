"""`sandboxd doctor`'s open-files and threads lines: what the daemon's fd limit will be, and a
warning (with the fix) when it is low."""

from __future__ import annotations

import resource
import subprocess
from pathlib import Path

import pytest

from conftest import BASE_ENV

pytestmark = pytest.mark.timeout(120)

SANDBOXD = str(Path(__file__).resolve().parents[1] / ".venv" / "bin" / "sandboxd")


def doctor_lines(nofile: tuple[int, int]) -> list[str]:
    done = subprocess.run([SANDBOXD, "doctor"], capture_output=True, text=True, env=BASE_ENV, timeout=100,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, nofile))
    return done.stdout.splitlines()


def line_of(lines: list[str], what: str) -> str:
    for index, line in enumerate(lines):
        if line[6:].startswith(what + ":"):
            return "\n".join(lines[index:index + 2])
    raise AssertionError(f"no {what!r} line in:\n" + "\n".join(lines))


def test_a_low_hard_fd_limit_warns_and_says_what_the_daemon_raises_to() -> None:
    text = line_of(doctor_lines((1024, 4096)), "open files")
    assert text.startswith("warn  open files: soft 1024, hard 4096: the daemon raises its soft limit to 4096"), text
    assert "LimitNOFILE=" in text


def test_systemds_default_soft_limit_is_raised_to_the_hard_limit() -> None:
    """Started with soft 1024 (systemd's default), the daemon would run with the hard limit;
    ok at 65536 and more (the hard limit here is what this machine allows us)."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    text = line_of(doctor_lines((1024, hard)), "open files")
    status = "ok   " if hard >= 65536 else "warn "
    assert text.startswith(f"{status} open files: soft 1024, hard {hard}: the daemon raises its soft limit to "
                           f"{hard}"), text


def test_threads_line_names_every_limit() -> None:
    text = line_of(doctor_lines(resource.getrlimit(resource.RLIMIT_NOFILE)), "threads")
    for name in ("threads-max", "pid_max", "RLIMIT_NPROC"):
        assert name in text, text
