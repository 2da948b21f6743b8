"""The MCP stdio transport over one `Exec` call (skeleton)."""

from __future__ import annotations

MAX_MESSAGE_BYTES = 4 << 20
STDERR_TAIL_BYTES = 64 << 10
