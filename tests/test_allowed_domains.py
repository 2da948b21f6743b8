"""Allowed domains (policy.domains): the names a policy takes are exactly the names the egress
proxy's matcher lets through and its DNS client asks for, as the same text. Generated inputs
(hypothesis) hold the three together; every place a domain enters is checked once with the
issue's two names, ``pÿpi.org`` and ``١٢.com`` (refused, naming the A-label), and an A-label
(taken). End to end through the proxy (CONNECT, plain HTTP, SOCKS5 by name):
tests/test_isolated_network.py."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import dns.message
import dns.rdatatype
import grpc
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from conftest import SANDBOXD
from sandboxd.errors import InvalidPolicy
from sandboxd.network.egress_proxy import allowed_name
from sandboxd.policy import WorkspaceWrite
from sandboxd.policy.domains import MAX_NAME, allowed_domain, host_name

# Pieces that make names, near-names and look-alikes: ASCII name characters in both cases, the
# characters the old check let through (isalnum: letters and digits of every script), ones that
# lower() turns into ASCII (the Kelvin sign) or into two characters (İ), a fullwidth letter,
# spaces, a bidi override, separators and wildcards in odd places.
PIECES = [*"abcxyz0129-.", "A", "Z", "xn--", "*.", "*", ".", "-", "ÿ", "١", "٢", "\u212a", "İ", "ß", "ｐ", "é",
          "\u202e", " ", "\t", "_", "/", ":", "..", "a" * 63, "b" * 64, "www", "pypi", "org", "com", "1", "99"]
names = st.one_of(st.lists(st.sampled_from(PIECES), min_size=0, max_size=12).map("".join),
                  st.text(max_size=40))
# Real A-labels: punycode of lower-case letters of other scripts, with the xn-- prefix.
a_labels = st.text(st.characters(categories=["Ll", "Lo"], min_codepoint=0x80), min_size=1, max_size=12).map(
    lambda text: "xn--" + text.encode("punycode").decode("ascii"))


def asked_of_dns(name: str) -> str:
    """The name the DNS client (network.dns: dnspython's query) puts on the wire, read back."""
    wire = dns.message.make_query(name, dns.rdatatype.A).to_wire()
    return str(dns.message.from_wire(wire).question[0].name.to_text(omit_final_dot=True))


def check_taken(entry: str) -> None:
    """What every name the policy takes must hold: ASCII, lower case, matched by the proxy as
    itself (in any case, with a final dot), asked of DNS as itself, and the same bytes through
    getaddrinfo (which the host-resolver path uses, after the "idna" codec)."""
    assert entry.isascii() and entry == entry.lower(), entry
    if entry == "*":                                                 # any host name, and only host names
        assert allowed_name("A.Example.", [entry]) == "a.example" and allowed_name("10.0.0.1", [entry]) is None
        assert allowed_name("caf\u00e9.test", [entry]) is None
        return
    if entry.startswith("*."):
        base = entry[2:]
        assert allowed_name(base, [entry]) is None, entry            # a subdomain, not the name itself
        sub = f"a.{base}"
        assert len(sub) <= MAX_NAME
        assert allowed_name(sub, [entry]) == sub and allowed_name(sub.upper() + ".", [entry]) == sub
        checked = sub
    else:
        assert allowed_name(entry, [entry]) == entry and allowed_name(entry.upper() + ".", [entry]) == entry
        checked = entry
    assert asked_of_dns(checked) == checked
    assert checked.encode("idna") == checked.encode("ascii")


@settings(max_examples=1000, deadline=None, database=None)
@given(names)
def test_what_the_policy_takes_the_proxy_and_dns_handle_as_itself(text: str) -> None:
    try:
        entry = allowed_domain(text)
    except InvalidPolicy as refused:
        if not text.strip().removeprefix("*.").isascii():
            assert "A-labels (IDNA: xn--...)" in str(refused), refused
        return
    check_taken(entry)
    assert allowed_domain(entry) == entry                           # kept as it is: no drift on reload


@settings(max_examples=1000, deadline=None, database=None)
@given(names, st.lists(names, max_size=4))
def test_the_proxy_lets_through_only_names_the_policy_would_take(name: str, candidates: list[str]) -> None:
    """Whatever a sandbox asks for, the matcher allows only a name the validator takes as it is:
    never one in another script, never one that lowers or strips into an allowed one."""
    patterns = []
    for candidate in candidates:
        try:
            patterns.append(allowed_domain(candidate))
        except InvalidPolicy:
            pass
    host = allowed_name(name, patterns)
    if host is None:
        return
    assert name.isascii(), name
    assert allowed_domain(host) == host and host_name(name) == host
    check_taken(host)


@settings(max_examples=1000, deadline=None, database=None)
@given(a_labels, st.booleans())
def test_a_labels_are_taken(label: str, wildcard: bool) -> None:
    assume(len(label) <= 63)
    entry = ("*." if wildcard else "") + f"{label}.test"
    assert allowed_domain(entry.upper()) == entry
    check_taken(entry)


@settings(max_examples=1000, deadline=None, database=None)
@given(st.text(st.characters(categories=["Ll", "Lo", "Nd"], min_codepoint=0x80), min_size=1, max_size=12))
def test_a_name_in_another_script_is_refused_with_its_a_label(label: str) -> None:
    """Refused (not matched some other way), and the A-label the message suggests, when it gives
    one, is itself taken."""
    with pytest.raises(InvalidPolicy) as refused:
        allowed_domain(f"{label}.org")
    said = str(refused.value)
    assert "is not ASCII" in said and "A-labels (IDNA: xn--...)" in said, said
    if ", e.g. " in said:
        check_taken(allowed_domain(said.rsplit(", e.g. ", 1)[1].strip("'")))


@pytest.mark.parametrize("text, suggested", [("pÿpi.org", "xn--ppi-toa.org"), ("١٢.com", "xn--9hbc.com"),
                                             ("*.pÿpi.org", "*.xn--ppi-toa.org"), ("faß.de", None)])
def test_the_issues_names_are_refused_naming_the_a_label(text: str, suggested: str | None) -> None:
    with pytest.raises(InvalidPolicy) as refused:
        WorkspaceWrite(network_access=True, allowed_domains=(text,))
    said = str(refused.value)
    assert f"allowed domain {text!r} is not ASCII" in said
    # ß: the standard library's IDNA 2003 would give fass.de, another name than IDNA 2008's.
    assert (f"e.g. {suggested!r}" in said) if suggested else "e.g." not in said, said
    # The control: the A-label itself is taken, and matched by the proxy.
    a_label = suggested or "xn--fa-hia.de"
    assert WorkspaceWrite(network_access=True, allowed_domains=(a_label,)).allowed_domains == (a_label,)


@pytest.mark.parametrize("text", ["1.2.3.4", "-pypi.org", "pypi-.org", "xn--zz.org", "xn--a-.org", "pypi..org",
                                  "*.*.pypi.org", "pypi.org..", "a" * 64 + ".org", "*." + "a." * 126 + "b", "",
                                  "*.", "pypi.org/simple", "pypi.org:443", "py_pi.org"])
def test_what_is_no_host_name_is_refused(text: str) -> None:
    with pytest.raises(InvalidPolicy, match="allowed domain"):
        allowed_domain(text)
    assert allowed_name(text, ["pypi.org", "*.pypi.org", "*.org"]) is None


# -- every place a domain enters -----------------------------------------------------------------

def test_grpc_create_and_update_refuse_a_non_ascii_domain(sandboxd_daemon: Any, tmp_path: Path) -> None:
    from daemon_helpers import create_session
    from sandboxd.v1 import sandboxd_pb2 as pb

    d = sandboxd_daemon()
    workspace = sandboxd_daemon.workspace()

    def policy(*domains: str) -> pb.SandboxPolicy:
        return pb.SandboxPolicy(mode=pb.SandboxPolicy.WORKSPACE_WRITE, network_access=True,
                                allowed_domains=list(domains))
    for name in ("pÿpi.org", "١٢.com"):
        with pytest.raises(grpc.RpcError) as refused:
            create_session(d.stub, workspace, policy(name))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "is not ASCII" in refused.value.details() and "xn--" in refused.value.details()
    session = create_session(d.stub, workspace, pb.SandboxPolicy(mode=pb.SandboxPolicy.WORKSPACE_WRITE))
    with pytest.raises(grpc.RpcError) as refused:
        d.stub.UpdateSessionPolicy(pb.UpdateSessionPolicyRequest(session_id=session.id,
                                                                 sandbox_policy=policy("pÿpi.org")))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
    assert "e.g. 'xn--ppi-toa.org'" in refused.value.details()
    # The control: the A-label goes through both, as given.
    updated = d.stub.UpdateSessionPolicy(pb.UpdateSessionPolicyRequest(session_id=session.id,
                                                                       sandbox_policy=policy("xn--ppi-toa.org")))
    assert list(updated.sandbox_policy.allowed_domains) == ["xn--ppi-toa.org"]
    created = create_session(d.stub, workspace, policy("XN--9HBC.com"))
    assert list(created.sandbox_policy.allowed_domains) == ["xn--9hbc.com"]


def test_sandboxd_run_refuses_a_non_ascii_domain(workspace: Path) -> None:
    result = subprocess.run([SANDBOXD, "run", "--workspace", str(workspace), "--network", "--allow-domain",
                             "pÿpi.org", "--", "true"], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "allowed domain 'pÿpi.org' is not ASCII" in result.stderr and "'xn--ppi-toa.org'" in result.stderr, \
        result.stderr
    assert "Traceback" not in result.stderr


def test_a_stored_session_with_a_non_ascii_domain_is_closed_at_restore_saying_why(sandboxd_daemon: Any) -> None:
    """An older sandboxd took ``pÿpi.org`` and kept the session open in its store: this one starts
    anyway, closes that session with a SessionClosed event that says why (neither resumed with
    the name dropped, which would widen or narrow it, nor an error at start), and resumes the rest."""
    from sandboxd.audit.store import SessionRow, open_in_state_dir
    from sandboxd.v1 import sandboxd_pb2 as pb

    d = sandboxd_daemon.prepare()
    workspace = sandboxd_daemon.workspace()
    old = {"name": "workspace-write", "network_access": True, "network_mode": "isolated",
           "allowed_domains": ["pÿpi.org"]}
    store = open_in_state_dir(str(d.base / "state"))
    try:
        for session_id, policy in (("old-unicode", old), ("old-plain", {**old, "allowed_domains": ["pypi.org"]})):
            store.save_session(SessionRow(session_id, 0, 0, "", str(workspace), policy, "never", {}, {}, {}, 1.0, None))
    finally:
        store.close()
    d.start()
    listed = {s.id for s in d.stub.ListSessions(pb.ListSessionsRequest()).sessions}
    assert "old-plain" in listed and "old-unicode" not in listed, listed
    closed = [e for e in d.stub.QueryEvents(pb.QueryEventsRequest(session_id="old-unicode")).events
              if e.type == "SessionClosed"]
    assert len(closed) == 1, closed
    assert "allowed domain 'pÿpi.org' is not ASCII" in json.loads(closed[0].data_json)["reason"], closed
    everything = {s.id for s in d.stub.ListSessions(pb.ListSessionsRequest(include_closed=True)).sessions}
    assert "old-plain" in everything and "old-unicode" not in everything, everything   # listed, without error
