"""Which home directories a sandbox may cover (launcher.rootfs step 7b: LaunchSpec.hidden_homes).

Two callers hide homes: `sandboxd run` (cli.run_env: its command user's and its caller's) and the
daemon, for a session whose policy says ``hide_home`` (service.sessions.lifecycle: its owner's).
Both ask here, so the same directories are never covered: a home is covered only when it is a real
directory owned by its user and not a system tree (daemon users have homes such as /usr/sbin or
/var/www, which every program reads).
"""

from __future__ import annotations

import os
import stat

# A "home" in these trees, or equal to one of these directories, is a system directory: never covered.
_SYSTEM_TREES = ("/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/libx32", "/proc", "/run", "/sbin",
                 "/sys", "/usr")
_SYSTEM_DIRS = ("/", "/home", "/media", "/mnt", "/nix", "/opt", "/snap", "/srv", "/tmp", "/var",
                "/var/lib", "/var/tmp")


def home_of(uid: int) -> str | None:
    """The home of ``uid`` in the user database (None: no such user, or no home)."""
    import pwd
    try:
        return pwd.getpwuid(uid).pw_dir or None
    except KeyError:
        return None


def coverable_home(path: str | None, owners: tuple[int, ...]) -> str | None:
    """``path`` as a real path when it is a home to cover: a directory owned by one of ``owners``,
    not a system directory; else None."""
    if not path or not path.startswith("/"):
        return None
    real = os.path.realpath(path)
    if real in _SYSTEM_DIRS or any(real == tree or real.startswith(tree + "/") for tree in _SYSTEM_TREES):
        return None
    try:
        st = os.stat(real)
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid not in owners:
        return None
    return real


def owner_home(uid: int) -> tuple[str, ...]:
    """The home of ``uid`` to cover, as a tuple of at most one real path (LaunchSpec.hidden_homes)."""
    home = coverable_home(home_of(uid), (uid,))
    return (home,) if home else ()
