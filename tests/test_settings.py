"""The daemon's settings (config.load -> DaemonSettings) and the Daemon built from them (service.daemon).

Precedence: the file, then the environment, then the flags, each winning over the one before.
Every bad value stops the start with where it came from, its key and what to fix, checked once.
A Daemon built in this process serves a call and stops leaving no thread, descriptor or process.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from pathlib import Path

import grpc
import pytest

from daemon_helpers import create_session, descendants, read_only, run_exec, socket_in
from sandboxd import config
from sandboxd.v1 import sandboxd_pb2 as pb
from sandboxd.v1 import sandboxd_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(180)


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "sandboxd.toml"
    path.write_text(text)
    return str(path)


# -- precedence ---------------------------------------------------------------------------------


FILE = '[listen]\nworkers = 200\nadmin_group = "0"\n[approvals]\ntimeout_seconds = 30\n[log]\nlevel = "debug"\n'


def test_the_file_overrides_the_defaults(tmp_path: Path) -> None:
    settings = config.load(write(tmp_path, FILE), environ={})
    assert (settings.workers, settings.admin_gid, settings.approval_timeout, settings.log_level) == (200, 0, 30, "debug")
    assert settings.quotas.workers == 200 and settings.config_path == str(tmp_path / "sandboxd.toml")
    # control: the built-in defaults, where nothing sets them
    bare = config.load(None, environ={})
    assert (bare.workers, bare.admin_gid, bare.approval_timeout, bare.log_level) == (128, None, 300, "info")
    assert bare.config_path is None


def test_the_environment_overrides_the_file_and_flags_override_both(tmp_path: Path) -> None:
    path = write(tmp_path, FILE)
    environ = {"SANDBOXD_LISTEN_WORKERS": "300", "SANDBOXD_APPROVALS_TIMEOUT_SECONDS": "40",
               "SANDBOXD_LOG_LEVEL": "warning", "SANDBOXD_NETWORK_DNS": '["192.0.2.53"]'}
    from_env = config.load(path, environ=environ)
    assert (from_env.workers, from_env.approval_timeout, from_env.log_level, from_env.dns) == \
        (300, 40, "warning", ("192.0.2.53",))
    assert from_env.admin_gid == 0                                    # what the environment leaves: the file's
    flagged = config.load(path, environ=environ, flags={"listen.workers": 400, "approvals.timeout_seconds": 50.0,
                                                        "network.dns": ["192.0.2.54"]})
    assert (flagged.workers, flagged.approval_timeout, flagged.dns) == (400, 50, ("192.0.2.54",))
    assert flagged.log_level == "warning" and flagged.quotas.workers == 400


def test_the_file_comes_from_the_environment_unless_given(tmp_path: Path) -> None:
    named = write(tmp_path, FILE)
    assert config.load(None, environ={"SANDBOXD_CONFIG": named}).workers == 200
    other = tmp_path / "other.toml"
    other.write_text("[listen]\nworkers = 256\n")
    assert config.load(str(other), environ={"SANDBOXD_CONFIG": named}).workers == 256    # --config wins


def test_serve_flags_map_to_their_keys() -> None:
    from sandboxd.cli.serve import flag_values, parser

    args = parser().parse_args(["--workers", "8", "--dns", "192.0.2.1", "--dns", "192.0.2.2", "--tcp-user", "nobody"])
    assert flag_values(args) == {"listen.workers": 8, "network.dns": ["192.0.2.1", "192.0.2.2"], "tls.user": "nobody"}
    assert flag_values(parser().parse_args([])) == {}
    assert flag_values(parser().parse_args(["--upstream-proxy", "http://p:3128", "--upstream-ca-file", "/c.pem"])) == \
        {"network.upstream_proxy": "http://p:3128", "network.upstream_ca_file": "/c.pem"}
    assert set(config.FLAGS) <= {key.dotted for key in config.KEYS}


# -- one check per bad value, naming its source, its key and the fix ------------------------------


@pytest.mark.parametrize("environ, flags, message", [
    ({"SANDBOXD_LISTEN_WORKERS": "0"}, {}, "$SANDBOXD_LISTEN_WORKERS: listen.workers: must be a whole number from 1"),
    ({"SANDBOXD_LISTEN_WORKERS": "many"}, {}, "$SANDBOXD_LISTEN_WORKERS: listen.workers: 'many' is not a TOML value"),
    ({}, {"approvals.timeout_seconds": 0.0}, "--approval-timeout: approvals.timeout_seconds: must be a positive number"),
    ({}, {"network.dns": ["192.0.2.1", "8.8.8"]}, "--dns: network.dns: '8.8.8' is not an IPv4 address"),
    ({}, {"network.dns": ["1.2.3.\u0664"]}, "--dns: network.dns: '1.2.3.\u0664' is not an IPv4 address"),
    ({}, {"listen.socket": "relative.sock"}, "--socket: listen.socket: must be an absolute path"),
    ({"SANDBOXD_LISTEN_ADMIN_GROUP": "no-such-group-here"}, {},
     "listen.admin_group: no group 'no-such-group-here' on this machine: name an existing group"),
    ({}, {"tls.address": "127.0.0.1:1"}, "tls: a TCP listener needs all of --tcp, --tls-cert, --tls-key"),
    ({"SANDBOXD_TLS_ADDRESS": "127.0.0.1:1"}, {}, "tls: a TCP listener needs all of address, cert, key and client_ca"),
    ({}, {"listen.workers": 8}, "quotas: 4 users at their quotas"),
    ({}, {"network.upstream_proxy": "https://proxy.corp:3128"}, "--upstream-proxy: network.upstream_proxy: must be "
                                                               "http://HOST:PORT"),
    ({}, {"network.upstream_proxy": "http://user:pw@proxy.corp:3128"}, "must be http://HOST:PORT (no user"),
    ({}, {"network.upstream_proxy": "http://proxy.corp"}, "must be http://HOST:PORT"),
    ({}, {"network.upstream_ca_file": "corp.pem"}, "--upstream-ca-file: network.upstream_ca_file: must be an absolute"),
    ({"SANDBOXD_NETWORK_ALLOWED_RANGES": '["169.254.0.0/16"]'}, {},
     "network.allowed_ranges: '169.254.0.0/16' holds the cloud metadata address 169.254.169.254"),
    ({"SANDBOXD_NETWORK_ALLOWED_RANGES": '["100.64.0.0/10"]'}, {}, "the cloud metadata address 100.100.100.200"),
    ({"SANDBOXD_NETWORK_ALLOWED_RANGES": '["0.0.0.0/0"]'}, {}, "holds loopback"),
    ({"SANDBOXD_NETWORK_ALLOWED_RANGES": '["fd00::/8"]'}, {}, "is not an IPv4 network"),
    ({"SANDBOXD_NETWORK_SECRETS": '{ GitHub = { file = "/s", upstreams = ["https://a"] } }'}, {}, "network.secrets: daemon secret 'GitHub'"),
    ({"SANDBOXD_NETWORK_SECRETS": '{ gh = { file = "s", upstreams = ["https://a"] } }'}, {}, "gh: file must be an absolute path"),
    ({"SANDBOXD_NETWORK_SECRETS": '{ gh = { file = "/s", owners = [], upstreams = ["https://a"] } }'}, {}, "gh: must be { file = ..."),
    ({"SANDBOXD_NETWORK_SECRETS": '{ gh = { file = "/s" } }'}, {}, "gh: upstreams must list the only https://HOST"),
    ({"SANDBOXD_NETWORK_SECRETS": '{ gh = { file = "/s", upstreams = [] } }'}, {}, "a daemon secret is bound to its"),
    ({"SANDBOXD_NETWORK_SECRETS": '{ gh = { file = "/s", upstreams = ["http://a.example"] } }'}, {},
     "gh: 'X=http://a.example': the upstream must be https://HOST[:PORT]"),
    ({"SANDBOXD_NETWORK_SECRETS": '{ gh = { file = "/s", upstreams = ["https://a.example"], inject = "Host: {}" } }'},
     {}, "gh: 'X=https://localhost;Host: {}': header 'Host' frames the message"),
    ({"SANDBOXD_NETWORK_SECRETS": '{ gh = { file = "/s", upstreams = ["https://a"], users = ["no-such-user-here"] } }'}, {},
     "network.secrets: unknown user or group in network.secrets.gh.users"),
    ({"SANDBOXD_NETWORK_SECRETS": '{ gh = { file = "/s", upstreams = ["https://a"], groups = ["no-such-group-here"] } }'},
     {},
     "network.secrets: gh: no group"),
    ({"SANDBOXD_QUOTAS_NETWORK_QUESTIONS_PER_SESSION": "0"}, {}, "must be a whole number from 1 to 1024"),
])
def test_a_bad_value_is_refused_with_its_source_and_key(environ: dict[str, str], flags: dict[str, object],
                                                         message: str) -> None:
    with pytest.raises(config.ConfigError) as refused:
        config.load(None, environ=environ, flags=flags)
    assert message in str(refused.value), str(refused.value)


def test_the_tls_files_and_users_are_checked_at_load(tmp_path: Path) -> None:
    pem = {name: tmp_path / f"{name}.pem" for name in ("cert", "key", "ca")}
    for name, path in pem.items():
        path.write_text(f"-----{name}-----\n")
    flags: dict[str, object] = {"tls.address": "127.0.0.1:8443", "tls.cert": str(pem["cert"]),
                                "tls.key": str(pem["key"]), "tls.client_ca": str(pem["ca"])}
    tls = config.load(None, environ={}, flags=flags).tls
    assert tls is not None and (tls.port, tls.cert, tls.key, tls.client_ca) == \
        (8443, b"-----cert-----\n", b"-----key-----\n", b"-----ca-----\n")
    assert (tls.uid, tls.gid) == (65534, 65534)                       # tls.user's default: nobody
    for changed, message in (({"tls.key": str(tmp_path / "gone.pem")}, "--tls-key: tls.key: cannot read"),
                             ({"tls.user": "no-such-user-here"}, "--tcp-user: tls.user: unknown user or group"),
                             ({"tls.address": "127.0.0.1:http"}, "--tcp: tls.address: '127.0.0.1:http' must be "
                                                                  "HOST:PORT")):
        with pytest.raises(config.ConfigError, match=message):
            config.load(None, environ={}, flags={**flags, **changed})


def test_the_network_keys_come_typed() -> None:
    """Issue 26's keys: defaults, then each set, as DaemonSettings holds them."""
    plain = config.load(None, environ={})
    assert (plain.upstream_proxy, plain.upstream_ca_pem, plain.allowed_ranges, dict(plain.secrets),
            plain.network_questions, plain.intercepted_connections) == (None, b"", (), {}, 16, 64)
    given = config.load(None, environ={
        "SANDBOXD_NETWORK_ALLOWED_RANGES": '["10.1.0.0/16"]',
        "SANDBOXD_NETWORK_SECRETS": '{ github = { file = "/etc/sandboxd/secrets/github", users = ["root", "65534"], '
                                    'groups = ["0"], upstreams = ["https://API.github.com", "https://g.example:8443"], '
                                    'inject = "x-api-key: token {}" } }',
        "SANDBOXD_QUOTAS_INTERCEPTED_CONNECTIONS_PER_SESSION": "8"}, flags={"network.upstream_proxy": "http://Proxy.Corp:3128"})
    assert given.upstream_proxy == ("proxy.corp", 3128) and given.allowed_ranges == ("10.1.0.0/16",)
    assert given.intercepted_connections == 8
    secret = given.secrets["github"]
    assert (secret.file, secret.uids, secret.gids) == ("/etc/sandboxd/secrets/github", (0, 65534), (0,))
    assert secret.upstreams == (("api.github.com", 443), ("g.example", 8443))
    assert secret.inject == ("x-api-key", "token {}", None)


