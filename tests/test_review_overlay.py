"""Review mode's kernel and library core (issue 25): the overlay mount, the change set, conflicts,
apply and discard, on the real kernel.

A `sandboxd run --review=keep:DIR` (experimental flag) builds the sandbox exactly as a one-shot
run does, with each writable root covered by an overlay whose upper layer is kept in DIR. Its
command creates, modifies, deletes, renames, chmods, symlinks and replaces a directory; the host
workspace must be byte for byte what a control copy holds, and the change set must list exactly
those changes. Apply runs as the workspace's owner in a forked child that dropped every privilege
(as the daemon will run it), from upper entries read as root (overlay's trusted.* attributes).
Attacks are made by plain users the tests create, each next to its control.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest

from conftest import BASE_ENV, PY, REPO, SANDBOXD, SLOW, describe, make_dir
from daemon_helpers import PlainUser, owned_dir, plain_users
from review_helpers import EDITS, EXPECTED, as_owner, kinds, review_base, scan_kept, snapshot, usual_workspace
from sandboxd.kernel import overlay
from sandboxd.review import apply as applying
from sandboxd.review import changes as listing
from sandboxd.review import conflicts, rules

pytestmark = pytest.mark.timeout(300)


class Place(NamedTuple):
    owner: PlainUser            # owns the workspace; the sandbox's commands run as it
    attacker: PlainUser
    base: Path                  # 0755, root's


@pytest.fixture(scope="module")
def place() -> Iterator[Place]:
    with plain_users(2) as (owner, attacker), review_base() as base:
        yield Place(owner, attacker, base)


def fresh(place: Place, name: str) -> tuple[Path, Path]:
    """A workspace of the owner's (with the usual contents) and the path of a review directory."""
    return usual_workspace(place.base / name, place.owner), place.base / f"{name}-review"


def review_run(ws: Path, review_dir: Path, script: str, *extra: str) -> subprocess.CompletedProcess[str]:
    """`sandboxd run --review=keep:DIR` as root (the command runs as the workspace's owner)."""
    return subprocess.run([SANDBOXD, "run", f"--review=keep:{review_dir}", "--workspace", str(ws), *extra,
                           "--", "sh", "-c", script], capture_output=True, text=True, timeout=120 * SLOW,
                          stdin=subprocess.DEVNULL, env=BASE_ENV, cwd=str(ws))


def test_the_host_stays_unchanged_and_the_change_set_is_exact(place: Place) -> None:
    ws, review_dir = fresh(place, "exact")
    control = snapshot(ws)
    result = review_run(ws, review_dir, EDITS + "cat mod.txt; ls replaced; ls newdir; test ! -e del.txt\n")
    assert result.returncode == 0, describe(result)
    # What the command saw: a normal writable workspace.
    assert result.stdout.split() == ["changed", "z", "n"]
    assert snapshot(ws) == control                              # the host: byte for byte as before
    listed = as_owner(place.owner, review_dir, "list")
    assert kinds(listed) == EXPECTED
    by_path = {change["path"]: change for change in listed["changes"]}
    assert by_path["mod.txt"]["sha256"] == hashlib.sha256(b"changed\n").hexdigest()
    assert by_path["mod.txt"]["size"] == 8 and by_path["mod.txt"]["host_size"] == 4
    assert by_path["chmod.sh"]["aspects"] == ["mode"] and by_path["chmod.sh"]["mode"] == 0o755
    assert by_path["link"]["target"] == "mod.txt" and by_path["link"]["host_target"] == "keep.txt"
    assert not any(change["conflict"] or change["flags"] for change in listed["changes"])
    shown = as_owner(place.owner, review_dir, "diff", path="mod.txt")["diff"]
    assert shown == "--- a/mod.txt\n+++ b/mod.txt\n@@ -1 +1 @@\n-old\n+changed\n"
    # The summary `sandboxd run` printed names them too.
    assert "review: 12 change(s) to" in result.stderr, result.stderr


def test_apply_of_one_path_lands_exactly_that_path(place: Place) -> None:
    ws, review_dir = fresh(place, "one")
    control = snapshot(ws)
    assert review_run(ws, review_dir, EDITS).returncode == 0
    done = as_owner(place.owner, review_dir, "apply", paths=("mod.txt",))
    assert [item["path"] for item in done["applied"]] == ["mod.txt"] and done["skipped"] == []
    after = snapshot(ws)
    assert after.pop("mod.txt")[4] == b"changed\n"
    control.pop("mod.txt")
    assert after == control
    assert (ws / "mod.txt").stat().st_uid == place.owner.uid
    # Applied: it is no longer a change (the host now has what the sandbox has).
    assert ("mod.txt", listing.MODIFIED) not in kinds(as_owner(place.owner, review_dir, "list"))


