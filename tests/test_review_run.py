"""`sandboxd run --review` and `sandboxd changes|apply|discard DIR` from the user's side (issue 25,
item 5), on the real kernel: as root (the command and the apply run as the workspace's owner, a
plain user the tests create) and rootless (a plain user's own run).

Each decision at the end: --review=apply lands what the sandbox made (as the owner), conflicts and
flagged changes stay with the commands that would take them; --review=discard leaves the host byte
for byte as it was and removes the change set; --review without a terminal keeps it and names
where; on a terminal (a pty here) the prompt takes a, d, k and r (the diff, then asks again). The
exit status is the command's throughout; a command killed keeps its change set. A kept directory
is its user's alone (control: its owner may use it).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import BASE_ENV, PY, SANDBOXD, SLOW, describe
from daemon_helpers import owned_dir
from sandboxd.kernel import overlay
from review_helpers import EDITS, PROMPT, on_a_pty, snapshot, wait_for
from test_review_overlay import (Place, code_for_plain_users, fresh, place,  # noqa: F401 - a fixture
                                 rootless_state, swap_in_symlink)

pytestmark = pytest.mark.timeout(300)

KEPT = re.compile(r"review: kept in (\S+)")


@pytest.fixture(scope="module")
def env(place: Place) -> dict[str, str]:
    """Root's environment: its runs' change sets on the tests' disk (the VM guest's /var/lib is an
    overlay, which overlayfs takes as no upper layer)."""
    state = place.base / "root-state"
    state.mkdir(mode=0o700, exist_ok=True)
    return {**BASE_ENV, "XDG_STATE_HOME": str(state)}


def reviews(env: dict[str, str]) -> str:
    return f"{env['XDG_STATE_HOME']}/sandboxd/reviews"


def run(env: dict[str, str], ws: Path, decision: str, script: str) -> subprocess.CompletedProcess[str]:
    """`sandboxd run --review[=decision]` as root, without a terminal."""
    flag = "--review" + (f"={decision}" if decision else "")
    return subprocess.run([SANDBOXD, "run", flag, "--workspace", str(ws), "--", "sh", "-c", script],
                          capture_output=True, text=True, timeout=120 * SLOW, stdin=subprocess.DEVNULL,
                          env=env, cwd=str(ws))


def sbx(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([SANDBOXD, *args], capture_output=True, text=True, timeout=120 * SLOW,
                          stdin=subprocess.DEVNULL, env=BASE_ENV)


def kept_dir(result: subprocess.CompletedProcess[str]) -> Path:
    found = KEPT.search(result.stderr)
    assert found, describe(result)
    return Path(found.group(1))


def left_for(ws: Path, base: str) -> list[str]:
    """The change sets under ``base`` whose layers cover ``ws``."""
    found = []
    for name in os.listdir(base) if os.path.isdir(base) else ():
        try:
            layers = overlay.load(f"{base}/{name}")
        except OSError:
            continue
        if any(layer.root == str(ws) for layer in layers):
            found.append(name)
    return found


def test_discard_leaves_the_host_byte_for_byte_and_keeps_nothing(place: Place, env: dict[str, str]) -> None:
    ws, _ = fresh(place, "run-discard")
    control = snapshot(ws)
    result = run(env, ws, "discard", EDITS + "exit 3")
    assert result.returncode == 3, describe(result)                    # the command's status
    assert "review: 12 change(s) to" in result.stderr and "review: discarded" in result.stderr, describe(result)
    assert snapshot(ws) == control
    assert left_for(ws, reviews(env)) == []


def test_the_summary_shows_a_name_the_sandbox_chose_escaped(place: Place, env: dict[str, str]) -> None:
    ws, _ = fresh(place, "run-escaped")
    result = run(env, ws, "discard", "touch \"$(printf 'a\\033[2Jb\\nreview: applied 9 change(s)')\"")
    assert result.returncode == 0, describe(result)
    assert "\x1b" not in result.stderr and "a\\x1b[2Jb\\nreview: applied 9 change(s)" in result.stderr, describe(result)
    assert "\nreview: applied" not in result.stderr                    # no line forged


def test_apply_lands_what_the_sandbox_made_as_the_owner(place: Place, env: dict[str, str]) -> None:
    ws, _ = fresh(place, "run-apply")
    control = snapshot(ws)
    result = run(env, ws, "apply", EDITS + "exit 5")
    assert result.returncode == 5, describe(result)
    assert "review: applied 12 change(s)" in result.stderr, describe(result)
    after = snapshot(ws)
    assert after != control
    assert (ws / "mod.txt").read_text() == "changed\n" and not (ws / "del.txt").exists()
    assert (ws / "replaced" / "z").read_text() == "z\n" and not (ws / "replaced" / "x").exists()
    assert os.readlink(ws / "link") == "mod.txt"
    # Written by the owner, not root: the new files are the owner's.
    assert (ws / "added.txt").stat().st_uid == place.owner.uid and (ws / "newdir").stat().st_uid == place.owner.uid
    assert left_for(ws, reviews(env)) == []


def test_nothing_changed_is_said_and_nothing_is_kept(place: Place, env: dict[str, str]) -> None:
    ws, _ = fresh(place, "run-nothing")
    result = run(env, ws, "", "cat keep.txt")
    assert result.returncode == 0 and "review: no changes" in result.stderr, describe(result)
    assert left_for(ws, reviews(env)) == []


def test_without_a_terminal_review_keeps_and_names_where(place: Place, env: dict[str, str]) -> None:
    ws, _ = fresh(place, "run-keep")
    control = snapshot(ws)
    result = run(env, ws, "", "echo changed > mod.txt; echo new > added.txt")
    assert result.returncode == 0, describe(result)
    kept = kept_dir(result)
    assert kept.parent == Path(reviews(env)) and (kept.stat().st_mode & 0o777) == 0o700
    assert snapshot(ws) == control
    shown = sbx("changes", str(kept), "--json")
    assert shown.returncode == 0, describe(shown)
    (listed,) = json.loads(shown.stdout)
    assert {(c["path"], c["kind"]) for c in listed["changes"]} == {("mod.txt", "modified"), ("added.txt", "added")}
    diff = sbx("changes", str(kept), "--diff", str(ws / "mod.txt"))
    assert "-old\n+changed\n" in diff.stdout and "added.txt" not in diff.stdout, describe(diff)
    one = sbx("apply", str(kept), str(ws / "added.txt"))
    assert one.returncode == 0, describe(one)
    assert (ws / "added.txt").read_text() == "new\n" and (ws / "mod.txt").read_text() == "old\n"
    rest = sbx("discard", str(kept), str(ws / "mod.txt"))               # the last change, by path
    assert rest.returncode == 0 and "nothing is left" in rest.stderr and not kept.exists(), describe(rest)
    assert (ws / "mod.txt").read_text() == "old\n"


def test_a_conflict_is_listed_with_how_to_force_it(place: Place, env: dict[str, str]) -> None:
    ws, _ = fresh(place, "run-conflict")
    result = run(env, ws, "keep", "echo sandbox > mod.txt; echo new > added.txt")
    kept = kept_dir(result)
    (ws / "mod.txt").write_text("host edit\n")                          # the host changed it meanwhile
    done = sbx("apply", str(kept))
    assert done.returncode == 1, describe(done)
    assert "mod.txt" in done.stderr and "conflict" in done.stderr and "--force" in done.stderr, describe(done)
    assert (ws / "mod.txt").read_text() == "host edit\n" and (ws / "added.txt").read_text() == "new\n"
    assert kept.exists()
    forced = sbx("apply", str(kept), "--force")
    assert forced.returncode == 0, describe(forced)
    assert (ws / "mod.txt").read_text() == "sandbox\n" and not kept.exists()


PLANT = ("mkdir -p repo/.git/hooks repo/.git/objects repo/.git/refs && echo 'ref: refs/heads/main' > repo/.git/HEAD"
         " && printf '#!/bin/sh\\ntouch /tmp/pwned\\n' > repo/.git/hooks/pre-commit && echo ok > ordinary.txt")


def test_a_planted_hook_is_not_applied_without_include_flagged(place: Place, env: dict[str, str]) -> None:
    ws, _ = fresh(place, "run-flagged")
    hook = ws / "repo" / ".git" / "hooks" / "pre-commit"
    result = run(env, ws, "apply", PLANT)
    assert result.returncode == 0, describe(result)
    assert (ws / "ordinary.txt").read_text() == "ok\n" and not (ws / "repo" / ".git").exists(), describe(result)
    assert f"--include-flagged {ws}/repo/.git" in result.stderr, describe(result)
    kept = Path(re.findall(r"sandboxd apply (\S+) --include-flagged", result.stderr)[0])
    plain = sbx("apply", str(kept))                                     # control of the flag: still skipped
    assert plain.returncode == 1 and not hook.exists(), describe(plain)
    named = sbx("apply", str(kept), *(f"--include-flagged={path}" for path in (hook.parent.parent, hook.parent, hook)))
    assert named.returncode == 0, describe(named)
    assert hook.read_text() == "#!/bin/sh\ntouch /tmp/pwned\n" and hook.stat().st_uid == place.owner.uid


def test_root_s_apply_of_a_kept_set_never_follows_a_swapped_symlink(place: Place, env: dict[str, str]) -> None:
    """`sandboxd apply DIR --force` as root writes as the workspace's owner and walks beneath the
    root: another user's symlink where the sandbox made a directory is refused, not followed into
    the owner's private directory (control: an apply that follows names, as the owner, does)."""
    ws, _ = fresh(place, "run-swap")
    os.chmod(ws, 0o777)                                 # a shared workspace: the attacker may add names
    private = owned_dir(place.base / "run-swap-private", place.owner)
    os.chmod(private, 0o700)
    kept = kept_dir(run(env, ws, "keep", "mkdir newdir && echo planted > newdir/authorized_keys"))
    swap_in_symlink(place, ws, private)
    done = sbx("apply", str(kept))
    assert done.returncode == 1 and "conflict" in done.stderr, describe(done)
    forced = sbx("apply", str(kept), "--force", str(ws / "newdir" / "authorized_keys"))
    assert forced.returncode == 1 and "symlink" in forced.stderr, describe(forced)
    assert os.listdir(private) == [] and os.readlink(ws / "newdir") == str(private)
    assert sbx("discard", str(kept)).returncode == 0


