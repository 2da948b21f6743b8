"""ApplyPatch (all-or-nothing) and Search (ripgrep and the built-in engine) through a real daemon."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from daemon_fixtures import base, client  # noqa: F401 - pytest fixtures
from sandboxd.client import SandboxClient, sandbox_policy
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


def test_patch_applies_to_several_files(client: SandboxClient, workspace: Path) -> None:
    session = client.create_session(str(workspace))
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