def test_apply_of_everything_makes_the_host_what_the_sandbox_saw(place: Place) -> None:
    ws, review_dir = fresh(place, "all")
    seen = review_run(ws, review_dir, EDITS + "find . | sort; cat */* *.txt 2>/dev/null | sort\n")
    assert seen.returncode == 0, describe(seen)
    done = as_owner(place.owner, review_dir, "apply")
    assert done["skipped"] == [], done["skipped"]
    assert {(item["path"], item["kind"]) for item in done["applied"]} == EXPECTED
    host = subprocess.run(["sh", "-c", "find . | sort; cat */* *.txt 2>/dev/null | sort"], cwd=ws,
                          capture_output=True, text=True)
    assert host.stdout == seen.stdout
    assert stat.S_IMODE((ws / "chmod.sh").stat().st_mode) == 0o755
    assert os.readlink(ws / "link") == "mod.txt"
    assert sorted(os.listdir(ws / "replaced")) == ["z"]
    assert not [name for name in os.listdir(ws) if name.startswith(".sandboxd-")]     # no leftovers


def test_a_host_edit_during_the_session_is_a_conflict(place: Place) -> None:
    ws, review_dir = fresh(place, "conflict")
    assert review_run(ws, review_dir, "echo mine > mod.txt; echo mine > sub/inner.txt; echo x > keep.txt").returncode == 0
    (ws / "mod.txt").write_text("the host's own edit\n")           # after the start: a conflict
    # The host replaces the directory sub/ (a new inode under the same name): its inner.txt too.
    os.rename(ws / "sub", ws / "sub-old")
    owned_dir(ws / "sub", place.owner)
    shutil.copy2(ws / "sub-old" / "inner.txt", ws / "sub" / "inner.txt")
    listed = {change["path"]: change for change in as_owner(place.owner, review_dir, "list")["changes"]}
    assert "changed on the host" in listed["mod.txt"]["conflict"]
    assert listed["sub/inner.txt"]["conflict"], listed["sub/inner.txt"]
    assert listed["keep.txt"]["conflict"] == ""                       # control: untouched on the host
    done = as_owner(place.owner, review_dir, "apply")
    skipped = {item["path"]: item["reason"] for item in done["skipped"]}
    assert set(skipped) == {"mod.txt", "sub/inner.txt"} and all(r.startswith("conflict:") for r in skipped.values())
    assert (ws / "mod.txt").read_text() == "the host's own edit\n" and (ws / "keep.txt").read_text() == "x\n"
    forced = as_owner(place.owner, review_dir, "apply", paths=("mod.txt",), force=True)
    assert [item["path"] for item in forced["applied"]] == ["mod.txt"]
    assert (ws / "mod.txt").read_text() == "mine\n"


def test_a_sibling_the_host_adds_is_no_conflict(place: Place) -> None:
    """The anchor: sub/ was copied up with its host handle, so a file the host adds beside a changed
    one (which moves sub/'s ctime) is no conflict, while sub/ itself stays the same directory."""
    ws, review_dir = fresh(place, "sibling")
    assert review_run(ws, review_dir, "echo mine > sub/inner.txt").returncode == 0
    _, entries = scan_kept(review_dir)
    assert {entry.path: entry for entry in entries}["sub"].origin, "overlayfs stored no origin for sub/"
    (ws / "sub" / "added-on-host.txt").write_text("host\n")
    listed = {change["path"]: change for change in as_owner(place.owner, review_dir, "list")["changes"]}
    assert listed["sub/inner.txt"]["conflict"] == ""


