"""The native helper's shared constants come from one source: native_call.constants(), read
from the Python modules, written into the generated sandboxd_call.h, compiled into
sandboxd-call. These check each link of that chain."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from sandboxd.kernel import caps, cgroups, landlock, process, terminals
from sandboxd.launcher import call_plan, native_call, report, sequence
from sandboxd.policy import limits

PRINT_ALL = r"""
#include <stdio.h>
#include "sandboxd_call.h"
#define COUNT(a) (sizeof a / sizeof *a)
static const int signals[] = SBX_FORWARDED_SIGNALS;
static const unsigned long long rights[][2] = SBX_LL_RIGHT_ABI, scopes[][2] = SBX_LL_SCOPE_ABI;
static const char *const extra[] = SBX_LL_EXTRA_WRITABLE, *const files[] = SBX_LL_FILE_WRITES_ONLY;
int main(void) {
%(scalars)s
    printf("SBX_FORWARDED_SIGNALS");
    for (size_t i = 0; i < COUNT(signals); i++) printf(" %%d", signals[i]);
    printf("\nSBX_LL_RIGHT_ABI");
    for (size_t i = 0; i < COUNT(rights); i++) printf(" %%llu:%%llu", rights[i][0], rights[i][1]);
    printf("\nSBX_LL_SCOPE_ABI");
    for (size_t i = 0; i < COUNT(scopes); i++) printf(" %%llu:%%llu", scopes[i][0], scopes[i][1]);
    printf("\nSBX_LL_EXTRA_WRITABLE");
    for (size_t i = 0; i < COUNT(extra); i++) printf(" %%s", extra[i]);
    printf("\nSBX_LL_FILE_WRITES_ONLY");
    for (size_t i = 0; i < COUNT(files); i++) printf(" %%s", files[i]);
    printf("\nSBX_PTMX_PATH %%s", SBX_PTMX_PATH);
    printf("\nSBX_OOM_SCORE_ADJ_PATH %%s", SBX_OOM_SCORE_ADJ_PATH);
    printf("\nSBX_CONSTANTS_DIGEST %%s\n", SBX_CONSTANTS_DIGEST);
    return 0;
}
"""


def render_expected() -> list[str]:
    """What the compiled header must say, written from the Python modules directly (not from
    native_call.constants, so a constant dropped or misnamed there shows)."""
    lines = [f"SBX_{name} {value}" for name, value in [
        ("REPORT_FD", 3), ("STATUS_FD", 4), ("SESSION_PIDFD", 5), ("INTAKE_FD", 6), ("BPF_FD", 7), ("ENV_FD", 8),
        ("SETUP_FAILED_EXIT", report.SETUP_FAILED_EXIT), ("CAPABILITY_VERSION_3", 0x20080522),
        ("CAP_SYS_ADMIN", caps.CAP_SYS_ADMIN), ("FALLBACK_LAST_CAP", caps.FALLBACK_LAST_CAP),
        ("SECUREBITS", caps.SECUREBITS), ("KILL_TREE_SIGNAL", int(sequence.KILL_TREE_SIGNAL)),
        ("LL_WRITE_FILE", landlock.WRITE_FILE), ("LL_TRUNCATE", landlock.TRUNCATE),
        ("LL_WANTED_WRITES", landlock.WANTED_WRITES), ("LL_WANTED_FILE_WRITES", landlock.WANTED_FILE_WRITES),
        ("LL_WANTED_SCOPES", landlock.WANTED_SCOPES), ("LL_NET_ABI", 4), ("LL_SCOPE_ATTR_ABI", 6),
        ("TERMINAL_MIN_SIZE", terminals.MIN_SIZE), ("TERMINAL_MAX_SIZE", terminals.MAX_SIZE),
        ("COMMAND_OOM_SCORE_ADJ", process.COMMAND_OOM_SCORE_ADJ),
        # What the helper holds: the policy's writable roots and the workspace, a cgroup set's groups.
        ("MAX_WRITABLE_PATHS", limits.MAX_WRITABLE_ROOTS + 1), ("MAX_CGROUP_DIRS", cgroups.MAX_SET_DIRS),
        ("MAX_CPU_SECONDS", limits.MAX_TIMEOUT_SECONDS), ("MAX_OPEN_FILES", limits.MAX_OPEN_FILES),
        ("PATH_MAX", limits.PATH_MAX), ("LL_HIGHEST_ABI", landlock.HIGHEST_KNOWN_ABI),
    ]]
    lines.append("SBX_FORWARDED_SIGNALS " + " ".join(str(int(s)) for s in sequence.FORWARDED_SIGNALS))
    lines.append("SBX_LL_RIGHT_ABI " + " ".join(f"{bit}:{abi}" for bit, abi in sorted(landlock.RIGHT_ABI.items())))
    lines.append("SBX_LL_SCOPE_ABI " + " ".join(f"{bit}:{abi}" for bit, abi in sorted(landlock.SCOPE_ABI.items())))
    lines.append("SBX_LL_EXTRA_WRITABLE " + " ".join(landlock.EXTRA_WRITABLE))
    lines.append("SBX_LL_FILE_WRITES_ONLY " + " ".join(landlock.FILE_WRITES_ONLY))
    lines.append(f"SBX_PTMX_PATH {terminals.PTMX_PATH}")
    lines.append(f"SBX_OOM_SCORE_ADJ_PATH {process.OOM_SCORE_ADJ_PATH}")
    lines.append(f"SBX_CONSTANTS_DIGEST {native_call.digest()}")
    return lines


SCALARS = ["REPORT_FD", "STATUS_FD", "SESSION_PIDFD", "INTAKE_FD", "BPF_FD", "ENV_FD", "SETUP_FAILED_EXIT",
           "CAPABILITY_VERSION_3", "CAP_SYS_ADMIN", "FALLBACK_LAST_CAP", "SECUREBITS", "KILL_TREE_SIGNAL",
           "LL_WRITE_FILE", "LL_TRUNCATE", "LL_WANTED_WRITES", "LL_WANTED_FILE_WRITES", "LL_WANTED_SCOPES",
           "LL_NET_ABI", "LL_SCOPE_ATTR_ABI", "TERMINAL_MIN_SIZE", "TERMINAL_MAX_SIZE", "COMMAND_OOM_SCORE_ADJ",
           "MAX_WRITABLE_PATHS", "MAX_CGROUP_DIRS", "MAX_CPU_SECONDS", "MAX_OPEN_FILES", "PATH_MAX",
           "LL_HIGHEST_ABI"]


def test_the_compiled_header_says_what_python_says(tmp_path: Path) -> None:
    """The C compiler's view of the generated header equals the Python constants."""
    (tmp_path / native_call.HEADER_NAME).write_text(native_call.header())
    scalars = "\n".join(f'    printf("SBX_{name} %lld\\n", (long long)(SBX_{name}));' for name in SCALARS)
    (tmp_path / "print_all.c").write_text(PRINT_ALL % {"scalars": scalars})
    subprocess.run(["cc", "-Wall", "-Werror", "-iquote", str(tmp_path), "-o", str(tmp_path / "print_all"),
                    str(tmp_path / "print_all.c")], check=True, capture_output=True)
    output = subprocess.run([str(tmp_path / "print_all")], check=True, capture_output=True, text=True).stdout
    assert output.splitlines() == render_expected()


