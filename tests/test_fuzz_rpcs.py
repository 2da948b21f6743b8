"""Every RPC of sandboxd.v1.Sandbox, fed random requests by a plain user (tests/fuzz_client.py,
hypothesis, messages built from their descriptors: integers at their extremes, NaN and
infinities, strings with NULs and megabytes long, repeated and nested fields, unknown enum
values, real session ids mixed in). Nothing may end in INTERNAL or UNKNOWN, the daemon and its
fork server keep their pids, and a normal Exec still works after each batch.

SANDBOXD_FUZZ_EXAMPLES (examples per RPC and batch, default 40) and SANDBOXD_FUZZ_BATCHES
(default 2) make a longer run; tests/benchmark.py --fuzz sets them for one.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from conftest import BASE_ENV
from daemon_helpers import PYTHON, close_quietly, create_session, read_only, running_daemon, run_exec
from plain_users import plain_user
from sandboxd.v1 import sandboxd_pb2 as pb

EXAMPLES = int(os.environ.get("SANDBOXD_FUZZ_EXAMPLES", "40"))
BATCHES = int(os.environ.get("SANDBOXD_FUZZ_BATCHES", "2"))
CLIENT = Path(__file__).with_name("fuzz_client.py")


def fuzz_batch(socket: str, uid: int, gid: int, workspace: str, examples: int) -> dict[str, object]:
    args = json.dumps({"uid": uid, "gid": gid, "socket": socket, "workspace": workspace, "examples": examples})
    # As root with -c: the client imports everything, then drops to the plain user itself.
    proc = subprocess.run([PYTHON, "-c", CLIENT.read_text(), args], capture_output=True, text=True,
                          timeout=max(900, examples * 60),
                          env={**BASE_ENV, "PYTHONPATH": str(CLIENT.parent)}, cwd="/")
    assert proc.returncode == 0 and proc.stdout.strip(), (
        f"fuzz client failed: exit={proc.returncode}\nstdout={proc.stdout[-3000:]}\nstderr={proc.stderr[-5000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(max(300, EXAMPLES * BATCHES * 15))
def test_random_requests_to_every_rpc_never_break_the_daemon() -> None:
    # The user outlives the daemon: stopping it ends the user's sandboxes, then userdel works.
    with plain_user() as (uid, gid), running_daemon("sbxfuzz-") as daemon:
        fork_pid = daemon.fork_server_pid()
        assert fork_pid is not None
        workspace = daemon.base / "ws"
        workspace.mkdir()
        (workspace / "f.txt").write_text("hello\n")
        (workspace / "sub").mkdir()
        os.mkfifo(workspace / "fifo")
        for path in (workspace, workspace / "f.txt", workspace / "sub", workspace / "fifo"):
            os.chown(path, uid, gid)
        control_ws = daemon.base / "control"
        control_ws.mkdir()
        control = create_session(daemon.stub, control_ws, read_only())
        total = 0
        try:
            for batch in range(BATCHES):
                outcome = fuzz_batch(daemon.socket, uid, gid, str(workspace), EXAMPLES)
                print(json.dumps({k: outcome[k] for k in ("calls", "codes", "by_method")}))
                assert outcome["failures"] == [], json.dumps(outcome["failures"], indent=1)[:8000]
                assert daemon.proc is not None and daemon.proc.poll() is None, daemon.log()
                assert daemon.fork_server_pid() == fork_pid, "the fork server was replaced or died"
                total += int(outcome["calls"])  # type: ignore[call-overload]
                normal = run_exec(daemon.stub, control.id, ["sh", "-c", "echo still-working"])
                assert normal.result is not None and normal.result.exit_code == 0, normal.describe()
                assert normal.stdout == b"still-working\n"
        finally:
            close_quietly(daemon.stub, control.id)
        # Every RPC was reached, with EXAMPLES requests each (GetStatus has no field: one is enough).
        methods = {m.name for m in pb.DESCRIPTOR.services_by_name["Sandbox"].methods}
        assert set(outcome["seconds"]) == methods  # type: ignore[call-overload]
        assert total >= BATCHES * EXAMPLES * (len(methods) - 1) // 2   # hypothesis stops early on small spaces


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
