"""The optional TCP listener: TLS with client certificates only. Certificates are made here with
openssl; traffic stays on 127.0.0.1."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import grpc
import pytest

from daemon_helpers import DaemonFactory, TlsListener
from sandboxd.client import sandbox_policy
from sandboxd.v1 import sandboxd_pb2 as pb
from sandboxd.v1 import sandboxd_pb2_grpc as pb_grpc


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_pki(d: Path) -> None:
    """A CA, a server certificate for 127.0.0.1, client certificates for alice and bob, and a stranger's."""
    for ca in ("ca", "other-ca"):
        openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{ca}.key", "-out", f"{ca}.pem",
                "-days", "2", "-subj", f"/CN={ca}", cwd=d)
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    for name, ca, ext in (("server", "ca", ["-extfile", "san.ext"]), ("alice", "ca", []), ("bob", "ca", []),
                          ("mallory", "other-ca", [])):
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                "-subj", f"/CN={name}", cwd=d)
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
                "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", *ext, cwd=d)


@pytest.fixture(scope="module")
def tls_daemon(sandboxd_daemon_module: DaemonFactory) -> tuple[Path, str]:
    base = sandboxd_daemon_module.base
    make_pki(base)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    address = f"127.0.0.1:{port}"
    sandboxd_daemon_module(tls=TlsListener(address, base / "server.pem", base / "server.key", base / "ca.pem",
                                           tcp_user="65534:65534"))
    return base, address


def stub_for(base: Path, address: str, who: str | None) -> pb_grpc.SandboxStub:
    key = (base / f"{who}.key").read_bytes() if who else None
    cert = (base / f"{who}.pem").read_bytes() if who else None
    credentials = grpc.ssl_channel_credentials(root_certificates=(base / "ca.pem").read_bytes(),
                                               private_key=key, certificate_chain=cert)
    return pb_grpc.SandboxStub(grpc.secure_channel(address, credentials))


def test_certificate_holders_get_their_own_sessions_as_the_tcp_user(tls_daemon: tuple[Path, str]) -> None:
    base, address = tls_daemon
    workspace = base / "alice-ws"
    workspace.mkdir()
    os.chmod(workspace, 0o777)
    alice, bob = stub_for(base, address, "alice"), stub_for(base, address, "bob")
    session = alice.CreateSession(pb.CreateSessionRequest(workspace=str(workspace)))
    assert session.owner_uid == 65534
    run = list(alice.Exec(iter([pb.ExecRequest(start=pb.ExecStart(session_id=session.id, argv=["id", "-u"]))])))
    assert b"".join(r.stdout for r in run) == b"65534\n"
    assert [s.id for s in alice.ListSessions(pb.ListSessionsRequest()).sessions] == [session.id]
    assert list(bob.ListSessions(pb.ListSessionsRequest()).sessions) == []          # same uid, other certificate
    with pytest.raises(grpc.RpcError) as info:
        bob.GetSession(pb.GetSessionRequest(session_id=session.id))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_tcp_user_reach_and_danger_are_enforced(tls_daemon: tuple[Path, str]) -> None:
    base, address = tls_daemon
    root_owned = base / "root-only"
    root_owned.mkdir()
    alice = stub_for(base, address, "alice")
    for policy in (sandbox_policy(), sandbox_policy("danger-full-access")):
        with pytest.raises(grpc.RpcError) as info:
            alice.CreateSession(pb.CreateSessionRequest(workspace=str(root_owned), sandbox_policy=policy))
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED


@pytest.mark.parametrize("who", [None, "mallory"])
def test_no_certificate_or_a_foreign_one_is_refused(tls_daemon: tuple[Path, str], who: str | None) -> None:
    base, address = tls_daemon
    with pytest.raises(grpc.RpcError) as info:
        stub_for(base, address, who).ListSessions(pb.ListSessionsRequest(), timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_tcp_without_tls_is_refused_at_start(sandboxd_daemon: DaemonFactory) -> None:
    result = sandboxd_daemon.start_failure(args=["--socket", "/nonexistent/x.sock", "--tcp", "127.0.0.1:1"],
                                           within=30)
    assert result.returncode == 2 and "needs all of --tcp" in result.log


def test_principals_sharing_a_user_are_kept_apart_by_the_paths_their_sandboxes_were_built_with(
        tls_daemon: tuple[Path, str]) -> None:
    """alice and bob act as one local user (the TCP user): bob may not use a directory overlapping
    alice's open session, also when he names it through a symlink of his own. Judged on what the fork
    server built (the real paths its lookup found as the owner), after the build and before bob can
    use it; the sandbox built for him is closed again. Control: a directory of his own is his."""
    base, address = tls_daemon
    theirs, own = base / "kept-apart-alice", base / "kept-apart-bob"
    for path in (theirs, own):
        path.mkdir()
        os.chmod(path, 0o777)
    (theirs / "sub").mkdir()
    os.chmod(theirs / "sub", 0o777)
    (base / "kept-apart-link").symlink_to(theirs / "sub")
    alice, bob = stub_for(base, address, "alice"), stub_for(base, address, "bob")
    session = alice.CreateSession(pb.CreateSessionRequest(workspace=str(theirs)))
    try:
        for workspace, roots in ((str(base / "kept-apart-link"), []), (str(own), [str(base / "kept-apart-link")])):
            with pytest.raises(grpc.RpcError) as refused:
                bob.CreateSession(pb.CreateSessionRequest(workspace=workspace, sandbox_policy=sandbox_policy(
                    "workspace-write", writable_roots=roots)))
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED, refused.value.details()
            assert f"overlaps {str(theirs)!r}" in (refused.value.details() or ""), refused.value.details()
        assert list(bob.ListSessions(pb.ListSessionsRequest()).sessions) == []
        mine = bob.CreateSession(pb.CreateSessionRequest(workspace=str(own)))           # the control
        bob.CloseSession(pb.CloseSessionRequest(session_id=mine.id))
    finally:
        alice.CloseSession(pb.CloseSessionRequest(session_id=session.id))
