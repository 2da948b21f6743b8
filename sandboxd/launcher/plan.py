"""LaunchPlan: a LaunchSpec with every host fact resolved, ready for the child.

Built in the parent (the spawner) before fork, so bad input is reported
before any process or namespace exists.
"""

from __future__ import annotations

import os

from sandboxd._record import Record
from sandboxd.kernel import paths, seccomp
from sandboxd.policy import DangerFullAccess, LaunchSpec, Limits, WorkspaceWrite


class LaunchPlan(Record):
    argv: tuple[str, ...]
    env: dict[str, str]
    cwd: str
    workspace: str
    confined: bool                      # every policy but DangerFullAccess
    network: bool
    network_isolated: bool              # a namespace of its own behind NAT (kernel.netns.IsolatedNetwork)
    writable_roots: tuple[str, ...]     # real paths, workspace first when writable
    readonly_roots: tuple[str, ...]     # the workspace under read-only: bound so it is seen even under /tmp
    protected_subpaths: tuple[str, ...]
    uid: int
    gid: int
    limits: Limits
    seccomp_program: bytes
    brokers_connect: bool               # the filter hands connect() to init (see connect_broker)
    tool: dict[str, object] | None = None  # a file tool to run in the sandbox instead of exec'ing argv
    dns: tuple[str, ...] = ()
    network_pool: str = ""
    allowed_unix_sockets: tuple[str, ...] = ()     # host socket files connect() may reach (connect_broker)
    allowed_hosts: tuple[str, ...] = ()            # the isolated network's egress allowlist
    allowed_domains: tuple[str, ...] = ()          # ... and its names, through the egress proxy
    # Set by the spawner just before fork, for an isolated network: the namespace to join, and the
    # sandbox's resolv.conf.
    netns_fd: int = -1
    resolv_conf: str | None = None


def prepare(spec: LaunchSpec) -> LaunchPlan:
    policy = spec.policy
    confined = not isinstance(policy, DangerFullAccess)
    writable = isinstance(policy, WorkspaceWrite)
    resolved = paths.resolve(spec.workspace, spec.cwd,
                             policy.writable_roots if writable else (),
                             workspace_writable=writable, confined=confined)
    if spec.user is not None:
        uid, gid = spec.user
    else:
        st = os.stat(resolved.workspace)
        uid, gid = st.st_uid, st.st_gid
    network = bool(policy.network_access)
    isolated = network and confined and getattr(policy, "network_mode", "host") == "isolated"
    filter_spec = seccomp.FilterSpec(confined=confined, network_access=network, isolated_network=isolated)
    return LaunchPlan(
        argv=spec.argv, env=dict(spec.env), cwd=resolved.cwd, workspace=resolved.workspace,
        confined=confined, network=network, network_isolated=isolated, dns=tuple(spec.dns),
        network_pool=spec.network_pool,
        allowed_unix_sockets=tuple(getattr(policy, "allowed_unix_sockets", ())),
        allowed_hosts=tuple(getattr(policy, "allowed_hosts", ())),
        allowed_domains=tuple(getattr(policy, "allowed_domains", ())),
        writable_roots=resolved.writable_roots,
        readonly_roots=() if writable or not confined else (resolved.workspace,),
        protected_subpaths=policy.protected_subpaths if writable else (),
        uid=uid, gid=gid, limits=spec.limits,
        seccomp_program=seccomp.program_for(filter_spec), brokers_connect=filter_spec.brokers_connect,
    )
