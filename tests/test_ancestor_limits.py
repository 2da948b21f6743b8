"""The caps of the cgroups above the sandboxes (kernel.ancestor_limits, service.ancestor_fit), on the
real kernel: issue 27's reproduction. A daemon runs in a parent group of the test's own
(cgroup_helpers.own_parent: v1 memory here, v2 in the matrix guests) capped at 700 MiB; a session
given 2 GiB used to be OOM-killed at 700 MiB, a cap it never mentioned. Now it is refused, naming
the group, its cap and what to ask for; 512 MiB works; a session that sets nothing gets the default
capped to 700 MiB, and status and the audit log say so. The control without the check: a session
given 2 GiB before the cap was set (nothing to refuse then) is OOM-killed allocating 800 MiB once the
parent is capped at 700 MiB, whatever its own limit says.
"""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest

from cgroup_helpers import LIMIT_FILES, ParentGroup, own_parent, read
from conftest import PY
from daemon_helpers import DaemonFactory, close_quietly, create_session, rpc_error, run_exec, workspace_write
from sandboxd.kernel import ancestor_limits, cgroups
from sandboxd.v1 import sandboxd_pb2 as pb

pytestmark = pytest.mark.timeout(300)

CAP = 700 << 20
ALLOCATE = ("import sys\n"
            "b = bytearray(int(sys.argv[1]) << 20)\n"
            "for i in range(0, len(b), 4096): b[i] = 1\n"
            "print('ALIVE', flush=True)\n")


def parent_group(parent: ParentGroup) -> tuple[Path, str]:
    """The test's parent group that holds the daemon in the memory hierarchy, and its limit file."""
    base, version = parent.bases["memory"]
    return base.parent, LIMIT_FILES["memory", version]


def cgroup_path(group: Path) -> str:
    """``group`` as /proc/PID/cgroup names it: its path below its hierarchy's mount."""
    h = cgroups.hierarchies()
    mounts = [h.unified] if h.unified else []
    mounts += [point for point, _ in h.v1.values()]
    for mount in mounts:
        if mount and str(group).startswith(mount.rstrip("/") + "/"):
            return "/" + str(group)[len(mount.rstrip("/")) + 1:]
    raise AssertionError(f"{group} is in no hierarchy of {mounts}")


def test_limits_above_names_the_tightest_cap_on_the_path() -> None:
    """Memory and pids: a group capped below a child capped higher; the group's cap is named, read
    from the child (its ancestor) and from the group itself; before the caps, neither is."""
    with own_parent() as parent:
        h = cgroups.hierarchies()
        made: list[Path] = []
        try:
            for resource, cap, looser in (("memory", CAP, 900 << 20), ("pids", 77, 99)):
                base, version = parent.bases[resource]
                group, name = base.parent, LIMIT_FILES[resource, version]
                child = group / "child"
                if version == "v2":              # the unit hands memory and pids down to its child
                    (group / "cgroup.subtree_control").write_text("+memory +pids")
                if not child.exists():
                    child.mkdir()
                    made.append(child)

                def above(start: Path, resource: str = resource,
                          version: str = version) -> ancestor_limits.Bound | None:
                    if version == "v2":
                        limits = ancestor_limits.limits_above(h, unified_group=cgroup_path(start), v1_groups={})
                    else:
                        limits = ancestor_limits.limits_above(h, unified_group="/",
                                                              v1_groups={resource: cgroup_path(start)})
                    return limits.get(resource)

                before = above(child)
                assert before is None or before.value > cap, before      # control: the machine's own caps only
                (group / name).write_text(str(cap))
                (child / name).write_text(str(looser))
                for start in (child, group):
                    bound = above(start)
                    assert bound is not None and bound.value == cap and bound.group == cgroup_path(group), bound
                    assert bound.file == name, bound
        finally:
            for child in made:
                child.rmdir()


def test_a_session_past_the_parent_cap_is_refused_and_the_default_is_capped(
        sandboxd_daemon: DaemonFactory) -> None:
    with own_parent() as parent:
        group, name = parent_group(parent)
        daemon = sandboxd_daemon(wrapper=parent.wrapper)
        sessions: list[str] = []
        try:
            stub = daemon.stub

            def session(**limits: int) -> pb.Session:
                made = create_session(stub, sandboxd_daemon.workspace(), workspace_write(),
                                      limits=pb.Limits(**limits))
                sessions.append(made.id)
                return made

            # Uncapped: 2 GiB is taken (nothing above caps it). This is the session without the check.
            unchecked = session(memory_bytes=2 << 30)
            (group / name).write_text(str(CAP))
            assert int(read(group / name)) == CAP

            error = rpc_error(lambda: session(memory_bytes=2 << 30))
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
            details = error.details()
            assert cgroup_path(group) in details and name in details and str(CAP) in details, details
            assert f"ask for at most {CAP}" in details, details
            print(f"2 GiB under a 700 MiB parent: INVALID_ARGUMENT: {details}")

            fits = session(memory_bytes=512 << 20)                    # control: under the cap, works
            alive = run_exec(stub, fits.id, [PY, "-c", ALLOCATE, "400"])
            assert alive.stdout == b"ALIVE\n" and not alive.result.oom_killed, alive.describe()

            # The control without the check: its own 2 GiB limit does not save it from the parent's cap.
            killed = run_exec(stub, unchecked.id, [PY, "-c", ALLOCATE, "800"])
            assert b"ALIVE" not in killed.stdout, killed.describe()
            assert killed.result.oom_killed or killed.result.signal == 9, killed.describe()

            plain = session()                                          # nothing asked: the default, capped
            assert plain.limits.memory_bytes == CAP, plain.limits
            features = stub.GetStatus(pb.GetStatusRequest()).features
            assert "capped from" in features["defaults.memory"] and cgroup_path(group) in features["defaults.memory"]
            assert str(CAP) in features["cgroup.ancestor_memory"], dict(features)
            print(f"status: defaults.memory: {features['defaults.memory']}")
            print(f"without the check: 2 GiB session touching 800 MiB: signal {killed.result.signal}, "
                  f"oom_killed {killed.result.oom_killed}; 512 MiB session touching 400 MiB: {alive.stdout!r}")
            events = stub.QueryEvents(pb.QueryEventsRequest(session_id=plain.id, types=["SessionCreated"])).events
            notes = json.loads(events[0].data_json)["limit_notes"]
            assert len(notes) == 1 and "capped to" in notes[0] and cgroup_path(group) in notes[0], notes
        finally:
            for session_id in sessions:
                close_quietly(daemon.stub, session_id)
            daemon.close()                        # before its parent group goes
