"""The fork server checks the native call helper once, at start: ``sandboxd-call -V`` must print
``native_call.digest()``. A helper built from other constants or another call plan (stale), or one
that does not answer with a digest (broken), is not used: calls take the Python path, and it says
so loudly (the fork server's log line, `sandboxctl status`'s call_helper, the doctor's warning)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from conftest import BASE_ENV
from sandboxd.cli import doctor
from sandboxd.launcher import native_call
from sandboxd.policy import LaunchSpec, WorkspaceWrite
from sandboxd.service import daemon_status
from sandboxd.supervisor.fork_client import ForkServer

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def stale_helper(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real sandboxd-call, compiled from this source with one shared constant changed (as a helper
    built before that constant changed would be)."""
    original = native_call.constants
    output = tmp_path_factory.mktemp("stale") / native_call.HELPER_NAME
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(native_call, "constants", lambda: {**original(), "SBX_TRACE_FD_MIN": 17})
        native_call.build(str(output))
    return output


def test_a_stale_helper_is_named_stale(stale_helper: Path) -> None:
    checked = native_call.check_helper(str(stale_helper))
    assert checked.path is None and checked.unusable, checked
    assert checked.state.startswith(f"stale ({stale_helper} was built with constants ") and \
        native_call.digest() in checked.state, checked
    # Control: the helper packaging/setup.sh built from the same source is current.
    built = native_call.check_helper()
    assert built.path == native_call.DEFAULT_HELPER and built.state == "built" and not built.unusable, built


@pytest.mark.parametrize("script", ["#!/bin/sh\necho not-a-digest\n", "#!/bin/sh\nexit 3\n", "\x7fELF garbage"])
def test_a_broken_helper_is_named_broken(tmp_path: Path, script: str) -> None:
    helper = tmp_path / native_call.HELPER_NAME
    helper.write_text(script)
    helper.chmod(0o755)
    checked = native_call.check_helper(str(helper))
    assert checked.path is None and checked.state.startswith("broken (") and checked.unusable, checked
    missing = native_call.check_helper(str(tmp_path / "not-there"))
    assert missing.path is None and missing.state.startswith("missing") and not missing.unusable


def _supervisor_exe(server: ForkServer, workspace: Path) -> str:
    """The program of a running call's supervisor: the helper on the native path, the fork
    server's Python (a fork of it) on the other."""
    name = f"check-{os.urandom(4).hex()}"
    server.open_session(name, LaunchSpec(argv=("true",), workspace=str(workspace), env=dict(BASE_ENV),
                                         policy=WorkspaceWrite()))
    null = os.open("/dev/null", os.O_RDWR)
    try:
        call_id, _ = server.call(name, ["sleep", "30"], dict(BASE_ENV), str(workspace), None, (null, null, null))
        deadline = time.monotonic() + 10
        while not (found := [p for p in psutil.Process(server.pid).children() if p.name() == "sandboxd-call"]):
            assert time.monotonic() < deadline, "the call's supervisor never showed up"
            time.sleep(0.02)
        exe = found[0].exe()
        server.cancel(call_id)
        server.wait(call_id)
        return exe
    finally:
        os.close(null)
        server.close_session(name)


@pytest.fixture
def started() -> Iterator[list[ForkServer]]:
    servers: list[ForkServer] = []
    try:
        yield servers
    finally:
        for server in servers:
            server.close()


def test_the_fork_server_does_not_use_a_stale_helper(stale_helper: Path, workspace: Path,
                                                     started: list[ForkServer],
                                                     capfd: pytest.CaptureFixture[str]) -> None:
    """Pointed at the stale build, the fork server logs why and how to rebuild, and runs calls on
    the Python path; pointed at a copy of the current build (the control), it runs them with it."""
    started.append(stale := ForkServer.start(call_helper=str(stale_helper)))
    assert not stale.native_calls
    assert _supervisor_exe(stale, workspace) != str(stale_helper)      # a fork of the fork server's Python
    log = capfd.readouterr().err
    assert f"sandboxd-fork: call helper stale ({stale_helper}" in log and "Python call path" in log, log
    assert "rebuild it: python -m sandboxd.launcher.native_call build" in log, log

    current = stale_helper.parent / "current" / native_call.HELPER_NAME
    current.parent.mkdir()
    current.write_bytes(Path(native_call.DEFAULT_HELPER).read_bytes())
    current.chmod(0o755)
    started.append(fresh := ForkServer.start(call_helper=str(current)))
    assert fresh.native_calls
    assert _supervisor_exe(fresh, workspace) == str(current)
    assert "call helper" not in capfd.readouterr().err


def test_status_and_doctor_say_stale(stale_helper: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`sandboxctl status` shows call_helper: stale (...), and the doctor warns with the fix."""
    assert daemon_status.kernel_features()["call_helper"] == "built"          # control
    monkeypatch.setattr(native_call, "DEFAULT_HELPER", str(stale_helper))
    assert daemon_status.kernel_features()["call_helper"].startswith(f"stale ({stale_helper}")
    status, text = doctor.check_call_helper()
    assert status == "warn" and "stale" in text and "fix: python -m sandboxd.launcher.native_call build" in text, text
