"""Module-scoped real daemons for the daemon tests, thin users of conftest's one daemon fixture
(``sandboxd_daemon_module``): ``client`` (a sandboxd.client over the module's daemon) with ``base``
(its base directory, where tests put their workspaces), and ``daemon`` / ``stub`` / ``ws`` (a
daemon_helpers.Daemon, its stub, a fresh workspace per test)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from daemon_helpers import Daemon, DaemonFactory, remove_tree
from sandboxd.client import SandboxClient
from sandboxd.v1 import sandboxd_pb2_grpc as pb_grpc

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def daemon(sandboxd_daemon_module: DaemonFactory) -> Daemon:
    """The module's daemon (started on first use)."""
    if not sandboxd_daemon_module.daemons:
        return sandboxd_daemon_module()
    return sandboxd_daemon_module.daemons[0]


@pytest.fixture(scope="module")
def base(sandboxd_daemon_module: DaemonFactory) -> Path:
    """The module daemon's base directory (its socket is in ``<base>/run/``)."""
    return sandboxd_daemon_module.base


@pytest.fixture(scope="module")
def client(daemon: Daemon) -> Iterator[SandboxClient]:
    with SandboxClient(daemon.socket) as c:
        yield c


@pytest.fixture(scope="module")
def stub(daemon: Daemon) -> pb_grpc.SandboxStub:
    return daemon.stub


@pytest.fixture
def ws(sandboxd_daemon_module: DaemonFactory, daemon: Daemon) -> Iterator[Path]:
    """A fresh root-owned 0755 workspace ``<base>/ws-*`` (beside the socket's directory, not in it)."""
    path = sandboxd_daemon_module.workspace()
    try:
        yield path
    finally:
        remove_tree(path)
