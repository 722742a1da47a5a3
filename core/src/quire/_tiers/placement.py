"""Where a multi-process local tier's peer copies go: each owner's holders, spread over
failure domains (``LocalTier(peers=k, failure_domain=...)``).

Every process has a **failure domain**, a string naming what it dies with (a host, a rack):
``LocalTier(failure_domain=...)``, else the environment variable ``QUIRE_FAILURE_DOMAIN``,
else the host name (:func:`domain_of`).  The processes exchange their domains when the tier
opens; :func:`place` then gives every process the same answer: the ``k`` processes that
hold copies of each owner's objects of every local step.

The placement walks a ring **interleaved by domain** (the domains ordered by their lowest
process index; the ring takes the first process of each domain, then the second of each,
...), so ring neighbours lie in different domains whenever the domains allow.  For each
owner in ring order it takes, walking the ring forward from the owner, the first processes
that satisfy the most demanding of these, in turn, until it has ``k``:

1. in another domain than the owner, in a domain none of its holders chosen so far is in,
   and holding fewer than ``k`` copies so far;
2. in another domain, holding fewer than ``k`` copies;
3. in another domain, the least loaded first;
4. any other process holding fewer than ``k`` copies, then any other process (only when
   fewer than ``k`` processes lie outside the owner's domain).

So whenever at least ``k`` processes lie outside an owner's domain, all of its holders do
(then losing one whole domain loses no owner's objects, when that holds for every owner).
With a single domain, or every process its own, the answer is the plain ring: owner ``j``'s
copies on processes ``j+1 .. j+k``.  With domains of equal size every process holds exactly
``k`` owners' copies (``core/tests/test_tier_placement.py`` checks up to 5 domains of up to 4
processes, every ``k``).  Rule 4 is logged once, as a warning, by the tier that had to take
it (:func:`shared_domains` says which owners).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence

__all__ = ["ENV", "domain_of", "interleave", "place", "shared_domains", "sources_of"]

ENV = "QUIRE_FAILURE_DOMAIN"


def domain_of(explicit: str | None) -> str:
    """This process's failure domain: ``explicit``, else ``$QUIRE_FAILURE_DOMAIN``, else the
    host name."""
    if explicit:
        return explicit
    return os.environ.get(ENV) or socket.gethostname()


def interleave(domains: Sequence[str]) -> list[int]:
    """The processes in ring order: the first process of each domain (domains ordered by
    their lowest process index), then the second of each, and so on."""
    groups: dict[str, list[int]] = {}
    for p, d in enumerate(domains):
        groups.setdefault(d, []).append(p)
    order = list(groups.values())  # insertion order: by lowest process index
    out: list[int] = []
    for r in range(max((len(g) for g in order), default=0)):
        out += [g[r] for g in order if r < len(g)]
    return out


def place(domains: Sequence[str], k: int) -> list[list[int]]:
    """``out[j]``: the processes that hold copies of owner ``j``'s objects (``k`` of them,
    at most every other process), chosen as the module docstring says.

    Parameters
    ----------
    domains : sequence of str
        Each process's failure domain, by process index.
    k : int
        Copies per owner (``LocalTier(peers=k)``).

    Returns
    -------
    list of list of int
        Holders per owner, in the order they were chosen; the same in every process.
    """
    n = len(domains)
    k = max(0, min(k, n - 1))
    ring = interleave(domains)
    pos = {p: i for i, p in enumerate(ring)}
    load = [0] * n
    out: list[list[int]] = [[] for _ in range(n)]
    for j in ring:
        chosen = out[j]
        walk = [ring[(pos[j] + o) % n] for o in range(1, n)]
        other = [h for h in walk if domains[h] != domains[j]]
        for candidates, rule in (
            (other, "spread"),
            (other, "light"),
            (sorted(other, key=load.__getitem__), "any"),  # stable: ring order among equals
            (walk, "light"),
            (walk, "any"),
        ):
            for h in candidates:
                if len(chosen) == k:
                    break
                if h in chosen or (rule != "any" and load[h] >= k):
                    continue
                if rule == "spread" and any(domains[h] == domains[c] for c in chosen):
                    continue
                chosen.append(h)
                load[h] += 1
    return out


def sources_of(placement: Sequence[Sequence[int]], me: int) -> list[int]:
    """The owners whose copies process ``me`` holds, ascending."""
    return [j for j, hs in enumerate(placement) if me in hs]


def shared_domains(domains: Sequence[str], placement: Sequence[Sequence[int]]) -> list[int]:
    """The owners with a holder in their own failure domain."""
    return [j for j, hs in enumerate(placement) if any(domains[h] == domains[j] for h in hs)]
