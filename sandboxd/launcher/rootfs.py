"""The sandbox's root filesystem, built in a fresh mount namespace, in this order.

1. Make every mount private, so nothing we do propagates to the host (and
   nothing the host mounts later leaks in).
2. Put a small private tmpfs on /tmp as a staging area, and bind the host's
   whole tree (recursively, every submount) at /tmp/root.
3. Make that copy read-only, nosuid and nodev in one recursive step: a device
   node on a read-only mount can still be written, so nodev matters.
4. Cover /proc with a fresh procfs for the new PID namespace, and mask the
   kernel's secrets and knobs in it.
5. Cover /sys with a fresh read-only sysfs (the copy showed the host's
   network devices and cgroup release_agent files).
6. Cover /dev with a minimal tmpfs: the six harmless nodes bound from the
   host, a private devpts holding at most ``limits.ptys`` terminals, a private
   /dev/shm; then make /dev read-only.
7. Cover /tmp with a private, size-capped tmpfs.
   7b. `sandboxd run`'s homes: cover each hidden home (LaunchSpec.hidden_homes) with an empty
   tmpfs, to be made read-only in 8d; the interpreter and package sandboxd runs from, and the
   command's cwd, stay visible read-only when they live there (a pyenv, a venv, a CI checkout
   with the build directory as the workspace). Make the command's
   HOME (LaunchSpec.private_home) in the private /tmp, its user's. Before 8, so a workspace
   inside a hidden home is attached over it.
8. Attach the workspace and writable roots read-write (under read-only, the
   workspace read-only, so it is seen even when it lives under /tmp), parents before
   children, from the detached mount trees the parent cloned from the very descriptors
   the caller's rights were checked on (launcher.plan, kernel.access): a name swapped
   since then changes nothing, and roots under /tmp are reachable that way too; in review
   mode cover each attached root at once with its overlay (kernel.overlay: the attached tree
   is the lower layer, the upper and work directories were opened in step 1b); then pin
   and re-protect the protected subpaths.
   8b. With an isolated network, bind its resolv.conf over /etc/resolv.conf.
   8c. Cover sandboxd's own places (its sockets' directory, its state directory): an empty
   read-only tmpfs over a directory, /dev/null over a file. After 8, so a workspace that
   contains them (a root caller's /var) does not show them either.
   8d. Make the hidden homes' tmpfs read-only: a write there could not be told from a write to
   the real home (a planted ~/.bashrc), which is what a sandbox is checked for.
   8e. With certificates to trust (LaunchSpec.trust_pem: its proxy's CA), write the host's CA
   bundle followed by them to a file on the staging tmpfs (enlarged for it in step 2), and bind
   that file read-only over each of launcher.trust_bundle.TRUST_BUNDLE_PATHS the copy holds
   (a symlink followed inside the copy): clients that read the system bundle trust the proxy too.
   The file lives on no mount the sandbox can reach but through those read-only binds.
9. pivot_root into the copy and drop the old root entirely.

Step 1b (review mode): open each overlay's upper and work directories and its checkpoint layers
(kernel.overlay.Layers.checkpoints, stacked under the upper), in this namespace (overlayfs takes
no layer from another) and before step 2 covers /tmp, where a `sandboxd run` review directory
may be.

Every kernel call here, and the lookups the steps decide by, go through kernel.syscalls.current
(``kernel = syscalls.current``): tests/test_setup_order.py records them instead, to hold this order
as a numbered list without root.
"""

from __future__ import annotations

import errno
import os

