"""Filesystem confinement: what a sandboxed command can write, read and see.

Every test runs real programs inside ``sandboxd run`` and checks both what the
program reported and, for writes, the host state afterwards. "Outside" targets
are 0777 directories under /var/tmp (same filesystem as the workspace, outside
every writable root), so only the sandbox can be what stops a write; the
danger-full-access controls show the very same write succeeding without it.
"""

from __future__ import annotations

import json
import os
import stat
import uuid
from pathlib import Path

import pytest

from conftest import (
    ALL_POLICIES,
    CONFINED,
    EXIT_SETUP,
    WRITABLE,
    WRITE_DENIED,
    WRITE_DENIED_ERRNOS,
    describe,
    make_dir,
    py,
    run_sbx,
)

# Appends to each path given; prints one JSON object {path: "WROTE" | errno name}.
WRITE_PROBE = r"""
import errno, json, sys
out = {}
for path in sys.argv[1:]:
    try:
        with open(path, "a") as f:
            f.write("pwned\n")
        out[path] = "WROTE"
    except OSError as e:
        out[path] = errno.errorcode.get(e.errno, str(e.errno))
print(json.dumps(out))
"""

# Runs os.<op>(*args) for each JSON-encoded [op, args...] row; prints {index: "OK" | errno name}.
OPS_PROBE = r"""
import errno, json, os, sys
out = {}
for i, row in enumerate(json.loads(sys.argv[1])):
    op, *args = row
    try:
        getattr(os, op)(*args)
        out[str(i)] = "OK"
    except OSError as e:
        out[str(i)] = errno.errorcode.get(e.errno, str(e.errno))
print(json.dumps(out))
"""


def try_writes(paths: list[str], *, workspace: Path, policy: str, options: tuple[str, ...] = (),
               cwd_relative: bool = False) -> dict[str, str]:
    """Append to every path from inside the sandbox; return {path: "WROTE" | errno name}."""
    result = run_sbx(py(WRITE_PROBE, *paths), workspace=workspace, policy=policy, options=options)
    assert result.returncode == 0, describe(result)
    return json.loads(result.stdout)


def try_ops(ops: list[list[object]], *, workspace: Path, policy: str,
            options: tuple[str, ...] = ()) -> list[str]:
    """Run os-module operations inside the sandbox; return their outcomes in order."""
    result = run_sbx(py(OPS_PROBE, json.dumps(ops)), workspace=workspace, policy=policy, options=options)
    assert result.returncode == 0, describe(result)
    out = json.loads(result.stdout)
    return [out[str(i)] for i in range(len(ops))]


def assert_denied(outcomes: dict[str, str]) -> None:
    for path, outcome in outcomes.items():
        assert outcome in WRITE_DENIED_ERRNOS, f"write to {path} was not denied: {outcome}"


# --------------------------------------------------------------------------- the workspace


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_workspace_writable_exactly_under_write_policies(policy: str, workspace: Path) -> None:
    """The workspace takes writes under workspace-write(+network) and danger-full-access, not read-only."""
    (workspace / "existing.txt").write_text("before\n")
    outcomes = try_writes([str(workspace / "new.txt"), str(workspace / "existing.txt")],
                          workspace=workspace, policy=policy)
    if policy == "read-only":
        assert_denied(outcomes)
        assert not (workspace / "new.txt").exists()
        assert (workspace / "existing.txt").read_text() == "before\n"
    else:
        assert set(outcomes.values()) == {"WROTE"}, outcomes
        assert (workspace / "new.txt").read_text() == "pwned\n"
        assert (workspace / "existing.txt").read_text() == "before\npwned\n"


@pytest.mark.parametrize("policy", WRITABLE)
def test_workspace_supports_ordinary_file_operations(policy: str, workspace: Path) -> None:
    """mkdir, rename, unlink, symlink, chmod and hardlinks *within* the workspace all work."""
    ws = str(workspace)
    outcomes = try_ops([
        ["mkdir", f"{ws}/d"], ["rename", f"{ws}/d", f"{ws}/e"], ["symlink", "e", f"{ws}/l"],
        ["mknod", f"{ws}/f"], ["link", f"{ws}/f", f"{ws}/g"], ["chmod", f"{ws}/g", 0o600],
        ["unlink", f"{ws}/f"], ["rmdir", f"{ws}/e"],
    ], workspace=workspace, policy=policy)
    assert outcomes == ["OK"] * 8
    assert (workspace / "g").exists() and (workspace / "l").is_symlink() and not (workspace / "e").exists()


