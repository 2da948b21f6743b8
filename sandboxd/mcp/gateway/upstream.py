"""One upstream MCP server in its own sandboxd session, and the Fleet of a gateway (skeleton)."""

from __future__ import annotations

from typing import Awaitable, Callable

import mcp.types as mcp_types

from sandboxd.mcp.daemon import Daemon
from sandboxd.mcp.gateway.config import GatewayConfig, UpstreamConfig
from sandboxd.v1 import sandboxd_pb2 as pb


class UpstreamError(Exception):
    """What went wrong with an upstream, for the model: printable, says what happened."""


class Upstream:
    def __init__(self, daemon: Daemon, config: UpstreamConfig, on_change: Callable[[str], Awaitable[None]]) -> None:
        self.name = config.name
        self.config = config
        self.session: pb.Session | None = None
        self.state = "stopped"
        self.tools: list[mcp_types.Tool] = []
        self.resources: list[mcp_types.Resource] = []
        self.prompts: list[mcp_types.Prompt] = []
        self._daemon = daemon
        self._on_change = on_change

    async def ensure_started(self) -> None:
        raise NotImplementedError

    async def call_tool(self, tool: str, arguments: dict, timeout: float) -> mcp_types.CallToolResult:
        raise NotImplementedError

    async def read_resource(self, uri: str, timeout: float) -> mcp_types.ReadResourceResult:
        raise NotImplementedError

    async def get_prompt(self, name: str, arguments: dict[str, str] | None, timeout: float) -> mcp_types.GetPromptResult:
        raise NotImplementedError

    async def close(self) -> None:
        raise NotImplementedError


class Fleet:
    def __init__(self, daemon: Daemon, config: GatewayConfig, on_change: Callable[[str, str], Awaitable[None]]) -> None:
        self.config = config
        self.upstreams: dict[str, Upstream] = {}
        self._daemon = daemon
        self._on_change = on_change

    async def start(self) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        raise NotImplementedError
