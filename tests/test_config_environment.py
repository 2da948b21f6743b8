"""`sandboxd config check` refuses exactly what `sandboxd serve` refuses, with the same words, and a
mistyped SANDBOXD_* variable is refused naming the closest key.

Both commands load the configuration through one path (config.load: the file, the environment,
what the keys name). Checked differentially: generated configurations (a seeded random mix of good
and bad values, unknown keys and sections, keys that clash together, and SANDBOXD_* variables
right and mistyped) go to both, which must agree on accept or refuse and on the message: many
in-process (serve's entry point up to the daemon it would run), a sample as real processes (a
refused serve exits 2 with config check's line; an accepted one serves)."""

from __future__ import annotations

import io
import random
import re
import subprocess
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

import pytest

from conftest import BASE_ENV, REPO, SANDBOXD
from daemon_helpers import DaemonFactory
from sandboxd import config

pytestmark = pytest.mark.timeout(300)
SEED = 27
IN_PROCESS = 400
REAL_EACH = 3           # real processes: this many accepted and this many refused configurations

# (section, name) -> (good values, bad values). Good alone; some clash together (workers 8 and the
# quotas; reserved_workers 200 and 128 workers; pids 1000 over total_pids 300).
VALUES: dict[tuple[str, str], tuple[list[Any], list[Any]]] = {
    ("listen", "workers"): ([128, 256], [0, "many", 2000, 8]),
    ("listen", "socket_mode"): (["0660", "0600"], ["0999", 660]),
    ("listen", "admin_group"): (["root", "0"], ["no-such-group-sbxd"]),
    ("quotas", "sessions_per_uid"): ([10], [0]),
    ("quotas", "calls_per_uid"): ([4], [5000]),
    ("quotas", "reserved_workers"): ([0, 16], [2000, 200]),
    ("log", "format"): (["text", "json"], ["xml"]),
    ("log", "level"): (["debug", "info"], ["loud"]),
    ("network", "dns"): ([["192.0.2.53"]], [["8.8.8"], "192.0.2.53"]),
    ("network", "pool"): (["10.234.0.0/24"], ["10.0.0.0/30", "ten"]),
    ("approvals", "timeout_seconds"): ([30, 0.5], [0, -1]),
    ("metrics", "listen"): ([""], ["127.0.0.1:70000", "no-such-host.invalid:9464", "9464"]),
    ("tls", "address"): ([""], ["127.0.0.1:9", "127.0.0.1"]),
    ("defaults", "pids"): ([64], [1000, -1]),
    ("limits", "total_pids"): ([300, 0], ["many"]),
    ("listen", "sockett"): ([], ["/x"]),
    ("lisen", "socket"): ([], ["/x"]),
}
VARIABLES: tuple[tuple[dict[str, str], bool], ...] = (
    ({"SANDBOXD_LOG_LEVEL": "debug"}, True), ({"SANDBOXD_LISTEN_WORKERS": "256"}, True),
    ({"SANDBOXD_SOCKET": "/run/elsewhere.sock"}, True),                 # the client's: not the daemon's
    ({"SANDBOXD_LISTEN_WORKER": "256"}, False), ({"SANDBOXD_LISTEN_WORKERS": "0"}, False),
    ({"SANDBOXD_LISTEN_WORKERS": "many"}, False), ({"SANDBOXD_METRIC_LISTEN": "127.0.0.1:9464"}, False),
    ({"SANDBOXD_QUOTAS_SESSIONS": "3"}, False),
)


def render(table: dict[str, dict[str, Any]]) -> str:
    def value(v: Any) -> str:
        if isinstance(v, str):
            return '"' + v + '"'
        if isinstance(v, list):
            return "[" + ", ".join(value(item) for item in v) + "]"
        return str(v).lower() if isinstance(v, bool) else str(v)
    return "".join(f"[{section}]\n" + "".join(f"{name} = {value(v)}\n" for name, v in keys.items())
                   for section, keys in table.items())


def generated(rng: random.Random, base: dict[str, dict[str, Any]] | None = None) -> tuple[str, dict[str, str]]:
    """A configuration file's text and the environment's SANDBOXD_* variables."""
    table: dict[str, dict[str, Any]] = {section: dict(keys) for section, keys in (base or {}).items()}
    for section, name in rng.sample(sorted(VALUES), rng.randint(0, 4)):
        good, bad = VALUES[(section, name)]
        pool = good if good and rng.random() < 0.7 else bad
        table.setdefault(section, {})[name] = rng.choice(pool)
    environ = dict(rng.choice(VARIABLES)[0]) if rng.random() < 0.4 else {}
    return render(table), environ


def check_in_process(path: Path) -> tuple[int, str]:
    from sandboxd.cli.main import main

    err = io.StringIO()
    with redirect_stderr(err), redirect_stdout(io.StringIO()):
        status = main(["config", "check", str(path)])
    return status, err.getvalue().removeprefix("sandboxd config: ")


