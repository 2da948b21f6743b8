"""The fork server's codec (supervisor/fork_protocol.py), without a fork server: every record
survives encode and decode unchanged; each field's JSON type is checked against its annotation
(a wrong one is Malformed under the message's id, naming the field and the type it must be); the
descriptor count is the record's; requests and events are told apart. A launch's spec crosses as
nested typed records (its policy's modes as choices), checked field by field the same way: a
malformed one is refused naming its path (``spec.policy.network_mode``)."""

from __future__ import annotations

import json
import re
import socket
from typing import Any

import pytest

from sandboxd.errors import InvalidPolicy
from sandboxd.policy import DangerFullAccess, LaunchSpec, Limits, ReadOnly, WorkspaceWrite
from sandboxd.policy.network import Unlisted
from sandboxd.policy.sandbox import NetworkMode, SandboxMode
from sandboxd.supervisor import fork_protocol as protocol

ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
SAMPLES: list[protocol.Message] = [
    protocol.Launch(1, protocol.spec_record(LaunchSpec(argv=("true",), workspace="/w"))),
    protocol.SessionOpen(2, "s#1", protocol.spec_record(LaunchSpec(argv=("true",), workspace="/w", policy=ReadOnly()))),
    protocol.SessionClose(3, "s#1"),
    protocol.Call(4, "s#1", ["sh", "-c", "echo é"], ENV, "/w", 2.5, None, [24, 80]),
    protocol.Call(5, "s#1", ["true"], {}, "/w"),
    protocol.Signal(6, 15),
    protocol.Cancel(7),
    protocol.CheckPaths(8, protocol.CallerRecord(1000, 1000, [27]), ["/w", "/x"]),
    protocol.CheckPaths(9, None, []),
    protocol.Ping(10),
    protocol.Started(11, 4242, 7),
    protocol.Started(12, 4243),
    protocol.Exited(13, 0, None, False, 0.001, 0.0005, None, False),
    protocol.Exited(14, None, 9, True, 3.0, None, 1 << 20, True),
    protocol.SessionReady(15, 99, "/w", ["/real/r"], "10.0.0.1", "10.0.0.2", ["1.1.1.1"], False, 4026532000),
    protocol.SessionReady(16, None, "/w", []),
    protocol.SessionClosed(17, False),
    protocol.PathsChecked(18, ["/real/w"]),
    protocol.Pong(19),
    protocol.Error(20, {"kind": "InvalidPolicy", "detail": "no"}),
    protocol.HeldSession(21, 99, "/w", ["/r"], "10.0.0.1", "10.0.0.2", ["1.1.1.1"], False, 4026532000, session="s#1"),
    protocol.CallEnded(22, None, 9, False, 0.5, None, 1 << 20, True, call=22, session="s#1", started_at=1.5, tag="t",
                       stdout_tail="out\xff", dropped=7),
]


def test_a_held_session_and_a_held_calls_end_are_checked_as_a_built_session_and_an_exit_are() -> None:
    """Duplicate D7: HeldSession repeated SessionReady's fields and CallEnded Exited's, each list
    checked on its own. Now each pair shares one declaration, so a field changed in one is changed
    in both, and a bad value is refused by the same check, naming the same field."""
    assert protocol.HeldSession._fields == protocol.SessionReady._fields + ("session",)
    assert protocol.CallEnded._fields[:len(protocol.Exited._fields)] == protocol.Exited._fields
    assert protocol.HeldSession.descriptor_flags == protocol.SessionReady.descriptor_flags
    ready = protocol.SessionReady(1, 99, "/w", ["/r"], proxy_listener=True)
    assert protocol.HeldSession(2, session="s#1", **ready.facts()).facts() == ready.facts()
    for record in (protocol.Exited(3, 0, None, False, 0.1, None, None, False),
                   protocol.CallEnded(3, 0, None, False, 0.1, None, None, False, call=3, session="", started_at=0.0,
                                      tag="")):
        fields = json.loads(record.encode())
        fields["timed_out"] = "no"
        with pytest.raises(protocol.Malformed, match="timed_out.*bool"):
            protocol.decode(json.dumps(fields).encode(), 0, protocol.events())


def table_of(message: protocol.Message) -> dict[str, type[protocol.Message]]:
    return protocol.requests() if isinstance(message, protocol.Request) else protocol.events()


@pytest.mark.parametrize("message", SAMPLES, ids=lambda m: f"{type(m).__name__}-{m.id}")
def test_every_record_round_trips(message: protocol.Message) -> None:
    back = protocol.decode(message.encode(), message.descriptors, table_of(message))
    assert type(back) is type(message) and back == message
    with pytest.raises(AttributeError, match="immutable"):
        back.id = 0  # type: ignore[misc]


