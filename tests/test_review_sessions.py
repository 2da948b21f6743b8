"""Review mode in the daemon's sessions (issue 25), from the user's side: gRPC and sandboxctl as
plain users the tests make, on the real kernel.

A review session's commands write into overlays whose change set the daemon keeps under its state
directory: the host stays byte for byte what a control copy holds until a person applies; apply of
one path lands exactly that path; discard makes the sandbox see the host again; a host edit made
during the session is a conflict; planted git hooks are flagged and not applied; other users can
neither list, apply nor discard (the owner can); checkpoints: a rollback returns the sandbox's view
to one (and to the start), apply lands every layer merged, only the owner checkpoints or rolls
back, and only between calls; a SIGKILLed daemon's successor lists the same
change set and the sandbox still sees it; and apply does not follow a symlink another user swapped
into the workspace between listing and apply (control: an apply that follows names writes into
the owner's private directory).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from conftest import BASE_ENV, REPO, SLOW, describe
from daemon_helpers import (Daemon, DaemonFactory, PlainUser, daemon_factory, owned_dir, plain_users,
                            run_client_as)
from review_helpers import CLIENT, EDITS, EXPECTED, free_stores, local_disk, snapshot, tmpfs, usual_workspace
from sandboxd.client import SandboxClient
from sandboxd.printable import printable

pytestmark = pytest.mark.timeout(600)

SANDBOXCTL = str(REPO / ".venv" / "bin" / "sandboxctl")


class Place(NamedTuple):
    factory: DaemonFactory
    daemon: Daemon
    owner: PlainUser
    attacker: PlainUser
    disk: Path                  # where workspaces go: a file system review mode takes as lower


@pytest.fixture(scope="module")
def place() -> Iterator[Place]:
    with plain_users(2) as (owner, attacker), daemon_factory("sbxrsess-") as factory, \
            contextlib.ExitStack() as stack:
        # Where /var/tmp is no local disk (the VM guest: overlays over tmpfs, no loop devices), a tmpfs
        # of the test's own for the workspaces and the daemon's state (1 GiB: the audit log's floor,
        # audit.min_free, is 512 MiB).
        disk = (factory.base if local_disk(str(factory.base))
                else stack.enter_context(tmpfs(factory.base / "disk", size="1g")))
        daemon = factory(args=["--state-dir", str(disk / "state")])
        yield Place(factory, daemon, owner, attacker, disk)
        daemon.close()                              # before its state's tmpfs (if any) is unmounted
        free_stores(disk / "state")                 # the kept change sets' stores (tmpfs mounts)


def fresh(place: Place, name: str) -> Path:
    """A workspace of the owner's with the usual contents."""
    return usual_workspace(place.disk / name, place.owner)


def as_user(place: Place, user: PlainUser, *ops: tuple[str, dict[str, Any]]) -> list[dict[str, Any]]:
    answers: list[dict[str, Any]] = run_client_as(user.uid, user.gid, place.daemon.socket, CLIENT,  # type: ignore[assignment]
                                                  {"ops": [list(op) for op in ops]}, timeout=300 * SLOW)
    return answers


def ok(answer: dict[str, Any]) -> dict[str, Any]:
    assert answer["ok"], answer
    return answer


def create(place: Place, ws: Path, **fields: Any) -> str:
    return str(ok(as_user(place, place.owner, ("create", {"workspace": str(ws), **fields}))[0])["id"])


def listed(place: Place, session: str, user: PlainUser | None = None) -> dict[str, dict[str, Any]]:
    answer = ok(as_user(place, user or place.owner, ("ListChanges", {"session_id": session}))[0])
    return {change.get("path", ""): change for change in answer.get("changes", [])}


def sandboxctl(place: Place, user: PlainUser, *args: str) -> subprocess.CompletedProcess[str]:
    def become() -> None:
        os.setgroups([])
        os.setgid(user.gid)
        os.setuid(user.uid)
    return subprocess.run([SANDBOXCTL, "--socket", place.daemon.socket, *args], capture_output=True, text=True,
                          timeout=300 * SLOW, env=BASE_ENV, cwd="/", preexec_fn=become)


def with_new_txt(place: Place, name: str) -> tuple[Path, str]:
    """A fresh workspace and a review session over it whose sandbox wrote new.txt ("x")."""
    ws = fresh(place, name)
    session = create(place, ws)
    ok(as_user(place, place.owner, ("exec", {"session": session, "script": "echo x > new.txt"}))[0])
    return ws, session


def event_kinds(place: Place, session: str) -> list[str]:
    """The types of the session's audit events, as `sandboxctl events --json` shows them to its owner."""
    events = sandboxctl(place, place.owner, "events", "--session", session, "--json")
    assert events.returncode == 0, describe(events)
    return [str(json.loads(line)["type"]) for line in events.stdout.splitlines()]


def close(place: Place, session: str) -> None:
    as_user(place, place.owner, ("CloseSession", {"session_id": session}))