def test_read_only_workspace_is_readable(workspace: Path) -> None:
    """Under read-only the workspace is visible (bound) and its files readable."""
    (workspace / "data.txt").write_text("visible content\n")
    result = run_sbx(["cat", "data.txt"], workspace=workspace, policy="read-only")
    assert result.returncode == 0, describe(result)
    assert result.stdout == "visible content\n"


@pytest.mark.parametrize("policy", ["read-only", "workspace-write"])
def test_workspace_under_host_tmp_is_visible_and_usable(policy: str, tmp_workspace: Path) -> None:
    """A workspace under the host's /tmp is bound into the private /tmp: readable, and writable if allowed."""
    (tmp_workspace / "in.txt").write_text("from host\n")
    result = run_sbx(["sh", "-c", "cat in.txt && echo out > out.txt"], workspace=tmp_workspace, policy=policy)
    assert "from host" in result.stdout, describe(result)
    if policy == "read-only":
        assert result.returncode != 0 and not (tmp_workspace / "out.txt").exists()
    else:
        assert result.returncode == 0, describe(result)
        assert (tmp_workspace / "out.txt").read_text() == "out\n"


# --------------------------------------------------------------------------- writes elsewhere


@pytest.mark.parametrize("policy", CONFINED)
def test_writes_outside_are_denied(policy: str, workspace: Path, outside: Path) -> None:
    """Creating or appending outside the writable areas fails (EROFS/EACCES), even to 0777 dirs and 0666 files."""
    tag = uuid.uuid4().hex
    targets = [str(outside / "new.txt"), str(outside / "target.txt"), f"/etc/sbxtest-{tag}",
               f"/usr/sbxtest-{tag}", f"/var/tmp/sbxtest-{tag}", f"/root/sbxtest-{tag}"]
    try:
        assert_denied(try_writes(targets, workspace=workspace, policy=policy))
        assert not (outside / "new.txt").exists()
        assert (outside / "target.txt").read_text() == "original\n"
        for path in targets[2:]:
            assert not os.path.exists(path), f"{path} was created on the host"
    finally:
        for path in targets[2:]:
            if os.path.exists(path):
                os.unlink(path)


@pytest.mark.parametrize("policy", CONFINED)
def test_directory_operations_outside_are_denied(policy: str, workspace: Path, outside: Path) -> None:
    """mkdir, rename, unlink, chmod and symlink creation outside the writable areas all fail."""
    out = str(outside)
    outcomes = try_ops([
        ["mkdir", f"{out}/d"], ["rename", f"{out}/target.txt", f"{out}/moved"], ["unlink", f"{out}/target.txt"],
        ["chmod", f"{out}/target.txt", 0o600], ["symlink", "/etc/passwd", f"{out}/l"],
        ["rename", f"{out}/target.txt", f"{workspace}/stolen"],
    ], workspace=workspace, policy=policy)
    for outcome in outcomes:
        assert outcome in WRITE_DENIED_ERRNOS + ("EXDEV",), outcomes
    assert sorted(os.listdir(outside)) == ["target.txt"]
    assert (outside / "target.txt").stat().st_mode & 0o777 == 0o666


def test_danger_full_access_writes_outside(workspace: Path, outside: Path) -> None:
    """Control: without confinement the same outside writes succeed (so the denials above are the sandbox's)."""
    outcomes = try_writes([str(outside / "new.txt"), str(outside / "target.txt")], workspace=workspace,
                          policy="danger-full-access")
    assert set(outcomes.values()) == {"WROTE"}, outcomes
    assert (outside / "new.txt").read_text() == "pwned\n"
    assert (outside / "target.txt").read_text() == "original\npwned\n"


@pytest.mark.parametrize("policy", CONFINED)
def test_planted_symlinks_do_not_lead_out(policy: str, workspace: Path, outside: Path) -> None:
    """Symlinks in the workspace (to a file and to a directory outside) do not make the outside writable."""
    (workspace / "flink").symlink_to(outside / "target.txt")
    (workspace / "dlink").symlink_to(outside)
    outcomes = try_writes([str(workspace / "flink"), str(workspace / "dlink" / "new.txt"), "flink",
                           "dlink/new2.txt"], workspace=workspace, policy=policy)
    assert_denied(outcomes)
    assert (outside / "target.txt").read_text() == "original\n"
    assert sorted(os.listdir(outside)) == ["target.txt"]