def test_a_request_is_not_an_event() -> None:
    """The same bytes decode only against their own table: an event is no request."""
    with pytest.raises(protocol.Malformed, match="unknown fork server operation None"):
        protocol.decode(protocol.Pong(3).encode(), 0, protocol.requests())
    with pytest.raises(protocol.Malformed, match="unknown fork server event None"):
        protocol.decode(protocol.Ping(3).encode(), 0, protocol.events())


@pytest.mark.parametrize("field, value, must_be", [
    ("session", 7, "str"),
    ("argv", "true", "list[str]"),
    ("argv", ["true", None], "list[str]"),
    ("env", {"A": 1}, "dict[str, str]"),
    ("env", [["A", "b"]], "dict[str, str]"),
    ("cwd", None, "str"),
    ("timeout", True, "float | None"),
    ("timeout", "10", "float | None"),
    ("terminal", "24x80", "list[object] | None"),
])
def test_a_field_of_the_wrong_type_is_malformed_under_its_id(field: str, value: object, must_be: str) -> None:
    good = json.loads(protocol.Call(41, "s", ["true"], ENV, "/w").encode())
    assert protocol.decode(json.dumps(good).encode(), 3, protocol.requests()).id == 41   # the control
    with pytest.raises(protocol.Malformed) as bad:
        protocol.decode(json.dumps({**good, field: value}).encode(), 3, protocol.requests())
    assert bad.value.id == 41
    assert f"field {field!r} must be {must_be}" in str(bad.value), str(bad.value)


def test_missing_fields_take_their_defaults_and_required_ones_are_refused() -> None:
    bare = {"op": "call", "id": 5, "session": "s", "argv": ["true"], "env": {}, "cwd": "/w"}
    call = protocol.decode(json.dumps(bare).encode(), 3, protocol.requests())
    assert isinstance(call, protocol.Call) and (call.timeout, call.tool, call.terminal) == (None, None, None)
    assert protocol.decode(b'{"event": "session_closed", "id": 1}', 0, protocol.events()) == \
        protocol.SessionClosed(1, True)
    del bare["cwd"]
    with pytest.raises(protocol.Malformed, match="field 'cwd' must be str, got None"):
        protocol.decode(json.dumps(bare).encode(), 3, protocol.requests())


def test_descriptors_ids_and_garbage() -> None:
    with pytest.raises(protocol.Malformed, match="takes 3 descriptors, got 0") as wrong:
        protocol.decode(protocol.Call(9, "s", ["true"], {}, "/").encode(), 0, protocol.requests())
    assert wrong.value.id == 9
    with pytest.raises(protocol.Malformed, match="takes 0 descriptors, got 3"):
        protocol.decode(protocol.Ping(9).encode(), 3, protocol.requests())
    for data in (b"\xff not json", b"[1, 2]", b'{"op": "ping"}', b'{"op": "ping", "id": true}',
                 b'{"op": "ping", "id": 1.5}', b"[" * 100_000):
        with pytest.raises(protocol.Malformed) as bad:
            protocol.decode(data, 0, protocol.requests())
        assert bad.value.id == 0


def test_a_session_ready_carries_the_proxy_listener_exactly_when_it_says_so() -> None:
    """The egress proxy's listener comes with SessionReady (its one descriptor) only when
    ``proxy_listener`` says so: one without the other is malformed, so none is lost or taken for it."""
    with_listener = protocol.SessionReady(3, 99, "/w", [], "10.0.0.1", "10.0.0.2", [], True)
    assert protocol.decode(with_listener.encode(), 1, protocol.events()) == with_listener
    with pytest.raises(protocol.Malformed, match="takes 1 descriptors, got 0 .proxy_listener is True."):
        protocol.decode(with_listener.encode(), 0, protocol.events())
    without = protocol.SessionReady(4, 99, "/w", [], "10.0.0.1", "10.0.0.2", [])
    assert protocol.decode(without.encode(), 0, protocol.events()) == without
    with pytest.raises(protocol.Malformed, match="takes 0 descriptors, got 1"):
        protocol.decode(without.encode(), 1, protocol.events())
    forged = json.loads(with_listener.encode())
    forged["proxy_listener"] = 1                           # not a bool: no descriptor is expected
    with pytest.raises(protocol.Malformed, match="takes 0 descriptors, got 1"):
        protocol.decode(json.dumps(forged).encode(), 1, protocol.events())


