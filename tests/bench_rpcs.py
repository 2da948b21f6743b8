"""Both command RPCs as a gRPC runtime drives them, for the benchmarks (benchmark.py's daemon phase,
bench_idle.py's alone-and-among-N table).

Not a test (no ``test_`` in its name). ``RawCalls`` uses the generated stubs of sandboxd/v1 and
nothing of sandboxd.client, one channel per RPC (a runtime's client per call style):

* ``Exec``: the bidirectional stream, ``start`` as its only message and the request side closed
  after it (``iter([...])``), which is what a runtime does for a command without stdin;
* ``Run``: the server-streaming form, one ``ExecStart``.

Both run ``true`` and raise unless a result with exit status 0 came back. ``variants`` gives the
interleaved set the benchmarks time: the two RPCs, the same two after an idle pause (the first
cgroup join after a quiet moment waits for an RCU grace period in the kernel: what a call an
agent makes now and then pays, which back-to-back calls hide), a one-shot bwrap and a bare spawn.
"""

from __future__ import annotations

import random
import time
from typing import Any

from benchmark import BWRAP_ARGV, Variant, spawn_and_wait

# The idle time before each "after a pause" call: longer than the few scheduler ticks in which
# the kernel's rcu_sync of cgroup migrations goes back to idle (HZ=250 here: 4 ms a tick).
PAUSE_MS = 60.0
EXEC, RUN = "Exec stream (raw stub)", "Run (raw stub)"
EXEC_PAUSED, RUN_PAUSED = "Exec after a pause", "Run after a pause"
BWRAP, BARE = "bwrap one-shot", "bare exec /bin/true"


class RawCalls:
    """``true`` through Exec and Run with the generated stubs, each on a channel of its own."""

    def __init__(self, socket_path: str) -> None:
        import grpc

        from sandboxd.v1 import sandboxd_pb2 as pb
        from sandboxd.v1 import sandboxd_pb2_grpc as pb_grpc

        self._pb = pb
        self._channels = [grpc.insecure_channel(f"unix:{socket_path}") for _ in range(2)]
        self._exec, self._run = (pb_grpc.SandboxStub(channel) for channel in self._channels)

    def exec_true(self, session_id: str) -> None:
        start = self._pb.ExecStart(session_id=session_id, argv=["true"])
        _check("Exec", list(self._exec.Exec(iter([self._pb.ExecRequest(start=start)]))))

    def run_true(self, session_id: str) -> None:
        _check("Run", list(self._run.Run(self._pb.ExecStart(session_id=session_id, argv=["true"]))))

    def close(self) -> None:
        for channel in self._channels:
            channel.close()


def _check(rpc: str, responses: list[Any]) -> None:
    last = responses[-1] if responses else None
    if last is None or last.WhichOneof("kind") != "result" or last.result.shell_status != 0:
        raise RuntimeError(f"{rpc} true: no result with status 0 among {len(responses)} responses: {last}")


def variants(calls: RawCalls, session_id: str, devnull: int, pause_ms: float = PAUSE_MS) -> list[Variant]:
    """The interleaved set: bwrap first (the rows' reference), bare, both RPCs back to back, and
    both after ``pause_ms`` of idleness (``measure`` sleeps before them, outside their timing)."""
    out = [Variant(BWRAP, lambda: spawn_and_wait(BWRAP_ARGV, devnull)),
           Variant(BARE, lambda: spawn_and_wait(["/bin/true"], devnull)),
           Variant(EXEC, lambda: calls.exec_true(session_id)),
           Variant(RUN, lambda: calls.run_true(session_id))]
    if pause_ms > 0:
        out += [Variant(EXEC_PAUSED, lambda: calls.exec_true(session_id)),
                Variant(RUN_PAUSED, lambda: calls.run_true(session_id))]
    return out


def measure(variants_: list[Variant], runs: int, warmup: int, seed: int, pause_ms: float = PAUSE_MS) -> None:
    """``runs`` rounds after ``warmup``, each variant once per round in a shuffled order; a paused
    variant sleeps ``pause_ms`` first, outside its timing."""
    rng = random.Random(seed)
    for round_no in range(warmup + runs):
        order = list(variants_)
        rng.shuffle(order)
        for variant in order:
            if variant.name in (EXEC_PAUSED, RUN_PAUSED):
                time.sleep(pause_ms / 1000)
            variant.measure(round_no >= warmup)


def medians(variants_: list[Variant]) -> dict[str, float | None]:
    from benchmark import summarize

    return {v.name: (summarize(v.samples_ms) or {}).get("median_ms") for v in variants_}
