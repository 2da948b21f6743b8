"""The matrix table of docs/kernels.md ("Kernels and cgroups") is the VM matrix runner's recorded output,
not prose: packaging/vm/run-matrix --record keeps each kernel's last row in
packaging/vm/matrix-results.json and writes the page's table from it. These tests keep the two from drifting apart."""

from __future__ import annotations

import os
import types

from script_modules import load_script

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _runner() -> types.ModuleType:
    return load_script(os.path.join(REPO, "packaging", "vm", "run-matrix"), "run_matrix")


def test_the_kernels_page_table_is_the_recorded_matrix() -> None:
    runner = _runner()
    rows = runner.load_record()
    assert rows, "packaging/vm/matrix-results.json has no recorded leg"
    with open(runner.MATRIX_PAGE) as f:
        page = f.read()
    assert runner.page_with(page, runner.render_record(rows)) == page, (
        "docs/kernels.md's matrix table differs from packaging/vm/matrix-results.json: "
        "run packaging/vm/run-matrix --record, or fix the file by hand and rewrite the table")


def test_recorded_rows_name_what_they_ran() -> None:
    for version, row in _runner().load_record().items():
        assert row["kernel"] == version
        for key in ("cgroup", "landlock", "doctor", "conformance", "tests", "minutes", "vm", "result", "date"):
            assert row.get(key), f"{version}: no {key}"


def test_rows_sort_by_kernel_version_and_cells_cannot_break_the_table() -> None:
    runner = _runner()
    row = {"cgroup": "v2 | only", "landlock": "2"}
    table = runner.render_record({"6.12.117": dict(row, kernel="6.12.117"), "6.1.0-57": dict(row, kernel="6.1.0-57")})
    lines = table.splitlines()
    assert lines[2].startswith("| 6.1.0-57 |") and lines[3].startswith("| 6.12.117 |")
    assert all(line.count("|") == lines[0].count("|") for line in lines)
    page = f"intro\n{runner.MATRIX_BEGIN}\nold\n{runner.MATRIX_END}\nrest\n"
    assert runner.page_with(page, table) == f"intro\n{runner.MATRIX_BEGIN}\n{table}\n{runner.MATRIX_END}\nrest\n"
