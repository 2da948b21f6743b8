"""A module-scoped real daemon for tests that drive it through sandboxd.client."""

from __future__ import annotations

import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandboxd.client import SandboxClient

REPO = Path(__file__).resolve().parents[1]
SANDBOXD = str(REPO / ".venv" / "bin" / "sandboxd")


@pytest.fixture(scope="module")
def base() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(dir="/var/tmp", prefix="sandboxd-files-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def client(base: Path) -> Iterator[SandboxClient]:
    socket_path = base / "sandboxd.sock"
    daemon = subprocess.Popen([SANDBOXD, "serve", "--socket", str(socket_path), "--state-dir", str(socket_path.parent / "state")], stderr=subprocess.PIPE, text=True)
    assert daemon.stderr is not None and '"serving"' in daemon.stderr.readline()
    with SandboxClient(str(socket_path)) as c:
        yield c
    daemon.send_signal(signal.SIGTERM)
    assert daemon.wait(timeout=30) == 0