def test_receive_reports_eof_truncation_and_descriptors() -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    buffer = protocol.receive_buffer()                    # one buffer for every message, as both ends read
    with ours, theirs:
        read_end, write_end = socket.socketpair()
        with read_end, write_end:
            fds = [read_end.fileno(), write_end.fileno(), read_end.fileno()]
            protocol.send(ours, protocol.Call(1, "s", ["true"], {}, "/").encode(), fds)
            message, received = protocol.receive(theirs, protocol.requests(), buffer)
            assert isinstance(message, protocol.Call) and len(received) == 3
            for fd in received:
                socket.socket(fileno=fd).close()
        ours.setsockopt(socket.SOL_SOCKET, protocol.SO_SNDBUFFORCE, 4 * protocol.MAX_MESSAGE)
        protocol.send(ours, b" " * (protocol.MAX_MESSAGE + 10))
        message, _ = protocol.receive(theirs, protocol.requests(), buffer)
        assert isinstance(message, protocol.Malformed) and "below" in str(message)
        # A short message after a long one is read as itself: nothing of the longer one is left in the buffer.
        protocol.send(ours, protocol.Ping(2).encode())
        message, _ = protocol.receive(theirs, protocol.requests(), buffer)
        assert isinstance(message, protocol.Ping) and message.id == 2
        ours.shutdown(socket.SHUT_WR)
        assert protocol.receive(theirs, protocol.requests(), buffer) == (None, [])


# -- the launch spec as a nested typed record -----------------------------------------------------

SPECS = [
    LaunchSpec(argv=("true",), workspace="/w"),
    LaunchSpec(argv=("ls", "-l"), workspace="/w", cwd="/w/sub", env={"A": "b"}, policy=ReadOnly(),
               limits=Limits(timeout_seconds=2.5, memory_bytes=64 << 20, pids=32, cpu_seconds=3, open_files=64,
                             tmp_size_bytes=8 << 20), user=(65534, 65534)),
    LaunchSpec(argv=("make",), workspace="/w", policy=WorkspaceWrite(
        network_access=True, writable_roots=("/var/tmp/a", "/var/tmp/b"), protected_subpaths=(".git/hooks", "x"),
        allowed_domains=("pypi.org",)), dns=("192.0.2.53",), caller=(1000, 1000, (27, 100))),
    LaunchSpec(argv=("id",), workspace="/w", policy=WorkspaceWrite(network_access=True, network_mode="host",
                                                                   protected_subpaths=())),
    LaunchSpec(argv=("id",), workspace="/w", policy=DangerFullAccess(), user=(0, 0)),
    LaunchSpec(argv=("id",), workspace="/w", owner="uid-1000", hidden_homes=("/root",), private_home="/tmp/h",
               limits=Limits(pids=100, total_pids=300, owner_pids=150, owner_memory_bytes=256 << 20)),
    LaunchSpec(argv=("gh",), workspace="/w", policy=WorkspaceWrite(
        network_access=True, allowed_domains=("*",), allowed_endpoints=("api.github.com=GET,HEAD:/repos/*/**",),
        unlisted="ask", credentials=("GH_TOKEN=https://api.github.com", "K=https://k.test:8443;x-api-key: {}")),
        trust_pem="-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"),
]


@pytest.mark.parametrize("spec", SPECS, ids=["minimal", "read-only-full", "workspace-write-roots", "host-network",
                                             "danger-root", "owner-share", "network-rules"])
def test_a_launch_spec_crosses_as_a_typed_record_and_comes_back_equal(spec: LaunchSpec) -> None:
    """The spec crosses nested (SpecRecord, PolicyRecord, Limits), its modes as choices: what the
    server decodes builds the very spec the client sent."""
    record = protocol.spec_record(spec)
    for message in (protocol.Launch(7, record), protocol.SessionOpen(8, "s#1", record)):
        back = protocol.decode(message.encode(), message.descriptors, protocol.requests())
        assert back == message
        assert isinstance(back, (protocol.Launch, protocol.SessionOpen))
        assert isinstance(back.spec.policy.name, SandboxMode) and isinstance(back.spec.policy.network_mode, NetworkMode)
        assert protocol.launch_spec(back.spec) == spec
        assert isinstance(back.spec.policy.unlisted, Unlisted)


def _spec_message() -> dict[str, Any]:
    good: dict[str, Any] = json.loads(protocol.Launch(61, protocol.spec_record(SPECS[2])).encode())
    assert protocol.decode(json.dumps(good).encode(), 3, protocol.requests()).id == 61      # the control
    return good


