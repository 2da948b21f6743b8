"""The one exception tree of sandboxd.

Everything that can go wrong is one of these. OS errors are translated into
them once, at the kernel edge (``sandboxd.kernel._libc.check`` and friends);
the layers above only ever see this tree, and the CLI and the gRPC service
(``service.status``) map it to exit codes / status codes in one place each.

An error crosses a process boundary (the fork server's answers, a sandbox's setup report) as
plain data: ``to_dict()`` names its class (``kind``) beside what its constructor takes, and
``from_dict()`` builds it back. Classes are found by name in one registry that
``__init_subclass__`` fills: only classes of this tree are in it, each name once, so a payload can
name nothing else; a name it does not hold decodes to the class ``from_dict`` was called on.

This module is pure: no OS calls, so the policy layer can use it too.
"""

from __future__ import annotations

import errno as _errno

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping
    from typing import Self

# Every class of the tree by its name (``to_dict``'s "kind"), filled as each class is defined.
_BY_NAME: "dict[str, type[SandboxdError]]" = {}


class SandboxdError(Exception):
    """Base of every sandboxd error."""

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        known = _BY_NAME.get(cls.__name__)
        if known is not None:
            # Two classes of one name would decode as whichever came last: refused where it is written.
            raise TypeError(f"sandboxd error {cls.__name__!r} is defined twice ({known.__module__} and "
                            f"{cls.__module__}): name one of them differently")
        _BY_NAME[cls.__name__] = cls

    def to_dict(self) -> dict[str, object]:
        """This error as JSON-safe data: ``kind``, its class's name, and what its constructor takes."""
        return {"kind": type(self).__name__, **self._fields()}

    @classmethod
    def from_dict(cls, data: "Mapping[str, object]") -> "Self":
        """The error ``data`` (a ``to_dict``) describes: of the class its ``kind`` names when that is
        ``cls`` or below it, else of ``cls`` itself. Never raises on what the data holds: a field of
        another type is read as text, a number that is not one as 0."""
        named = _BY_NAME.get(str(data.get("kind")), cls)
        kind = named if issubclass(named, cls) else cls
        return kind._from_fields(data)

    def _fields(self) -> dict[str, object]:
        """``to_dict`` but the kind: the message, as ``detail``; a class with its own constructor
        gives that constructor's arguments."""
        return {"detail": str(self)}

    @classmethod
    def _from_fields(cls, data: "Mapping[str, object]") -> "Self":
        """The inverse of ``_fields``."""
        return cls(_text(data, "detail") or cls.__name__)


class InvalidPolicy(SandboxdError, ValueError):
    """The caller asked for something that cannot be (bad path, unknown name, bad size)."""


class NotFound(SandboxdError):
    """No such object visible to the caller (a session id, a call id)."""


class Forbidden(SandboxdError):
    """The caller may not do this (someone else's session, a path out of its own reach)."""


class CallerRefused(Forbidden):
    """The daemon serves this caller nothing: it did not come through the front door, the door
    refused its connection (a process inside a sandbox, ...), or its TLS certificate names nobody.
    The message says which."""


class PermissionDenied(Forbidden):
    """A tool call the policy engine refused, or the user denied: it was never invoked.
    ``by`` says who: "sandbox" (structural), "user", "timeout" (nobody answered in time),
    "cancelled" (the caller went away while waiting)."""

    def __init__(self, call_id: str, tool: str, reason: str | None, by: str, detail: str = "") -> None:
        self.call_id, self.tool, self.reason, self.by, self.detail = call_id, tool, reason, by, detail
        words = {"sandbox": "denied by the sandbox", "user": "denied by user",
                 "timeout": "denied: nobody approved it in time", "cancelled": "denied: the caller went away"}
        text = f"{tool}: {words.get(by, 'denied')}"
        if reason:
            text += f" ({reason})"
        super().__init__(f"{text}: {detail}" if detail else text)

    def _fields(self) -> dict[str, object]:
        # Also the denial's structured form in a failed call's trailing metadata (service.status).
        return {"call_id": self.call_id, "tool": self.tool, "reason": self.reason, "by": self.by,
                "detail": self.detail, "message": str(self)}

    @classmethod
    def _from_fields(cls, data: "Mapping[str, object]") -> "Self":
        return cls(_text(data, "call_id") or "", _text(data, "tool") or "", _text(data, "reason"),
                   _text(data, "by") or "", _text(data, "detail") or "")


