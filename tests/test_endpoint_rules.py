"""Endpoint rules, credential specifications and the policy advisor (``sandboxd.policy.network``,
``sandboxd.policy.network_advice``): pure, no kernel, no daemon.

The glob matcher is checked three ways: the design's table (docs/networks.md), a differential
against a reference regular expression translation of the same semantics on generated globs and
paths (hypothesis), and the normalization refusals that come before any match."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sandboxd.errors import InvalidPolicy
from sandboxd.policy.network import (
    CredentialSpec,
    EndpointRule,
    NetworkRules,
    Unlisted,
    check_secret,
    check_secrets_match,
    covers,
    endpoint_allowed,
    metadata_address,
    metadata_name,
    normalize_path,
    parse_credential,
    parse_endpoint,
    path_matches,
    why_not_normal,
)
from sandboxd.policy.network_advice import Proposal, propose

# -- the glob: the design's table, exactly ----------------------------------------------------------

TABLE = [
    ("/repos/*/issues/**", ["/repos/a/issues", "/repos/a/issues/", "/repos/a/issues/1/comments"],
     ["/repos/a/b/issues", "/repos/a/issue"]),
    ("/repos/*", ["/repos/a", "/repos/"], ["/repos/a/", "/repos"]),
    ("/**", ["/", "/a", "/a/b/c/", "//"], []),
    ("/v1/messages", ["/v1/messages"], ["/v1/messages/", "/V1/messages"]),
    ("/files/*.tar.gz", ["/files/x.tar.gz", "/files/.tar.gz"], ["/files/a/x.tar.gz", "/files/x.tar.gzz"]),
    ("/a/*/b", ["/a//b", "/a/x/b"], ["/a/b", "/a/x/y/b"]),
    ("/v1/*.json", ["/v1/a.json", "/v1/.json"], ["/v1/a.jsonx", "/v1/a/b.json"]),
    ("/a/**/b", ["/a/b", "/a/x/b", "/a/x/y/b"], ["/a/x/y/c", "/b"]),
]


@pytest.mark.parametrize("glob, yes, no", TABLE, ids=[row[0] for row in TABLE])
def test_the_glob_table(glob: str, yes: list[str], no: list[str]) -> None:
    for path in yes:
        assert path_matches(glob, path), (glob, path)
    for path in no:
        assert not path_matches(glob, path), (glob, path)


def test_a_path_with_dot_segments_is_refused_before_it_is_matched() -> None:
    """``/repos/a/issues/../../gists`` would match ``/repos/*/issues/**`` as text: it never gets there."""
    assert path_matches("/repos/*/issues/**", "/repos/a/issues/../../gists")         # the control: as text
    assert normalize_path("/repos/a/issues/../../gists") is None
    assert normalize_path("/v1/messages?beta=1") == "/v1/messages"                     # the query is not matched


# -- the differential: path_matches against a reference regex translation ------------------------

def _reference(glob: str) -> re.Pattern[str]:
    """The same semantics as a regular expression (only for the test: the code never builds one)."""
    parts = glob.split("/")
    out = re.escape(parts[0])
    for part in parts[1:]:
        if part == "**":
            out += "(?:/[^/]*)*"
        else:
            out += "/" + "[^/]*".join(re.escape(piece) for piece in part.split("*"))
    return re.compile(out)


_glob_segment = st.sampled_from(["a", "b", "ab", "", "*", "**", "a*", "*b", "a*b", "*a*", "**"])
_path_segment = st.sampled_from(["a", "b", "ab", "ba", "", "aab", "bab", "x"])


@settings(max_examples=2000, deadline=None, database=None)
@given(st.lists(_glob_segment, max_size=6), st.lists(_path_segment, max_size=7))
def test_path_matches_equals_the_reference_translation(glob_segments: list[str], path_segments: list[str]) -> None:
    glob, path = "/" + "/".join(glob_segments), "/" + "/".join(path_segments)
    assert path_matches(glob, path) == bool(_reference(glob).fullmatch(path)), (glob, path)


# -- normalization -------------------------------------------------------------------------------

@pytest.mark.parametrize("target, normal", [
    ("/a/b", "/a/b"), ("/a/%7e%41", "/a/~A"), ("/a/%2a", "/a/%2A"), ("/a%3bb", "/a%3Bb"), ("/a/b?c=%2F", "/a/b"),
    ("/a/.b/..c/...", "/a/.b/..c/..."), ("/a;x/b", "/a;x/b"),
])
def test_normalization_decodes_unreserved_and_upper_cases_the_rest(target: str, normal: str) -> None:
    assert normalize_path(target) == normal
    assert why_not_normal(target) == ""


@pytest.mark.parametrize("target, says", [
    ("/a/%2e%2e/b", "'.' or '..' segment"), ("/a/%2E/b", "'.' or '..' segment"), ("/a/../b", "'..' segment"),
    ("/a/..;x/b", "'..' segment"), ("/a/.;x", "'.' or '..'"), ("/a/.", "'.' or '..'"),
    ("/a%2fb", "escaped slash"), ("/a%5Cb", "escaped backslash"), ("/a%00", "escaped NUL"), ("/a\\b", "backslash"),
    ("/a%zz", "two hex digits"), ("/a%2", "two hex digits"), ("/a\x01b", "visible ASCII"), ("/a b", "visible ASCII"),
    ("/caf\u00e9", "visible ASCII"), ("a/b", "not a path"), ("*", "not a path"), ("http://h/a", "not a path"),
    ("/a#b", "fragment"), ("/a" * 129, "more than 128 segments"), ("/" * 129, "more than 128 segments"),
])
def test_an_ambiguous_path_is_refused_saying_why(target: str, says: str) -> None:
    assert normalize_path(target) is None
    assert says in why_not_normal(target)


# -- rules: syntax -------------------------------------------------------------------------------

def test_an_endpoint_rule_parses_into_its_canonical_form() -> None:
    rule = parse_endpoint(" API.GitHub.com =get, head ,GET:/repos/%7euser/*/issues/**")
    assert rule == EndpointRule("api.github.com", ("GET", "HEAD"), "/repos/~user/*/issues/**")
    assert parse_endpoint(rule.text()) == rule and rule.text() == "api.github.com=GET,HEAD:/repos/~user/*/issues/**"
    assert parse_endpoint("*.example.com=*:/**").methods == ("*",)
    assert parse_endpoint("*=GET:/health").host == "*"


@pytest.mark.parametrize("text, says", [
    ("api.github.com", "HOST=METHODS:PATH-GLOB"), ("api.github.com=GET", "HOST=METHODS:PATH-GLOB"),
    ("10.0.0.1=GET:/", "its host"), ("api.github.com=:/a", "method ''"), ("h.com=G ET:/a", "method 'G ET'"),
    ("h.com=GET,*:/a", "method '*'"), ("h.com=GET:a/b", "must start with '/'"), ("h.com=GET:/a?b", "query"),
    ("h.com=GET:/a#b", "query"), ("h.com=GET:/a**b", "'**' stands alone"), ("h.com=GET:/**x", "'**' stands alone"),
    ("h.com=GET:/a/../b", "'.' or '..'"), ("h.com=GET:" + "/*" * 65, "more than 64 segments"), ("h.com=GET:/a%2Fb", "escaped slash"), ("h.com=GET:/" + "a" * 1024, "1024"),
])
def test_a_bad_endpoint_rule_is_refused_saying_what_to_give(text: str, says: str) -> None:
    with pytest.raises(InvalidPolicy, match=re.escape(says)):
        parse_endpoint(text)


def test_a_method_matches_exactly_and_get_does_not_imply_head() -> None:
    rules = (parse_endpoint("h.com=GET:/a/**"),)
    assert endpoint_allowed(rules, "GET", "/a/b")
    assert not endpoint_allowed(rules, "HEAD", "/a/b") and not endpoint_allowed(rules, "get", "/a/b")
    assert not endpoint_allowed(rules, "GET", "/b") and not endpoint_allowed((), "GET", "/a")
    assert endpoint_allowed((parse_endpoint("h.com=*:/a"),), "PATCH", "/a")


def test_network_rules_allow_ruled_and_intercept() -> None:
    rules = NetworkRules(("*.github.com", "pypi.org"),
                         (parse_endpoint("api.github.com=GET:/repos/**"), parse_endpoint("*.github.com=POST:/graphql")),
                         (parse_credential("T=https://uploads.example.com:8443"),), Unlisted.ASK)
    assert rules.allowed("api.github.com", 1) and rules.allowed("pypi.org", 443)
    assert not rules.allowed("github.com", 443)                                    # "*." is subdomains only
    assert rules.allowed("uploads.example.com", 8443) and not rules.allowed("uploads.example.com", 443)
    assert [rule.methods for rule in rules.ruled("api.github.com")] == [("GET",), ("POST",)]   # the union
    assert [rule.methods for rule in rules.ruled("gist.github.com")] == [("POST",)]
    assert rules.intercepts("api.github.com", 443) and rules.intercepts("uploads.example.com", 8443)
    assert not rules.intercepts("pypi.org", 443) and not rules.intercepts("uploads.example.com", 443)
    assert NetworkRules(("*",)).allowed("anything.test", 22)


def test_covers_says_whether_a_domain_entry_allows_every_name_of_another() -> None:
    assert covers("*.github.com", "api.github.com") and covers("*.github.com", "*.api.github.com")
    assert covers("*", "*.x.com") and covers("*", "*") and covers("x.com", "x.com")
    assert not covers("*.github.com", "github.com") and not covers("api.github.com", "*.github.com")
    assert not covers("*.x.com", "*") and not covers("*.b.com", "*.ab.com")


# -- credentials -------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, spec", [
    ("GITHUB_TOKEN=https://api.github.com", CredentialSpec("GITHUB_TOKEN", "api.github.com")),
    ("K=https://API.example.com:8443/", CredentialSpec("K", "api.example.com", 8443)),
    ("K=https://api.example.com;x-api-key: {}", CredentialSpec("K", "api.example.com", 443, "x-api-key", "{}")),
    ("K=https://h.test;Authorization: token {}", CredentialSpec("K", "h.test", 443, "Authorization", "token {}")),
    ("G=https://git.test;basic:git", CredentialSpec("G", "git.test", 443, "Authorization", "Basic {}", "git")),
    ("G=https://git.test;basic", CredentialSpec("G", "git.test", 443, "Authorization", "Basic {}", "")),
])
def test_a_credential_parses_and_its_text_comes_back(text: str, spec: CredentialSpec) -> None:
    assert parse_credential(text) == spec
    assert parse_credential(spec.text()) == spec
    assert spec.upstream == f"https://{spec.host}:{spec.port}"


@pytest.mark.parametrize("text, says", [
    ("https://api.github.com", "VAR=https://HOST"), ("1X=https://h.test", "letters, digits"),
    ("A-B=https://h.test", "letters, digits"), ("HTTPS_PROXY=https://h.test", "sandboxd sets HTTPS_PROXY"),
    ("K=http://h.test", "https://HOST"), ("K=https://10.0.0.1", "host name"), ("K=https://*.h.test", "host name"),
    ("K=https://h.test/v1", "host name"), ("K=https://user@h.test", "host name"), ("K=https://h.test:0", "1 to 65535"),
    ("K=https://h.test:99999", "1 to 65535"), ("K=https://h.test;x-api-key {}", "HEADER: TEMPLATE"),
    ("K=https://h.test;Host: {}", "frames the message"), ("K=https://h.test;Transfer-Encoding: {}", "frames"),
    ("K=https://h.test;x-k: Bearer", "exactly once"), ("K=https://h.test;x-k: {}{}", "exactly once"),
    ("K=https://h.test;x-k: {}\r\nX: y", "exactly once"), ("K=https://h.test;basic:", "needs a user"),
    ("K=https://h.test;basic:a:b", "without ':'"),
])
def test_a_bad_credential_is_refused_saying_what_to_give(text: str, says: str) -> None:
    with pytest.raises(InvalidPolicy, match=re.escape(says)):
        parse_credential(text)


def test_a_secret_is_checked_and_never_named_in_the_refusal() -> None:
    assert check_secret("T", b"ghp_abc") == b"ghp_abc"                                   # the control
    for bad in (b"", b"a" * ((8 << 10) + 1), b"tok\r\nX-Evil: 1", b"tok en", b"tok\x00", "\u00e9".encode()):
        with pytest.raises(InvalidPolicy) as refused:
            check_secret("T", bad)
        assert "T" in str(refused.value) and (not bad or bad.decode(errors="replace") not in str(refused.value))
    specs = (parse_credential("A=https://a.test"), parse_credential("B=https://b.test"))
    check_secrets_match(specs, ["A", "B"])
    check_secrets_match(specs, ["B"], known=["A"])
    with pytest.raises(InvalidPolicy, match="credential A has no secret"):
        check_secrets_match(specs, ["B"])
    with pytest.raises(InvalidPolicy, match="'C', which no credential"):
        check_secrets_match(specs, ["A", "B", "C"])


# -- metadata ------------------------------------------------------------------------------------

def test_metadata_names_and_addresses_in_every_spelling() -> None:
    for name in ("metadata.google.internal", "x.metadata.google.internal", "metadata", "instance-data"):
        assert metadata_name(name)
    assert not metadata_name("metadata.example.com") and not metadata_name("google.internal")
    for address in ("169.254.169.254", "::ffff:169.254.169.254", "64:ff9b::a9fe:a9fe", "fd00:ec2::254",
                    "100.100.100.200", "fd00:ec2::23"):
        assert metadata_address(address), address
    for address in ("169.254.169.253", "10.0.0.1", "::ffff:10.0.0.1", "not an address", "fe80::1%eth0"):
        assert not metadata_address(address), address


# -- the advisor -------------------------------------------------------------------------------------

GITHUB = NetworkRules(("api.github.com",), (parse_endpoint("api.github.com=GET:/repos/*/issues/**"),))


@pytest.mark.parametrize("method, path, rule", [
    ("POST", "/repos/acme/api/issues/123/comments", "api.github.com=POST:/repos/acme/api/issues/*/comments"),
    ("GET", "/repos/acme/commits/deadbeef1234?per_page=1", "api.github.com=GET:/repos/acme/commits/*"),
    ("DELETE", "/x/123e4567-e89b-12d3-a456-426614174000/y", "api.github.com=DELETE:/x/*/y"),
    ("GET", "/t/abcDEF123456ghij_k/v", "api.github.com=GET:/t/*/v"),
    ("GET", "/t/abcdefghijklmnopq/cafe/v2", "api.github.com=GET:/t/abcdefghijklmnopq/cafe/v2"),  # no digit; short hex
    ("GET", "/a**b/%7e", "api.github.com=GET:/*/~"),
])
def test_the_advisor_proposes_the_narrow_endpoint_rule(method: str, path: str, rule: str) -> None:
    proposal = propose("api.github.com", 443, method, path, GITHUB)
    assert proposal is not None and proposal.kind == "endpoint" and proposal.rule == rule


