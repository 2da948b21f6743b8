"""ApplyPatch (all-or-nothing) and Search (ripgrep and the built-in engine) through a real daemon."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import stat
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from daemon_fixtures import base, client  # noqa: F401 - pytest fixtures
from sandboxd.client import SandboxClient, sandbox_policy
from sandboxd.launcher import patch_tool
from sandboxd.v1 import sandboxd_pb2 as pb

PATCH = """--- a/a.txt
+++ b/a.txt
@@ -1,3 +1,3 @@
 line one
-foo bar
+foo BAZ
 last
--- /dev/null
+++ b/sub/new.txt
@@ -0,0 +1 @@
+brand new
"""


@pytest.fixture
def workspace(base: Path, request: pytest.FixtureRequest) -> Path:
    path = base / f"ps-{request.node.name}".replace("[", "_").replace("]", "")
    (path / "sub").mkdir(parents=True)
    (path / "a.txt").write_text("line one\nfoo bar\nlast\n")
    (path / "b.txt").write_text("nothing here\nFOO BAR again\n")
    return path


@pytest.mark.parametrize("mode", ["workspace-write", "danger-full-access"])
def test_patch_applies_to_several_files(client: SandboxClient, workspace: Path, mode: str) -> None:
    """Also in root's danger-full-access session, where the file tool runs unconfined."""
    session = client.create_session(str(workspace), policy=sandbox_policy(mode), approval="never")
    reply = client.stub.ApplyPatch(pb.ApplyPatchRequest(session_id=session.id, patch=PATCH))
    assert [(f.path, f.action) for f in reply.files] == [("a.txt", "modified"), ("sub/new.txt", "created")]
    assert (workspace / "a.txt").read_text() == "line one\nfoo BAZ\nlast\n"
    assert (workspace / "sub/new.txt").read_text() == "brand new\n"


def test_patch_is_all_or_nothing(client: SandboxClient, workspace: Path) -> None:
    """The second file's hunk does not apply: the first file (which would) is left untouched too."""
    broken = PATCH.replace("brand new", "x") + """--- a/b.txt
+++ b/b.txt
@@ -1,2 +1,2 @@
-this line is not there
+y
 FOO BAR again
"""
    session = client.create_session(str(workspace))
    with pytest.raises(grpc.RpcError) as info:
        client.stub.ApplyPatch(pb.ApplyPatchRequest(session_id=session.id, patch=broken))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "nothing was changed" in str(info.value.details())
    assert (workspace / "a.txt").read_text() == "line one\nfoo bar\nlast\n"
    assert not (workspace / "sub/new.txt").exists()


def test_patch_refused_by_policy(client: SandboxClient, workspace: Path) -> None:
    session = client.create_session(str(workspace), policy=sandbox_policy("read-only"))
    with pytest.raises(grpc.RpcError) as info:
        client.stub.ApplyPatch(pb.ApplyPatchRequest(session_id=session.id, patch=PATCH))
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert (workspace / "a.txt").read_text() == "line one\nfoo bar\nlast\n"


def test_garbage_patch_is_invalid(client: SandboxClient, workspace: Path) -> None:
    session = client.create_session(str(workspace))
    with pytest.raises(grpc.RpcError) as info:
        client.stub.ApplyPatch(pb.ApplyPatchRequest(session_id=session.id, patch="not a diff"))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


# Round 10's hostile patch: one headed edit, then git-format parts without ---/+++ headers.
HEADLESS = ("diff --git a/a.txt b/a.txt\n--- a/a.txt\n+++ b/a.txt\n@@ -1,3 +1,3 @@\n line one\n-foo bar\n+foo BAZ\n"
            " last\ndiff --git a/b.txt b/moved-away.txt\nsimilarity index 100%\nrename from b.txt\nrename to moved-away.txt\n"
            "diff --git a/script.sh b/script.sh\nold mode 100644\nnew mode 100755\n"
            "diff --git a/tool.sh b/tool.sh\nnew file mode 100755\nindex 0000000..e69de29\n")


def _held(client: SandboxClient, session_id: str, call: "threading.Thread") -> pb.PendingApproval:
    while call.is_alive():
        held = client.stub.ListPendingApprovals(pb.ListPendingApprovalsRequest(session_id=session_id)).approvals
        if held:
            return held[0]
        time.sleep(0.05)
    raise AssertionError("the patch was never held for approval")


