"""The replica-parallel write plan's pure parts (``quire._handlers.replicas``): how a shard is
cut into pieces and how pieces are placed.  The multi-process behaviour (bytes written once,
balance, loads) is tested with real processes in ``tests/test_multihost.py``."""

from __future__ import annotations

import math

import pytest

from quire._handlers.replicas import _split, assign

pytestmark = pytest.mark.quick  # the quick tier (CONTRIBUTING.md)


@pytest.mark.parametrize(
    ("shard", "shape", "k", "chunk"),
    [
        ((4099, 1024), (4099, 1024), 4, (1025, 1024)),  # prime rows: ceil(n / k), last shorter
        ((1000, 8), (1000, 8), 4, (250, 8)),  # exact
        ((1001, 257), (1001, 257), 4, (143, 257)),  # 7 exact pieces (between k and 2k) beat padding
        ((7, 300001), (7, 300001), 4, (1, 300001)),  # 7 rows: 7 pieces of one row
        ((3, 5), (3, 5), 4, (3, 1)),  # 3 rows < k: the axis reaching k pieces wins
        ((3, 2), (3, 2), 4, (1, 2)),  # ... else the one with the most (one per row)
        ((1, 64), (1, 64), 4, (1, 16)),  # axis 0 cannot split: the next axis does
        ((2048, 1030), (4096, 1030), 2, (1024, 1030)),  # sharded axis: a divisor of the shard
        ((6, 10), (12, 10), 4, (6, 2)),  # sharded axis 0 gives 3 pieces; axis 1 gives 5
        ((6, 3), (12, 3), 4, (2, 3)),  # sharded axis 0: 3 pieces of a divisor of 6
    ],
)
def test_split_cuts_one_axis_and_keeps_the_grid_regular(
    shard: tuple[int, ...], shape: tuple[int, ...], k: int, chunk: tuple[int, ...]
) -> None:
    got = _split(shard, shape, k)
    assert got == chunk
    for c, s, n in zip(got, shard, shape):
        if s != n:  # an axis the array is sharded on: pieces tile every shard
            assert s % c == 0
    pieces = math.prod(-(-s // c) for s, c in zip(shard, got))
    assert 2 <= pieces <= 2 * k


def test_split_leaves_an_unsplittable_shard_whole() -> None:
    assert _split((1, 1), (1, 1), 4) == (1, 1)
    assert _split((5,), (10,), 2) == (5,)  # 5 rows of a sharded axis: no divisor gives 2..2k


def test_assign_places_largest_first_on_the_least_loaded_holder() -> None:
    load = {0: 10}
    units = [(8, (0, 1)), (6, (0, 1)), (5, (0, 1, 2)), (4, (1, 2)), (1, (0,))]
    assert assign(units, load) == [1, 1, 2, 2, 0]
    assert load == {0: 11, 1: 14, 2: 9}
    # ties go to the lowest process, so every process computes the same plan
    assert assign([(3, (2, 1)), (3, (1, 2))], {}) == [1, 2]