from sandboxd.errors import SetupError
from sandboxd.kernel import syscalls
from sandboxd.kernel.mounts import (
    MOUNT_ATTR_NODEV,
    MOUNT_ATTR_NOSUID,
    MOUNT_ATTR_RDONLY,
    MS_BIND,
    MS_NODEV,
    MS_NOEXEC,
    MS_NOSUID,
    MS_RDONLY,
    MS_REMOUNT,
)
from sandboxd.launcher import rootless
from sandboxd.launcher.trust_bundle import TRUST_BUNDLE_PATHS
from sandboxd.policy.spec import MAX_TRUST_PEM
from sandboxd.launcher.plan import LaunchPlan
from sandboxd.policy.git_dirs import FoundGitDirs
from sandboxd.policy.sandbox import is_within
from sandboxd.policy.git_config import (GIT_DIR_CREATE_EMPTY, GIT_DIR_NESTED, GIT_GUARD_SUBPATH,
                                        git_dir_entry_writable)

TYPE_CHECKING = False
if TYPE_CHECKING:
    from sandboxd.kernel.overlay import Layers

STAGE = "/tmp"
NEW_ROOT = STAGE + "/root"
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
# Kernel interfaces a process that is uid 0 without capabilities could still
# read or write through plain file permissions.
PROC_READONLY = ("sys", "sysrq-trigger", "irq", "bus", "fs", "driver")
PROC_MASKED = ("kcore", "keys", "timer_list", "sched_debug", "kallsyms", "kmsg", "kpagecount", "kpageflags",
               "kpagecgroup", "config.gz")
SYS_MASKED = ("firmware", "kernel/security", "kernel/debug")
READONLY_ATTRS = MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV
# The walk that finds the git directories of a writable root at build: bounded, so that a huge
# tree costs a bounded time (repositories beyond are left to the post-call git guard).
GIT_WALK_MAX_DIRS = 20_000
GIT_WALK_MAX_DEPTH = 16
GIT_NESTED_MAX_DEPTH = 6
STAGE_SIZE = 1 << 20
# The largest host CA bundle step 8e copies (Debian's and Fedora's are about 220 KB); the staging
# tmpfs grows by it and MAX_TRUST_PEM when there is one to copy.
MAX_HOST_BUNDLE = 4 << 20
TRUST_BUNDLE_FILE = STAGE + "/trust-bundle.pem"


def build(plan: LaunchPlan) -> None:
    kernel = syscalls.current
    kernel.make_private("/")                                                        # 1
    if plan.rootless:
        rootless.clone_roots(plan.root_trees)    # for step 8, before /tmp is covered
    layer_dirs = _open_layer_dirs(plan.review_layers)                                # 1b
    try:
        _build_tree(plan, layer_dirs)
    finally:
        for fds in layer_dirs.values():
            for fd in fds:
                kernel.close(fd)


def _build_tree(plan: LaunchPlan, layer_dirs: "dict[str, tuple[int, ...]]") -> None:
    kernel = syscalls.current
    stage_size = STAGE_SIZE + (MAX_HOST_BUNDLE + MAX_TRUST_PEM if plan.trust_pem else 0)
    kernel.tmpfs(STAGE, size=stage_size, mode=0o700, step="mount staging tmpfs")      # 2
    kernel.mkdir(NEW_ROOT, 0o755)
    kernel.bind("/", NEW_ROOT, step="bind host root")
    kernel.set_attrs_recursive(NEW_ROOT, READONLY_ATTRS, step="make host root read-only")  # 3
    _mount_proc(NEW_ROOT + "/proc")                                                  # 4
    _mount_sys(NEW_ROOT + "/sys", plan.rootless)                                     # 5
    _mount_dev(NEW_ROOT + "/dev", plan.limits.tmp_size_bytes, plan.limits.ptys)      # 6
    kernel.tmpfs(NEW_ROOT + "/tmp", size=plan.limits.tmp_size_bytes, mode=0o1777,    # 7
                 step="mount private /tmp")
    covered = [home for home in plan.hidden_homes
               if not any(is_within(home, root) for root in (*plan.readonly_roots, *plan.writable_roots))]
    for home in covered:                                                             # 7b
        _cover_home(home, plan)
    if plan.private_home:
        kernel.makedirs(NEW_ROOT + plan.private_home, 0o700)
        kernel.chown(NEW_ROOT + plan.private_home, plan.uid, plan.gid)
    for root in plan.readonly_roots:                                                 # 8
        _attach_root(root, plan.root_trees[root], writable=False)
    for root in plan.writable_roots:
        _attach_root(root, plan.root_trees[root], writable=True,
                     review=(plan.review_layers[root], layer_dirs[root]) if root in layer_dirs else None)
    for root in plan.writable_roots:
        _protect_root(root, plan.protected_subpaths, plan.git_dirs.get(root), reviewed=root in layer_dirs)
    plan.close_trees()
    if plan.resolv_conf is not None:                                                 # 8b
        _bind_resolv_conf(plan.resolv_conf)
    for path in plan.hidden_paths:                                                   # 8c
        _hide(path)
    for home in covered:                                                             # 8d
        if kernel.ismount(NEW_ROOT + home):
            kernel.mount(None, NEW_ROOT + home, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV,
                         step="make hidden home read-only")
    if plan.trust_pem:                                                               # 8e
        _bind_trust_bundle(plan.trust_source, plan.trust_pem)
    kernel.pivot_root_here(NEW_ROOT)                                                 # 9