def test_a_killed_command_keeps_its_change_set(place: Place, env: dict[str, str]) -> None:
    ws, _ = fresh(place, "run-killed")
    control = snapshot(ws)
    result = run(env, ws, "discard", "echo changed > mod.txt; kill -9 $$")
    assert result.returncode == 128 + 9, describe(result)
    assert "killed by signal 9" in result.stderr, describe(result)
    kept = Path(re.findall(r"kept in (\S+)", result.stderr)[0])
    assert (kept / "layers.json").exists() and snapshot(ws) == control
    assert sbx("discard", str(kept)).returncode == 0 and not kept.exists()


def test_an_interrupted_run_keeps_its_change_set(place: Place, env: dict[str, str]) -> None:
    """Ctrl-C to `sandboxd run --review=apply` (SIGINT, forwarded to the command): nothing applied,
    the change set kept where it is, and said so; the status the command's (128+2)."""
    ws, _ = fresh(place, "run-interrupted")
    control = snapshot(ws)
    process = subprocess.Popen([SANDBOXD, "run", "--review=apply", "--workspace", str(ws), "--", "sh", "-c",
                                "echo changed > mod.txt; echo ready; exec sleep 60"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env, cwd=str(ws), text=True)
    try:
        assert process.stdout is not None and process.stdout.readline() == "ready\n"
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=120 * SLOW)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 128 + signal.SIGINT, stderr
    assert "killed by signal 2" in stderr and "applied" not in stderr, stderr
    kept = Path(re.findall(r"kept in (\S+)", stderr)[0])
    assert snapshot(ws) == control and (kept / "layers.json").exists()
    assert sbx("discard", str(kept)).returncode == 0 and not kept.exists()