def test_the_card_and_the_result_show_every_part_git_applies(client: SandboxClient, workspace: Path) -> None:
    """The card a person approves names the rename, the mode change and the new executable, not
    only the headed edit; so do the result and the judgement (each path is a target)."""
    (workspace / "script.sh").write_text("echo hi\n")
    os.chmod(workspace / "script.sh", 0o644)
    session = client.create_session(str(workspace), approval="always")
    answer: dict[str, object] = {}
    call = threading.Thread(target=lambda: answer.setdefault("reply", client.stub.ApplyPatch(
        pb.ApplyPatchRequest(session_id=session.id, patch=HEADLESS), timeout=120)))
    call.start()
    held = _held(client, session.id, call)
    assert held.summary == ("Patch: a.txt: modified; b.txt: renamed to moved-away.txt; moved-away.txt: renamed "
                            "from b.txt; script.sh: made executable; tool.sh: created executable")
    assert sorted(json.loads(held.arguments_json)["paths"]) == sorted(
        str(workspace / name) for name in ("a.txt", "b.txt", "moved-away.txt", "script.sh", "tool.sh"))
    client.stub.ResolveApproval(pb.ResolveApprovalRequest(session_id=session.id, call_id=held.call_id,
                                                          decision="allow_once"))
    call.join()
    reply = answer["reply"]
    assert isinstance(reply, pb.ApplyPatchResponse)
    assert [(f.path, f.action) for f in reply.files] == [
        ("a.txt", "modified"), ("b.txt", "renamed to moved-away.txt"), ("moved-away.txt", "renamed from b.txt"),
        ("script.sh", "made executable"), ("tool.sh", "created executable")]
    assert not (workspace / "b.txt").exists() and (workspace / "moved-away.txt").exists()
    assert os.stat(workspace / "script.sh").st_mode & 0o111 and os.stat(workspace / "tool.sh").st_mode & 0o111


def test_a_rename_out_of_a_protected_subpath_is_judged(client: SandboxClient, workspace: Path) -> None:
    """The rename's source is a target: under a protected subpath it is refused up front. Control:
    the same rename of an unprotected file is applied."""
    (workspace / "guarded").mkdir()
    (workspace / "guarded/keep.txt").write_text("secret config\n")
    (workspace / "open.txt").write_text("free\n")
    policy = sandbox_policy("workspace-write")
    policy.protected_subpaths.append("guarded")
    session = client.create_session(str(workspace), policy=policy, approval="never")
    rename = "diff --git a/{0} b/stolen.txt\nsimilarity index 100%\nrename from {0}\nrename to stolen.txt\n"
    with pytest.raises(grpc.RpcError) as info:
        client.stub.ApplyPatch(pb.ApplyPatchRequest(session_id=session.id, patch=rename.format("guarded/keep.txt")))
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert (workspace / "guarded/keep.txt").exists() and not (workspace / "stolen.txt").exists()
    client.stub.ApplyPatch(pb.ApplyPatchRequest(session_id=session.id, patch=rename.format("open.txt")))
    assert (workspace / "stolen.txt").read_text() == "free\n"


def test_a_binary_part_is_refused_saying_so(client: SandboxClient, workspace: Path) -> None:
    binary = ("diff --git a/x.bin b/x.bin\nnew file mode 100755\nindex 0000000..1111111\nGIT binary patch\n"
              "literal 1\nIcmZo*000C20{{R3\n\nliteral 0\nHcmV?d00001\n\n")
    session = client.create_session(str(workspace))
    with pytest.raises(grpc.RpcError) as info:
        client.stub.ApplyPatch(pb.ApplyPatchRequest(session_id=session.id, patch=PATCH + binary))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "binary part" in str(info.value.details())
    assert (workspace / "a.txt").read_text() == "line one\nfoo bar\nlast\n" and not (workspace / "x.bin").exists()


IN_REPO = "diff --git a/x b/x\n--- a/x\n+++ b/x\n@@ -1 +1 @@\n-a\n+b\n"


def test_a_workspace_inside_a_repository_is_patched_as_plain_files(client: SandboxClient, base: Path) -> None:
    """A workspace that is a subdirectory of a git repository whose .gitattributes asks for CRLF and a
    smudge filter (a command from the repository's config). Control, git apply as it ran before, on
    the host: it reads a/x relative to the repository's top, skips it as outside the workspace and
    says nothing; given ws/x it writes x with CRLF and runs the filter. Through the daemon the part
    names the workspace's x, which is written as the patch says, and no filter runs."""
    repo = base / "ps-in-repo"
    workspace = repo / "ws"
    workspace.mkdir(parents=True)
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    marker = workspace / "smudged"
    subprocess.run(["git", "-C", str(repo), "config", "filter.mark.smudge", f"sh -c 'touch {marker}; cat'"], check=True)
    (repo / ".gitattributes").write_text("* text eol=crlf\nx filter=mark\n")
    (workspace / "x").write_text("a\n")
    old_env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8",
               "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": "/dev/null"}
    for patch, written in ((IN_REPO, b"a\n"), (IN_REPO.replace(" a/", " a/ws/").replace(" b/", " b/ws/"), b"b\r\n")):
        git = subprocess.run(["git", "apply", "-p1", "-"], input=patch.encode(), cwd=workspace, env=old_env,
                             capture_output=True, check=False)
        assert git.returncode == 0 and (workspace / "x").read_bytes() == written, git.stderr
    assert marker.exists()
    (workspace / "x").write_text("a\n")
    marker.unlink()
    session = client.create_session(str(workspace), approval="never")
    reply = client.stub.ApplyPatch(pb.ApplyPatchRequest(session_id=session.id, patch=IN_REPO))
    assert [(f.path, f.action) for f in reply.files] == [("x", "modified")]
    assert (workspace / "x").read_bytes() == b"b\n" and not marker.exists()
    assert sorted(path.name for path in workspace.iterdir()) == ["x"]


