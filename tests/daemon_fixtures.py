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


def module_daemon(factory: DaemonFactory) -> Daemon:
    """The module's one daemon, started on first use (so ``daemon`` and ``client`` share it, and a
    module may import either alone)."""
    if not factory.daemons:
        return factory()
    return factory.daemons[0]


@pytest.fixture(scope="module")
def daemon(sandboxd_daemon_module: DaemonFactory) -> Daemon:
    return module_daemon(sandboxd_daemon_module)


@pytest.fixture(scope="module")
def base(sandboxd_daemon_module: DaemonFactory) -> Path:
    """The module daemon's base directory (its socket is in ``<base>/run/``)."""
    return sandboxd_daemon_module.base


@pytest.fixture(scope="module")
def client(sandboxd_daemon_module: DaemonFactory) -> Iterator[SandboxClient]:
    with SandboxClient(module_daemon(sandboxd_daemon_module).socket) as c:
        yield c


@pytest.fixture(scope="module")
def stub(daemon: Daemon) -> pb_grpc.SandboxStub:
    return daemon.stub


@pytest.fixture
def ws(sandboxd_daemon_module: DaemonFactory) -> Iterator[Path]:
    """A fresh root-owned 0755 workspace ``<base>/ws-*`` (beside the socket's directory, not in it)."""
    module_daemon(sandboxd_daemon_module)
    path = sandboxd_daemon_module.workspace()
    try:
        yield path
    finally:
        remove_tree(path)
