"""`sandboxd serve`: the daemon, in the foreground, logging to stderr (JSON lines by default).

Settings come from the configuration file (sandboxd.config: --config, $SANDBOXD_CONFIG, or
/etc/sandboxd/sandboxd.toml), and a command-line flag wins over the file.
"""

from __future__ import annotations

import argparse
import errno
import grp
import sys

from sandboxd.errors import SandboxdError

TYPE_CHECKING = False
if TYPE_CHECKING:
    from sandboxd.config import Config

# flag destination -> configuration key
FLAG_KEYS = {"socket": "listen.socket", "admin_group": "listen.admin_group", "workers": "listen.workers",
             "state_dir": "state.dir", "dns": "network.dns", "approval_timeout": "approvals.timeout_seconds",
             "tcp": "tls.address", "tls_cert": "tls.cert", "tls_key": "tls.key", "tls_client_ca": "tls.client_ca",
             "tcp_user": "tls.user", "log_format": "log.format", "log_level": "log.level",
             "metrics": "metrics.listen"}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sandboxd serve", description=(
        "Run the sandboxd daemon: one persistent kernel sandbox per session, driven over gRPC "
        "(service sandboxd.v1.Sandbox, plus grpc.health.v1 and server reflection) on a Unix socket. "
        "Every local user may connect; each sees and uses only the sessions it created "
        "(the kernel tells the daemon who is calling), except root and the admin group. "
        "Defaults come from the configuration file (see `sandboxd config defaults`); flags win over it."))
    p.add_argument("--config", metavar="FILE", help="the configuration file (default: $SANDBOXD_CONFIG, else "
                   "/etc/sandboxd/sandboxd.toml if it exists)")
    p.add_argument("--socket", help="the Unix socket to listen on [listen.socket]")
    p.add_argument("--admin-group", metavar="GROUP", help="members may see and use every session [listen.admin_group]")
    p.add_argument("--workers", type=int, help="concurrent RPCs [listen.workers]")
    p.add_argument("--state-dir", help="the event store (audit log) and session metadata [state.dir]")
    p.add_argument("--dns", action="append", metavar="IP",
                   help="a resolver for isolated-network sessions (repeatable) [network.dns]")
    p.add_argument("--approval-timeout", type=float, metavar="SECONDS",
                   help="a call nobody approves within this is denied [approvals.timeout_seconds]")
    p.add_argument("--log-format", choices=["json", "text"], help="[log.format]")
    p.add_argument("--log-level", choices=["debug", "info", "warning"], help="[log.level]")
    p.add_argument("--metrics", metavar="HOST:PORT", help="serve Prometheus metrics here [metrics.listen]")
    tls = p.add_argument_group("optional TCP listener (TLS with client certificates only)")
    tls.add_argument("--tcp", metavar="HOST:PORT", help="also listen here, with TLS [tls.address]")
    tls.add_argument("--tls-cert", metavar="FILE", help="the server's certificate chain (PEM) [tls.cert]")
    tls.add_argument("--tls-key", metavar="FILE", help="the server's private key (PEM) [tls.key]")
    tls.add_argument("--tls-client-ca", metavar="FILE", help="CA that client certificates must be signed by [tls.client_ca]")
    tls.add_argument("--tcp-user", metavar="USER[:GROUP]", help="the local user TLS callers act as [tls.user]")
    return p


def settings(argv: list[str]) -> "Config":
    """The configuration file's values, overridden by the flags given; ConfigError on a bad file."""
    from sandboxd import config

    args = parser().parse_args(argv)
    loaded = config.load(args.config or config.default_path())
    values = dict(loaded.values)
    for flag, key in FLAG_KEYS.items():
        given = getattr(args, flag)
        if given is not None:
            values[key] = given
    return loaded.replace(values=values)


