"""`sandboxd mcp --gateway FILE`: one MCP server in front of the upstream MCP servers a TOML file
names, each run in its own sandboxd session of the calling user, every call through the daemon's
policy engine (docs/mcp.md, "The gateway").

config      the gateway file (TOML) -> GatewayConfig, strict: a typo is an error, never a weaker wall
exec_stdio  the MCP stdio transport over one long `Exec` call in an upstream's session
http_bridge a url upstream: stdio <-> streamable HTTP, run inside the upstream's own session
upstream    one upstream (its session, its server, its MCP client session, restarts) and the Fleet
naming      exposed names (UPSTREAM__tool) <-> the upstream's own names
effects     each upstream tool's effect and risk, and what a permission mode hides
authorize   the arguments redacted and bounded, Authorize and ReportToolResult around each call
router      the Fleet joined to sandboxd/mcp/handlers.py (tools, resources, prompts, list_changed)
"""