@pytest.fixture
def locked(workspace: Path) -> Iterator[Path]:
    """A directory of the workspace made immutable (chattr +i): creating a file in it fails after
    git has checked the whole patch, part way through its writes."""
    directory = workspace / "locked"
    directory.mkdir()
    made = subprocess.run(["chattr", "+i", str(directory)], capture_output=True, text=True, check=False)
    if made.returncode != 0:
        pytest.skip(f"the file system under the workspace has no immutable attribute: {made.stderr.strip()}")
    try:
        yield directory
    finally:
        subprocess.run(["chattr", "-i", str(directory)], check=True)


PART_WAY = ("--- a/a.txt\n+++ b/a.txt\n@@ -1,3 +1,3 @@\n line one\n-foo bar\n+CHANGED\n last\n"
            "--- a/b.txt\n+++ /dev/null\n@@ -1,2 +0,0 @@\n-nothing here\n-FOO BAR again\n"
            "--- /dev/null\n+++ b/new/dir/made.txt\n@@ -0,0 +1 @@\n+x\n"
            "--- /dev/null\n+++ b/locked/new.txt\n@@ -0,0 +1 @@\n+x\n")


def test_a_patch_that_fails_part_way_changes_nothing(client: SandboxClient, workspace: Path, locked: Path) -> None:
    """git apply writes file by file: control, on the host, git leaves a.txt changed, b.txt deleted
    and new/dir made when the write into the immutable directory fails. Through the daemon every
    one of them is put back, as the error says."""
    before = {name: (workspace / name).read_bytes() for name in ("a.txt", "b.txt")}
    os.chmod(workspace / "a.txt", 0o640)
    control = workspace.parent / f"{workspace.name}-control"
    shutil.copytree(workspace, control, symlinks=True)
    try:
        subprocess.run(["chattr", "+i", str(control / "locked")], check=True)
        git = subprocess.run(["git", "apply", "-p1", "-"], input=PART_WAY.encode(), cwd=control, capture_output=True,
                             check=False)
        subprocess.run(["chattr", "-i", str(control / "locked")], check=True)
        assert git.returncode != 0
        assert (control / "a.txt").read_text() == "line one\nCHANGED\nlast\n" and not (control / "b.txt").exists()
    finally:
        subprocess.run(["chattr", "-i", str(control / "locked")], check=False)
        shutil.rmtree(control)
    session = client.create_session(str(workspace))
    with pytest.raises(grpc.RpcError) as info:
        client.stub.ApplyPatch(pb.ApplyPatchRequest(session_id=session.id, patch=PART_WAY))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "nothing was changed" in str(info.value.details())
    assert {name: (workspace / name).read_bytes() for name in ("a.txt", "b.txt")} == before
    assert stat.S_IMODE(os.stat(workspace / "a.txt").st_mode) == 0o640
    assert not (workspace / "new").exists() and not list(locked.iterdir())


def test_a_target_that_cannot_be_put_back_is_named(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """launcher.patch_tool alone: the "git" here deletes the target, locks its directory and fails;
    the tool cannot put the target back and says which (exit EXIT_NOT_RESTORED, its path on stdout)."""
    (tmp_path / "d").mkdir()
    target = tmp_path / "d" / "f.txt"
    target.write_text("old\n")
    script = f"rm {shlex.quote(str(target))} && chattr +i {shlex.quote(str(target.parent))}; exit 1"
    try:
        code = patch_tool.run([str(target)], ["sh", "-c", script], {"PATH": "/usr/bin:/bin"})
    finally:
        subprocess.run(["chattr", "-i", str(target.parent)], check=False)
    if code == patch_tool.EXIT_RESTORED:
        pytest.skip("the file system under the temp dir has no immutable attribute")
    out, err = capfd.readouterr()
    assert code == patch_tool.EXIT_NOT_RESTORED and bytes.fromhex(out.strip()).decode() == str(target)
    assert f"not put back: {target}" in err and not target.exists()


@pytest.mark.parametrize("engine", ["ripgrep", "builtin"])
def test_search_finds_matches_with_either_engine(client: SandboxClient, workspace: Path, engine: str) -> None:
    session = client.create_session(str(workspace))
    reply = client.stub.Search(pb.SearchRequest(session_id=session.id, pattern="foo ba[rz]", case_insensitive=True,
                                                engine=engine))
    assert reply.engine == engine
    found = sorted((Path(m.path).name, m.line, m.text) for m in reply.matches)
    assert found == [("a.txt", 2, "foo bar"), ("b.txt", 2, "FOO BAR again")]
    capped = client.stub.Search(pb.SearchRequest(session_id=session.id, pattern="o", max_results=1, engine=engine))
    assert len(capped.matches) == 1 and capped.truncated
    case = client.stub.Search(pb.SearchRequest(session_id=session.id, pattern="FOO", engine=engine))
    assert [Path(m.path).name for m in case.matches] == ["b.txt"]