def test_planted_code_is_flagged_and_not_applied_unless_named(place: Place) -> None:
    ws, review_dir = fresh(place, "flagged")
    plant = textwrap.dedent("""\
        set -e
        mkdir -p repo/.git/hooks repo/.git/objects repo/.git/refs
        echo 'ref: refs/heads/main' > repo/.git/HEAD
        printf '[core]\\n\\tfsmonitor = touch /tmp/pwned\\n' > repo/.git/config
        printf '#!/bin/sh\\ntouch /tmp/pwned\\n' > repo/.git/hooks/post-checkout
        echo 'gitdir: /somewhere/else' > sub/.git
        if chmod 4755 sub/inner.txt; then echo set-id made; fi   # the seccomp filter refuses set-ID modes
        echo 'export PATH=.' > .envrc
        echo ordinary > ordinary.txt
    """)
    result = review_run(ws, review_dir, plant)
    assert result.returncode == 0 and "set-id made" not in result.stdout, describe(result)
    listed = {change["path"]: change for change in as_owner(place.owner, review_dir, "list")["changes"]}
    assert rules.HOOK in listed["repo/.git/hooks/post-checkout"]["flags"]
    assert rules.CONFIG in listed["repo/.git/config"]["flags"]
    assert rules.GITFILE in listed["sub/.git"]["flags"]
    assert listed[".envrc"]["flags"] and listed["ordinary.txt"]["flags"] == []
    done = as_owner(place.owner, review_dir, "apply")
    applied = {item["path"] for item in done["applied"]}
    assert "ordinary.txt" in applied and not applied & {"repo/.git/hooks/post-checkout", "repo/.git/config",
                                                        "sub/.git", ".envrc"}
    assert not (ws / "repo" / ".git" / "hooks" / "post-checkout").exists() and not (ws / "sub" / ".git").exists()
    named = as_owner(place.owner, review_dir, "apply", paths=("sub/.git",), include_flagged=frozenset({"sub/.git"}))
    assert [item["path"] for item in named["applied"]] == ["sub/.git"]
    assert (ws / "sub" / ".git").read_text() == "gitdir: /somewhere/else\n"


NAIVE_APPLY = textwrap.dedent("""\
    import json, os, sys
    ws, rel, text = sys.argv[1:4]
    with open(os.path.join(ws, rel), "w") as f:      # what an apply that follows names would do
        f.write(text)
    print(json.dumps({"wrote": os.path.realpath(os.path.join(ws, rel))}))
""")


def swap_in_symlink(place: Place, ws: Path, private: Path) -> None:
    """The attacker (who may add names to the shared ``ws``) puts a symlink to the owner's
    ``private`` directory where the sandbox made ``newdir``; control: an apply that follows names,
    as the owner, writes ``newdir/authorized_keys`` into ``private`` (removed again)."""
    swap = subprocess.run(["ln", "-s", str(private), str(ws / "newdir")], user=place.attacker.uid,
                          group=place.attacker.gid, extra_groups=[], capture_output=True, text=True, env=BASE_ENV)
    assert swap.returncode == 0, describe(swap)
    naive = subprocess.run([PY, "-c", NAIVE_APPLY, str(ws), "newdir/authorized_keys", "planted\n"],
                           user=place.owner.uid, group=place.owner.gid, extra_groups=[], capture_output=True,
                           text=True, env=BASE_ENV)
    assert naive.returncode == 0, describe(naive)
    assert (private / "authorized_keys").read_text() == "planted\n"
    (private / "authorized_keys").unlink()


def test_a_symlink_swapped_in_before_apply_is_refused_not_followed(place: Place) -> None:
    ws, review_dir = fresh(place, "swap")
    os.chmod(ws, 0o777)                                 # a shared workspace: the attacker may add names
    private = owned_dir(place.base / "owners-private", place.owner)
    os.chmod(private, 0o700)
    assert review_run(ws, review_dir, "mkdir newdir && echo planted > newdir/authorized_keys").returncode == 0
    listed = as_owner(place.owner, review_dir, "list")
    assert ("newdir/authorized_keys", listing.ADDED) in kinds(listed)
    # Between listing and apply the attacker puts a symlink where the new directory goes.
    swap_in_symlink(place, ws, private)
    # The apply: a conflict by default (the host has a new name there) ...
    done = as_owner(place.owner, review_dir, "apply")
    assert done["applied"] == [] and "conflict" in done["skipped"][0]["reason"]
    # ... and forced, the file alone (its new directory not asked for): refused by the walk itself.
    forced = as_owner(place.owner, review_dir, "apply", paths=("newdir/authorized_keys",), force=True)
    assert forced["applied"] == [], forced
    assert "symlink" in forced["skipped"][0]["reason"], forced
    assert os.listdir(private) == [] and os.readlink(ws / "newdir") == str(private)


