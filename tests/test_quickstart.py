"""The README's quick start runs verbatim on a fresh machine, and no line of it is silent.

The block between `<!-- quickstart -->` and `<!-- /quickstart -->` in README.md is what a person
types in a second terminal, as root, while the first runs `packaging/setup.sh serve`. Here the
daemon is started that way (setup.sh serve, with the test's socket and state directory), the
commands are found where set-up puts them (its links, in a directory of the test's instead of
/usr/local/bin), and the block runs line by line in one shell, with HOME in a temporary directory.
Every line must exit 0 and print something.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from conftest import BASE_ENV, REPO, SLOW
from daemon_helpers import DaemonFactory

pytestmark = pytest.mark.timeout(300)

START, END = "<!-- quickstart -->", "<!-- /quickstart -->"
# Printed after each line by the harness: the line's number and its exit status.
MARK = "@@quickstart-line"


def quickstart_lines(readme: str) -> list[str]:
    """The commands of the fenced block between the markers: one per line (backslash continuations
    joined), blank and comment-only lines left out. Fails when the markers or the block are missing."""
    assert readme.count(START) == 1 and readme.count(END) == 1, f"README.md needs one {START} ... {END} block"
    body = readme[readme.index(START) + len(START):readme.index(END)]
    fenced = re.fullmatch(r"\s*```(?:sh|bash|console)?\n(.*?)```\s*", body, re.S)
    assert fenced, f"between {START} and {END}: one fenced ```sh block, nothing else"
    lines: list[str] = []
    pending = ""
    for raw in fenced.group(1).splitlines():
        if raw.endswith("\\"):
            pending += raw[:-1] + " "
            continue
        line, pending = pending + raw, ""
        if line.strip() and not line.lstrip().startswith("#"):
            lines.append(line)
    assert lines, "the quick-start block has no commands"
    return lines


def harness(lines: list[str]) -> str:
    """One bash script: each line as written, then a mark with its number and status."""
    return "".join(f"{line}\nprintf '\\n{MARK} {number} %d\\n' $?\n" for number, line in enumerate(lines))


def test_quickstart_lines_are_parsed_as_written() -> None:
    readme = f"intro\n{START}\n```sh\na --flag \\\n  b   # joined\n\n# a comment\nc\n```\n{END}\nafter\n"
    assert quickstart_lines(readme) == ["a --flag    b   # joined", "c"]
    with pytest.raises(AssertionError, match="needs one"):
        quickstart_lines("no block here")
    with pytest.raises(AssertionError, match="one fenced"):
        quickstart_lines(f"{START}\nprose only\n{END}")


def test_the_quickstart_runs_verbatim(sandboxd_daemon: DaemonFactory) -> None:
    lines = quickstart_lines((REPO / "README.md").read_text())
    bin_dir = sandboxd_daemon.base / "bin"
    # The README's way: `packaging/setup.sh serve` (here with the test's socket and state directory).
    daemon = sandboxd_daemon(executable=str(REPO / "packaging" / "setup.sh"), env={"SANDBOXD_BIN_DIR": str(bin_dir)},
                             within=180 * SLOW)
    home = sandboxd_daemon.workspace()
    env = {**BASE_ENV, "PATH": f"{bin_dir}:{BASE_ENV['PATH']}", "HOME": str(home),
           "SANDBOXD_SOCKET": daemon.socket}
    result = subprocess.run(["bash", "-c", harness(lines)], capture_output=True, text=True, env=env, cwd=home,
                            timeout=240 * SLOW, stdin=subprocess.DEVNULL)
    output = result.stdout
    failures = []
    done = 0
    for number, line in enumerate(lines):
        before, sep, rest = output.partition(f"\n{MARK} {number} ")
        if not sep:
            failures.append(f"line {number + 1} never finished: {line}")
            break
        status, _, output = rest.partition("\n")
        done += 1
        if status != "0":
            failures.append(f"line {number + 1} exited {status}: {line}\n  printed: {before.strip()[-500:]!r}")
        elif not before.strip():
            failures.append(f"line {number + 1} printed nothing: {line}")
    assert not failures and done == len(lines), "\n".join(failures) + f"\nstderr: {result.stderr[-2000:]}"
    assert (home / "demo" / "notes.txt").read_text() == "notes\n"          # what the block made is there
