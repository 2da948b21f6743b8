"""CI's lint gate: ruff and mypy (strict, configured in pyproject.toml) are clean over sandboxd/.

They run from the venv the tests run in (packaging/setup.sh test installs them with the test
extras), from the repository root so pyproject.toml's settings apply. The Record checks prove the
``dataclass_transform`` base is what makes the records type-check: a bad construction is caught,
the same construction done right is not.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One mypy cache for this module's runs (the checks of the snippets reuse sandboxd's), out of the tree."""
    return tmp_path_factory.mktemp("lint-cache")


def _run(*args: str, cache: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(cache), "MYPY_CACHE_DIR": str(cache / "mypy"),
                               "RUFF_CACHE_DIR": str(cache / "ruff")})


def test_ruff_is_clean(cache: Path) -> None:
    done = _run("ruff", "check", "--no-cache", "sandboxd", cache=cache)
    assert done.returncode == 0, f"ruff check sandboxd found problems:\n{done.stdout}{done.stderr}"


def test_mypy_is_clean(cache: Path) -> None:
    done = _run("mypy", "sandboxd", cache=cache)
    assert done.returncode == 0, f"mypy sandboxd found problems:\n{done.stdout}{done.stderr}"
    assert "Success: no issues found" in done.stdout, done.stdout


_RECORD_USE = '''
from sandboxd.policy import LaunchSpec, Limits
from sandboxd.policy.decision import ToolRules

spec = LaunchSpec(argv=("true",), workspace="/")
rules = ToolRules(hidden=frozenset({"shell.exec"}))
names: frozenset[str] = rules.always_ask            # a Factory default has its field's type
env: dict[str, str] = spec.env
timeout: float | None = spec.replace(limits=Limits(timeout_seconds=1.0)).limits.timeout_seconds
'''

_RECORD_MISUSE = '''
from sandboxd.policy import LaunchSpec, Limits

LaunchSpec(argv=("true",), workspce="/")            # a misspelt field
LaunchSpec(argv=("true",))                          # a field without a default left out
Limits(pids="many")                                 # a value of the wrong type
LaunchSpec(argv=("true",), workspace="/").workspace = "/tmp"   # records are frozen
count: int = LaunchSpec(argv=("true",), workspace="/").replace(workspace="/tmp").workspace
'''


def _mypy_file(tmp_path: Path, cache: Path, source: str) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "use_records.py"
    path.write_text(source)
    return _run("mypy", "--strict", "--no-error-summary", str(path), cache=cache)


def test_records_type_check_their_fields(tmp_path: Path, cache: Path) -> None:
    done = _mypy_file(tmp_path, cache, _RECORD_USE)
    assert done.returncode == 0, f"a correct use of Records was refused:\n{done.stdout}{done.stderr}"


def test_records_refuse_bad_constructions(tmp_path: Path, cache: Path) -> None:
    done = _mypy_file(tmp_path, cache, _RECORD_MISUSE)
    lines = [line for line in done.stdout.splitlines() if ": error:" in line]
    flagged = {int(line.split(":")[1]) for line in lines}
    # One error on each of lines 4-8 of the snippet (line 1 is blank).
    assert flagged == {4, 5, 6, 7, 8}, f"mypy output:\n{done.stdout}{done.stderr}"
    assert 'Unexpected keyword argument "workspce"' in done.stdout, done.stdout
    assert 'Missing positional argument "workspace"' in done.stdout, done.stdout


def test_the_types_cost_the_run_path_no_imports() -> None:
    """The typing imports sit under TYPE_CHECKING: `sandboxd run`'s modules load without ``typing`` (or
    ``dataclasses`` and what it pulls in), which would cost more than a launch."""
    probe = ("import sys, sandboxd.cli.run, sandboxd.supervisor.spawner, sandboxd.launcher.sequence\n"
             "print(sorted(m for m in ('typing', 'dataclasses', 'inspect', 're', 'enum') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"the run path imported {done.stdout.strip()}"
    # The control: the same probe sees typing once something imports it.
    control = subprocess.run([sys.executable, "-c", "import typing\n" + probe], cwd=REPO, capture_output=True,
                             text=True, timeout=60)
    assert "'typing'" in control.stdout, control.stdout + control.stderr


def test_a_run_never_imports_psutil(tmp_path: Path) -> None:
    """psutil serves the daemon (kernel.peers, the front door's descriptor count, GetStatus); a
    `sandboxd run` and the fork server load without it (its import costs more than a launch)."""
    from conftest import BASE_ENV, SANDBOXD

    done = subprocess.run([SANDBOXD, "run", "--", "true"], capture_output=True, text=True, timeout=60,
                          env={**BASE_ENV, "PYTHONPROFILEIMPORTTIME": "1"}, cwd=tmp_path)
    imported = [line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time")]
    assert done.returncode == 0 and "sandboxd.cli.run" in imported, done.stderr[-2000:]
    assert not [name for name in imported if name.startswith("psutil")], imported
    probe = "import sys, sandboxd.supervisor.fork_client as f, sandboxd.supervisor.fork_server as s, sandboxd.kernel.peers as p; print('psutil' in sys.modules)"
    fork_server = subprocess.run([sys.executable, "-c", probe.replace(", sandboxd.kernel.peers as p", "")],
                                 cwd=REPO, capture_output=True, text=True, timeout=60)
    control = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert (fork_server.stdout.strip(), control.stdout.strip()) == ("False", "True"), fork_server.stderr + control.stderr


def test_typed_settings_read_each_default_with_its_type() -> None:
    """sandboxd serve reads the configuration through Config's typed accessors: each default is of
    the type its accessor promises, and the wrong accessor is refused rather than guessed."""
    from sandboxd import config

    loaded = config.read_file(None)
    accessors = {str: loaded.text, bool: loaded.flag, int: loaded.whole, float: loaded.number,
                 list: loaded.texts, dict: loaded.table}
    for key in config.KEYS:
        value = accessors[type(key.default)](key.dotted)
        assert value == (tuple(key.default) if isinstance(key.default, list) else key.default), key.dotted
    assert loaded.whole("listen.workers") == 128 and loaded.text("listen.socket_mode") == "0666"
    for read, dotted in ((loaded.whole, "listen.socket"), (loaded.text, "listen.workers"),
                         (loaded.whole, "defaults.network_access"), (loaded.flag, "listen.workers")):
        with pytest.raises(TypeError, match=dotted):
            read(dotted)