def test_planted_symlinks_lead_out_without_confinement(workspace: Path, outside: Path) -> None:
    """Control: the same symlink writes succeed under danger-full-access."""
    (workspace / "flink").symlink_to(outside / "target.txt")
    (workspace / "dlink").symlink_to(outside)
    outcomes = try_writes([str(workspace / "flink"), str(workspace / "dlink" / "new.txt")],
                          workspace=workspace, policy="danger-full-access")
    assert set(outcomes.values()) == {"WROTE"}, outcomes
    assert (outside / "target.txt").read_text() == "original\npwned\n"


@pytest.mark.parametrize("policy", WRITABLE)
def test_symlink_made_inside_does_not_lead_out(policy: str, workspace: Path, outside: Path) -> None:
    """A symlink the command itself creates in the workspace cannot be written through to the outside."""
    script = (f"ln -s {outside} made && ln -s {outside}/target.txt madefile && echo linked; "
              "echo pwned > made/new.txt; echo pwned >> madefile; exit 0")
    result = run_sbx(["sh", "-c", script], workspace=workspace, policy=policy)
    assert "linked" in result.stdout, describe(result)
    denials = [line for line in result.stderr.splitlines() if any(text in line for text in WRITE_DENIED)]
    assert len(denials) == 2, describe(result)
    assert (workspace / "made").is_symlink()
    assert sorted(os.listdir(outside)) == ["target.txt"]
    assert (outside / "target.txt").read_text() == "original\n"


@pytest.mark.parametrize("policy", CONFINED)
def test_hardlink_from_outside_cannot_be_created(policy: str, workspace: Path, outside: Path) -> None:
    """`ln /outside/file ws/x` fails (EXDEV/EPERM; EROFS when the workspace is read-only) and leaves no link."""
    result = run_sbx(["ln", str(outside / "target.txt"), str(workspace / "hl")], workspace=workspace,
                     policy=policy)
    assert result.returncode != 0, describe(result)
    allowed = ["Invalid cross-device link", "Operation not permitted"]
    if policy == "read-only":
        allowed.append("Read-only file system")
    assert any(text in result.stderr for text in allowed), describe(result)
    assert not os.path.lexists(workspace / "hl")
    assert (outside / "target.txt").stat().st_nlink == 1


@pytest.mark.parametrize("policy", WRITABLE)
def test_hardlink_errno_is_exdev_or_eperm(policy: str, workspace: Path, outside: Path) -> None:
    """The link(2) call itself fails with EXDEV or EPERM, in both directions across the workspace boundary."""
    (workspace / "mine.txt").write_text("mine\n")
    outcomes = try_ops([["link", str(outside / "target.txt"), str(workspace / "hl")],
                        ["link", str(workspace / "mine.txt"), str(outside / "hl")]],
                       workspace=workspace, policy=policy)
    assert outcomes[0] in ("EXDEV", "EPERM"), outcomes
    assert outcomes[1] in ("EXDEV", "EPERM", "EROFS", "EACCES"), outcomes
    assert not os.path.lexists(workspace / "hl") and not os.path.lexists(outside / "hl")


def test_hardlink_possible_without_confinement(workspace: Path, outside: Path) -> None:
    """Control: on the host filesystem the same hardlink works (same filesystem), so EXDEV comes from the sandbox."""
    result = run_sbx(["ln", str(outside / "target.txt"), str(workspace / "hl")], workspace=workspace,
                     policy="danger-full-access")
    assert result.returncode == 0, describe(result)
    assert (outside / "target.txt").stat().st_nlink == 2


@pytest.mark.parametrize("policy", CONFINED)
def test_dotdot_traversal_does_not_escape(policy: str, workspace: Path, outside: Path) -> None:
    """Relative `..` paths and un-normalised absolute paths out of the workspace are still read-only."""
    depth = "../" * (len(workspace.parts) + 3)
    outcomes = try_writes(["../outside/new.txt", f"{depth}{str(outside).lstrip('/')}/new2.txt",
                           f"{workspace}/../outside/target.txt", "./../outside/../outside/new3.txt"],
                          workspace=workspace, policy=policy)
    assert_denied(outcomes)
    assert sorted(os.listdir(outside)) == ["target.txt"]
    assert (outside / "target.txt").read_text() == "original\n"


