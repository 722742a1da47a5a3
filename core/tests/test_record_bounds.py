"""Every bound the record check enforces holds what quire's writers produce (issue 29).

``quire._format.bounds`` states each bound with the reason no writer exceeds it; these tests
hold the writers to it at the edges: the replica split's piece count (generated), trees as
deep as allowed, the longest locations quire writes (moved again by a finalize's pack
rewrite), meshes without axes or with long or non-string axis names, 64-dimensional
arrays, custom nodes whose keys collide once made strings, long type names.  Where a
writer could exceed a bound (deeper trees, PRNG keys of an unregistered implementation,
huge Python integers), the save refuses with a typed error before anything is written.
The multi-process case of the issue is ``tests/test_record_bounds_multihost.py``.
"""

from __future__ import annotations

import collections
import math
import os
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import jax
import numpy as np
import pytest
from hypothesis import given, settings
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import quire
from quire import partial
from quire._format import bounds
from quire._handlers.replicas import _split

pytestmark = pytest.mark.quick  # the quick tier (CONTRIBUTING.md)


def _walk_leaves(tree: Any) -> list[Any]:
    return jax.tree_util.tree_leaves(tree)


def _equal(a: Any, b: Any) -> None:
    la, lb = _walk_leaves(a), _walk_leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# ------------------------------------------------------------------ chunks per array
@st.composite
def _shard_cases(draw: st.DrawFn) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    ndim = draw(st.integers(1, 3))
    shard = tuple(draw(st.integers(1, 60)) for _ in range(ndim))
    split = tuple(draw(st.sampled_from([1, 1, 2, 3, 4])) for _ in range(ndim))
    return shard, tuple(s * n for s, n in zip(shard, split)), draw(st.integers(1, 9))


