"""Where peer copies go (``quire._tiers.placement``): each owner's holders spread over
failure domains, deterministic, the plain ring when domains do not help."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from quire._checkpointer.localtier import LocalTier
from quire._tiers import placement as tp


def check(domains: list[str], k: int) -> list[list[int]]:
    """``place`` with the properties every answer must have."""
    out = tp.place(domains, k)
    n, want = len(domains), min(k, len(domains) - 1)
    assert len(out) == n
    for j, hs in enumerate(out):
        assert len(hs) == len(set(hs)) == want, (j, hs)
        assert j not in hs and all(0 <= h < n for h in hs)
        outside = sum(d != domains[j] for d in domains)
        # every holder in another domain whenever enough processes lie outside the owner's
        in_other = sum(domains[h] != domains[j] for h in hs)
        assert in_other == min(want, outside), (domains, k, j, hs)
    assert tp.place(list(domains), k) == out  # deterministic
    for me in range(n):
        assert tp.sources_of(out, me) == [j for j in range(n) if me in out[j]]
    return out


def ring(n: int, k: int) -> list[list[int]]:
    return [[(j + o) % n for o in range(1, k + 1)] for j in range(n)]


def test_four_processes_on_two_hosts() -> None:
    # processes 0, 1 on host a; 2, 3 on host b: the plain ring would put 0's copy on 1
    out = check(["a", "a", "b", "b"], 1)
    assert out == [[2], [3], [1], [0]]
    assert tp.shared_domains(["a", "a", "b", "b"], out) == []
    # interleaved hosts: the plain ring already alternates
    assert check(["a", "b", "a", "b"], 1) == ring(4, 1)
    # two copies each: both on the other host
    out = check(["a", "a", "b", "b"], 2)
    assert all({"a", "b"} - {["a", "a", "b", "b"][h] for h in hs} for hs in out)
    assert Counter(h for hs in out for h in hs) == {p: 2 for p in range(4)}


def test_eight_processes_on_four_hosts() -> None:
    domains = [h for h in "abcd" for _ in range(2)]  # 0,1 on a; 2,3 on b; ...
    for k in (1, 2, 3):
        out = check(domains, k)
        # balanced: every process holds exactly k owners' copies
        assert Counter(h for hs in out for h in hs) == {p: k for p in range(8)}, (k, out)
        # the holders of one owner are on k different hosts (there are 3 other hosts)
        for j, hs in enumerate(out):
            assert len({domains[h] for h in hs}) == k, (k, j, hs)
    # losing any one host loses no owner's every copy
    out = tp.place(domains, 1)
    for lost in "abcd":
        dead = {p for p, d in enumerate(domains) if d == lost}
        assert all({j, *out[j]} - dead for j in range(8))


@pytest.mark.parametrize("blocks", [True, False])
def test_equal_domains_give_every_process_k_copies(blocks: bool) -> None:
    # D domains of m processes each, as blocks (0..m-1 on the first) or round-robin
    for d, m in itertools.product(range(1, 6), range(1, 5)):
        n = d * m
        domains = [chr(97 + (i // m if blocks else i % d)) for i in range(n)]
        for k in range(1, n):
            out = check(domains, k)
            assert Counter(h for hs in out for h in hs) == {p: k for p in range(n)}, (d, m, k)


def test_uneven_domains() -> None:
    # 3 processes on host a, one on b: every owner of a copies to b; b's to a
    out = check(["a", "a", "a", "b"], 1)
    assert [hs for hs in out[:3]] == [[3]] * 3 and out[3][0] in (0, 1, 2)
    # 6 on a, 2 on b: a's owners split their copies over b's two processes
    domains = ["a"] * 6 + ["b"] * 2
    out = check(domains, 1)
    assert Counter(out[j][0] for j in range(6)) == {6: 3, 7: 3}
    # three hosts of 3, 2, 1 processes, two copies each
    domains = ["a", "a", "a", "b", "b", "c"]
    out = check(domains, 2)
    # every copy off its owner's host; c's one process is not made to hold everyone's
    assert tp.shared_domains(domains, out) == []
    assert max(Counter(h for hs in out for h in hs).values()) <= 3, out
    assert tp.shared_domains(domains, out) == []


def test_too_few_domains_falls_back_to_the_ring() -> None:
    # one domain (one host): exactly the plain ring, each owner on j+1 .. j+k
    for n, k in [(2, 1), (4, 1), (4, 2), (4, 3), (8, 2)]:
        out = check(["h"] * n, k)
        assert out == ring(n, k)
        assert tp.shared_domains(["h"] * n, out) == list(range(n))
    # every process its own domain: the plain ring too
    assert check(list("abcdef"), 2) == ring(6, 2)
    # two hosts of two, three copies: two on the other host, the third on its own
    domains = ["a", "a", "b", "b"]
    out = check(domains, 3)
    assert tp.shared_domains(domains, out) == [0, 1, 2, 3]
    # more copies than other processes: every other process
    assert [sorted(hs) for hs in check(["a", "b", "c"], 5)] == [[1, 2], [0, 2], [0, 1]]
    assert check(["a"], 1) == [[]]


@pytest.mark.parametrize("n", [2, 3, 5, 7])
def test_every_shape_keeps_the_invariants(n: int) -> None:
    # every assignment of n processes to up to 3 domains, k = 1..n-1
    for domains in itertools.product("abc", repeat=n):
        for k in range(1, n):
            check(list(domains), k)


def test_the_domain_comes_from_the_argument_then_the_environment_then_the_host(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import socket

    monkeypatch.delenv(tp.ENV, raising=False)
    assert tp.domain_of(None) == socket.gethostname()
    monkeypatch.setenv(tp.ENV, "rack-7")
    assert tp.domain_of(None) == "rack-7"
    assert tp.domain_of("host-3") == "host-3"
    assert LocalTier("x", peers=1, failure_domain="host-3").failure_domain == "host-3"
    for bad in ("", 3):
        with pytest.raises(TypeError, match="failure_domain"):
            LocalTier("x", failure_domain=bad)  # type: ignore[arg-type]