@pytest.mark.parametrize("policy", CONFINED)
def test_proc_root_links_do_not_escape(policy: str, workspace: Path, outside: Path) -> None:
    """/proc/self/root/..., /proc/1/root/... and /proc/self/cwd/.. cannot be used to write outside."""
    outcomes = try_writes([f"/proc/self/root{outside}/a.txt", f"/proc/1/root{outside}/b.txt",
                           "/proc/self/cwd/../outside/c.txt", f"/proc/self/root{outside}/target.txt",
                           "/proc/1/cwd/../outside/d.txt"],
                          workspace=workspace, policy=policy)
    for path, outcome in outcomes.items():
        assert outcome in WRITE_DENIED_ERRNOS + ("ENOENT",), (path, outcome)
    assert sorted(os.listdir(outside)) == ["target.txt"]
    assert (outside / "target.txt").read_text() == "original\n"


@pytest.mark.parametrize("policy", CONFINED)
def test_root_filesystem_mount_flags(policy: str, base_dir: Path, workspace: Path) -> None:
    """Inside, / is ro,nosuid,nodev; only the writable areas are rw, and those are nosuid,nodev too."""
    extra = make_dir(base_dir / "extra")
    options = ("--writable-root", str(extra)) if policy != "read-only" else ()
    result = run_sbx(["cat", "/proc/self/mountinfo"], workspace=workspace, policy=policy, options=options)
    assert result.returncode == 0, describe(result)
    visible: dict[str, set[str]] = {}
    for line in result.stdout.splitlines():
        fields = line.split()
        visible[fields[4]] = set(fields[5].split(","))  # the last mount on a point is the visible one
    assert {"ro", "nosuid", "nodev"} <= visible["/"], visible["/"]
    writable = {"/tmp", "/dev/shm", "/dev/pts"}
    if policy != "read-only":
        writable |= {str(workspace), str(extra)}
    for point in writable:
        assert "rw" in visible[point] and "nosuid" in visible[point], (point, visible[point])
    for point in writable - {"/dev/pts"}:
        assert "nodev" in visible[point], (point, visible[point])
    if policy == "read-only":
        assert {"ro", "nosuid", "nodev"} <= visible[str(workspace)]
    for point, opts in visible.items():
        if point in writable or point == "/proc" or point.startswith("/dev/") or point.startswith("/proc/"):
            continue
        assert "ro" in opts, f"{point} is mounted {sorted(opts)}"
    assert "ro" in visible["/proc/sys"] and "ro" in visible["/sys"] and "ro" in visible["/dev"]


# --------------------------------------------------------------------------- writable roots


@pytest.mark.parametrize("policy", WRITABLE)
def test_writable_root_is_writable_and_others_are_not(policy: str, base_dir: Path, workspace: Path,
                                                      outside: Path) -> None:
    """A --writable-root takes writes; a sibling directory does not."""
    root = make_dir(base_dir / "root", 0o777)
    outcomes = try_writes([str(root / "a.txt"), str(outside / "b.txt")], workspace=workspace, policy=policy,
                          options=("--writable-root", str(root)))
    assert outcomes[str(root / "a.txt")] == "WROTE"
    assert outcomes[str(outside / "b.txt")] in WRITE_DENIED_ERRNOS
    assert (root / "a.txt").read_text() == "pwned\n"


def test_writable_root_under_tmp(tmp_path: Path, workspace: Path) -> None:
    """A writable root under the host's /tmp is bound into the private /tmp and its writes reach the host."""
    root = make_dir(tmp_path / "under-tmp")
    (root / "seen.txt").write_text("host file\n")
    result = run_sbx(["sh", "-c", f"cat {root}/seen.txt && echo written > {root}/new.txt"],
                     workspace=workspace, options=("--writable-root", str(root)))
    assert result.returncode == 0, describe(result)
    assert result.stdout == "host file\n"
    assert (root / "new.txt").read_text() == "written\n"


