"""The call plan (launcher/call_plan.py) is the one list of a call's setup steps: both call paths
trace by its names (sequence.py by ``Step``, sandboxd_call.c by the generated ``SBX_STEP_*``), and
``misplaced`` refuses a trace with a step that is not in it or out of its order. The traces of real
calls are compared with it in tests/test_call_paths.py; these check the plan, its checker and the
sources, without root."""

from __future__ import annotations

import itertools
import re
import subprocess
from pathlib import Path

import pytest

from sandboxd.launcher import call_plan, native_call, sequence
from sandboxd.launcher.call_plan import Step

OPTIONS = ("terminal", "walked", "listener")


@pytest.mark.parametrize("taken", list(itertools.product([False, True], repeat=len(OPTIONS))))
def test_every_expected_trace_follows_the_plan(taken: tuple[bool, ...]) -> None:
    options = dict(zip(OPTIONS, taken))
    trace = call_plan.expected(landlock_abi=6, **options)
    assert call_plan.misplaced(trace) is None, trace
    for option, on in options.items():          # each optional step is there exactly when asked
        step = {"terminal": Step.OPEN_TERMINAL, "walked": Step.CLOSE_ON_EXEC_WALK,
                "listener": Step.SEND_LISTENER}[option]
        assert (step in trace) == on, (option, trace)


def test_a_swapped_pair_is_refused() -> None:
    """Seccomp before Landlock (a filter that could refuse landlock_restrict_self), or the command
    forked before the privileges are dropped: each swap of two neighbours is named."""
    trace = call_plan.expected(landlock_abi=6, listener=True)
    for index in range(len(trace) - 1):
        swapped = [*trace[:index], trace[index + 1], trace[index], *trace[index + 2:]]
        if swapped == trace:
            continue
        problem = call_plan.misplaced(swapped)
        # Named at the first of the two, or at the second when the first was an optional step
        # the plan lets a trace skip.
        assert problem is not None and re.match(f"step ({index + 1}|{index + 2}) ", problem), (index, problem)


def test_an_unknown_or_missing_step_is_refused() -> None:
    trace = call_plan.expected(landlock_abi=3)
    assert "not in the call plan" in str(call_plan.misplaced([*trace[:5], "mount a tmpfs", *trace[5:]]))
    assert "not in the call plan" in str(call_plan.misplaced([*trace[:-1], "landlock abi x", "exec"]))
    without_seccomp = [step for step in trace if step != Step.SECCOMP]
    assert "comes where the plan has 'seccomp'" in str(call_plan.misplaced(without_seccomp))
    assert "ends before 'exec'" in str(call_plan.misplaced(trace[:-1]))


def _traced_names(pattern: str, text: str) -> list[str]:
    return re.findall(pattern, text)


def test_both_sources_trace_only_by_the_plan_names() -> None:
    """No step name is written by hand in either path, and every step of the plan is traced by
    both (a step in a branch no test call takes, a terminal's or the fallback's, counts too)."""
    c_source = Path(native_call.SOURCE).read_text()
    py_source = Path(sequence.__file__).read_text()
    c_calls = _traced_names(r"\btrace\(([^)]*)\)", c_source)
    py_calls = _traced_names(r"\btrace\(([^)]*)\)", py_source)
    # The C trace() definition and its formatted ABI line, Python's formatted ABI line: all others by name.
    assert {call for call in c_calls if not call.startswith("SBX_STEP_")} == {"const char *step", "step"}, c_calls
    assert {call for call in py_calls if not call.startswith("Step.")} == set(), py_calls
    names = set(call_plan.step_names())
    assert {call.removeprefix("SBX_STEP_") for call in c_calls if call.startswith("SBX_STEP_")} | {"LANDLOCK_ABI"} \
        == names
    assert "snprintf(step, sizeof step, SBX_STEP_LANDLOCK_ABI" in c_source
    assert {call.removeprefix("Step.").split()[0] for call in py_calls} == names


PRINT_STEPS = r"""
#include <stdio.h>
#include "sandboxd_call.h"
static const char *const plan[] = SBX_CALL_PLAN;
int main(void) {
%(steps)s
    for (size_t i = 0; i < sizeof plan / sizeof *plan; i++) printf("plan %%s\n", plan[i]);
    return 0;
}
"""


def test_the_compiled_header_names_the_plan(tmp_path: Path) -> None:
    """What the C compiler sees for each SBX_STEP_* and the plan's order equals call_plan."""
    (tmp_path / native_call.HEADER_NAME).write_text(native_call.header())
    steps = "\n".join(f'    printf("{name} %s\\n", SBX_STEP_{name});' for name in call_plan.step_names())
    (tmp_path / "steps.c").write_text(PRINT_STEPS % {"steps": steps})
    subprocess.run(["cc", "-Wall", "-Werror", "-iquote", str(tmp_path), "-o", str(tmp_path / "steps"),
                    str(tmp_path / "steps.c")], check=True, capture_output=True)
    output = subprocess.run([str(tmp_path / "steps")], check=True, capture_output=True, text=True).stdout
    assert output.splitlines() == [f"{name} {text}" for name, text in call_plan.step_names().items()] + [
        f"plan {text}" for text, _ in call_plan.CALL_PLAN]


def test_a_changed_plan_changes_the_digest(monkeypatch: pytest.MonkeyPatch) -> None:
    """A helper built before the plan changed is stale (the fork server then does not use it)."""
    before = native_call.digest()
    swapped = list(call_plan.CALL_PLAN)
    swapped[17], swapped[21] = swapped[21], swapped[17]          # landlock <-> seccomp
    monkeypatch.setattr(call_plan, "CALL_PLAN", tuple(swapped))
    assert native_call.digest() != before