def serve_in_process(path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[int, str]:
    """`sandboxd serve --config PATH` up to the daemon it would run (which returns at once here)."""
    import sandboxd.service.daemon as daemon_module
    from sandboxd.cli.serve import main

    class NotRun:
        def __init__(self, settings: object) -> None:
            self.settings = settings

        def run(self) -> int:
            return 0
    monkeypatch.setattr(daemon_module, "Daemon", NotRun)
    err = io.StringIO()
    with redirect_stderr(err):
        status = main(["--config", str(path)])
    return status, err.getvalue().removeprefix("sandboxd serve: ")


def test_config_check_and_serve_agree_on_generated_configurations(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(SEED)
    path = tmp_path / "sandboxd.toml"
    outcomes = {"accepted": 0, "refused": 0}
    for number in range(IN_PROCESS):
        text, environ = generated(rng)
        path.write_text(text)
        with monkeypatch.context() as patched:
            for name in [n for n in __import__("os").environ if n.startswith("SANDBOXD_")]:
                patched.delenv(name)
            for name, value in environ.items():
                patched.setenv(name, value)
            checked = check_in_process(path)
            served = serve_in_process(path, patched)
        assert checked == served, (number, text, environ, checked, served)
        assert checked[0] in (0, 2) and (checked[0] == 0) == (checked[1] == ""), (text, environ, checked)
        outcomes["accepted" if checked[0] == 0 else "refused"] += 1
    # The mix holds both kinds, in numbers (else the comparison proves little).
    assert min(outcomes.values()) >= IN_PROCESS // 5, outcomes


def test_real_processes_agree_too(sandboxd_daemon: DaemonFactory) -> None:
    base = sandboxd_daemon.base
    places = {"listen": {"socket": str(base / "run" / "gen.sock")}, "state": {"dir": str(base / "state")}}
    rng = random.Random(SEED + 1)
    seen = {"accepted": 0, "refused": 0}
    while min(seen.values()) < REAL_EACH:
        text, environ = generated(rng, places)
        path = base / "generated.toml"
        path.write_text(text)
        checked = subprocess.run([SANDBOXD, "config", "check", str(path)], capture_output=True, text=True,
                                 env={**BASE_ENV, **environ}, timeout=60)
        kind = "accepted" if checked.returncode == 0 else "refused"
        if seen[kind] >= REAL_EACH:
            continue
        seen[kind] += 1
        if kind == "refused":
            assert checked.returncode == 2, checked.stderr
            failed = sandboxd_daemon.start_failure(args=["--config", str(path)], env=environ, default_flags=False,
                                                   socket=base / "run" / "gen.sock")
            message = checked.stderr.removeprefix("sandboxd config: ")
            assert failed.returncode == 2 and failed.log == "sandboxd serve: " + message, (text, environ, failed)
        else:
            daemon = sandboxd_daemon(args=["--config", str(path)], env=environ, default_flags=False,
                                     socket=base / "run" / "gen.sock")
            assert daemon.serving_logged(), (text, environ, daemon.log())
            assert daemon.stop() == 0


def test_a_mistyped_variable_is_refused_naming_the_closest_key(sandboxd_daemon: DaemonFactory) -> None:
    expected = ("$SANDBOXD_LISTEN_WORKER: no configuration key is set by this variable: did you mean "
                "$SANDBOXD_LISTEN_WORKERS (listen.workers)? (unset it, or rename it)")
    failed = sandboxd_daemon.start_failure(env={"SANDBOXD_LISTEN_WORKER": "256"})
    assert failed.returncode == 2 and failed.log.strip() == f"sandboxd serve: {expected}", failed.log
    checked = subprocess.run([SANDBOXD, "config", "check", "/dev/null"], capture_output=True, text=True,
                             env={**BASE_ENV, "SANDBOXD_LISTEN_WORKER": "256"}, timeout=60)
    assert checked.returncode == 2 and checked.stderr.strip() == f"sandboxd config: {expected}", checked.stderr
    # Control: spelled right, the same value is taken.
    daemon = sandboxd_daemon(env={"SANDBOXD_LISTEN_WORKERS": "256"})
    assert daemon.serving_logged()


@pytest.mark.parametrize("name, closest", [
    ("SANDBOXD_METRIC_LISTEN", "SANDBOXD_METRICS_LISTEN"), ("SANDBOXD_LISTN_SOCKET", "SANDBOXD_LISTEN_SOCKET"),
    ("SANDBOXD_QUOTAS_SESSION_PER_UID", "SANDBOXD_QUOTAS_SESSIONS_PER_UID"), ("SANDBOXD_TLS_ADRESS", "SANDBOXD_TLS_ADDRESS"),
])
def test_the_closest_key_is_named(name: str, closest: str) -> None:
    with pytest.raises(config.ConfigError) as refused:
        config.load("/dev/null", environ={name: "1"})
    assert f"did you mean ${closest} " in str(refused.value), str(refused.value)


def test_no_variable_sandboxd_itself_uses_is_taken_for_a_typo() -> None:
    """Every SANDBOXD_* name in the tree (the client's socket, the tracer, set-up, tests, packaging)
    is a key's variable or one of config.OTHER_VARIABLES: a daemon started beside them serves."""
    names: set[str] = set()
    for path in [*REPO.glob("sandboxd/**/*.py"), *REPO.glob("tests/*.py"), *REPO.glob("packaging/**/*"),
                 *REPO.glob("docs/*.md"), REPO / "README.md", *REPO.glob(".ci/*")]:
        if path.is_file():
            names |= set(re.findall(r"\bSANDBOXD_[A-Z0-9_]*[A-Z0-9]\b", path.read_text(errors="replace")))
    refused = {name: config.mistyped_variable(name) for name in sorted(names)}
    refused = {name: problem for name, problem in refused.items()
               if problem and name not in {"SANDBOXD_LISTEN_WORKER", "SANDBOXD_METRIC_LISTEN", "SANDBOXD_LISTN_SOCKET",
                                           "SANDBOXD_QUOTAS_SESSIONS", "SANDBOXD_QUOTAS_SESSION_PER_UID",
                                           "SANDBOXD_TLS_ADRESS"}}
    assert not refused, refused
    assert len(names) > 20