def test_the_upstream_ca_file_must_be_roots_and_pem(tmp_path: Path) -> None:
    pem = tmp_path / "corp.pem"
    pem.write_text("-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n")
    pem.chmod(0o644)
    os.chown(pem, 0, 0)
    assert config.load(None, environ={}, flags={"network.upstream_ca_file": str(pem)}).upstream_ca_pem == \
        pem.read_bytes()                                                     # the control
    problems = []
    for change, says in ((lambda: pem.chmod(0o666), "not group or other writable"),
                         (lambda: os.chown(pem, 65534, 0), "owned by root"),
                         (lambda: pem.write_text("-----BEGIN PRIVATE KEY-----\nx\n-----END PRIVATE KEY-----\n"),
                          "PEM certificates only"),
                         (lambda: pem.write_text(""), "holds no certificate")):
        pem.write_text("-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n")
        pem.chmod(0o644)
        os.chown(pem, 0, 0)
        change()
        with pytest.raises(config.ConfigError, match=says) as refused:
            config.load(None, environ={}, flags={"network.upstream_ca_file": str(pem)})
        problems.append(str(refused.value))
    link = tmp_path / "link.pem"
    link.symlink_to(pem)
    with pytest.raises(config.ConfigError, match="not a symlink"):
        config.load(None, environ={}, flags={"network.upstream_ca_file": str(link)})
    assert all("--upstream-ca-file: network.upstream_ca_file" in problem for problem in problems)


