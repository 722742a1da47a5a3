"""A lazy view of an array is a ``quire.sources.LazyArray``: slices, ``.T``, casts, reshapes, stacks.

Whatever node sits behind it, a lazy array answers shape, dtype, read, slicing and the lazy
operations; ``.sources()`` lists only the arrays of sources it reads from.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import quire
from quire import surgery
from quire._sources.lazy import Region, as_lazy

W = np.arange(40, dtype=np.float32).reshape(10, 4)
B = np.arange(100, 140, dtype=np.float32).reshape(10, 4)


class _Reader:
    """Serves regions of ``a``; records them, and the blocking reads asked for."""

    def __init__(self, a: np.ndarray) -> None:
        self.a = a
        self.regions: list[Region] = []
        self.blocking_asked: list[Region] = []

    async def read_region(self, region: Region) -> np.ndarray:
        self.regions.append(region)
        return np.ascontiguousarray(self.a[region])

    def blocking(self, region: Region) -> Callable[[], np.ndarray]:
        self.blocking_asked.append(region)
        return lambda: np.ascontiguousarray(self.a[region])


def _leaf(name: str, a: np.ndarray) -> quire.sources.LazyArray:
    return quire.sources.LazyArray(a.shape, a.dtype, (name,), _Reader(a), "memory://views")


# (name, build from the lazy leaves w and b, the same on numpy arrays)
CASES: list[tuple[str, Callable[[Any, Any], Any], Callable[[Any, Any], Any]]] = [
    ("slice", lambda w, b: w[3:9], lambda w, b: w[3:9]),
    ("int", lambda w, b: w[2], lambda w, b: w[2]),
    ("ellipsis", lambda w, b: w[..., 1], lambda w, b: w[..., 1]),
    ("view of view", lambda w, b: w[1:9][2:5, 1:], lambda w, b: w[1:9][2:5, 1:]),
    ("T", lambda w, b: w.T, lambda w, b: w.T),
    ("astype", lambda w, b: w.astype(np.float16), lambda w, b: w.astype(np.float16)),
    ("astype name", lambda w, b: w.astype("bfloat16"), lambda w, b: w.astype("bfloat16")),
    ("reshape", lambda w, b: w.reshape(4, 10), lambda w, b: w.reshape(4, 10)),
    ("stack", lambda w, b: surgery.stack([w, b]), lambda w, b: np.stack([w, b])),
    (
        "concatenate",
        lambda w, b: surgery.concatenate([w, b], axis=1),
        lambda w, b: np.concatenate([w, b], axis=1),
    ),
    ("transpose", lambda w, b: surgery.transpose(w, (1, 0)), lambda w, b: w.T),
    ("torch_linear", lambda w, b: surgery.torch_linear(w[:4]), lambda w, b: w[:4].T),
    ("const", lambda w, b: as_lazy(np.ones((2, 3))), lambda w, b: np.ones((2, 3))),
    (
        "chain",
        lambda w, b: surgery.stack([w, b], axis=1)[2:7].T.astype(np.float64),
        lambda w, b: np.stack([w, b], axis=1)[2:7].T.astype(np.float64),
    ),
]
IDS = [c[0] for c in CASES]


@pytest.mark.parametrize(("name", "lazy", "eager"), CASES, ids=IDS)
def test_every_lazy_value_is_a_lazy_array(name: str, lazy: Any, eager: Any) -> None:
    v = lazy(_leaf("w", W), _leaf("b", B))
    assert isinstance(v, quire.sources.LazyArray)
    assert isinstance(v, quire.sources.LazyArray) and isinstance(v, quire.surgery.LazyArray)
    assert isinstance(v, quire.sources.LazyValue) and isinstance(v, quire.surgery.LazyValue)


@pytest.mark.parametrize(("name", "lazy", "eager"), CASES, ids=IDS)
def test_a_view_reads_slices_and_operates_as_its_numpy_twin(
    name: str, lazy: Any, eager: Any
) -> None:
    v, want = lazy(_leaf("w", W), _leaf("b", B)), np.asarray(eager(W, B))
    assert (v.shape, v.dtype, v.ndim, v.size) == (want.shape, want.dtype, want.ndim, want.size)
    np.testing.assert_array_equal(v.read(), want)
    np.testing.assert_array_equal(np.asarray(v), want)
    if want.ndim:
        np.testing.assert_array_equal(v[1:].read(), want[1:])
        np.testing.assert_array_equal(v[..., 0].read(), want[..., 0])
        np.testing.assert_array_equal(v.T.read(), want.T)
        np.testing.assert_array_equal(v.reshape(-1).read(), want.reshape(-1))
        np.testing.assert_array_equal(v.astype(np.float32).read(), want.astype(np.float32))
        assert len(v) == len(want)


def test_sources_lists_only_the_source_arrays() -> None:
    w, b = _leaf("w", W), _leaf("b", B)
    assert w.sources() == [w]
    assert w[3:9].sources() == [w] and w.T[1].sources() == [w]
    assert surgery.stack([w, b[0:10]]).sources() == [w, b]
    assert surgery.concatenate([w, np.zeros((1, 4), np.float32)]).sources() == [w]
    assert as_lazy(np.ones(3)).sources() == []
    # Only a source's array carries a key path, URL and reader.
    assert (w.key, w.url, w.key_path) == ("w", "memory://views", ("w",))
    assert not hasattr(w[3:9], "url") and not hasattr(w.T, "reader")


def test_repr_names_the_source_and_the_operation() -> None:
    w, b = _leaf("w", W), _leaf("b", B)
    leaf = "LazyArray('w', shape=(10, 4), dtype=float32, url='memory://views')"
    assert repr(w) == leaf
    assert repr(w[3:9]) == f"{leaf}[3:9, 0:4]"
    assert repr(w[2, 1:3]) == f"{leaf}[2, 1:3]"
    assert repr(w.T) == f"transpose({leaf}, (1, 0))"
    assert repr(w.astype("bfloat16")) == f"astype({leaf}, 'bfloat16')"
    assert repr(w.reshape(40)) == f"reshape({leaf}, (40,))"
    assert "stack([" in repr(surgery.stack([w, b])) and "LazyArray('b'" in repr(
        surgery.stack([w, b])
    )
    assert repr(as_lazy(np.ones(3))) == "const(shape=(3,), dtype=float64)"


def test_a_view_reads_only_what_it_covers_and_never_the_leaf_blocking_path() -> None:
    w = _leaf("w", W)
    reader = w.reader
    devices = np.array(jax.devices()[:2])
    sharding = NamedSharding(Mesh(devices, ("x",)), PartitionSpec("x"))
    got = w[2:6].read(sharding=sharding)
    np.testing.assert_array_equal(np.asarray(got), W[2:6])
    assert reader.blocking_asked == []  # a view's region is not the leaf's
    assert all(r[0].start >= 2 and r[0].stop <= 6 for r in reader.regions)
    whole = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    np.testing.assert_array_equal(np.asarray(w.read(sharding=whole)), W)
    assert reader.blocking_asked == [(slice(0, 10), slice(0, 4))]


def test_views_of_an_opened_checkpoint_are_lazy_arrays(tmp_path: Path) -> None:
    url = str(tmp_path / "ck")
    quire.save(url, {"w": W, "step": 3})
    src = quire.open(url)
    w = src.tree["w"]
    assert isinstance(w, quire.sources.LazyArray) and w.key == "w"
    for v in (w[3:9], w.T, w.astype(np.float16), w.reshape(2, 20)):
        assert isinstance(v, quire.sources.LazyArray)
        assert v.sources() == [w]
    np.testing.assert_array_equal(w[3:9].T.read(), W[3:9].T)
    out = quire.load(url, None, transform=lambda t: {"k": t["w"][1:4].T})
    np.testing.assert_array_equal(out["k"], W[1:4].T)
