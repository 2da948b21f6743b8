"""The error tree's one registry: every error crosses a process boundary (the fork server's answers,
a sandbox's setup report) as ``to_dict`` and comes back from ``from_dict`` as the same class with the
same fields; a name outside the tree decodes to the base class; a refused caller is CallerRefused,
PERMISSION_DENIED with its reason, through the one status table."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import grpc
import pytest

from daemon_fixtures import daemon  # noqa: F401 - pytest fixture
from daemon_helpers import Daemon
from sandboxd import errors
from sandboxd.config import ConfigError
from sandboxd.errors import (CallerRefused, Forbidden, InvalidPolicy, PermissionDenied, SandboxdError, SetupError)
from sandboxd.launcher import report
from sandboxd.service import status
from sandboxd.supervisor import fork_protocol
from sandboxd.v1 import sandboxd_pb2 as pb
from sandboxd.v1 import sandboxd_pb2_grpc as pb_grpc


def every_error_class() -> list[type[SandboxdError]]:
    """The whole tree below the base, found by walking subclasses (not by asking the registry)."""
    found: list[type[SandboxdError]] = []
    pending = list(SandboxdError.__subclasses__())
    while pending:
        cls = pending.pop()
        found.append(cls)
        pending.extend(cls.__subclasses__())
    return sorted(found, key=lambda cls: cls.__name__)


def sample(cls: type[SandboxdError]) -> SandboxdError:
    """An instance of ``cls`` with every field set (and none of them its default)."""
    if issubclass(cls, SetupError):
        return cls("mount /proc", errno.EACCES, "/proc/sys", hint="run it as root", detail="the kernel said no")
    if issubclass(cls, PermissionDenied):
        return cls("call-7", "shell", "sandbox_rejected", "user", "not now")
    if issubclass(cls, ConfigError):
        return cls("/etc/sandboxd/sandboxd.toml", "listen.workers", "must be at least 1")
    return cls(f"{cls.__name__}: what went wrong")


def test_the_registry_holds_the_whole_tree_and_nothing_else() -> None:
    classes = every_error_class()
    assert {SetupError, CallerRefused, ConfigError, PermissionDenied} <= set(classes)
    assert errors._BY_NAME == {cls.__name__: cls for cls in classes}


@pytest.mark.parametrize("cls", every_error_class(), ids=lambda cls: cls.__name__)
def test_every_error_round_trips(cls: type[SandboxdError]) -> None:
    """to_dict, through JSON (the fork server's wire), then from_dict: the same class, message and
    fields; the same through the fork server's own codec (an Error event) and, for setup errors,
    through the setup report's text form, where every value arrives as text."""
    error = sample(cls)
    data = error.to_dict()
    assert data["kind"] == cls.__name__
    back = SandboxdError.from_dict(json.loads(json.dumps(data)))
    assert type(back) is cls and str(back) == str(error) and back.to_dict() == data

    event = fork_protocol.decode(fork_protocol.Error(7, data).encode(), 0, fork_protocol.events())
    assert isinstance(event, fork_protocol.Error)
    assert type(SandboxdError.from_dict(event.error)) is cls

    if isinstance(error, SetupError):
        assert isinstance(back, SetupError)
        assert (back.step, back.errno, back.path, back.hint, back.detail) == \
            ("mount /proc", errno.EACCES, "/proc/sys", "run it as root", "the kernel said no")
        reported, _ = report.parse_outcome(report.encode(data))
        assert type(reported) is cls and (reported.step, reported.errno, reported.path) == \
            ("mount /proc", errno.EACCES, "/proc/sys")
        assert str(reported) == str(error)


@pytest.mark.parametrize("kind", ["SystemExit", "KeyboardInterrupt", "Exception", "BaseException", "OSError",
                                  "object", "type", "__class__", "__init_subclass__", "sandboxd.errors.SetupError",
                                  "setuperror", "", None, 42, ["SetupError"], {"SetupError": 1}])
def test_an_unknown_or_hostile_name_decodes_to_the_base(kind: object) -> None:
    data = {"kind": kind, "detail": "what the other side said", "step": "exec", "errno": 2}
    error = SandboxdError.from_dict(data)
    assert type(error) is SandboxdError and str(error) == "what the other side said"
    # Called on a class, nothing outside that class's own subtree comes back either.
    assert type(SetupError.from_dict(data)) is SetupError
    assert type(SandboxdError.from_dict({"detail": "no kind at all"})) is SandboxdError


def test_a_name_decodes_only_within_the_class_asked() -> None:
    """SetupError.from_dict of another branch's name (the setup report names only setup errors) is a
    SetupError; the base's from_dict gives that class (control)."""
    data = CallerRefused("not through the front door").to_dict()
    assert type(SetupError.from_dict(data)) is SetupError
    assert type(SandboxdError.from_dict(data)) is CallerRefused
    assert type(Forbidden.from_dict(data)) is CallerRefused


@pytest.mark.parametrize("value", ["EACCES", "13abc", "", True, 1.5, [13], {"n": 13}, None])
def test_fields_of_the_wrong_type_never_raise(value: object) -> None:
    error = SandboxdError.from_dict({"kind": "ExecFailed", "step": value, "errno": value, "path": value,
                                     "hint": value, "detail": value})
    assert isinstance(error, errors.ExecFailed) and error.errno == 0
    denied = SandboxdError.from_dict({"kind": "PermissionDenied", "call_id": value, "tool": value, "by": value})
    assert isinstance(denied, PermissionDenied)
    assert SetupError.from_dict({"kind": "SetupError", "errno": "13"}).errno == errno.EACCES   # control: text


def test_a_second_class_of_a_taken_name_is_refused() -> None:
    with pytest.raises(TypeError, match="'SetupError' is defined twice"):
        type("SetupError", (SandboxdError,), {})
    with pytest.raises(TypeError, match="'InvalidPolicy' is defined twice"):
        type("InvalidPolicy", (Forbidden,), {})
    assert errors._BY_NAME["SetupError"] is SetupError and errors._BY_NAME["InvalidPolicy"] is InvalidPolicy


class AbortedCall:
    """What status.abort hands a gRPC context: the code, message and trailing metadata it ends with."""

    def __init__(self) -> None:
        self.metadata: tuple[tuple[str, str], ...] = ()
        self.code: grpc.StatusCode | None = None
        self.message = ""

    def set_trailing_metadata(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self.metadata = metadata

    def abort(self, code: grpc.StatusCode, message: str) -> None:
        self.code, self.message = code, message
        raise grpc.RpcError(message)


def test_caller_refused_is_permission_denied_with_its_reason() -> None:
    refused = CallerRefused("this connection comes from a process inside a sandboxd sandbox")
    assert isinstance(refused, Forbidden) and not isinstance(refused, OSError)   # no `except OSError` eats it
    assert status.code_for(refused) == grpc.StatusCode.PERMISSION_DENIED
    call = AbortedCall()
    with pytest.raises(grpc.RpcError):
        status.abort(call, refused)  # type: ignore[arg-type]
    assert call.code == grpc.StatusCode.PERMISSION_DENIED
    assert call.message == "this connection comes from a process inside a sandboxd sandbox"
    assert call.metadata == ()                            # only a tool call's denial carries metadata
    # Controls: the rest of the table is as before.
    assert status.code_for(InvalidPolicy("x")) == grpc.StatusCode.INVALID_ARGUMENT
    assert status.code_for(SandboxdError("x")) == grpc.StatusCode.INTERNAL


def test_a_call_around_the_front_door_is_refused_by_the_daemon(daemon: Daemon) -> None:  # noqa: F811
    """Root, straight to the daemon's private gRPC socket (not through the door, so nobody the
    door knows): every call is PERMISSION_DENIED saying so, from the real servicer."""
    [backend] = sorted(Path(daemon.private).glob("grpc-*.sock"))
    with grpc.insecure_channel(f"unix:{backend}") as channel:
        with pytest.raises(grpc.RpcError) as raised:
            pb_grpc.SandboxStub(channel).ListSessions(pb.ListSessionsRequest(), timeout=30)
    assert raised.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "not connected through the front door" in (raised.value.details() or "")
    with grpc.insecure_channel(f"unix:{daemon.socket}") as channel:    # control: through the door
        pb_grpc.SandboxStub(channel).ListSessions(pb.ListSessionsRequest(), timeout=30)
