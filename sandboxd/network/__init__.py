"""The daemon's own network services, all user-space: the front door (who calls the gRPC daemon),
the TCP relay loop, and on it the egress proxy, published ports and rootless `sandboxd run`'s
loopback proxy, and the proxy's DNS client.

Layering: above ``kernel``, ``policy`` and ``launcher`` (it uses the kernel's netns, nftables and
inet_diag mechanisms and the launcher's descriptor passing), below ``supervisor`` (the spawner
starts a rootless sandbox's proxy), ``service`` and ``cli``. The kernel-level mechanisms
(``kernel.netns``, ``kernel.nftables``, ``kernel.addresses``) stay in ``kernel``, one per mechanism.
"""
