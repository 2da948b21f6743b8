"""Every RPC counts against its caller (issue 24, part 3): floods of requests that wait on a path.

A plain user (the attacker) mounts a FUSE file system whose server never answers
(test_hung_fs.HungMount) and sends 400 requests at once, each of which makes the daemon look up
a path under that mount as the attacker, which waits ``fork_server.wait_seconds``: AddStandingRule
naming a workspace there (the rule flood), and UpdateSessionPolicy giving its own session a
writable root there (the policy flood: each waits for the session's build lock, then for the
path). Before, only running calls and streams were counted: the 400 held all 128 workers three
rounds in a row and another user's ListSessions waited 26.9 s. Now every RPC holds a slot of its
caller's (service/quotas.py): past ``quotas.requests_per_uid`` requests in progress the next one
ends at once with RESOURCE_EXHAUSTED naming that key, so the flood holds at most that many workers
(GetStatus's ``workers_busy``, sampled throughout, says so), and another plain user (the
bystander) is served while the admitted requests still hang. The same for server reflection
streams (a stream waits on its client: it counts as one of the caller's streams).

Controls: the admitted requests really hang (each ends DEADLINE_EXCEEDED naming the path after
``wait_seconds``), and local root, which no per-owner bound holds, floods its own hung mount: its
requests then take every worker but the first-slot share (what any flood did before), and the
bystander, with nothing in progress, is served from that share. No timed assertion: "served"
means its call returned while the flood's admitted requests were still hanging. The latencies
are printed (docs/hardening-round-4.md quotes them with the default settings).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest

from daemon_helpers import Daemon, DaemonFactory, PlainUser, plain_users, run_client_as
from sandboxd.v1 import sandboxd_pb2 as pb
from sandboxd.v1 import sandboxd_pb2_grpc as pb_grpc
from test_hung_fs import HungMount, owned_dir
from user_fuse import fuse_for_users  # noqa: F401 - a fixture

pytestmark = pytest.mark.timeout(600)

FLOOD = 400                         # requests sent at once, as in the issue
WAIT_SECONDS = 5.0                  # the daemon's fork_server.wait_seconds here
# A daemon of 32 workers (8 reserved): a pool of 24, a first-slot share of 3; 4 owners at 3 calls,
# 2 streams and 2 requests hold 28 of the 32 workers.
WORKERS, RESERVED, CALLS, STREAMS, REQUESTS = 32, 8, 3, 2, 2
SHARE = (WORKERS - RESERVED) // 8
CONFIG = f"""
[listen]
workers = {WORKERS}
[quotas]
reserved_workers = {RESERVED}
calls_per_uid = {CALLS}
streams_per_uid = {STREAMS}
requests_per_uid = {REQUESTS}
[fork_server]
wait_seconds = {WAIT_SECONDS}
"""

# The attacker (or root, the control): FLOOD requests at once on the hung path, then a flag file;
# each one's outcome and when it ended.
ATTACK = r'''
import threading, time
def rule():
    return stub.AddStandingRule.future(pb.StandingRule(workspace=ARGS["hung"] + "/ws", tool="fs.list"), timeout=600)
session = None
if ARGS["kind"] == "policy":
    session = stub.CreateSession(pb.CreateSessionRequest(workspace=ARGS["ws"], approval_policy=pb.NEVER),
                                 timeout=120).id
    roots = pb.SandboxPolicy(mode=pb.SandboxPolicy.WORKSPACE_WRITE, writable_roots=[ARGS["hung"] + "/root"])
    def request():
        return stub.UpdateSessionPolicy.future(pb.UpdateSessionPolicyRequest(session_id=session,
                                                                             sandbox_policy=roots), timeout=600)
else:
    request = rule
ended, lock = {}, threading.Lock()
def done(index):
    def record(_future):
        with lock:
            ended[index] = time.monotonic()
    return record
started = time.monotonic()
calls = [request() for _ in range(ARGS["count"])]
for index, call in enumerate(calls):
    call.add_done_callback(done(index))
with open(ARGS["flag"], "w") as f:
    f.write(str(started))
for call in calls:
    call.exception()                          # waits for its end, whatever it was
while len(ended) < len(calls):
    time.sleep(0.01)
results = [[call.code().name, call.details() or "", ended[index]] for index, call in enumerate(calls)]
if session is not None:
    stub.CloseSession(pb.CloseSessionRequest(session_id=session), timeout=120)
print(json.dumps({"started": started, "results": results}))
'''

# The bystander: a few ListSessions before (its baseline), then, once the flood is in, ListSessions
# and GetStatus for ``seconds``: when each started and ended, and the workers busy it was told of.
BYSTANDER = r'''
import time
def listed():
    started = time.monotonic()
    stub.ListSessions(pb.ListSessionsRequest(), timeout=120)
    return [started, time.monotonic()]
baseline = [listed() for _ in range(5)]
with open(ARGS["ready"], "w") as f:
    f.write("ready")
while not os.path.exists(ARGS["flag"]):
    time.sleep(0.005)
rounds, busy = [], []
until = time.monotonic() + ARGS["seconds"]
while time.monotonic() < until:
    rounds.append(listed())
    busy.append(stub.GetStatus(pb.GetStatusRequest(), timeout=120).quota_usage["workers_busy"])
    time.sleep(0.02)
print(json.dumps({"baseline": baseline, "rounds": rounds, "busy": busy}))
'''


@pytest.fixture(scope="module")
def users() -> Iterator[list[PlainUser]]:
    """The attacker and the bystander, made here and removed afterwards."""
    with plain_users(2) as made:
        yield made


@pytest.fixture(scope="module")
def daemon(users: list[PlainUser], sandboxd_daemon_module: DaemonFactory) -> Daemon:
    return sandboxd_daemon_module(config=CONFIG)


@pytest.fixture()
def hung_mount(daemon: Daemon, fuse_for_users: None) -> Iterator[Callable[[PlainUser, str], HungMount]]:  # noqa: F811
    """``hung_mount(owner, kind)``: a FUSE mount of ``owner``'s that never answers, released
    afterwards; ``kind`` as for HungMount (root's goes in a mount namespace of its own, "userns":
    only the daemon, told its /proc/PID/root path, ever looks up anything under it)."""
    made: list[HungMount] = []

    def make(owner: PlainUser, kind: str = "fusermount3") -> HungMount:
        base = owned_dir(daemon.base, owner, f"fuse-{uuid.uuid4().hex[:8]}")
        made.append(HungMount(kind, owner, base))
        return made[-1]

    yield make
    for mount in made:
        if mount.holder.poll() is None:
            mount.release()


def busy_sampler(daemon: Daemon) -> tuple[threading.Event, list[int]]:
    """Root's GetStatus every 20 ms until the event is set: everyone's workers busy, each time
    (root's own GetStatus among them)."""
    stop, seen = threading.Event(), []

    def sample() -> None:
        channel = grpc.insecure_channel("unix:" + daemon.socket)
        stub = pb_grpc.SandboxStub(channel)
        try:
            while not stop.is_set():
                seen.append(stub.GetStatus(pb.GetStatusRequest(), timeout=60).quota_usage["workers_busy"])
                time.sleep(0.02)
        finally:
            channel.close()

    threading.Thread(target=sample, daemon=True).start()
    return stop, seen


def flood(daemon: Daemon, attacker: PlainUser, bystander: PlainUser, kind: str, hung: str,
          sample: bool = True) -> tuple[list[list[Any]], dict[str, Any], list[int]]:
    """Run the attacker's flood and the bystander beside it: (the flood's results, what the
    bystander saw, root's samples of workers_busy)."""
    flag = owned_dir(daemon.base, attacker) / "flooding"
    ready = owned_dir(daemon.base, bystander) / "ready"
    ws = owned_dir(daemon.base, attacker)
    attack: dict[str, Any] = {}
    seen_by: dict[str, Any] = {}
    bystanding = threading.Thread(target=lambda: seen_by.update(run_client_as(
        bystander.uid, bystander.gid, daemon.socket, BYSTANDER,
        {"flag": str(flag), "ready": str(ready), "seconds": WAIT_SECONDS * 0.6}, timeout=300)))
    bystanding.start()
    while not ready.exists() and bystanding.is_alive():
        time.sleep(0.01)
    stop, samples = busy_sampler(daemon) if sample else (threading.Event(), [])
    try:
        attack = run_client_as(attacker.uid, attacker.gid, daemon.socket, ATTACK,
                               {"kind": kind, "hung": hung, "ws": str(ws), "flag": str(flag), "count": FLOOD},
                               timeout=300)
    finally:
        stop.set()
        bystanding.join(300)
    assert seen_by, "the bystander's client failed"
    return attack["results"], seen_by, samples


def report(what: str, seen_by: dict[str, Any], first_hung_end: float) -> None:
    during = sorted(end - start for start, end in seen_by["rounds"] if start < first_hung_end)
    base = sorted(end - start for start, end in seen_by["baseline"])
    print(f"{what}: bystander ListSessions while the flood hangs: {len(during)} calls, p50 "
          f"{during[len(during) // 2]:.4f} s, max {during[-1]:.4f} s (before the flood: p50 "
          f"{base[len(base) // 2]:.4f} s, max {base[-1]:.4f} s)")


def check_flood(results: list[list[Any]], seen_by: dict[str, Any], samples: list[int], hung: str) -> float:
    """The flood held at most its requests' share, the admitted ones really hung, and the
    bystander was served while they did; when the first admitted one ended."""
    codes = {code for code, _, _ in results}
    assert codes == {"DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED"}, codes
    hung_ends = []
    for code, details, ended in results:
        if code == "DEADLINE_EXCEEDED":         # admitted: waited on the mount, which it names
            assert hung in details and "does not answer" in details, details
            hung_ends.append(ended)
        else:
            assert f"already has {REQUESTS} requests in progress" in details, details
            assert "quotas.requests_per_uid" in details, details
    # Root's samples: the flood's admitted requests, the bystander's call, root's own GetStatus.
    assert samples and max(samples) <= REQUESTS + 2, samples
    assert max(seen_by["busy"]) <= REQUESTS + 2, seen_by["busy"]
    first_hung_end = min(hung_ends)
    served = [end for _, end in seen_by["rounds"] if end < first_hung_end]
    assert served, (seen_by["rounds"][:3], first_hung_end)
    return first_hung_end


@pytest.mark.parametrize("kind", ["rule", "policy"])
def test_a_flood_holds_only_its_callers_requests(kind: str, daemon: Daemon, users: list[PlainUser],
                                                 hung_mount: Callable[[PlainUser, str], HungMount]) -> None:
    """The rule flood (AddStandingRule) and the policy flood (UpdateSessionPolicy) of 400 at once."""
    attacker, bystander = users
    hung = hung_mount(attacker, "fusermount3").path
    results, seen_by, samples = flood(daemon, attacker, bystander, kind, hung)
    first_hung_end = check_flood(results, seen_by, samples, hung)
    report(f"{kind} flood", seen_by, first_hung_end)
    if kind == "rule":
        # The admitted ones waited the whole wait_seconds: without the bound, each of the 400 would.
        started = min(ended for code, _, ended in results if code == "RESOURCE_EXHAUSTED")
        assert first_hung_end - started >= WAIT_SECONDS * 0.8, (first_hung_end, started)
    else:
        # The admitted ones took the session's build lock in turn, each waiting on the mount.
        assert sum(code == "DEADLINE_EXCEEDED" for code, _, _ in results) >= 2


def test_control_root_without_a_per_owner_bound_fills_all_but_the_share(
        daemon: Daemon, users: list[PlainUser], hung_mount: Callable[[PlainUser, str], HungMount]) -> None:
    """Local root is held to no per-owner bound: its flood on its own hung mount (root mounted it,
    so root's lookups wait) takes every worker up to the first-slot share, as any flood took all
    of them before; the bystander, with nothing in progress, is served from the share, and is
    told the workers are busy but for it."""
    _, bystander = users
    root = PlainUser("root", 0, 0)
    hung = hung_mount(root, "userns").path
    results, seen_by, _ = flood(daemon, root, bystander, "rule", hung, sample=False)
    admitted = [ended for code, _, ended in results if code == "DEADLINE_EXCEEDED"]
    assert len(admitted) >= WORKERS - SHARE - 2, len(admitted)         # all but the share (the bystander's)
    refused = [details for code, details, _ in results if code == "RESOURCE_EXHAUSTED"]
    assert refused and all("first-slot share" in details for details in refused), refused[:3]
    first_hung_end = min(admitted)
    during = [busy for (start, _), busy in zip(seen_by["rounds"], seen_by["busy"], strict=True)
              if start < first_hung_end]
    assert during and max(during) >= WORKERS - SHARE, seen_by["busy"]
    assert [end for _, end in seen_by["rounds"] if end < first_hung_end], seen_by["rounds"][:3]
    report("root's flood (control)", seen_by, first_hung_end)


REFLECTION = r'''
import threading, time                        # loaded already (by grpc): the stdlib is root's, out of reach now
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
class Feed:
    """One list_services request, then nothing until released: the stream stays open."""
    def __init__(self):
        self.sent, self.released = False, threading.Event()
    def __iter__(self):
        return self
    def __next__(self):
        if not self.sent:
            self.sent = True
            return reflection_pb2.ServerReflectionRequest(list_services="")
        self.released.wait()
        raise StopIteration
reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
feeds = [Feed() for _ in range(ARGS["count"])]
streams = [reflect.ServerReflectionInfo(feed, timeout=300) for feed in feeds]
answered, refused = 0, []
for stream in streams:
    try:
        reply = next(stream)
        answered += any(s.name == "sandboxd.v1.Sandbox" for s in reply.list_services_response.service)
    except grpc.RpcError as error:
        refused.append([error.code().name, error.details()])
status = stub.GetStatus(pb.GetStatusRequest(), timeout=60).quota_usage
with open(ARGS["flag"], "w") as f:
    f.write("holding")
while not os.path.exists(ARGS["done"]):
    time.sleep(0.02)
for feed in feeds:
    feed.released.set()
print(json.dumps({"answered": answered, "refused": refused, "streams": status["streams"]}))
'''


def test_reflection_streams_are_the_callers_streams(daemon: Daemon, users: list[PlainUser]) -> None:
    """A server-reflection stream waits for its client's next request, holding a worker: 50 of
    them open at once by one user used to hold 50 workers. Now each is one of the caller's
    streams: STREAMS are served (and answer), the rest are refused naming quotas.streams_per_uid,
    and the bystander is served while they are held."""
    attacker, bystander = users
    flag, done = owned_dir(daemon.base, attacker) / "holding", owned_dir(daemon.base, attacker) / "done"
    outcome: dict[str, Any] = {}
    holder = threading.Thread(target=lambda: outcome.update(run_client_as(
        attacker.uid, attacker.gid, daemon.socket, REFLECTION, {"count": 50, "flag": str(flag), "done": str(done)},
        timeout=300)))
    holder.start()
    try:
        while not flag.exists() and holder.is_alive():
            time.sleep(0.02)
        served = run_client_as(bystander.uid, bystander.gid, daemon.socket, r'''
print(json.dumps({"listed": code(lambda: stub.ListSessions(pb.ListSessionsRequest(), timeout=60))}))
''')
        busy = daemon.stub.GetStatus(pb.GetStatusRequest(), timeout=60).quota_usage["workers_busy"]
    finally:
        done.write_text("done")
        holder.join(300)
    assert served == {"listed": "OK"}
    assert outcome["answered"] == STREAMS and outcome["streams"] == STREAMS, outcome
    assert len(outcome["refused"]) == 50 - STREAMS, outcome
    assert all(code == "RESOURCE_EXHAUSTED" and "quotas.streams_per_uid" in details
               for code, details in outcome["refused"]), outcome["refused"][:3]
    assert busy <= STREAMS + 1, busy                  # the held streams and root's GetStatus
