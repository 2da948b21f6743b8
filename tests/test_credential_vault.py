"""The daemon's credential vault (service/credential_vault.py) and the clients' credential flags
(cli/network_args.py), without a daemon: who may give which secret, what is kept across a change,
daemon secrets' files and bindings, and that no message or repr carries a secret. End to end:
tests/test_credentials_daemon.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sandboxd.cli.network_args import parse_credentials
from sandboxd.config.settings import SecretSource
from sandboxd.errors import Forbidden, InvalidPolicy
from sandboxd.policy.network import DaemonSecret, parse_credential
from sandboxd.service.callers import session_owner
from sandboxd.service.credential_vault import CredentialVault, read_secret_file

ALICE, ROOT = session_owner(4242, 4242, ""), session_owner(0, 0, "")
SPEC = parse_credential("TOKEN=https://api.example.com")
VALUE = b"tok_the-real-secret-value"


def daemon_secret(tmp_path: Path, mode: int = 0o600, **fields: object) -> SecretSource:
    path = tmp_path / "secret"
    path.write_bytes(b"dsk_from-the-daemon\n")
    os.chmod(path, mode)
    base: dict[str, object] = {"file": str(path), "uids": (ALICE.uid,), "gids": (),
                               "upstreams": (("api.example.com", 443),)}
    return SecretSource(**{**base, **fields})  # type: ignore[arg-type]


def test_a_kept_secret_follows_the_whole_spec() -> None:
    vault = CredentialVault()
    first = vault.resolve(ALICE, ALICE, None, [SPEC], {"TOKEN": VALUE})
    (held,) = first.held.values()
    assert first.known_names([SPEC]) == {"TOKEN"}
    kept = vault.resolve(ALICE, ALICE, first, [SPEC], {})
    assert kept.held["TOKEN"] is held and kept.phantoms() == first.phantoms()
    for moved in ("TOKEN=https://evil.example.com", "TOKEN=https://api.example.com:8443",
                  "TOKEN=https://api.example.com;x-api-key: {}", "TOKEN=https://api.example.com;basic"):
        spec = parse_credential(moved)
        assert first.known_names([spec]) == frozenset()
        with pytest.raises(InvalidPolicy, match="send its secret again"):
            vault.resolve(ALICE, ALICE, first, [spec], {})
    moved = vault.resolve(ALICE, ALICE, first, [parse_credential("TOKEN=https://other.example.com")],
                          {"TOKEN": b"another-secret"})
    assert moved.phantoms()["TOKEN"] != first.phantoms()["TOKEN"]      # a new credential, a new phantom
    first.wipe_unused(moved)
    assert bytes(held.secret._value) == b"\0" * len(VALUE)  # type: ignore[union-attr]


def test_only_the_owner_gives_secrets() -> None:
    vault = CredentialVault({"gh": SecretSource("/nonexistent", (), (), (("api.example.com", 443),))})
    mine = vault.resolve(ALICE, ALICE, None, [SPEC], {"TOKEN": VALUE})
    for given in ({"TOKEN": b"roots-own"}, {"TOKEN": DaemonSecret("gh")}):
        with pytest.raises(Forbidden, match="only the session's owner"):
            vault.resolve(ROOT, ALICE, mine, [SPEC], given)
    assert vault.resolve(ROOT, ALICE, mine, [SPEC], {}).held["TOKEN"] is mine.held["TOKEN"]   # keep: yes
    assert vault.resolve(ROOT, ALICE, mine, [], {}).held == {}                               # remove: yes


def test_a_daemon_secret_is_bound_to_its_users_upstreams_and_injection(tmp_path: Path) -> None:
    vault = CredentialVault({"gh": daemon_secret(tmp_path)})
    got = vault.resolve(ALICE, ALICE, None, [SPEC], {"TOKEN": DaemonSecret("gh")})
    assert got.states()[0].source == "daemon:gh" and got.daemon_sources() == {"TOKEN": "gh"}
    assert got.credential_set().swap("api.example.com", 443, [(b"Authorization", f"Bearer {got.phantoms()['TOKEN']}"
                                                               .encode())])[0] == [(b"Authorization",
                                                                                    b"Bearer dsk_from-the-daemon")]
    with pytest.raises(InvalidPolicy, match="only for https://api.example.com:443"):
        vault.resolve(ALICE, ALICE, None, [parse_credential("TOKEN=https://evil.example.com")],
                      {"TOKEN": DaemonSecret("gh")})
    bob = session_owner(4343, 4343, "")
    for name in ("gh", "nosuch"):                                   # the same answer: nothing learnt
        with pytest.raises(Forbidden, match="does not exist or is not granted"):
            vault.resolve(bob, bob, None, [SPEC], {"TOKEN": DaemonSecret(name)})
    # Without inject, only the default header: a header the user picks may be one the upstream echoes.
    with pytest.raises(InvalidPolicy, match="Authorization: Bearer"):
        vault.resolve(ALICE, ALICE, None, [parse_credential("TOKEN=https://api.example.com;X-Debug: {}")],
                      {"TOKEN": DaemonSecret("gh")})
    fixed = CredentialVault({"gh": daemon_secret(tmp_path, inject=("x-api-key", "{}", None))})
    with pytest.raises(InvalidPolicy, match="inject"):
        fixed.resolve(ALICE, ALICE, None, [SPEC], {"TOKEN": DaemonSecret("gh")})
    fixed.resolve(ALICE, ALICE, None, [parse_credential("TOKEN=https://api.example.com;x-api-key: {}")],
                  {"TOKEN": DaemonSecret("gh")})
    # After a restart: the daemon secret read again, a caller's lost.
    restored = vault.restored(ALICE, [SPEC, parse_credential("OTHER=https://api.example.com")], {"TOKEN": "gh"})
    assert [(s.name, s.source, s.usable) for s in restored.states()] == [("OTHER", "caller", False),
                                                                          ("TOKEN", "daemon:gh", True)]


def test_a_daemon_secrets_file_must_be_roots_and_private(tmp_path: Path) -> None:
    for mode in (0o640, 0o604):
        source = daemon_secret(tmp_path, mode)
        with pytest.raises(InvalidPolicy, match="mode 0600") as refused:
            read_secret_file("gh", source.file)
        assert "dsk_" not in str(refused.value)
    link = tmp_path / "link"
    link.symlink_to(daemon_secret(tmp_path).file)
    with pytest.raises(InvalidPolicy, match="cannot be opened"):
        read_secret_file("gh", str(link))
    assert read_secret_file("gh", daemon_secret(tmp_path).file) == b"dsk_from-the-daemon"


def test_the_client_reads_each_secret_once_and_never_says_it(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_bytes(b"from-a-file\n")
    got = parse_credentials(["A=https://a.example", "B=https://b.example;x-api-key: {}", "C=https://c.example"],
                            [f"B={path}"], ["C=gh"], {"A": "from-the-env"})
    assert got.secrets == {"A": b"from-the-env", "B": b"from-a-file", "C": "gh"}
    assert "from-" not in repr(got)
    for args, message in (
            ((["A=https://a.example"], [], [], {}), r"\$A is not set"),
            ((["A=https://a.example"], ["B=/x"], [], {"A": "x"}), "no --credential names B"),
            ((["A=https://a.example"], [], ["Z=gh"], {"A": "x"}), "no --credential names Z"),
            ((["A=https://a.example"], [], [], {"A": "has space secret"}), "a character a header cannot carry"),
            ((["A=http://a.example"], [], [], {"A": "x"}), "must be https://")):
        with pytest.raises(ValueError, match=message) as refused:
            parse_credentials(*args)  # type: ignore[arg-type]
        assert "secret value" not in str(refused.value) and "has space" not in str(refused.value)
    kept = parse_credentials(["A=https://a.example"], [], [], {}, secret_required=False)
    assert kept.specs == ("A=https://a.example",)
    assert kept.secrets == {}


def test_apply_network_policy_updates_the_running_proxy_and_audits_it(tmp_path: Path) -> None:
    """The entry track ask uses ("allow for the session"): the session's proxy enforces the new
    rules at once, the change is audited live with its ``by``; a change that needs a new sandbox
    is refused and changes nothing."""
    import socket

    from sandboxd.audit.store import EventStore
    from sandboxd.errors import WrongState
    from sandboxd.network.egress_proxy import EgressProxy
    from sandboxd.policy import Limits, policy_from_name
    from sandboxd.service.sandbox_network import network_environment
    from sandboxd.service.sessions.network_live import LiveNetwork, apply_network_policy
    from sandboxd.service.sessions.state import Session

    store = EventStore(str(tmp_path / "events.db"))
    policy = policy_from_name("workspace-write", network_access=True, allowed_domains=["a.example"])
    session = Session("s1", ALICE, str(tmp_path), policy, "never", Limits(), {})
    vault = CredentialVault()
    session.credentials = vault.resolve(ALICE, ALICE, None, [], {})
    session.live_network = LiveNetwork(store, vault, network_environment)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    from sandboxd.network.tcp_relay import RelayLoop

    loop = RelayLoop("test-vault")                  # its own: a later test counts sandboxd's threads
    proxy = EgressProxy(listener, policy.network_rules, netns_fd=-1, loop=loop)
    session.services[1] = [proxy]
    try:
        wider = policy.replace(allowed_domains=("a.example", "b.example"))
        apply_network_policy(session, wider, by="approval")
        assert proxy.rules.allowed("b.example", 443) and session.policy == wider
        (event,) = store.query(session_ids=["s1"], types=["PolicyChanged"])
        data = event.data
        assert data["live"] is True and data["by"] == "approval" and data["generation"] == 1, data
        with pytest.raises(WrongState, match="needs a new sandbox"):
            apply_network_policy(session, wider.replace(writable_roots=(str(tmp_path),)), by="caller")
        assert session.policy == wider and len(store.query(session_ids=["s1"], types=["PolicyChanged"])) == 1
    finally:
        proxy.close()
        loop.close()
        listener.close()
        store.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="adds a user and a group (root)")
def test_a_group_granted_daemon_secret_follows_the_owners_groups_now(tmp_path: Path) -> None:
    """Hostile r7b L6: the owner's groups at each use, not those its connection carried at create.
    A real user and group: taken out of the group, the owner can neither add the secret again nor
    keep it through an update."""
    import grp
    import subprocess
    import uuid

    from daemon_helpers import plain_users
    from sandboxd.service.callers import Caller

    group = f"sbxt-g{uuid.uuid4().hex[:8]}"
    subprocess.run(["groupadd", group], check=True, capture_output=True, timeout=60)
    try:
        gid = grp.getgrnam(group).gr_gid
        with plain_users(1) as (user,):
            subprocess.run(["gpasswd", "-a", user.name, group], check=True, capture_output=True, timeout=60)
            # As identified at create: SO_PEERGROUPS carried the group.
            owner = Caller(user.uid, user.gid, os.getpid(), "", (gid,))
            vault = CredentialVault({"gh": daemon_secret(tmp_path, uids=(), gids=(gid,))})
            first = vault.resolve(owner, owner, None, [SPEC], {"TOKEN": DaemonSecret("gh")})
            kept = vault.resolve(owner, owner, first, [SPEC], {})
            assert [s.usable for s in kept.states()] == [True]                  # control: a member keeps it
            subprocess.run(["gpasswd", "-d", user.name, group], check=True, capture_output=True, timeout=60)
            with pytest.raises(Forbidden, match="does not exist or is not granted"):
                vault.resolve(owner, owner, first, [SPEC], {"TOKEN": DaemonSecret("gh")})
            after = vault.resolve(owner, owner, first, [SPEC], {})
            assert [(s.name, s.source, s.usable) for s in after.states()] == [("TOKEN", "daemon:gh", False)]
            assert after.phantoms() == first.phantoms() and after.credential_set().swap(
                "api.example.com", 443, [(b"Authorization", f"Bearer {first.phantoms()['TOKEN']}".encode())]
            )[0] != [(b"Authorization", b"Bearer dsk_from-the-daemon")]
    finally:
        subprocess.run(["groupdel", group], capture_output=True, timeout=60)