def test_settings_are_frozen() -> None:
    settings = config.load(None, environ={})
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.workers = 1                                       # type: ignore[misc]
    with pytest.raises((AttributeError, TypeError)):
        settings.extra = 1                                         # type: ignore[attr-defined]  # slots: no new ones
    assert not hasattr(settings, "__dict__")


# -- the Daemon, in this process ----------------------------------------------------------------


def threads() -> set[str]:
    return {f"{t.name}:{t.ident}" for t in threading.enumerate()}


def descriptors() -> dict[int, str]:
    found = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            found[int(fd)] = os.readlink(f"/proc/self/fd/{fd}")
        except FileNotFoundError:                # the listing's own descriptor
            pass
    return found


def test_a_daemon_serves_a_call_and_stops_leaving_nothing(base_dir: Path, workspace: Path) -> None:
    from sandboxd.service.daemon import Daemon

    socket = socket_in(base_dir)
    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        metrics = f"127.0.0.1:{s.getsockname()[1]}"
    settings = config.load(None, environ={}, flags={"listen.socket": str(socket), "metrics.listen": metrics,
                                                    "state.dir": str(base_dir / "state"),
                                                    "approvals.timeout_seconds": 20.0})
    threads_before, fds_before, children_before = threads(), descriptors(), descendants(os.getpid())
    daemon = Daemon(settings)
    assert daemon.start() is None
    serving = threading.Thread(target=daemon.serve, name="test-serve")
    serving.start()
    children = descendants(os.getpid())
    assert set(children) - set(children_before), "no fork server was started"
    try:
        with grpc.insecure_channel(f"unix:{socket}") as channel:
            stub = pb_grpc.SandboxStub(channel)
            session = create_session(stub, workspace, read_only())
            assert run_exec(stub, session.id, ["echo", "served"]).stdout == b"served\n"
            status = stub.GetStatus(pb.GetStatusRequest(), timeout=60)
            assert status.sessions == 1 and status.quota_usage["connections"] >= 1
        import urllib.request
        scraped = urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10).read().decode()
        assert "\nsandboxd_sessions 1.0\n" in scraped, scraped[-2000:]
    finally:
        daemon.request_stop()
        serving.join(60)
        daemon.stop()
        daemon.close()
    assert not serving.is_alive()
    assert threads() == threads_before, threads() ^ threads_before
    # Nothing new is open (gRPC may have closed its process-wide poller, once no channel was left).
    assert set(descriptors().items()) <= set(fds_before.items()), set(descriptors().items()) - set(fds_before.items())
    left = {pid: info for pid, info in descendants(os.getpid()).items() if pid not in children_before}
    assert left == {}, left
    assert not socket.exists() and os.listdir(socket.parent / ".sandboxd-private") in ([], ["relay"])
