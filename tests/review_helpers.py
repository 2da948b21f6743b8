"""What the review-mode tests share (test_review_overlay: the library through `sandboxd run`;
test_review_sessions: the daemon's sessions): where a workspace may be a lower layer on every
kernel, the usual workspace, the command that changes it in every way, and a byte-for-byte
snapshot of a tree to compare the host with."""

from __future__ import annotations

import contextlib
import os
import stat
import subprocess
import textwrap
from collections.abc import Iterator
from pathlib import Path

from daemon_helpers import PlainUser, owned_dir
from sandboxd.kernel import overlay
from sandboxd.review import changes as listing

TMPFS_MAGIC = 0x01021994


def local_disk(path: str) -> bool:
    """Whether ``path`` is on a file system review mode takes as lower and upper on every kernel: not
    an overlay, nor a tmpfs (user.* attributes only from 6.6). The VM matrix's guest has only those
    writable (virtme's /var and /tmp are overlays over tmpfs)."""
    fd = os.open(path, os.O_PATH)
    try:
        kind = overlay.filesystem_type(fd)
    finally:
        os.close(fd)
    return kind not in overlay.REFUSED_UPPERS and kind != TMPFS_MAGIC


@contextlib.contextmanager
def tmpfs(where: Path, size: str = "256m") -> Iterator[Path]:
    """A tmpfs of the test's own at ``where`` (made): a lower and, as root, an upper on every kernel."""
    where.mkdir(mode=0o755)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "sbxreview", str(where)], check=True,
                   capture_output=True, timeout=60)
    try:
        yield where
    finally:
        if subprocess.run(["umount", str(where)], capture_output=True, timeout=60).returncode != 0:
            subprocess.run(["umount", "-l", str(where)], check=True, capture_output=True, timeout=60)


def free_stores(state_dir: Path) -> None:
    """Remove every change set a test daemon kept under ``state_dir`` (its daemon closed): a bounded
    store is a tmpfs in the host's mount namespace, which no directory removal takes away."""
    review = state_dir / "review"
    for path in sorted(review.iterdir()) if review.is_dir() else []:
        overlay.remove_layers(str(path))


def usual_workspace(ws: Path, owner: PlainUser) -> Path:
    """A new workspace of ``owner``'s at ``ws`` with the usual contents (what EDITS changes)."""
    owned_dir(ws, owner)
    files = {"keep.txt": "keep\n", "mod.txt": "old\n", "del.txt": "delete me\n", "chmod.sh": "#!/bin/sh\n",
             "renamed-src.txt": "moving\n", "olddir/a": "a\n", "olddir/b": "b\n", "replaced/x": "x\n",
             "replaced/y": "y\n", "sub/inner.txt": "inner\n"}
    for rel, text in files.items():
        path = ws / rel
        if not path.parent.exists():
            owned_dir(path.parent, owner)
        path.write_text(text)
        os.chmod(path, 0o644)
        os.chown(path, owner.uid, owner.gid)
    os.symlink("keep.txt", ws / "link")
    os.lchown(ws / "link", owner.uid, owner.gid)
    return ws


# Creates, modifies, deletes, renames, chmods, symlinks and replaces a directory.
EDITS = textwrap.dedent("""\
    set -e
    echo new > added.txt
    echo changed > mod.txt
    rm del.txt
    chmod 755 chmod.sh
    ln -sfn mod.txt link
    mv renamed-src.txt renamed-dst.txt
    rm -rf replaced && mkdir replaced && echo z > replaced/z
    mkdir newdir && echo n > newdir/n
    rm -rf olddir
""")
# The change set EDITS makes: (path, kind).
EXPECTED = {
    ("added.txt", listing.ADDED), ("mod.txt", listing.MODIFIED), ("del.txt", listing.DELETED),
    ("chmod.sh", listing.METADATA), ("link", listing.MODIFIED), ("renamed-src.txt", listing.DELETED),
    ("renamed-dst.txt", listing.ADDED), ("replaced", listing.REPLACED), ("replaced/z", listing.ADDED),
    ("newdir", listing.ADDED), ("newdir/n", listing.ADDED), ("olddir", listing.DELETED),
}


def snapshot(top: Path) -> dict[str, tuple[object, ...]]:
    """Every entry under ``top``: its type, mode, owner and content (a file's bytes, a link's target)."""
    seen: dict[str, tuple[object, ...]] = {}
    for dirpath, dirnames, filenames in os.walk(top):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            st = path.lstat()
            body: object = (os.readlink(path) if stat.S_ISLNK(st.st_mode)
                            else path.read_bytes() if stat.S_ISREG(st.st_mode) else None)
            seen[str(path.relative_to(top))] = (stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode), st.st_uid,
                                                st.st_gid, body)
    return seen


# What a client body does, as a plain user: ARGS["ops"] is a list of [name, request fields]; each
# answer (or its status code and details) is printed as JSON.
CLIENT = r'''
from google.protobuf.json_format import MessageToDict
answers = []
for name, fields in ARGS["ops"]:
    try:
        if name == "create":
            reply = stub.CreateSession(pb.CreateSessionRequest(
                workspace=fields["workspace"], approval_policy=pb.NEVER, review=fields.get("review", True),
                sandbox_policy=pb.SandboxPolicy(mode=pb.SandboxPolicy.Mode.Value(fields.get("mode", "WORKSPACE_WRITE")))),
                timeout=180)
        elif name == "exec":
            out, status = run(fields["session"], ["sh", "-c", fields["script"]])
            answers.append({"ok": True, "stdout": out, "status": status})
            continue
        else:
            request = getattr(pb, name + "Request")(**fields)
            reply = getattr(stub, name)(request, timeout=180)
        answers.append({"ok": True, **MessageToDict(reply, preserving_proto_field_name=True)})
    except grpc.RpcError as error:
        answers.append({"ok": False, "code": error.code().name, "details": error.details()})
print(json.dumps(answers))
'''