def test_the_host_is_unchanged_until_apply_which_lands_exactly_one_path_and_discard_restores(place: Place) -> None:
    ws = fresh(place, "ws-main")
    control = snapshot(ws)
    session = create(place, ws)
    ran = ok(as_user(place, place.owner, ("exec", {"session": session, "script": EDITS + "cat mod.txt"}))[0])
    assert ran["status"] == 0 and ran["stdout"] == "changed\n", ran        # the sandbox sees its writes
    assert snapshot(ws) == control                                         # the host: byte for byte as before
    changes = listed(place, session)
    assert {(path, change["kind"].lower().replace("_", " ")) for path, change in changes.items()} == EXPECTED
    assert changes["mod.txt"]["root"] == str(ws.resolve()) and not changes["mod.txt"].get("flags")

    # sandboxctl as the owner shows the same change set, each path escaped, one per line.
    shown = sandboxctl(place, place.owner, "changes", session, "--stat")
    assert shown.returncode == 0 and "12 change(s)" in shown.stdout, describe(shown)
    lines = sandboxctl(place, place.owner, "changes", session, "--json")
    assert {json.loads(line)["path"] for line in lines.stdout.splitlines()} == {path for path, _ in EXPECTED}
    diff = sandboxctl(place, place.owner, "changes", session, "--diff", "mod.txt")
    assert "-old" in diff.stdout and "+changed" in diff.stdout, describe(diff)

    applied = sandboxctl(place, place.owner, "apply", session, "added.txt")
    assert applied.returncode == 0 and applied.stdout.strip() == "applied added.txt", describe(applied)
    after = snapshot(ws)
    assert set(after) - set(control) == {"added.txt"} and (ws / "added.txt").read_text() == "new\n"
    assert {key: value for key, value in after.items() if key != "added.txt"} == control
    assert after["added.txt"][2] == place.owner.uid                        # written as the owner, never root

    dropped = sandboxctl(place, place.owner, "discard", session)
    assert dropped.returncode == 0 and "discarded mod.txt" in dropped.stdout, describe(dropped)
    seen = ok(as_user(place, place.owner, ("exec", {"session": session, "script": "cat mod.txt; ls"}))[0])
    assert seen["stdout"].split("\n", 1)[0] == "old"                       # the host's content again
    assert "olddir" in seen["stdout"] and "newdir" not in seen["stdout"], seen
    assert listed(place, session) == {}
    assert snapshot(ws) == after
    kinds = event_kinds(place, session)
    assert "ChangesApplied" in kinds and "ChangesDiscarded" in kinds, kinds
    close(place, session)


def test_a_host_edit_during_the_session_is_a_conflict(place: Place) -> None:
    ws = fresh(place, "ws-conflict")
    session = create(place, ws)
    ok(as_user(place, place.owner, ("exec", {"session": session, "script": "echo mine > mod.txt; echo k > keep2"}))[0])
    # Control: untouched on the host, the sandbox's change is no conflict.
    assert not listed(place, session)["mod.txt"].get("conflict")
    subprocess.run(["sh", "-c", f"echo theirs > {ws}/mod.txt"], check=True, user=place.owner.uid,
                   group=place.owner.gid, extra_groups=[], timeout=60)
    changes = listed(place, session)
    assert changes["mod.txt"].get("conflict") and not changes["keep2"].get("conflict"), changes
    skipped = ok(as_user(place, place.owner, ("ApplyChanges", {"session_id": session}))[0])
    assert [item["path"] for item in skipped.get("skipped", [])] == ["mod.txt"], skipped
    assert "conflict" in skipped["skipped"][0]["reason"]
    assert (ws / "mod.txt").read_text() == "theirs\n" and (ws / "keep2").read_text() == "k\n"
    forced = ok(as_user(place, place.owner, ("ApplyChanges", {"session_id": session, "paths": ["mod.txt"],
                                                              "force": True}))[0])
    assert [item["path"] for item in forced.get("applied", [])] == ["mod.txt"], forced
    assert (ws / "mod.txt").read_text() == "mine\n"
    close(place, session)


def test_a_planted_hook_is_flagged_and_applied_only_when_named(place: Place) -> None:
    ws = fresh(place, "ws-hook")
    for part in ("repo", "repo/.git", "repo/.git/objects", "repo/.git/refs"):
        owned_dir(ws / part, place.owner)
    (ws / "repo/.git/HEAD").write_text("ref: refs/heads/main\n")      # a checkout of the owner's, no hooks yet
    session = create(place, ws)
    plant = ("mkdir -p repo/.git/hooks && printf '#!/bin/sh\\ntouch /tmp/pwned\\n' > repo/.git/hooks/x && "
             "chmod 755 repo/.git/hooks/x && echo fine > ordinary.txt")
    ran = ok(as_user(place, place.owner, ("exec", {"session": session, "script": plant}))[0])
    assert ran["status"] == 0, ran
    changes = listed(place, session)
    assert changes["repo/.git/hooks/x"].get("flags"), changes["repo/.git/hooks/x"]
    shown = sandboxctl(place, place.owner, "changes", session, "repo/.git/hooks/x")
    assert "[flagged:" in shown.stdout, describe(shown)
    result = sandboxctl(place, place.owner, "apply", session)
    assert result.returncode == 1 and "skipped repo/.git/hooks: flagged: a git hook" in result.stdout, \
        describe(result)
    assert "skipped repo/.git/hooks/x: its directory repo/.git/hooks was not applied" in result.stdout
    assert (ws / "ordinary.txt").read_text() == "fine\n"                  # control: the rest was applied
    assert not (ws / "repo" / ".git" / "hooks" / "x").exists()
    named = sandboxctl(place, place.owner, "apply", session, "repo/.git/hooks", "--include-flagged",
                       "repo/.git/hooks", "--include-flagged", "repo/.git/hooks/x")
    assert named.returncode == 0 and (ws / "repo" / ".git" / "hooks" / "x").exists(), describe(named)
    close(place, session)