def test_every_constant_reaches_the_header() -> None:
    """native_call.constants() names every value the test above compares, and nothing else."""
    names = set(native_call.constants())
    assert names == {f"SBX_{name}" for name in SCALARS} | {
        "SBX_FORWARDED_SIGNALS", "SBX_LL_RIGHT_ABI", "SBX_LL_SCOPE_ABI", "SBX_LL_EXTRA_WRITABLE",
        "SBX_LL_FILE_WRITES_ONLY", "SBX_TRACE_FD_MIN", "SBX_PTMX_PATH", "SBX_OOM_SCORE_ADJ_PATH", "SBX_CALL_PLAN"} | {
        f"SBX_STEP_{name}" for name in call_plan.step_names()}     # tests/test_call_plan.py compiles these


def test_the_installed_helper_was_built_from_the_current_constants() -> None:
    """sandboxd-call -V prints the digest of the header it was compiled with: a helper built
    before a Python constant changed fails here (packaging/setup.sh rebuilds it then)."""
    helper = native_call.helper_path()
    assert helper is not None, "sandboxd-call is not built: run packaging/setup.sh"
    built = subprocess.run([helper, "-V"], check=True, capture_output=True, text=True).stdout.strip()
    assert built == native_call.digest()


def test_the_source_has_no_copies_of_the_constants() -> None:
    """sandboxd_call.c takes them from the header: no hand-written twin of a shared value."""
    source = Path(native_call.SOURCE).read_text()
    assert '#include "sandboxd_call.h"' in source
    assert not re.search(r"#define\s+SBX_", source)
    for copy in ("0x20080522", "1ULL <<", "SIGRTMIN + 2", "SIGTERM, SIGINT", '"/dev/shm"', '"/tmp"',
                 "REPORT_FD = 3", "(1 << 5)", '"/dev/ptmx"', '"/proc/self/oom_score_adj"', "MAX_PATHS = 256",
                 "604800", "1 << 20"):
        assert copy not in source, copy


def test_the_build_needs_the_generated_header(tmp_path: Path) -> None:
    """Compiled without it, the source stops with a message that says how to build it."""
    result = subprocess.run(["cc", "-fsyntax-only", "-iquote", str(tmp_path), native_call.SOURCE],
                            capture_output=True, text=True)
    assert result.returncode != 0 and "sandboxd_call.h" in result.stderr


@pytest.mark.parametrize("name", ["SBX_SECUREBITS", "SBX_LL_WANTED_WRITES"])
def test_a_changed_constant_changes_the_digest(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The digest covers the values, so a stale helper cannot pass the check above."""
    before = native_call.digest()
    original = native_call.constants
    monkeypatch.setattr(native_call, "constants", lambda: {**original(), name: 0})
    assert native_call.digest() != before