def _pty_run(env: dict[str, str], ws: Path, script: str) -> "contextlib.AbstractContextManager[tuple[int, list[bytes], subprocess.Popen[bytes]]]":
    """`sandboxd run --review` with a pty as its terminal: (master, output so far, process)."""
    return on_a_pty([SANDBOXD, "run", "--review", "--workspace", str(ws), "--", "sh", "-c", script], env, str(ws))


def test_a_key_typed_ahead_does_not_answer(place: Place, env: dict[str, str]) -> None:
    """An "a" typed while the command runs (or left by it) is dropped; the answer typed once the
    question shows decides (here: discard)."""
    ws, _ = fresh(place, "run-pty-ahead")
    control = snapshot(ws)
    with _pty_run(env, ws, "echo changed > mod.txt; sleep 2") as (master, output, process):
        os.write(master, b"a")                            # long before the question: the command sleeps
        wait_for(output, PROMPT)
        os.write(master, b"d")
        assert process.wait(timeout=120 * SLOW) == 0, b"".join(output)
    shown = b"".join(output).decode(errors="replace")
    assert "review: discarded" in shown and "applied" not in shown, shown
    assert snapshot(ws) == control and left_for(ws, reviews(env)) == []


@pytest.mark.parametrize("keys", ["a", "d", "k", "ra"])
def test_the_prompt_on_a_terminal(place: Place, env: dict[str, str], keys: str) -> None:
    ws, _ = fresh(place, f"run-pty-{keys}")
    control = snapshot(ws)
    with _pty_run(env, ws, "echo changed > mod.txt; exit 7") as (master, output, process):
        for index, key in enumerate(keys, start=1):
            wait_for(output, PROMPT, index)
            os.write(master, key.encode())
        assert process.wait(timeout=120 * SLOW) == 7, b"".join(output)
    shown = b"".join(output).decode(errors="replace")
    assert "review: 1 change(s) to" in shown, shown
    if "r" in keys:
        assert "-old" in shown and "+changed" in shown, shown
    if keys.endswith("a"):
        assert (ws / "mod.txt").read_text() == "changed\n" and left_for(ws, reviews(env)) == [], shown
    elif keys == "d":
        assert snapshot(ws) == control and left_for(ws, reviews(env)) == [], shown
    else:
        assert snapshot(ws) == control and len(left_for(ws, reviews(env))) == 1 and "review: kept in" in shown, shown
        for name in left_for(ws, reviews(env)):
            assert sbx("discard", f"{reviews(env)}/{name}").returncode == 0