def test_another_user_can_neither_list_apply_nor_discard(place: Place) -> None:
    ws, session = with_new_txt(place, "ws-other")
    tried = as_user(place, place.attacker, ("ListChanges", {"session_id": session}),
                    ("DiffChanges", {"session_id": session}),
                    ("ApplyChanges", {"session_id": session}), ("DiscardChanges", {"session_id": session}))
    assert [answer.get("code") for answer in tried] == ["NOT_FOUND"] * 4, tried
    assert not (ws / "new.txt").exists()
    assert set(listed(place, session)) == {"new.txt"}                      # control: the owner can
    ok(as_user(place, place.owner, ("ApplyChanges", {"session_id": session}))[0])
    assert (ws / "new.txt").read_text() == "x\n"
    close(place, session)


def test_bad_requests_are_refused_saying_what_to_fix(place: Place) -> None:
    ws = fresh(place, "ws-bad")
    direct = create(place, ws, review=False)
    refused = as_user(place, place.owner, ("ListChanges", {"session_id": direct}),
                      ("create", {"workspace": str(ws), "mode": "DANGER_FULL_ACCESS"}))
    assert refused[0]["code"] == "FAILED_PRECONDITION" and "not in review mode" in refused[0]["details"]
    assert refused[1]["code"] == "INVALID_ARGUMENT" and "workspace-write" in refused[1]["details"], refused
    session = create(place, ws)
    bad = as_user(place, place.owner, ("ListChanges", {"session_id": session, "paths": ["/etc/passwd"]}),
                  ("ListChanges", {"session_id": session, "paths": ["../outside"]}),
                  ("ListChanges", {"session_id": session, "page_size": 100_000}),
                  ("UpdateSessionPolicy", {"session_id": session,
                                           "sandbox_policy": {"mode": "READ_ONLY"}}))
    assert [answer.get("code") for answer in bad] == ["INVALID_ARGUMENT"] * 3 + ["FAILED_PRECONDITION"], bad
    assert "not under one of the session's roots" in bad[0]["details"]
    close(place, session)
    close(place, direct)


def test_a_killed_daemon_keeps_the_change_set(place: Place) -> None:
    ws = fresh(place, "ws-restart")
    session = create(place, ws)
    ok(as_user(place, place.owner, ("exec", {"session": session, "script": "echo kept > added.txt; rm del.txt"}))[0])
    before = listed(place, session)
    assert set(before) == {"added.txt", "del.txt"}
    place.daemon.kill()
    place.daemon.start()
    assert listed(place, session) == before
    seen = ok(as_user(place, place.owner, ("exec", {"session": session, "script": "cat added.txt; ls"}))[0])
    assert seen["stdout"].startswith("kept\n") and "del.txt" not in seen["stdout"], seen
    assert not (ws / "added.txt").exists() and (ws / "del.txt").exists()
    close(place, session)
    assert (place.disk / "state" / "review" / session / "layers.json").exists()   # pending changes stay


def test_apply_does_not_follow_a_symlink_swapped_in_between_listing_and_apply(place: Place) -> None:
    ws = fresh(place, "ws-swap")
    shared = ws / "shared"
    shared.mkdir(mode=0o777)
    os.chmod(shared, 0o777)                        # a directory other users may rename in (no sticky bit)
    inner = owned_dir(shared / "inner", place.owner)
    private = owned_dir(place.disk / "owner-private", place.owner)
    os.chmod(private, 0o700)
    session = create(place, ws)
    ok(as_user(place, place.owner, ("exec", {"session": session, "script": "echo planted > shared/inner/p.txt"}))[0])
    assert set(listed(place, session)) == {"shared/inner/p.txt"}
    # The attacker (not the owner) swaps the directory for a symlink to the owner's private one.
    swap = f"mv {inner} {shared}/gone && ln -s {private} {inner}"
    subprocess.run(["sh", "-c", swap], check=True, user=place.attacker.uid, group=place.attacker.gid,
                   extra_groups=[], timeout=60)
    # Control: an apply that follows names, as the owner, writes into the owner's private directory.
    subprocess.run(["sh", "-c", f"echo planted > {inner}/p.txt"], check=True, user=place.owner.uid,
                   group=place.owner.gid, extra_groups=[], timeout=60)
    assert (private / "p.txt").read_text() == "planted\n"
    (private / "p.txt").unlink()
    # The daemon's apply: the swap is a conflict (skipped, saying so), and forced it replaces the
    # symlink with the sandbox's directory: never written through it.
    result = ok(as_user(place, place.owner, ("ApplyChanges", {"session_id": session}))[0])
    reasons = {item["path"]: item["reason"] for item in result.get("skipped", [])}
    assert "conflict" in reasons["shared/inner"] and "shared/inner/p.txt" in reasons, result
    assert os.listdir(private) == []
    forced = ok(as_user(place, place.owner, ("ApplyChanges", {"session_id": session, "force": True}))[0])
    assert {item["path"] for item in forced.get("applied", [])} == {"shared/inner", "shared/inner/p.txt"}, forced
    assert os.listdir(private) == [] and not (shared / "inner").is_symlink()
    assert (shared / "inner" / "p.txt").read_text() == "planted\n"
    close(place, session)
    shutil.rmtree(private)


