"""The generated gRPC code in sandboxd/v1 is committed (this proves it is current), and what the wire carries of issue 26."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
GENERATED = ("sandboxd_pb2.py", "sandboxd_pb2_grpc.py", "sandboxd_pb2.pyi")


def test_generated_code_matches_the_proto(tmp_path: Path) -> None:
    """Regenerate from protos/sandboxd/v1/sandboxd.proto and compare byte for byte. If this fails,
    run: python -m grpc_tools.protoc -Iprotos --python_out=. --grpc_python_out=. --pyi_out=.
    protos/sandboxd/v1/sandboxd.proto"""
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{REPO / 'protos'}", f"--python_out={tmp_path}",
                    f"--grpc_python_out={tmp_path}", f"--pyi_out={tmp_path}",
                    str(REPO / "protos" / "sandboxd" / "v1" / "sandboxd.proto")], check=True)
    for name in GENERATED:
        fresh = (tmp_path / "sandboxd" / "v1" / name).read_text()
        committed = (REPO / "sandboxd" / "v1" / name).read_text()
        assert fresh == committed, f"sandboxd/v1/{name} is stale: regenerate it (see this test's docstring)"


def test_service_has_the_documented_calls() -> None:
    from sandboxd.v1 import sandboxd_pb2
    methods = {m.name for m in sandboxd_pb2.DESCRIPTOR.services_by_name["Sandbox"].methods}
    assert {"CreateSession", "GetSession", "ListSessions", "CloseSession", "UpdateSessionPolicy", "Exec"} <= methods


# -- issue 26's fields: the policy's network rules and the credentials' secrets --------------------

def _network_policy(**fields: object) -> "object":
    from sandboxd.v1 import sandboxd_pb2 as pb

    return pb.SandboxPolicy(mode=pb.SandboxPolicy.WORKSPACE_WRITE, network_access=True, **fields)  # type: ignore[arg-type]


def test_network_rules_cross_the_wire_canonical_and_back() -> None:
    from sandboxd.policy.network import Unlisted
    from sandboxd.service.convert import policy_from_proto, policy_to_proto

    message = _network_policy(allowed_domains=["*.github.com"], allowed_endpoints=["api.github.com=get:/repos/**"],
                              unlisted="ask", credentials=["GH_TOKEN=https://api.github.com:443"])
    policy = policy_from_proto(message)  # type: ignore[arg-type]
    assert policy.unlisted is Unlisted.ASK and policy.proxied
    echoed = policy_to_proto(policy)
    assert list(echoed.allowed_endpoints) == ["api.github.com=GET:/repos/**"]
    assert list(echoed.credentials) == ["GH_TOKEN=https://api.github.com"] and echoed.unlisted == "ask"
    assert policy_from_proto(echoed) == policy
    assert policy_to_proto(policy_from_proto(_network_policy())).unlisted == ""     # refuse: the default, empty


def test_credential_secrets_are_checked_against_the_policy_and_never_echoed() -> None:
    from sandboxd.errors import InvalidPolicy
    from sandboxd.policy.network import DaemonSecret
    from sandboxd.service.convert import credential_secrets_from_proto, policy_from_proto
    from sandboxd.v1 import sandboxd_pb2 as pb

    policy = policy_from_proto(_network_policy(credentials=["A=https://a.test", "B=https://b.test"]))  # type: ignore[arg-type]
    secrets = {"A": pb.CredentialSecret(value=b"tok-A"), "B": pb.CredentialSecret(daemon_secret="github")}
    assert credential_secrets_from_proto(secrets, policy) == {"A": b"tok-A", "B": DaemonSecret("github")}
    assert credential_secrets_from_proto({"A": secrets["A"]}, policy, known=frozenset({"B"})) == {"A": b"tok-A"}
    for bad, says in (({"A": secrets["A"]}, "credential B has no secret"),
                      ({**secrets, "C": secrets["A"]}, "credential_secrets has 3 entries; the limit is 2"),
                      ({"A": secrets["A"], "C": secrets["A"]}, "credential B has no secret"),
                      ({"A": pb.CredentialSecret(value=b"tok\r\nX: 1"), "B": secrets["B"]}, "a character a header"),
                      ({"A": pb.CredentialSecret(), "B": secrets["B"]}, "the secret of A is empty"),
                      ({"A": secrets["A"], "B": pb.CredentialSecret(daemon_secret="../x")}, "daemon secret '../x'")):
        with pytest.raises(InvalidPolicy, match=re.escape(says)) as refused:
            credential_secrets_from_proto(bad, policy)
        assert "tok" not in str(refused.value)
    assert "tok" not in str(policy_to_session_fields(policy))


def policy_to_session_fields(policy: "object") -> str:
    """Everything the wire echoes of a policy, as text (the secret is not in it to find)."""
    from sandboxd.service.convert import policy_to_proto

    return str(policy_to_proto(policy))  # type: ignore[arg-type]


def test_credential_states_and_the_approval_fields_exist_on_the_wire() -> None:
    from sandboxd.policy.network import CredentialState
    from sandboxd.service.convert import credential_states_to_proto
    from sandboxd.v1 import sandboxd_pb2 as pb

    states = credential_states_to_proto([CredentialState("GH", "https://api.github.com:443", "caller", False)])
    session = pb.Session(credential_states=states)
    assert pb.Session.FromString(session.SerializeToString()).credential_states[0].usable is False
    assert pb.ResolveApprovalRequest(rule="a.test=GET:/x").rule and pb.PendingApproval(proposal="a.test").proposal
    fields = {f.name: f.number for f in pb.SandboxPolicy.DESCRIPTOR.fields}
    assert (fields["allowed_endpoints"], fields["unlisted"], fields["credentials"]) == (11, 12, 13)
    assert pb.CreateSessionRequest.DESCRIPTOR.fields_by_name["credential_secrets"].number == 12
    assert pb.UpdateSessionPolicyRequest.DESCRIPTOR.fields_by_name["credential_secrets"].number == 4


def test_the_gateway_fields_have_their_numbers_and_round_trip() -> None:
    """Round 9's fields (sandboxd mcp --gateway): hide_home 14 of SandboxPolicy, typed through the policy
    model and echoed; runs_in_session_id 10 of AuthorizeRequest."""
    from sandboxd.errors import InvalidPolicy
    from sandboxd.policy.spec import policy_from_dict, policy_to_dict
    from sandboxd.service.convert import policy_from_proto, policy_to_proto
    from sandboxd.v1 import sandboxd_pb2 as pb

    assert pb.SandboxPolicy.DESCRIPTOR.fields_by_name["hide_home"].number == 14
    assert pb.AuthorizeRequest.DESCRIPTOR.fields_by_name["runs_in_session_id"].number == 10
    for mode in (pb.SandboxPolicy.READ_ONLY, pb.SandboxPolicy.WORKSPACE_WRITE):
        policy = policy_from_proto(pb.SandboxPolicy(mode=mode, hide_home=True))
        assert policy.hide_home and policy_to_proto(policy).hide_home
        assert policy_from_dict(policy_to_dict(policy)) == policy        # the store keeps it
    assert not policy_to_proto(policy_from_proto(pb.SandboxPolicy())).hide_home
    with pytest.raises(InvalidPolicy, match="hide the home"):
        policy_from_proto(pb.SandboxPolicy(mode=pb.SandboxPolicy.DANGER_FULL_ACCESS, hide_home=True))