def test_the_advisor_proposes_the_exact_name_for_an_unlisted_host() -> None:
    assert propose("uploads.github.com", 443, "CONNECT", "", GITHUB) == \
        Proposal("domain", "uploads.github.com", "uploads.github.com is not among the allowed domains")
    assert propose("api.github.com", 443, "GET", "/a/../b", GITHUB) is None              # refused as ambiguous
    assert propose("api.github.com", 443, "get", "/a", GITHUB) is None                  # no rule can name "get"


@pytest.mark.parametrize("method", ["*", "G*T", "M-SEARCH", "GET,POST", "**"])
def test_a_method_that_is_not_letters_never_leads_to_a_proposal(method: str) -> None:
    """"*" would be proposed as a rule for any method (second hostile pass, M1)."""
    assert propose("api.github.com", 443, method, "/repos/a/pulls", GITHUB) is None
    assert propose("api.github.com", 443, "GET", "/repos/a/pulls", GITHUB) is not None          # control


@pytest.mark.parametrize("path", ["/a'b", '/a"b', "/a<b>", "/a`id`", "/a$b", "/a;b", "/a!b", "/a(b)", "/a&b"])
def test_a_proposal_holds_only_safe_characters(path: str) -> None:
    assert propose("api.github.com", 443, "GET", path, GITHUB) is None
    assert propose("api.github.com", 443, "GET", "/a:b@c+d,e=f", GITHUB) is not None            # control


