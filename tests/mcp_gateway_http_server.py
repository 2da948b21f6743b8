"""A small streamable-HTTP MCP server (the SDK's MCPServer) for the gateway's url upstreams:
``python mcp_gateway_http_server.py PORT`` serves http://127.0.0.1:PORT/mcp with one tool, echo."""

from __future__ import annotations

import sys

from mcp.server.mcpserver import MCPServer

server = MCPServer("gateway-http-test")


@server.tool()
def echo(text: str) -> str:
    """Say it back."""
    return "echo over http: " + text


if __name__ == "__main__":
    server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[1]))