def test_nested_writable_roots(base_dir: Path, workspace: Path) -> None:
    """Nested roots (outer, outer/inner, and a root inside the workspace) are all writable."""
    outer = make_dir(base_dir / "outer")
    inner = make_dir(outer / "inner")
    in_ws = make_dir(workspace / "sub" / "deeper")
    outcomes = try_writes([str(outer / "o.txt"), str(inner / "i.txt"), str(in_ws / "w.txt"),
                           str(workspace / "top.txt")],
                          workspace=workspace, policy="workspace-write",
                          options=("--writable-root", str(inner), "--writable-root", str(outer),
                                   "--writable-root", str(in_ws)))
    assert set(outcomes.values()) == {"WROTE"}, outcomes
    assert (inner / "i.txt").read_text() == "pwned\n" and (outer / "o.txt").read_text() == "pwned\n"


def test_writable_root_given_through_symlink(base_dir: Path, workspace: Path) -> None:
    """A root named through a host symlink (outside any writable area) is resolved: writes land in the target."""
    real = make_dir(base_dir / "real")
    (base_dir / "alias").symlink_to(real)
    result = run_sbx(["sh", "-c", f"echo via-link > {base_dir}/alias/x.txt && echo via-real >> {real}/x.txt"],
                     workspace=workspace, options=("--writable-root", str(base_dir / "alias")))
    assert result.returncode == 0, describe(result)
    assert (real / "x.txt").read_text() == "via-link\nvia-real\n"


@pytest.mark.parametrize("through", ["planted", "planted/sub"])
def test_writable_root_through_planted_symlink_is_refused(through: str, workspace: Path, outside: Path) -> None:
    """A root whose path passes through a symlink inside the workspace is refused with 125, nothing runs."""
    make_dir(outside / "sub", 0o777)
    (workspace / "planted").symlink_to(outside)
    result = run_sbx(["sh", "-c", f"echo pwned > {outside}/ran.txt"], workspace=workspace,
                     options=("--writable-root", f"{workspace}/{through}"))
    assert result.returncode == EXIT_SETUP, describe(result)
    assert result.stderr.startswith("sandboxd run:") and "symlink" in result.stderr, describe(result)
    assert not (outside / "ran.txt").exists()


def test_writable_root_through_symlink_in_other_root_is_refused(base_dir: Path, workspace: Path,
                                                                outside: Path) -> None:
    """A symlink planted inside *another* writable root is refused too, not only inside the workspace."""
    other = make_dir(base_dir / "other")
    (other / "planted").symlink_to(outside)
    result = run_sbx(["true"], workspace=workspace,
                     options=("--writable-root", str(other), "--writable-root", f"{other}/planted"))
    assert result.returncode == EXIT_SETUP, describe(result)
    assert "symlink" in result.stderr, describe(result)


@pytest.mark.parametrize("ws", ["/", "/proc", "/sys", "/dev"])
def test_workspace_that_would_expose_the_host_is_refused(ws: str) -> None:
    """A writable workspace of /, or under /proc, /sys or /dev, is refused (125) exactly like the same
    --writable-root: otherwise the whole host, or the host's kernel interfaces, would become writable."""
    tag = uuid.uuid4().hex
    proof = Path(f"/var/tmp/sbxtest-proof-{tag}")
    try:
        result = run_sbx(["sh", "-c", f"touch {proof}; echo RAN"], workspace=ws)
        assert "RAN" not in result.stdout, describe(result)
        assert result.returncode == EXIT_SETUP, describe(result)
        assert result.stderr.startswith("sandboxd run:"), describe(result)
        assert not proof.exists(), "the host root was writable"
    finally:
        proof.unlink(missing_ok=True)


def test_default_workspace_from_root_directory_is_refused() -> None:
    """`cd / && sandboxd run -- cmd` (workspace = cwd = /) must not make the host writable."""
    tag = uuid.uuid4().hex
    proof = Path(f"/var/tmp/sbxtest-proof-{tag}")
    try:
        result = run_sbx(["sh", "-c", f"touch {proof}; echo RAN"], cwd="/")
        assert result.returncode == EXIT_SETUP and "RAN" not in result.stdout, describe(result)
        assert not proof.exists(), "the host root was writable"
    finally:
        proof.unlink(missing_ok=True)


# --------------------------------------------------------------------------- /tmp and /dev


