"""`sandboxd drain`: tell the daemon on a socket to drain (the Drain RPC: admins only), then wait
for it to exit; a restart or an upgrade that loses no running call, and a DaemonSet's preStop.

Why an RPC and not a signal: the RPC carries the timeout, needs no pid (a preStop hook or an
operator's shell in another PID namespace reaches the socket, not the process), and the daemon
decides who may ask (root or listen.admin_group, from SO_PEERCRED) as for every other call.
SIGTERM drains too (drain.shutdown = "drain"), with drain.timeout_seconds.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from sandboxd import defaults
from sandboxd.printable import printable

POLL_SECONDS = 0.5
# The wait for the daemon's exit goes this far past the drain's timeout (its stop: the sandboxes
# closed, the fork server stopped), then gives up, non-zero.
STOP_SECONDS = 60.0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sandboxd drain", description=(
        "Drain the daemon: it starts no new sessions or calls (clients get UNAVAILABLE with a retry hint, and "
        "sandboxctl and sandboxd mcp try again once the next daemon serves), lets running calls finish up to "
        "the timeout, kills those left (audited: drain_timeout), and exits. Waits for that exit."))
    p.add_argument("--socket", default="", help=f"the daemon's socket (default: ${defaults.SOCKET_ENV}, else "
                   f"{defaults.SOCKET})")
    p.add_argument("--timeout", type=float, default=0, metavar="SECONDS",
                   help="how long running calls may go on (default: the daemon's drain.timeout_seconds)")
    p.add_argument("--no-wait", action="store_true", help="return once the drain began")
    return p


def main(argv: list[str]) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from sandboxd.client import SandboxClient
    from sandboxd.v1 import sandboxd_pb2 as pb

    args = parser().parse_args(argv)
    socket_path = args.socket or os.environ.get(defaults.SOCKET_ENV) or defaults.SOCKET
    with SandboxClient(socket_path) as client:
        try:
            answer = client.stub.Drain(pb.DrainRequest(timeout_seconds=args.timeout), timeout=30)
        except grpc.RpcError as error:
            sys.stderr.write(f"sandboxd drain: {error.code().name}: {printable(error.details() or '')}\n")
            return 1
        print(f"draining {printable(socket_path)}: {answer.running_calls} calls running, up to "
              f"{answer.timeout_seconds:g} s", flush=True)
        if args.no_wait:
            return 0
        health = health_pb2_grpc.HealthStub(client.channel)
        deadline = time.monotonic() + answer.timeout_seconds + STOP_SECONDS
        while time.monotonic() < deadline:
            try:
                status = health.Check(health_pb2.HealthCheckRequest(service=""),  # type: ignore[attr-defined]
                                      timeout=10).status
            except grpc.RpcError:
                print("drained: the daemon exited", flush=True)      # its socket no longer answers
                return 0
            if status == health_pb2.HealthCheckResponse.SERVING:      # another daemon took the socket
                print("drained: another daemon serves on the socket", flush=True)
                return 0
            time.sleep(POLL_SECONDS)
    sys.stderr.write(f"sandboxd drain: the daemon still answers {answer.timeout_seconds + STOP_SECONDS:g} s later\n")
    return 1