class Exhausted(SandboxdError):
    """A configured limit on the daemon itself was reached (sessions, calls)."""


class Draining(SandboxdError):
    """The daemon is draining (a restart or an upgrade): it starts no new session or call. Nothing
    was started, so the client may try again after ``retry_after`` seconds, on the next daemon."""

    def __init__(self, detail: str, retry_after: int = 1) -> None:
        self.detail, self.retry_after = detail, retry_after
        super().__init__(f"sandboxd is draining; retry in {retry_after} s ({detail})")

    def _fields(self) -> dict[str, object]:
        return {"detail": self.detail, "retry_after": self.retry_after}

    @classmethod
    def _from_fields(cls, data: "Mapping[str, object]") -> "Self":
        return cls(_text(data, "detail") or "", _whole(data, "retry_after"))


class WrongState(SandboxdError):
    """The object is not in a state that allows this now (a session not in review mode; a discard
    while a call of the session runs): the message says what would."""


class DeadlineExceeded(SandboxdError):
    """A call ran out of its time budget (a file tool, the built-in search) and was stopped."""


class SetupError(SandboxdError):
    """The sandbox could not be built. Never followed by running the command anyway.

    ``step`` names the setup step (``unshare``, ``mount /proc``, ``exec`` ...),
    ``errno`` the kernel's answer, ``path`` the file involved if any, and
    ``hint`` what the user can do about it.
    """

    def __init__(self, step: str, errno: int = 0, path: str | None = None,
                 hint: str | None = None, detail: str | None = None) -> None:
        self.step = step
        self.errno = errno
        self.path = path
        self.hint = hint
        self.detail = detail
        super().__init__(self.message())

    def message(self) -> str:
        parts = [f"sandbox setup failed at step '{self.step}'"]
        if self.path:
            parts.append(f"on {self.path}")
        if self.errno:
            name = _errno.errorcode.get(self.errno, str(self.errno))
            parts.append(f"({name}: {_strerror(self.errno)})")
        if self.detail:
            parts.append(f"- {self.detail}")
        text = " ".join(parts)
        if self.hint:
            text += f"; {self.hint}"
        return text

    def _fields(self) -> dict[str, object]:
        return {"step": self.step, "errno": self.errno, "path": self.path, "hint": self.hint, "detail": self.detail}

    @classmethod
    def _from_fields(cls, data: "Mapping[str, object]") -> "Self":
        return cls(step=_text(data, "step") or "?", errno=_whole(data, "errno"), path=_text(data, "path"),
                   hint=_text(data, "hint"), detail=_text(data, "detail"))


class NamespacesUnavailable(SetupError):
    """The kernel, a container runtime or an LSM refused to create namespaces."""


class ExecFailed(SetupError):
    """Everything was set up but the program itself could not be executed."""


class LimitsUnavailable(SetupError):
    """A resource limit was asked for but no cgroup controller can enforce it."""


class ProcessLimitReached(SetupError):
    """A fork in the sandbox failed with EAGAIN: the sandbox's process limit, its owner's share of the
    ceiling or the ceiling itself is full (the caller's to resolve, not a broken host)."""


def _text(data: "Mapping[str, object]", key: str) -> str | None:
    value = data.get(key)
    return None if value is None else str(value)


def _whole(data: "Mapping[str, object]", key: str) -> int:
    """An integer field (a setup report's fields are all text); 0 when it is not one."""
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        return 0
    try:
        return int(value)
    except ValueError:
        return 0


def _strerror(code: int) -> str:
    import os  # os.strerror is a pure table lookup, no system call
    return os.strerror(code)