def test_discard_and_apply_wait_for_the_session_to_be_between_calls(place: Place) -> None:
    ws = fresh(place, "ws-busy")
    session = create(place, ws)
    ok(as_user(place, place.owner, ("exec", {"session": session, "script": "echo x > new.txt"}))[0])
    job = ok(as_user(place, place.owner, ("StartBackground", {"session_id": session, "argv": ["sleep", "600"],
                                                              "name": "sleeper"}))[0])
    refused = as_user(place, place.owner, ("DiscardChanges", {"session_id": session}))[0]
    assert refused.get("code") == "FAILED_PRECONDITION" and "'sleeper'" in refused["details"], refused
    # Apply too (a running process could swap a file between the person's diff and the apply, and
    # watch the apply read it): refused, and nothing reached the host.
    refused = as_user(place, place.owner, ("ApplyChanges", {"session_id": session}))[0]
    assert refused.get("code") == "FAILED_PRECONDITION" and "'sleeper'" in refused["details"], refused
    assert not (ws / "new.txt").exists()
    ran = ok(as_user(place, place.owner, ("exec", {"session": session, "script": "cat new.txt"}))[0])
    assert ran["stdout"] == "x\n"                                          # nothing was dropped
    ok(as_user(place, place.owner, ("StopBackground", {"session_id": session, "id": job["id"]}))[0])
    dropped = ok(as_user(place, place.owner, ("DiscardChanges", {"session_id": session}))[0])  # control: idle
    assert [item["path"] for item in dropped.get("discarded", [])] == ["new.txt"], dropped
    gone = ok(as_user(place, place.owner, ("exec", {"session": session, "script": "ls"}))[0])
    assert "new.txt" not in gone["stdout"], gone
    kept = place.disk / "state" / "review" / session
    assert kept.is_dir()
    close(place, session)
    assert not kept.exists()                       # closed with nothing in its change set: removed


def test_sandboxctl_prints_the_names_a_sandbox_chose_escaped(place: Place) -> None:
    ws = fresh(place, "ws-names")
    session = create(place, ws)
    ok(as_user(place, place.owner, ("exec", {"session": session,
                                             "script": "printf 'x\\n' > \"$(printf 'evil\\n\\033[31mname')\""}))[0])
    shown = sandboxctl(place, place.owner, "changes", session)
    assert shown.returncode == 0 and "\x1b" not in shown.stdout, describe(shown)
    assert shown.stdout.splitlines() == ["A evil\\n\\x1b[31mname"], describe(shown)
    diff = sandboxctl(place, place.owner, "changes", session, "--diff")
    # The daemon's diff names the path escaped (one header line), and sandboxctl escapes each line again.
    assert "\x1b" not in diff.stdout and diff.stdout.splitlines() == [
        "--- /dev/null", "+++ b/evil\\\\n\\\\x1b[31mname", "@@ -0,0 +1 @@", "+x"], describe(diff)
    close(place, session)


def test_review_is_refused_in_one_line_where_the_lower_cannot_be_one(place: Place) -> None:
    layers = place.disk / "ovl-layers"
    for name in ("lower", "upper", "work"):
        (layers / name).mkdir(parents=True)
    merged = place.disk / "ovl-merged"
    merged.mkdir()
    subprocess.run(["mount", "-t", "overlay", "sbxrsess-ovl", "-o", f"lowerdir={layers}/lower,upperdir={layers}/upper,"
                    f"workdir={layers}/work", str(merged)], check=True, capture_output=True, timeout=60)
    try:
        ws = owned_dir(merged / "ws", place.owner)
        kept = place.disk / "state" / "review"
        before = set(os.listdir(kept)) if kept.exists() else set()
        refused = as_user(place, place.owner, ("create", {"workspace": str(ws)}))[0]
        assert refused.get("code") == "INVALID_ARGUMENT" and "overlayfs" in refused["details"], refused
        assert "\n" not in refused["details"]
        assert (set(os.listdir(kept)) if kept.exists() else set()) == before     # nothing left of it
        direct = create(place, ws, review=False)                               # control: direct mode works
        close(place, direct)
    finally:
        subprocess.run(["umount", "-l", str(merged)], check=True, capture_output=True, timeout=60)


def sees(place: Place, session: str) -> set[str]:
    """What the sandbox sees of its workspace: each entry's name and a file's content, one line each."""
    return set(str(ok(as_user(place, place.owner, ("exec", {"session": session, "script": (
        "for f in $(ls -A | sort); do if [ -f \"$f\" ] && [ ! -L \"$f\" ]; then echo \"$f=$(cat \"$f\")\"; "
        "else echo \"$f\"; fi; done")}))[0])["stdout"]).splitlines())


