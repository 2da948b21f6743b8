"""A small stdio MCP server (the `mcp` SDK's MCPServer) that does what a third-party server
fetched by `npx -y` could do with its user's rights: read files, write files, open connections,
read its environment, leave a process behind. tests/test_mcp_recipe.py runs it with and without
`sandboxd run` around it. Every tool reports what happened as text, never raises: the test reads
the outcome (an errno name, an HTTP status) from the result."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import urllib.error
import urllib.request

from mcp.server.mcpserver import MCPServer

server = MCPServer("recipe-probe")


@server.tool()
def read_file(path: str) -> str:
    """Read a text file."""
    try:
        with open(path) as f:
            return "read: " + f.read()
    except OSError as exc:
        return _errno(exc)


@server.tool()
def write_file(path: str, text: str) -> str:
    """Write a text file."""
    try:
        with open(path, "w") as f:
            f.write(text)
        return "written"
    except OSError as exc:
        return _errno(exc)


@server.tool()
def fetch(url: str) -> str:
    """GET a URL the way most servers do (urllib honours HTTP_PROXY / HTTPS_PROXY)."""
    try:
        with urllib.request.urlopen(url, timeout=10) as reply:
            return "open: " + reply.read().decode()
    except urllib.error.HTTPError as exc:
        return f"http {exc.code}"
    except OSError as exc:
        return _errno(exc)


@server.tool()
def fetch_with_token(url: str, variable: str) -> str:
    """GET a URL with ``Authorization: Bearer $variable``, as a server calling its API does."""
    request = urllib.request.Request(url, headers={"Authorization": "Bearer " + os.environ.get(variable, "")})
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return "open: " + reply.read().decode()
    except urllib.error.HTTPError as exc:
        return f"http {exc.code}"
    except OSError as exc:
        return _errno(exc)


@server.tool()
def connect(host: str, port: int) -> str:
    """Open a TCP connection directly, ignoring any proxy."""
    try:
        socket.create_connection((host, port), timeout=3).close()
        return "open"
    except OSError as exc:
        return _errno(exc)


@server.tool()
def environment() -> str:
    """The server's environment and who it runs as."""
    return json.dumps({"env": dict(os.environ), "uid": os.getuid()})


@server.tool()
def leave_behind(marker: str) -> str:
    """Start a process that outlives this call (and would outlive the server, unsandboxed)."""
    child = subprocess.Popen([marker, "600"], executable="/bin/sleep", start_new_session=True,
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return f"started {child.pid}"


def _errno(exc: OSError) -> str:
    import errno
    if exc.errno is None and isinstance(exc.args[0] if exc.args else None, OSError):
        exc = exc.args[0]                                     # urllib's URLError wraps the socket's
    reason = getattr(exc, "reason", None)
    if isinstance(reason, OSError):
        exc = reason
    return "error: " + (errno.errorcode.get(exc.errno or 0) or type(exc).__name__)


if __name__ == "__main__":
    server.run("stdio")
