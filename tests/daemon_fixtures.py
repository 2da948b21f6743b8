"""Module-scoped real daemons for the daemon tests: ``client`` (a sandboxd.client over its own
daemon), and ``daemon`` / ``stub`` / ``ws`` (a daemons_helpers.Daemon, its stub, a fresh
workspace per test)."""

from __future__ import annotations

import shutil
import signal
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import make_dir
from daemon_helpers import Daemon, remove_tree, running_daemon
from sandboxd.client import SandboxClient
from sandboxd.v1 import sandboxd_pb2_grpc as pb_grpc

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
    daemon = subprocess.Popen([SANDBOXD, "serve", "--socket", str(socket_path), "--state-dir", str(base / "state")],
                              stderr=subprocess.PIPE, text=True)
    assert daemon.stderr is not None and '"serving"' in daemon.stderr.readline()
    with SandboxClient(str(socket_path)) as c:
        yield c
    daemon.send_signal(signal.SIGTERM)
    assert daemon.wait(timeout=30) == 0




@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    with running_daemon() as d:
        yield d


@pytest.fixture(scope="module")
def stub(daemon: Daemon) -> pb_grpc.SandboxStub:
    return daemon.stub


@pytest.fixture
def ws(daemon: Daemon) -> Iterator[Path]:
    """A fresh root-owned 0755 workspace next to the daemon's socket."""
    path = make_dir(daemon.base / f"ws-{uuid.uuid4().hex[:8]}")
    try:
        yield path
    finally:
        remove_tree(path)