@pytest.mark.parametrize("policy", CONFINED)
def test_tmp_is_private(policy: str, workspace: Path) -> None:
    """The host's /tmp is invisible inside, and files made in the sandbox's /tmp never reach the host."""
    tag = uuid.uuid4().hex
    host_file = Path(f"/tmp/sbxtest-host-{tag}")
    host_file.write_text("host secret\n")
    try:
        script = (f"test -e {host_file} && echo VISIBLE; echo inside > /tmp/sbxtest-inside-{tag} && echo MADE; "
                  "ls -A /tmp | grep -vx home | wc -l")         # home: the command's HOME (cli/run_env.py)
        result = run_sbx(["sh", "-c", script], workspace=workspace, policy=policy)
        assert result.returncode == 0, describe(result)
        lines = result.stdout.split()
        assert "VISIBLE" not in lines and "MADE" in lines, describe(result)
        assert lines[-1] == "1", f"the private /tmp should hold only our file: {describe(result)}"
        assert not os.path.exists(f"/tmp/sbxtest-inside-{tag}")
    finally:
        host_file.unlink()


@pytest.mark.parametrize("where", ["/tmp", "/dev/shm"])
def test_tmp_and_shm_capped_by_tmp_size(where: str, workspace: Path) -> None:
    """dd beyond --tmp-size fails with ENOSPC in /tmp and /dev/shm; a smaller write succeeds."""
    script = (f"dd if=/dev/zero of={where}/small bs=1M count=4 2>/dev/null && echo SMALL-OK; rm -f {where}/small; "
              f"dd if=/dev/zero of={where}/big bs=1M count=16")
    result = run_sbx(["sh", "-c", script], workspace=workspace, options=("--tmp-size", "8M"))
    assert "SMALL-OK" in result.stdout, describe(result)
    assert result.returncode != 0 and "No space left on device" in result.stderr, describe(result)


def test_tmp_default_size_is_512m(workspace: Path) -> None:
    """Without --tmp-size the private /tmp and /dev/shm are 512M tmpfs."""
    result = run_sbx(py("import os\nfor p in ('/tmp', '/dev/shm'):\n s = os.statvfs(p)\n"
                        " print(s.f_blocks * s.f_frsize)"), workspace=workspace)
    assert result.returncode == 0, describe(result)
    assert result.stdout.split() == [str(512 << 20)] * 2


DEV_NODES = {"null", "zero", "full", "random", "urandom", "tty"}
DEV_ALLOWED = DEV_NODES | {"pts", "shm", "ptmx", "fd", "stdin", "stdout", "stderr"}


@pytest.mark.parametrize("policy", CONFINED)
def test_dev_is_minimal(policy: str, workspace: Path) -> None:
    """/dev holds only null zero full random urandom tty, pts, shm, ptmx (+ fd/std* links); no disks, mem, kmsg."""
    result = run_sbx(py("import os, json, stat\nprint(json.dumps({n: stat.S_IFMT(os.lstat('/dev/' + n).st_mode)"
                        " for n in os.listdir('/dev')}))"), workspace=workspace, policy=policy)
    assert result.returncode == 0, describe(result)
    entries = json.loads(result.stdout)
    assert set(entries) <= DEV_ALLOWED, sorted(set(entries) - DEV_ALLOWED)
    assert DEV_NODES | {"pts", "shm", "ptmx"} <= set(entries)
    for name in DEV_NODES:
        assert entries[name] == stat.S_IFCHR, name
    assert not any(entries[n] == stat.S_IFBLK for n in entries)


@pytest.mark.parametrize("policy", CONFINED)
def test_dev_nodes_work_and_dev_is_read_only(policy: str, workspace: Path) -> None:
    """The device nodes behave normally, but nothing can be created in /dev."""
    script = r"""
import errno, os
print(len(open('/dev/urandom', 'rb').read(16)), open('/dev/zero', 'rb').read(4) == bytes(4))
open('/dev/null', 'w').write('x')
try:
    open('/dev/full', 'wb', buffering=0).write(b'x')
except OSError as e:
    print('full', errno.errorcode[e.errno])
for op in (lambda: open('/dev/sbxtest', 'w'), lambda: os.mkdir('/dev/sbxdir'), lambda: os.symlink('/', '/dev/l')):
    try:
        op(); print('CREATED')
    except OSError as e:
        print('create', errno.errorcode[e.errno])
"""
    result = run_sbx(py(script), workspace=workspace, policy=policy)
    assert result.returncode == 0, describe(result)
    lines = result.stdout.splitlines()
    assert lines[:2] == ["16 True", "full ENOSPC"], describe(result)
    assert all(line.split()[1] in WRITE_DENIED_ERRNOS for line in lines[2:]) and len(lines) == 5, describe(result)


