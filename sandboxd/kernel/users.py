"""Local users and groups by name or number (the password and group databases)."""

from __future__ import annotations

from sandboxd.errors import InvalidPolicy


def parse_user(text: str, what: str = "--user") -> tuple[int, int]:
    """``USER[:GROUP]`` (names or numbers) as (uid, gid); the user's own group when none is
    given (its number when the user has no entry). InvalidPolicy naming ``what`` if unknown."""
    import grp
    import pwd

    name, _, group = text.partition(":")
    try:
        if name.isdigit():
            uid = int(name)
            try:
                default_gid = pwd.getpwuid(uid).pw_gid
            except KeyError:
                default_gid = uid
        else:
            entry = pwd.getpwnam(name)
            uid, default_gid = entry.pw_uid, entry.pw_gid
        if not group:
            return uid, default_gid
        return uid, int(group) if group.isdigit() else grp.getgrnam(group).gr_gid
    except KeyError:
        raise InvalidPolicy(f"unknown user or group in {what} {text!r}") from None


def group_id(text: str) -> int:
    """A group by name or number; KeyError when no group has that name."""
    import grp

    return int(text) if text.isdigit() else grp.getgrnam(text).gr_gid