def test_rollback_returns_the_sandbox_to_a_checkpoint_and_apply_lands_every_layer(place: Place) -> None:
    ws = fresh(place, "ws-checkpoints")
    control = snapshot(ws)
    session = create(place, ws)
    start = sees(place, session)
    assert "del.txt=delete me" in start and "a.txt=A" not in start, start
    run = lambda script: ok(as_user(place, place.owner, ("exec", {"session": session, "script": script}))[0])  # noqa: E731
    run("echo A > a.txt")
    first = ok(as_user(place, place.owner, ("CreateCheckpoint", {"session_id": session, "label": "one\x1b[2J"}))[0])
    assert int(first["id"]) == 1 and int(first["changes"]) == 1 and first["label"] == "one\x1b[2J", first
    run("echo B > b.txt; rm del.txt")
    second = ok(as_user(place, place.owner, ("CreateCheckpoint", {"session_id": session}))[0])
    assert int(second["id"]) == 2 and int(second["changes"]) == 2, second
    run("echo C > c.txt")
    at_two = sees(place, session)
    listing = ok(as_user(place, place.owner, ("ListCheckpoints", {"session_id": session}))[0])
    assert [int(item["id"]) for item in listing["checkpoints"]] == [1, 2], listing
    shown = sandboxctl(place, place.owner, "checkpoints", session)    # the label a client chose: escaped
    lines = shown.stdout.splitlines()
    assert shown.returncode == 0 and len(lines) == 2 and "\x1b" not in shown.stdout, describe(shown)
    assert lines[0].startswith("1  ") and lines[0].endswith("1 change(s)  " + printable("one\x1b[2J")), lines

    back = ok(as_user(place, place.owner, ("RollbackChanges", {"session_id": session, "checkpoint_id": 2}))[0])
    assert int(back["checkpoint_id"]) == 2 and [int(item["id"]) for item in back["checkpoints"]] == [1, 2], back
    seen = sees(place, session)
    assert seen == at_two - {"c.txt=C"} and {"a.txt=A", "b.txt=B"} <= seen, (seen, at_two)
    assert seen == start - {"del.txt=delete me"} | {"a.txt=A", "b.txt=B"}, seen
    assert {path: change["kind"] for path, change in listed(place, session).items()} == {
        "a.txt": "ADDED", "b.txt": "ADDED", "del.txt": "DELETED"}
    assert snapshot(ws) == control                                         # the host: untouched throughout

    rolled = sandboxctl(place, place.owner, "rollback", session, "0")
    assert rolled.returncode == 0 and "rolled back to the start (dropped 2" in rolled.stdout, describe(rolled)
    assert sees(place, session) == start and listed(place, session) == {}
    again = ok(as_user(place, place.owner, ("ListCheckpoints", {"session_id": session}))[0])
    assert again.get("checkpoints", []) == [], again
    gone = as_user(place, place.owner, ("RollbackChanges", {"session_id": session, "checkpoint_id": 1}))[0]
    assert gone.get("code") == "NOT_FOUND", gone                           # a rolled-back id names no state

    # Checkpoints again (ids go on: never reused), then apply: the host gets every layer merged.
    run("echo A > a.txt; echo keep > mod.txt")
    third = ok(as_user(place, place.owner, ("CreateCheckpoint", {"session_id": session}))[0])
    assert int(third["id"]) == 3, third
    run("echo A2 > a.txt; echo B > b.txt; rm del.txt")
    marked = sandboxctl(place, place.owner, "checkpoint", session, "--label", "four")
    assert marked.returncode == 0 and marked.stdout.startswith("4  ") and "four" in marked.stdout, describe(marked)
    run("echo C > c.txt; rm b.txt")
    merged = sees(place, session)
    shown = ok(as_user(place, place.owner, ("DiffChanges", {"session_id": session, "paths": ["a.txt", "mod.txt"]}))[0])
    assert "+A2" in shown["diff"] and "+A\n" not in shown["diff"] and "+keep" in shown["diff"], shown  # each from its layer
    applied = ok(as_user(place, place.owner, ("ApplyChanges", {"session_id": session}))[0])
    assert {item["path"] for item in applied.get("applied", [])} == {"a.txt", "c.txt", "mod.txt", "del.txt"}, applied
    after = snapshot(ws)
    assert set(after) == (set(control) - {"del.txt"}) | {"a.txt", "c.txt"}
    assert (ws / "a.txt").read_text() == "A2\n" and (ws / "c.txt").read_text() == "C\n"
    assert (ws / "mod.txt").read_text() == "keep\n"
    assert {key: value for key, value in after.items() if key not in ("a.txt", "c.txt", "mod.txt")} == \
        {key: value for key, value in control.items() if key not in ("del.txt", "mod.txt")}
    assert sees(place, session) == merged and listed(place, session) == {}

    kinds = event_kinds(place, session)
    assert kinds.count("CheckpointCreated") == 4 and kinds.count("ChangesRolledBack") == 2, kinds
    close(place, session)


def test_only_the_owner_checkpoints_and_rolls_back_and_only_between_calls(place: Place) -> None:
    _, session = with_new_txt(place, "ws-checkpoint-rights")
    tried = as_user(place, place.attacker, ("CreateCheckpoint", {"session_id": session}),
                    ("ListCheckpoints", {"session_id": session}),
                    ("RollbackChanges", {"session_id": session, "checkpoint_id": 0}))
    assert [answer.get("code") for answer in tried] == ["NOT_FOUND"] * 3, tried
    made = ok(as_user(place, place.owner, ("CreateCheckpoint", {"session_id": session}))[0])  # control: the owner
    assert int(made["id"]) == 1, made
    ok(as_user(place, place.owner, ("exec", {"session": session, "script": "echo y > later.txt"}))[0])

    long = as_user(place, place.owner, ("CreateCheckpoint", {"session_id": session, "label": "x" * 257}))[0]
    assert long.get("code") == "INVALID_ARGUMENT" and "256" in long["details"], long

    job = ok(as_user(place, place.owner, ("StartBackground", {"session_id": session, "argv": ["sleep", "600"],
                                                              "name": "sleeper"}))[0])
    refused = as_user(place, place.owner, ("RollbackChanges", {"session_id": session, "checkpoint_id": 0}),
                      ("CreateCheckpoint", {"session_id": session}))
    assert [answer.get("code") for answer in refused] == ["FAILED_PRECONDITION"] * 2, refused
    assert all("'sleeper'" in answer["details"] for answer in refused), refused
    ran = ok(as_user(place, place.owner, ("exec", {"session": session, "script": "cat new.txt later.txt"}))[0])
    assert ran["stdout"] == "x\ny\n", ran                                  # nothing was dropped
    ok(as_user(place, place.owner, ("StopBackground", {"session_id": session, "id": job["id"]}))[0])
    ok(as_user(place, place.owner, ("RollbackChanges", {"session_id": session, "checkpoint_id": 1}))[0])  # idle
    ran = ok(as_user(place, place.owner, ("exec", {"session": session, "script": "ls"}))[0])
    assert "new.txt" in ran["stdout"] and "later.txt" not in ran["stdout"], ran
    close(place, session)
    closed = as_user(place, place.owner, ("CreateCheckpoint", {"session_id": session}))[0]
    assert closed.get("code") == "FAILED_PRECONDITION" and "closed" in closed["details"], closed
    ok(as_user(place, place.owner, ("DiscardChanges", {"session_id": session}))[0])