# --------------------------------------------------------------------------- /proc and /sys


@pytest.mark.parametrize("policy", CONFINED)
def test_proc_sys_is_not_writable(policy: str, workspace: Path) -> None:
    """/proc/sys is read-only: writing kernel/domainname (UTS-namespaced, allowed to uid 0 by mode) fails."""
    script = "cat /proc/sys/kernel/domainname && echo sbxtest > /proc/sys/kernel/domainname && echo WROTE; " \
             "cat /proc/sys/kernel/domainname"
    result = run_sbx(["sh", "-c", script], workspace=workspace, policy=policy)
    assert "WROTE" not in result.stdout, describe(result)
    assert "sbxtest" not in result.stdout
    assert any(text in result.stderr for text in ("Read-only file system", "Permission denied")), describe(result)


@pytest.mark.parametrize("policy", CONFINED)
def test_sys_is_not_writable(policy: str, workspace: Path) -> None:
    """/sys is read-only: writing back a sysfs attribute's own value (mode 0644 root) fails; creating fails."""
    attribute = "/sys/kernel/mm/ksm/run"
    if not os.path.exists(attribute):
        attribute = "/sys/kernel/uevent_seqnum"  # read-only by mode: still must not be writable
    script = f"v=$(cat {attribute}) && echo $v > {attribute} && echo WROTE; mkdir /sys/sbxtest && echo MKDIR"
    result = run_sbx(["sh", "-c", script], workspace=workspace, policy=policy)
    assert "WROTE" not in result.stdout and "MKDIR" not in result.stdout, describe(result)
    assert "Read-only file system" in result.stderr or "Permission denied" in result.stderr, describe(result)


@pytest.mark.parametrize("policy", CONFINED)
def test_sensitive_proc_and_sys_files_are_masked(policy: str, workspace: Path) -> None:
    """/proc/kcore, kallsyms, keys, timer_list, kmsg... yield nothing; /sys/firmware etc. are empty."""
    script = r"""
import json, os
out = {}
for name in ('kcore', 'kallsyms', 'keys', 'timer_list', 'sched_debug', 'kmsg', 'kpageflags', 'config.gz'):
    path = '/proc/' + name
    try:
        with open(path, 'rb') as f:
            out[path] = len(f.read(4096))
    except OSError as e:
        out[path] = 'error'
for path in ('/sys/firmware', '/sys/kernel/security', '/sys/kernel/debug'):
    try:
        out[path] = os.listdir(path)
    except OSError:
        out[path] = []
print(json.dumps(out))
"""
    result = run_sbx(py(script), workspace=workspace, policy=policy)
    assert result.returncode == 0, describe(result)
    for path, value in json.loads(result.stdout).items():
        assert value in (0, "error", []), f"{path} leaked: {value}"


@pytest.mark.parametrize("policy", CONFINED)
def test_dmesg_fails(policy: str, workspace: Path) -> None:
    """The kernel log cannot be read (syslog is filtered, /dev/kmsg absent, /proc/kmsg masked)."""
    result = run_sbx(["dmesg"], workspace=workspace, policy=policy)
    assert result.returncode != 0, describe(result)
    assert result.stdout == ""


@pytest.mark.parametrize("policy", CONFINED)
def test_proc_shows_only_the_sandbox(policy: str, workspace: Path) -> None:
    """/proc is a fresh procfs of the new PID namespace: PID 1 (sandboxd's init) and the command itself."""
    script = ("import json, os\nprint(json.dumps([sorted(int(p) for p in os.listdir('/proc') if p.isdigit()),"
              " os.getpid()]))\nprint(open('/proc/1/comm').read().strip())")
    result = run_sbx(py(script), workspace=workspace, policy=policy)
    assert result.returncode == 0, describe(result)
    first, comm = result.stdout.splitlines()
    pids, me = json.loads(first)
    assert pids == sorted({1, me}), describe(result)
    assert comm.startswith("sandboxd"), comm
