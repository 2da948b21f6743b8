"""What review mode costs a daemon session (issue 25), as root, on bench_git_guard's 20,000-directory
workspace against an empty one, through gRPC to a daemon of the bench's own:

* CreateSession (+ its first call, which the sandbox's build is part of: CreateSession builds it):
  review mode in the big workspace against review mode in an empty one, and direct mode in both
  (direct mode walks the tree for the git guard's baseline);
* a call's end: Run `true` in an existing session (the git guard's after-call look in direct mode,
  nothing in review mode);
* ListChanges with 10 changed files;
* a call that marks a checkpoint first (ExecStart.checkpoint) against the same call without;
* ApplyChanges of 1,000 changed files (1 KiB each, in 50 directories).

Medians of ``--runs`` (default 9), big and empty alternating; one line per figure. Not a test:
nothing is asserted.

    .venv/bin/python tests/bench_review_sessions.py [--runs 9]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Callable

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_git_guard import make_big_workspace  # noqa: E402
from daemon_helpers import daemon_factory  # noqa: E402
from review_helpers import free_stores  # noqa: E402
from sandboxd.client import SandboxClient  # noqa: E402
from sandboxd.v1 import sandboxd_pb2 as pb  # noqa: E402


def ms(action: Callable[[], object]) -> float:
    start = time.perf_counter()
    action()
    return (time.perf_counter() - start) * 1e3


def run(client: SandboxClient, session: str, script: str) -> None:
    responses = list(client.stub.Run(pb.ExecStart(session_id=session, argv=["sh", "-c", script])))
    result = responses[-1].result
    if result.exit_code != 0:
        raise SystemExit(f"bench: `{script}` failed ({result.exit_code}): {responses}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=9)
    runs = parser.parse_args().runs
    big = make_big_workspace()
    empty = tempfile.mkdtemp(prefix="sbxbench-empty-", dir="/var/tmp")
    try:
        with daemon_factory("sbxbench-review-") as factory:
            state = factory.base / "state"
            daemon = factory(args=["--state-dir", str(state)])
            client = SandboxClient(str(daemon.socket))
            try:
                for review in (True, False):
                    create: dict[str, list[float]] = {big: [], empty: []}
                    call: dict[str, list[float]] = {big: [], empty: []}
                    for _ in range(runs):
                        for workspace in (big, empty):
                            made: list[str] = []
                            create[workspace].append(ms(lambda: made.append(client.create_session(
                                workspace, approval="never", review=review).id)))
                            run(client, made[0], "true")              # warm
                            call[workspace].append(ms(lambda: run(client, made[0], "true")))
                            client.close_session(made[0])
                    mode = "review" if review else "direct"
                    for name, samples in (("CreateSession", create), ("a call of true", call)):
                        b, e = statistics.median(samples[big]), statistics.median(samples[empty])
                        print(f"{mode:<6} {name:<14}: 20,000 directories {b:7.1f} ms, empty {e:7.1f} ms, "
                              f"added {b - e:+7.1f} ms")
                session = client.create_session(big, approval="never", review=True).id
                run(client, session, "mkdir -p bench-ten && for i in 0 1 2 3 4 5 6 7 8 9; do "
                                     "echo $i > bench-ten/f$i; done")
                listed = [ms(lambda: client.list_changes(session)) for _ in range(runs)]
                count = len(client.list_changes(session)[0])
                print(f"review ListChanges, {count} changes in the 20,000-directory workspace: "
                      f"{statistics.median(listed):.1f} ms")
                client.discard_changes(session)
                client.close_session(session)
                # A call that marks a checkpoint first (ExecStart.checkpoint) after a call that changed
                # a file, against the same call without: the checkpoint closes the sandbox, the call
                # rebuilds it.
                session = client.create_session(empty, approval="never", review=True).id
                marked: dict[bool, list[float]] = {True: [], False: []}
                for index in range(runs):
                    for checkpoint in (True, False):
                        run(client, session, f"echo {index} > bench-{checkpoint}-{index}")
                        start = pb.ExecStart(session_id=session, argv=["true"], checkpoint=checkpoint)
                        marked[checkpoint].append(ms(lambda: list(client.stub.Run(start))))
                with_point, without = statistics.median(marked[True]), statistics.median(marked[False])
                print(f"review a call of true after a change, with a checkpoint {with_point:.1f} ms, without "
                      f"{without:.1f} ms, added {with_point - without:+.1f} ms "
                      f"({len(client.list_checkpoints(session))} checkpoints kept)")
                client.close_session(session)
                applied: list[float] = []
                for index in range(max(3, runs // 3)):
                    target = tempfile.mkdtemp(prefix="sbxbench-apply-", dir="/var/tmp")
                    session = client.create_session(target, approval="never", review=True).id
                    run(client, session, "for d in $(seq 50); do mkdir d$d; for f in $(seq 20); do "
                                         "head -c 1024 /dev/urandom > d$d/f$f; done; done")
                    result: list[pb.ApplyChangesResponse] = []
                    applied.append(ms(lambda: result.append(client.apply_changes(session))))
                    if len(result[0].applied) < 1000 or result[0].skipped:
                        raise SystemExit(f"bench: apply landed {len(result[0].applied)}, skipped "
                                         f"{len(result[0].skipped)}")
                    client.close_session(session)
                    shutil.rmtree(target)
                print(f"review ApplyChanges of 1,000 files (and 50 directories): "
                      f"{statistics.median(applied):.0f} ms (median of {len(applied)})")
            finally:
                client.close()
                daemon.close()
                free_stores(state)
    finally:
        shutil.rmtree(big, ignore_errors=True)
        shutil.rmtree(empty, ignore_errors=True)


if __name__ == "__main__":
    main()