def _mount_proc(target: str) -> None:
    kernel = syscalls.current
    kernel.mount("proc", target, "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, step="mount /proc")
    for name in PROC_READONLY:
        path = f"{target}/{name}"
        if kernel.isdir(path) or kernel.isfile(path):
            kernel.bind(path, path, recursive=True, step=f"protect /proc/{name}")
            kernel.set_attrs_recursive(path, READONLY_ATTRS, step=f"protect /proc/{name}")
    for name in PROC_MASKED:
        path = f"{target}/{name}"
        if kernel.lexists(path):
            kernel.bind("/dev/null", path, recursive=False, step=f"mask /proc/{name}")


def _in_copy(path: str) -> str | None:
    """Where the copy's file ``path`` is, its symlinks (such as systemd's resolv.conf) followed
    inside the copy, not on the host; None when that is no regular file."""
    kernel = syscalls.current
    target = NEW_ROOT + path
    for _ in range(8):
        if not kernel.islink(target):
            break
        link = kernel.readlink(target)
        target = NEW_ROOT + link if link.startswith("/") else os.path.join(os.path.dirname(target), link)
    return target if kernel.isfile(target) else None


def _bind_trust_bundle(source: str, pem: str) -> None:
    """Step 8e: the host's bundle ``source`` and ``pem`` in one staging file, bound read-only over
    every system bundle of the copy (each once, however many names lead to it)."""
    kernel = syscalls.current
    kernel.write_concatenated(TRUST_BUNDLE_FILE, source, pem, 0o444, limit=MAX_HOST_BUNDLE,
                              step="write the trust bundle")
    targets = (_in_copy(path) for path in TRUST_BUNDLE_PATHS)
    for target in dict.fromkeys(target for target in targets if target is not None):
        kernel.bind(TRUST_BUNDLE_FILE, target, recursive=False, step="bind the trust bundle")
        kernel.mount("none", target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV,
                     step="make the trust bundle read-only")


def _bind_resolv_conf(text: str) -> None:
    """An isolated network's resolvers: a file on the staging tmpfs, bound read-only over the
    copy's /etc/resolv.conf (see _in_copy). The bind keeps the staging file alive after
    pivot_root detaches the rest."""
    kernel = syscalls.current
    target = _in_copy("/etc/resolv.conf")
    if target is None:
        return                                            # the host has none: DNS stays unconfigured
    source = STAGE + "/resolv.conf"
    kernel.write_file(source, text, 0o644)
    kernel.bind(source, target, step="bind resolv.conf")
    kernel.mount("none", target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV,
                 step="make resolv.conf read-only")


def _mount_sys(target: str, rootless: bool) -> None:
    kernel = syscalls.current
    try:
        kernel.mount("sysfs", target, "sysfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, step="mount /sys")
    except SetupError as exc:
        # In the host's network namespace the kernel hands out the host's own sysfs
        # superblock, already mounted read-write: EBUSY (rootless: EPERM, that namespace is not
        # ours). The read-only copy from step 3 then stays; only the masks below are added.
        if exc.errno != errno.EBUSY and not (rootless and exc.errno == errno.EPERM):
            raise
    for name in SYS_MASKED:
        path = f"{target}/{name}"
        if kernel.isdir(path):
            kernel.tmpfs(path, size=4096, mode=0o555, flags=MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC,
                         step=f"mask /sys/{name}")


def _mount_dev(target: str, shm_size: int, ptys: int) -> None:
    kernel = syscalls.current
    kernel.tmpfs(target, size=1 << 16, mode=0o755, flags=MS_NOSUID | MS_NOEXEC, step="mount /dev")
    for name in DEVICES:
        node = f"{target}/{name}"
        kernel.create_file(node, 0o666)
        kernel.bind(f"/dev/{name}", node, recursive=False, step=f"bind /dev/{name}")
    kernel.mkdir(f"{target}/pts", 0o755)
    # max=: every devpts instance but the host's draws on one kernel-wide pool of ptys
    # (policy.limits.DEFAULT_PTYS); past its own max a sandbox's next /dev/ptmx open gets ENOSPC.
    kernel.mount("devpts", f"{target}/pts", "devpts", MS_NOSUID | MS_NOEXEC,
                 f"newinstance,ptmxmode=0666,mode=0620,max={ptys}", step="mount /dev/pts")
    kernel.symlink("pts/ptmx", f"{target}/ptmx")
    kernel.mkdir(f"{target}/shm", 0o1777)
    kernel.tmpfs(f"{target}/shm", size=shm_size, mode=0o1777, step="mount /dev/shm")
    for name, dest in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                       ("stderr", "/proc/self/fd/2")):
        kernel.symlink(dest, f"{target}/{name}")
    kernel.mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NOEXEC,
                 step="make /dev read-only")


