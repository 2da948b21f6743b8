"""The public conformance probes (../shared/conformance): 20 escape attempts x 4 policies must all hold."""

from __future__ import annotations

import subprocess

import pytest

from conftest import BASE_ENV, REPO, SANDBOXD

CONFORMANCE = (REPO / ".." / "shared" / "conformance").resolve()


@pytest.mark.timeout(300)
def test_public_conformance_probes_all_hold() -> None:
    """`../shared/conformance/run SANDBOXD` exits 0 and reports every probe held."""
    runner = CONFORMANCE / "run"
    if not runner.exists():
        pytest.skip(f"conformance probes not present: {CONFORMANCE} does not exist (expected at ../shared/conformance)")
    result = subprocess.run([str(runner), SANDBOXD], capture_output=True, text=True, timeout=280,
                            env={**BASE_ENV, "HOME": "/root"})
    failed = [line for line in result.stdout.splitlines() if line and not line.startswith(("ok", "held"))]
    assert result.returncode == 0, "\n".join(failed) + "\n" + result.stdout[-2000:] + result.stderr[-2000:]
    summary = [line for line in result.stdout.splitlines() if line.startswith("held ")]
    assert summary, result.stdout[-2000:]
    held, total = summary[-1].split()[1].split("/")
    assert held == total, summary[-1]
