"""Which home directories a sandbox may cover (launcher.rootfs step 7b: LaunchSpec.hidden_homes).

Two callers hide homes: `sandboxd run` (cli.run_env: its command user's and its caller's, each
covered only when it is a real directory owned by its user and not a system tree: daemon users have
homes such as /usr/sbin or /var/www, which every program reads) and the daemon, for a session whose
policy says ``hide_home`` (service.sessions.lifecycle: its owner's). The daemon's rule is stricter
in what it promises: the owner's home is covered whoever owns the directory (an admin-made or
sftp-chroot home is root's), and where it cannot be (no home, "/", a system directory, one holding
sandboxd's own places) hide_home is refused, never reported true while nothing is hidden.
"""

from __future__ import annotations

import os
import stat

from sandboxd.policy.sandbox import is_within

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
    return home_verdict(path, owners)[0]


def home_verdict(path: str | None, owners: tuple[int, ...]) -> tuple[str | None, str]:
    """(the real path to cover, "") for a home to cover (as coverable_home); else (None, why not),
    the reason "" when there is nothing there a command could see (no path, a relative one, nothing
    at it or nothing the caller can reach)."""
    if not path or not path.startswith("/"):
        return None, ""
    real = os.path.realpath(path)
    if real in _SYSTEM_DIRS or any(real == tree or real.startswith(tree + "/") for tree in _SYSTEM_TREES):
        return None, f"{real} is a system directory, which every program reads"
    try:
        st = os.stat(real)
    except OSError:
        return None, ""
    if not stat.S_ISDIR(st.st_mode):
        return None, "it is not a directory"
    if st.st_uid not in owners:
        return None, f"it is owned by uid {st.st_uid}, neither the command's user nor you"
    return real, ""


def owner_home(uid: int) -> tuple[str, ...]:
    """The home of ``uid`` to cover, as a tuple of at most one real path (LaunchSpec.hidden_homes)."""
    home = coverable_home(home_of(uid), (uid,))
    return (home,) if home else ()


class Uncoverable(ValueError):
    """A session owner's home that hide_home cannot cover; the text says why and what to do."""


def session_home(uid: int, own_places: tuple[str, ...] = ()) -> str:
    """The daemon's hide_home: the real path of ``uid``'s home to cover, whoever owns the directory
    (the cover exists only in the sandbox's mount namespace). Raises Uncoverable when it cannot be
    covered: no home, not a directory, a system directory, or one holding ``own_places`` (the
    daemon's directories every sandbox hides: a cover over them would undo that)."""
    path = home_of(uid)
    if not path or not path.startswith("/"):
        raise Uncoverable(f"uid {uid} has no home directory in the user database")
    real = os.path.realpath(path)
    if real in _SYSTEM_DIRS or any(real == tree or real.startswith(tree + "/") for tree in _SYSTEM_TREES):
        raise Uncoverable(f"the home {path!r} is the system directory {real!r}, which every program reads")
    try:
        st = os.stat(real)
    except OSError as error:
        raise Uncoverable(f"the home {path!r} cannot be found ({error.strerror})") from None
    if not stat.S_ISDIR(st.st_mode):
        raise Uncoverable(f"the home {path!r} is not a directory")
    for place in own_places:
        if is_within(place, real):
            raise Uncoverable(f"the home {path!r} holds sandboxd's own directory {place!r}")
    return real


def runtime_dir(uid: int) -> tuple[str, ...]:
    """``uid``'s runtime directory (/run/user/UID: $XDG_RUNTIME_DIR, where podman keeps registry
    credentials and agents their sockets) when it is a real directory of theirs: (path,) or ()."""
    path = f"/run/user/{uid}"
    try:
        st = os.lstat(path)
    except OSError:
        return ()
    return (path,) if stat.S_ISDIR(st.st_mode) and st.st_uid == uid else ()


# The most other mounts of a home's directory covered (a mount table is the host's: an admin's binds).
MAX_ALIASES = 32


def other_mounts(home: str, mountinfo: str = "/proc/self/mountinfo") -> tuple[str, ...]:
    """The other paths at which the directory ``home`` (a real path) is mounted: a bind of /var/home
    at /home, one btrfs subvolume mounted twice. The sandbox's root shows every mount of the host's,
    so a home covered at one path only would still show at the others: these are covered too.
    Found by the mount table: the mount holding ``home`` gives its filesystem (major:minor) and its
    path in it; every other mount of that filesystem whose root holds that path shows it."""
    try:
        with open(mountinfo, encoding="utf-8", errors="surrogateescape") as table:
            lines = table.read().splitlines()
    except OSError:
        return ()
    mounts: list[tuple[str, str, str]] = []                  # (major:minor, root in its filesystem, mount point)
    for line in lines:
        fields = line.split()
        if len(fields) >= 5:
            mounts.append((fields[2], _unescape(fields[3]), _unescape(fields[4])))
    holding = [(len(point), index) for index, (_dev, _root, point) in enumerate(mounts) if is_within(home, point)]
    if not holding:
        return ()
    dev, root, point = mounts[max(holding)[1]]               # the deepest mount point; of those, the topmost
    inner = os.path.normpath(os.path.join(root, os.path.relpath(home, point)))
    found: list[str] = []
    for other_dev, other_root, other_point in mounts:
        if other_dev == dev and is_within(inner, other_root):
            alias = os.path.normpath(os.path.join(other_point, os.path.relpath(inner, other_root)))
            if alias != home and alias not in found and len(found) < MAX_ALIASES:
                found.append(alias)
    return tuple(found)


def _unescape(field: str) -> str:
    """A mountinfo path: the kernel writes space, tab, newline and backslash as \\ooo. By hand, not
    with `re`: `sandboxd run` imports this module, and `re` would load `collections` on its path
    (tests/test_oneshot_speed.py)."""
    parts = field.split("\\")
    out = [parts[0]]
    for part in parts[1:]:
        code = part[:3]
        if len(code) == 3 and all(digit in "01234567" for digit in code):
            out.append(chr(int(code, 8)) + part[3:])
        else:
            out.append("\\" + part)
    return "".join(out)