def _open_layer_dirs(layers: "dict[str, Layers]") -> "dict[str, tuple[int, ...]]":
    """Step 1b: (upper, work, checkpoint layers oldest first) descriptors of each reviewed root's
    overlay, opened here (see the module's text); O_PATH, never through a symlink (the review
    directory is sandboxd's own)."""
    kernel = syscalls.current
    opened: dict[str, tuple[int, ...]] = {}
    try:
        for root, layer in layers.items():
            fds: list[int] = []
            try:
                for path in (layer.upper, layer.work, *layer.checkpoints):
                    fds.append(kernel.open_dir_path(path, step="open review layers"))
            except BaseException:
                for fd in fds:
                    kernel.close(fd)
                raise
            opened[root] = tuple(fds)
    except BaseException:
        for fds_of_root in opened.values():
            for fd in fds_of_root:
                kernel.close(fd)
        raise
    return opened


def _attach_root(root: str, tree: int, *, writable: bool,
                 review: "tuple[Layers, tuple[int, ...]] | None" = None) -> None:
    kernel = syscalls.current
    target = NEW_ROOT + root
    if not kernel.lexists(target):
        # Only possible under a directory the sandbox replaced (e.g. /tmp): make the mount point.
        if kernel.is_dir_fd(tree):
            kernel.makedirs(target, 0o755, exist_ok=True)
        else:
            kernel.makedirs(os.path.dirname(target), 0o755, exist_ok=True)
            kernel.create_file(target, 0o644)
    kernel.attach_tree(tree, target, step="bind root")
    if review is not None:
        layer, (upper, work, *checkpoints) = review
        lower = kernel.open_dir_path(target, step="open review lower")  # the tree just attached
        try:
            kernel.mount_overlay(target, lower_fd=lower, upper_fd=upper, work_fd=work, userxattr=layer.userxattr,
                                 shown=root, checkpoint_fds=tuple(checkpoints))
        finally:
            kernel.close(lower)
    if writable:
        kernel.set_attrs_recursive(target, MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV, MOUNT_ATTR_RDONLY,
                                   step="bind writable root")
    else:
        kernel.set_attrs_recursive(target, READONLY_ATTRS, step="bind read-only workspace")


