"""What a load target may differ in from the checkpoint, and what the errors say (issue 35):
empty nodes match each other, casts that lose information are refused unless asked for, and
every mismatch names the fix that applies to it."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, NamedTuple

import jax
import ml_dtypes
import numpy as np
import optax
import pytest
from hypothesis import event, given
from hypothesis import strategies as st
from propcase import (
    COMPLEX,
    DTYPES,
    INTS,
    JAX_DTYPES,
    SUBBYTE,
    Leaf,
    dtype,
    is_float,
    same_bits,
    values,
)
from propgen import castable
from props_budget import examples

import quire
from quire.errors import LossyCastError, TreeMismatchError


class Empty(NamedTuple):
    pass


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Hollow:
    """A registered dataclass with no fields: a pytree node with no leaves."""


def _bits(a: Any, b: Any) -> None:
    """Same structure (the target's) and, leaf by leaf, the same dtype and bytes."""
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        assert x.tobytes() == y.tobytes()


# --------------------------------------------------------------------------- empty nodes
EMPTIES = {
    "None": lambda: None,
    "()": tuple,
    "[]": list,
    "{}": dict,
    "EmptyState": optax.EmptyState,
    "NamedTuple": Empty,
    "dataclass": Hollow,
    "nested": lambda: {"a": (), "b": [None, {}]},
}


@pytest.mark.parametrize("saved", sorted(EMPTIES))
@pytest.mark.parametrize("target", sorted(EMPTIES))
def test_empty_nodes_match_each_other(tmp_path: Path, saved: str, target: str) -> None:
    """Orbax writes optax's EmptyState() as None: every empty node loads into every other,
    and the result has the target's structure (EmptyState comes back as EmptyState)."""
    w = np.arange(6, dtype=np.float32)
    url = str(tmp_path / "ckpt")
    quire.save(url, {"w": w, "opt": (EMPTIES[saved](), {"mu": w + 1}), "tail": EMPTIES[saved]()})
    abstract = {
        "w": jax.ShapeDtypeStruct((6,), np.float32),
        "opt": (EMPTIES[target](), {"mu": jax.ShapeDtypeStruct((6,), np.float32)}),
        "tail": EMPTIES[target](),
    }
    got = quire.load(url, abstract)
    expected = {"w": w, "opt": (EMPTIES[target](), {"mu": w + 1}), "tail": EMPTIES[target]()}
    _bits(got, expected)
    assert type(got["opt"][0]) is type(EMPTIES[target]())
    # The lazy path (quire.open / transform) pairs the same way.
    got = quire.load(url, abstract, transform=lambda t: t)
    _bits(got, expected)


def test_empty_nodes_on_either_side_match_without_a_target_container(tmp_path: Path) -> None:
    """A target EmptyState where the checkpoint holds None one level up (a None for the
    whole optimizer state), and the other way round."""
    url = str(tmp_path / "ckpt")
    quire.save(url, {"w": np.ones(2), "opt": None})
    got = quire.load(url, {"w": np.zeros(2), "opt": (optax.EmptyState(), {"a": ()})})
    assert got["opt"] == (optax.EmptyState(), {"a": ()})
    url2 = str(tmp_path / "ckpt2")
    quire.save(url2, {"w": np.ones(2), "opt": (optax.EmptyState(), [None, {}])})
    assert quire.load(url2, {"w": np.zeros(2), "opt": None})["opt"] is None


def test_a_subtree_with_data_is_still_missing(tmp_path: Path) -> None:
    """Empty matches empty only: a target None or EmptyState where the checkpoint holds
    arrays, or the other way round, is a mismatch; so is a None with no counterpart."""
    url = str(tmp_path / "ckpt")
    quire.save(url, {"w": np.ones(2), "opt": ({"mu": np.ones(3)}, optax.EmptyState())})
    with pytest.raises(TreeMismatchError) as ei:
        quire.load(url, {"w": np.zeros(2), "opt": (optax.EmptyState(), optax.EmptyState())})
    assert ei.value.missing == ["opt/0/mu"] and not ei.value.extra
    with pytest.raises(TreeMismatchError) as ei:
        quire.load(url, {"w": np.zeros(2), "opt": (None, None)})
    assert ei.value.missing == ["opt/0/mu"] and ei.value.extra == ["opt/0"]
    # A None the other side lacks is a mismatch (as before); an empty container is left
    # alone (as before: a partial save's delete leaves one behind).
    with pytest.raises(TreeMismatchError) as ei:
        quire.load(
            url, {"w": np.zeros(2), "opt": ({"mu": np.zeros(3)}, optax.EmptyState(), None)}
        )
    assert ei.value.extra == ["opt/2"] and not ei.value.missing
    url3 = str(tmp_path / "ckpt3")
    quire.save(url3, {"w": np.ones(2), "gone": None})
    with pytest.raises(TreeMismatchError) as ei:
        quire.load(url3, {"w": np.zeros(2)})
    assert ei.value.missing == ["gone"] and not ei.value.extra
    assert quire.load(url3, {"w": np.zeros(2)}, partial=True)["w"].tolist() == [1.0, 1.0]
    got = quire.load(url, {"w": np.zeros(2), "opt": ({"mu": np.zeros(3)},), "new": {}})
    assert got["opt"][0]["mu"].tolist() == [1.0, 1.0, 1.0] and got["new"] == {}
    # A saved None is no array: a target array there is missing from the checkpoint.
    url2 = str(tmp_path / "ckpt2")
    quire.save(url2, {"w": None})
    with pytest.raises(TreeMismatchError, match="'w'"):
        quire.load(url2, {"w": jax.ShapeDtypeStruct((2,), np.float32)})
    with pytest.raises(TreeMismatchError, match="'w'"):
        quire.load(url2, {"w": jax.ShapeDtypeStruct((2,), np.float32)}, transform=lambda t: t)
    # A target None is "as saved" where the checkpoint holds a leaf (unchanged), strict or
    # partial (docs/jax-libraries.md says so: the hunt's finding 6 read it the other way).
    got = quire.load(url, {"w": None, "opt": ({"mu": None}, None)})
    assert got["w"].tolist() == [1.0, 1.0] and got["opt"][1] is None
    assert quire.load(url, {"w": None}, partial=True)["w"].tolist() == [1.0, 1.0]


# --------------------------------------------------------------------------------- casts
# The oracle trusts no quire code: each dtype's kind from its name, numpy's order of kinds,
# each integer type's range from numpy / ml_dtypes.
_ORDER = "buifc"


def _kind(name: str) -> str:
    if name == "bool":
        return "b"
    if name in COMPLEX:
        return "c"
    if is_float(name):
        return "f"
    return "u" if name.startswith("u") else "i"


def _int_range(name: str) -> tuple[int, int]:
    info: Any = ml_dtypes.iinfo(dtype(name))
    return int(info.min), int(info.max)


def _refused(src: str, dst: str, v: np.ndarray, casting: str) -> bool:
    """Whether ``casting`` refuses loading the values ``v`` of dtype ``src`` as ``dst``."""
    if src == dst or casting == "unsafe":
        return False
    if casting == "no":
        return True
    if _ORDER.index(_kind(src)) > _ORDER.index(_kind(dst)):
        return True
    if _kind(src) in "ui" and _kind(dst) in "ui" and v.size:
        lo, hi = _int_range(dst)
        ints = v.astype(np.int8) if src in SUBBYTE else v
        return int(ints.min()) < lo or int(ints.max()) > hi
    return False


@st.composite
def _cast_cases(draw: Any) -> tuple[str, str, np.ndarray, str, str, str]:
    src = draw(st.sampled_from(DTYPES))
    dst = draw(st.sampled_from([d for d in DTYPES if castable(src, d)]))
    shape = draw(st.sampled_from([(), (5,), (2, 3)]))
    leaf = Leaf(("w",), shape, src, draw(st.integers(0, 2**16)))
    v = values(leaf)
    if draw(st.booleans()):  # small values: every integer narrowing keeps them
        v = np.random.default_rng(leaf.seed).integers(0, 2, shape).astype(dtype(src))
    target = draw(st.sampled_from(["numpy", "jax"] if dst in JAX_DTYPES else ["numpy"]))
    reader = draw(st.sampled_from(["load", "lazy"]))
    casting = draw(st.sampled_from(["same_kind", "same_kind", "no", "unsafe"]))
    return src, dst, v, target, reader, casting


@examples(ci=60)
@given(case=_cast_cases())
@pytest.mark.filterwarnings("ignore:(overflow|invalid value) encountered in cast")
@pytest.mark.filterwarnings("ignore:Casting complex values to real:numpy.exceptions.ComplexWarning")
def test_casting_refuses_exactly_the_lossy_casts(
    tmp_path_factory: pytest.TempPathFactory, case: tuple[str, str, np.ndarray, str, str, str]
) -> None:
    """Every pair of dtypes a checkpoint holds, random bits or small values, numpy or jax
    targets, ``quire.load`` or the lazy path: a cast is refused exactly when the oracle says
    it loses information (by kind, or an integer narrowed past a value), with a
    LossyCastError naming the leaf, both dtypes and ``casting``; else it is numpy's cast."""
    src, dst, v, target, reader, casting = case
    url = str(tmp_path_factory.mktemp("cast") / "ckpt")
    quire.save(url, {"w": v})
    want = np.zeros(v.shape, dtype(dst))
    t = want if target == "numpy" else jax.ShapeDtypeStruct(v.shape, dtype(dst))
    kw = {"casting": None if casting == "same_kind" else casting}
    if reader == "lazy":
        kw["transform"] = lambda tree: tree

    event(f"refused ({casting})" if _refused(src, dst, v, casting) else f"loaded ({casting})")
    if _refused(src, dst, v, casting):
        with pytest.raises(LossyCastError) as ei:
            quire.load(url, {"w": t}, **kw)
        msg = str(ei.value)
        assert "'w'" in msg and src in msg and dst in msg and "casting=" in msg, msg
        assert "unsafe" in msg and ei.value.mismatched, msg
        return
    got = quire.load(url, {"w": t}, **kw)["w"]
    with np.errstate(all="ignore"):
        expected = v.astype(dtype(dst))
    problem = same_bits(np.asarray(got), expected, any_nan=src != dst)
    assert problem is None, problem


def test_same_kind_agrees_with_numpy_on_numpy_types(tmp_path: Path) -> None:
    """For numpy's own types the rule is numpy's same_kind (plus the value check of
    narrowed ints); for ml_dtypes' types numpy's answer is wrong (kind "V"), the rule is not."""
    from quire._handlers.casting import can_cast

    names = ["bool", *INTS, "float16", "float32", "float64", *COMPLEX]
    for a in names:
        for b in names:
            assert can_cast(dtype(a), dtype(b), "same_kind") == np.can_cast(
                dtype(a), dtype(b), "same_kind"
            ), (a, b)
    bf16, f8, i4 = (dtype(n) for n in ("bfloat16", "float8_e4m3fn", "int4"))
    assert can_cast(np.dtype(np.float32), bf16, "same_kind")  # numpy: True too
    assert can_cast(bf16, np.dtype(np.float16), "same_kind")  # numpy: False (kind "V")
    assert can_cast(bf16, f8, "same_kind") and can_cast(f8, np.dtype(np.float32), "same_kind")
    assert not can_cast(np.dtype(np.float32), i4, "same_kind")  # numpy: True
    assert not can_cast(np.dtype(np.complex64), bf16, "same_kind")  # numpy: True
    assert can_cast(i4, np.dtype(np.int8), "same_kind") and not can_cast(bf16, i4, "same_kind")


@pytest.mark.filterwarnings("ignore:Casting complex values to real:numpy.exceptions.ComplexWarning")
def test_lossy_casts_are_listed_together_before_anything_is_read(tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    tree = {
        "w": np.linspace(0, 3, 6, dtype=np.float32),
        "z": np.ones(2, np.complex64),
        "n": np.arange(3, dtype=np.int32),
        "ok": np.ones(2, np.float64),
    }
    quire.save(url, tree)
    target = {
        "w": jax.ShapeDtypeStruct((6,), np.int32),
        "z": np.zeros(2, np.float32),
        "n": np.zeros(3, np.bool_),
        "ok": jax.ShapeDtypeStruct((2,), ml_dtypes.bfloat16),
    }
    with pytest.raises(LossyCastError) as ei:
        quire.load(url, target)
    e = ei.value
    assert isinstance(e, TreeMismatchError)
    assert [m.split(":")[0] for m in e.mismatched] == ["'w'", "'z'", "'n'"]
    msg = str(e)
    assert "'w': saved float32, target int32: a float cast to an int" in msg
    assert "'z': saved complex64, target float32: a complex cast to a float" in msg
    assert "'n': saved int32, target bool: an int cast to a bool" in msg
    assert "casting='unsafe'" in msg and "callable (key_path, target)" in msg
    # Per call: every leaf; per leaf: a callable of (key path, target leaf).
    got = quire.load(url, target, casting="unsafe")
    assert got["w"].dtype == np.int32 and np.asarray(got["w"]).tolist() == [0, 0, 1, 1, 2, 3]
    with pytest.raises(LossyCastError) as ei:
        quire.load(url, target, casting=lambda path, t: "unsafe" if path == ("w",) else None)
    assert [m.split(":")[0] for m in ei.value.mismatched] == ["'z'", "'n'"]
    allow = {("w",), ("z",), ("n",)}
    got = quire.load(url, target, casting=lambda path, t: "unsafe" if path in allow else None)
    assert got["n"].tolist() == [False, True, True]
    # The same through a Checkpointer and the lazy path.
    with pytest.raises(LossyCastError):
        quire.load(url, target, transform=lambda t: t)
    assert quire.load(url, target, transform=lambda t: t, casting="unsafe")["z"].dtype == np.float32
    with pytest.raises(ValueError, match="'same_kind'"):
        quire.load(url, target, casting="lossless")


def test_a_narrowed_int_is_refused_when_a_value_does_not_fit(tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    quire.save(url, {"small": np.arange(4, dtype=np.int64), "big": np.array([1, 300], np.int64)})
    target = {"small": np.zeros(4, np.int8), "big": jax.ShapeDtypeStruct((2,), np.int8)}
    with pytest.raises(LossyCastError) as ei:
        quire.load(url, target)
    msg = str(ei.value)
    assert "'big'" in msg and "int64" in msg and "int8" in msg and "1 to 300" in msg
    assert "casting='unsafe'" in msg
    got = quire.load(url, {"small": target["small"], "big": np.zeros(2, np.int16)})
    assert got["small"].dtype == np.int8 and got["big"].tolist() == [1, 300]
    wrapped = quire.load(url, target, casting="unsafe")["big"]
    assert np.asarray(wrapped).tolist() == [1, 44]
    # Sharded over 4 devices: each device's region is checked.
    mesh = jax.make_mesh((4,), ("d",))
    sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
    quire.save(url, {"x": np.array([0, 1, 2, 40000], np.int32)}, overwrite=True)
    with pytest.raises(LossyCastError, match="40000"):
        quire.load(url, {"x": jax.ShapeDtypeStruct((4,), np.int16, sharding=sh)})
    with pytest.raises(LossyCastError, match="40000"):
        quire.load(
            url,
            {"x": jax.ShapeDtypeStruct((4,), np.int16, sharding=sh)},
            transform=lambda t: t,
        )


def test_inline_numbers_follow_the_same_rule(tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    quire.save(url, {"f": 1.5, "i": 300, "s": np.float64(0.25), "b": True})
    with pytest.raises(LossyCastError) as ei:
        quire.load(url, {"f": int, "i": np.int8(0), "s": np.float32, "b": bool})
    assert [m.split(":")[0] for m in ei.value.mismatched] == ["'f'"]
    with pytest.raises(LossyCastError, match="300"):
        quire.load(url, {"f": float, "i": np.int8(0), "s": np.float32, "b": bool})
    got = quire.load(url, {"f": float, "i": np.int16(0), "s": np.float32, "b": int})
    assert got == {"f": 1.5, "i": 300, "s": np.float32(0.25), "b": 1}
    assert type(got["i"]) is np.int16 and type(got["s"]) is np.float32
    assert quire.load(url, {"f": int, "i": int, "s": float, "b": bool}, casting="unsafe")["f"] == 1


_TYPED = {"i": 300, "t": "False", "b": b"\x01\x02", "a0": np.array(300)}


@pytest.mark.parametrize("reader", ["load", "lazy"])
@pytest.mark.parametrize(
    ("key", "target"),
    [
        ("i", bytes),  # bytes(300): 300 zero bytes
        ("i", str),
        ("t", bool),  # bool("False") is True
        ("t", float),
        ("b", str),  # str(b"..."): "b'...'"
        ("a0", bytes),  # a 0-d array's element goes the same way
        ("a0", list),
    ],
)
def test_a_type_target_is_not_applied_by_calling_it(
    tmp_path: Path, reader: str, key: str, target: type
) -> None:
    """A Python type as the target of a scalar, str or bytes leaf converts only where the
    value stays what was saved; calling the type made other data (``bytes(300)``, an
    uninitialised ``np.ndarray(300)``, ``bool("False")``) with no error."""
    url = str(tmp_path / "ckpt")
    quire.save(url, _TYPED)
    tf = None if reader == "load" else (lambda t: t)
    with pytest.raises(quire.errors.UnsupportedLeafError) as ei:
        quire.load(url, {key: target}, partial=True, transform=tf)
    msg = str(ei.value)
    assert url in msg and f"leaf {key!r}" in msg and "make the abstract leaf" in msg


@pytest.mark.parametrize("reader", ["load", "lazy"])
def test_a_type_target_that_keeps_the_value_converts(tmp_path: Path, reader: str) -> None:
    """The conversions a type target makes: str to str, bytes to bytes / bytearray, a
    number to a number type by the casting rule (a wrapping one refused), ``np.ndarray`` (the
    type) a 0-d array of the saved dtype."""
    url = str(tmp_path / "ckpt")
    quire.save(url, _TYPED)
    tf = None if reader == "load" else (lambda t: t)
    targets = {"i": np.ndarray, "t": str, "b": bytearray, "a0": np.float32}
    got = quire.load(url, targets, transform=tf)
    assert got == {"i": 300, "t": "False", "b": bytearray(b"\x01\x02"), "a0": 300.0}
    assert type(got["i"]) is np.ndarray and got["i"].shape == () and got["i"].dtype == np.int64
    assert type(got["b"]) is bytearray and type(got["a0"]) is np.float32
    got = quire.load(url, {"i": np.float32, "t": "", "b": bytes, "a0": int}, transform=tf)
    assert got == {"i": 300.0, "t": "False", "b": b"\x01\x02", "a0": 300}
    assert type(got["i"]) is np.float32 and type(got["a0"]) is int
    # np.int8(np.int64(300)) wraps to 44: the type is a cast like any other.
    with pytest.raises(LossyCastError, match="300"):
        quire.load(url, {"a0": np.int8}, partial=True, transform=tf)


@pytest.mark.parametrize("reader", ["load", "lazy"])
@pytest.mark.parametrize(
    ("key", "target", "why"),
    [
        ("name", np.zeros((), np.float32), "str, target float32 array of shape ()"),
        ("name", jax.ShapeDtypeStruct((), np.float32), "str, target float32 array"),
        ("lr", np.zeros((), np.float32), "str, target float32 array"),  # it parsed as 0.001
        ("lr", np.float32(0), "str, target float32 array"),
        ("blob", np.zeros((), np.uint8), "bytes, target uint8 array"),
        ("n", np.zeros(3, np.int64), "int, target int64 array of shape (3,)"),
        ("n", jax.ShapeDtypeStruct((3,), np.int32), "int, target int32 array of shape (3,)"),
    ],
)
def test_a_str_or_scalar_leaf_into_an_array_target_is_a_mismatch(
    tmp_path: Path, reader: str, key: str, target: Any, why: str
) -> None:
    """A saved str or bytes has no array to give an array target, and a scalar none of
    another shape: each is a TreeMismatchError naming the key path and both sides (a str
    was a bare ValueError, or parsed as a number when it could be; a scalar came back 0-d
    into a target of shape (3,))."""
    url = str(tmp_path / "ckpt")
    quire.save(url, {"cfg": {"name": "abc", "lr": "0.001", "blob": b"\x01", "n": 3}})
    tf = None if reader == "load" else (lambda t: t)
    with pytest.raises(TreeMismatchError) as ei:
        quire.load(url, {"cfg": {key: target}}, partial=True, transform=tf)
    assert url in str(ei.value) and why in str(ei.value)
    assert [m.split(":")[0] for m in ei.value.mismatched] == [f"'cfg/{key}'"]
    # Into their own kind they load, a scalar into an array of shape () too.
    own = {"name": "", "lr": str, "blob": bytes, "n": np.zeros((), np.int64)}
    assert quire.load(url, {"cfg": own}, transform=tf)["cfg"]["n"] == np.int64(3)


def test_lazy_astype_and_read_dtype_are_casts_asked_for(tmp_path: Path) -> None:
    """A cast named in the transform (astype) or in LazyArray.read(dtype=) stays allowed."""
    url = str(tmp_path / "ckpt")
    quire.save(url, {"w": np.array([1.7, -2.2], np.float32)})
    got = quire.load(
        url, {"w": np.zeros(2, np.int32)}, transform=lambda t: {"w": t["w"].astype("int32")}
    )
    assert got["w"].tolist() == [1, -2]
    with quire.open(url) as src:
        assert src.tree["w"].read(dtype=np.int32).tolist() == [1, -2]


# ------------------------------------------------------------------------------ messages
def _fix(e: BaseException) -> str:
    """The "To fix:" line of a TreeMismatchError's message."""
    (line,) = [ln for ln in str(e).splitlines() if ln.strip().startswith("To fix:")]
    return line


def test_each_mismatch_names_its_own_fix(tmp_path: Path) -> None:
    """It said "To fix: fix the abstract tree." for a wrong shape and a new layer alike."""
    url = str(tmp_path / "ckpt")
    quire.save(url, {"dense": {"w": np.ones((4, 3), np.float32)}, "step": 3})
    dense = {"w": jax.ShapeDtypeStruct((4, 3), np.float32)}
    # A layer new in the target: initialise it and merge, with transform=.
    with pytest.raises(TreeMismatchError) as ei:
        quire.load(url, {"dense": dense, "head": {"w": np.zeros(2)}, "step": int})
    fix = _fix(ei.value)
    assert "transform=" in fix and "fresh" in fix and "fix the abstract tree" not in fix
    assert "partial=True" not in fix
    # What that fix says works (a freshly initialised head is a concrete array).
    got = quire.load(
        url,
        {"dense": dense, "head": {"w": np.zeros(2)}, "step": int},
        transform=lambda saved: {**saved, "head": {"w": np.full(2, 0.5)}},
    )
    assert got["head"]["w"].tolist() == [0.5, 0.5] and got["step"] == 3
    # A subset of the checkpoint: partial=True, and nothing about transforms.
    with pytest.raises(TreeMismatchError) as ei:
        quire.load(url, {"dense": dense})
    fix = _fix(ei.value)
    assert "partial=True" in fix and "transform" not in fix
    # A wrong shape: the saved one, in the mismatch, and where to read every saved shape.
    with pytest.raises(TreeMismatchError) as ei:
        quire.load(url, {"dense": {"w": jax.ShapeDtypeStruct((3, 4), np.float32)}, "step": int})
    assert ei.value.mismatched == ["'dense/w': saved shape (4, 3) float32, target shape (3, 4)"]
    fix = _fix(ei.value)
    assert "saved shapes" in fix and "quire.metadata(url)" in fix
    assert "partial=True" not in fix and "fix the abstract tree" not in fix
    # Through a transform: the transform is what changes.
    with pytest.raises(TreeMismatchError) as ei:
        quire.load(url, {"dense": dense, "step": int}, transform=lambda s: {"dense": s["dense"]})
    assert str(ei.value).startswith(f"the transform result of {url} does not match")
    assert "return them from the transform" in _fix(ei.value)


@pytest.mark.parametrize(
    "fn", [jax.nn.relu, lambda x: x, np.tanh, print], ids=["relu", "lambda", "ufunc", "builtin"]
)
def test_a_function_in_the_tree_is_left_out_not_given_a_handler(tmp_path: Path, fn: Any) -> None:
    url = str(tmp_path / "ckpt")
    with pytest.raises(quire.errors.UnsupportedLeafError) as ei:
        quire.save(url, {"w": np.ones(2), "act": fn})
    msg = str(ei.value)
    assert "'act' is a function" in msg and "leave them out" in msg
    assert "eqx.filter" in msg and "nnx.state" in msg
    assert "handler" not in msg and "register" not in msg
    quire.save(url, {"w": np.ones(2)})
    with pytest.raises(quire.errors.UnsupportedLeafError, match="'act' is a function") as ei:
        quire.load(url, {"w": np.zeros(2), "act": fn})
    assert "register" not in str(ei.value)


# ------------------------------------------------------------------------ named units
def test_a_step_saved_as_units_loads_or_names_the_units_call(tmp_path: Path) -> None:
    """Checkpointer.load on a step of named units raised "no pytree unit 'pytree'" (a
    CheckpointNotFoundError naming quire.load_checkpointables without the units)."""
    w = np.arange(3.0)
    with quire.Checkpointer(tmp_path / "run") as ck:
        ck.save_checkpointables(1, {"state": {"w": w}})
        ck.save_checkpointables(2, {"state": {"w": w}, "config": {"epoch": 2}})
        ck.wait()
        # One unit, a pytree: it is the step's tree (nothing is left behind).
        assert ck.load(1, {"w": np.zeros(3)})["w"].tolist() == [0.0, 1.0, 2.0]
        assert ck.load(1)["w"].tolist() == [0.0, 1.0, 2.0]
        assert quire.load(tmp_path / "run" / "step_00000001")["w"].tolist() == [0.0, 1.0, 2.0]
        with quire.open(tmp_path / "run" / "step_00000001") as src:
            assert src.tree["w"].read().tolist() == [0.0, 1.0, 2.0]
        # Several: the error names the call that loads them, with their names.
        with pytest.raises(quire.errors.CheckpointNotFoundError) as ei:
            ck.load(2, {"w": np.zeros(3)})
        msg = str(ei.value)
        assert "{'state': target, 'config': None}" in msg
        assert "quire.load_checkpointables(url, " in msg
        assert "Checkpointer.load_checkpointables(step, " in msg
        got = ck.load_checkpointables(2, {"state": {"w": np.zeros(3)}, "config": None})
        assert got["state"]["w"].tolist() == [0.0, 1.0, 2.0] and got["config"] == {"epoch": 2}


def test_a_64_bit_jax_target_with_x64_off_holds_only_what_fits_32_bits(tmp_path: Path) -> None:
    """With jax_enable_x64 off (JAX's default, and here) a jax.Array of int64 / float64 is
    int32 / float32: the cast rule sees that dtype, not the one the target names.  A
    ShapeDtypeStruct of int64 over saved int64 values past int32 wrapped them (2**40+7 -> 7)
    and float64 1e300 became float32 inf, with no error (the hunt's finding 1), while an
    explicit int32 target was refused.  Values that fit load as the 32-bit type."""
    assert not jax.config.jax_enable_x64
    url = str(tmp_path / "ckpt")
    big = np.array([2**40 + 7, -5], np.int64)
    huge = np.array([1e300, 0.5], np.float64)
    quire.save(url, {"i": big, "f": huge, "n": 2**40 + 7, "ok": np.array([7, -5], np.int64)})
    mesh = jax.make_mesh((2,), ("d",))
    sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
    sds = jax.ShapeDtypeStruct

    def refused(target: dict[str, Any], key: str, named: str, real: str, **kw: Any) -> None:
        with pytest.raises(LossyCastError) as ei:
            quire.load(url, target, partial=True, **kw)
        msg = str(ei.value)
        assert url in msg and f"'{key}'" in msg and named in msg and real in msg, msg
        assert "jax_enable_x64" in msg and "numpy" in msg and ei.value.mismatched, msg

    for key, named, real in (("i", "int64", "int32"), ("f", "float64", "float32")):
        for s in (None, sh):
            t = sds((2,), np.dtype(named), sharding=s)
            refused({key: t}, key, named, real)  # quire.load
        # the lazy path (a jax.Array where the target has a sharding)
        refused(
            {key: sds((2,), np.dtype(named), sharding=sh)},
            key,
            named,
            real,
            transform=lambda tr: tr,
        )
        refused({key: jax.Array}, key, named, real)  # "as saved", as a jax.Array
        with pytest.raises(LossyCastError, match="jax_enable_x64"):
            quire.open(url).tree[key].read(sharding=sh)
        with pytest.raises(LossyCastError, match="jax_enable_x64"):
            quire.open(url).tree[key].read(dtype=np.dtype(named), sharding=sh)
        # numpy holds 64 bits whatever JAX's setting: the saved values, exactly.
        got = quire.load(url, {key: np.zeros(2, np.dtype(named))}, partial=True)[key]
        assert got.dtype == np.dtype(named) and got.tolist() == {"i": big, "f": huge}[key].tolist()
    refused({"n": sds((), np.int64)}, "n", "int64", "int32")  # an inline Python int
    refused({"i": sds((2,), np.int64)}, "i", "int64", "int32", shardings=sh)
    # A 64-bit jax.Array cannot exist here: a concrete target is already 32 bits and
    # refused by the ordinary rule.
    concrete = jax.device_put(np.zeros(2, np.int64))
    assert concrete.dtype == np.int32
    with pytest.raises(LossyCastError, match="do not fit the target's int32"):
        quire.load(url, {"i": concrete}, partial=True)
    # A Checkpointer restores through the same rule.
    ck = quire.Checkpointer(str(tmp_path / "root"))
    ck.save(1, {"i": big})
    ck.wait()
    with pytest.raises(LossyCastError, match="jax_enable_x64"):
        ck.load(1, {"i": sds((2,), np.int64)})
    # What fits is loaded, as the 32-bit type a jax.Array holds here.
    got = quire.load(url, {"ok": sds((2,), np.int64, sharding=sh)}, partial=True)["ok"]
    assert got.dtype == np.int32 and np.asarray(got).tolist() == [7, -5]
    lazy = {"ok": sds((2,), np.int64, sharding=sh)}
    got = quire.load(url, lazy, partial=True, transform=lambda t: t)["ok"]
    assert got.dtype == np.int32 and np.asarray(got).tolist() == [7, -5]
    quire.save(url, {"f": np.array([0.5, 1e30], np.float64)}, overwrite=True)
    got = quire.load(url, {"f": sds((2,), np.float64)})["f"]
    assert got.dtype == np.float32 and np.asarray(got).tolist() == [0.5, np.float32(1e30)]