def test_discard_drops_changes_from_the_upper_layer(place: Place) -> None:
    ws, review_dir = fresh(place, "discard")
    assert review_run(ws, review_dir, EDITS).returncode == 0
    layers, entries = scan_kept(review_dir)
    upper_fd = os.open(layers.upper, os.O_RDONLY | os.O_DIRECTORY)
    try:
        inside = applying.discard(upper_fd, entries, ("replaced/z",))
        assert inside.removed == () and "replaced" in inside.skipped[0].reason
        dropped = applying.discard(upper_fd, entries, ("mod.txt", "replaced"))
        assert set(dropped.removed) == {"mod.txt", "replaced"}
    finally:
        os.close(upper_fd)
    left = kinds(as_owner(place.owner, review_dir, "list"))
    assert left == EXPECTED - {("mod.txt", listing.MODIFIED), ("replaced", listing.REPLACED),
                               ("replaced/z", listing.ADDED)}


def code_for_plain_users(place: Place) -> Path:
    """A copy of the code plain users can read (the checkout may sit where they cannot), for
    `python -m sandboxd.cli.main` as one of them; the seccomp programs' cache made first."""
    code = place.base / "code"
    if not (code / "sandboxd").exists():
        make_dir(code)
        shutil.copytree(REPO / "sandboxd", code / "sandboxd", ignore=shutil.ignore_patterns("__pycache__"))
        subprocess.run(["chmod", "-R", "a+rX", str(code)], check=True)
    subprocess.run([sys.executable, "-c", "from sandboxd.kernel import seccomp\n"
                    "for c in (True, False): seccomp.program_for(seccomp.FilterSpec(confined=c))\n"],
                   check=True, timeout=120, cwd=REPO)
    return code


def rootless_state(place: Place, name: str) -> Path:
    """A directory of the owner's for a rootless run's change sets; skipped, naming why, where the
    kernel cannot have one (no unprivileged overlayfs, no user.* attributes on the tests' disk)."""
    if not overlay.rootless_supported():
        pytest.skip(f"unprivileged overlayfs needs Linux 5.11 (this is {os.uname().release})")
    state = owned_dir(place.base / name, place.owner)
    try:
        os.setxattr(state, "user.sbxreview-probe", b"1")
    except OSError as exc:
        pytest.skip(f"{place.base} holds no user.* extended attributes ({os.strerror(exc.errno or 0)}): "
                    "a tmpfs has them from Linux 6.6")
    return state


def test_rootless_review_as_a_plain_user(place: Place) -> None:
    state = rootless_state(place, "rootless-state")
    code = code_for_plain_users(place)
    ws, _ = fresh(place, "rootless")
    review_dir = state / "review"
    control = snapshot(ws)
    env = {**BASE_ENV, "HOME": str(ws), "PYTHONPATH": str(code)}
    user = {"user": place.owner.uid, "group": place.owner.gid, "extra_groups": []}
    result = subprocess.run([PY, "-m", "sandboxd.cli.main", "run", f"--review=keep:{review_dir}", "--", "sh", "-c",
                             EDITS + "cat mod.txt\n"], capture_output=True, text=True, timeout=120 * SLOW,
                            stdin=subprocess.DEVNULL, cwd=str(ws), env=env, **user)
    assert result.returncode == 0, describe(result)
    assert result.stdout.split() == ["changed"]
    assert snapshot(ws) == control
    listed = subprocess.run([PY, "-c", "import json, sys\nfrom sandboxd.review import kept\n"
                             "(s,) = kept.list_changes(sys.argv[1])\n"
                             "print(json.dumps(sorted([c.path, c.kind] for c in s.changes)))\n", str(review_dir)],
                            capture_output=True, text=True, timeout=60, cwd=str(ws), env=env, **user)
    assert listed.returncode == 0, describe(listed)
    assert {tuple(item) for item in json.loads(listed.stdout)} == EXPECTED
    (layers,) = overlay.load(str(review_dir))
    assert layers.userxattr and os.stat(layers.upper).st_uid == place.owner.uid


