"""`sandboxd mcp --gateway FILE`: the names, effects, policy and MCP surface of the gateway.

The first tests read the pure parts (exposed names over generated names, effects and what a
session shows, the redaction and bound of the audited arguments); the rest drive the real
gateway (the `sandboxd mcp` command) with the official Python SDK client, against a real daemon
and real upstream servers (tests/mcp_gateway_servers.py) in their own sessions: names and
descriptions, held calls answered by elicitation, the audit log, what an untrusted server's call
gets, permission mode read_only, standing rules, list_changed, a bad gateway file."""

from __future__ import annotations

import json
import re
import urllib.parse

import mcp_types as types
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sandboxd.mcp.gateway import authorize, naming
from sandboxd.mcp.gateway.config import GatewayConfig, ToolOverride, UpstreamConfig
from sandboxd.mcp.gateway.effects import ToolPolicy, hidden_because, tool_policy
from sandboxd.v1 import sandboxd_pb2 as pb

EXPOSED = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")

# -- names -----------------------------------------------------------------------------------------

upstream_names = st.from_regex(naming.UPSTREAM_NAME, fullmatch=True)
# Names as an upstream might list them: plain ones, ones with dots and slashes, long ones, any text.
tool_names = st.one_of(st.from_regex(r"[a-z_]{1,70}", fullmatch=True), st.from_regex(r"[a-z.]{1,12}", fullmatch=True),
                       st.text(min_size=0, max_size=80))


@settings(max_examples=300, deadline=None)
@given(upstream=upstream_names, originals=st.lists(tool_names, max_size=40))
def test_exposed_names_are_valid_unique_and_lead_back(upstream: str, originals: list[str]) -> None:
    names = naming.Names(upstream, originals)
    pairs = names.items()
    exposed = [name for _original, name in pairs]
    assert len(set(exposed)) == len(exposed)                               # no two collide
    assert all(EXPOSED.match(name) and name.startswith(upstream + "__") for name in exposed)
    assert {original for original, _name in pairs} == set(originals)       # none left out
    for original, name in pairs:
        assert names.original(name) == original and names.exposed(original) == name
        assert naming.split(name) == (upstream, name[len(upstream) + 2:])
    # A name that needs no change keeps it, whatever else is listed (an empty one gets a hash).
    for original in originals:
        if original and EXPOSED.match(f"{upstream}__{original}"):
            assert names.exposed(original) == f"{upstream}__{original}"


def test_a_sanitized_or_long_name_gets_a_hash_suffix() -> None:
    long = "x" * 80
    names = naming.Names("gh", ["a_b", "a.b", "a b", long])
    assert names.exposed("a_b") == "gh__a_b"                               # the clean one keeps its name
    assert re.fullmatch(r"gh__a_b-[0-9a-f]{8}", names.exposed("a.b") or "")
    assert re.fullmatch(r"gh__a_b-[0-9a-f]{8}", names.exposed("a b") or "")
    assert names.exposed("a.b") != names.exposed("a b")
    assert len(names.exposed(long) or "") == 64 and names.original(names.exposed(long) or "") == long
    assert naming.Names("gh", ["only.dots"]).exposed("only.dots") == "gh__only_dots"  # no collision: no hash
    assert naming.split("shell") is None and naming.split("Bad__x") is None


def test_names_of_different_upstreams_never_collide() -> None:
    # Upstream names have no "_": the first "__" is where an upstream's name ends.
    first, second = naming.Names("a", ["b__c"]), naming.Names("a-b", ["c"])
    assert first.exposed("b__c") == "a__b__c" and second.exposed("c") == "a-b__c"
    assert naming.split("a__b__c") == ("a", "b__c")


@settings(max_examples=200, deadline=None)
@given(upstream=upstream_names, uri=st.text(max_size=200))
def test_resource_uris_round_trip(upstream: str, uri: str) -> None:
    exposed = naming.resource_uri(upstream, uri)
    assert exposed.startswith(f"sandboxd-gateway://{upstream}/")
    assert "/" not in exposed[len(f"sandboxd-gateway://{upstream}/"):]
    assert naming.resource_origin(exposed) == (upstream, uri)
    assert urllib.parse.urlsplit(exposed).netloc == upstream


def test_a_uri_of_no_upstream_is_none() -> None:
    assert naming.resource_origin("file:///etc/passwd") is None
    assert naming.resource_origin("sandboxd-gateway://Bad_Name/x") is None
    assert naming.resource_origin("sandboxd-gateway://fs") is None


# -- effects and what a session shows ----------------------------------------------------------------

READ_HINT = types.ToolAnnotations(read_only_hint=True)
DESTROY_HINT = types.ToolAnnotations(destructive_hint=True)


