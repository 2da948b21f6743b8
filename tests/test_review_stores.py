"""Review sessions' disk bound (issue 25, item 7), on the real kernel as a plain user: each daemon
session's review directory is a bounded store (kernel.review_space) the fork server mounts when it
makes it. A write past the session's bound gets ENOSPC inside the sandbox while the daemon keeps
serving (control: a daemon with a bigger bound lets the same write land); an owner's second
session is bounded by what its first leaves of review.owner_bytes; after a SIGKILLed daemon's
restart the stores are still mounted and still counted (a third session is refused naming
review.owner_bytes until one is freed by closing it with nothing pending); a failed build leaves
no store. A session closed with changes pending is listed, applied (one path, then the rest) and
discarded after the close by its owner (another user: NOT_FOUND), and what leaves nothing frees
its store and directory.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from conftest import SLOW
from daemon_helpers import Daemon, PlainUser, daemon_factory, plain_users, run_client_as
from review_helpers import CLIENT, free_stores, local_disk, tmpfs, usual_workspace
from sandboxd.kernel import review_space

pytestmark = pytest.mark.timeout(600)

MIB = 1 << 20
SMALL = '[review]\nsession_bytes = "8M"\nowner_bytes = "16M"\n'
ROOMY = '[review]\nsession_bytes = "32M"\nowner_bytes = "64M"\n'
CAPPED = '[review]\nsession_bytes = "8M"\nowner_bytes = "64M"\nowner_stores = 2\n'


class Place(NamedTuple):
    small: Daemon
    roomy: Daemon
    capped: Daemon
    owner: PlainUser
    disk: Path


@pytest.fixture(scope="module")
def place() -> Iterator[Place]:
    with plain_users(1) as (owner,), daemon_factory("sbxrstore-") as factory, \
            daemon_factory("sbxrstore-roomy-") as other, daemon_factory("sbxrstore-capped-") as third, \
            contextlib.ExitStack() as stack:
        disk = (factory.base if local_disk(str(factory.base))
                else stack.enter_context(tmpfs(factory.base / "disk", size="1g")))
        stack.callback(free_stores, disk / "small")             # after its daemon (callbacks: last first)
        small = factory(config=SMALL, args=["--state-dir", str(disk / "small")])
        stack.callback(small.close)
        stack.callback(free_stores, other.base / "roomy")
        roomy = other(config=ROOMY, args=["--state-dir", str(other.base / "roomy")])
        stack.callback(roomy.close)
        stack.callback(free_stores, third.base / "capped")
        capped = third(config=CAPPED, args=["--state-dir", str(third.base / "capped")])
        stack.callback(capped.close)
        yield Place(small, roomy, capped, owner, disk)


def call(daemon: Daemon, user: PlainUser, *ops: tuple[str, dict[str, Any]]) -> list[dict[str, Any]]:
    answers: list[dict[str, Any]] = run_client_as(user.uid, user.gid, daemon.socket, CLIENT,  # type: ignore[assignment]
                                                  {"ops": [list(op) for op in ops]}, timeout=300 * SLOW)
    return answers


def create(place: Place, daemon: Daemon, name: str) -> str:
    answer = call(daemon, place.owner, ("create", {"workspace": str(usual_workspace(place.disk / name, place.owner))}))[0]
    assert answer["ok"], answer
    return str(answer["id"])


def write(place: Place, daemon: Daemon, session: str, name: str, mib: int) -> dict[str, Any]:
    """``mib`` MiB written to ``name`` in the session's workspace; the answer (stdout has the error:
    then what was written is removed, as a person would)."""
    answer = call(daemon, place.owner, ("exec", {"session": session, "script": (
        f"head -c {mib * MIB} /dev/zero > {name} 2>/tmp/err && echo WROTE || {{ cat /tmp/err; rm -f {name}; echo FAILED; }}")}))[0]
    assert answer["ok"], answer
    return answer


def store(place: Place, session: str) -> str:
    return str(place.disk / "small" / "review" / session)


def test_a_write_past_the_session_bound_gets_enospc_inside_and_the_daemon_serves_on(place: Place) -> None:
    session = create(place, place.small, "ws-bound")
    assert review_space.is_store(store(place, session))
    assert review_space.reserved(store(place, session)) == review_space.charge(8 * MIB)   # bytes and inodes
    refused = write(place, place.small, session, "big", 10)
    assert "FAILED" in refused["stdout"] and "No space left" in refused["stdout"], refused
    # The daemon serves on: the same session lists its changes and runs the next command.
    assert call(place.small, place.owner, ("ListChanges", {"session_id": session}))[0]["ok"]
    assert "WROTE" in write(place, place.small, session, "big", 1)["stdout"]
    # Control: under a bigger bound the very same write lands.
    roomy = create(place, place.roomy, "ws-roomy")
    assert "WROTE" in write(place, place.roomy, roomy, "big", 10)["stdout"]
    call(place.roomy, place.owner, ("DiscardChanges", {"session_id": roomy}), ("CloseSession", {"session_id": roomy}))
    call(place.small, place.owner, ("DiscardChanges", {"session_id": session}), ("CloseSession", {"session_id": session}))
    assert not Path(store(place, session)).exists()             # nothing pending at close: freed


def test_the_owner_share_bounds_a_second_session_and_survives_a_restart(place: Place) -> None:
    first = create(place, place.small, "ws-first")              # 8 MiB (and 2,064 inodes' 2 MiB) of the owner's 16
    assert "WROTE" in write(place, place.small, first, "six", 6)["stdout"]
    second = create(place, place.small, "ws-second")            # what the first leaves: under 6 MiB, inodes counted
    assert review_space.reserved(store(place, second)) <= 16 * MIB - review_space.charge(8 * MIB)
    refused = write(place, place.small, second, "six", 6)
    assert "No space left" in refused["stdout"], refused           # control: the first's 6 MiB landed
    assert "WROTE" in write(place, place.small, second, "three", 3)["stdout"]

    place.small.kill()
    place.small.start()
    for session in (first, second):                             # still mounted, still counted
        assert review_space.is_store(store(place, session))
    third = call(place.small, place.owner, ("create", {"workspace": str(usual_workspace(
        place.disk / "ws-third", place.owner))}))[0]
    assert not third["ok"] and third["code"] == "RESOURCE_EXHAUSTED" and "review.owner_bytes" in third["details"], third
    # The first's change set gone (nothing pending at its close): its store is freed, and room made.
    assert "WROTE" in write(place, place.small, first, "six", 0)["stdout"]
    assert call(place.small, place.owner, ("exec", {"session": first, "script": "rm six"}))[0]["ok"]
    assert call(place.small, place.owner, ("CloseSession", {"session_id": first}))[0]["ok"]
    assert not Path(store(place, first)).exists()
    third_id = create(place, place.small, "ws-third-again")
    assert review_space.is_store(store(place, third_id))
    for session in (second, third_id):
        call(place.small, place.owner, ("DiscardChanges", {"session_id": session}),
             ("CloseSession", {"session_id": session}))


def test_a_failed_build_leaves_no_store(place: Place) -> None:
    theirs = place.disk / "ws-roots"                            # root's: the owner may not write it
    theirs.mkdir(mode=0o755)
    review = place.disk / "small" / "review"
    before = sorted(review.iterdir()) if review.exists() else []
    answer = call(place.small, place.owner, ("create", {"workspace": str(theirs)}))[0]
    assert not answer["ok"] and answer["code"] in ("PERMISSION_DENIED", "INVALID_ARGUMENT"), answer
    assert (sorted(review.iterdir()) if review.exists() else []) == before
    mounted = Path("/proc/self/mountinfo").read_text()
    assert not [line for line in mounted.splitlines() if str(place.disk / "small" / "review") in line
                and not any(str(path) in line for path in before)]


def test_a_closed_sessions_change_set_is_listed_and_applied_after_close_then_freed(place: Place) -> None:
    ws = place.disk / "ws-closed"
    session = create(place, place.small, "ws-closed")
    assert call(place.small, place.owner, ("exec", {"session": session, "script": "echo kept > added.txt; rm del.txt"}))[0]["ok"]
    assert call(place.small, place.owner, ("CloseSession", {"session_id": session}))[0]["ok"]
    assert review_space.is_store(store(place, session))         # pending: kept (and sealed)
    listed = call(place.small, place.owner, ("ListChanges", {"session_id": session}))[0]
    assert listed["ok"], listed
    # Another user learns nothing of it (NOT_FOUND, as for an open session of someone else's).
    with plain_users(1) as (stranger,):
        for name in ("ListChanges", "ApplyChanges", "DiscardChanges"):
            theirs = call(place.small, stranger, (name, {"session_id": session}))[0]
            assert not theirs["ok"] and theirs["code"] == "NOT_FOUND", theirs
    assert (ws / "del.txt").exists() and not (ws / "added.txt").exists()
    applied = call(place.small, place.owner, ("ApplyChanges", {"session_id": session, "paths": ["added.txt"]}))[0]
    assert applied["ok"], (applied, place.small.log()[-3000:])
    assert (ws / "added.txt").read_text() == "kept\n" and (ws / "del.txt").exists()   # exactly that path
    assert review_space.is_store(store(place, session))         # del.txt still pending: kept
    assert call(place.small, place.owner, ("ApplyChanges", {"session_id": session}))[0]["ok"]
    assert not (ws / "del.txt").exists()
    assert not Path(store(place, session)).exists()             # nothing left: the store and directory freed
    gone = call(place.small, place.owner, ("ListChanges", {"session_id": session}))[0]
    assert not gone["ok"] and gone["code"] == "NOT_FOUND" and "keeps no change set" in gone["details"], gone


def test_a_closed_sessions_discard_of_all_frees_its_store(place: Place) -> None:
    session = create(place, place.small, "ws-closed-discard")
    assert call(place.small, place.owner, ("exec", {"session": session, "script": "echo x > added.txt"}))[0]["ok"]
    assert call(place.small, place.owner, ("CloseSession", {"session_id": session}))[0]["ok"]
    assert review_space.is_store(store(place, session))
    assert call(place.small, place.owner, ("DiscardChanges", {"session_id": session}))[0]["ok"]
    assert not Path(store(place, session)).exists()
    assert not (place.disk / "ws-closed-discard" / "added.txt").exists()


def capped_store(place: Place, session: str) -> str:
    return str(place.capped.base / "capped" / "review" / session)


FILL_INODES = ("python3 -c 'import os\nn = 0\ntry:\n    while True:\n        os.close(os.open(\"f%d\" % n, "
               "os.O_CREAT | os.O_WRONLY)); n += 1\nexcept OSError as e:\n    print(n, e.strerror)'")


def test_a_full_store_keeps_its_checkpoints_and_its_change_set(place: Place) -> None:
    """The second hostile pass's B3: a store the sandbox filled (its bytes, then its inodes). Every
    save finds a reserve, so a checkpoint on a store full of bytes is made, twice, and rolled back
    to; one that could not be recorded (no inode left) is refused before anything changes, saying
    what to do. Each time the session goes on, and its close keeps the change set."""
    daemon, owner = place.capped, place.owner
    ws = usual_workspace(place.disk / "ws-full", owner)
    answer = call(daemon, owner, ("create", {"workspace": str(ws)}))[0]
    assert answer["ok"], answer
    session = str(answer["id"])
    filled = call(daemon, owner, ("exec", {"session": session, "script": (
        "echo precious > work.txt; head -c 20000000 /dev/zero > big 2>/tmp/err; cat /tmp/err")}))[0]
    assert "No space left" in filled["stdout"], filled
    for label in ("one", "two"):                    # the second save finds a reserve too
        made = call(daemon, owner, ("CreateCheckpoint", {"session_id": session, "label": label}))[0]
        assert made["ok"] and made["label"] == label, (made, daemon.log()[-3000:])
    listed = call(daemon, owner, ("ListCheckpoints", {"session_id": session}))[0]
    assert [item["label"] for item in listed["checkpoints"]] == ["one", "two"], listed
    back = call(daemon, owner, ("RollbackChanges", {"session_id": session, "checkpoint_id": 1}))[0]
    assert back["ok"], back
    # The session goes on: a command runs, the change set lists.
    ran = call(daemon, owner, ("exec", {"session": session, "script": "cat work.txt"}))[0]
    assert ran["stdout"] == "precious\n", ran
    changes = call(daemon, owner, ("ListChanges", {"session_id": session}))[0]
    assert {item["path"] for item in changes["changes"]} >= {"work.txt", "big"}, changes
    # Now its inodes too: after removing big (bytes back), files until the kernel refuses one.
    full = call(daemon, owner, ("exec", {"session": session, "script": "rm big; " + FILL_INODES}))[0]
    assert "No space left" in full["stdout"], full
    refused = call(daemon, owner, ("CreateCheckpoint", {"session_id": session, "label": "three"}))[0]
    assert not refused["ok"] and refused["code"] == "RESOURCE_EXHAUSTED", refused
    assert "discard some changes" in refused["details"] and "Nothing was changed" in refused["details"], refused
    listed = call(daemon, owner, ("ListCheckpoints", {"session_id": session}))[0]
    assert [item["label"] for item in listed["checkpoints"]] == ["one"], listed
    ran = call(daemon, owner, ("exec", {"session": session, "script": "cat work.txt; ls | wc -l"}))[0]
    assert ran["stdout"].startswith("precious\n"), ran
    # Control: with room made (some files discarded), the same checkpoint is made.
    discarded = call(daemon, owner, ("DiscardChanges", {"session_id": session, "paths": [f"f{n}" for n in range(8)]}))[0]
    assert discarded["ok"], discarded
    made = call(daemon, owner, ("CreateCheckpoint", {"session_id": session, "label": "three"}))[0]
    assert made["ok"] and made["label"] == "three", made
    # Closed, the change set is kept (pending), listed, and precious is still in it.
    assert call(daemon, owner, ("CloseSession", {"session_id": session}))[0]["ok"]
    assert review_space.is_store(capped_store(place, session))
    after = call(daemon, owner, ("ListChanges", {"session_id": session, "paths": ["work.txt"]}))[0]
    assert after["ok"] and "work.txt" in {item["path"] for item in after["changes"]}, after
    # And it is applied and discarded as any: what was precious lands.
    applied = call(daemon, owner, ("ApplyChanges", {"session_id": session, "paths": ["work.txt"]}))[0]
    assert applied["ok"] and (ws / "work.txt").read_text() == "precious\n", applied
    assert call(daemon, owner, ("DiscardChanges", {"session_id": session}))[0]["ok"]
    assert not Path(capped_store(place, session)).exists()


def test_an_owner_keeps_at_most_review_owner_stores_stores(place: Place) -> None:
    """review.owner_stores = 2: an owner's third review session (its others open, or closed with
    changes kept) is refused naming the key, and leaves no store; another owner is not affected,
    and once one is discarded (control) the third is made."""
    daemon = place.capped
    with plain_users(2) as (owner, other):
        made = []
        for name in ("cap-1", "cap-2"):
            answer = call(daemon, owner, ("create", {"workspace": str(usual_workspace(place.disk / name, owner))}))[0]
            assert answer["ok"], answer
            made.append(str(answer["id"]))
        assert call(daemon, owner, ("exec", {"session": made[0], "script": "echo x > kept.txt"}))[0]["ok"]
        assert call(daemon, owner, ("CloseSession", {"session_id": made[0]}))[0]["ok"]      # kept: still counted
        review = place.capped.base / "capped" / "review"
        before = sorted(review.iterdir())
        third = call(daemon, owner, ("create", {"workspace": str(usual_workspace(place.disk / "cap-3", owner))}))[0]
        assert not third["ok"] and third["code"] == "RESOURCE_EXHAUSTED", third
        assert "review.owner_stores" in third["details"] and "apply or discard" in third["details"], third
        assert sorted(review.iterdir()) == before                    # nothing left of the refused one
        theirs = call(daemon, other, ("create", {"workspace": str(usual_workspace(place.disk / "cap-o", other))}))[0]
        assert theirs["ok"], theirs                                  # another owner's count is its own
        assert call(daemon, owner, ("DiscardChanges", {"session_id": made[0]}))[0]["ok"]
        again = call(daemon, owner, ("create", {"workspace": str(usual_workspace(place.disk / "cap-3b", owner))}))[0]
        assert again["ok"], again
        for user, session in ((owner, made[1]), (owner, str(again["id"])), (other, str(theirs["id"]))):
            call(daemon, user, ("CloseSession", {"session_id": session}))