def _cover_home(home: str, plan: LaunchPlan) -> None:
    """Step 7b: an empty tmpfs of the command's user over ``home`` (a real path: cli.run_env), with
    what must stay visible in it bound back read-only: sandboxd's own install, and the command's
    cwd when it was put there (`--cwd ~/checkout` with the workspace elsewhere, a CI runner's
    layout). Writable until 8d, for the mount points of the roots inside."""
    kernel = syscalls.current
    target = NEW_ROOT + home
    if not kernel.isdir(target) or kernel.islink(target):
        return                                            # under a replaced directory (/tmp), or gone
    kernel.tmpfs(target, size=1 << 16, mode=0o700, step="cover a home")
    kernel.chown(target, plan.uid, plan.gid)
    roots = (*plan.readonly_roots, *plan.writable_roots)
    cwd = () if any(is_within(plan.cwd, root) for root in roots) else (plan.cwd,)   # else attached in 8
    for kept in sorted({*_own_install(), *cwd}, key=len):
        if kept != home and is_within(kept, home):
            _bind_back(kept)


def _bind_back(path: str) -> None:
    """Bind the host's directory ``path`` read-only at the same place in the copy, reached from / one
    component at a time without following symlinks: a name its home's owner swaps cannot point
    the bind elsewhere. A path that is not such a directory stays hidden."""
    kernel = syscalls.current
    flags = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open("/", flags)
    try:
        for part in path.strip("/").split("/"):
            fd, parent = os.open(part, flags, dir_fd=fd), fd
            os.close(parent)
    except OSError:
        os.close(fd)
        return
    try:
        tree = kernel.clone_tree(fd, step="keep a directory of a hidden home", path=path)
    finally:
        os.close(fd)
    try:
        kernel.makedirs(NEW_ROOT + path, 0o755, exist_ok=True)
        kernel.attach_tree(tree, NEW_ROOT + path, step="keep a directory of a hidden home")
    finally:
        os.close(tree)
    kernel.set_attrs_recursive(NEW_ROOT + path, READONLY_ATTRS, step="keep a directory of a hidden home")


def _own_install() -> tuple[str, ...]:
    """The interpreter's prefixes and the directory of the sandboxd package, as real paths: what
    this process (the sandbox's init) and a command started with the same Python may still load."""
    import sys
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    paths = (sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(package))
    return tuple(dict.fromkeys(os.path.realpath(path) for path in paths))


def _hide(path: str) -> None:
    """Cover one of sandboxd's own paths (step 8c): it may hold the daemon's sockets or its audit
    log, which no sandbox may reach, whatever its uid or network."""
    kernel = syscalls.current
    target = NEW_ROOT + path
    if not kernel.lexists(target):
        return                                            # under a replaced directory (/tmp): not there
    if kernel.isdir(target) and not kernel.islink(target):
        kernel.tmpfs(target, size=4096, mode=0o555, flags=MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC,
                     step="hide sandboxd's own directory")
    else:
        kernel.bind("/dev/null", target, recursive=False, step="hide sandboxd's own socket")


