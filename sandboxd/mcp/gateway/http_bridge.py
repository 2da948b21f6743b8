"""``python -m sandboxd.mcp.gateway.http_bridge URL [--credential SPEC ...]``: the MCP stdio
transport on one side, the SDK's streamable HTTP client to URL on the other.

A ``url`` upstream is reached by this bridge run INSIDE the upstream's own sandboxd session, as its
server command would be: the connection then leaves through that session's network (its egress
proxy, its allowed domains, its credentials), never from the gateway's own process, which runs
unconfined as the user. A credential whose upstream is the URL's origin is sent as its header with
the variable's value, which inside the sandbox is the phantom the proxy swaps for the secret.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from urllib.parse import urlsplit

import anyio
import mcp_types as types
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client
from mcp.shared.message import SessionMessage

from sandboxd.errors import InvalidPolicy
from sandboxd.policy.network import HTTPS_PORT, parse_credential
from sandboxd.printable import printable

MAX_LINE_BYTES = 4 << 20             # as the gateway's side of the transport (exec_stdio)


def credential_headers(url: str, specs: list[str], environ: "os._Environ[str] | dict[str, str]") -> dict[str, str]:
    """The headers of the credentials whose upstream is ``url``'s origin (https only)."""
    parts = urlsplit(url)
    headers = {}
    for text in specs:
        spec = parse_credential(text)
        if (parts.scheme == "https" and parts.hostname == spec.host and (parts.port or HTTPS_PORT) == spec.port
                and spec.basic_user is None and spec.name in environ):
            headers[spec.header] = spec.template.replace("{}", environ[spec.name])
    return headers


async def bridge(url: str, headers: dict[str, str]) -> None:
    stdout = anyio.wrap_file(sys.stdout.buffer)
    async with create_mcp_http_client(headers=headers) as http, \
            streamable_http_client(url, http_client=http) as (read_stream, write_stream):
        async with anyio.create_task_group() as tasks:
            async def to_server() -> None:
                # An asyncio pipe reader, not a thread: a thread blocked in read() would keep the
                # bridge alive after its connection failed.
                stdin = asyncio.StreamReader(limit=MAX_LINE_BYTES)
                await asyncio.get_running_loop().connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdin),
                                                                   sys.stdin)
                while True:
                    try:
                        line = await stdin.readline()
                    except ValueError:
                        break                                  # over the bound: the gateway broke the transport
                    if not line:
                        break                                  # stdin closed: the gateway is done
                    if line.strip():
                        try:
                            message = types.jsonrpc_message_adapter.validate_json(line, by_name=False)
                        except ValueError:
                            continue
                        await write_stream.send(SessionMessage(message))
                tasks.cancel_scope.cancel()

            async def to_gateway() -> None:
                async for item in read_stream:
                    if isinstance(item, Exception):
                        # Which request it failed is not known: end the bridge, so that the gateway
                        # fails the pending calls with this (its stderr) and starts it again, rather
                        # than each waiting out its timeout.
                        raise item
                    await stdout.write(item.message.model_dump_json(by_alias=True, exclude_unset=True).encode()
                                       + b"\n")
                    await stdout.flush()
                tasks.cancel_scope.cancel()

            tasks.start_soon(to_server)
            tasks.start_soon(to_gateway)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m sandboxd.mcp.gateway.http_bridge")
    parser.add_argument("url")
    parser.add_argument("--credential", action="append", default=[], metavar="VAR=https://HOST[;...]")
    args = parser.parse_args(argv)
    try:
        headers = credential_headers(args.url, args.credential, os.environ)
        anyio.run(bridge, args.url, headers)
    except InvalidPolicy as exc:
        sys.stderr.write(f"http_bridge: {printable(str(exc))}\n")
        return 2
    except Exception as exc:  # noqa: BLE001 - the gateway reads the reason from stderr's last lines
        while isinstance(exc, ExceptionGroup):
            exc = exc.exceptions[0]
        sys.stderr.write(f"http_bridge: {printable(args.url)}: {printable(type(exc).__name__)}: "
                         f"{printable(str(exc))[:1000]}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