def test_the_effect_comes_from_the_file_then_a_trusted_servers_hints_then_unknown() -> None:
    untrusted = UpstreamConfig(name="fs", command=("x",), tools={"write": ToolOverride(effect="workspace-write")})
    trusted = UpstreamConfig(name="fs", command=("x",), trusted=True,
                             tools={"read": ToolOverride(effect="destructive", risk="low")})
    assert tool_policy(untrusted, "write", DESTROY_HINT) == ToolPolicy("workspace-write", "medium", "override")
    # An untrusted server's hints are its own claim: they count for nothing.
    assert tool_policy(untrusted, "read", READ_HINT) == ToolPolicy("unknown-command", "high", "default")
    assert tool_policy(trusted, "list", READ_HINT) == ToolPolicy("read-only", "low", "annotations")
    assert tool_policy(trusted, "drop", DESTROY_HINT) == ToolPolicy("destructive", "high", "annotations")
    assert tool_policy(trusted, "other", None).effect == "unknown-command"
    assert tool_policy(trusted, "read", READ_HINT) == ToolPolicy("destructive", "low", "override")  # the file wins


def _session(mode: "pb.SandboxPolicy.Mode.ValueType" = pb.SandboxPolicy.WORKSPACE_WRITE, *, network: bool = False,
             permission_mode: str = "") -> pb.Session:
    return pb.Session(sandbox_policy=pb.SandboxPolicy(mode=mode, network_access=network),
                      permission_mode=permission_mode)


@pytest.mark.parametrize(("session", "shown"), [
    (_session(), {"read-only", "workspace-write", "unknown-command"}),
    (_session(network=True), {"read-only", "workspace-write", "unknown-command", "network"}),
    (_session(pb.SandboxPolicy.READ_ONLY), {"read-only", "unknown-command"}),
    (_session(pb.SandboxPolicy.READ_ONLY, permission_mode="read_only"), {"read-only"}),
    (_session(pb.SandboxPolicy.DANGER_FULL_ACCESS), {"read-only", "workspace-write", "unknown-command", "network",
                                                      "destructive"}),
])
def test_a_session_shows_the_effects_it_could_allow(session: pb.Session, shown: set[str]) -> None:
    effects = ("read-only", "workspace-write", "network", "destructive", "unknown-command")
    visible = {effect for effect in effects if hidden_because(session, ToolPolicy(effect, "high", "x")) is None}
    assert visible == shown
    if session.permission_mode:
        assert "read_only" in (hidden_because(session, ToolPolicy("unknown-command", "high", "x")) or "")


# -- the audited arguments ---------------------------------------------------------------------------

def test_secrets_are_redacted_wherever_they_appear() -> None:
    config = GatewayConfig(path="/g.toml", upstreams=(
        UpstreamConfig(name="gh", command=("x",), credentials=("GH_TOKEN=https://api.github.com",),
                       env={"API_KEY": "k3y-value-1", "MODE": "plain-value", "db_password": "hunter22"},
                       pass_env=("SESSION_SECRET", "HOME")),
    ))
    environ = {"GH_TOKEN": "ghp_abcdef123456", "SESSION_SECRET": "s3ss10n-s3cr3t", "HOME": "/home/me-home"}
    redactor = authorize.Redactor.of(config, environ)
    arguments = {"token": "ghp_abcdef123456", "header": "Bearer ghp_abcdef123456",
                 "nested": [{"k3y-value-1": "hunter22"}, "s3ss10n-s3cr3t"], "mode": "plain-value",
                 "home": "/home/me-home", "n": 3}
    audited = json.loads(authorize.arguments_json(arguments, redactor))
    assert audited == {"token": "[redacted]", "header": "Bearer [redacted]",
                       "nested": [{"[redacted]": "[redacted]"}, "[redacted]"], "mode": "plain-value",
                       "home": "/home/me-home", "n": 3}
    # The control: without the file's secrets nothing is replaced.
    assert json.loads(authorize.arguments_json(arguments, authorize.Redactor([]))) == arguments


def test_a_short_secret_is_replaced_only_whole() -> None:
    redactor = authorize.Redactor(["abc"])
    assert redactor.value({"a": "abc", "b": "abcdef"}) == {"a": "[redacted]", "b": "abcdef"}


def test_arguments_over_16_kib_keep_their_head() -> None:
    arguments = {"content": "é" * 20000, "path": "x"}
    audited = authorize.arguments_json(arguments, authorize.Redactor([]))
    data = json.loads(audited)
    whole = json.dumps(arguments, separators=(",", ":"))
    assert data["truncated"] is True and data["bytes"] == len(whole) > authorize.ARGUMENTS_LIMIT
    assert data["head"] == whole[:authorize.ARGUMENTS_LIMIT]
    assert len(audited) < authorize.ARGUMENTS_LIMIT + 4096
    small = {"content": "x" * 100}
    assert json.loads(authorize.arguments_json(small, authorize.Redactor([]))) == small