def test_a_kept_directory_is_its_users_alone(place: Place, env: dict[str, str]) -> None:
    ws, _ = fresh(place, "run-mine")
    kept = kept_dir(run(env, ws, "keep", "echo changed > mod.txt"))
    # Another user's kept set (one the owner made, as a plain user would), used by root: refused.
    theirs = owned_dir(place.base / "run-mine-theirs", place.owner)
    refused = sbx("changes", str(theirs))
    assert refused.returncode == 2 and "not to you" in refused.stderr, describe(refused)
    os.chmod(kept, 0o777)
    refused = sbx("changes", str(kept))
    assert refused.returncode == 2 and "writable by others" in refused.stderr, describe(refused)
    os.chmod(kept, 0o700)                                               # control: its owner may
    assert sbx("changes", str(kept)).returncode == 0
    code = {**BASE_ENV, "PYTHONPATH": str(code_for_plain_users(place))}
    attacker = subprocess.run([PY, "-m", "sandboxd.cli.main", "apply", str(kept)], capture_output=True, text=True,
                              timeout=120 * SLOW, env=code, cwd="/", user=place.attacker.uid,
                              group=place.attacker.gid, extra_groups=[])
    assert attacker.returncode == 2 and "cannot open" in attacker.stderr, describe(attacker)
    assert (ws / "mod.txt").read_text() == "old\n"
    assert sbx("discard", str(kept)).returncode == 0


