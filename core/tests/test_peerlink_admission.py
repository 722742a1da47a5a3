"""Who takes a peer server's handshake slots (``quire._peers.admission``), as a property:
random arrivals from hosts of the run and from other addresses, handshakes ending, time
passing, against an oracle that keeps its own count of who holds what.

* The run's slots are only ever held by the run's hosts, so a connection from a host of the
  run is admitted whenever fewer of the run's slots are held than there are: however many
  other addresses arrive, in whatever order (the invariant ``docs/peers.md`` states).
* No pool holds more than its slots; no address more shared slots than its share.
* A refusal is fair: in each pool the newcomer may use, no address holds two more than the
  newcomer's with a handshake past the grace period, nor two more and above a fair share
  (the pool's slots over the addresses holding one, the newcomer's counted).
* A cut handshake is of an address holding two more than the newcomer's: its oldest past
  the grace, or (none past it, the address above its fair share) its oldest; its socket is
  shut down.
"""

from __future__ import annotations

import collections
import socket
from typing import Any

import hypothesis.strategies as st
from hypothesis import example, given, settings

from quire._peers import admission
from quire._peers.admission import GRACE, RUN, SHARED, Admission, Shake

RUN_HOSTS = ["10.0.0.1", "10.0.0.2"]
OTHERS = ["192.0.2.1", "192.0.2.2", "192.0.2.3", "::ffff:10.0.0.1"]  # the last: run host 1
RESERVED, SHARED_SLOTS, PER_ADDRESS = 4, 4, 2

events = st.lists(
    st.one_of(
        st.tuples(st.just("arrive"), st.sampled_from(RUN_HOSTS + OTHERS), st.integers(1, 8)),
        st.tuples(st.just("end"), st.integers(0, 20), st.just(1)),
        st.tuples(st.just("tick"), st.sampled_from([0.1, 0.3, GRACE]), st.just(1)),
    ),
    max_size=40,
).map(lambda script: [(what, arg) for what, arg, n in script for _ in range(n)])


def held(a: Admission) -> list[Shake]:
    return list(a._shaking.values())


FLOOD = (
    [("arrive", "192.0.2.1")] * 3
    + [("arrive", "192.0.2.2")] * 3
    + [("tick", 1.0), ("arrive", "192.0.2.3")]  # cuts one of 192.0.2.1's
    + [("arrive", "::ffff:10.0.0.1")] * 5  # the run's 4, then cuts one of 192.0.2.2's
    + [("tick", 1.0), ("arrive", "10.0.0.2")]  # cuts one of 10.0.0.1's
    + [("end", 0), ("arrive", "192.0.2.1"), ("arrive", "10.0.0.2")] * 2
)


YOUNG_FLOOD = (  # handshakes never past the grace period
    [("arrive", "10.0.0.2")] * 4  # the run's slots, all from one host of the run
    + [("arrive", "192.0.2.1")] * 2
    + [("arrive", "192.0.2.2")] * 2  # the shared ones
    + [("tick", 0.3), ("arrive", "10.0.0.1")]  # cuts one of 10.0.0.2's however young
    + [("arrive", "192.0.2.3")]  # refused: nobody above a fair share of 4 / 3
)


@settings(max_examples=100, deadline=None)
@given(events)
@example(FLOOD)
@example(YOUNG_FLOOD)
def test_the_run_always_finds_its_slots_and_every_pool_is_shared_fairly(
    script: list[tuple[str, Any]],
) -> None:
    now = [0.0]
    a = Admission(64, 48, RESERVED + SHARED_SLOTS, RESERVED, PER_ADDRESS, clock=lambda: now[0])
    a.reserve_for(RUN_HOSTS)
    live: list[Shake] = []
    sockets: list[socket.socket] = []
    try:
        for what, arg in script:
            if what == "tick":
                now[0] += arg
                continue
            if what == "end":
                if live:
                    shake = live.pop(arg % len(live))
                    assert not a.shaken(shake)
                    a.release(shake)
                continue
            addr = admission.canonical_host(arg)
            before = held(a)
            run_held = sum(h.pool == RUN for h in before)
            mine, other = socket.socketpair()
            sockets += [mine, other]
            shake, why = a.admit(mine, arg)
            if addr in RUN_HOSTS and run_held < RESERVED:
                assert shake is not None and shake.pool == RUN and not why
            if shake is None:
                refused_fairly(before, addr, now[0])
            else:
                live.append(shake)
                cut = [h for h in live if h.cut]
                assert len(cut) <= 1 and bool(cut) == bool(why)
                for h in cut:
                    assert cutting_was_fair(before, h, shake, now[0])
                    assert h.sock.recv(1) == b""  # shut down
                    live.remove(h)
            now_held = held(a)
            assert sorted(map(id, now_held)) == sorted(map(id, live))
            assert all(h.addr in RUN_HOSTS for h in now_held if h.pool == RUN)
            assert sum(h.pool == RUN for h in now_held) <= RESERVED
            assert sum(h.pool == SHARED for h in now_held) <= SHARED_SLOTS
            shared = collections.Counter(h.addr for h in now_held if h.pool == SHARED)
            assert max(shared.values(), default=0) <= PER_ADDRESS
            assert a.connections == len(live) and a.handshakes == len(live)
    finally:
        for s in sockets:
            s.close()


def pools_for(addr: str) -> list[str]:
    return [RUN, SHARED] if addr in RUN_HOSTS else [SHARED]


def refused_fairly(before: list[Shake], addr: str, now: float) -> None:
    for pool in pools_for(addr):
        in_pool = [h for h in before if h.pool == pool]
        by_addr = collections.Counter(h.addr for h in in_pool)
        mine = by_addr[addr]
        size = RESERVED if pool == RUN else SHARED_SLOTS
        if pool == SHARED and mine >= PER_ADDRESS:
            continue
        assert len(in_pool) >= size  # no free slot it could take
        fair = -(-size // len(set(by_addr) | {addr}))
        for h in in_pool:  # and none it could fairly take
            assert by_addr[h.addr] < mine + 2 or (
                now - h.since < GRACE and by_addr[h.addr] <= fair
            )


def cutting_was_fair(before: list[Shake], victim: Shake, newcomer: Shake, now: float) -> bool:
    """The victim is of the address holding the most, two more than the newcomer's: its
    oldest past the grace period, or, when none is and that address holds more than a
    fair share (the pool's slots over the addresses in it, the newcomer's counted), its
    oldest."""
    in_pool = [h for h in before if h.pool == newcomer.pool]
    by_addr = collections.Counter(h.addr for h in in_pool)
    top = max(by_addr.values())
    tops = [h for h in in_pool if by_addr[h.addr] == top]
    aged = [h for h in tops if now - h.since >= GRACE]
    size = RESERVED if newcomer.pool == RUN else SHARED_SLOTS
    fair = -(-size // len(set(by_addr) | {newcomer.addr}))
    if aged:
        ok = now - victim.since >= GRACE and not [h for h in aged if h.since < victim.since]
    else:
        ok = top > fair and not [h for h in tops if h.since < victim.since]
    return (
        victim.pool == newcomer.pool
        and by_addr[victim.addr] == top >= by_addr[newcomer.addr] + 2
        and ok
    )


def test_a_host_is_compared_as_the_server_sees_it() -> None:
    assert admission.canonical_host("::ffff:127.0.0.1") == "127.0.0.1"
    assert admission.canonical_host("fe80::1%eth0") == "fe80::1"
    assert admission.canonical_host("127.000.0.1") == "127.000.0.1"  # not an address
