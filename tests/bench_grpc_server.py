"""What grpc itself costs per call, with no sandbox behind it (not a test: pytest does not collect it).

A server process answers the Sandbox service's Exec or Run with what a warm `Exec true` sends
(`started_pid`, then `result`) and does nothing else: no session, no fork server, no audit. The
client (this process, sandboxd's own grpc client) makes CALLS calls over a Unix socket. The CPU
time of both processes per call is grpc's framework cost for that RPC shape and server kind:

* ``sync``: grpc's thread-pool server, as `sandboxd serve` runs today (grpc.server with a
  ThreadPoolExecutor; each event passes from grpc's poll thread to a pool worker and back);
* ``aio``: a grpc.aio server on one asyncio loop (the handler is an async generator).

    .venv/bin/python tests/bench_grpc_server.py [CALLS] [ROUNDS]

prints, for each of sync/Exec, sync/Run, aio/Exec, aio/Run, interleaved in ROUNDS rounds, the
server's and the client's CPU ms per call and the wall ms per call.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent import futures
from typing import AsyncIterator, Iterator

import grpc

from sandboxd.v1 import sandboxd_pb2 as pb
from sandboxd.v1 import sandboxd_pb2_grpc as pb_grpc

TICK_S = 1 / os.sysconf("SC_CLK_TCK")
RESULT = pb.ExecResponse(result=pb.ExecResult(exit_code=0, wall_seconds=0.001))


class SyncServicer(pb_grpc.SandboxServicer):
    def Exec(self, request_iterator: Iterator[pb.ExecRequest], context: grpc.ServicerContext) -> Iterator[pb.ExecResponse]:
        next(request_iterator)
        yield pb.ExecResponse(started_pid=2)
        yield RESULT

    def Run(self, request: pb.ExecStart, context: grpc.ServicerContext) -> Iterator[pb.ExecResponse]:
        yield pb.ExecResponse(started_pid=2)
        yield RESULT


class AioServicer(pb_grpc.SandboxServicer):
    async def Exec(self, request_iterator: AsyncIterator[pb.ExecRequest],  # type: ignore[override]
                   context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ExecResponse]:
        async for _ in request_iterator:
            break
        yield pb.ExecResponse(started_pid=2)
        yield RESULT

    async def Run(self, request: pb.ExecStart,  # type: ignore[override]
                  context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ExecResponse]:
        yield pb.ExecResponse(started_pid=2)
        yield RESULT


def serve(kind: str, socket: str) -> None:
    if kind == "sync":
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        pb_grpc.add_SandboxServicer_to_server(SyncServicer(), server)
        server.add_insecure_port(f"unix:{socket}")
        server.start()
        print("ready", flush=True)
        server.wait_for_termination()
        return

    async def main() -> None:
        server = grpc.aio.server()
        pb_grpc.add_SandboxServicer_to_server(AioServicer(), server)
        server.add_insecure_port(f"unix:{socket}")
        await server.start()
        print("ready", flush=True)
        await server.wait_for_termination()
    asyncio.run(main())


def process_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * TICK_S


def measure(kind: str, rpc: str, calls: int, directory: str) -> tuple[float, float, float]:
    """(server CPU ms, client CPU ms, wall ms) per call."""
    socket = os.path.join(directory, f"{kind}.sock")
    server = subprocess.Popen([sys.executable, __file__, "--serve", kind, socket], stdout=subprocess.PIPE)
    try:
        assert server.stdout is not None and server.stdout.readline() == b"ready\n"
        start = pb.ExecStart(session_id="s", argv=["true"], close_stdin=True)
        with grpc.insecure_channel(f"unix:{socket}") as channel:
            stub = pb_grpc.SandboxStub(channel)

            def one() -> None:
                responses = (stub.Run(start) if rpc == "Run" else stub.Exec(iter([pb.ExecRequest(start=start)])))
                assert [r.WhichOneof("kind") for r in responses] == ["started_pid", "result"]
            for _ in range(50):
                one()
            server_before, client_before, began = process_cpu_s(server.pid), os.times(), time.perf_counter()
            for _ in range(calls):
                one()
            wall = time.perf_counter() - began
            client_after, server_after = os.times(), process_cpu_s(server.pid)
        client = (client_after.user - client_before.user) + (client_after.system - client_before.system)
        return ((server_after - server_before) / calls * 1000, client / calls * 1000, wall / calls * 1000)
    finally:
        server.send_signal(signal.SIGKILL)
        server.wait()


def main(argv: list[str]) -> int:
    if argv[:1] == ["--serve"]:
        serve(argv[1], argv[2])
        return 0
    calls = int(argv[0]) if argv else 2000
    rounds = int(argv[1]) if len(argv) > 1 else 3
    cases = [("sync", "Exec"), ("sync", "Run"), ("aio", "Exec"), ("aio", "Run")]
    totals: dict[tuple[str, str], list[tuple[float, float, float]]] = {case: [] for case in cases}
    print(f"grpc framework cost per call, {calls} calls x {rounds} rounds; loadavg {os.getloadavg()}")
    with tempfile.TemporaryDirectory(prefix="sbxd-grpcbench-") as directory:
        for _ in range(rounds):
            for case in cases:
                totals[case].append(measure(*case, calls, directory))
    print(f"{'server/RPC':<12} | {'server CPU ms':>13} | {'client CPU ms':>13} | {'wall ms':>8}   (median of rounds)")
    for case, samples in totals.items():
        server_ms, client_ms, wall_ms = (sorted(column)[len(column) // 2] for column in zip(*samples, strict=True))
        print(f"{case[0] + '/' + case[1]:<12} | {server_ms:13.3f} | {client_ms:13.3f} | {wall_ms:8.3f}")
    print(f"loadavg at end {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
