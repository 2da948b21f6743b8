"""The client half of tests/test_fuzz_rpcs.py: property-based requests to every RPC of
sandboxd.v1.Sandbox, built from the message descriptors, sent by a plain user.

Run by the test as root with ``python -c SOURCE ARGS_JSON``: it imports everything first, then
drops to the given uid/gid (nothing is read from disk after that), creates a few real sessions
to mix their ids in, and runs one hypothesis test per RPC. It prints one JSON object: the
calls made, the status codes seen, and every failure (INTERNAL, UNKNOWN) with its request.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Callable, Iterator

import grpc
from google.protobuf import descriptor as d
from google.protobuf import text_format
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sandboxd.v1 import sandboxd_pb2 as pb
from sandboxd.v1 import sandboxd_pb2_grpc as pb_grpc

ARGS: dict[str, Any] = json.loads(sys.argv[1])
BAD_CODES = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
CALL_TIMEOUT = 5.0                       # a held approval or a long command ends by cancellation
STREAM_TIMEOUT = 1.0
STREAM_MESSAGES = 4                      # a stream is read this far, then cancelled

ALWAYS_SET = ("session_id", "start", "workspace")
_INT_RANGES = {
    d.FieldDescriptor.TYPE_INT32: (-(1 << 31), (1 << 31) - 1), d.FieldDescriptor.TYPE_SINT32: (-(1 << 31), (1 << 31) - 1),
    d.FieldDescriptor.TYPE_SFIXED32: (-(1 << 31), (1 << 31) - 1),
    d.FieldDescriptor.TYPE_INT64: (-(1 << 63), (1 << 63) - 1), d.FieldDescriptor.TYPE_SINT64: (-(1 << 63), (1 << 63) - 1),
    d.FieldDescriptor.TYPE_SFIXED64: (-(1 << 63), (1 << 63) - 1),
    d.FieldDescriptor.TYPE_UINT32: (0, (1 << 32) - 1), d.FieldDescriptor.TYPE_FIXED32: (0, (1 << 32) - 1),
    d.FieldDescriptor.TYPE_UINT64: (0, (1 << 64) - 1), d.FieldDescriptor.TYPE_FIXED64: (0, (1 << 64) - 1),
}


def integers(low: int, high: int) -> st.SearchStrategy[int]:
    """The extremes and the edges (sign, 2^31, 2^53, 2^63) of the field's range, and anything in it."""
    edges = sorted({v for v in (low, low + 1, -1, 0, 1, 2, 1000, (1 << 31) - 1, 1 << 31, (1 << 53) + 1,
                                (1 << 63) - 1, high - 1, high) if low <= v <= high})
    return st.one_of(st.sampled_from(edges), st.integers(low, high))


def floats(width: int) -> st.SearchStrategy[float]:
    specials = [0.0, -0.0, 1e-9, 0.5, 1.0, -1.0, 604800.0, 604801.0, 1e300, -1e300, float("nan"), float("inf"),
                float("-inf")]
    return st.one_of(st.sampled_from(specials), st.floats(width=width))


def texts(name: str) -> st.SearchStrategy[str]:
    """Random text, the odd and the huge, and for some fields real values (session ids, paths)."""
    odd = ["", "\0", "a\0b", "/tmp/\0x", "/", "[" * 100000, "{\"a\":" * 50000, ".", "..", "../../etc/passwd", "/dev/zero", "/proc/self/mem", "x" * 5000,
           "/" + "a/" * 3000, "\N{SNOWMAN}" * 10, "é" * 300, "9" * 30, "-1", "NaN", "(a+)+$", "[", "*"]
    huge = st.integers(0, 3 << 20).map(lambda n: "h" * n)
    real: list[str] = []
    if name in ("session_id",):
        real = list(ARGS["session_ids"])
    elif name in ("workspace", "cwd", "path"):
        real = [ARGS["workspace"], "f.txt", "fifo", "sub", ARGS["workspace"] + "/f.txt"]
    elif name == "pattern":
        real = ["hello", "(a|aa)*b", "(x+x+)+y"]
    elif name == "patch":
        real = ["--- a/f.txt\n+++ b/f.txt\n@@ -1 +1 @@\n-hello\n+world\n", "--- /dev/null\n+++ b/n\n"]
    elif name == "argv":
        real = ["true", "echo", "cat", "/bin/sh", "-c", "ls"]
    elif name == "shell":
        real = ["echo hi", "cat /etc/hostname; exit 3", "kill -9 $$"]
    elif name in ("tool",):
        real = ["browser.action", "shell.exec", "fs.read"]
    elif name in ("engine",):
        real = ["builtin", "ripgrep"]
    elif name in ("permission_mode",):
        real = ["default", "plan", "acceptEdits", "bypassPermissions"]
    options = [st.text(max_size=40), st.text(max_size=40), st.sampled_from(odd), st.sampled_from(odd), huge]
    if real:                                   # mostly real: past NOT_FOUND, into the RPC's own checks
        options = [st.sampled_from(real)] * 12 + options
    return st.sampled_from(options).flatmap(lambda chosen: chosen)


