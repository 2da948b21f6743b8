"""The clients ride out a burst of their own requests (quotas.requests_per_uid) and a draining
daemon's refusals (UNAVAILABLE with sandboxd-retry-after), and nothing else.

A stand-in daemon in this process answers GetStatus with the daemon's own refusal a given number
of times before it answers; what the clients see is asserted, with the control of a refusal that
names another key (returned at once, tried once)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from daemon_helpers import stand_in_daemon
from sandboxd.client import REQUEST_QUOTA_KEY, RETRY_AFTER_METADATA, DrainWait, SandboxClient
from sandboxd.mcp.daemon import Daemon
from sandboxd.v1 import sandboxd_pb2 as pb
from sandboxd.v1 import sandboxd_pb2_grpc as pb_grpc


class Refusing(pb_grpc.SandboxServicer):
    def __init__(self) -> None:
        self.refusals, self.key, self.tries = 0, REQUEST_QUOTA_KEY, 0
        self.lock = threading.Lock()

    def GetStatus(self, request: pb.GetStatusRequest, context: grpc.ServicerContext) -> pb.DaemonStatus:
        with self.lock:
            self.tries += 1
            refuse = self.tries <= self.refusals
        if refuse:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"uid 1000 already has 8 requests in progress, its limit ({self.key}): wait")
        return pb.DaemonStatus(version="stand-in")


def _version_through_the_mcp_servers_channel(socket_path: str) -> str:
    """GetStatus through the channel ``sandboxd mcp`` uses (sandboxd.mcp.daemon, asyncio)."""
    async def ask() -> str:
        daemon = Daemon(socket_path)
        try:
            return (await daemon.stub.GetStatus(pb.GetStatusRequest())).version
        finally:
            await daemon.close()

    return asyncio.run(ask())


@pytest.fixture
def stand_in(tmp_path: Path) -> Iterator[tuple[Refusing, str]]:
    servicer = Refusing()
    with stand_in_daemon(servicer, tmp_path / "sandboxd.sock") as socket_path:
        yield servicer, socket_path


@pytest.mark.parametrize("refusals", [1, 5])
def test_the_sync_client_tries_again_while_its_requests_are_in_progress(
        stand_in: tuple[Refusing, str], refusals: int) -> None:
    servicer, socket_path = stand_in
    servicer.refusals = refusals
    with SandboxClient(socket_path) as client:
        assert client.stub.GetStatus(pb.GetStatusRequest()).version == "stand-in"
    assert servicer.tries == refusals + 1


def test_the_sync_client_gives_up_and_says_why(stand_in: tuple[Refusing, str]) -> None:
    servicer, socket_path = stand_in
    servicer.refusals = 1000
    with SandboxClient(socket_path) as client, pytest.raises(grpc.RpcError) as refused:
        client.stub.GetStatus(pb.GetStatusRequest())
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert REQUEST_QUOTA_KEY in (refused.value.details() or "")
    assert 2 < servicer.tries < 20                    # bounded: a few tries, then the refusal


def test_another_refusal_is_returned_at_once(stand_in: tuple[Refusing, str]) -> None:
    """The control: a refusal for anything else (the audit budget here) is not tried again."""
    servicer, socket_path = stand_in
    servicer.refusals, servicer.key = 1, "audit.owner_budget"
    with SandboxClient(socket_path) as client, pytest.raises(grpc.RpcError) as refused:
        client.stub.GetStatus(pb.GetStatusRequest())
    assert "audit.owner_budget" in (refused.value.details() or "")
    assert servicer.tries == 1


def test_the_mcp_servers_channel_tries_again_too(stand_in: tuple[Refusing, str]) -> None:
    servicer, socket_path = stand_in
    servicer.refusals = 3
    assert _version_through_the_mcp_servers_channel(socket_path) == "stand-in"
    assert servicer.tries == 4


class Draining(Refusing):
    """Refuses like a draining daemon (UNAVAILABLE with the retry hint), ``refusals`` times."""

    def GetStatus(self, request: pb.GetStatusRequest, context: grpc.ServicerContext) -> pb.DaemonStatus:
        with self.lock:
            self.tries += 1
            refuse = self.tries <= self.refusals
        if refuse:
            context.set_trailing_metadata(((RETRY_AFTER_METADATA, "0"),))
            context.abort(grpc.StatusCode.UNAVAILABLE, "sandboxd is draining; retry in 0 s (no new call starts ...)")
        return pb.DaemonStatus(version="stand-in")


@pytest.fixture
def draining(tmp_path: Path) -> Iterator[tuple[Draining, str]]:
    servicer = Draining()
    with stand_in_daemon(servicer, tmp_path / "sandboxd.sock") as socket_path:
        yield servicer, socket_path


def test_both_clients_wait_for_a_draining_daemon_and_say_so(draining: tuple[Draining, str],
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    servicer, socket_path = draining
    servicer.refusals = 3
    with SandboxClient(socket_path) as client:
        assert client.stub.GetStatus(pb.GetStatusRequest()).version == "stand-in"
    assert servicer.tries == 4
    assert capsys.readouterr().err.count("sandboxd is draining") == 1      # said once, not per try

    servicer.tries = 0
    assert _version_through_the_mcp_servers_channel(socket_path) == "stand-in"
    assert servicer.tries == 4


def test_the_drain_wait_is_bounded_and_ignores_other_unavailables() -> None:
    said: list[str] = []
    wait = DrainWait(say=said.append, budget=0.0)
    hint = ((RETRY_AFTER_METADATA, "2"),)
    assert wait.delay(grpc.StatusCode.UNAVAILABLE, hint) is None      # its wait is spent: the refusal is returned
    assert wait.waiting and said and "draining" in said[0]
    ample = DrainWait(say=said.append)
    assert ample.delay(grpc.StatusCode.UNAVAILABLE, hint) is not None
    assert ample.delay(grpc.StatusCode.UNAVAILABLE, ()) is not None  # then no daemon at all: the restart
    # The control: an UNAVAILABLE with no draining daemon's refusal first (no daemon) is returned.
    fresh = DrainWait(say=said.append)
    assert fresh.delay(grpc.StatusCode.UNAVAILABLE, ()) is None and not fresh.waiting
    assert fresh.delay(grpc.StatusCode.RESOURCE_EXHAUSTED, hint) is None
