"""Each bad input of issue 11, through a real daemon: a clear INVALID_ARGUMENT (or
RESOURCE_EXHAUSTED, DEADLINE_EXCEEDED) saying what to fix, never INTERNAL; and bounded answers
(ReadFile of /dev/zero or a FIFO, a huge max_bytes, a backtracking pattern). Each has a control
showing the legitimate use still works."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import grpc
import pytest

from daemon_fixtures import daemon, stub, ws  # noqa: F401 - pytest fixtures
from daemon_helpers import Daemon, close_quietly, create_session, rpc_error, run_exec, workspace_write
from sandboxd.client import SandboxClient
from sandboxd.errors import InvalidPolicy
from sandboxd.policy import LaunchSpec, Limits, policy_from_name
from sandboxd.policy import limits as policy_limits
from sandboxd.service.file_calls import DEFAULT_READ_LIMIT, MAX_READ_LIMIT
from sandboxd.v1 import sandboxd_pb2 as pb
from sandboxd.v1 import sandboxd_pb2_grpc as pb_grpc

INVALID = grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture
def session(stub: pb_grpc.SandboxStub, ws: Path):  # type: ignore[no-untyped-def]
    s = create_session(stub, ws, workspace_write())
    yield s
    close_quietly(stub, s.id)


def exec_error(stub: pb_grpc.SandboxStub, start: pb.ExecStart) -> grpc.RpcError:
    return rpc_error(lambda: stub.Exec(iter([pb.ExecRequest(start=start)]), timeout=120))


@pytest.mark.parametrize("timeout", [-1.0, math.nan, math.inf, 604801.0])
def test_exec_timeouts_out_of_range_are_refused(stub: pb_grpc.SandboxStub, session: pb.Session,
                                                timeout: float) -> None:
    error = exec_error(stub, pb.ExecStart(session_id=session.id, argv=["true"], timeout_seconds=timeout))
    assert error.code() == INVALID and "timeout_seconds" in error.details(), error.details()
    ok = run_exec(stub, session.id, ["true"], timeout_seconds=604800.0)           # control: a week is allowed
    assert ok.result is not None and ok.result.exit_code == 0 and not ok.result.timed_out


def test_argv_and_env_beyond_the_kernels_limits_are_refused(stub: pb_grpc.SandboxStub, session: pb.Session) -> None:
    many = exec_error(stub, pb.ExecStart(session_id=session.id, argv=["true"] + ["x" * 300] * 10_000))
    assert many.code() == INVALID and "ARG_MAX" in many.details(), many.details()
    long_arg = exec_error(stub, pb.ExecStart(session_id=session.id, argv=["echo", "y" * (128 << 10)]))
    assert long_arg.code() == INVALID and "per argument" in long_arg.details(), long_arg.details()
    big_env = exec_error(stub, pb.ExecStart(session_id=session.id, argv=["true"], env={"BIG": "z" * (3 << 20)}))
    assert big_env.code() == INVALID and "per variable" in big_env.details(), big_env.details()
    nul_env = exec_error(stub, pb.ExecStart(session_id=session.id, argv=["true"], env={"A": "a\0b"}))
    assert nul_env.code() == INVALID and "NUL" in nul_env.details()
    # Control: just below the per-string limit runs.
    ok = run_exec(stub, session.id, ["sh", "-c", 'printf %s "$1" | wc -c', "sh", "y" * ((128 << 10) - 1)])
    assert ok.result is not None and ok.result.exit_code == 0 and ok.stdout.strip() == str((128 << 10) - 1).encode()


def test_nul_and_overlong_paths_are_refused(stub: pb_grpc.SandboxStub, ws: Path, session: pb.Session) -> None:
    error = rpc_error(lambda: stub.CreateSession(pb.CreateSessionRequest(workspace=f"{ws}\0x"), timeout=60))
    assert error.code() == INVALID and "workspace may not contain NUL" in error.details(), error.details()
    root = rpc_error(lambda: stub.CreateSession(pb.CreateSessionRequest(
        workspace=str(ws), sandbox_policy=workspace_write(writable_roots=["/tmp\0"])), timeout=60))
    assert root.code() == INVALID and "writable root" in root.details()
    long_path = rpc_error(lambda: stub.ReadFile(pb.ReadFileRequest(session_id=session.id, path="a/" * 3000),
                                                timeout=60))
    assert long_path.code() == INVALID and "PATH_MAX" not in long_path.details() and "4096" in long_path.details()
    cwd = exec_error(stub, pb.ExecStart(session_id=session.id, argv=["true"], cwd=f"{ws}/\0"))
    assert cwd.code() == INVALID and "cwd may not contain NUL" in cwd.details()


@pytest.mark.parametrize("limits, word", [
    (pb.Limits(memory_bytes=(1 << 64) - 1), "memory_bytes"), (pb.Limits(tmp_size_bytes=(1 << 64) - 1), "tmp_size"),
    (pb.Limits(pids=(1 << 32) - 1), "pids"), (pb.Limits(timeout_seconds=math.nan), "timeout_seconds"),
    (pb.Limits(open_files=(1 << 32) - 1), "open_files"), (pb.Limits(cpu_seconds=(1 << 32) - 1), "cpu_seconds")])
def test_limits_beyond_the_kernels_range_are_refused(stub: pb_grpc.SandboxStub, ws: Path, limits: pb.Limits,
                                                     word: str) -> None:
    error = rpc_error(lambda: create_session(stub, ws, workspace_write(), limits=limits))
    assert error.code() == INVALID and word in error.details() and "root" not in error.details(), error.details()


def test_the_policy_model_refuses_the_same_for_sandboxd_run() -> None:
    with pytest.raises(InvalidPolicy, match="above its maximum"):
        Limits(memory_bytes=1 << 64)
    with pytest.raises(InvalidPolicy, match="finite"):
        Limits(timeout_seconds=math.nan)
    with pytest.raises(InvalidPolicy, match="ARG_MAX"):
        LaunchSpec(argv=("true",) + ("x" * 300,) * 10_000, workspace="/tmp")
    with pytest.raises(InvalidPolicy, match=f"argv has 1000001 entries; the limit is {policy_limits.MAX_ARGV}"):
        LaunchSpec(argv=("true",) + ("x",) * 1_000_000, workspace="/tmp")
    with pytest.raises(InvalidPolicy, match=f"writable_roots has 5000 entries; the limit is "
                                            f"{policy_limits.MAX_WRITABLE_ROOTS}"):
        policy_from_name("workspace-write", writable_roots=[f"/tmp/{i}" for i in range(5000)])
    assert Limits(memory_bytes=1 << 53, pids=1 << 22).pids == 1 << 22           # control: the maxima themselves


def test_page_tokens_and_sequences_are_checked(stub: pb_grpc.SandboxStub, session: pb.Session) -> None:
    for token in ("9" * 5000, "-5", str(1 << 63), "12abc"):
        error = rpc_error(lambda: stub.QueryEvents(pb.QueryEventsRequest(page_token=token), timeout=60))
        assert error.code() == INVALID and "page_token" in error.details()
    nan = rpc_error(lambda: stub.QueryEvents(pb.QueryEventsRequest(since=math.nan), timeout=60))
    assert nan.code() == INVALID and "since" in nan.details()
    watch = rpc_error(lambda: stub.WatchEvents(pb.WatchEventsRequest(from_sequence=(1 << 64) - 1), timeout=60))
    assert watch.code() == INVALID and "from_sequence" in watch.details()
    run_exec(stub, session.id, ["true"])                                          # control: real tokens work
    page = stub.QueryEvents(pb.QueryEventsRequest(session_id=session.id, page_size=1), timeout=60)
    assert len(page.events) == 1 and page.next_page_token
    assert stub.QueryEvents(pb.QueryEventsRequest(session_id=session.id, page_token=page.next_page_token),
                            timeout=60).events


def test_only_regular_files_are_read_and_at_once(stub: pb_grpc.SandboxStub, ws: Path, session: pb.Session) -> None:
    os.mkfifo(ws / "fifo")
    fifo = rpc_error(lambda: stub.ReadFile(pb.ReadFileRequest(session_id=session.id, path="fifo"), timeout=30))
    assert fifo.code() == INVALID and "FIFO" in fifo.details(), fifo.details()
    zero = rpc_error(lambda: stub.ReadFile(pb.ReadFileRequest(session_id=session.id, path="/dev/zero",
                                                               max_bytes=1 << 62), timeout=30))
    assert zero.code() == INVALID and "character device" in zero.details(), zero.details()
    (ws / "f.txt").write_bytes(b"hello")
    assert stub.ReadFile(pb.ReadFileRequest(session_id=session.id, path="f.txt"), timeout=30).data == b"hello"


def test_read_file_answers_are_bounded_and_fit_clients(daemon: Daemon, stub: pb_grpc.SandboxStub, ws: Path,
                                                        session: pb.Session) -> None:
    (ws / "big").write_bytes(b"b" * (MAX_READ_LIMIT + 100))
    # A default gRPC client (4 MiB receive limit) gets the default answer.
    default = stub.ReadFile(pb.ReadFileRequest(session_id=session.id, path="big"), timeout=60)
    assert len(default.data) == DEFAULT_READ_LIMIT and default.truncated
    # A client asking for more than the daemon's maximum gets the maximum, truncated.
    with SandboxClient(daemon.socket) as client:
        huge = client.stub.ReadFile(pb.ReadFileRequest(session_id=session.id, path="big", max_bytes=1 << 62),
                                    timeout=60)
        assert len(huge.data) == MAX_READ_LIMIT and huge.truncated
        # The project's own client reads a 5 MiB file whole.
        (ws / "five").write_bytes(b"5" * (5 << 20))
        five = client.read_file(session.id, "five", max_bytes=5 << 20)
        assert len(five.data) == 5 << 20 and not five.truncated


def test_a_backtracking_pattern_ends_in_deadline_exceeded(stub: pb_grpc.SandboxStub, ws: Path,
                                                          session: pb.Session) -> None:
    (ws / "text").write_text("a" * 40 + "!\n")
    error = rpc_error(lambda: stub.Search(pb.SearchRequest(session_id=session.id, pattern="(a+)+$", engine="builtin"),
                                          timeout=120))
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "budget" in error.details(), error.details()
    found = stub.Search(pb.SearchRequest(session_id=session.id, pattern="a+!", engine="builtin"), timeout=60)
    assert [m.path.rsplit("/", 1)[-1] for m in found.matches] == ["text"]
    too_many = rpc_error(lambda: stub.Search(pb.SearchRequest(session_id=session.id, pattern="a",
                                                              max_results=(1 << 32) - 1), timeout=60))
    assert too_many.code() == INVALID and "max_results" in too_many.details()


def test_standing_rules_and_json_arguments_are_checked(stub: pb_grpc.SandboxStub, ws: Path,
                                                       session: pb.Session) -> None:
    rule = rpc_error(lambda: stub.AddStandingRule(pb.StandingRule(workspace=f"{ws}/\0", tool="browser.action"),
                                                  timeout=60))
    assert rule.code() == INVALID and "workspace may not contain NUL" in rule.details()
    listed = rpc_error(lambda: stub.ListStandingRules(pb.ListStandingRulesRequest(workspace="/\0"), timeout=60))
    assert listed.code() == INVALID
    nested = rpc_error(lambda: stub.Authorize(pb.AuthorizeRequest(session_id=session.id, tool="browser.action",
                                                                  arguments_json="[" * 100_000), timeout=60))
    assert nested.code() == INVALID and "nested too deeply" in nested.details(), nested.details()
    ok = stub.Authorize(pb.AuthorizeRequest(session_id=session.id, tool="browser.action", arguments_json="[[1]]"),
                        timeout=60)                                           # control: NEVER asks nobody
    assert ok.call_id


# Every list of a policy or a request, one entry past its limit (policy/limits.py): refused with
# INVALID_ARGUMENT naming the field and the limit, before anything is built.
_ISOLATED = {"network_access": True, "network_mode": "isolated"}
POLICY_LISTS = [
    ("writable_roots", policy_limits.MAX_WRITABLE_ROOTS, lambda n: {"writable_roots": [f"/tmp/r{i}" for i in range(n)]}),
    ("protected_subpaths", policy_limits.MAX_PROTECTED_SUBPATHS,
     lambda n: {"protected_subpaths": [f"p{i}" for i in range(n)], "no_default_protected_subpaths": True}),
    ("allowed_unix_sockets", policy_limits.MAX_ALLOWED_UNIX_SOCKETS,
     lambda n: {"allowed_unix_sockets": [f"/run/s{i}.sock" for i in range(n)]}),
    ("allowed_hosts", policy_limits.MAX_ALLOWED_HOSTS,
     lambda n: {**_ISOLATED, "allowed_hosts": [f"192.0.2.{i % 250}:{1000 + i}" for i in range(n)]}),
    ("allowed_domains", policy_limits.MAX_ALLOWED_DOMAINS,
     lambda n: {**_ISOLATED, "allowed_domains": [f"d{i}.example.org" for i in range(n)]}),
    ("published_ports", policy_limits.MAX_PUBLISHED_PORTS,
     lambda n: {**_ISOLATED, "published_ports": [f"{20000 + i}:{8000 + i}" for i in range(n)]}),
]


@pytest.mark.parametrize("field, limit, fields", POLICY_LISTS, ids=[case[0] for case in POLICY_LISTS])
def test_each_policy_list_past_its_limit_is_refused(stub: pb_grpc.SandboxStub, ws: Path, session: pb.Session,
                                                    field: str, limit: int, fields: Any) -> None:
    said = f"{field} has {limit + 1} entries; the limit is {limit}"
    created = rpc_error(lambda: create_session(stub, ws, workspace_write(**fields(limit + 1))))
    assert created.code() == INVALID and said in created.details(), created.details()
    updated = rpc_error(lambda: stub.UpdateSessionPolicy(pb.UpdateSessionPolicyRequest(
        session_id=session.id, sandbox_policy=workspace_write(**fields(limit + 1))), timeout=60))
    assert updated.code() == INVALID and said in updated.details(), updated.details()
    # Control: the session is untouched and still runs commands.
    assert stub.GetSession(pb.GetSessionRequest(session_id=session.id), timeout=60).sandbox_generation == 1
    assert run_exec(stub, session.id, ["true"]).result.exit_code == 0


@pytest.mark.parametrize("fields, said", [
    ({**_ISOLATED, "allowed_hosts": ["\u0668.8.8.8"]}, "Only decimal digits"),      # Arabic-Indic 8: int() takes it
    ({**_ISOLATED, "allowed_hosts": ["192.0.2.053:443"]}, "Leading zeros"),
    ({**_ISOLATED, "allowed_hosts": ["192.0.2.7:\u0664\u0664\u0663"]}, "ASCII digits"),
    ({**_ISOLATED, "published_ports": ["18000:\u0668\u0660"]}, "ASCII digits"),
], ids=["address-digits", "address-zeros", "port-digits", "publish-digits"])
def test_addresses_and_ports_in_other_digits_are_refused(stub: pb_grpc.SandboxStub, ws: Path, fields: Any,
                                                         said: str) -> None:
    """One reading of addresses and ports (policy/ipv4.py): what int() would take but nft and people
    read otherwise is refused with INVALID_ARGUMENT saying why (tests/test_ipv4_text.py: every form)."""
    error = rpc_error(lambda: create_session(stub, ws, workspace_write(**fields)))
    assert error.code() == INVALID and said in error.details(), error.details()


def test_five_thousand_writable_roots_are_refused_and_the_limit_itself_works(stub: pb_grpc.SandboxStub,
                                                                            ws: Path) -> None:
    roots = [ws / f"root-{i}" for i in range(5000)]
    for root in roots[:policy_limits.MAX_WRITABLE_ROOTS]:
        root.mkdir()
    error = rpc_error(lambda: create_session(stub, ws, workspace_write(writable_roots=[str(r) for r in roots])))
    assert error.code() == INVALID, error.details()
    assert f"writable_roots has 5000 entries; the limit is {policy_limits.MAX_WRITABLE_ROOTS}" in error.details()
    # Control: exactly the limit builds a sandbox, and the last root is writable in it.
    at_limit = [str(r) for r in roots[:policy_limits.MAX_WRITABLE_ROOTS]]
    s = create_session(stub, ws, workspace_write(writable_roots=at_limit))
    try:
        ok = run_exec(stub, s.id, ["sh", "-c", f"touch {at_limit[-1]}/written && echo ok"])
        assert ok.result.exit_code == 0 and ok.stdout == b"ok\n", ok
    finally:
        close_quietly(stub, s.id)


def test_all_the_lists_of_a_policy_are_bounded_in_bytes_together(stub: pb_grpc.SandboxStub, ws: Path) -> None:
    long_roots = [f"/tmp/{'r' * 250}/{'s' * 40}{i}" for i in range(policy_limits.MAX_WRITABLE_ROOTS)]
    error = rpc_error(lambda: create_session(stub, ws, workspace_write(writable_roots=long_roots)))
    assert error.code() == INVALID, error.details()
    assert f"the limit is {policy_limits.MAX_POLICY_LIST_BYTES}" in error.details() and "bytes" in error.details()


def test_labels_past_their_limits_are_refused(stub: pb_grpc.SandboxStub, ws: Path) -> None:
    limit = policy_limits.MAX_LABELS
    many = rpc_error(lambda: create_session(stub, ws, workspace_write(),
                                            labels={f"k{i}": "v" for i in range(limit + 1)}))
    assert many.code() == INVALID and f"labels has {limit + 1} entries; the limit is {limit}" in many.details()
    long_key = rpc_error(lambda: create_session(stub, ws, workspace_write(),
                                                labels={"k" * (policy_limits.MAX_LABEL_KEY + 1): "v"}))
    assert long_key.code() == INVALID and "label key" in long_key.details(), long_key.details()
    long_value = rpc_error(lambda: create_session(stub, ws, workspace_write(),
                                                  labels={"k": "v" * (policy_limits.MAX_LABEL_VALUE + 1)}))
    assert long_value.code() == INVALID and "value of label 'k'" in long_value.details(), long_value.details()
    # Control: exactly the limit is kept and given back.
    labels = {f"k{i}": "v" * policy_limits.MAX_LABEL_VALUE for i in range(limit)}
    s = create_session(stub, ws, workspace_write(), labels=labels)
    try:
        assert dict(stub.GetSession(pb.GetSessionRequest(session_id=s.id), timeout=60).labels) == labels
    finally:
        close_quietly(stub, s.id)


def test_argv_and_env_past_their_counts_are_refused(stub: pb_grpc.SandboxStub, session: pb.Session) -> None:
    argv_limit, env_limit = policy_limits.MAX_ARGV, policy_limits.MAX_ENV_ENTRIES
    argv = exec_error(stub, pb.ExecStart(session_id=session.id, argv=["true"] * (argv_limit + 1)))
    assert argv.code() == INVALID and f"argv has {argv_limit + 1} entries; the limit is {argv_limit}" in argv.details()
    env = exec_error(stub, pb.ExecStart(session_id=session.id, argv=["true"],
                                        env={f"V{i}": "" for i in range(env_limit + 1)}))
    assert env.code() == INVALID and f"env has {env_limit + 1} entries; the limit is {env_limit}" in env.details()
    value = "z" * (100 << 10)
    big = exec_error(stub, pb.ExecStart(session_id=session.id, argv=["true"], env={"V1": value, "V2": value}))
    assert big.code() == INVALID and f"the limit is {policy_limits.MAX_ENV_BYTES}" in big.details(), big.details()
    background = rpc_error(lambda: stub.StartBackground(pb.StartBackgroundRequest(
        session_id=session.id, argv=["true"], env={f"V{i}": "" for i in range(env_limit + 1)}), timeout=60))
    assert background.code() == INVALID and "env has" in background.details(), background.details()
    # Control: exactly the limits run (the counts reach the command).
    env_at_limit = {"PATH": "/usr/bin:/bin", **{f"V{i}": "" for i in range(env_limit - 1)}}
    ok = run_exec(stub, session.id, ["sh", "-c", 'echo $#; env | grep -c "^V"', "sh", *["a"] * (argv_limit - 4)],
                  env=env_at_limit)
    assert ok.result.exit_code == 0, ok
    assert ok.stdout.split() == [str(argv_limit - 4).encode(), str(env_limit - 1).encode()], ok.stdout[:200]


def _bad_utf8(message: Any, field: str) -> bytes:
    """``message`` as sent, its string ``field`` (set to "xAx") holding the byte 0xff instead of "A"."""
    setattr(message, field, "xAx")
    data = message.SerializeToString()
    assert data.count(b"xAx") == 1
    return data.replace(b"xAx", b"x\xffx")


def test_a_string_that_is_not_utf8_is_invalid_argument_saying_so(daemon: Daemon) -> None:  # noqa: F811
    """proto3 strings must be UTF-8: a raw client's bytes there were `INTERNAL: Exception deserializing
    request!` (gRPC's words, before any code of ours). Now INVALID_ARGUMENT saying what to fix, for a
    unary request, a unary request with a stream answer, and the first message of a request stream.
    Control: the same requests with the byte a letter decode (and reach the servicer: its NOT_FOUND)."""
    said = "a string field is not valid UTF-8"
    with SandboxClient(daemon.socket) as client:
        channel = client.channel

        def unary(method: str, data: bytes) -> grpc.RpcError:
            call = channel.unary_unary(f"/sandboxd.v1.Sandbox/{method}")
            return rpc_error(lambda: call(data, timeout=60))

        def unary_stream(method: str, data: bytes) -> grpc.RpcError:
            call = channel.unary_stream(f"/sandboxd.v1.Sandbox/{method}")
            return rpc_error(lambda: list(call(data, timeout=60)))

        def stream_stream(method: str, data: bytes) -> grpc.RpcError:
            call = channel.stream_stream(f"/sandboxd.v1.Sandbox/{method}")
            return rpc_error(lambda: list(call(iter([data]), timeout=60)))

        cases = [(unary, "ReadFile", _bad_utf8(pb.ReadFileRequest(path="f"), "session_id")),
                 (unary, "GetSession", _bad_utf8(pb.GetSessionRequest(), "session_id")),
                 (unary_stream, "Run", _bad_utf8(pb.ExecStart(argv=["true"]), "session_id"))]
        for call, method, data in cases:
            error = call(method, data)
            assert (error.code(), error.details().split(":")[0]) == (INVALID, said), (method, error)
            control = call(method, data.replace(b"x\xffx", b"xAx"))
            assert control.code() == grpc.StatusCode.NOT_FOUND, (method, control)
        exec_start = pb.ExecRequest(start=pb.ExecStart(session_id="xAx", argv=["true"])).SerializeToString()
        error = stream_stream("Exec", exec_start.replace(b"xAx", b"x\xffx"))
        assert (error.code(), error.details().split(":")[0]) == (INVALID, said), error
        assert stream_stream("Exec", exec_start).code() == grpc.StatusCode.NOT_FOUND
        corrupt = unary("ReadFile", b"\xff\xff\xff")
        assert corrupt.code() == INVALID and "not a valid message" in corrupt.details(), corrupt


INTERCEPTOR_CONTROL = r"""
import json, sys
from concurrent import futures
import grpc
from sandboxd.service.request_decoding import DecodingInterceptor
from sandboxd.v1 import sandboxd_pb2 as pb
from sandboxd.v1 import sandboxd_pb2_grpc as pb_grpc

socket_path, intercepted, bad = sys.argv[1], sys.argv[2] == "1", bytes.fromhex(sys.argv[3])

class Servicer(pb_grpc.SandboxServicer):
    def GetSession(self, request, context):
        return pb.Session(id=request.session_id)

with futures.ThreadPoolExecutor(2) as workers:
    server = grpc.server(workers, interceptors=[DecodingInterceptor()] if intercepted else [])
    pb_grpc.add_SandboxServicer_to_server(Servicer(), server)
    server.add_insecure_port(f"unix:{socket_path}")
    server.start()
    try:
        with grpc.insecure_channel(f"unix:{socket_path}") as channel:
            call = channel.unary_unary("/sandboxd.v1.Sandbox/GetSession", response_deserializer=pb.Session.FromString)
            ok = call(pb.GetSessionRequest(session_id="ok").SerializeToString(), timeout=60).id
            try:
                call(bad, timeout=60)
                answer = ["OK", ""]
            except grpc.RpcError as error:
                answer = [error.code().name, error.details()]
    finally:
        server.stop(None).wait()
print(json.dumps({"ok": ok, "code": answer[0], "details": answer[1]}))
"""


@pytest.mark.parametrize("intercepted", [True, False])
def test_the_interceptor_is_what_answers_invalid_argument(tmp_path: Path, intercepted: bool) -> None:
    """The control of the test above: a gRPC server of the same service without DecodingInterceptor
    answers the same bad string INTERNAL (gRPC's own words), before its method runs. In a process of
    its own: a gRPC server's threads left in pytest's process make a later in-process fork abort
    (test_call_cgroups' Spawner)."""
    import json
    import subprocess
    import sys

    bad = _bad_utf8(pb.GetSessionRequest(), "session_id")
    done = subprocess.run([sys.executable, "-c", INTERCEPTOR_CONTROL, str(tmp_path / "s.sock"),
                           "1" if intercepted else "0", bad.hex()], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    assert answer["ok"] == "ok", answer
    if intercepted:
        assert answer["code"] == "INVALID_ARGUMENT" and "not valid UTF-8" in answer["details"], answer
    else:
        assert (answer["code"], answer["details"]) == ("INTERNAL", "Exception deserializing request!"), answer
