"""The gateway's upstreams (sandboxd/mcp/gateway/upstream.py, exec_stdio.py) against a real daemon:
each upstream's server runs as one Exec call in its own session, and the faults of a hostile or
broken server (a hang, a flood, a crash, its own requests to the client) end in a bounded, stated
way, with the state after each fault checked, not only the absence of an exception.

The servers are tests/mcp_gateway_servers.py, run by the system interpreter inside the sandbox."""

from __future__ import annotations

import asyncio
import contextlib
import os
import pwd
import socket
import stat
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import mcp_types as types
import pytest
from mcp.client.session import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client

from conftest import PY, SLOW
from daemon_fixtures import daemon, ws  # noqa: F401 - pytest fixtures
from daemon_helpers import Daemon, DaemonFactory, close_quietly, run_exec
from sandboxd.mcp.daemon import Daemon as AsyncDaemon
from sandboxd.mcp.gateway.config import GatewayConfig, UpstreamConfig, default_workspace
from sandboxd.mcp.gateway import exec_stdio
from sandboxd.mcp.gateway.exec_stdio import (MAX_MESSAGE_BYTES, MAX_UNASKED_PER_SECOND, RESTART_UNASKED_PER_SECOND,
                                             STDERR_TAIL_BYTES)
from sandboxd.mcp.gateway.http_bridge import credential_headers
from sandboxd.mcp.gateway.upstream import (MAX_LISTED, Fleet, Upstream, UpstreamError, exec_start,
                                           gateway_variables)
from sandboxd.v1 import sandboxd_pb2 as pb

SERVER = str(Path(__file__).resolve().parent / "mcp_gateway_servers.py")
T = TypeVar("T")


def upstream_config(name: str, workspace: Path, mode: str = "echo", *extra: str, **fields: Any) -> UpstreamConfig:
    return UpstreamConfig(name=name, command=(PY, SERVER, mode, *extra), workspace=str(workspace), **fields)


def run(daemon: Daemon, scenario: Callable[[AsyncDaemon], Awaitable[T]]) -> T:
    async def main() -> T:
        client = AsyncDaemon(daemon.socket)
        try:
            return await scenario(client)
        finally:
            await client.close()
    return asyncio.run(main())


async def no_change(kind: str) -> None:
    del kind


def text(result: types.CallToolResult) -> str:
    return "".join(block.text for block in result.content if isinstance(block, types.TextContent))


def open_sessions(daemon: Daemon, name: str) -> list[pb.Session]:
    return [session for session in daemon.stub.ListSessions(pb.ListSessionsRequest()).sessions
            if session.labels.get("upstream") == name]


async def eventually(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 30 * SLOW
    while not check():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)


def test_listed_called_and_closed_in_its_own_session(daemon: Daemon, ws: Path) -> None:
    async def scenario(client: AsyncDaemon) -> None:
        upstream = Upstream(client, upstream_config("echo", ws), no_change)
        await upstream.ensure_started()
        assert upstream.state == "ready"
        assert [tool.name for tool in upstream.tools] == ["echo", "write_file", "read_file"]
        assert [resource.uri for resource in upstream.resources] == ["test://notes"]
        assert [prompt.name for prompt in upstream.prompts] == ["greet"]
        result = await upstream.call_tool("echo", {"text": "hi"}, 30)
        assert text(result) == "echo: hi" and not result.is_error
        # Lines that are not JSON-RPC are dropped and counted; the answer after them arrives.
        assert text(await upstream.call_tool("echo", {"text": "garbage first"}, 30)) == "echo: garbage first"
        assert upstream.process is not None and upstream.process.invalid_lines == 2
        read = await upstream.read_resource("test://notes", 30)
        assert read.contents[0].text == "read echo"
        prompt = await upstream.get_prompt("greet", None, 30)
        assert prompt.messages[0].content.text == "hello from echo"
        # Its own session: the upstream's label, approval never, the workspace of its table.
        assert upstream.session is not None
        [session] = open_sessions(daemon, "echo")
        assert session.id == upstream.session.id and session.workspace == str(ws)
        assert session.labels["client"] == "sandboxd-mcp-gateway"
        assert session.approval_policy == pb.NEVER
        assert session.running_calls == 1                      # the server: one long Exec call
        process = upstream.process
        assert process is not None and process.pid > 0
        await upstream.close()
        await upstream.close()                                  # idempotent
        assert upstream.state == "closed" and upstream.session is None
        assert process.ended.is_set() and process.result is not None   # the Exec call ended
        assert open_sessions(daemon, "echo") == []
        [closed] = [past for past in daemon.stub.ListSessions(pb.ListSessionsRequest(include_closed=True)).sessions
                    if past.id == session.id]
        assert closed.closed_at > 0 and closed.running_calls == 0
        with pytest.raises(UpstreamError, match="closing"):
            await upstream.call_tool("echo", {"text": "late"}, 30)
    run(daemon, scenario)


