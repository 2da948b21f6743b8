"""`sandboxd mcp`: an MCP server that is a client of the daemon as the calling user.

catalog   the tools a model sees: names, descriptions (with the session's policy), JSON schemas
daemon    the daemon's asynchronous stub, session creation, denials read from a gRPC error
binding   one MCP connection's sandboxd session: its event watch (approvals, policy changes)
handlers  tools/list and tools/call, mapped onto the daemon's RPCs
gateway   `sandboxd mcp --gateway FILE`: upstream MCP servers, each in a session of its own, every
          call through the policy engine (its __init__ lists its modules)
The command line (flags, stdio and HTTP transports) is sandboxd/cli/mcp.py.
"""