def owners_sandboxd(place: Place, state: Path) -> "Callable[..., subprocess.CompletedProcess[str]]":
    """`sandboxd ARGS` as the place's owner, a plain user, with ``state`` as its HOME and XDG_STATE_HOME."""
    mine = {**BASE_ENV, "PYTHONPATH": str(code_for_plain_users(place)), "HOME": str(state),
            "XDG_STATE_HOME": str(state)}

    def as_owner(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run([PY, "-m", "sandboxd.cli.main", *args], capture_output=True, text=True,
                              timeout=120 * SLOW, stdin=subprocess.DEVNULL, cwd=str(cwd), env=mine,
                              user=place.owner.uid, group=place.owner.gid, extra_groups=[])
    return as_owner


def test_rootless_apply_discard_and_keep_as_a_plain_user(place: Place, env: dict[str, str]) -> None:
    state = rootless_state(place, "rootless-run-state")
    as_owner = owners_sandboxd(place, state)
    base = state / "sandboxd" / "reviews"
    outcomes = {}
    for decision in ("apply", "discard", ""):
        ws, _ = fresh(place, f"rootless-run-{decision or 'ask'}")
        control = snapshot(ws)
        result = as_owner("run", "--review" + (f"={decision}" if decision else ""), "--",
                          "sh", "-c", EDITS + "exit 4", cwd=ws)
        assert result.returncode == 4, describe(result)
        assert "review: 12 change(s) to" in result.stderr, describe(result)
        outcomes[decision] = (ws, control, result)
    ws, control, result = outcomes["apply"]
    assert (ws / "mod.txt").read_text() == "changed\n" and (ws / "added.txt").stat().st_uid == place.owner.uid
    ws, control, result = outcomes["discard"]
    assert snapshot(ws) == control
    ws, control, result = outcomes[""]
    kept = kept_dir(result)
    assert kept.parent == base and kept.stat().st_uid == place.owner.uid and snapshot(ws) == control
    assert left_for(outcomes["apply"][0], str(base)) == [] and left_for(outcomes["discard"][0], str(base)) == []
    # Root may not use a plain user's kept set (the run's own user only); its owner may.
    assert sbx("changes", str(kept)).returncode == 2
    shown = as_owner("changes", str(kept), "--stat", cwd=ws)
    assert shown.returncode == 0 and "mod.txt" in shown.stdout, describe(shown)
    done = as_owner("apply", str(kept), cwd=ws)
    assert done.returncode == 0, describe(done)
    assert (ws / "mod.txt").read_text() == "changed\n" and not kept.exists()


def test_no_run_of_the_user_rewrites_a_change_set_kept_for_their_review(place: Place) -> None:
    """The user's kept change sets (defaults.review_bases) are hidden, read-only and empty, in every
    sandbox of theirs: a later run whose workspace holds them cannot rewrite what waits for the
    person's review. Control: beside them, a directory of the same user's is written as usual."""
    state = rootless_state(place, "rootless-kept-state")
    as_owner = owners_sandboxd(place, state)
    ws, _ = fresh(place, "rootless-kept")
    kept = kept_dir(as_owner("run", "--review=keep", "--", "sh", "-c", "echo changed > mod.txt", cwd=ws))
    before = sorted(str(path.relative_to(kept)) for path in kept.rglob("*"))
    owned_dir(state / "sandboxd" / "other", place.owner)
    attack = as_owner("run", "--workspace", str(state), "--", "sh", "-c",
                      f"echo listed: $(ls -A sandboxd/reviews); echo evil > sandboxd/reviews/{kept.name}/planted; "
                      "echo control > sandboxd/other/written", cwd=state)
    assert attack.stdout == "listed:\n" and "cannot create" in attack.stderr, describe(attack)     # nothing there
    assert sorted(str(path.relative_to(kept)) for path in kept.rglob("*")) == before
    assert (state / "sandboxd" / "other" / "written").read_text() == "control\n"      # the control
    shown = as_owner("changes", str(kept), "--stat", cwd=ws)
    assert shown.returncode == 0 and shown.stdout.endswith(": 1 modified\n"), describe(shown)
    assert as_owner("discard", str(kept), cwd=ws).returncode == 0


def test_the_layers_record_is_the_text_json_writes() -> None:
    layers = [overlay.Layers(root="/w/\u00e9\"q\\\n\udcff", upper="/r/0/upper", work="/r/0/work", userxattr=flag,
                             root_dev=2049, root_ino=12, started_ns=1764780000123456789) for flag in (True, False)]
    text = overlay.record_text(layers)
    assert text == json.dumps([layer.as_dict() for layer in layers], sort_keys=True)
    assert overlay.record_text([]) == "[]"


def test_an_owner_place_is_hidden_only_as_their_directory_reached_through_no_symlink(place: Place) -> None:
    """launcher.plan hides LaunchSpec.owner_hidden as root: a name the owner controls must not make
    it hide (or refuse a workspace under) anything else. Control: their own directory is hidden."""
    from sandboxd.launcher.plan import _owner_places
    from sandboxd.policy import LaunchSpec
    mine = owned_dir(place.base / "owner-place-mine", place.owner)
    theirs = owned_dir(place.base / "owner-place-theirs", place.attacker)
    link = place.base / "owner-place-link"
    link.symlink_to("/etc")
    via_link = place.base / "owner-place-via"
    via_link.symlink_to(mine)
    spec = LaunchSpec(argv=("true",), workspace=str(mine), caller=(place.owner.uid, place.owner.gid, ()),
                      owner_hidden=(str(mine), str(theirs), str(link), str(via_link), str(place.base / "absent")))
    assert _owner_places(spec) == (str(mine),)
