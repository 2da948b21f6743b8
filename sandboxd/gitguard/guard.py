"""The git guard: after a sandboxed call, neutralise git configuration it planted.

The mounts of sandboxd/launcher/rootfs.py keep the control files of every git
directory that exists when a sandbox is built read-only. What they cannot
cover is what appears later: a repository made in the sandbox (`git init sub`,
then a gitlink in the outer index makes host `git status` recurse into it), a
`commondir` or `config.worktree` dropped into an existing git directory, a
`.git` file or symlink pointing somewhere else. A host user's next `git status`
would run the hooks and the core.fsmonitor of those. So after every call this
guard (run by the daemon as root, or by `sandboxd run`) looks at what changed
under the writable roots and removes what would run code:

* hooks: any entry of hooks/ not ending in ``.sample`` that was not there before;
* config: keys outside sandboxd.policy.git_config.SAFE_KEYS that were not there before;
* ``commondir`` and ``config.worktree`` that appeared (a linked worktree's own
  ``commondir`` of "../.." is kept);
* ``.git`` symlinks that appeared, and ``.git`` files that appeared or changed unless
  they name, read by git's own rules (policy.git_config.gitfile_target: up to 1 MiB,
  only trailing LF/CR stripped, symlinks and ".." resolved as git resolves them),
  a directory inside a writable root that the guard inspects as a git directory;
* sequencer state (rebase-merge, rebase-apply, sequencer: `exec` lines, merge
  strategies) that appeared or changed: a stopped rebase left by a sandboxed
  command is exactly what a host `git rebase --continue` would run.

Every directory under a writable root that git could take for a git directory
(HEAD with objects, refs, commondir or config) is one the guard inspects, wherever
it is: inside another repository's .git, its objects/ and refs/ included.

What was there when the guard took its baseline (the sandbox's build) is the
user's own and is left alone.

Cheap: the guard remembers each directory's (inode, ctime) and lists only the
directories whose ctime moved (ctime, unlike mtime, cannot be set back by the
sandbox); a call that changed nothing costs one lstat per directory and a few
per git directory. Safe against a hostile sandbox running concurrently: every
directory is opened from the root's descriptor one component at a time with
O_NOFOLLOW|O_DIRECTORY, never across another mount (st_dev), files are read
with O_NOFOLLOW|O_NONBLOCK and only if regular, and a config is never written
in place: a new file is made with O_CREAT|O_EXCL, given the old owner and mode,
and renamed over the old name.
"""

from __future__ import annotations

import errno
import os
import stat
import _thread  # the C module: threading imports functools and collections, too much for `sandboxd run`

from sandboxd._record import Record
from sandboxd.kernel.inotify import Inotify
from sandboxd.policy.git_dirs import FoundGitDirs
from sandboxd.policy.git_config import (GIT_DIR_NESTED, GIT_DIR_REDIRECTS, GIT_SEQUENCER_DIRS, GITFILE_MAX_BYTES,
                                        ConfigSyntaxError, filter_config, gitfile_target, parse)

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Iterable, Iterator

    from sandboxd.gitguard.watch import InotifyHub, Subscription



def _log_error(message: str, *args: object) -> None:
    import logging                      # only on this rare path: `sandboxd run` does not import logging
    logging.getLogger("sandboxd").error(message, *args)

# The walk holds a directory open while its subdirectories wait (opened from it): at most this many
# levels at once; deeper ones are opened from the root, component by component, as before.
MAX_OPEN_DEPTH = 64
MAX_DIRS = 200_000            # directories tracked per root; beyond, new ones are not watched (logged once)
MAX_CONFIG_BYTES = 1 << 20    # a bigger config a sandbox wrote is replaced by an empty one
MAX_NESTED_DEPTH = 6          # modules/a/b/c: submodule names may hold slashes
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
MAX_SEQUENCER_ENTRIES = 10_000  # a sequencer directory bigger than this is removed without a closer look
# The names that make a directory one git may take for a git directory (with HEAD): a superset of
# setup.c's is_git_directory (HEAD, objects/ and refs/, or a commondir).
GIT_DIR_MARKS = frozenset({"objects", "refs", "commondir", "config"})


class Neutralization(Record):
    """One thing the guard removed: ``what`` is hook, config-key, config, commondir, config.worktree,
    gitfile, symlink or sequencer; ``key`` the hook name, the config key, the file name, a gitfile's
    target or the sequencer directory's name."""

    repo: str
    what: str
    key: str

    def describe(self) -> str:
        return f"git guard: removed {self.what} {self.key!r} in {self.repo}"


