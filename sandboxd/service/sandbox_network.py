"""What the daemon serves a sandbox's network, as a session's hooks: its published ports
(policy.published_ports) and its egress proxy (policy.allowed_domains, allowed_endpoints,
credentials), one set per sandbox generation, closed with it (sandbox_hooks).

A proxied session's proxy ends TLS for the hosts its rules intercept with the session's own CA
(session.ca: its key stays in the daemon; the sandbox trusts its certificate through
LaunchSpec.trust_pem) and checks each upstream with one context per daemon (the host's trust
store, network.upstream_ca_file, SSL_CERT_FILE). It swaps the session's phantoms for the secrets
the daemon holds (service.credential_vault)."""

from __future__ import annotations

import os
import socket
import ssl
import threading
from typing import TYPE_CHECKING, Callable, Iterable

from sandboxd.audit.store import EventStore, EventType
from sandboxd.defaults import PROXY_PORT
from sandboxd.errors import SetupError
from sandboxd.service.sandbox_hooks import Sandbox, SandboxHooks, Service
from sandboxd.service.sessions.state import Session

if TYPE_CHECKING:
    from sandboxd.service.network_questions import NetworkQuestions


class PublishedPorts(SandboxHooks):
    def __init__(self, connections: int, per_peer: int) -> None:
        # Connections at once per sandbox, and per connecting user but the session's owner.
        self._connections, self._per_peer = connections, per_peer

    def sandbox_ready(self, session: Session, sandbox: Sandbox) -> Iterable[Service]:
        entries = sandbox.policy.published_ports
        if not entries:
            return ()
        from sandboxd.network.publish import publish_all

        netns = os.open(f"/proc/{sandbox.info.init_pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        try:
            return publish_all(netns, entries, connections=self._connections, per_peer=self._per_peer,
                               owners=frozenset({session.owner.uid}))
        finally:
            os.close(netns)


def network_environment(session: Session) -> dict[str, str]:
    """The variables a proxied sandbox's commands get: the proxy's, the trust bundle's (clients
    read the bundle the rootfs binds with the session's CA: launcher.trust_bundle) and each
    credential's phantom. The caller holds ``session.lock``."""
    from sandboxd.launcher.trust_bundle import host_bundle_path, trust_environment
    from sandboxd.network.egress_proxy import proxy_environment

    bundle = host_bundle_path()
    phantoms = session.credentials.phantoms() if session.credentials is not None else {}
    return {**proxy_environment(), **(trust_environment(bundle) if bundle else {}), **phantoms}


class EgressProxies(SandboxHooks):
    def __init__(self, store: EventStore, connections: int, count_denial: Callable[[], None] | None = None,
                 upstream_ca_pem: bytes = b"", allowed_ranges: tuple[str, ...] = (),
                 upstream_proxy: tuple[str, int] | None = None, intercepted_connections: int = 64) -> None:
        """``upstream_ca_pem``: network.upstream_ca_file's certificates, trusted for upstreams
        besides the host's store; ``allowed_ranges``: network.allowed_ranges; ``upstream_proxy``:
        network.upstream_proxy (host, port), which every allowed connection then goes through;
        ``intercepted_connections``: quotas.intercepted_connections_per_session."""
        self._store = store
        self._connections = connections                 # at once, per sandbox
        self._intercepted = intercepted_connections      # of them, intercepted (TLS ended)
        self._count_denial = count_denial                # the daemon's metrics, when it has them
        # Who answers unlisted = ask (service.network_questions), once the daemon has its approval gate.
        self.questions: "NetworkQuestions | None" = None
        self._upstream_ca_pem, self._allowed_ranges = upstream_ca_pem, allowed_ranges
        self._upstream_proxy = upstream_proxy
        self._upstream_context: ssl.SSLContext | None = None   # one per process, made at first use
        self._context_lock = threading.Lock()

    def upstream_context(self) -> ssl.SSLContext:
        with self._context_lock:
            if self._upstream_context is None:
                from sandboxd.network.interception.upstream_tls import upstream_context
                self._upstream_context = upstream_context(self._upstream_ca_pem.decode("ascii"))
            return self._upstream_context

    def sandbox_ready(self, session: Session, sandbox: Sandbox) -> Iterable[Service]:
        info = sandbox.info
        if not (sandbox.policy.proxied and info.host_address and info.sandbox_address):
            return ()
        from sandboxd.network.credentials import CredentialSet
        from sandboxd.network.egress_proxy import PROXY_ADDRESS, EgressProxy
        from sandboxd.network.interception.intercepted import Interceptor
        from sandboxd.network.upstream import UpstreamRoute

        def denied(destination: str, why: str) -> None:
            if self._count_denial is not None:
                self._count_denial()
            # The sandbox chooses how often: noted, i.e. counted rather than written once its owner's
            # audit budget is spent (the connection is refused either way).
            self._store.note(session.id, [(EventType.PERMISSION_DENIED, "", "network", {
                "reason": "network_request", "by": "sandbox", "destination": destination, "detail": why,
                "message": f"network: denied by the sandbox (network_request): {destination}: {why}"})])
        if info.proxy_listener < 0:
            raise SetupError("egress proxy", 0, f"{PROXY_ADDRESS}:{PROXY_PORT}",
                             detail="the fork server sent no listening socket for the egress proxy")
        # The socket the fork server bound in the sandbox's namespace before the sandbox existed,
        # never closed since (egress_proxy.PROXY_ADDRESS says why not an address of the host's).
        listener = socket.socket(fileno=os.dup(info.proxy_listener))
        netns = os.open(f"/proc/{info.init_pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        with session.lock:
            ca, credentials = session.ca, session.credentials
        # Every proxied session's proxy can intercept (a live change may add a host to intercept).
        interceptor = Interceptor(ca, self.upstream_context()) if ca is not None else None
        try:                                            # its upstream connections are made in there
            # Every proxy may ask: whether it does is its rules' unlisted, which a live change may set.
            ask = self.questions.ask_for(session) if self.questions is not None else None
            proxy = EgressProxy(listener, sandbox.policy.network_rules, netns_fd=netns, resolvers=info.resolvers,
                                on_denied=denied, interceptor=interceptor, ask=ask,
                                credentials=credentials.credential_set() if credentials is not None else CredentialSet(),
                                allowed_ranges=self._allowed_ranges, connections=self._connections,
                                intercepted_connections=self._intercepted,
                                upstream=UpstreamRoute(*self._upstream_proxy, ca_pem=self._upstream_ca_pem.decode("ascii"))
                                if self._upstream_proxy is not None else None).start()
        except BaseException:
            listener.close()
            raise
        finally:
            os.close(netns)
        if info.transparent_listener >= 0:            # the sandbox's ports 80 and 443 (network.transparent)
            try:
                proxy.serve_captured(socket.socket(fileno=os.dup(info.transparent_listener)))
            except BaseException:
                proxy.close()
                raise
        with session.lock:
            session.extra_env = network_environment(session)
        return (proxy,)
