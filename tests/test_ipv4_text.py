"""Addresses and ports given as text are read one way (sandboxd/policy/ipv4.py, on ``ipaddress``):
the three places that take an IPv4 address (a LaunchSpec's DNS servers, a policy's allowed hosts,
the daemon's network.dns) and the two that take ports (allowed hosts, published ports) refuse
digits of other scripts (``int("٤٤٣") == 443``), leading zeros (octal to inet_aton), signs and
spaces, each with a message that says what to fix; the well-formed text next to each is accepted.
The daemon's answer to the same (INVALID_ARGUMENT) is tested in tests/test_bad_inputs.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from sandboxd import config
from sandboxd.errors import InvalidPolicy
from sandboxd.policy import LaunchSpec, policy_from_name
from sandboxd.policy.sandbox import parse_allowed_host, parse_publish

ARABIC_INDIC_EIGHT = "\u0668"          # int() reads it as 8
ARABIC_INDIC_443 = "\u0664\u0664\u0663"
FULLWIDTH_ONE = "\uff11"

BAD_ADDRESSES = [
    (f"{ARABIC_INDIC_EIGHT}.8.8.8", "Only decimal digits"),
    (f"192.0.2.{FULLWIDTH_ONE}", "Only decimal digits"),
    ("192.0.2.053", "Leading zeros"),
    ("010.0.0.1", "Leading zeros"),
    ("192.0.2", "Expected 4 octets"),
    ("192.0.2.256", "> 255"),
    ("192.0.2.+5", "Only decimal digits"),
    (" 192.0.2.5", "Only decimal digits"),
]


@pytest.mark.parametrize("text, why", BAD_ADDRESSES)
def test_dns_servers_of_a_launch_refuse_malformed_addresses(text: str, why: str) -> None:
    with pytest.raises(InvalidPolicy) as refused:
        LaunchSpec(argv=("true",), workspace="/", dns=(text,))
    assert f"DNS server {text!r} must be an IPv4 address such as 192.0.2.53" in str(refused.value)
    assert why in str(refused.value)
    assert LaunchSpec(argv=("true",), workspace="/", dns=("192.0.2.53",)).dns == ("192.0.2.53",)   # control


@pytest.mark.parametrize("text, why", BAD_ADDRESSES)
def test_allowed_hosts_refuse_malformed_addresses(text: str, why: str) -> None:
    for entry in (text, f"{text}/24", f"{text}:443"):
        with pytest.raises(InvalidPolicy) as refused:
            parse_allowed_host(entry)
        assert "give an IPv4 address or CIDR" in str(refused.value) and why in str(refused.value)
    with pytest.raises(InvalidPolicy, match="give an IPv4 address or CIDR"):
        policy_from_name("workspace-write", network_access=True, allowed_hosts=[text])


@pytest.mark.parametrize("entry, why", [
    (f"192.0.2.0/{ARABIC_INDIC_EIGHT}", "ASCII digits"),
    ("192.0.2.0/33", "not a valid netmask"),
    ("192.0.2.0/", "ASCII digits"),
    (f"192.0.2.7:{ARABIC_INDIC_443}", "ASCII digits"),
    ("192.0.2.7:+443", "ASCII digits"),
    ("192.0.2.7:0", "ports go from 1 to 65535"),
    ("192.0.2.7:9000-8000", "goes downward"),
])
def test_allowed_hosts_refuse_malformed_prefixes_and_ports(entry: str, why: str) -> None:
    with pytest.raises(InvalidPolicy) as refused:
        parse_allowed_host(entry)
    assert why in str(refused.value), str(refused.value)


def test_well_formed_allowed_hosts_read_as_before() -> None:
    assert parse_allowed_host("203.0.113.7") == ("203.0.113.7/32", ())
    assert parse_allowed_host("198.51.100.0/24:443") == ("198.51.100.0/24", ((443, 443),))
    assert parse_allowed_host("192.0.2.1:8000-8100,9000") == ("192.0.2.1/32", ((8000, 8100), (9000, 9000)))
    # Host bits set: the network they are in, as nft would read it.
    assert parse_allowed_host("198.51.100.7/24") == ("198.51.100.0/24", ())


@pytest.mark.parametrize("entry", [ARABIC_INDIC_443, f"18000:{ARABIC_INDIC_443}", f"{ARABIC_INDIC_443}:80",
                                   "+80", " 80", "8_0", "70000:80", "0"])
def test_published_ports_refuse_anything_but_ascii_ports(entry: str) -> None:
    with pytest.raises(InvalidPolicy) as refused:
        parse_publish(entry)
    message = str(refused.value)
    assert f"publish {entry!r}: give [HOSTPORT:]PORT" in message
    assert "ASCII digits" in message or "ports go from 1 to 65535" in message, message
    assert parse_publish("18000:8000") == (18000, 8000) and parse_publish("8000") == (8000, 8000)   # control


@pytest.mark.parametrize("text, why", BAD_ADDRESSES[:4])
def test_the_daemons_dns_setting_refuses_malformed_addresses(tmp_path: Path, text: str, why: str) -> None:
    path = tmp_path / "sandboxd.toml"
    path.write_text(f'[network]\ndns = ["{text}"]\n', encoding="utf-8")
    with pytest.raises(config.ConfigError) as refused:
        config.read_file(str(path))
    assert f"network.dns: {text!r} is not an IPv4 address" in str(refused.value) and why in str(refused.value)
    path.write_text('[network]\ndns = ["192.0.2.53"]\n')
    assert config.read_file(str(path)).texts("network.dns") == ("192.0.2.53",)          # control