def blobs() -> st.SearchStrategy[bytes]:
    return st.one_of(st.binary(max_size=64), st.sampled_from([b"", b"\0" * 10, b"x" * (1 << 20)]),
                     st.integers(0, 5 << 20).map(lambda n: b"\xff" * n))


def scalar(field: d.FieldDescriptor) -> st.SearchStrategy[Any]:
    kind = field.type
    if kind in _INT_RANGES:
        return integers(*_INT_RANGES[kind])
    if kind == d.FieldDescriptor.TYPE_DOUBLE:
        return floats(64)
    if kind == d.FieldDescriptor.TYPE_FLOAT:
        return floats(32)
    if kind == d.FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if kind == d.FieldDescriptor.TYPE_ENUM:
        known = [v.number for v in field.enum_type.values]
        return st.one_of(st.sampled_from(known), st.integers(-(1 << 31), (1 << 31) - 1))
    if kind == d.FieldDescriptor.TYPE_STRING:
        return texts(field.name)
    if kind == d.FieldDescriptor.TYPE_BYTES:
        return blobs()
    raise AssertionError(f"no strategy for {field.full_name}")


def messages(descriptor: d.Descriptor, depth: int = 0) -> st.SearchStrategy[Any]:
    """A message of this type with any subset of its fields set to random values."""
    cls = _class_of(descriptor)
    if depth > 3:
        return st.just(cls())
    parts: dict[str, st.SearchStrategy[Any]] = {}
    for field in descriptor.fields:
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            key_field, value_field = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
            value = (messages(value_field.message_type, depth + 1) if value_field.message_type is not None
                     else scalar(value_field))
            parts[field.name] = st.dictionaries(scalar(key_field), value, max_size=4)
        elif field.message_type is not None:
            one = messages(field.message_type, depth + 1)
            parts[field.name] = st.lists(one, max_size=3) if _repeated(field) else one
        elif _repeated(field):
            parts[field.name] = st.one_of(st.lists(scalar(field), max_size=6),
                                          st.integers(0, 200_000).map(lambda n: ["a"] * n)
                                          if field.type == d.FieldDescriptor.TYPE_STRING else st.just([]))
        else:
            parts[field.name] = scalar(field)
    # The fields that get a request past its first check are always set; the rest at random.
    required = {name: parts.pop(name) for name in ALWAYS_SET if name in parts}
    return st.fixed_dictionaries(required, optional=parts).map(lambda values: _build(cls, descriptor, values))


def _repeated(field: d.FieldDescriptor) -> bool:
    return bool(field.is_repeated)


def _class_of(descriptor: d.Descriptor) -> Any:
    from google.protobuf import message_factory

    return message_factory.GetMessageClass(descriptor)


def _build(cls: Any, descriptor: d.Descriptor, values: dict[str, Any]) -> Any:
    message = cls()
    for name, value in values.items():
        field = descriptor.fields_by_name[name]
        target = getattr(message, name) if _repeated(field) or field.message_type is not None else None
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            for key, item in value.items():
                if field.message_type.fields_by_name["value"].message_type is not None:
                    target[key].CopyFrom(item)
                else:
                    target[key] = item
        elif field.message_type is not None and _repeated(field):
            for item in value:
                target.add().CopyFrom(item)
        elif field.message_type is not None:
            target.CopyFrom(value)
        elif _repeated(field):
            target.extend(value)
        else:
            setattr(message, name, value)
    return message


