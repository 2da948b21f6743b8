"""What the review-mode tests share (test_review_overlay: the library through `sandboxd run`;
test_review_checkpoints: checkpoints and rollback; test_review_sessions: the daemon's sessions):
where a workspace may be a lower layer on every kernel, the usual workspace, the command that
changes it in every way, a byte-for-byte snapshot of a tree to compare the host with, and a kept
change set read as root and compared or applied as its owner the way the daemon does."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import subprocess
import tempfile
import textwrap
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from conftest import SLOW
from daemon_helpers import PlainUser, owned_dir
from sandboxd.cli.change_sets import plain
from sandboxd.kernel import caps, overlay, review_space
from sandboxd.review import apply as applying
from sandboxd.review import changes as listing
from sandboxd.review import conflicts, diff, kept, upper

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


@contextlib.contextmanager
def review_base() -> Iterator[Path]:
    """A directory 0755 of root's under /var/tmp, removed afterwards (the review stores the tests
    left under it unmounted first): where /var/tmp is no local disk (the VM guest: overlays over
    tmpfs, no loop devices), a tmpfs of the test's own there, a lower and, as root, an upper on
    every kernel."""
    with contextlib.ExitStack() as stack:
        top = Path(tempfile.mkdtemp(prefix="sbxreview-", dir="/var/tmp"))
        stack.callback(shutil.rmtree, top, ignore_errors=True)
        stack.callback(subprocess.run, ["chmod", "-R", "u+rwx", str(top)], capture_output=True)
        os.chmod(top, 0o755)
        base = top if local_disk(str(top)) else stack.enter_context(tmpfs(top / "disk"))
        stack.callback(release_stores, top)             # first: they may sit on the tmpfs above
        yield base


def release_stores(top: "Path | str") -> None:
    """Unmount the review stores (kernel.review_space: a tmpfs per root run's review directory) the
    tests left under ``top``, deepest first."""
    with open("/proc/self/mountinfo") as info:
        points = [line.split()[4] for line in info if line.split()[4].startswith(f"{top}/")]
    for point in sorted(points, reverse=True):
        review_space.release(point)


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


def scan_kept(review_dir: Path) -> tuple[overlay.Layers, list[upper.UpperEntry]]:
    """The one overlay kept in ``review_dir`` and its change set, every layer merged (as root)."""
    (layers,) = overlay.load(str(review_dir))
    fds = kept.open_stack(layers)
    try:
        return layers, upper.scan_stack(fds, prefix=layers.xattr_prefix)
    finally:
        kept.close_stack(fds)


def as_owner(user: PlainUser, review_dir: Path, body: str, **options: Any) -> dict[str, Any]:
    """Run ``body`` ("apply", "list" or "diff") over the kept change set the way the daemon will: the
    layers read as root here (every layer, checkpoints merged), then a forked child that drops to
    ``user`` (no capability, no groups) compares it with the host and applies (the conflict
    baseline, root's, read and saved here). Returns the child's result."""
    layers, entries = scan_kept(review_dir)
    baseline = conflicts.load_baseline(os.path.dirname(layers.upper), layers.started_ns)
    fds = kept.open_stack(layers)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read)
            caps.drop_privileges(user.uid, user.gid)
            host_fd = os.open(layers.root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
            with listing.Comparison(entries, upper_fd=fds[0], host_fd=host_fd, layers=layers, baseline=baseline,
                                    checkpoint_fds=fds[1:]) as compared:
                result: object
                if body == "list":
                    result = compared.list()
                elif body == "diff":
                    (change,) = compared.list(under=options["path"]).changes
                    result = {"diff": diff.show(compared, change)}
                else:
                    result = applying.apply(compared, **options)
            os.write(write, json.dumps({"ok": plain(result)}).encode())
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            os.write(write, json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode())
        finally:
            os._exit(0)
    os.close(write)
    kept.close_stack(fds)
    data = b""
    while chunk := os.read(read, 1 << 16):
        data += chunk
    os.close(read)
    os.waitpid(pid, 0)
    answer: dict[str, Any] = json.loads(data)
    assert "ok" in answer, answer
    ok: dict[str, Any] = answer["ok"]
    if body == "apply":                                 # kept beside the layers, as the daemon will
        conflicts.save_baseline(os.path.dirname(layers.upper),
                                conflicts.Baseline(started_ns=ok["baseline"]["started_ns"],
                                                   applied=ok["baseline"]["applied"]))
    return ok


def kinds(change_set: dict[str, Any]) -> set[tuple[str, str]]:
    return {(change["path"], change["kind"]) for change in change_set["changes"]}


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


PROMPT = b"[a]pply [d]iscard [k]eep [r]eview? "          # the end-of-review question (cli.keys.ask_review)


@contextlib.contextmanager
def on_a_pty(argv: Sequence[str], env: Mapping[str, str], cwd: str = "/") -> Iterator[
        tuple[int, list[bytes], "subprocess.Popen[bytes]"]]:
    """``argv`` with a pty as its terminal: (master, output so far, process)."""
    master, slave = os.openpty()
    process = subprocess.Popen(list(argv), stdin=slave, stdout=slave, stderr=slave, env={**env, "TERM": "dumb"},
                               cwd=cwd, start_new_session=True)
    os.close(slave)
    output: list[bytes] = []

    def pump() -> None:
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:
                return
            if not chunk:
                return
            output.append(chunk)
    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        yield master, output, process
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=60)
        reader.join(timeout=10)
        os.close(master)


def wait_for(output: list[bytes], text: bytes, count: int = 1,
             process: "subprocess.Popen[bytes] | None" = None) -> None:
    """Until ``text`` was shown ``count`` times (an assertion with what was shown past 60 s, or
    once ``process`` ended)."""
    deadline = time.monotonic() + 60 * SLOW
    while b"".join(output).count(text) < count:
        ended = f" (it ended with {process.returncode})" if process is not None and process.poll() is not None else ""
        assert time.monotonic() < deadline and not ended, b"".join(output).decode(errors="replace") + ended
        time.sleep(0.05)