Key = tuple[int, int, int, int]  # (st_ino, st_ctime_ns, st_size, st_mode) of an lstat


def _key(st: os.stat_result) -> Key:
    return st.st_ino, st.st_ctime_ns, st.st_size, st.st_mode


class _Dir:
    __slots__ = ("key", "subdirs", "git_key")

    def __init__(self, key: Key, subdirs: tuple[str, ...], git_key: Key | None) -> None:
        self.key, self.subdirs, self.git_key = key, subdirs, git_key


Fingerprint = tuple[tuple[str, Key], ...]  # a sequencer directory: every entry's path and key


class _Git:
    __slots__ = ("keys", "names", "config_trusted", "hooks_trusted", "nested", "redirects", "sequencer")

    def __init__(self) -> None:
        self.keys: dict[str, Key | None] = {}                 # "", config, hooks, modules, worktrees, hooks/X
        self.names: frozenset[str] = frozenset()              # entries of the git dir at the last look
        self.config_trusted: frozenset[tuple[str, str | None]] = frozenset()
        self.hooks_trusted: dict[str, Key] = {}
        self.nested: tuple[str, ...] = ()
        self.redirects: dict[str, Key | None] = {}            # commondir, config.worktree kept, as seen
        self.sequencer: dict[str, Fingerprint] = {}          # rebase-merge, ... as last seen


class _Root:
    def __init__(self, path: str, dev: int) -> None:
        self.path, self.dev = path, dev
        self.dirs: dict[str, _Dir] = {}
        self.gits: dict[str, _Git] = {}
        self.full = False
        self.wds: dict[int, str] = {}        # inotify watch -> the directory it watches
        # Directories holding a .git *file*: it can be rewritten in place (no event on its
        # directory, no ctime change there), a symlink on the way to its target can be replaced,
        # and the target can appear where the walk does not go (another filesystem mounted in the
        # root), so each is looked at every time: (its key, the path it names, where that led,
        # whether a directory was there).
        self.gitfiles: dict[str, tuple[Key, str, str, bool]] = {}
        self.watching = True                 # False: a watch could not be added; every look walks it all
        # Directories on another filesystem the baseline did not enter (FoundGitDirs.other_filesystems).
        self.other_filesystems: set[str] = set()