@pytest.mark.parametrize("path, value, says", [
    ("spec.policy.network_mode", 7, "must be one of isolated, host, got 7"),
    ("spec.policy.network_mode", "moon", "must be one of isolated, host, got 'moon'"),
    ("spec.policy.name", "bogus", "must be one of read-only, workspace-write, danger-full-access"),
    ("spec.policy.network_access", "yes", "must be bool"),
    ("spec.policy.writable_roots", "/a", "must be list[str]"),
    ("spec.policy.writable_roots", ["/a", 5], "must be list[str]"),
    ("spec.policy.allowed_hosts", None, "is missing"),
    ("spec.policy.surprise", True, "PolicyRecord has no field 'surprise'"),
    ("spec.policy", ["workspace-write"], "must be an object of PolicyRecord's fields"),
    ("spec.limits.pids", "10", "must be int | None"),
    ("spec.limits.pids", 0, "is refused: limit pids must be greater than zero"),
    ("spec.limits.nonsense", 1, "Limits has no field 'nonsense'"),
    ("spec.caller.groups", [27, "wheel"], "must be list[int]"),
    ("spec.caller", [1000, 1000, [27]], "must be an object of CallerRecord's fields"),
    ("spec.user", ["x", 0], "must be list[int] | None"),
    ("spec.argv", None, "is missing"),
    ("spec.policy.unlisted", "sometimes", "must be one of refuse, ask, got 'sometimes'"),
    ("spec.policy.unlisted", None, "is missing"),
    ("spec.policy.allowed_endpoints", "a.test=GET:/", "must be list[str]"),
    ("spec.policy.credentials", [{"name": "T"}], "must be list[str]"),
    ("spec.trust_pem", ["pem"], "must be str"),
])
def test_a_malformed_nested_field_is_refused_naming_its_path(path: str, value: object, says: str) -> None:
    """Each field of the nested spec is checked as the top-level ones are: a wrong one is Malformed
    under the request's id, naming the field by its path (the server answers it InvalidPolicy),
    never a KeyError or TypeError from deep inside."""
    message = _spec_message()
    *parents, name = path.split(".")
    holder = message
    for part in parents:
        holder = holder[part]
    if value is None and says == "is missing":
        del holder[name]
    else:
        holder[name] = value
    with pytest.raises(protocol.Malformed) as bad:
        protocol.decode(json.dumps(message).encode(), 3, protocol.requests())
    assert bad.value.id == 61
    # A field the record lacks, or one its own check refuses (Limits' ranges), is named by the record's path.
    where = path.rpartition(".")[0] if "has no field" in says or "is refused" in says else path
    assert f"field {where!r}" in str(bad.value) and says in str(bad.value), str(bad.value)


def test_a_well_typed_spec_its_policy_kind_refuses_is_invalid_policy() -> None:
    """Every field has its type, but the kind does not take it (read-only with network, or with a
    writable root): InvalidPolicy saying so, from the policy's own rules."""
    for change, says in (({"name": "read-only"}, "read-only has no network access"),
                         ({"name": "danger-full-access", "network_access": True}, "danger-full-access has no writable roots")):
        message = _spec_message()
        message["spec"]["policy"].update(change)
        decoded = protocol.decode(json.dumps(message).encode(), 3, protocol.requests())
        assert isinstance(decoded, protocol.Launch)
        with pytest.raises(InvalidPolicy, match=says):
            protocol.launch_spec(decoded.spec)
    message = _spec_message()
    message["spec"]["user"] = [1, 2, 3]
    decoded = protocol.decode(json.dumps(message).encode(), 3, protocol.requests())
    assert isinstance(decoded, protocol.Launch)
    with pytest.raises(InvalidPolicy, match="'spec.user' must be \\[uid, gid\\]"):
        protocol.launch_spec(decoded.spec)


@pytest.mark.parametrize("field, value, says", [
    ("allowed_endpoints", ["pypi.org=GET:/a/../b"], "'.' or '..' segment"),
    ("allowed_endpoints", ["other.test=GET:/"], "endpoint rules only narrow"),
    ("credentials", ["T=http://a.test"], "https://HOST"),
])
def test_network_rules_the_policy_refuses_are_refused_after_decoding(field: str, value: object, says: str) -> None:
    """A well-typed record whose rules the policy refuses is InvalidPolicy from launch_spec, as the
    policy's own check says (the server never builds from it)."""
    message = _spec_message()
    message["spec"]["policy"][field] = value
    decoded = protocol.decode(json.dumps(message).encode(), 3, protocol.requests())
    assert isinstance(decoded, protocol.Launch)
    with pytest.raises(InvalidPolicy, match=re.escape(says)):
        protocol.launch_spec(decoded.spec)


@pytest.mark.parametrize("proxy, transparent", [(True, True), (True, False), (False, False)])
def test_session_ready_carries_one_descriptor_per_listener_it_names(proxy: bool, transparent: bool) -> None:
    """descriptor_flags: the egress proxy's listener and transparent capture's each come only when
    their flag says so, and a count that does not fit is refused naming both flags."""
    ready = protocol.SessionReady(21, 99, "/w", [], "10.0.0.1", "10.0.0.2", None, proxy, 1,
                                  transparent_listener=transparent)
    count = int(proxy) + int(transparent)
    assert protocol.decode(ready.encode(), count, protocol.events()) == ready
    with pytest.raises(protocol.Malformed, match=f"takes {count} descriptors, got {count + 1} "
                       f"\\(proxy_listener is {proxy}, transparent_listener is {transparent}\\)"):
        protocol.decode(ready.encode(), count + 1, protocol.events())
