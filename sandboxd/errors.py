"""The one exception tree of sandboxd.

Everything that can go wrong is one of these. OS errors are translated into
them once, at the kernel edge (``sandboxd.kernel._libc.check`` and friends);
the layers above only ever see this tree, and the CLI (and later the gRPC
service) maps it to exit codes / status codes in one place each.

This module is pure: no OS calls, so the policy layer can use it too.
"""

from __future__ import annotations

import errno as _errno

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping


class SandboxdError(Exception):
    """Base of every sandboxd error."""


class InvalidPolicy(SandboxdError, ValueError):
    """The caller asked for something that cannot be (bad path, unknown name, bad size)."""


class NotFound(SandboxdError):
    """No such object visible to the caller (a session id, a call id)."""


class Forbidden(SandboxdError):
    """The caller may not do this (someone else's session, a path out of its own reach)."""


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

    def to_dict(self) -> dict[str, object]:
        return {"call_id": self.call_id, "tool": self.tool, "reason": self.reason, "by": self.by,
                "detail": self.detail, "message": str(self)}


class Exhausted(SandboxdError):
    """A configured limit on the daemon itself was reached (sessions, calls)."""


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

    def to_dict(self) -> dict[str, object]:
        return {"step": self.step, "errno": self.errno, "path": self.path,
                "hint": self.hint, "detail": self.detail, "kind": type(self).__name__}

    @staticmethod
    def from_dict(data: "Mapping[str, object]") -> "SetupError":
        cls = _SETUP_KINDS.get(str(data.get("kind")), SetupError)
        def text(key: str) -> str | None:
            value = data.get(key)
            return None if value is None else str(value)
        number = data.get("errno") or 0
        return cls(step=str(data.get("step", "?")), errno=int(number) if isinstance(number, (int, str)) else 0,
                   path=text("path"), hint=text("hint"), detail=text("detail"))


class NamespacesUnavailable(SetupError):
    """The kernel, a container runtime or an LSM refused to create namespaces."""


class ExecFailed(SetupError):
    """Everything was set up but the program itself could not be executed."""


class LimitsUnavailable(SetupError):
    """A resource limit was asked for but no cgroup controller can enforce it."""


class ProcessLimitReached(SetupError):
    """A fork in the sandbox failed with EAGAIN: the sandbox's process limit, its owner's share of the
    ceiling or the ceiling itself is full (the caller's to resolve, not a broken host)."""


_SETUP_KINDS = {c.__name__: c for c in (SetupError, NamespacesUnavailable, ExecFailed, LimitsUnavailable,
                                        ProcessLimitReached)}


def _strerror(code: int) -> str:
    import os  # os.strerror is a pure table lookup, no system call
    return os.strerror(code)
