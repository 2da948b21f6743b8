"""The interception room: where the egress proxy ends a sandbox's TLS to hosts that have endpoint
rules or credentials, and mediates its HTTP/1.1 requests (design §3-§4; docs/networks.md).

- ``ca``: the per-session CA and the leaf certificates it mints (keys only in this process);
- ``upstream_tls``: how the real upstream's certificate is checked;
- ``tls_end``: one TLS side on the loop, over memory buffers;
- ``http1``: the HTTP/1.1 mediator (h11 on both sides: requests re-serialised, streamed);
- ``sni``: the server name of a ClientHello (transparent capture);
- ``intercepted``: the connection object the egress proxy hands an intercepted CONNECT to.

Imported only by a proxy that intercepts: ``cryptography``, ``h11`` and ``ssl`` stay off a plain
``sandboxd run``'s path.
"""