def call(stub_method: Callable[..., Any], method: d.MethodDescriptor, request: Any) -> tuple[grpc.StatusCode, str]:
    """Send one request; the status it ends with (OK, or the error's) and its message."""
    try:
        if method.client_streaming:
            response = stub_method(iter([request]), timeout=CALL_TIMEOUT)
        elif method.server_streaming:             # WatchEvents waits for live events: do not wait long
            response = stub_method(request, timeout=STREAM_TIMEOUT)
        else:
            response = stub_method(request, timeout=CALL_TIMEOUT)
        if method.server_streaming:
            for index, _ in enumerate(response):
                if index >= STREAM_MESSAGES:
                    response.cancel()
                    break
        return grpc.StatusCode.OK, ""
    except grpc.RpcError as error:
        return error.code(), error.details() or ""


def fuzz_one(method: d.MethodDescriptor, stub_method: Any, tally: dict[str, Any]) -> Callable[[], None]:
    """The hypothesis test of one RPC; what it sees is added to ``tally``."""
    @settings(max_examples=int(ARGS["examples"]), deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(messages(method.input_type))
    def fuzz(request: Any) -> None:
        code, details = call(stub_method, method, request)
        tally["calls"] += 1
        tally["codes"][code.name] = tally["codes"].get(code.name, 0) + 1
        per_method = tally["by_method"].setdefault(method.name, {})
        per_method[code.name] = per_method.get(code.name, 0) + 1
        if code in BAD_CODES:
            shown = text_format.MessageToString(request, as_utf8=True)
            tally["failures"].append({"method": method.name, "code": code.name, "details": details[:500],
                                      "request": shown[:1500]})
    return fuzz


def live_sessions(stub: pb_grpc.SandboxStub, ids: list[str]) -> list[str]:
    """Two open sessions of ours (approval NEVER: a call held for a person would only wait out
    CALL_TIMEOUT; held calls are the quota test's subject), opened again if closed."""
    alive = []
    for session_id in ids:
        try:                                 # UpdateSessionPolicy may have made it ask a person (ALWAYS)
            stub.UpdateSessionPolicy(pb.UpdateSessionPolicyRequest(session_id=session_id, approval_policy=pb.NEVER),
                                     timeout=30)
            alive.append(session_id)
        except grpc.RpcError:
            pass
    modes = [pb.SandboxPolicy.WORKSPACE_WRITE, pb.SandboxPolicy.READ_ONLY][len(alive):]
    for mode in modes:
        try:
            alive.append(stub.CreateSession(pb.CreateSessionRequest(
                workspace=ARGS["workspace"], approval_policy=pb.NEVER, sandbox_policy=pb.SandboxPolicy(mode=mode)),
                timeout=60).id)
        except grpc.RpcError as error:       # at the session quota: make room, fuzzed sessions are not needed
            if error.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise
            for other in stub.ListSessions(pb.ListSessionsRequest(), timeout=30).sessions:
                if other.id not in alive:
                    stub.CloseSession(pb.CloseSessionRequest(session_id=other.id), timeout=30)
            alive.append(stub.CreateSession(pb.CreateSessionRequest(
                workspace=ARGS["workspace"], approval_policy=pb.NEVER, sandbox_policy=pb.SandboxPolicy(mode=mode)),
                timeout=60).id)
    return alive


def main() -> None:
    channel = grpc.insecure_channel("unix:" + ARGS["socket"],
                                    options=(("grpc.max_receive_message_length", 128 << 20),
                                             ("grpc.max_send_message_length", 128 << 20)))
    stub = pb_grpc.SandboxStub(channel)
    os.setgroups([])
    os.setgid(ARGS["gid"])
    os.setuid(ARGS["uid"])
    ARGS["session_ids"] = []
    service = pb.DESCRIPTOR.services_by_name["Sandbox"]
    only = set(ARGS.get("only") or ())
    tally: dict[str, Any] = {"calls": 0, "codes": {}, "failures": [], "seconds": {}, "by_method": {}}
    for method in service.methods:
        if only and method.name not in only:
            continue
        ARGS["session_ids"] = live_sessions(stub, ARGS["session_ids"])   # CloseSession may have closed them
        started = time.monotonic()
        fuzz_one(method, getattr(stub, method.name), tally)()
        tally["seconds"][method.name] = round(time.monotonic() - started, 2)
    channel.close()
    print(json.dumps(tally))


if __name__ == "__main__":
    main()