def _protect_root(root: str, subs: tuple[str, ...], found: FoundGitDirs | None = None, *,
                  reviewed: bool = False) -> None:
    """The protected subpaths of one writable root and, while .git/config is one of them (the
    default), the control files of every git directory under it (see _protect_git_dir): those the
    git guard's baseline walk just found (``found``, LaunchPlan.git_dirs), else from a walk here.
    ``reviewed``: the root is an overlay, and its git directories are left as they are: nothing the
    sandbox writes there reaches the host but by an apply, which flags every change to a git
    directory's control files and applies none unless a person names it (review.rules). This
    also spares a review launch the walk for git directories (a second or more in a workspace of
    20,000 directories)."""
    done: dict[str, bool] = {}                      # path -> already read-only (else only pinned)
    if GIT_GUARD_SUBPATH in subs and not reviewed:
        top = NEW_ROOT + root
        if found is None:
            gitdirs = _find_git_dirs(top)
        else:
            # The guard walks every directory of the root's filesystem, with no depth bound and
            # 200,000 directories where this walk stops at 20,000 and depth 16: what it found is a
            # superset of what _find_git_dirs finds there. It does not enter another filesystem
            # mounted under the root; the attached tree holds it, so it is walked here as before.
            gitdirs = sorted({*(f"{top}/{rel}" for rel in found.git_dirs),
                              *(gitdir for rel in found.other_filesystems for gitdir in _find_git_dirs(f"{top}/{rel}"))})
        for gitdir in gitdirs:
            _protect_git_dir(root, gitdir, done)
    for sub in subs:
        _protect(root, sub, done)


def _find_git_dirs(top: str) -> list[str]:
    """The ``.git`` directories under ``top`` (not symlinks; not inside another git directory),
    parents first, from a walk bounded in directories and depth. Each directory is opened from its
    parent's descriptor (O_NOFOLLOW: a symlink is never followed), not looked up from / again."""
    found: list[str] = []
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    # (path, descriptor to open it from or -1 for top, depth); a parent's descriptor is closed
    # once its last subdirectory was taken off the stack (refs).
    refs: dict[int, int] = {}
    stack: list[tuple[str, int, int]] = [(top, -1, 0)]
    seen = 0
    try:
        while stack and seen < GIT_WALK_MAX_DIRS:
            path, parent, depth = stack.pop()
            seen += 1
            try:
                fd = os.open(path, flags) if parent < 0 else os.open(path.rsplit("/", 1)[1], flags, dir_fd=parent)
            except OSError:
                fd = -1
            finally:
                if parent >= 0:
                    _release(parent, refs)
            if fd < 0:
                continue
            subdirs: list[str] = []
            try:
                with os.scandir(fd) as entries:
                    for entry in entries:
                        if not entry.is_dir(follow_symlinks=False):
                            continue
                        if entry.name == ".git":
                            found.append(f"{path}/.git")
                        elif depth < GIT_WALK_MAX_DEPTH:
                            subdirs.append(entry.name)
            except OSError:
                pass
            if subdirs:
                refs[fd] = len(subdirs)
                stack.extend((f"{path}/{name}", fd, depth + 1) for name in subdirs)
            else:
                os.close(fd)
    finally:
        for fd in refs:                             # the walk stopped early (GIT_WALK_MAX_DIRS)
            os.close(fd)
    return sorted(found)


def _release(fd: int, refs: dict[int, int]) -> None:
    refs[fd] -= 1
    if refs[fd] == 0:
        del refs[fd]
        os.close(fd)


def _protect_git_dir(root: str, gitdir: str, done: dict[str, bool], depth: int = 0) -> None:
    """Everything in an existing git directory read-only but what git add, commit, checkout, branch,
    stash, fetch and gc write (sandboxd.policy.git_config.GIT_DIR_WRITABLE): config, hooks/, info/,
    description, commondir, config.worktree, anything unknown. hooks/ and info/ are made (empty, as
    `git init` does) when missing, so that no hook can appear in them. .git itself and its ancestors
    are pinned (a mount point cannot be renamed away); modules/* and worktrees/* are git directories
    themselves. The git guard (gitguard/guard.py) covers what appears later."""
    kernel = syscalls.current
    if kernel.islink(gitdir) or not kernel.isdir(gitdir):
        return
    _pin_down_to(NEW_ROOT + root, gitdir, done)
    _make_empty_dirs(NEW_ROOT + root, gitdir)
    for entry in list(kernel.scandir(gitdir)):
        if git_dir_entry_writable(entry.name) or entry.is_symlink():
            continue                                 # a symlinked hooks/ or config is refused by _protect
        if entry.name in GIT_DIR_NESTED and entry.is_dir(follow_symlinks=False):
            _pin(entry.path, done)
            for nested in _nested_git_dirs(entry.path, depth):
                _protect_git_dir(root, nested, done, depth + 1)
            continue
        if entry.path not in done or not done[entry.path]:
            if entry.path not in done:
                kernel.bind(entry.path, entry.path, recursive=True, step="protect git directory")
            kernel.set_attrs_recursive(entry.path, READONLY_ATTRS, step="protect git directory")
            done[entry.path] = True


