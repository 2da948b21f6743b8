"""The one event loop of the network services (sandboxd/network/event_loop.py), on its own: its
timer heap (order, deadlines that move, discards), the acceptor's back-off (a listener with no room
leaves the epoll set, connections wait in the backlog, and are accepted once the back-off ends),
and a failing handler (closed, logged, and the loop goes on); its worker pools, fair between
owners (network/fair_pool.py). The front door and the relays on it: tests/test_peercred.py,
tests/test_relay_loop.py; one proxy's stuck lookups against another's: tests/test_egress_rules.py."""

from __future__ import annotations

import socket
import threading
import time

from sandboxd.network.event_loop import LOOKUP, READ, Acceptor, EventLoop
from sandboxd.network.fair_pool import FairPool


def _wait(predicate, seconds: float = 10.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


class _Deadline:
    def __init__(self, deadline: float, fired: list[str], name: str) -> None:
        self.deadline, self.fired, self.name = deadline, fired, name

    def expire(self) -> None:
        self.fired.append(self.name)


def test_timers_fire_in_deadline_order_and_moved_or_discarded_ones_wait() -> None:
    loop = EventLoop("test-loop").start()
    fired: list[str] = []
    try:
        now = time.monotonic()
        moved = _Deadline(now + 0.05, fired, "moved")
        dropped = _Deadline(now + 0.05, fired, "dropped")

        def arm() -> None:
            loop.later(0.2, lambda: fired.append("late"))
            loop.later(0.1, lambda: fired.append("early"))
            loop.add_timed(moved)
            loop.add_timed(dropped)
            moved.deadline = now + 0.4            # traffic since: its deadline moved
            loop.discard_timed(dropped)
        loop.call(arm)
        assert _wait(lambda: len(fired) == 3)
        assert fired == ["early", "late", "moved"]
        assert time.monotonic() >= now + 0.4      # not before its new deadline
        time.sleep(0.1)
        assert fired == ["early", "late", "moved"]                        # each once; the discarded never
    finally:
        loop.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("test-loop")]


def test_a_listener_without_room_rests_and_connections_wait_in_the_backlog() -> None:
    loop = EventLoop("test-accept").start()
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    room = threading.Event()
    starved: list[str] = []
    accepted: list[socket.socket] = []
    acceptor = Acceptor(loop, listener, lambda conn, _address: accepted.append(conn), name="test",
                        backoff=0.2, room=room.is_set, starved=starved.append)
    clients = []
    try:
        loop.call(acceptor.start)
        clients = [socket.create_connection(listener.getsockname()) for _ in range(3)]
        assert _wait(lambda: starved != [])
        assert starved[0] == "" and loop.call(lambda: acceptor.paused)
        time.sleep(0.5)                            # back-offs come and go: still no room, nothing taken
        assert accepted == []
        room.set()
        assert _wait(lambda: len(accepted) == 3)   # the next back-off's end takes the backlog
        assert not loop.call(lambda: acceptor.paused)
    finally:
        loop.call(acceptor.stop)
        for sock in clients + accepted + [listener]:
            sock.close()
        loop.close()


class _Exploding:
    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.closed = sock, threading.Event()

    def on_ready(self, _mask: int) -> None:
        raise RuntimeError("a bug in one connection")

    def close(self) -> None:
        self.closed.set()


def test_a_failing_handler_is_closed_and_the_loop_serves_the_others(caplog) -> None:  # type: ignore[no-untyped-def]
    loop = EventLoop("test-fail").start()
    bad_ours, bad_theirs = socket.socketpair()
    good_ours, good_theirs = socket.socketpair()
    bad = _Exploding(bad_ours)
    got = threading.Event()

    class _Good:
        def on_ready(self, _mask: int) -> None:
            good_ours.recv(16)
            got.set()

        def close(self) -> None:
            pass
    try:
        loop.call(lambda: loop.watch(bad_ours, 0, READ, bad))
        loop.call(lambda: loop.watch(good_ours, 0, READ, _Good()))
        bad_theirs.send(b"x")
        assert bad.closed.wait(10)
        assert "test-fail: a connection handler failed" in caplog.text
        good_theirs.send(b"y")
        assert got.wait(10)                        # the loop lives on
    finally:
        loop.call(lambda: loop.watch(bad_ours, READ, 0, bad))
        loop.close()
        for sock in (bad_ours, bad_theirs, good_ours, good_theirs):
            sock.close()


def test_an_owner_holds_at_most_its_share_of_the_threads_and_another_owner_runs_meanwhile() -> None:
    pool = FairPool("test-fair", 4, per_owner=2, max_queued=100)
    stuck = threading.Event()
    try:
        hog = [pool.submit("hog", stuck.wait) for _ in range(10)]
        assert _wait(lambda: pool.load("hog") == (2, 8))          # 10 asked, 2 run: its own queue holds 8
        other = pool.submit("other", lambda: "done")
        assert other is not None and other.result(timeout=30) == "done"
        assert pool.load("hog") == (2, 8) and not any(f.done() for f in hog if f is not None)   # still stuck
        # Control: without the per-owner cap the same 10 jobs take every thread.
        greedy = FairPool("test-greedy", 4, per_owner=4, max_queued=100)
        try:
            for _ in range(10):
                greedy.submit("hog", stuck.wait)
            assert _wait(lambda: greedy.load("hog") == (4, 6))
        finally:
            stuck.set()
            greedy.shutdown()
    finally:
        stuck.set()
        pool.shutdown()
    assert all(f is not None and f.done() for f in hog)                   # queued work ran, not dropped


def test_owners_take_turns_and_an_owners_full_queue_refuses_only_its_own_work() -> None:
    pool = FairPool("test-turns", 1, per_owner=1, max_queued=3)
    gate, order = threading.Event(), []
    try:
        pool.submit("a", gate.wait)
        assert _wait(lambda: pool.load("a") == (1, 0))
        for name in ("a1", "a2", "a3"):
            assert pool.submit("a", lambda name=name: order.append(name)) is not None
        assert pool.submit("a", lambda: order.append("a4")) is None           # 3 waiting: its 4th refused
        for name in ("b1", "b2"):                                           # another owner's is not
            assert pool.submit("b", lambda name=name: order.append(name)) is not None
        gate.set()
        assert _wait(lambda: len(order) == 5)
        assert order == ["b1", "a1", "b2", "a2", "a3"]                      # in turn, not in arrival order
    finally:
        gate.set()
        pool.shutdown()
    assert pool.load("a") == (0, 0) and pool.load("b") == (0, 0)            # nothing kept for a gone owner


def test_lookups_have_their_own_pool_and_the_loop_reports_an_owners_load() -> None:
    loop = EventLoop("test-lanes").start()
    stuck, done = threading.Event(), threading.Event()
    try:
        owners = [object() for _ in range(8)]
        for owner in owners:                                                # every lookup thread stuck
            for _ in range(4):
                assert loop.offload(stuck.wait, owner=owner, lane=LOOKUP)
        assert _wait(lambda: sum(loop.load(owner, LOOKUP)[0] for owner in owners) == 16)
        assert loop.offload(lambda: "event written", lambda f: done.set(), owner=owners[0])
        assert done.wait(30)                                                # other work still runs
    finally:
        stuck.set()
        loop.close()