def test_an_apply_of_what_a_person_reviewed_skips_what_changed_or_appeared_since(place: Place) -> None:
    """ApplyChanges with the fingerprints a person was shown (ListChanges, DiffChanges) applies those
    changes only as shown: a file rewritten after the review, even back to a same-size text, and a
    file made after it, are skipped and stay pending. Control: the same apply with what is current."""
    ws = fresh(place, "ws-reviewed")
    session = create(place, ws)
    ok(as_user(place, place.owner, ("exec", {"session": session, "script": "echo safe > a.txt; echo keep > b.txt"}))[0])
    shown = listed(place, session)
    assert len(shown["a.txt"]["fingerprint"]) == 64, shown
    diffed = ok(as_user(place, place.owner, ("DiffChanges", {"session_id": session, "paths": ["b.txt"]}))[0])
    assert "+keep" in diffed["diff"] and [(item["path"], item["fingerprint"]) for item in diffed["shown"]] == [
        ("b.txt", shown["b.txt"]["fingerprint"])], diffed       # the diff vouches for what it showed
    seen = [{"root": change["root"], "path": path, "fingerprint": change["fingerprint"]}
            for path, change in shown.items()]
    # What a process of the session does after the review (then ends: apply waits for that).
    ok(as_user(place, place.owner, ("exec", {"session": session, "script": "echo evil > a.txt; echo new > c.txt"}))[0])
    applied = ok(as_user(place, place.owner, ("ApplyChanges", {"session_id": session, "reviewed": seen}))[0])
    assert [item["path"] for item in applied.get("applied", [])] == ["b.txt"], applied
    reasons = {item["path"]: item["reason"] for item in applied.get("skipped", [])}
    assert reasons == {"a.txt": "changed since it was reviewed: review it again",
                       "c.txt": "not among the changes reviewed: review it, then apply it"}, applied
    assert (ws / "b.txt").read_text() == "keep\n" and not (ws / "a.txt").exists() and not (ws / "c.txt").exists()
    assert set(listed(place, session)) == {"a.txt", "c.txt"}                 # the skipped stay pending
    # Nothing reviewed, nothing applied; then, control: what is current applies.
    nothing = ok(as_user(place, place.owner, ("ApplyChanges", {"session_id": session, "only_reviewed": True}))[0])
    assert not nothing.get("applied") and len(nothing.get("skipped", [])) == 2, nothing
    current = [{"root": change["root"], "path": path, "fingerprint": change["fingerprint"]}
               for path, change in listed(place, session).items()]
    control = ok(as_user(place, place.owner, ("ApplyChanges", {"session_id": session, "reviewed": current}))[0])
    assert sorted(item["path"] for item in control.get("applied", [])) == ["a.txt", "c.txt"], control
    assert (ws / "a.txt").read_text() == "evil\n"
    # sandboxctl: `changes --json` is what `apply --reviewed` reads.
    ok(as_user(place, place.owner, ("exec", {"session": session, "script": "echo d1 > d.txt"}))[0])
    listing = sandboxctl(place, place.owner, "changes", session, "--json")
    assert listing.returncode == 0, describe(listing)
    saved = place.disk / "reviewed.json"
    saved.write_text(listing.stdout)
    os.chmod(saved, 0o644)
    ok(as_user(place, place.owner, ("exec", {"session": session, "script": "echo d2 > d.txt"}))[0])
    stale = sandboxctl(place, place.owner, "apply", session, "--reviewed", str(saved))
    assert stale.returncode == 1 and "skipped d.txt: changed since it was reviewed" in stale.stdout, describe(stale)
    assert not (ws / "d.txt").exists()
    # Bad fingerprints, roots and paths are INVALID_ARGUMENT saying what to pass.
    root = str(ws.resolve())
    bad = as_user(place, place.owner,
                  ("ApplyChanges", {"session_id": session, "reviewed": [{"root": root, "path": "d.txt",
                                                                         "fingerprint": "zz"}]}),
                  ("ApplyChanges", {"session_id": session, "reviewed": [{"root": "/etc", "path": "passwd",
                                                                         "fingerprint": "0" * 64}]}),
                  ("ApplyChanges", {"session_id": session, "reviewed": [{"root": root, "path": "../x",
                                                                         "fingerprint": "0" * 64}]}))
    assert [answer.get("code") for answer in bad] == ["INVALID_ARGUMENT"] * 3, bad
    assert all("pass what ListChanges or DiffChanges gave" in answer["details"] for answer in bad), bad
    close(place, session)