class GitGuard:
    """The guard of one session's (or one `sandboxd run`'s) writable roots. Thread-safe: concurrent
    calls' inspections run one at a time."""

    def __init__(self, roots: Iterable[str] = (), *, watch: bool = True, hub: "InotifyHub | None" = None,
                 owner: str = "") -> None:
        """``hub``: a daemon's one inotify instance, shared by its sessions' guards (gitguard/watch.py),
        whose watches count against ``owner``'s budget there (past it a root is walked instead);
        without, the guard makes an instance of its own (`sandboxd run`)."""
        self._lock = _thread.allocate_lock()
        self._roots: dict[str, _Root] = {}
        self.inotify: Inotify | Subscription | None = None
        self.overflows = 0           # inspections that found events lost and so looked at every directory
        if watch:
            try:
                self.inotify = hub.subscribe(owner) if hub is not None else Inotify()
            except OSError as exc:       # out of instances (fs.inotify.max_user_instances): walk instead
                _log_error("git guard: no inotify (%s): every inspection walks the whole tree", exc)
        self.set_roots(roots)

    def close(self) -> None:
        with self._lock:
            if self.inotify is not None:
                self.inotify.close()
                self.inotify = None

    def set_roots(self, roots: Iterable[str]) -> None:
        """Watch these roots from now on; a root new to the guard gets its baseline now."""
        with self._lock:
            wanted = list(dict.fromkeys(roots))
            self._roots = {path: self._roots[path] for path in wanted if path in self._roots} | {
                path: root for path in wanted if path not in self._roots
                for root in [self._baseline(path)] if root is not None}

    @property
    def roots(self) -> tuple[str, ...]:
        return tuple(self._roots)

    def found_git_dirs(self) -> dict[str, FoundGitDirs]:
        """What the baseline walk found, for the build of the sandbox launched next
        (LaunchSpec.git_dirs): each root's ``.git`` directories not inside another one, as the
        build's own walk finds them, and where the walk did not go (another filesystem). Only
        right after the baseline: the build must protect what the guard took as the user's. A
        root the walk did not finish (MAX_DIRS) is left out: the build walks it itself."""
        with self._lock:
            return {path: FoundGitDirs(git_dirs=tuple(sorted(rel for rel in root.gits if _is_dot_git(rel))),
                                       other_filesystems=tuple(sorted(root.other_filesystems)))
                    for path, root in self._roots.items() if not root.full}

    def inspect(self) -> list[Neutralization]:
        """Neutralise what changed since the last inspection; what was removed, in order."""
        with self._lock:
            found: list[Neutralization] = []
            fired: set[int] | None = None              # None: look at every directory
            if self.inotify is not None:
                fired, overflow = self.inotify.drain()
                if overflow:
                    fired = None
                    self.overflows += 1
            for root in self._roots.values():
                seeds = None if fired is None or not root.watching else {
                    root.wds[wd] for wd in fired if wd in root.wds}
                _Pass(self, root, found, baseline=False).run(seeds)
            return found

    def _baseline(self, path: str) -> _Root | None:
        try:
            st = os.stat(path)
        except OSError:
            return None
        if not stat.S_ISDIR(st.st_mode):
            return None
        root = _Root(path, st.st_dev)
        _Pass(self, root, [], baseline=True).run()
        return root

    def _resolve(self, path: str, first: _Root | None = None) -> str | None:
        """``path`` (absolute) with its symlinks and ".." resolved as the kernel and git resolve them
        (what is missing is kept as written, as realpath(3) without strictness), or None where the
        resolution leaves the roots: nothing outside them is looked at (a hung mount there must not
        hang the guard), and a git directory outside them is never one a planted .git file may name."""
        roots = ([first.path] if first is not None else []) + list(self._roots)
        parts = path.split("/")[::-1]
        done, links = "", 0
        while parts:
            part = parts.pop()
            if part in ("", "."):
                continue
            if part == "..":
                done = done.rsplit("/", 1)[0]
                continue
            step = f"{done}/{part}"
            if any(r == step or r.startswith(step + "/") for r in roots):
                done = step                       # a root or above one: real directories (roots are real paths)
                continue
            if self._inside(step, first) is None:
                return None
            try:
                st = os.lstat(step)
            except OSError:
                done = step
                continue
            if not stat.S_ISLNK(st.st_mode):
                done = step
                continue
            links += 1
            if links > 40:                        # ELOOP for git too
                return None
            try:
                link = os.readlink(step)
            except OSError:
                return None
            if link.startswith("/"):
                done = ""
            parts.extend(link.split("/")[::-1])
        return done or "/"

    def _inside(self, path: str, first: _Root | None = None) -> tuple[_Root, str] | None:
        """The root holding ``path`` (a real path) and the path below it; ``first`` is looked at
        first (a root taking its baseline is not among the guard's roots yet)."""
        for root in ([first] if first is not None else []) + list(self._roots.values()):
            if path == root.path:
                return root, ""
            if path.startswith(root.path.rstrip("/") + "/"):
                return root, path[len(root.path.rstrip("/")) + 1:]
        return None