def test_two_upstreams_never_share_a_session(daemon: Daemon, sandboxd_daemon_module: DaemonFactory) -> None:
    one, two = sandboxd_daemon_module.workspace(), sandboxd_daemon_module.workspace()

    async def scenario(client: AsyncDaemon) -> None:
        first = Upstream(client, upstream_config("one", one), no_change)
        second = Upstream(client, upstream_config("two", two), no_change)
        try:
            await asyncio.gather(first.ensure_started(), second.ensure_started())
            assert first.session is not None and second.session is not None
            assert first.session.id != second.session.id
            assert text(await first.call_tool("write_file", {"path": "mine.txt", "text": "one's"}, 30)) == "written"
            assert (one / "mine.txt").read_text() == "one's"
            seen = await second.call_tool("read_file", {"path": "mine.txt"}, 30)
            assert seen.is_error and "No such file" in text(seen)
            # The control: the first sees its own file through the same tool.
            assert text(await first.call_tool("read_file", {"path": "mine.txt"}, 30)) == "read: one's"
            # Nor can the first write into the second's workspace (the kernel's wall), where the
            # second itself writes (the control).
            intrusion = await first.call_tool("write_file", {"path": str(two / "theirs.txt"), "text": "x"}, 30)
            assert intrusion.is_error and "Read-only file system" in text(intrusion)
            assert text(await second.call_tool("write_file", {"path": str(two / "theirs.txt"), "text": "2"}, 30)
                        ) == "written"
            assert (two / "theirs.txt").read_text() == "2"
        finally:
            await asyncio.gather(first.close(), second.close())
        assert open_sessions(daemon, "one") == open_sessions(daemon, "two") == []
    run(daemon, scenario)


def test_a_hung_call_times_out_and_the_upstream_is_told(daemon: Daemon, ws: Path) -> None:
    async def scenario(client: AsyncDaemon) -> None:
        upstream = Upstream(client, upstream_config("slow", ws, "slow"), no_change)
        try:
            with pytest.raises(UpstreamError, match=r"slow: tool hang timed out after 1 s"):
                await upstream.call_tool("hang", {}, 1)
            await eventually(lambda: (ws / "cancelled.log").exists(), "the upstream saw no notifications/cancelled")
            # The cancel names the hung call's own id (a direct request's: "gw-N"), and nothing waits on.
            [hung] = (ws / "hung.log").read_text().split()
            assert hung.startswith("gw-") and (ws / "cancelled.log").read_text().split() == [hung]
            assert upstream._direct is not None and upstream._direct.pending == 0
            # The upstream lives on: the same server answers the next call.
            pid = upstream.process.pid if upstream.process else 0
            assert text(await upstream.call_tool("echo", {"text": "after"}, 30)) == "echo: after"
            assert upstream.state == "ready" and upstream.process is not None and upstream.process.pid == pid
        finally:
            await upstream.close()
    run(daemon, scenario)


def test_a_flood_is_bounded_and_the_upstream_restarts(daemon: Daemon, ws: Path) -> None:
    async def scenario(client: AsyncDaemon) -> None:
        upstream = Upstream(client, upstream_config("flood", ws, "flood"), no_change)
        try:
            # A valid result over the gateway's 1 MiB: replaced by an error result saying so.
            big = await upstream.call_tool("big", {}, 60)
            assert big.is_error and "over the gateway's bound of 1 MiB" in text(big) and len(text(big)) < 1000
            # 1 MiB of stderr: only the tail is kept.
            assert text(await upstream.call_tool("noise", {}, 60)) == "noisy"
            first = upstream.process
            assert first is not None
            # (stderr and stdout are two streams: the tail may come after the answer)
            await eventually(lambda: first.stderr_lines(1) == "the last line of the noise", "no stderr tail")
            assert len(first.stderr_tail) == STDERR_TAIL_BYTES
            session_id = upstream.session.id if upstream.session else ""
            # A 10 MiB line: the transport stops at 4 MiB, the call fails, the server is ended.
            with pytest.raises(UpstreamError, match=f"over {MAX_MESSAGE_BYTES >> 20} MiB"):
                await upstream.call_tool("flood", {}, 60)
            assert upstream.state in ("restarting", "starting", "failed")
            # Started again (in the same session), and serving; the flooding server's call has ended.
            assert text(await upstream.call_tool("echo", {"text": "again"}, 60)) == "echo: again"
            assert upstream.process is not first and upstream.session is not None
            assert upstream.session.id == session_id
            await eventually(lambda: daemon.stub.GetSession(pb.GetSessionRequest(session_id=session_id)).running_calls
                             == 1, "the flooding server's Exec call did not end")
        finally:
            await upstream.close()
    run(daemon, scenario)


