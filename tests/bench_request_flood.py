"""The request floods of issue 24 (part 3) with the daemon's default settings, timed from a
bystander's side (not a test module: pytest does not collect it; tests/test_request_floods.py
holds the assertions).

A plain user mounts a FUSE file system that never answers and sends FLOOD requests at once that
wait on it (``rule``: AddStandingRule naming a workspace there; ``policy``: UpdateSessionPolicy
giving its own session a writable root there). Another plain user calls ListSessions in a loop
for WINDOW seconds from the moment the flood is in: how long each call took, the first one
especially (behind the flood, if the flood holds the workers).

    .venv/bin/python tests/bench_request_flood.py rule|policy|quiet [FLOOD [WINDOW]]

``quiet`` sends the rule flood on a directory of the attacker's own (answers at once): the
control flood. Set SANDBOXD_BENCH_SOURCE=DIR to run the daemon from another checkout's
``sandboxd`` package (e.g. main's, exported with ``git archive``): the clients are this one's.
The attacker's requests give up after WINDOW + 20 s on its side (on main the daemon's workers
keep waiting; the daemon is stopped at the end).
"""

from __future__ import annotations

import json
import os
import stat
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from daemon_helpers import Daemon, PlainUser, make_base_dir, plain_users, remove_tree, run_client_as  # noqa: E402
from test_hung_fs import HungMount, owned_dir  # noqa: E402

ATTACK = r'''
import time
hung = ARGS["hung"]
if ARGS["kind"] == "policy":
    session = stub.CreateSession(pb.CreateSessionRequest(workspace=ARGS["ws"], approval_policy=pb.NEVER),
                                 timeout=120).id
    roots = pb.SandboxPolicy(mode=pb.SandboxPolicy.WORKSPACE_WRITE, writable_roots=[hung + "/root"])
    request = lambda: stub.UpdateSessionPolicy.future(pb.UpdateSessionPolicyRequest(
        session_id=session, sandbox_policy=roots), timeout=ARGS["give_up"])
else:
    request = lambda: stub.AddStandingRule.future(pb.StandingRule(
        workspace=hung if ARGS["kind"] == "quiet" else hung + "/ws", tool="fs.list"), timeout=ARGS["give_up"])
calls = [request() for _ in range(ARGS["count"])]
with open(ARGS["flag"], "w") as f:
    f.write("in")
codes = {}
for call in calls:
    call.exception()
    codes[call.code().name] = codes.get(call.code().name, 0) + 1
print(json.dumps({"codes": codes}))
'''

BYSTANDER = r'''
import time
def listed():
    started = time.monotonic()
    stub.ListSessions(pb.ListSessionsRequest(), timeout=300)
    return time.monotonic() - started
baseline = [listed() for _ in range(20)]
with open(ARGS["ready"], "w") as f:
    f.write("ready")
while not os.path.exists(ARGS["flag"]):
    time.sleep(0.005)
during, until = [], time.monotonic() + ARGS["window"]
while time.monotonic() < until:
    during.append(listed())
    time.sleep(0.02)
print(json.dumps({"baseline": baseline, "during": during}))
'''


def main() -> None:
    kind = sys.argv[1]
    count = int(sys.argv[2]) if len(sys.argv) > 2 else 400
    window = float(sys.argv[3]) if len(sys.argv) > 3 else 8.0
    source = os.environ.get("SANDBOXD_BENCH_SOURCE")
    base = make_base_dir("sbxflood-")
    daemon = Daemon(base, env={"PYTHONPATH": source} if source else None)
    mount: HungMount | None = None
    fuse_mode = stat.S_IMODE(os.stat("/dev/fuse").st_mode)
    os.chmod("/dev/fuse", 0o666)                  # as test_hung_fs's fixture: what a plain user needs to mount
    try:
        daemon.start()
        with plain_users(2) as (attacker, bystander):
            mount = HungMount("fusermount3", attacker, owned_dir(base, attacker, f"fuse-{uuid.uuid4().hex[:6]}"))
            quiet = owned_dir(base, attacker)
            result = flood(daemon, attacker, bystander, kind, str(quiet) if kind == "quiet" else mount.path,
                           count, window)
            mount.release()
            mount = None
            daemon.close()
    finally:
        if mount is not None:
            mount.release()
        if daemon.proc is not None and daemon.proc.poll() is None:
            daemon.close()
        os.chmod("/dev/fuse", fuse_mode)
        remove_tree(base)
    print(json.dumps(result, indent=1))


def flood(daemon: Daemon, attacker: PlainUser, bystander: PlainUser, kind: str, path: str, count: int,
          window: float) -> dict[str, Any]:
    flag, ready = owned_dir(daemon.base, attacker) / "in", owned_dir(daemon.base, bystander) / "ready"
    seen: dict[str, Any] = {}
    watcher = threading.Thread(target=lambda: seen.update(run_client_as(
        bystander.uid, bystander.gid, daemon.socket, BYSTANDER,
        {"flag": str(flag), "ready": str(ready), "window": window}, timeout=900)))
    watcher.start()
    while not ready.exists():
        time.sleep(0.01)
    attack = run_client_as(attacker.uid, attacker.gid, daemon.socket, ATTACK,
                           {"kind": kind, "hung": path, "ws": str(owned_dir(daemon.base, attacker)), "flag": str(flag),
                            "count": count, "give_up": window + 20}, timeout=900)
    watcher.join(900)
    during = seen["during"]
    return {"kind": kind, "flood": count, "attacker": attack["codes"], "load": os.getloadavg(),
            "baseline_p50_s": round(statistics.median(seen["baseline"]), 4),
            "first_call_s": round(during[0], 4), "calls_in_window": len(during),
            "p50_s": round(statistics.median(during), 4), "max_s": round(max(during), 4)}


if __name__ == "__main__":
    main()
