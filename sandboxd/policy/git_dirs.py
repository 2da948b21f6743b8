"""FoundGitDirs: what the git guard's baseline walk found under one writable root, handed to the
sandbox's build so that it protects those git directories without walking the root again.

Built by sandboxd.gitguard.guard (GitGuard.found_git_dirs), read by
sandboxd.launcher.rootfs (_protect_root). One walk then serves both: the guard's baseline (what
was there is the user's) and the build's read-only mounts over every existing git directory's
control files (issue 10). A root the walk could not cover completely has no FoundGitDirs: the
build walks it itself, as it always did.
"""

from __future__ import annotations

from sandboxd._record import Record


class FoundGitDirs(Record):
    # The ``.git`` directories under the root (not symlinks, not inside another git directory),
    # relative to it, parents first: what the build's own walk (rootfs._find_git_dirs) finds.
    git_dirs: tuple[str, ...] = ()
    # Directories under the root on another filesystem: the guard does not enter them, the build
    # walks each itself (the roots are attached with their submounts).
    other_filesystems: tuple[str, ...] = ()