def test_a_lower_that_is_an_overlay_is_refused_in_one_line(place: Place) -> None:
    top = make_dir(place.base / "stacked")
    for name in ("lower", "upper", "work", "merged"):
        make_dir(top / name)
    script = (f"mount -t overlay x -o lowerdir={top}/lower,upperdir={top}/upper,workdir={top}/work {top}/merged"
              f" && exec {SANDBOXD} run --review=keep:{top}/review --workspace {top}/merged -- true")
    result = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script], capture_output=True,
                            text=True, timeout=60 * SLOW, env=BASE_ENV)
    assert result.returncode == 125, describe(result)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "it is on overlayfs" in lines[0], result.stderr
    assert not (top / "review").exists()                # nothing left of the refused run
    # Control: the same run over a plain directory builds.
    plain = subprocess.run([SANDBOXD, "run", f"--review=keep:{top}/review2", "--workspace", str(top / "lower"),
                            "--", "true"], capture_output=True, text=True, timeout=60 * SLOW, env=BASE_ENV)
    assert plain.returncode == 0, describe(plain)


def test_lowers_refused_by_file_system(place: Place) -> None:
    fd = os.open("/proc", os.O_PATH)
    try:
        with pytest.raises(Exception, match="on proc"):
            overlay.check_lower(fd, "/proc")
    finally:
        os.close(fd)
    fd = os.open(place.base, os.O_PATH)
    try:
        overlay.check_lower(fd, str(place.base))         # control: a local disk is a lower
    finally:
        os.close(fd)


@pytest.mark.parametrize(("release", "supported"), [("6.18.44-fc", True), ("6.1.0-28-amd64", True),
                                                     ("5.11.0", True), ("5.10.209", False), ("4.19", False)])
def test_rootless_kernel_gate(release: str, supported: bool) -> None:
    assert overlay.rootless_supported(release) is supported


def test_review_rules() -> None:
    never_git = lambda path: False  # noqa: E731
    assert rules.reasons(".git/hooks/pre-commit", "file", 0o755, never_git) == (rules.HOOK,)
    assert rules.reasons(".git/hooks/pre-commit.sample", "file", 0o755, never_git) == ()
    assert rules.reasons(".git/config", "file", 0o644, never_git) == (rules.CONFIG,)
    assert rules.reasons(".git/rebase-merge/git-rebase-todo", "file", 0o644, never_git) == (rules.SEQUENCER,)
    assert rules.reasons(".git/objects/ab/cdef", "file", 0o444, never_git) == ()
    assert rules.reasons(".git/refs/heads/main", "file", 0o644, never_git) == ()
    assert rules.reasons(".git/modules/lib/hooks/post-merge", "file", 0o755, never_git) == (rules.HOOK,)
    assert rules.reasons("sub/.git", "file", 0o644, never_git) == (rules.GITFILE,)
    assert rules.reasons("sub/.git", "symlink", 0o777, never_git) == (rules.GITLINK,)
    assert rules.reasons("bin/tool", "file", 0o4755, never_git) == (rules.SETID,)
    assert rules.reasons("src/main.c", "file", 0o644, never_git) == ()
    # Writable by every user: anyone could change what runs later (a sticky directory aside).
    assert rules.reasons("src", "dir", 0o777, never_git) == (rules.WORLD_WRITABLE,)
    assert rules.reasons("", "dir", 0o777, never_git) == (rules.WORLD_WRITABLE,)
    assert rules.reasons("Makefile", "file", 0o666, never_git) == (rules.WORLD_WRITABLE,)
    assert rules.reasons("scratch", "dir", 0o1777, never_git) == ()
    assert rules.reasons("src", "dir", 0o775, never_git) == ()
    # A tool's configuration directory as a symlink brings its target's files in unflagged otherwise.
    assert rules.reasons(".vscode", "symlink", 0o777, never_git) == (f".vscode: {rules.TOOL_LINK}",)
    assert rules.reasons("sub/.vscode", "symlink", 0o777, never_git) == (f".vscode: {rules.TOOL_LINK}",)
    assert rules.reasons(".vscode", "dir", 0o755, never_git) == ()
    # A git directory not named .git (hidden in objects/, say), as the guard judges one.
    hidden = lambda path: path == ".git/objects/ab/repo"  # noqa: E731
    assert rules.HOOK in rules.reasons(".git/objects/ab/repo/hooks/post-checkout", "file", 0o755, hidden)


def test_origin_handles_are_read_as_overlay_writes_them() -> None:
    fid = bytes(range(8))
    stored = bytes([0, 0xFB, 21 + len(fid), 0, 0x81]) + bytes(16) + fid
    assert conflicts.origin_handle(stored) == (0x81, fid)
    assert conflicts.origin_handle(b"") is None and conflicts.origin_handle(None) is None
    assert conflicts.origin_handle(stored[:20]) is None