_method = st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "M-SEARCH"])
_segment = st.one_of(
    st.text(alphabet="abcxyz0123456789-_.~*%;", max_size=20),
    st.uuids().map(str), st.integers(0, 10**12).map(str), st.text(alphabet="0123456789abcdef", min_size=7, max_size=40))


@settings(max_examples=1000, deadline=None, database=None)
@given(_method, st.lists(_segment, min_size=0, max_size=8), st.booleans())
def test_a_proposal_always_matches_the_request_that_made_it(method: str, segments: list[str], query: bool) -> None:
    """The advisor's property: its rule parses back to itself and lets the very request through."""
    target = "/" + "/".join(segments) + ("?q=1" if query else "")
    proposal = propose("api.github.com", 443, method, target, GITHUB)
    normal = normalize_path(target)
    if normal is None or not method.isalpha():                    # no rule names a method not letters
        assert proposal is None
        return
    if proposal is None:
        assert ";" in normal                                      # the one unsafe character of the alphabet
        return
    assert proposal is not None and proposal.kind == "endpoint"
    rule = parse_endpoint(proposal.rule)
    assert rule.text() == proposal.rule and "**" not in rule.path and rule.methods == (method,)
    assert endpoint_allowed((rule,), method, normal)
    assert NetworkRules(GITHUB.domains, (*GITHUB.endpoints, rule)).allowed("api.github.com", 443)


def test_matching_is_bounded_by_the_segment_caps() -> None:
    """The largest path and glob there may be match by comparisons, not a table: the last allowed
    sizes still match (the control for the refusals above)."""
    glob, path = "/**" + "/*" * 63, "/a" * 128
    assert parse_endpoint("h.com=GET:" + glob).path == glob and normalize_path(path) == path
    assert path_matches(glob, path) and not path_matches(glob + "x", path)
