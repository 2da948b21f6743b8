"""The egress proxy's DNS client (sandboxd/network/dns.py, on dnspython) against stand-in resolvers
on loopback addresses: it takes the A record of a matching answer, skips a resolver whose reply is
not the answer to its question (another id: a forged or stray reply) or that does not answer, and
says so (OSError) when no resolver gives an address. End to end through the proxy:
tests/test_isolated_network.py (allowed domains)."""

from __future__ import annotations

import random
import socket
import threading
from collections.abc import Callable, Iterator

import dns.exception
import dns.message
import dns.rrset
import pytest

from sandboxd.network.dns import resolve

Answer = Callable[[dns.message.Message], "bytes | None"]


def _a_record(address: str) -> Answer:
    def answer(query: dns.message.Message) -> bytes:
        reply = dns.message.make_response(query)
        reply.answer.append(dns.rrset.from_text(query.question[0].name, 60, "IN", "A", address))
        return reply.to_wire()
    return answer


def _wrong_id(address: str) -> Answer:
    def answer(query: dns.message.Message) -> bytes:
        query.id ^= 0x5A5A
        return _a_record(address)(query)
    return answer


def _no_address(query: dns.message.Message) -> bytes:
    return dns.message.make_response(query).to_wire()      # NOERROR, no answer


@pytest.fixture
def resolvers() -> Iterator[Callable[[Answer], str]]:
    """Start a stand-in resolver on a fresh 127.x.y.z:53; returns its address."""
    sockets: list[socket.socket] = []
    threads: list[threading.Thread] = []
    stop = threading.Event()

    def start(answer: Answer) -> str:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.settimeout(0.1)              # so the thread sees ``stop``: closing does not wake a recvfrom
        for _ in range(20):
            address = f"127.{random.randrange(1, 250)}.{random.randrange(1, 250)}.{random.randrange(2, 250)}"
            try:
                sock.bind((address, 53))
                break
            except OSError:
                continue
        sockets.append(sock)

        def serve() -> None:
            while not stop.is_set():
                try:
                    data, client = sock.recvfrom(4096)
                except TimeoutError:
                    continue
                except OSError:
                    return
                try:
                    question = dns.message.from_wire(data)
                except dns.exception.DNSException:
                    continue                  # not a query this stand-in can answer: like a real server, drop it
                reply = answer(question)
                if reply is not None:
                    sock.sendto(reply, client)
        thread = threading.Thread(target=serve, name=f"resolver-{address}", daemon=True)
        thread.start()
        threads.append(thread)
        return address
    yield start
    stop.set()
    for thread in threads:
        thread.join(5)
    for sock in sockets:
        sock.close()


def test_the_answer_to_the_question_is_taken(resolvers: Callable[[Answer], str]) -> None:
    assert resolve("internet.test", [resolvers(_a_record("198.51.100.10"))]) == "198.51.100.10"


def test_a_reply_to_another_question_is_not_the_answer(resolvers: Callable[[Answer], str]) -> None:
    forged, honest = resolvers(_wrong_id("203.0.113.66")), resolvers(_a_record("198.51.100.10"))
    assert resolve("internet.test", [forged, honest]) == "198.51.100.10"
    with pytest.raises(OSError, match="cannot resolve internet.test"):
        resolve("internet.test", [forged])


def test_no_address_from_any_resolver_is_an_error(resolvers: Callable[[Answer], str]) -> None:
    with pytest.raises(OSError, match="cannot resolve nothing.test"):
        resolve("nothing.test", [resolvers(_no_address)])


def test_a_name_no_query_can_carry_is_an_error() -> None:
    with pytest.raises(OSError, match="cannot resolve"):
        resolve("a" * 64 + ".test", ["192.0.2.53"])        # a label longer than 63 bytes
