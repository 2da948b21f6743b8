"""What a surviving supervisor keeps of each call for the next daemon (fork_protocol.Call.tag): who
the call is in the daemon's own records, as a small JSON object of strings. ``exec``: a
ToolInvocation (its audit call id and tool); ``background``: a background process (its job id and
name). The supervisor only stores and returns it (at most fork_server.MAX_TAG characters)."""

from __future__ import annotations

import json

NAME_CHARS = 80                  # a background process's name kept (BackgroundJob names are at most that)


def call_tag(call_id: str, tool: str) -> str:
    return json.dumps({"kind": "exec", "call": call_id, "tool": tool}, separators=(",", ":"))


def background_tag(job_id: str, name: str) -> str:
    return json.dumps({"kind": "background", "job": job_id, "name": name[:NAME_CHARS]}, separators=(",", ":"))


def parse_tag(text: str) -> dict[str, str]:
    """A tag's fields (strings only); {} for none or one this daemon cannot read."""
    try:
        value = json.loads(text) if text else {}
    except ValueError:
        return {}
    if not isinstance(value, dict):
        return {}
    return {key: item for key, item in value.items() if isinstance(key, str) and isinstance(item, str)}
