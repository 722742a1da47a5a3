"""Materialising lazy trees: bounded leaves in flight, the first error stops the rest."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import numpy as np
import pytest

import quire
from quire._sources.lazy import LazyArray, Region, region_shape


class _Reader:
    """Fills a region with ``value``; counts reads in flight and started."""

    in_flight = 0
    peak = 0
    started = 0

    def __init__(self, value: float, fail: bool = False) -> None:
        self.value, self.fail = value, fail

    async def read_region(self, region: Region) -> np.ndarray:
        cls = type(self)
        cls.started += 1
        cls.in_flight += 1
        cls.peak = max(cls.peak, cls.in_flight)
        try:
            await asyncio.sleep(0.001)
            if self.fail:
                raise quire.CorruptCheckpointError("memory://x: leaf 5 is damaged")
            return np.full(region_shape(region), self.value, np.float32)
        finally:
            cls.in_flight -= 1


def _tree(n: int, fail_at: int = -1) -> dict[str, LazyArray]:
    return {
        f"w{i}": LazyArray((4, 3), np.float32, (f"w{i}",), _Reader(i, i == fail_at), "memory://x")
        for i in range(n)
    }


def test_many_leaves_load_with_a_bounded_number_in_flight() -> None:
    _Reader.in_flight = _Reader.peak = _Reader.started = 0
    n = 200
    with quire.Context(max_concurrency=8):
        out = quire.load({"a": _Source(_tree(n))}, None, transform=lambda a: a)
    assert sorted(out) == sorted(f"w{i}" for i in range(n))
    for i in range(n):
        np.testing.assert_array_equal(out[f"w{i}"], np.full((4, 3), i, np.float32))
    assert 1 < _Reader.peak <= 8


def test_first_failing_leaf_stops_the_others() -> None:
    _Reader.in_flight = _Reader.peak = _Reader.started = 0
    n = 400
    with (
        quire.Context(max_concurrency=8),
        pytest.raises(quire.CorruptCheckpointError, match="leaf 5 is damaged"),
    ):
        quire.load(_Source(_tree(n, fail_at=5)), None, transform=lambda t: t)
    assert _Reader.started < n // 2  # the rest were never started
    assert _Reader.in_flight == 0  # and none is left running


class _Source(quire.sources.Source):
    format = "test-memory"

    def __init__(self, tree: dict[str, LazyArray]) -> None:
        self.url, self.tree, self.metadata = "memory://x", tree, {}

    @classmethod
    def detect(cls, url: str, storage_options: dict[str, object]) -> bool:
        return False

    @classmethod
    def open(cls, url: str, storage_options: dict[str, object]) -> _Source:
        raise NotImplementedError


def test_sharded_local_load_reads_once_per_tensor_and_detects_truncation(tmp_path: Path) -> None:
    import jax
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    t = {f"w{i}": rng.standard_normal((16, 8)).astype(np.float32) for i in range(3)}
    f = tmp_path / "m.safetensors"
    save_file(t, str(f))
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
    P = jax.sharding.PartitionSpec
    rules = quire.surgery.partition_rules([("w0", P("data", "model")), (".*", P())], mesh)
    src = quire.open(f)
    out = quire.load(src, shardings=rules)
    for k, v in t.items():
        np.testing.assert_array_equal(np.asarray(out[k]), v)
    assert out["w0"].sharding.spec == P("data", "model")
    assert src.requests == 3 and src.bytes_read == sum(v.nbytes for v in t.values())
    # A file cut short after it was opened: a typed error naming it, not garbage.
    src = quire.open(f)
    os.truncate(f, f.stat().st_size - 100)
    with pytest.raises(quire.CorruptCheckpointError, match=r"m\.safetensors is truncated"):
        quire.load(src, shardings=rules)
    with pytest.raises(quire.CorruptCheckpointError, match=r"m\.safetensors is truncated"):
        src.tree["w2"].read()