def test_a_call_may_mark_a_checkpoint_before_it_runs_which_rolls_it_back(place: Place) -> None:
    """ExecStart.checkpoint (sandboxctl exec --checkpoint): a checkpoint labelled with the call,
    made before it runs when anything changed since the last one; rolling back to it undoes that
    call and those after. With a background process running it is skipped (audited), the call runs."""
    ws = fresh(place, "ws-call-checkpoints")
    session = create(place, ws)

    def call(script: str) -> subprocess.CompletedProcess[str]:
        ran = sandboxctl(place, place.owner, "exec", "--checkpoint", session, "--", "sh", "-c", script)
        assert ran.returncode == 0, describe(ran)
        return ran

    call("echo one > a.txt")                    # nothing changed before it: no point to mark
    checkpoints = ok(as_user(place, place.owner, ("ListCheckpoints", {"session_id": session}))[0])
    assert checkpoints.get("checkpoints", []) == [], checkpoints
    call("echo two > b.txt")
    call("rm a.txt; echo three > c.txt")
    marked = ok(as_user(place, place.owner, ("ListCheckpoints", {"session_id": session}))[0])["checkpoints"]
    assert [int(item["id"]) for item in marked] == [1, 2] and [int(item["changes"]) for item in marked] == [1, 1], marked
    events = sandboxctl(place, place.owner, "events", "--session", session, "--json")
    calls = [json.loads(line)["call_id"] for line in events.stdout.splitlines()
             if json.loads(line)["type"] == "ToolInvocationStarted"]
    assert [item["call_id"] for item in marked] == calls[1:], (marked, calls)     # the 2nd and 3rd calls
    assert all(item["label"].startswith(f"before {item['call_id']}: ") for item in marked), marked
    listing = sandboxctl(place, place.owner, "checkpoints", session)
    assert f"before {calls[2]}: " in listing.stdout, describe(listing)

    back = ok(as_user(place, place.owner, ("RollbackChanges", {"session_id": session, "checkpoint_id": 2}))[0])
    assert int(back["checkpoint_id"]) == 2, back                            # before the third call
    seen = sees(place, session)
    assert {"a.txt=one", "b.txt=two"} <= seen and "c.txt=three" not in seen, seen

    # A background process runs: no checkpoint can be made, the call still runs, the log says why.
    ok(as_user(place, place.owner, ("exec", {"session": session, "script": "echo changed > e.txt"}))[0])
    job = ok(as_user(place, place.owner, ("StartBackground", {"session_id": session, "argv": ["sleep", "600"],
                                                              "name": "sleeper"}))[0])
    call("echo four > d.txt")
    after = ok(as_user(place, place.owner, ("ListCheckpoints", {"session_id": session}))[0])["checkpoints"]
    assert [int(item["id"]) for item in after] == [1, 2], after
    events = sandboxctl(place, place.owner, "events", "--session", session, "--json")
    skipped = [json.loads(line) for line in events.stdout.splitlines()
               if json.loads(line)["type"] == "CheckpointCreated" and "skipped" in json.loads(line).get("data", {})]
    assert len(skipped) == 1 and "'sleeper'" in skipped[0]["data"]["skipped"], skipped
    ok(as_user(place, place.owner, ("StopBackground", {"session_id": session, "id": job["id"]}))[0])

    # A direct session has no change set to mark: refused before anything runs.
    direct = create(place, fresh(place, "ws-call-checkpoints-direct"), review=False)
    refused = sandboxctl(place, place.owner, "exec", "--checkpoint", direct, "--", "sh", "-c", "echo x > ran")
    assert refused.returncode != 0 and "not in review mode" in refused.stderr, describe(refused)
    assert not (place.disk / "ws-call-checkpoints-direct" / "ran").exists()
    close(place, session)
    close(place, direct)


def test_no_session_of_the_user_rewrites_a_change_set_kept_for_their_review(place: Place) -> None:
    """A user's kept `sandboxd run --review` change sets (~/.local/state/sandboxd/reviews, by their
    home in the user database) are hidden in every session of theirs, even one whose workspace is
    their home. Control: beside them, a directory of theirs is written as usual."""
    home = owned_dir(place.disk / "home-of-owner", place.owner)
    state = home
    for name in (".local", "state", "sandboxd", "reviews", "kept-1"):
        state = owned_dir(state / name, place.owner)
    (state / "record").write_text("the root it applies to\n")
    os.chown(state / "record", place.owner.uid, place.owner.gid)
    other = owned_dir(home / ".local" / "state" / "sandboxd" / "other", place.owner)
    usual = subprocess.run(["getent", "passwd", place.owner.name], capture_output=True, text=True, check=True)
    subprocess.run(["usermod", "-d", str(home), place.owner.name], check=True, capture_output=True)
    try:
        session = create(place, home, review=False)
        ran = ok(as_user(place, place.owner, ("exec", {"session": session, "script": (
            "echo listed: $(ls -A .local/state/sandboxd/reviews); "
            "echo evil > .local/state/sandboxd/reviews/kept-1/record; echo control > .local/state/sandboxd/other/x")}))[0])
        assert ran["stdout"] == "listed:\n", ran
        assert (state / "record").read_text() == "the root it applies to\n"
        assert (other / "x").read_text() == "control\n"                            # the control
        close(place, session)
    finally:
        subprocess.run(["usermod", "-d", usual.stdout.split(":")[5], place.owner.name], check=True, capture_output=True)


