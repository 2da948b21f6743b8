"""One user's stuck close costs only that user (round 4's second hostile pass, finding 8).

A session asked for with close_with_caller is closed by the daemon when its creating process exits
(service.process_ties); so are approval channels' registrations. Closing a session takes its
build_lock, which an UpdateSessionPolicy holds while it waits (up to fork_server.wait_seconds) on a
path: a writable root on the caller's own FUSE mount whose server never answers. Every tie's
callback ran on the one watch thread, one after another: the attacker's stuck close held every
other user's close-with-caller cleanup and channel unregistration (the pass: the victim's session
still open 40 s after its process exited).

Now each owner's callbacks run on a thread of that owner's (service/process_ties.py). The attack as
the pass ran it: the attacker's process P creates a close_with_caller session and runs one Exec; six
threads of another of its processes update that session's policy with writable roots on its stuck
mount; P is killed. Then the victim's process creates a close_with_caller session and exits: its
session is closed while the attacker's is still open (its close stuck behind the updates). The
control, in the same run: a second close_with_caller session of the attacker, whose process also
ends, stays open behind the stuck close of its own owner's thread, as every user's did before.
Once the attacker's mount goes, both of its sessions close. Nothing here is timed: the updates hold
the attacker's session for 6 x WAIT_SECONDS unless the mount goes, which the test does at the end.
The victim's process also registered an approval channel (a Unix socket of its own): its registry
entry goes with it as well, where before it waited behind the attacker's close too.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import SLOW, eventually
from daemon_helpers import DaemonFactory, PlainUser, owned_dir, plain_users, run_client_as, start_client_as
from sandboxd.client import SandboxClient
from sandboxd.v1 import sandboxd_pb2 as pb
from user_fuse import UserFuse, fuse_for_users  # noqa: F401 - a fixture

pytestmark = pytest.mark.timeout(int(600 * SLOW))

WAIT_SECONDS = 120.0 * SLOW            # fork_server.wait_seconds: the updates hold the session this long each
UPDATES = 6                            # the pass's six UpdateSessionPolicy threads
WITHIN = 60.0 * SLOW                   # how long what must happen may take here (never a measure)

# As a user: a close_with_caller session on ARGS["ws"] (with ARGS["exec"], one Exec in it, so its
# sandbox is built; with ARGS["channel"], an approval channel registered: a Unix socket listening
# there); its id printed; then the process waits to be killed (or, ARGS["exit"], exits).
TIED = r'''
import socket
if ARGS["channel"]:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(ARGS["channel"])
    listener.listen()
    stub.RegisterApprovalChannel(pb.RegisterApprovalChannelRequest(), timeout=120)
s = stub.CreateSession(pb.CreateSessionRequest(workspace=ARGS["ws"], approval_policy=pb.NEVER, close_with_caller=True,
    sandbox_policy=pb.SandboxPolicy(mode=pb.SandboxPolicy.WORKSPACE_WRITE)), timeout=120)
if ARGS["exec"]:
    run(s.id, ["/bin/true"])
print(json.dumps({"session": s.id}), flush=True)
if not ARGS["exit"]:
    sys.stdin.read()
'''

# As the attacker: UPDATES threads of UpdateSessionPolicy on ARGS["session"], each naming a writable
# root on the stuck mount; the codes.
UPDATE = r'''
import threading
codes = []
def update(i):
    policy = pb.SandboxPolicy(mode=pb.SandboxPolicy.WORKSPACE_WRITE, writable_roots=[f"{ARGS['mount']}/r{i}"])
    try:
        stub.UpdateSessionPolicy(pb.UpdateSessionPolicyRequest(session_id=ARGS["session"], sandbox_policy=policy),
                                 timeout=3600)
        codes.append("OK")
    except grpc.RpcError as error:
        codes.append(error.code().name)
threads = [threading.Thread(target=update, args=(i,)) for i in range(ARGS["updates"])]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(json.dumps({"codes": codes}))
'''


@pytest.fixture(scope="module")
def users() -> Iterator[list[PlainUser]]:
    """Two plain users (attacker, victim), made here and removed afterwards."""
    with plain_users(2) as made:
        yield made


def tied_session(daemon_socket: str, user: PlainUser, workspace: Path, *, run_one: bool = False,
                 exit_now: bool = False, channel: str = "") -> tuple[str, subprocess.Popen[str]]:
    """A close_with_caller session of ``user`` and the process it is tied to."""
    process = start_client_as(user.uid, user.gid, daemon_socket, TIED,
                              {"ws": str(workspace), "exec": run_one, "exit": exit_now, "channel": channel})
    assert process.stdout is not None
    line = process.stdout.readline()
    assert line, f"the tied client failed: {process.communicate(timeout=60)}"
    session: str = json.loads(line)["session"]
    return session, process


def channels_of(daemon_socket: str, uid: int) -> list[str]:
    """The approval-channel registry entries of ``uid`` (launcher.channel_registry: KEY starts with the uid)."""
    from sandboxd import defaults

    return [name for name in os.listdir(defaults.channel_registry(daemon_socket))
            if name.rsplit("-", 1)[-1].startswith(f"{uid}.")]


def kill(process: subprocess.Popen[str]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGKILL)
    process.communicate(timeout=60)


def test_one_users_stuck_close_stalls_nobody_elses(users: list[PlainUser], fuse_for_users: None,  # noqa: F811
                                                   sandboxd_daemon: DaemonFactory) -> None:
    attacker, victim = users
    daemon = sandboxd_daemon(config=f"[fork_server]\nwait_seconds = {WAIT_SECONDS}\n")
    base = sandboxd_daemon.base
    attacker_ws, control_ws = owned_dir(base / "ws-attacker", attacker), owned_dir(base / "ws-control", attacker)
    victim_ws = owned_dir(base / "ws-victim", victim)
    mount = UserFuse("stuck", attacker.uid, attacker.gid, base / "fuse-attacker")
    processes: list[subprocess.Popen[str]] = []
    with SandboxClient(daemon.socket) as root:
        def open_ids() -> set[str]:
            return {s.id for s in root.stub.ListSessions(pb.ListSessionsRequest()).sessions}
        try:
            # The pass's control first: with nothing stuck, a victim's tied session and channel go with
            # its process.
            quiet, quiet_holder = tied_session(daemon.socket, victim, victim_ws, channel=str(victim_ws / "quiet.sock"))
            processes.append(quiet_holder)
            assert quiet in open_ids() and channels_of(daemon.socket, victim.uid)
            kill(quiet_holder)
            assert eventually(lambda: quiet not in open_ids(), WITHIN), "a tied session outlived its process"
            assert eventually(lambda: not channels_of(daemon.socket, victim.uid), WITHIN)

            # P: the attacker's tied session, its sandbox built; the control's process, of the same owner.
            stuck, holder = tied_session(daemon.socket, attacker, attacker_ws, run_one=True)
            control, control_holder = tied_session(daemon.socket, attacker, control_ws)
            processes += [holder, control_holder]
            updates: dict[str, Any] = {}
            updater = threading.Thread(target=lambda: updates.update(run_client_as(
                attacker.uid, attacker.gid, daemon.socket, UPDATE,
                {"session": stuck, "mount": str(mount.mountpoint), "updates": UPDATES}, timeout=WITHIN * 20)),
                daemon=True)
            updater.start()
            assert mount.swallowed() is not None, "no update reached the stuck mount"   # one holds build_lock now

            kill(holder)                                   # the attacker's close begins: stuck behind the updates
            kill(control_holder)                           # the control's close: queued behind it, same owner
            victims, victim_holder = tied_session(daemon.socket, victim, victim_ws, exit_now=True,
                                                  channel=str(victim_ws / "channel.sock"))
            victim_holder.communicate(timeout=60)
            exited = time.monotonic()

            # The victim's session and channel went with its process, while the attacker's close is
            # still stuck (and the control's behind it): one owner's slow close cost only that owner.
            assert eventually(lambda: victims not in open_ids(), WITHIN), "the victim's tied session stayed open"
            assert eventually(lambda: not channels_of(daemon.socket, victim.uid), WITHIN), \
                channels_of(daemon.socket, victim.uid)
            closed_after = time.monotonic() - exited
            still = open_ids()
            assert stuck in still and control in still, (stuck, control, still)
            print(f"\nthe victim's tied session closed {closed_after:.2f} s after its process exited (polled every "
                  "50 ms), while the attacker's close was stuck")
            assert updater.is_alive(), updates              # the updates were holding it all along

            # Once the attacker's mount goes, the updates end and both of its sessions close.
            mount.release()
            updater.join(WITHIN)
            assert not updater.is_alive(), "the updates never ended"
            assert eventually(lambda: not {stuck, control} & open_ids(), WITHIN), open_ids()
        finally:
            mount.release()
            for process in processes:
                kill(process)