@pytest.mark.parametrize("wall", [True, False], ids=["bounded", "control-unbounded"])
def test_a_chatty_upstreams_notifications_are_bounded_in_rate(daemon: Daemon, ws: Path, wall: bool,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """An upstream's notifications past MAX_UNASKED_PER_SECOND a second are dropped (cheaply, unparsed),
    and its answer still arrives; the control (no rate bound) hands on every one of them. Past
    RESTART_UNASKED_PER_SECOND in one second the upstream is broken: its call fails, it restarts."""
    sent = 5 * MAX_UNASKED_PER_SECOND                      # more than the rate, below the restart rate
    assert sent <= RESTART_UNASKED_PER_SECOND
    if not wall:
        monkeypatch.setattr(exec_stdio, "MAX_UNASKED_PER_SECOND", 1 << 40)
        monkeypatch.setattr(exec_stdio, "RESTART_UNASKED_PER_SECOND", 1 << 40)

    async def scenario(client: AsyncDaemon) -> None:
        upstream = Upstream(client, upstream_config("chatty", ws, "chatty"), no_change)
        try:
            result = await upstream.call_tool("chatter", {"times": sent}, 60)
            assert text(result) == f"chattered {sent}" and not result.is_error
            process = upstream.process
            assert process is not None and process.unasked + process.dropped_unasked == sent
            if not wall:
                assert process.unasked == sent and process.dropped_unasked == 0
                return
            # Handed on: at most the rate per second the burst lasted (a burst of 500 lines spans at
            # least one whole window: something was dropped).
            assert process.dropped_unasked > 0 and process.unasked < sent
            # A flood far past the restart rate: the upstream is ended and started again.
            with pytest.raises(UpstreamError, match=f"over {RESTART_UNASKED_PER_SECOND} notifications"):
                await upstream.call_tool("chatter", {"times": 20 * RESTART_UNASKED_PER_SECOND}, 60)
            assert process.dropped_unasked > RESTART_UNASKED_PER_SECOND - MAX_UNASKED_PER_SECOND
            assert text(await upstream.call_tool("echo", {"text": "again"}, 60)) == "echo: again"
            assert upstream.process is not process
        finally:
            await upstream.close()
    run(daemon, scenario)


def test_concurrent_calls_answered_in_reverse_get_their_own_results(daemon: Daemon, ws: Path) -> None:
    """Three calls wait at once; the upstream answers them last first: each caller gets the answer
    to its own id (the direct path matches by id, not by order)."""
    async def scenario(client: AsyncDaemon) -> None:
        upstream = Upstream(client, upstream_config("ids", ws, "hostile-ids"), no_change)
        try:
            await upstream.ensure_started()
            results = await asyncio.gather(*(upstream.call_tool("hold", {"text": name, "times": 3}, 30)
                                             for name in ("a", "b", "c")))
            assert [text(result) for result in results] == ["held: a", "held: b", "held: c"]
            assert upstream.process is not None and upstream.process.stray_answers == 0
        finally:
            await upstream.close()
    run(daemon, scenario)


def test_an_exit_while_calls_wait_fails_each_with_its_status(daemon: Daemon, ws: Path) -> None:
    async def scenario(client: AsyncDaemon) -> None:
        upstream = Upstream(client, upstream_config("dies", ws, "hostile-ids"), no_change)
        try:
            await upstream.ensure_started()
            first = upstream.process
            outcomes = await asyncio.gather(*(upstream.call_tool("hold", {"text": name, "times": 2}, 30)
                                              for name in ("a", "exit")), return_exceptions=True)
            for outcome in outcomes:
                assert isinstance(outcome, UpstreamError), outcome
                assert "dies stopped: it exited with status 5" in str(outcome)
                assert "exiting with 2 calls waiting" in str(outcome)
            # Started again: served by a new server.
            assert text(await upstream.call_tool("echo", {"text": "again"}, 30)) == "echo: again"
            assert upstream.process is not first
        finally:
            await upstream.close()
    run(daemon, scenario)


def test_answers_nobody_waits_for_are_dropped_and_bounded(daemon: Daemon, ws: Path) -> None:
    """Answers to ids nobody asked (a "gw-" id of the upstream's making, an integer one, its own
    call's id a second time) are dropped, and a line nested too deep to parse is counted as not
    JSON-RPC: the call gets its own answer, the next call too, and the client session lives on. A flood of them past the restart rate breaks the upstream, restarted."""
    async def scenario(client: AsyncDaemon) -> None:
        upstream = Upstream(client, upstream_config("strays", ws, "hostile-ids"), no_change)
        try:
            assert text(await upstream.call_tool("stray", {"times": 3}, 30)) == "stray: first"
            process = upstream.process
            assert process is not None
            await eventually(lambda: process.stray_answers == 4, f"{process.stray_answers} stray answers counted")
            assert text(await upstream.call_tool("echo", {"text": "next"}, 30)) == "echo: next"
            assert (await upstream.read_resource("test://notes", 30)).contents[0].text == "read hostile-ids"
            assert upstream.process is process and process.invalid_lines == 1       # the one nested too deep
            with pytest.raises(UpstreamError, match=f"over {RESTART_UNASKED_PER_SECOND} notifications"):
                await upstream.call_tool("stray", {"times": 20 * RESTART_UNASKED_PER_SECOND}, 60)
            assert process.stray_answers > RESTART_UNASKED_PER_SECOND - MAX_UNASKED_PER_SECOND
            assert text(await upstream.call_tool("echo", {"text": "again"}, 60)) == "echo: again"
            assert upstream.process is not process
        finally:
            await upstream.close()
    run(daemon, scenario)


def test_an_answer_that_cannot_be_written_back_fails_its_call_only(daemon: Daemon, ws: Path) -> None:
    """A tools/call answer with a lone surrogate (json.loads and pydantic's validation take it; no
    serializer writes it back), an error whose message holds one, a structuredContent nested 900
    deep (validated; pydantic cannot serialize it) and 100 deep (within every parser; over the
    direct path's cap): each an error for its call, at once (not its timeout), and the same server
    serves the next call. The control: json.loads and validation do take each answer, its
    serialization fails (what ended the gateway), and the session's path (the SDK's parser)
    refuses them too."""
    import json

    from mcp_gateway_servers import deep_answer, surrogate_answer, surrogate_error

    for line in (surrogate_answer(1), deep_answer(1)):
        result = types.CallToolResult.model_validate(json.loads(line)["result"], by_name=False)
        with pytest.raises(ValueError, match="surrogates not allowed|depth"):
            result.model_dump_json(by_alias=True, exclude_none=True)
    for line in (surrogate_answer(1), surrogate_error(1), deep_answer(1)):
        assert exec_stdio._parse(line.encode()) is None, line
    assert exec_stdio._parse(deep_answer(1, 100).encode()) is not None     # the cap is the direct path's own

    async def scenario(client: AsyncDaemon) -> None:
        upstream = Upstream(client, upstream_config("writes", ws, "hostile-ids"), no_change)
        try:
            await upstream.ensure_started()
            process = upstream.process
            for tool, arguments, why in (("surrogate", {}, "not valid JSON"), ("surrogate_error", {}, "not valid JSON"),
                                         ("deep", {}, "not valid JSON"), ("deep", {"times": 100}, "nests more than 64")):
                with pytest.raises(UpstreamError, match=f"writes: tool {tool}: its answer is not valid MCP: .*{why}"):
                    await upstream.call_tool(tool, arguments, 600)
                assert text(await upstream.call_tool("echo", {"text": tool}, 30)) == f"echo: {tool}"
            assert upstream.process is process and upstream.state == "ready"
            # 50 deep (with the envelope, within the cap of 64) is taken, and written back whole.
            assert text(await upstream.call_tool("deep", {"times": 50}, 30)) == "deep"
        finally:
            await upstream.close()
    run(daemon, scenario)


def test_a_request_its_caller_left_mid_write_still_reaches_stdin_whole(daemon: Daemon, ws: Path) -> None:
    """A 16 MiB request (16 chunks of the Exec call's stdin) whose caller times out while the
    upstream reads nothing: the line is still written whole (else the next request is glued to a
    cut one: the server reads a line that is not JSON and exits), and the same server answers the
    next call."""
    async def scenario(client: AsyncDaemon) -> None:
        upstream = Upstream(client, upstream_config("cut", ws, "slow"), no_change)
        try:
            await upstream.ensure_started()
            process = upstream.process
            stall = asyncio.create_task(upstream.call_tool("stall", {"times": 3}, 60))
            await eventually(lambda: upstream._direct is not None and upstream._direct.pending == 1, "stall sent")
            with pytest.raises(UpstreamError, match="timed out after 1 s"):
                await upstream.call_tool("stall", {"times": 0, "text": "x" * (16 << 20)}, 1)
            assert text(await stall) == "stalled"
            assert text(await upstream.call_tool("echo", {"text": "after"}, 60)) == "echo: after"
            assert upstream.process is process and not process.ended.is_set(), process.why_ended()
        finally:
            await upstream.close()
    run(daemon, scenario)


def test_a_crash_fails_the_call_and_the_next_call_works(daemon: Daemon, ws: Path) -> None:
    changes: list[str] = []

    async def changed(kind: str) -> None:
        changes.append(kind)

    async def scenario(client: AsyncDaemon) -> None:
        upstream = Upstream(client, upstream_config("crashy", ws, "crash-after", "2"), changed)
        try:
            assert text(await upstream.call_tool("echo", {"text": "1"}, 30)) == "echo: 1"
            changes.clear()
            with pytest.raises(UpstreamError) as crash:
                await upstream.call_tool("echo", {"text": "2"}, 30)
            assert "exited with status 3" in str(crash.value)
            assert "crashing on call 2 as asked" in str(crash.value)
            first = upstream.process
            await eventually(lambda: upstream.tools == [] or upstream.process is not first, "its lists stayed")
            # The next call waits for the restart (back-off 1 s) and is served by a new server.
            assert text(await upstream.call_tool("echo", {"text": "3"}, 30)) == "echo: 3"
            assert upstream.state == "ready" and upstream.process is not first
            assert len(open_sessions(daemon, "crashy")) == 1       # its session was reused
            # Its lists went with it, and came back: a client's listing follows both ways.
            assert changes == ["prompts", "resources", "tools"] * 2
        finally:
            await upstream.close()
        assert open_sessions(daemon, "crashy") == []
    run(daemon, scenario)


def test_a_changed_tool_list_is_listed_again(daemon: Daemon, ws: Path) -> None:
    changes: list[str] = []

    async def changed(kind: str) -> None:
        changes.append(kind)

    async def scenario(client: AsyncDaemon) -> None:
        upstream = Upstream(client, upstream_config("lists", ws, "list-changes"), changed)
        try:
            await upstream.ensure_started()
            # Its first start changes every list it has (from nothing): a client that listed before learns of them.
            assert changes == ["prompts", "resources", "tools"]
            assert "extra" not in [tool.name for tool in upstream.tools]
            changes.clear()
            assert text(await upstream.call_tool("add_tool", {"text": "extra"}, 30)) == "added"
            await eventually(lambda: changes == ["tools"], f"no tools change reported: {changes}")
            assert "extra" in [tool.name for tool in upstream.tools]
            # 500 notifications at once: folded into a few listings, not 500 (one per interval at most).
            changes.clear()
            assert text(await upstream.call_tool("add_tool", {"text": "more", "times": 500}, 30)) == "added"
            await eventually(lambda: "more" in [tool.name for tool in upstream.tools], "no listing after the flood")
            await asyncio.sleep(0)
            assert 1 <= len(changes) < 50 and set(changes) == {"tools"}
        finally:
            await upstream.close()
    run(daemon, scenario)


def test_the_upstreams_own_requests_are_refused(daemon: Daemon, ws: Path) -> None:
    async def scenario(client: AsyncDaemon) -> None:
        upstream = Upstream(client, upstream_config("asks", ws, "asks"), no_change)
        try:
            answer = text(await upstream.call_tool("ask", {}, 30))
            assert upstream.process is not None and upstream.process.refused_requests == 3
        finally:
            await upstream.close()
        parts = sorted(answer.split("; "))
        assert [part.split(":")[0] for part in parts] == ["elicitation/create", "roots/list", "sampling/createMessage"]
        assert all(": error -32601 refused: the sandboxd gateway declares no client capability" in part
                   for part in parts), answer
    run(daemon, scenario)


def test_a_server_that_cannot_start_says_why(daemon: Daemon, ws: Path) -> None:
    async def scenario(client: AsyncDaemon) -> None:
        broken = UpstreamConfig(name="broken", command=(PY, "-c", "import sys; sys.stderr.write('no luck\\n'); "
                                                                   "sys.exit(7)"), workspace=str(ws))
        upstream = Upstream(client, broken, no_change)
        try:
            with pytest.raises(UpstreamError) as failure:
                await upstream.ensure_started()
            assert "exited with status 7" in str(failure.value) and "no luck" in str(failure.value)
            assert upstream.state == "failed"
        finally:
            await upstream.close()
        assert upstream.state == "closed" and open_sessions(daemon, "broken") == []
    run(daemon, scenario)


def test_a_session_the_daemon_refuses_is_said_not_retried(daemon: Daemon) -> None:
    """The daemon refuses the upstream's session (INVALID_ARGUMENT: here hide_home with the home as the
    workspace; so too a home that cannot be hidden): the caller is told why, and no runner starts it
    again on a timer (each call tries once). The control, the same server in a workspace elsewhere,
    starts: test_listed_called_and_closed_in_its_own_session."""
    home = Path(pwd.getpwuid(os.getuid()).pw_dir)

    async def scenario(client: AsyncDaemon) -> None:
        upstream = Upstream(client, upstream_config("refused", home), no_change)
        try:
            for _ in range(2):
                with pytest.raises(UpstreamError, match="INVALID_ARGUMENT.*hide_home"):
                    await upstream.ensure_started()
                assert upstream.state == "failed" and "hide_home" in upstream.last_error
                assert upstream._runner is None          # not restarting on a timer
        finally:
            await upstream.close()
        assert open_sessions(daemon, "refused") == []
    run(daemon, scenario)


def test_a_missing_credential_names_the_variable(daemon: Daemon, ws: Path) -> None:
    os.environ.pop("GATEWAY_TEST_TOKEN", None)

    async def scenario(client: AsyncDaemon) -> None:
        config = upstream_config("cred", ws, credentials=("GATEWAY_TEST_TOKEN=https://api.example.com",))
        upstream = Upstream(client, config, no_change)
        try:
            with pytest.raises(UpstreamError, match=r"\$GATEWAY_TEST_TOKEN is not set"):
                await upstream.ensure_started()
        finally:
            await upstream.close()
    run(daemon, scenario)


def test_the_fleet_starts_the_eager_ones_and_closes_all(daemon: Daemon, sandboxd_daemon_module: DaemonFactory) -> None:
    eager, lazy = sandboxd_daemon_module.workspace(), sandboxd_daemon_module.workspace()
    silent = UpstreamConfig(name="silent", command=(PY, "-c", "import time; time.sleep(600)"), workspace=str(eager))
    config = GatewayConfig(path="test", upstreams=(upstream_config("eager", eager), silent,
                                                   upstream_config("lazy", lazy, start="first_use")))

    async def scenario(client: AsyncDaemon) -> None:
        fleet = Fleet(client, config, lambda name, kind: no_change(kind))
        try:
            # start() returns with the upstream that never answers initialize still starting (behind).
            await fleet.start()
            assert fleet.upstreams["eager"].state == "ready" and fleet.upstreams["lazy"].state == "stopped"
            assert fleet.upstreams["silent"].state == "starting"
            assert open_sessions(daemon, "lazy") == []
            assert text(await fleet.upstreams["lazy"].call_tool("echo", {"text": "x"}, 30)) == "echo: x"
            assert len(open_sessions(daemon, "eager")) == len(open_sessions(daemon, "lazy")) == 1
        finally:
            await fleet.close()
        assert open_sessions(daemon, "eager") == open_sessions(daemon, "lazy") == open_sessions(daemon, "silent") == []
        assert {upstream.state for upstream in fleet.upstreams.values()} == {"closed"}
    run(daemon, scenario)


HTTP_SERVER = str(Path(__file__).resolve().parent / "mcp_gateway_http_server.py")


@contextlib.contextmanager
def http_mcp_server() -> Iterator[int]:
    """tests/mcp_gateway_http_server.py on a free loopback port, once it answers."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen([sys.executable, HTTP_SERVER, str(port)], stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60 * SLOW
        while True:
            assert server.poll() is None and time.monotonic() < deadline, "the HTTP MCP server did not start"
            with socket.socket() as attempt:
                if attempt.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.05)
        yield port
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_the_http_bridge_carries_mcp_outside_a_sandbox() -> None:
    """The control for a url upstream: the bridge, run unconfined, reaches the server and carries
    its tools and calls both ways."""
    async def scenario(port: int) -> tuple[list[str], str]:
        params = StdioServerParameters(command=sys.executable, args=[
            "-m", "sandboxd.mcp.gateway.http_bridge", f"http://localhost:{port}/mcp"], env={"PATH": "/usr/bin:/bin"})
        async with stdio_client(params, errlog=sys.__stderr__) as (read_stream, write_stream), \
                ClientSession(read_stream, write_stream) as session:
            await session.initialize()
            names = [tool.name for tool in (await session.list_tools()).tools]
            return names, text(await session.call_tool("echo", {"text": "hi"}))
    with http_mcp_server() as port:
        names, answer = asyncio.run(scenario(port))
    assert names == ["echo"] and answer == "echo over http: hi"


def test_a_url_upstream_connects_from_its_sandbox_and_not_to_the_hosts_loopback(daemon: Daemon, ws: Path) -> None:
    """A url upstream's connection leaves from its own session (its isolated network, the URL's host
    its only allowed domain), whose loopback is its own: the host's loopback server, which the
    control above reached through the same bridge, is out of reach."""
    async def scenario(client: AsyncDaemon, port: int) -> None:
        config = UpstreamConfig(name="remote", url=f"http://localhost:{port}/mcp", workspace=str(ws))
        upstream = Upstream(client, config, no_change)
        try:
            with pytest.raises(UpstreamError) as refused:
                await upstream.ensure_started()
            assert upstream.session is not None
            policy = upstream.session.sandbox_policy
            assert policy.network_mode == "isolated" and list(policy.allowed_domains) == ["localhost"]
            assert "remote stopped: it exited with status 1" in str(refused.value)
            assert f"http_bridge: http://localhost:{port}/mcp: ConnectError" in str(refused.value)
        finally:
            await upstream.close()
    with http_mcp_server() as port:
        run(daemon, lambda client: scenario(client, port))


def test_the_servers_environment_is_its_table_and_its_credential_a_phantom(daemon: Daemon, ws: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GATEWAY_TEST_TOKEN", "the-real-secret-value")
    monkeypatch.setenv("GATEWAY_TEST_PASSED", "passed on")
    monkeypatch.setenv("GATEWAY_TEST_KEPT", "not for the server")
    config = upstream_config("envs", ws, "env", credentials=("GATEWAY_TEST_TOKEN=https://api.example.com",),
                             env={"PLAIN": "from the table"}, pass_env=("GATEWAY_TEST_PASSED", "GATEWAY_TEST_UNSET"))

    async def scenario(client: AsyncDaemon) -> dict[str, str]:
        upstream = Fleet(client, GatewayConfig(path="test", upstreams=(config,)), lambda name, kind: no_change(kind),
                         variables).upstreams["envs"]
        try:
            await upstream.ensure_started()
            assert upstream.session is not None
            [state] = upstream.session.credential_states
            assert state.name == "GATEWAY_TEST_TOKEN" and state.usable
            return {name: text(await upstream.call_tool("getenv", {"text": name}, 30))
                    for name in ("PLAIN", "GATEWAY_TEST_PASSED", "GATEWAY_TEST_UNSET", "GATEWAY_TEST_KEPT",
                                 "GATEWAY_TEST_TOKEN")}
        finally:
            await upstream.close()
    variables = gateway_variables(GatewayConfig(path="test", upstreams=(config,)))
    assert variables == {"GATEWAY_TEST_TOKEN": "the-real-secret-value", "GATEWAY_TEST_PASSED": "passed on"}
    # Read at start: what the environment holds later (the gateway's own --credential flags take
    # their variables out of it) does not change what the upstream gets.
    monkeypatch.delenv("GATEWAY_TEST_TOKEN")
    monkeypatch.setenv("GATEWAY_TEST_PASSED", "changed later")
    seen = run(daemon, scenario)
    assert seen["PLAIN"] == "from the table" and seen["GATEWAY_TEST_PASSED"] == "passed on"
    assert seen["GATEWAY_TEST_UNSET"] == "unset" and seen["GATEWAY_TEST_KEPT"] == "unset"
    # Inside, the credential's variable holds a phantom, never the secret.
    assert seen["GATEWAY_TEST_TOKEN"] not in ("unset", "the-real-secret-value")



def test_a_url_upstream_in_a_full_access_session_is_served(daemon: Daemon, ws: Path) -> None:
    """The control inside the daemon: the same bridge in a danger-full-access session (the host's
    network as it is) reaches the server on the host's loopback and carries listings and calls."""
    async def scenario(client: AsyncDaemon, port: int) -> None:
        config = UpstreamConfig(name="remote", url=f"http://localhost:{port}/mcp", workspace=str(ws),
                                sandbox="danger-full-access")
        upstream = Upstream(client, config, no_change)
        try:
            await upstream.ensure_started()
            assert [tool.name for tool in upstream.tools] == ["echo"]
            assert text(await upstream.call_tool("echo", {"text": "x"}, 30)) == "echo over http: x"
            assert upstream.session is not None and upstream.session.labels["upstream"] == "remote"
        finally:
            await upstream.close()
    with http_mcp_server() as port:
        run(daemon, lambda client: scenario(client, port))