def _make_empty_dirs(top: str, gitdir: str) -> None:
    """Make the missing GIT_DIR_CREATE_EMPTY directories, owned like the git directory. We are root
    and a sandbox of another session on the same workspace may be swapping names right now: the
    git directory is reached from ``top`` one component at a time without following symlinks."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(top, flags)
    except OSError:
        return
    try:
        for part in os.path.relpath(gitdir, top).split("/"):
            nxt = os.open(part, flags, dir_fd=fd)
            os.close(fd)
            fd = nxt
        owner = os.fstat(fd)
        for name in GIT_DIR_CREATE_EMPTY:
            try:
                os.mkdir(name, 0o755, dir_fd=fd)
            except OSError:
                continue                             # there already, or a read-only or full filesystem
            made = os.open(name, flags, dir_fd=fd)
            try:
                os.fchown(made, owner.st_uid, owner.st_gid)
            finally:
                os.close(made)
    except OSError:
        pass                                         # swapped or gone: the git guard still looks after calls
    finally:
        os.close(fd)


def _nested_git_dirs(path: str, depth: int) -> list[str]:
    """Git directories in modules/ or worktrees/: each holds a HEAD (submodule names may nest)."""
    kernel = syscalls.current
    found = []
    for entry in kernel.scandir(path):
        if not entry.is_dir(follow_symlinks=False):
            continue
        if kernel.lexists(f"{entry.path}/HEAD"):
            found.append(entry.path)
        elif depth < GIT_NESTED_MAX_DEPTH:
            found += _nested_git_dirs(entry.path, depth + 1)
    return found


def _pin_down_to(top: str, path: str, done: dict[str, bool]) -> None:
    """Pin every directory from below ``top`` down to ``path``, parents first."""
    rel = os.path.relpath(path, top)
    current = top
    for part in rel.split("/"):
        current = f"{current}/{part}"
        _pin(current, done)


def _pin(path: str, done: dict[str, bool]) -> None:
    kernel = syscalls.current
    if path not in done:
        kernel.bind(path, path, recursive=True, step="protect subpath")
        done[path] = False


def _protect(root: str, sub: str, done: dict[str, bool] | None = None) -> None:
    """Keep ``root/sub`` read-only, and pin each of its ancestors under ``root``.

    Pinning (binding a directory onto itself) matters: Linux lets a process
    rename a directory that merely *contains* a mount point, so without it a
    command could move ``.git`` aside and build a new one with writable hooks.
    A mount point itself cannot be renamed or removed (EBUSY).
    """
    kernel = syscalls.current
    done = {} if done is None else done
    parts = sub.split("/")
    current = NEW_ROOT + root
    for index, part in enumerate(parts):
        current = f"{current}/{part}"
        if not kernel.lexists(current):
            return
        if kernel.islink(current):
            raise SetupError("protect subpath", errno.ELOOP, f"{root}/{'/'.join(parts[:index + 1])}",
                             hint="a protected path is a symlink, which could point anywhere: replace it by "
                                  "a real file or directory, or remove it from protected_subpaths")
        last = index == len(parts) - 1
        if current not in done:
            kernel.bind(current, current, recursive=True, step="protect subpath")
            done[current] = False
        if last and not done[current]:
            kernel.set_attrs_recursive(current, READONLY_ATTRS, step="protect subpath")
            done[current] = True