class _Pass:
    """One walk over one root: in baseline mode it records, otherwise it also neutralises."""

    def __init__(self, guard: GitGuard, root: _Root, found: list[Neutralization], *, baseline: bool) -> None:
        self.guard, self.root, self.found, self.baseline = guard, root, found, baseline
        self.root_fd = -1

    def run(self, seeds: set[str] | None = None) -> None:
        """Look at the ``seeds`` directories (those inotify saw change) and what is new under them;
        None: at every directory (the first look, or when inotify lost events or is unavailable)."""
        try:
            self._walk_dirs(seeds)
            self._check_gitfiles()
            self.check_gits()
        finally:
            if self.root_fd >= 0:
                os.close(self.root_fd)
                self.root_fd = -1

    def check_gits(self) -> None:
        """Every known git directory: a few lstats each, a closer look at those that changed."""
        try:
            for rel in list(self.root.gits):
                self._check_git(rel)
        finally:
            if self.root_fd >= 0:
                os.close(self.root_fd)
                self.root_fd = -1

    # -- paths -------------------------------------------------------------------------------------

    def _full(self, rel: str) -> str:
        return f"{self.root.path}/{rel}" if rel else self.root.path

    def _lstat(self, rel: str) -> os.stat_result | None:
        try:
            st = os.lstat(self._full(rel))
        except OSError:
            return None
        return st if st.st_dev == self.root.dev else None

    def _open_dir(self, rel: str) -> int:
        """A descriptor of ``rel`` reached from the root without following any symlink or leaving
        the root's filesystem; OSError otherwise."""
        if self.root_fd < 0:
            self.root_fd = os.open(self.root.path, DIR_FLAGS)
        fd = os.dup(self.root_fd)
        try:
            for part in rel.split("/") if rel else ():
                nxt = os.open(part, DIR_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = nxt
                if os.fstat(fd).st_dev != self.root.dev:
                    raise OSError(errno.EXDEV, "another filesystem", rel)
            return fd
        except BaseException:
            os.close(fd)
            raise

    def _record(self, rel: str, what: str, key: str) -> None:
        item = Neutralization(repo=self._full(rel), what=what, key=key)
        self.found.append(item)           # the caller records, logs or prints it

    # -- ordinary directories ----------------------------------------------------------------------

    def _walk_dirs(self, seeds: set[str] | None) -> None:
        """Visit ``seeds`` (None: the root) and, below each, what is new (with inotify) or
        everything (without). A subdirectory is reached from its parent's descriptor, held open
        while its subdirectories wait on the stack (``_Parent``): one openat per directory, never
        a symlink followed (O_NOFOLLOW), never another filesystem (st_dev), instead of one open
        per path component from the root."""
        dirs = self.root.dirs
        everything = seeds is None
        stack: list[tuple[str, _Parent | None]] = [(rel, None) for rel in ([""] if seeds is None else sorted(seeds))]
        try:
            while stack:
                rel, parent = stack.pop()
                try:
                    subs, handle = self._visit(rel, parent, dirs.get(rel), everything)
                finally:
                    if parent is not None:
                        parent.release()
                if subs:
                    stack.extend((_join(rel, sub), handle) for sub in subs)
        finally:
            for _rel, parent in stack:            # only after an error: what was not visited
                if parent is not None:
                    parent.release()

    def _visit(self, rel: str, parent: "_Parent | None", old: "_Dir | None",
               everything: bool) -> "tuple[Iterable[str], _Parent | None]":
        """One directory of the walk: (the subdirectories to visit next, the descriptor to open
        them from, holding one reference per subdirectory; None: open them from the root)."""
        name = rel.rsplit("/", 1)[-1]
        st = _lstat_at(None, self._full(rel)) if parent is None else _lstat_at(parent.fd, name)
        if st is None or not stat.S_ISDIR(st.st_mode) or st.st_dev != self.root.dev:
            if st is not None and stat.S_ISDIR(st.st_mode) and self.baseline:
                self.root.other_filesystems.add(rel)      # the build walks it (FoundGitDirs)
            self._forget(rel)
            return (), None
        if old is not None and old.key == _key(st) and not (everything and old.subdirs):
            return (), None                       # unchanged, and nothing below to visit: no open
        if old is None and len(self.root.dirs) >= MAX_DIRS:
            if not self.root.full:
                self.root.full = True
                _log_error("git guard: more than %d directories under %s: deeper new ones are not "
                           "inspected", MAX_DIRS, self.root.path)
            return (), None
        try:
            fd = self._open_dir(rel) if parent is None else os.open(name, DIR_FLAGS, dir_fd=parent.fd)
        except OSError:
            self._forget(rel)
            return (), None
        depth = 0 if parent is None else parent.depth + 1
        try:
            st = os.fstat(fd)                     # what was opened (the name may have changed since)
            if st.st_dev != self.root.dev:
                if self.baseline:
                    self.root.other_filesystems.add(rel)
                self._forget(rel)
                return (), None
            subs: "Iterable[str]"
            if old is not None and old.key == _key(st):
                subs = old.subdirs if everything else ()
            else:
                subdirs, changed = self._scan(rel, old, fd)
                # With inotify, a known subdirectory has its own watch: only new or replaced ones are visited.
                subs = subdirs if everything else changed
            subs = tuple(subs)
            if not subs or depth >= MAX_OPEN_DEPTH:
                return subs, None                 # deeper: opened from the root (bounded descriptors)
            handle = _Parent(fd, len(subs), depth)
            fd = -1                               # the handle owns it now
            return subs, handle
        finally:
            if fd >= 0:
                os.close(fd)

    def _forget(self, rel: str) -> None:
        old = self.root.dirs.pop(rel, None)
        if old is None:
            return
        for sub in old.subdirs:
            self._forget(f"{rel}/{sub}" if rel else sub)

    def _scan(self, rel: str, old: _Dir | None, fd: int) -> tuple[tuple[str, ...], list[str]]:
        """List one directory, open as ``fd`` (the caller closes it): (its subdirectories, those
        new or replaced since the last look)."""
        self._watch(rel, fd)          # first: a change from now on is an event, seen next time
        key = _key(os.fstat(fd))      # before listing: a later change moves ctime, seen next time
        subdirs: list[str] = []
        changed: list[str] = []
        names: set[str] = set()
        git_key: Key | None = None
        with os.scandir(fd) as entries:
            for entry in _entries(entries):
                names.add(entry.name)
                if entry.name == ".git":
                    try:
                        est = entry.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    git_key = _key(est)
                    if old is None or old.git_key != git_key:
                        self._git_entry(rel, fd, est)
                    elif stat.S_ISDIR(est.st_mode):
                        self._track_git(_join(rel, ".git"))
                if entry.is_dir(follow_symlinks=False):     # d_type: no stat per entry
                    # .git directories and their objects/, refs/, ... are walked too: a git
                    # directory hidden in there is one a planted .git file could name.
                    # (another filesystem mounted there is refused when it is opened: _open_dir)
                    subdirs.append(entry.name)
                    known = self.root.dirs.get(_join(rel, entry.name))
                    if known is None or known.key[0] != entry.inode():
                        changed.append(entry.name)
        if "HEAD" in names and not GIT_DIR_MARKS.isdisjoint(names):
            # a git directory under another name (a bare repository, the target of a .git file,
            # or one hidden anywhere, .git/objects/xx/ included)
            self._track_git(rel)
        if old is not None:
            for gone in set(old.subdirs) - set(subdirs):
                self._forget(_join(rel, gone))
        self.root.dirs[rel] = _Dir(key, tuple(subdirs), git_key)
        return tuple(subdirs), changed

    def _watch(self, rel: str, fd: int) -> None:
        inotify = self.guard.inotify
        if inotify is None or not self.root.watching:
            return
        try:
            self.root.wds[inotify.watch_fd(fd)] = rel
        except OSError as exc:            # out of watches (the owner's budget, fs.inotify.max_user_watches): walk instead
            self.root.watching = False
            _log_error("git guard: cannot watch %s (%s): every inspection walks the whole tree",
                       self._full(rel), exc)

    def _git_entry(self, rel: str, dir_fd: int, est: os.stat_result) -> None:
        """A ``.git`` that is new or was replaced (or, for a file, rewritten) since the last look."""
        where = _join(rel, ".git")
        self.root.gitfiles.pop(rel, None)
        if stat.S_ISDIR(est.st_mode):
            self._track_git(where)
            return
        if stat.S_ISLNK(est.st_mode):
            if not self.baseline:
                self._unlink(dir_fd, ".git", rel, "symlink", ".git")
            return
        if not stat.S_ISREG(est.st_mode):
            return                                           # git reads only a regular file (it stats)
        data = _read_bytes(dir_fd, ".git", GITFILE_MAX_BYTES)
        named = None if data is None else gitfile_target(data, os.fsencode(self._full(where)))
        if named is None:
            # Git refuses it (no "gitdir: ", empty, over 1 MiB): useless to git, and whatever our
            # reading missed must not stay.
            if not self.baseline:
                self._unlink(dir_fd, ".git", rel, "gitfile", "<not a gitfile git reads>")
            return
        target = os.fsdecode(named)
        real = self.guard._resolve(target, self.root)          # noqa: SLF001 - the guard's own helper
        self.root.gitfiles[rel] = (_key(est), target, real or "", self._is_dir(real))
        if (real is None or not self._judge_gitfile_target(real)) and not self.baseline:
            self.root.gitfiles.pop(rel, None)
            self._unlink(dir_fd, ".git", rel, "gitfile", real or target)

    def _judge_gitfile_target(self, real: str) -> bool:
        """Whether a .git file naming ``real`` may stay: it must be a directory inside a writable
        root, reached without leaving that root's filesystem, that the guard inspects as a git
        directory (now, and after every call)."""
        inside = self.guard._inside(real, self.root)          # noqa: SLF001 - the guard's own helper
        if inside is None:
            return False
        root, target_rel = inside
        there = self if root is self.root else _Pass(self.guard, root, self.found, baseline=self.baseline)
        try:
            there._track_git(target_rel)                      # noqa: SLF001 - a pass of the same class
            if self.baseline:
                return True
            st = there._lstat(target_rel)                     # noqa: SLF001
            return target_rel in root.gits and st is not None and stat.S_ISDIR(st.st_mode)
        finally:
            if there is not self and there.root_fd >= 0:
                os.close(there.root_fd)

    @staticmethod
    def _is_dir(real: str | None) -> bool:
        """Whether a directory is at ``real`` (resolved already: inside the roots, or None)."""
        try:
            return real is not None and stat.S_ISDIR(os.lstat(real).st_mode)
        except OSError:
            return False

    def _check_gitfiles(self) -> None:
        for rel, (key, target, real, was_dir) in list(self.root.gitfiles.items()):
            st = self._lstat(_join(rel, ".git"))
            if st is None or not stat.S_ISREG(st.st_mode):
                self.root.gitfiles.pop(rel, None)            # replaced: its directory's event covers it
                continue
            now = self.guard._resolve(target, self.root)     # noqa: SLF001 - the guard's own helper
            if _key(st) == key and (now or "") == real and self._is_dir(now) == was_dir:
                continue
            try:
                fd = self._open_dir(rel)
            except OSError:
                self.root.gitfiles.pop(rel, None)
                continue
            try:
                self._git_entry(rel, fd, st)
            finally:
                os.close(fd)

    def _track_git(self, rel: str) -> None:
        if rel not in self.root.gits:
            self.root.gits[rel] = _Git()
            if not self.baseline:
                self._check_git(rel)

    # -- git directories ---------------------------------------------------------------------------

    def _git_keys(self, rel: str, git: _Git) -> dict[str, Key | None]:
        keys: dict[str, Key | None] = {}
        for name in ("", "config", "hooks", *GIT_DIR_NESTED, *GIT_DIR_REDIRECTS):
            st = self._lstat(_join(rel, name) if name else rel)
            keys[name] = None if st is None else _key(st)
        for hook in git.hooks_trusted:
            st = self._lstat(f"{rel}/hooks/{hook}")
            keys["hooks/" + hook] = None if st is None else _key(st)
        return keys

    def _check_git(self, rel: str, depth: int = 0) -> None:
        git = self.root.gits.get(rel)
        if git is None:
            return
        self._check_sequencer(rel, git)
        keys = self._git_keys(rel, git)
        if keys[""] is None or not stat.S_ISDIR(keys[""][3]):
            del self.root.gits[rel]
            return
        if keys != git.keys:
            try:
                fd = self._open_dir(rel)
            except OSError:
                del self.root.gits[rel]
                return
            before = len(self.found)
            try:
                self._inspect_git(rel, fd, git, keys)
            finally:
                os.close(fd)
            # What was seen before looking: a change made while we looked shows as a difference next
            # time. After a change of our own, look again next time (and find it clean).
            git.keys = keys if len(self.found) == before else {}
        for nested in git.nested:
            if nested not in self.root.gits:
                self.root.gits[nested] = _Git()
            if depth < MAX_NESTED_DEPTH:
                self._check_git(nested, depth + 1)

    def _inspect_git(self, rel: str, fd: int, git: _Git, keys: dict[str, Key | None]) -> None:
        names = set(os.listdir(fd))
        for name in GIT_DIR_REDIRECTS:
            changed = name not in git.names or git.redirects.get(name) != keys.get(name)
            if name in names and not self.baseline and changed:
                if not (name == "commondir" and self._worktree_commondir(rel, fd)):
                    self._unlink(fd, name, rel, name, name)
                    names.discard(name)
        git.names = frozenset(names)
        git.redirects = {name: keys.get(name) for name in GIT_DIR_REDIRECTS if name in names}
        # A commit moves the git directory's ctime, not config's or hooks/': those are read again
        # only when they changed.
        if "config" in names and keys.get("config") != git.keys.get("config"):
            self._inspect_config(rel, fd, git)
        hook_keys = {k: v for k, v in keys.items() if k == "hooks" or k.startswith("hooks/")}
        if "hooks" in names and hook_keys != {k: v for k, v in git.keys.items() if k in hook_keys}:
            self._inspect_hooks(rel, fd, git)
        nested: list[str] = []
        for name in GIT_DIR_NESTED:
            if name in names:
                nested += self._nested_gits(rel, name)
        git.nested = tuple(nested)

    def _check_sequencer(self, rel: str, git: _Git) -> None:
        """Sequencer state that appeared or changed since the last look is removed whole: what a
        rebase (cherry-pick, revert, am) finished inside a call leaves is nothing, and one a
        sandboxed command left stopped is one whose `exec` lines the host would run."""
        state: dict[str, Fingerprint] = {}
        for name in GIT_SEQUENCER_DIRS:
            st = self._lstat(f"{rel}/{name}")
            if st is not None:
                state[name] = self._fingerprint(f"{rel}/{name}", st)
        if not self.baseline:
            for name, fingerprint in list(state.items()):
                if git.sequencer.get(name) != fingerprint and self._remove_sequencer(rel, name):
                    del state[name]
        git.sequencer = state

    def _fingerprint(self, rel: str, st: os.stat_result) -> Fingerprint:
        """The key of ``rel`` and of everything under it (a todo rewritten in place moves its own
        ctime only); one too big to list is never the same twice."""
        items: list[tuple[str, Key]] = [("", _key(st))]
        if not stat.S_ISDIR(st.st_mode):
            return tuple(items)
        stack = [""]
        while stack:
            sub = stack.pop()
            try:
                fd = self._open_dir(f"{rel}/{sub}" if sub else rel)
            except OSError:
                items.append((sub + "/<unreadable>", (0, 0, 0, 0)))
                continue
            try:
                with os.scandir(fd) as entries:
                    for entry in _entries(entries):
                        try:
                            key = _key(entry.stat(follow_symlinks=False))
                        except OSError:
                            continue
                        items.append((_join(sub, entry.name), key))
                        if stat.S_ISDIR(key[3]):
                            stack.append(_join(sub, entry.name))
                        if len(items) > MAX_SEQUENCER_ENTRIES:
                            return (*items, ("<too many entries>", (int.from_bytes(os.urandom(6), "big"), 0, 0, 0)))
            finally:
                os.close(fd)
        return tuple(sorted(items))

    def _remove_sequencer(self, rel: str, name: str) -> bool:
        """Renamed out of git's sight first (atomic, whatever the sandbox does meanwhile), then
        removed as far as it goes."""
        try:
            fd = self._open_dir(rel)
        except OSError:
            return False
        try:
            dead = f".{name}.sandboxd-removed-{os.urandom(6).hex()}"
            try:
                os.rename(name, dead, src_dir_fd=fd, dst_dir_fd=fd)
            except OSError as exc:
                _log_error("git guard: could not remove %s/%s: %s", self._full(rel), name, exc)
                return False
            self._record(rel, "sequencer", name)
            self._remove_tree(fd, dead, 0)
            return True
        finally:
            os.close(fd)

    def _remove_tree(self, dir_fd: int, name: str, depth: int) -> None:
        """``name`` and what is under it, never following a symlink nor leaving the root's
        filesystem; what cannot be removed stays (under a name git does not read)."""
        try:
            os.unlink(name, dir_fd=dir_fd)
            return
        except IsADirectoryError:
            pass
        except OSError:
            return
        if depth > MAX_NESTED_DEPTH * 8:
            return
        try:
            fd = os.open(name, DIR_FLAGS, dir_fd=dir_fd)
        except OSError:
            return
        try:
            if os.fstat(fd).st_dev != self.root.dev:
                return
            with os.scandir(fd) as entries:
                names = [entry.name for entry in _entries(entries)]
            for sub in names:
                self._remove_tree(fd, sub, depth + 1)
        finally:
            os.close(fd)
        try:
            os.rmdir(name, dir_fd=dir_fd)
        except OSError:
            pass

    def _worktree_commondir(self, rel: str, fd: int) -> bool:
        """A linked worktree's git dir (<gitdir>/worktrees/NAME) names its main one as "../..": that
        one is git's own and points at a directory the guard watches anyway."""
        parent = rel.rsplit("/", 2)
        text = _read_small(fd, "commondir", 256)
        return len(parent) >= 2 and parent[-2] == "worktrees" and text is not None and \
            text.strip() in ("../..", "../../")

    def _inspect_config(self, rel: str, fd: int, git: _Git) -> None:
        try:
            st = os.stat("config", dir_fd=fd, follow_symlinks=False)
        except OSError:
            return
        if stat.S_ISLNK(st.st_mode):
            if not self.baseline:
                self._unlink(fd, "config", rel, "config", "symlink")
            return
        if not stat.S_ISREG(st.st_mode):
            return
        text = _read_small(fd, "config", MAX_CONFIG_BYTES)
        if self.baseline:
            try:
                git.config_trusted = frozenset(e.ident() for e in parse(text or ""))
            except ConfigSyntaxError:
                git.config_trusted = frozenset()
            return
        new: str | None
        if text is None:
            new, dropped = "", ["<oversized config>"]
        else:
            new, dropped = filter_config(text, git.config_trusted)
        if new is None:
            return
        if self._replace(fd, "config", new.encode(), st):
            for key in dropped:
                self._record(rel, "config-key", key)

    def _inspect_hooks(self, rel: str, fd: int, git: _Git) -> None:
        try:
            st = os.stat("hooks", dir_fd=fd, follow_symlinks=False)
        except OSError:
            return
        if stat.S_ISLNK(st.st_mode):
            if not self.baseline:
                self._unlink(fd, "hooks", rel, "hook", "hooks (a symlink)")
            return
        if not stat.S_ISDIR(st.st_mode) or st.st_dev != self.root.dev:
            return
        try:
            hooks_fd = os.open("hooks", DIR_FLAGS, dir_fd=fd)
        except OSError:
            return
        try:
            trusted: dict[str, Key] = {}
            with os.scandir(hooks_fd) as entries:
                for entry in entries:
                    if entry.name.endswith(".sample"):
                        continue
                    try:
                        key = _key(entry.stat(follow_symlinks=False))
                    except OSError:
                        continue
                    if self.baseline or git.hooks_trusted.get(entry.name) == key:
                        trusted[entry.name] = key
                    elif stat.S_ISDIR(key[3]):
                        continue                      # git cannot run a directory
                    else:
                        self._unlink(hooks_fd, entry.name, rel, "hook", entry.name)
            git.hooks_trusted = trusted
        finally:
            os.close(hooks_fd)

    def _nested_gits(self, rel: str, name: str) -> list[str]:
        """Git directories under <gitdir>/modules or <gitdir>/worktrees (submodule names may nest)."""
        found: list[str] = []
        stack = [(_join(rel, name), 0)]
        while stack:
            here, level = stack.pop()
            try:
                fd = self._open_dir(here)
            except OSError:
                continue
            try:
                with os.scandir(fd) as entries:
                    for entry in entries:
                        if not entry.is_dir(follow_symlinks=False):
                            continue
                        child = f"{here}/{entry.name}"
                        try:
                            os.stat(f"{entry.name}/HEAD", dir_fd=fd, follow_symlinks=False)
                            found.append(child)
                        except OSError:
                            if level < MAX_NESTED_DEPTH:
                                stack.append((child, level + 1))
            finally:
                os.close(fd)
        return found

    # -- changes -----------------------------------------------------------------------------------

    def _unlink(self, dir_fd: int, name: str, rel: str, what: str, key: str) -> None:
        try:
            os.unlink(name, dir_fd=dir_fd)
        except IsADirectoryError:
            return
        except OSError as exc:
            _log_error("git guard: could not remove %s/%s: %s", self._full(rel), name, exc)
            return
        self._record(rel, what, key)

    def _replace(self, dir_fd: int, name: str, data: bytes, old: os.stat_result) -> bool:
        """Put ``data`` under ``name`` as a new file with the old one's owner and mode (never written
        in place: the old inode may be hard-linked anywhere)."""
        tmp = f".{name}.sandboxd-{os.urandom(6).hex()}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                         dir_fd=dir_fd)
        except OSError as exc:
            _log_error("git guard: could not rewrite %s: %s", name, exc)
            return False
        try:
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                if os.geteuid() == 0:
                    os.fchown(fd, old.st_uid, old.st_gid)
                os.fchmod(fd, old.st_mode & 0o666)
            finally:
                os.close(fd)
            os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            return True
        except OSError as exc:
            _log_error("git guard: could not rewrite %s: %s", name, exc)
            try:
                os.unlink(tmp, dir_fd=dir_fd)
            except OSError:
                pass
            return False


class _Parent:
    """A directory the walk holds open for its subdirectories still on the stack: each releases
    one reference once visited; the last one closes it."""
    __slots__ = ("fd", "refs", "depth")

    def __init__(self, fd: int, refs: int, depth: int) -> None:
        self.fd, self.refs, self.depth = fd, refs, depth

    def release(self) -> None:
        self.refs -= 1
        if self.refs == 0:
            os.close(self.fd)
            self.fd = -1


def _is_dot_git(rel: str) -> bool:
    """A ``.git`` directory not inside another git directory's ``.git``."""
    parts = rel.split("/")
    return parts[-1] == ".git" and ".git" not in parts[:-1]


def _lstat_at(dir_fd: int | None, name: str) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return None


def _entries(entries: "Iterator[os.DirEntry[str]]") -> "Iterator[os.DirEntry[str]]":
    """A directory's entries, ending early (not failing) when it cannot be read further."""
    try:
        yield from entries
    except OSError:
        return


def _join(rel: str, name: str) -> str:
    return f"{rel}/{name}" if rel else name


def _read_small(dir_fd: int, name: str, limit: int) -> str | None:
    """A regular file's text (None: not a regular file, unreadable, or over ``limit`` bytes)."""
    data = _read_bytes(dir_fd, name, limit)
    return None if data is None else data.decode("utf-8", "surrogateescape")


def _read_bytes(dir_fd: int, name: str, limit: int) -> bytes | None:
    """A regular file's bytes (None: not a regular file, unreadable, or over ``limit`` bytes)."""
    try:
        fd = os.open(name, FILE_FLAGS, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        chunks, total = [], 0
        while True:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            total += len(chunk)
            if total > limit:
                return None
            chunks.append(chunk)
        return b"".join(chunks)
    except OSError:
        return None
    finally:
        os.close(fd)
