"""`sandboxd serve`: the daemon, in the foreground, logging to stderr (JSON lines by default).

Settings come from the configuration file (sandboxd.config: --config, $SANDBOXD_CONFIG, or
/etc/sandboxd/sandboxd.toml), and a command-line flag wins over the file.
"""

from __future__ import annotations

import argparse
import grp
import sys

from sandboxd.errors import SandboxdError

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


def settings(argv: list[str]) -> dict[str, object]:
    """The configuration file's values, overridden by the flags given; ConfigError on a bad file."""
    from sandboxd import config

    args = parser().parse_args(argv)
    loaded = config.load(args.config or config.default_path())
    values = {flag: loaded[key] for flag, key in FLAG_KEYS.items()}
    for flag in FLAG_KEYS:
        given = getattr(args, flag)
        if given is not None:
            values[flag] = given
    values["config_path"] = loaded.path
    values["config"] = loaded
    return values


def main(argv: list[str]) -> int:
    try:
        values = settings(argv)
    except SandboxdError as exc:
        sys.stderr.write(f"sandboxd serve: {exc}\n")
        return 2
    listener = None
    tls_options = (values["tls_cert"], values["tls_key"], values["tls_client_ca"])
    if values["tcp"] or any(tls_options):
        if not (values["tcp"] and all(tls_options)):
            sys.stderr.write("sandboxd serve: a TCP listener needs all of --tcp, --tls-cert, --tls-key and "
                             "--tls-client-ca (there is no plain-text or unauthenticated TCP)\n")
            return 2
        from sandboxd.cli.run import parse_user
        from sandboxd.errors import InvalidPolicy
        from sandboxd.service.server import TlsListener
        try:
            uid, gid = parse_user(str(values["tcp_user"]))
            config = values["config"]
            users = {name: parse_user(str(user)) for name, user in config["tls.users"].items()}  # type: ignore[index]
            listener = TlsListener(str(values["tcp"]), str(values["tls_cert"]), str(values["tls_key"]),
                                   str(values["tls_client_ca"]), uid, gid,
                                   identity=str(config["tls.identity"]), users=users)  # type: ignore[index]
        except (InvalidPolicy, OSError) as exc:
            sys.stderr.write(f"sandboxd serve: {exc}\n")
            return 2
    admin_gid = None
    group = str(values["admin_group"] or "")
    if group:
        try:
            admin_gid = int(group) if group.isdigit() else grp.getgrnam(group).gr_gid
        except KeyError:
            sys.stderr.write(f"sandboxd serve: unknown group {group!r}\n")
            return 2
    if float(values["approval_timeout"]) <= 0:  # type: ignore[arg-type]
        sys.stderr.write("sandboxd serve: --approval-timeout must be a positive number of seconds\n")
        return 2
    dns = tuple(values["dns"])  # type: ignore[call-overload]
    try:
        from sandboxd.policy import LaunchSpec
        LaunchSpec(argv=("true",), workspace="/", dns=dns)   # validates the addresses
    except SandboxdError as exc:
        sys.stderr.write(f"sandboxd serve: {exc}\n")
        return 2
    from sandboxd.policy import parse_size
    from sandboxd.service.convert import SessionDefaults
    from sandboxd.service.quotas import QuotaLimits
    from sandboxd.service.server import serve

    loaded = values["config"]
    try:
        quotas = QuotaLimits(sessions_per_uid=loaded["quotas.sessions_per_uid"],  # type: ignore[index]
                             calls_per_uid=loaded["quotas.calls_per_uid"],  # type: ignore[index]
                             streams_per_uid=loaded["quotas.streams_per_uid"],  # type: ignore[index]
                             reserved_workers=loaded["quotas.reserved_workers"],  # type: ignore[index]
                             workers=int(values["workers"]))  # type: ignore[call-overload]
    except SandboxdError as exc:
        sys.stderr.write(f"sandboxd serve: {exc}\n")
        return 2
    defaults = SessionDefaults(
        sandbox=loaded["defaults.sandbox_policy"], network_access=loaded["defaults.network_access"],  # type: ignore[index]
        approval=loaded["defaults.approval_policy"],  # type: ignore[index]
        timeout_seconds=float(loaded["defaults.timeout_seconds"]) or None,  # type: ignore[index]
        memory_bytes=parse_size(loaded["defaults.memory"], "defaults.memory") if loaded["defaults.memory"] else None,  # type: ignore[index]
        pids=int(loaded["defaults.pids"]) or None)  # type: ignore[index]
    return serve(str(values["socket"]), socket_mode=int(loaded["listen.socket_mode"], 8),  # type: ignore[index]
                 admin_gid=admin_gid, workers=int(values["workers"]),  # type: ignore[call-overload]
                 tls=listener, state_dir=str(values["state_dir"]),
                 approval_timeout=float(values["approval_timeout"]), dns=dns,  # type: ignore[arg-type]
                 log_format=str(values["log_format"]), log_level=str(values["log_level"]),
                 config_path=values["config_path"],  # type: ignore[arg-type]
                 metrics_listen=str(values["metrics"] or ""), session_defaults=defaults,
                 network_pool=loaded["network.pool"], quotas=quotas,  # type: ignore[index]
                 proxy_connections=int(loaded["quotas.proxy_connections_per_session"]),  # type: ignore[index]
                 published_connections=int(loaded["quotas.published_connections_per_session"]),  # type: ignore[index]
                 connections_per_uid=int(loaded["quotas.connections_per_uid"]))  # type: ignore[index]
