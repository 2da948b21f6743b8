"""The egress proxy's DNS client (network.egress_proxy): an IPv4 address for a name, asked of the
configured resolvers (network.dns in the daemon's configuration, --dns of `sandboxd run`), else of
the host's own resolver. Blocking: the proxy calls it on a worker thread, never on its loop.

dnspython builds the query and checks the answer: a random id, the reply's source, id and question
must match the query's (a reply that does not is not taken as the answer), and names are encoded
as IDNA. Imported on first use (~40 ms): only a proxy with configured resolvers pays it."""

from __future__ import annotations

import socket

__all__ = ["TIMEOUT_SECONDS", "resolve"]

TIMEOUT_SECONDS = 3.0              # per resolver


def resolve(name: str, resolvers: "list[str] | tuple[str, ...]") -> str:
    """An IPv4 address of ``name``: a one-question A query to each resolver in turn, else the
    host's resolver (getaddrinfo). OSError when none answers with an address."""
    if not resolvers:
        return str(socket.getaddrinfo(name, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0])
    import dns.exception
    import dns.message
    import dns.query
    import dns.rdatatype

    try:
        query = dns.message.make_query(name, dns.rdatatype.A)
    except (dns.exception.DNSException, ValueError) as exc:      # (a label too long, say)
        raise OSError(f"cannot resolve {name}: {exc}") from None
    for server in resolvers:
        try:
            reply = dns.query.udp(query, server, timeout=TIMEOUT_SECONDS)
        except (dns.exception.DNSException, OSError, ValueError):
            continue
        for rrset in reply.answer:
            if rrset.rdtype == dns.rdatatype.A:
                for record in rrset:
                    return str(record.address)
    raise OSError(f"cannot resolve {name}")