def test_a_name_that_is_no_utf8_is_listed_named_and_applied(place: Place) -> None:
    """A file name is bytes the sandbox chose: one that is no UTF-8 is listed as `\\xHH` escapes
    (never INTERNAL), and that name, given back, applies exactly that file."""
    ws = fresh(place, "ws-bytes")
    session = create(place, ws)
    ok(as_user(place, place.owner, ("exec", {"session": session, "script": "echo ok > good.txt; echo bad > \"$(printf 'x\\377y')\""}))[0])
    changes = listed(place, session)
    assert set(changes) == {"good.txt", "x\\xffy"}, changes
    shown = sandboxctl(place, place.owner, "changes", session)
    assert shown.returncode == 0 and "good.txt" in shown.stdout, describe(shown)
    applied = ok(as_user(place, place.owner, ("ApplyChanges", {"session_id": session, "paths": ["x\\xffy"]}))[0])
    assert [item["path"] for item in applied.get("applied", [])] == ["x\\xffy"], applied
    assert (ws / os.fsdecode(b"x\xffy")).read_text() == "bad\n" and not (ws / "good.txt").exists()
    assert set(listed(place, session)) == {"good.txt"}
    close(place, session)


def test_an_apply_cut_short_by_a_killed_daemon_is_in_the_audit_log(place: Place) -> None:
    """The review child finishes an apply the daemon started even when the daemon is SIGKILLed
    meanwhile: the log says it started (with its paths) before anything reached the host, so what
    landed is never missing from it. Control: an apply that ends says what landed as well."""
    import threading
    ws = fresh(place, "ws-apply-killed")
    session = create(place, ws)
    ok(as_user(place, place.owner, ("exec", {"session": session, "script": (
        "mkdir big && for i in $(seq 1 200); do head -c 131072 /dev/urandom > big/f$i; done")}))[0])
    answers: list[Any] = []
    applying = threading.Thread(target=lambda: answers.append(
        as_user(place, place.owner, ("ApplyChanges", {"session_id": session}))))
    applying.start()
    for _ in range(6000):
        if (ws / "big").is_dir() and len(os.listdir(ws / "big")) > 5:
            break
        threading.Event().wait(0.01)
    place.daemon.kill()
    applying.join(timeout=300 * SLOW)
    place.daemon.start()
    started = [json.loads(line) for line in sandboxctl(place, place.owner, "events", "--session", session,
                                                       "--json").stdout.splitlines()
               if json.loads(line)["type"] == "ChangesApplied"]
    assert started and started[0]["data"].get("phase") == "started", started
    assert started[0]["data"]["paths"] == ["(all)"], started
    # Control: an apply that ends records its start and then what landed.
    ok(as_user(place, place.owner, ("exec", {"session": session, "script": "echo again > again.txt"}))[0])
    ok(as_user(place, place.owner, ("ApplyChanges", {"session_id": session, "paths": ["again.txt"]}))[0])
    events = [json.loads(line) for line in sandboxctl(place, place.owner, "events", "--session", session,
                                                      "--json").stdout.splitlines()
              if json.loads(line)["type"] == "ChangesApplied"]
    assert [event["data"].get("phase", "done") for event in events[-2:]] == ["started", "done"], events
    assert events[-1]["data"]["applied"] == [{"root": str(ws.resolve()), "path": "again.txt", "kind": "added",
                                              "sha256": events[-1]["data"]["applied"][0]["sha256"]}], events
    close(place, session)


def test_what_reviewed_covers_at_its_edges(place: Place) -> None:
    """The third hostile pass's edges of `reviewed`: a file past a listing's hash budget applies as
    listed (its upper entry vouches for it); a diff cut short vouches for nothing; more changes than
    one request carries are applied in parts by sandboxd.client; a root's own mode change is kept
    at the close."""
    ws = fresh(place, "ws-reviewed-edges")
    session = create(place, ws)
    ok(as_user(place, place.owner, ("exec", {"session": session, "script": (
        "truncate -s 300M big; seq 1 6000 > long.txt; mkdir many; cd many; seq -f 'f%05g' 1 2500 | xargs touch")}))[0])
    with SandboxClient(place.daemon.socket) as root:
        changes, unhashed = root.list_changes(session)
        by_path = {change.path: change for change in changes}
        assert unhashed >= 1 and by_path["big"].sha256 == "", by_path["big"]
        diffed: dict[tuple[str, str], str] = {}
        text = "".join(root.diff_changes(session, ["long.txt"], seen=diffed))
        assert "more lines" in text and diffed == {}, (text[-200:], diffed)      # cut short: not vouched for
        seen = {(change.root, change.path): change.fingerprint for change in changes}
        assert len(seen) > 2_000
        answer = root.apply_changes(session, reviewed=seen)
        assert not answer.skipped, answer.skipped[:5]
        assert {item.path for item in answer.applied} >= {"big", "long.txt", "many", "many/f02500"}
    assert (ws / "big").stat().st_size == 300 << 20 and len(os.listdir(ws / "many")) == 2500
    ok(as_user(place, place.owner, ("exec", {"session": session, "script": "chmod 700 ."}))[0])
    assert listed(place, session)[""]["kind"] == "METADATA"
    close(place, session)
    assert listed(place, session)[""]["kind"] == "METADATA"                 # kept after the close
    ok(as_user(place, place.owner, ("DiscardChanges", {"session_id": session}))[0])
