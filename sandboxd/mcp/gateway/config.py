"""The gateway file: TOML, one `[upstreams.NAME]` table per upstream MCP server (skeleton)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType


class GatewayConfigError(ValueError):
    """A gateway file that cannot be used: the message names the file, the table and the key, and
    says what to fix."""


@dataclass(frozen=True)
class ToolOverride:
    effect: str | None = None
    risk: str | None = None


@dataclass(frozen=True)
class UpstreamConfig:
    name: str
    command: tuple[str, ...] = ()
    url: str = ""
    sandbox: str = "workspace-write"
    workspace: str = ""
    writable_roots: tuple[str, ...] = ()
    network: bool = False
    allow_domains: tuple[str, ...] = ()
    credentials: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    pass_env: tuple[str, ...] = ()
    trusted: bool = False
    tools: Mapping[str, ToolOverride] = field(default_factory=lambda: MappingProxyType({}))
    timeout_seconds: float = 120.0
    start: str = "gateway"


@dataclass(frozen=True)
class GatewayConfig:
    path: str
    upstreams: tuple[UpstreamConfig, ...]


def load(path: str) -> GatewayConfig:
    raise NotImplementedError
