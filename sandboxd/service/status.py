"""The one place where sandboxd's exception tree becomes gRPC status codes."""

from __future__ import annotations

import json

from typing import NoReturn

import grpc

from sandboxd.errors import (
    CallerRefused,
    DeadlineExceeded,
    Draining,
    ExecFailed,
    Exhausted,
    Forbidden,
    InvalidPolicy,
    LimitsUnavailable,
    NamespacesUnavailable,
    NotFound,
    PermissionDenied,
    ProcessLimitReached,
    SandboxdError,
    SetupError,
    WrongState,
)

_CODES: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (InvalidPolicy, grpc.StatusCode.INVALID_ARGUMENT),
    (NotFound, grpc.StatusCode.NOT_FOUND),
    (CallerRefused, grpc.StatusCode.PERMISSION_DENIED),     # not through the front door, or refused there
    (Forbidden, grpc.StatusCode.PERMISSION_DENIED),
    # An EACCES that reached a handler untranslated (the kernel edge translates the ones it knows):
    # still a refusal to the caller, not an INTERNAL error. Callers are refused with CallerRefused.
    (PermissionError, grpc.StatusCode.PERMISSION_DENIED),
    (Exhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (DeadlineExceeded, grpc.StatusCode.DEADLINE_EXCEEDED),
    (WrongState, grpc.StatusCode.FAILED_PRECONDITION),
    (Draining, grpc.StatusCode.UNAVAILABLE),
    (ProcessLimitReached, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (ExecFailed, grpc.StatusCode.FAILED_PRECONDITION),
    (LimitsUnavailable, grpc.StatusCode.FAILED_PRECONDITION),
    (NamespacesUnavailable, grpc.StatusCode.FAILED_PRECONDITION),
    (SetupError, grpc.StatusCode.FAILED_PRECONDITION),
    (SandboxdError, grpc.StatusCode.INTERNAL),
)


def code_for(error: BaseException) -> grpc.StatusCode:
    for kind, code in _CODES:
        if isinstance(error, kind):
            return code
    return grpc.StatusCode.INTERNAL


DENIAL_METADATA = "sandboxd-permission-denied"
# On UNAVAILABLE from a draining daemon: whole seconds to wait before trying again (nothing started).
RETRY_AFTER_METADATA = "sandboxd-retry-after"


def abort(context: grpc.ServicerContext, error: BaseException) -> NoReturn:
    """End the call with the status for ``error`` and its message (never a traceback). A policy
    denial also carries its structured form (JSON) in the trailing metadata."""
    if isinstance(error, PermissionDenied):
        context.set_trailing_metadata(((DENIAL_METADATA, json.dumps(error.to_dict())),))
    elif isinstance(error, Draining):
        context.set_trailing_metadata(((RETRY_AFTER_METADATA, str(error.retry_after)),))
    code = code_for(error)
    message = str(error) if code != grpc.StatusCode.INTERNAL or isinstance(error, SandboxdError) \
        else f"internal error: {type(error).__name__}"
    context.abort(code, message)