@settings(max_examples=300, deadline=None, derandomize=True)
@given(_shard_cases())
def test_a_shard_becomes_at_most_pieces_per_holder_times_k_pieces(
    case: tuple[tuple[int, ...], tuple[int, ...], int],
) -> None:
    """The writer's split of one shard among k holders, and the grid over the array: the
    record check's limit (``max_chunks`` of the mesh's devices) holds it whenever the
    shard has at least k device copies (k <= holders <= replicas)."""
    shard, shape, k = case
    chunk = _split(shard, shape, k)
    pieces = math.prod(-(-s // c) for s, c in zip(shard, chunk))
    assert pieces <= bounds.PIECES_PER_HOLDER * k
    shards = math.prod(n // s for n, s in zip(shape, shard))
    grid = math.prod(-(-n // c) for n, c in zip(shape, chunk))
    assert grid == shards * pieces  # the grid is regular over every shard
    assert grid <= bounds.max_chunks(shards * k)


def test_a_shard_of_four_holders_cut_into_ten_chunks_is_within_the_bound() -> None:
    # (2050, 4096) over a (4, 2) mesh, P(None, "model"): 2 shards, 4 holders each
    chunk = _split((2050, 2048), (2050, 4096), 4)
    assert chunk == (410, 2048)
    assert 2 * 5 == 10 <= bounds.max_chunks(8)


# ------------------------------------------------------------------ locations
def test_the_longest_locations_quire_writes_are_within_the_bound(tmp_path: Path) -> None:
    assert bounds.WRITTEN_LOCATION <= bounds.MAX_LOCATION
    url = str(tmp_path / "long")
    long = "k" * 400
    # keys escaped to the longest component, case-colliding siblings (~n suffixes), a path
    # cut and hashed, a unit name as long as a key
    tree: dict[str, Any] = {}
    node = tree
    for i in range(12):
        node[long + str(i)] = {}
        node = node[long + str(i)]
    for i in range(12):
        node[("Ab" * 100)[: 100 + i].swapcase() if i % 2 else ("Ab" * 100)[: 100 + i]] = np.ones(3)
        node["x" * 90 + "A" * i] = np.ones(2)
        node["x" * 90 + "a" * i] = np.ones(2)
    big = np.arange(5000, dtype=np.float32)
    partial.save(url, {"t": tree, "pad": big})
    partial.save(url, {"pad": big + 1})  # version 1's pack is now mostly dead: rewritten
    partial.finalize(url)
    record = quire.metadata(url).record
    locs = [
        leaf["location"]
        for leaf in _record_leaves(record["units"]["pytree"]["tree"])
        if "location" in leaf
    ]
    moved = [loc for loc in locs if len(loc.split("/")[2]) == bounds.TXID_LENGTH]
    assert moved, "the finalize moved no leaf under a second txid"
    assert max(map(len, locs)) <= bounds.WRITTEN_LOCATION
    assert max(len(p) for loc in locs for p in loc.split("/")) <= bounds.MAX_COMPONENT
    _equal(quire.load(url)["t"], tree)


def _record_leaves(node: dict[str, Any]) -> list[dict[str, Any]]:
    if node["kind"] == "leaf":
        return [node]
    return [leaf for c in node["children"] for leaf in _record_leaves(c)]


# ------------------------------------------------------------------ trees
def _nested(depth: int) -> Any:
    tree: Any = np.ones(2)
    for _ in range(depth):
        tree = {"a": tree}
    return tree


def test_a_tree_as_deep_as_the_bound_loads_and_a_deeper_one_is_refused(tmp_path: Path) -> None:
    url = str(tmp_path / "deep")
    quire.save(url, _nested(bounds.MAX_DEPTH))
    _equal(quire.load(url), _nested(bounds.MAX_DEPTH))
    deeper = str(tmp_path / "deeper")
    with pytest.raises(quire.errors.UnsupportedLeafError, match=f"deeper than {bounds.MAX_DEPTH}"):
        quire.save(deeper, _nested(bounds.MAX_DEPTH + 1))
    assert not os.path.exists(deeper)  # refused before anything was written


def test_custom_node_keys_that_collide_as_strings_are_kept_by_position(tmp_path: Path) -> None:
    url = str(tmp_path / "od")
    tree = {"od": collections.OrderedDict([(1.0, np.ones(1)), ("1.0", np.zeros(1))])}
    quire.save(url, tree)
    _equal(quire.load(url, tree), tree)
    assert quire.load(url)["od"] == [np.ones(1), np.zeros(1)]


def test_a_long_custom_node_type_name_is_clipped(tmp_path: Path) -> None:
    name = "N" * (2 * bounds.MAX_TYPE_NAME)
    cls = type(name, (), {})
    jax.tree_util.register_pytree_node(
        cls, lambda n: ((n.x,), None), lambda _, kids: _with_x(cls, kids[0])
    )
    url = str(tmp_path / "typ")
    quire.save(url, {"n": _with_x(cls, np.arange(3))})
    rec = quire.metadata(url).record["units"]["pytree"]["tree"]["children"][0]
    assert len(rec["type"]) == bounds.MAX_TYPE_NAME
    np.testing.assert_array_equal(quire.load(url)["n"][0], np.arange(3))


def _with_x(cls: type, x: Any) -> Any:
    obj = cls()
    obj.x = x
    return obj


# ------------------------------------------------------------------ arrays and meshes
def test_an_array_of_numpys_most_dimensions_loads(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        np.zeros((1,) * (bounds.MAX_NDIM + 1))  # why no writer exceeds MAX_NDIM
    url = str(tmp_path / "nd")
    a = np.arange(2, dtype=np.int8).reshape((2,) + (1,) * (bounds.MAX_NDIM - 1))
    quire.save(url, {"a": a})
    np.testing.assert_array_equal(quire.load(url)["a"], a)


@pytest.mark.parametrize("names", [(), ("a" * 300,), (0, 1)], ids=["no-axes", "long", "ints"])
def test_meshes_jax_accepts_save_and_load(tmp_path: Path, names: tuple[Any, ...]) -> None:
    devs = np.array(jax.devices())
    if not names:  # a mesh without axes: one device
        mesh, spec, shape = Mesh(devs[0], ()), P(), (3,)
    elif len(names) == 1:
        mesh, spec, shape = Mesh(devs, names), P(names[0]), (8,)
    else:
        mesh, spec, shape = Mesh(devs.reshape(4, 2), names), P(names[0], names[1]), (8, 2)
    x = jax.device_put(np.arange(math.prod(shape), dtype=np.float32).reshape(shape),
                       NamedSharding(mesh, spec))  # fmt: skip
    url = str(tmp_path / "mesh")
    quire.save(url, {"x": x})
    np.testing.assert_array_equal(quire.load(url)["x"], np.asarray(x))
    target = {"x": jax.ShapeDtypeStruct(shape, np.float32, sharding=x.sharding)}
    assert quire.load(url, target)["x"].sharding == x.sharding


@pytest.mark.parametrize("n", [2**51, bounds.MAX_DIM])
def test_an_empty_array_with_a_huge_dimension_loads(tmp_path: Path, n: int) -> None:
    url = str(tmp_path / "e")
    quire.save(url, {"x": np.zeros((0, n), np.int8)})  # numpy allows it: no byte is held
    assert quire.load(url)["x"].shape == (0, n)


def test_a_size0_array_sharded_over_the_mesh_saves(tmp_path: Path) -> None:
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("a", "b"))
    x = jax.device_put(np.zeros((0, 4), np.float32), NamedSharding(mesh, P("a", "b")))
    url = str(tmp_path / "empty")
    quire.save(url, {"x": x})
    assert quire.load(url)["x"].shape == (0, 4)


# ------------------------------------------------------------------ refused up front
def test_a_prng_key_no_load_can_rebuild_is_refused(tmp_path: Path) -> None:
    import jax.extend.random as jr

    base = jr.threefry_prng_impl
    impl = jr.define_prng_impl(
        key_shape=base.key_shape, seed=base.seed, split=base.split,
        random_bits=base.random_bits, fold_in=base.fold_in,
    )  # fmt: skip
    url = str(tmp_path / "key")
    with pytest.raises(quire.errors.UnsupportedLeafError, match="key_data") as ei:
        quire.save(url, {"k": jax.random.key(0, impl=impl)})
    assert url in str(ei.value) and "'k'" in str(ei.value)
    assert not os.path.exists(os.path.join(url, "quire.json"))
    quire.save(url, {"k": jax.random.key(0)})  # a registered implementation is fine
    assert jax.random.key_impl(quire.load(url)["k"]) == jax.random.key_impl(jax.random.key(0))


def test_an_integer_json_readers_refuse_is_refused(tmp_path: Path) -> None:
    url = str(tmp_path / "int")
    quire.save(url, {"n": 10**bounds.MAX_INT_DIGITS - 1})  # 4300 digits: readable
    assert quire.load(url)["n"] == 10**bounds.MAX_INT_DIGITS - 1
    with pytest.raises(quire.errors.UnsupportedLeafError, match="save it as a string"):
        quire.save(str(tmp_path / "int2"), {"n": -(10**bounds.MAX_INT_DIGITS)})
