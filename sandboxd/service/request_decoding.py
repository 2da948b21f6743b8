"""A request that does not decode is the caller's mistake, answered INVALID_ARGUMENT with what to fix.

gRPC's Python server answers a message its deserializer refuses with ``INTERNAL: Exception
deserializing request!``, which says neither that the caller is at fault nor what is wrong. The
commonest case is a string field holding bytes that are not UTF-8 (proto3 strings must be): a raw
client, or one that put a path's bytes in a string. ``DecodingInterceptor`` wraps every method's
deserializer so that such a message becomes ``Undecodable`` instead, and the method answers
INVALID_ARGUMENT, before the servicer sees anything:

- a unary request: at once (``context.abort``);
- a request stream (Exec): when the servicer reads that message, ``Undecodable`` (an InvalidPolicy)
  is raised where it reads it, so the servicer's own mapping answers INVALID_ARGUMENT; one that
  escapes the method is answered the same way here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf.message import DecodeError

from sandboxd.errors import InvalidPolicy

if TYPE_CHECKING:
    Handler = grpc.RpcMethodHandler[Any, Any]         # generic in the stubs only
UTF8_SAID = "bad UTF-8"          # what upb's DecodeError says of a string field that is not UTF-8


class Undecodable(InvalidPolicy):
    """A request message that did not decode, and why (said to the caller)."""


def _explained(error: DecodeError) -> Undecodable:
    what = str(error)
    if UTF8_SAID in what:
        return Undecodable("a string field is not valid UTF-8: send text as UTF-8 (proto3 strings must be; "
                           "a bytes field takes any bytes)")
    return Undecodable(f"the request is not a valid message ({what.rpartition(': ')[2] or 'it does not parse'}): "
                       "send a message of the method's request type")


def _tolerant(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    """``deserializer`` whose refusal comes back as an Undecodable (a value), not raised: gRPC
    turns a raised one into INTERNAL before any code of ours runs."""
    if deserializer is None:
        return None
    decode = deserializer

    def tolerant(data: bytes) -> Any:
        try:
            return decode(data)
        except DecodeError as error:
            return _explained(error)
    return tolerant


def _checked(requests: Iterator[Any]) -> Iterator[Any]:
    for request in requests:
        if isinstance(request, Undecodable):
            raise request
        yield request


def _unary_unary(behavior: Callable[[Any, grpc.ServicerContext], Any]) -> Callable[..., Any]:
    def checked(request: Any, context: grpc.ServicerContext) -> Any:
        if isinstance(request, Undecodable):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(request))
        return behavior(request, context)
    return checked


def _unary_stream(behavior: Callable[[Any, grpc.ServicerContext], Iterator[Any]]) -> Callable[..., Iterator[Any]]:
    def checked(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        if isinstance(request, Undecodable):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(request))
        yield from behavior(request, context)
    return checked


def _stream_unary(behavior: Callable[[Iterator[Any], grpc.ServicerContext], Any]) -> Callable[..., Any]:
    def checked(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
        try:
            return behavior(_checked(requests), context)
        except Undecodable as error:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
    return checked


def _stream_stream(behavior: Callable[[Iterator[Any], grpc.ServicerContext], Iterator[Any]]
                   ) -> Callable[..., Iterator[Any]]:
    def checked(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
        try:
            yield from behavior(_checked(requests), context)
        except Undecodable as error:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
    return checked


class DecodingInterceptor(grpc.ServerInterceptor):
    """Every method's handler with a deserializer that never raises (see the module's doc), made
    once per method: as many as the services have (an unknown method has no handler to keep)."""

    def __init__(self) -> None:
        self._made: dict[str, tuple[Handler, Handler]] = {}   # method -> (gRPC's handler, ours)

    def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Handler | None],
                          handler_call_details: grpc.HandlerCallDetails) -> Handler | None:
        handler = continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        method = handler_call_details.method
        made = self._made.get(method)
        if made is None or made[0] is not handler:          # a service that makes its handler per call
            made = self._made[method] = (handler, self._tolerant(handler))
        return made[1]

    @staticmethod
    def _tolerant(handler: Handler) -> Handler:
        wrapped: dict[str, Any] = {"request_deserializer": _tolerant(handler.request_deserializer)}
        for kind, wrap in (("unary_unary", _unary_unary), ("unary_stream", _unary_stream),
                           ("stream_unary", _stream_unary), ("stream_stream", _stream_stream)):
            behavior = getattr(handler, kind)
            if behavior is not None:
                wrapped[kind] = wrap(behavior)
        # grpc's handlers are namedtuples (grpc._utilities.RpcMethodHandler): the same, these parts replaced.
        replaced: Handler = handler._replace(**wrapped)  # type: ignore[attr-defined]
        return replaced