def test_a_listing_is_bounded(daemon: Daemon, ws: Path) -> None:
    async def scenario(client: AsyncDaemon) -> list[str]:
        upstream = Upstream(client, upstream_config("many", ws, "many"), no_change)
        try:
            await upstream.ensure_started()
            assert text(await upstream.call_tool("echo", {"text": "still"}, 30)) == "echo: still"
            return [tool.name for tool in upstream.tools]
        finally:
            await upstream.close()
    names = run(daemon, scenario)
    # 1,024 kept, in the upstream's order; the 100 KiB tool left out (over 64 KiB), not the rest.
    assert len(names) == MAX_LISTED and names[:3] == ["echo", "write_file", "read_file"]
    assert "huge" not in names and names[3] == "t0" and names[-1] == f"t{MAX_LISTED - 4}"


def test_the_private_workspace_is_made_and_a_planted_link_refused(daemon: Daemon,
                                                                   sandboxd_daemon_module: DaemonFactory,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    state = sandboxd_daemon_module.workspace()
    monkeypatch.setenv("XDG_STATE_HOME", str(state))
    private = Path(default_workspace("mine"))
    elsewhere = sandboxd_daemon_module.workspace()
    private.parent.mkdir(parents=True)
    private.symlink_to(elsewhere)                  # planted: the upstream would write `elsewhere`
    config = UpstreamConfig(name="mine", command=(PY, SERVER, "echo"), workspace=str(private))

    async def scenario(client: AsyncDaemon) -> None:
        upstream = Upstream(client, config, no_change)
        try:
            with pytest.raises(UpstreamError, match=r"its private directory .* needs .*/mine to be a directory of yours "
                                                    r"with mode 0700; it is a link or not a directory"):
                await upstream.ensure_started()
            assert upstream.session is None and open_sessions(daemon, "mine") == []
        finally:
            await upstream.close()
        # The control: without the link, the directory is made 0700 and the upstream served there.
        private.unlink()
        upstream = Upstream(client, config, no_change)
        try:
            assert text(await upstream.call_tool("write_file", {"path": "here", "text": "x"}, 30)) == "written"
        finally:
            await upstream.close()
    run(daemon, scenario)
    assert stat.S_IMODE(private.lstat().st_mode) == 0o700 and (private / "here").read_text() == "x"
    assert list(elsewhere.iterdir()) == []


def test_the_private_workspaces_parents_in_the_home_are_checked(daemon: Daemon,
                                                                 sandboxd_daemon_module: DaemonFactory,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Without XDG_STATE_HOME, ~/.local and ~/.local/state are checked too: one others may write (or
    a link) is refused before any session is opened; the control: fixed, the upstream is served."""
    home = sandboxd_daemon_module.workspace()
    home.chmod(0o755)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("XDG_STATE_HOME", raising=False)
    private = Path(default_workspace("mine"))
    assert private == home / ".local" / "state" / "sandboxd" / "gateway" / "mine"
    (home / ".local" / "state").mkdir(parents=True)
    (home / ".local" / "state").chmod(0o777)                 # others could plant sandboxd/ there
    config = UpstreamConfig(name="mine", command=(PY, SERVER, "echo"), workspace=str(private))

    async def scenario(client: AsyncDaemon) -> None:
        upstream = Upstream(client, config, no_change)
        try:
            with pytest.raises(UpstreamError, match=r"needs .*/\.local/state to be a directory of yours that only you "
                                                    r"may write; it is mode 777"):
                await upstream.ensure_started()
            assert upstream.session is None and open_sessions(daemon, "mine") == []
        finally:
            await upstream.close()
        assert not (home / ".local" / "state" / "sandboxd").exists()
        # A link for ~/.local/state itself: refused as well.
        (home / ".local" / "state").rmdir()
        elsewhere = sandboxd_daemon_module.workspace()
        (home / ".local" / "state").symlink_to(elsewhere)
        upstream = Upstream(client, config, no_change)
        try:
            with pytest.raises(UpstreamError, match=r"\.local/state to be .*; it is a link or not a directory"):
                await upstream.ensure_started()
        finally:
            await upstream.close()
        assert list(elsewhere.iterdir()) == []
        # The control: a real directory of yours, and the upstream is served there.
        (home / ".local" / "state").unlink()
        upstream = Upstream(client, config, no_change)
        try:
            assert text(await upstream.call_tool("write_file", {"path": "here", "text": "x"}, 30)) == "written"
        finally:
            await upstream.close()
    run(daemon, scenario)
    assert (private / "here").read_text() == "x" and stat.S_IMODE(private.stat().st_mode) == 0o700


def test_an_upstream_cannot_read_its_users_home(daemon: Daemon, ws: Path) -> None:
    """The upstream's session covers its owner's home (hide_home): the test server's read_file of a
    key there fails; the control, a session of the same user without it, reads the key."""
    secret_dir = Path(pwd.getpwuid(os.getuid()).pw_dir) / f".sbxd-gateway-test-{uuid.uuid4().hex[:8]}"
    secret_dir.mkdir(mode=0o700)
    key = secret_dir / "id_rsa"
    key.write_text("sbxt-gateway-home-secret\n")
    try:
        control = daemon.stub.CreateSession(pb.CreateSessionRequest(
            workspace=str(ws), sandbox_policy=pb.SandboxPolicy(mode=pb.SandboxPolicy.WORKSPACE_WRITE),
            approval_policy=pb.NEVER))
        try:
            outcome = run_exec(daemon.stub, control.id, ["cat", str(key)])
            assert outcome.stdout == b"sbxt-gateway-home-secret\n", outcome.describe()
        finally:
            close_quietly(daemon.stub, control.id)

        async def scenario(client: AsyncDaemon) -> types.CallToolResult:
            upstream = Upstream(client, upstream_config("homes", ws), no_change)
            try:
                await upstream.ensure_started()
                assert upstream.session is not None and upstream.session.sandbox_policy.hide_home
                return await upstream.call_tool("read_file", {"path": str(key)}, 30)
            finally:
                await upstream.close()
        seen = run(daemon, scenario)
        assert seen.is_error and "sbxt-gateway-home-secret" not in text(seen), text(seen)
    finally:
        key.unlink()
        secret_dir.rmdir()


def test_a_url_upstreams_bridge_must_be_outside_the_hidden_home(monkeypatch: pytest.MonkeyPatch) -> None:
    config = UpstreamConfig(name="remote", url="https://mcp.example.com/mcp", workspace="/srv/ws")
    start = exec_start(config, "session", {})
    assert start.argv[:4] == [sys.executable, "-m", "sandboxd.mcp.gateway.http_bridge", config.url]
    assert os.path.realpath(sys.executable) != os.path.expanduser("~/.venv/bin/python")
    monkeypatch.setattr(sys, "executable", os.path.expanduser("~/.venv/bin/python"))
    with pytest.raises(UpstreamError, match="inside your home, which the upstream's session hides"):
        exec_start(config, "session", {})


def test_close_ends_a_start_that_hangs(daemon: Daemon, ws: Path) -> None:
    """A server that never answers initialize: close() ends the try there (the waiting caller
    hears the gateway is closing, not the start's own 60 s timeout), and its call and session."""
    async def scenario(client: AsyncDaemon) -> None:
        silent = UpstreamConfig(name="silent", command=(PY, "-c", "import time; time.sleep(600)"), workspace=str(ws))
        upstream = Upstream(client, silent, no_change)
        starting = asyncio.ensure_future(upstream.ensure_started())
        await eventually(lambda: upstream.process is not None and upstream.process.pid > 0, "the server never ran")
        process = upstream.process
        assert upstream.state == "starting" and not starting.done()
        await upstream.close()
        with pytest.raises(UpstreamError, match="the gateway is closing"):
            await starting
        assert process is not None and process.ended.is_set()
        assert upstream.state == "closed" and open_sessions(daemon, "silent") == []
    run(daemon, scenario)


def test_the_bridge_sends_a_credential_only_to_its_origin() -> None:
    """A url upstream's credential goes as its header to the URL's https origin only, holding what
    the variable holds inside the sandbox (the phantom the proxy swaps for the secret)."""
    specs = ["TOKEN=https://mcp.example.com", "KEY=https://mcp.example.com:8443;x-api-key: {}",
             "BASIC=https://mcp.example.com;basic:me", "OTHER=https://api.example.org"]
    environ = {"TOKEN": "phantom-1", "KEY": "phantom-2", "BASIC": "phantom-3", "OTHER": "phantom-4"}
    assert credential_headers("https://mcp.example.com/mcp", specs, environ) == {"Authorization": "Bearer phantom-1"}
    assert credential_headers("https://mcp.example.com:8443/mcp", specs, environ) == {"x-api-key": "phantom-2"}
    assert credential_headers("http://mcp.example.com/mcp", specs, environ) == {}       # never over plain HTTP
    assert credential_headers("https://evil.example.net/mcp", specs, environ) == {}