def main(argv: list[str]) -> int:
    try:
        loaded = settings(argv)
    except SandboxdError as exc:
        sys.stderr.write(f"sandboxd serve: {exc}\n")
        return 2
    listener = None
    tcp = loaded.text("tls.address")
    tls_options = (loaded.text("tls.cert"), loaded.text("tls.key"), loaded.text("tls.client_ca"))
    if tcp or any(tls_options):
        if not (tcp and all(tls_options)):
            sys.stderr.write("sandboxd serve: a TCP listener needs all of --tcp, --tls-cert, --tls-key and "
                             "--tls-client-ca (there is no plain-text or unauthenticated TCP)\n")
            return 2
        from sandboxd.cli.run import parse_user
        from sandboxd.errors import InvalidPolicy
        from sandboxd.service.server import TlsListener
        try:
            uid, gid = parse_user(loaded.text("tls.user"))
            users = {name: parse_user(user) for name, user in loaded.table("tls.users").items()}
            listener = TlsListener(tcp, *tls_options, uid, gid, identity=loaded.text("tls.identity"), users=users)
        except (InvalidPolicy, OSError) as exc:
            sys.stderr.write(f"sandboxd serve: {exc}\n")
            return 2
    admin_gid = None
    group = loaded.text("listen.admin_group")
    if group:
        try:
            admin_gid = int(group) if group.isdigit() else grp.getgrnam(group).gr_gid
        except KeyError:
            sys.stderr.write(f"sandboxd serve: unknown group {group!r}\n")
            return 2
    approval_timeout = loaded.number("approvals.timeout_seconds")
    if approval_timeout <= 0:
        sys.stderr.write("sandboxd serve: --approval-timeout must be a positive number of seconds\n")
        return 2
    dns = loaded.texts("network.dns")
    try:
        from sandboxd.policy import LaunchSpec
        LaunchSpec(argv=("true",), workspace="/", dns=dns)   # validates the addresses
    except SandboxdError as exc:
        sys.stderr.write(f"sandboxd serve: {exc}\n")
        return 2
    from sandboxd.config import resource_limits
    from sandboxd.service.convert import SessionDefaults
    from sandboxd.service.quotas import QuotaLimits
    from sandboxd.service.server import serve

    try:
        quotas = QuotaLimits(sessions_per_uid=loaded.whole("quotas.sessions_per_uid"),
                             calls_per_uid=loaded.whole("quotas.calls_per_uid"),
                             streams_per_uid=loaded.whole("quotas.streams_per_uid"),
                             background_per_uid=loaded.whole("quotas.background_per_uid"),
                             reserved_workers=loaded.whole("quotas.reserved_workers"),
                             workers=loaded.whole("listen.workers"))
    except SandboxdError as exc:
        sys.stderr.write(f"sandboxd serve: {exc}\n")
        return 2
    limits = resource_limits(loaded)
    defaults = SessionDefaults(
        sandbox=loaded.text("defaults.sandbox_policy"), network_access=loaded.flag("defaults.network_access"),
        approval=loaded.text("defaults.approval_policy"),
        timeout_seconds=loaded.number("defaults.timeout_seconds") or None,
        memory_bytes=limits.memory, pids=limits.pids, max_memory_bytes=limits.max_memory, max_pids=limits.max_pids,
        total_memory_bytes=limits.total_memory, total_pids=limits.total_pids,
        owner_memory_bytes=limits.owner_memory or None, owner_pids=limits.owner_pids)
    try:
        return serve(loaded.text("listen.socket"), socket_mode=int(loaded.text("listen.socket_mode"), 8),
                     admin_gid=admin_gid, workers=loaded.whole("listen.workers"),
                     tls=listener, state_dir=loaded.text("state.dir"),
                     approval_timeout=approval_timeout, dns=dns,
                     log_format=loaded.text("log.format"), log_level=loaded.text("log.level"),
                     config_path=loaded.path,
                     metrics_listen=loaded.text("metrics.listen"), session_defaults=defaults,
                     network_pool=loaded.text("network.pool"), quotas=quotas,
                     proxy_connections=loaded.whole("quotas.proxy_connections_per_session"),
                     published_connections=loaded.whole("quotas.published_connections_per_session"),
                     published_per_peer=loaded.whole("quotas.published_connections_per_peer"),
                     connections_per_uid=loaded.whole("quotas.connections_per_uid"),
                     ping_timeout=loaded.number("fork_server.ping_timeout_seconds"),
                     wait_seconds=loaded.number("fork_server.wait_seconds"),
                     allow_user_full_access=loaded.flag("policy.allow_user_full_access"))
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
        # A second `sandboxd serve` on a busy socket: one line, not a traceback.
        sys.stderr.write(f"sandboxd serve: another daemon is serving {loaded.text('listen.socket')}: stop it "
                         f"first, or serve on another socket (--socket)\n")
        return 1
