"""service.patch_parts against git itself (a differential test): for generated patches mixing
---/+++ parts with git-format parts that have no such headers (renames, copies, mode changes,
creations, deletions, quoted names, text between parts), every path `git apply` writes, and every
path `git apply --numstat -z` names, must be among the paths patch_parts lists (or patch_parts
refuses the patch). git runs on the host as the test's user in a temp dir, on the same files."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sandboxd.errors import InvalidPolicy
from sandboxd.service import patch_parts
from sandboxd.service.patch_search import GIT_ENV

GIT = shutil.which("git") or "git"          # ApplyPatch needs it: missing, this test fails
FILES = {"a.txt": "one\ntwo\n", "b.txt": "hello\n", "run.sh": "echo hi\n", "sp ace.txt": "x\n",
         "dir/c.txt": "c\n", "tab\tname": "t\n", 'q"uote': "q\n", "b.txt\v": "vt\n", "b.txt\f": "ff\n"}
# What may follow a traditional ---/+++ name: git drops a timestamp after a tab, and after spaces too
# (whitespace damage: "x 2020-01-01" is x); a tab ends a name; \v, \f and text that is no timestamp do not.
STAMPS = ["", "\t2024-01-02 03:04:05.000000000 +0000", " 2020-01-01", "  2020-01-01", "\t2020-01-01",
          " 2020-01-01 00:00:00", " 2020-01-01 00:00:00.5 +0000", "  2020-01-01 00:00:00 +01:00", " 20-01-01",
          " 2020-01-01\t", "  junk", " 12:00:00 +0000", "\v", "\f", "\t\v"]
NAMES = list(FILES) + ["new.txt", "dir/new.sh", "d2/deep/n.txt", "caf\u00e9.txt", "x.orig", "a.txt.orig"]


def _quoted(name: str) -> str:
    if not any(c in name for c in '"\t\\\n') and name.isascii():
        return name
    body = "".join({'"': '\\"', "\t": "\\t", "\\": "\\\\"}.get(c, c) if c.isascii()
                   else "".join(f"\\{b:03o}" for b in c.encode()) for c in name)
    return f'"{body}"'


def _side(prefix: str, name: str) -> str:
    quoted = _quoted(name)
    return f'"{prefix}{quoted[1:]}' if quoted.startswith('"') else prefix + quoted


@st.composite
def hunk(draw: st.DrawFn, name: str, new: bool = False, delete: bool = False) -> str:
    old_lines = [] if new else FILES.get(name, "one\n").splitlines()
    if delete:
        return f"@@ -1,{len(old_lines)} +0,0 @@\n" + "".join(f"-{line}\n" for line in old_lines)
    added = draw(st.lists(st.sampled_from(["+added", "+#!/bin/sh", "+", "+--- a/b.txt"]), min_size=1, max_size=2))
    if new:
        return f"@@ -0,0 +1,{len(added)} @@\n" + "".join(f"{line}\n" for line in added)
    body = [f" {old_lines[0]}"] + added + [f" {line}" for line in old_lines[1:]]
    return f"@@ -1,{len(old_lines)} +1,{len(old_lines) + len(added)} @@\n" + "".join(f"{line}\n" for line in body)


@st.composite
def part(draw: st.DrawFn) -> str:
    kind = draw(st.sampled_from(["traditional", "git-edit", "rename", "copy", "mode", "new", "delete",
                                 "garbage", "git-new-empty", "noise"]))
    old = draw(st.sampled_from(list(FILES)))
    other = draw(st.sampled_from(NAMES))
    head = f"diff --git {_side('a/', old)} {_side('b/', old)}\n"
    if kind == "traditional":
        target = draw(st.sampled_from([old, old + ".orig", other]))
        stamp, other_stamp = draw(st.sampled_from(STAMPS)), draw(st.sampled_from(STAMPS))
        if draw(st.booleans()):                 # a creation or deletion, named with a timestamp
            return draw(st.sampled_from([f"--- /dev/null\n+++ {_side('b/', other)}{stamp}\n" + draw(hunk(other, new=True)),
                                         f"--- {_side('a/', old)}{stamp}\n+++ /dev/null\n" + draw(hunk(old, delete=True))]))
        return f"--- {_side('a/', old)}{stamp}\n+++ {_side('b/', target)}{other_stamp}\n" + draw(hunk(old))
    if kind == "git-edit":
        return head + f"index 1111111..2222222 100644\n--- {_side('a/', old)}\n+++ {_side('b/', old)}\n" + draw(hunk(old))
    if kind in ("rename", "copy"):
        edit = draw(st.booleans())
        text = (f"diff --git {_side('a/', old)} {_side('b/', other)}\nsimilarity index 90%\n"
                f"{kind} from {_quoted(old)}\n{kind} to {_quoted(other)}\n")
        if draw(st.booleans()):
            text += "old mode 100644\nnew mode 100755\n"
        if edit:
            text += f"--- {_side('a/', old)}\n+++ {_side('b/', other)}\n" + draw(hunk(old))
        return text
    if kind == "mode":
        return head + draw(st.sampled_from(["old mode 100644\nnew mode 100755\n", "old mode 100755\nnew mode 100644\n"]))
    if kind == "new":
        mode = draw(st.sampled_from(["100644", "100755"]))
        new_head = f"diff --git {_side('a/', other)} {_side('b/', other)}\n"
        return new_head + f"new file mode {mode}\nindex 0000000..1111111\n--- /dev/null\n+++ {_side('b/', other)}\n" + draw(
            hunk(other, new=True))
    if kind == "git-new-empty":
        return f"diff --git {_side('a/', other)} {_side('b/', other)}\nnew file mode 100755\nindex 0000000..e69de29\n"
    if kind == "delete":
        return head + f"deleted file mode 100644\nindex 1111111..0000000\n--- {_side('a/', old)}\n+++ /dev/null\n" + draw(
            hunk(old, delete=True))
    if kind == "noise":                          # a header line where git may or may not expect one
        return draw(st.sampled_from(["old mode 100644\n", "new mode 100755\n", f"rename to {other}\n",
                                     f"copy to {other}\n", f"+++ b/{other}\n", f"--- a/{old}\n",
                                     "index 0000000..1111111 100755\n", "new file mode 100755\n",
                                     f"rename old {old}\n", "deleted file mode 100644\n", "\\ No newline at end of file\n",
                                     f"diff --git a/{other} b/{other}\n", f"--- a/{old}\r\n", "@@ -1 +1 @@\n"]))
    return draw(st.sampled_from(["Subject: a commit message\n", "\n", "some text --- not a header\n"]))


def _tree(root: Path) -> dict[str, tuple[int, bytes]]:
    found = {}
    for path in root.rglob("*"):
        if path.is_file() and ".git" not in path.relative_to(root).parts:
            found[str(path.relative_to(root))] = (path.stat().st_mode, path.read_bytes())
    return found


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(part(), min_size=1, max_size=4), st.booleans())
def test_every_path_git_writes_is_listed(parts: list[str], crlf: bool) -> None:
    patch = "".join(parts).replace("\n", "\r\n") if crlf else "".join(parts)
    try:
        listed, strip = patch_parts.changes(patch, 0)
    except InvalidPolicy:
        return                                   # refused: nothing applied, nothing to show
    assert strip == 1                            # every generated name is under a/ or b/
    paths = {change.path for change in listed}
    with tempfile.TemporaryDirectory() as temp:
        root = Path(temp)
        for name, text in FILES.items():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            (root / name).write_text(text)
            os.chmod(root / name, 0o644)
        before = _tree(root)
        numstat = subprocess.run([GIT, "apply", "--numstat", "-z", f"-p{strip}", "-"], input=patch.encode(),
                                 cwd=root, env=GIT_ENV, capture_output=True, check=False)
        named = {entry.decode() for entry in numstat.stdout.split(b"\0") if entry and b"\t" not in entry}
        named |= {entry.decode().split("\t", 2)[2] for entry in numstat.stdout.split(b"\0")
                  if entry.count(b"\t") == 2 and entry.split(b"\t", 2)[2]}
        assert named <= paths, (patch, named - paths)
        subprocess.run([GIT, "apply", f"-p{strip}", "-"], input=patch.encode(), cwd=root, env=GIT_ENV, capture_output=True,
                       check=False)
        after = _tree(root)
        written = {path for path in before.keys() | after.keys() if before.get(path) != after.get(path)}
        assert written <= paths, (patch, written - paths)
        said: dict[str, list[str]] = {}           # a path may be in several parts
        for change in listed:
            said.setdefault(change.path, []).append(change.action)
        for path in written:                      # and what it did there is what the card says
            if path not in before:
                assert any(a.startswith(("created", "renamed from", "copied from")) for a in said[path]), (patch, path)
            elif path not in after:
                assert any(a == "deleted" or a.startswith("renamed to ") for a in said[path]), (patch, path)
            elif (before[path][0] ^ after[path][0]) & 0o100:
                made = "made executable" if after[path][0] & 0o100 else "made not executable"
                assert any(made in a or a.startswith("created") for a in said[path]), (patch, path)


def test_the_hostile_patch_shows_its_rename_and_mode_change() -> None:
    """Round 10's hostile patch: one headed edit, then parts without ---/+++ headers."""
    patch = ("diff --git a/innocent.txt b/innocent.txt\n--- a/innocent.txt\n+++ b/innocent.txt\n@@ -1 +1 @@\n"
             "-hello\n+hello world\ndiff --git a/victim.txt b/moved-away.txt\nsimilarity index 100%\n"
             "rename from victim.txt\nrename to moved-away.txt\ndiff --git a/script.sh b/script.sh\n"
             "old mode 100644\nnew mode 100755\n")
    listed, strip = patch_parts.changes(patch, 0)
    assert strip == 1
    assert [(c.path, c.action) for c in listed] == [
        ("innocent.txt", "modified"), ("victim.txt", "renamed to moved-away.txt"),
        ("moved-away.txt", "renamed from victim.txt"), ("script.sh", "made executable")]


