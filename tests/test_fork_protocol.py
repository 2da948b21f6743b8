"""The fork server's codec (supervisor/fork_protocol.py), without a fork server: every record
survives encode and decode unchanged; each field's JSON type is checked against its annotation
(a wrong one is Malformed under the message's id, naming the field and the type it must be); the
descriptor count is the record's; requests and events are told apart."""

from __future__ import annotations

import json
import socket

import pytest

from sandboxd.supervisor import fork_protocol as protocol

ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
SAMPLES: list[protocol.Message] = [
    protocol.Launch(1, {"argv": ["true"], "workspace": "/w"}),
    protocol.SessionOpen(2, "s#1", {"argv": ["true"]}),
    protocol.SessionClose(3, "s#1"),
    protocol.Call(4, "s#1", ["sh", "-c", "echo é"], ENV, "/w", 2.5, None, [24, 80]),
    protocol.Call(5, "s#1", ["true"], {}, "/w"),
    protocol.Signal(6, 15),
    protocol.Cancel(7),
    protocol.CheckPaths(8, [1000, 1000, [27]], ["/w", "/x"]),
    protocol.CheckPaths(9, None, []),
    protocol.Ping(10),
    protocol.Started(11, 4242, 7),
    protocol.Started(12, 4243),
    protocol.Exited(13, 0, None, False, 0.001, 0.0005, None, False),
    protocol.Exited(14, None, 9, True, 3.0, None, 1 << 20, True),
    protocol.SessionReady(15, 99, "/w", "10.0.0.1", "10.0.0.2", ["1.1.1.1"]),
    protocol.SessionReady(16, None, "/w"),
    protocol.SessionClosed(17, False),
    protocol.PathsChecked(18, ["/real/w"]),
    protocol.Pong(19),
    protocol.Error(20, {"kind": "InvalidPolicy", "detail": "no"}),
]


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
    with_listener = protocol.SessionReady(3, 99, "/w", "10.0.0.1", "10.0.0.2", [], True)
    assert protocol.decode(with_listener.encode(), 1, protocol.events()) == with_listener
    with pytest.raises(protocol.Malformed, match="takes 1 descriptors, got 0 .proxy_listener is True."):
        protocol.decode(with_listener.encode(), 0, protocol.events())
    without = protocol.SessionReady(4, 99, "/w", "10.0.0.1", "10.0.0.2", [])
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