@pytest.mark.parametrize("patch, says", [
    ("diff --git a/x.bin b/x.bin\nnew file mode 100755\nindex 0000000..1111111\nGIT binary patch\nliteral 1\n"
     "IcmZo*000C20{{R3\n\nliteral 0\nHcmV?d00001\n\n", "binary part"),
    ("diff --git a/x b/x\nindex 1..2 100644\nBinary files a/x and b/x differ\n", "binary part"),
    ("--- a/x\t1970-01-01 00:00:00 +0000\n+++ b/x\n@@ -0,0 +1 @@\n+x\n", "epoch timestamp"),
    ("@@ -1 +1 @@\n-a\n+b\n", "without a file header"),
    ("--- a/x\n+++ b/x\n@@ -1,2 +1,2 @@\n-a\n+b\n", "ends before its line counts"),
    ("diff --git a/x b/x\n", "without the header lines git needs"),
    ("diff --git a/x b/x\nnew file mode 100755\ndeleted file mode 100644\n", "inconsistent header lines"),
])
def test_what_it_cannot_show_is_refused_saying_what(patch: str, says: str) -> None:
    with pytest.raises(InvalidPolicy, match=says):
        patch_parts.changes(patch, 0)


@pytest.mark.parametrize("suffix, name", [
    (" 2020-01-01", "x"), ("  2020-01-01 00:00:00 +0000", "x"), (" 2020-01-01 00:00:00.5", "x"),
    ("\t2020-01-01", "x"), (" 2020-01-01\t", "x 2020-01-01"), ("  junk", "x  junk"), ("\v", "x\v"), ("\f", "x\f"),
])
def test_a_traditional_name_is_the_file_git_writes(tmp_path: Path, suffix: str, name: str) -> None:
    """Round 10's hostile pass: git drops a timestamp after spaces too (whitespace damage), and
    \\v and \\f are part of a name. The name listed is the file git writes, checked on git itself."""
    patch = f"--- a/x{suffix}\n+++ b/x{suffix}\n@@ -1 +1 @@\n-a\n+b\n"
    listed, strip = patch_parts.changes(patch, 0)
    assert [(c.path, c.action) for c in listed] == [(name, "modified")]
    (tmp_path / name).write_text("a\n")
    git = subprocess.run([GIT, "apply", f"-p{strip}", "-"], input=patch.encode(), cwd=tmp_path, env=GIT_ENV,
                         capture_output=True, check=False)
    assert git.returncode == 0 and (tmp_path / name).read_text() == "b\n", git.stderr
