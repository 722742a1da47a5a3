"""Generated round-trip cases as plain data, their values, and an oracle that trusts no quire code.

Shared by the property tests of one process (``core/tests/test_props_roundtrip.py``, which draws
cases with the strategies of ``propgen.py``) and the worker processes of the multi-process set
(``tests/multihost/props_worker.py``, which receives cases as JSON): a case is frozen
dataclasses of ints, strings and tuples, so every process rebuilds the same values from it.

The oracle:

* values are a pure function of the leaf (its seed, shape and dtype), made with numpy only;
  floats are random *bit patterns* (NaNs with payloads, -0.0, infinities, subnormals);
* what a leaf must hold after a round trip is that value passed through numpy's own casts
  (the storage cast, then the load cast): ``expected``;
* ``same_bits`` compares bit patterns; where a cast took place, any NaN matches any NaN (numpy
  and XLA may pick different NaN payloads), everything else bit for bit;
* the stored arrays are read again with plain zarr through fsspec's reference file system
  (format v2, built from ``quire.json`` and the chunk indexes with ``json`` only) or with
  tensorstore's zarr3 driver (format v1); see ``external_reads``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import posixpath
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

# ------------------------------------------------------------------------------ dtypes
# Every dtype a checkpoint may hold (docs/format.md), spelled as zarr / tensorstore spell them.
FLOATS = ("float16", "float32", "float64", "bfloat16")
FLOAT8 = tuple(
    n
    for n in (
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
        "float8_e4m3b11fnuz",
        "float8_e4m3",
        "float8_e3m4",
        "float8_e8m0fnu",
    )
    if hasattr(ml_dtypes, n)
)
INTS = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")
SUBBYTE = tuple(n for n in ("int4", "uint4", "int2", "uint2") if hasattr(ml_dtypes, n))
COMPLEX = ("complex64", "complex128")
DTYPES = ("bool", *INTS, *FLOATS, *FLOAT8, *SUBBYTE, *COMPLEX)
# A jax.Array of a 64-bit dtype needs jax_enable_x64 (off here): numpy leaves cover them.
WIDE = ("int64", "uint64", "float64", "complex128")
JAX_DTYPES = tuple(d for d in DTYPES if d not in WIDE)

# Sub-byte integers: their range (ml_dtypes keeps one value per byte).
_RANGE = {"int4": (-8, 8), "uint4": (0, 16), "int2": (-2, 2), "uint2": (0, 4)}


def dtype(name: str) -> np.dtype[Any]:
    return np.dtype(getattr(ml_dtypes, name)) if hasattr(ml_dtypes, name) else np.dtype(name)


def is_float(name: str) -> bool:
    return name in FLOATS or name in FLOAT8


def is_int(name: str) -> bool:
    return name in INTS or name in SUBBYTE


# ------------------------------------------------------------------------------ the case
Axis = str | tuple[str, ...] | None  # one entry of a PartitionSpec


@dataclass(frozen=True)
class MeshCase:
    """``jax.make_mesh(shape, names, axis_types=types, devices=[jax.devices()[i] ...])``."""

    shape: tuple[int, ...]
    names: tuple[str, ...]
    types: tuple[str, ...]  # "auto" / "explicit", per axis
    devices: tuple[int, ...]  # positions in jax.devices() (all processes'), in mesh order

    def build(self) -> Any:
        import jax
        from jax.sharding import AxisType

        everywhere = jax.devices()  # the same order in every process
        kinds = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}
        return jax.make_mesh(
            self.shape,
            self.names,
            axis_types=tuple(kinds[t] for t in self.types),
            devices=[everywhere[i] for i in self.devices],
        )


@dataclass(frozen=True)
class Place:
    """Where a jax.Array lives: a mesh and a partition spec."""

    mesh: MeshCase
    spec: tuple[Axis, ...]

    def sharding(self) -> Any:
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        return NamedSharding(self.mesh.build(), P(*self.spec))


@dataclass(frozen=True)
class Storage:
    """``quire.StorageOptions`` of one leaf."""

    dtype: str | None = None
    codecs: tuple[str, ...] = ()
    chunk_bytes: int | None = None
    checksum: bool = True
    transpose: tuple[int, ...] | None = None  # an array-to-array codec's axis order

    def options(self) -> Any:
        import quire

        codecs: list[Any] = list(self.codecs)
        if self.transpose is not None:  # given last: quire puts it before ``bytes``
            codecs.append({"name": "transpose", "configuration": {"order": list(self.transpose)}})
        return quire.StorageOptions(
            dtype=None if self.dtype is None else dtype(self.dtype),
            codecs=codecs or None,
            chunk_bytes=self.chunk_bytes,
            checksum=self.checksum,
            # ``expected`` is numpy's cast of random bits: the lossy ones asked for by name
            # (test_roundtrip checks that the default refuses them).
            casting="unsafe",
        )


@dataclass(frozen=True)
class Target:
    """What a leaf is loaded as: ``kind`` "numpy" (a numpy array), "jax" (a
    ShapeDtypeStruct with ``place``'s sharding); ``dtype`` None: the stored dtype."""

    kind: str
    place: Place | None = None
    dtype: str | None = None


@dataclass(frozen=True)
class Leaf:
    """One array leaf: at ``path`` in the tree, its value made from ``seed``."""

    path: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: str
    seed: int
    place: Place | None = None  # None: a numpy array, else a jax.Array placed there
    storage: Storage | None = None
    target: Target | None = None  # None: not in a partial target

    @property
    def stored_dtype(self) -> str:
        return (
            self.dtype
            if self.storage is None or self.storage.dtype is None
            else (self.storage.dtype)
        )

    @property
    def loaded_dtype(self) -> str:
        t = self.target
        return self.stored_dtype if t is None or t.dtype is None else t.dtype

    def with_seed(self, seed: int) -> Leaf:
        return Leaf(self.path, self.shape, self.dtype, seed, self.place, self.storage, self.target)


@dataclass(frozen=True)
class Case:
    """A tree of leaves, how it is saved and how it is loaded.

    ``path``: "save", "save_async", "partial" (the journal), "tier" (a Checkpointer with a
    local tier) or "incremental" (an incremental Checkpointer's steps); ``target``: "none"
    (load as saved), "tree" (an abstract tree naming every leaf) or "partial" (only the
    leaves whose ``target`` is set, ``partial=True``).

    ``versions``: for "partial", the journal's versions, each ``(leaf index, seed)`` pairs (a
    leaf seen before is replaced); for "incremental", the steps after the first, each the
    leaves that change (a seed equal to the leaf's current one: a new object with the same
    bytes).  ``deleted``: leaves a last journal version deletes.
    """

    leaves: tuple[Leaf, ...]
    path: str = "save"
    target: str = "none"
    layout: str = "packed"
    replica_writes: bool = True
    replica_reads: bool | None = None
    scalars: tuple[tuple[str, Any], ...] = ()  # inline leaves: (key, value)
    piece_bytes: int | None = None  # replica_piece_bytes (None: the default, 1 MiB)
    reader: str = "load"  # "load": quire.load; "lazy": quire.load with a transform (quire.open)
    versions: tuple[tuple[tuple[int, int], ...], ...] = ()
    deleted: tuple[int, ...] = ()

    def at(self, seeds: dict[int, int], dropped: Iterable[int] = ()) -> Case:
        """This case with some leaves' seeds replaced and some leaves left out."""
        gone = set(dropped)
        leaves = tuple(
            leaf.with_seed(seeds.get(i, leaf.seed))
            for i, leaf in enumerate(self.leaves)
            if i not in gone
        )
        return dataclasses.replace(self, leaves=leaves)

    def to_json(self) -> str:
        return json.dumps(_plain(self))

    @staticmethod
    def from_json(text: str) -> Case:
        return _case(json.loads(text))


def _plain(x: Any) -> Any:
    if isinstance(x, Case | Leaf | Place | MeshCase | Storage | Target):
        return {"_": type(x).__name__, **{k: _plain(v) for k, v in vars(x).items()}}
    if isinstance(x, tuple | list):
        return [_plain(v) for v in x]
    return x


_TYPES = {c.__name__: c for c in (Case, Leaf, Place, MeshCase, Storage, Target)}


def _tup(x: Any) -> Any:
    return tuple(_tup(v) for v in x) if isinstance(x, list) else x


def _case(d: Any) -> Any:
    if isinstance(d, dict) and "_" in d:
        cls = _TYPES[d["_"]]
        kw = {k: _case(v) for k, v in d.items() if k != "_"}
        if cls is Case:
            kw["scalars"] = tuple((k, v) for k, v in d["scalars"])
        if cls is Place:
            kw["spec"] = tuple(_tup(s) for s in d["spec"])
        return cls(**kw)
    if isinstance(d, list):
        return tuple(_case(v) for v in d)
    return d


# ------------------------------------------------------------------------------ values
def values(leaf: Leaf) -> np.ndarray:
    """The leaf's value (numpy only): random bits for floats and ints, with a few special
    values (NaNs of both signs, infinities, -0.0, the smallest subnormal, the extremes)
    planted where the bits alone would hardly ever give them; in range for sub-byte ints
    and bools."""
    rng = np.random.default_rng(leaf.seed)
    d = dtype(leaf.dtype)
    n = math.prod(leaf.shape)
    if leaf.dtype == "bool":
        return rng.integers(0, 2, leaf.shape).astype(bool)
    if leaf.dtype in _RANGE:
        lo, hi = _RANGE[leaf.dtype]
        return rng.integers(lo, hi, leaf.shape).astype(d)
    raw = rng.integers(0, 256, n * d.itemsize, dtype=np.uint8)
    flat = raw.view(d).copy()
    special = _specials(d)
    if n and len(special):
        at = rng.choice(n, size=min(n, len(special)), replace=False)
        flat[at] = rng.choice(special, size=len(at))
    return flat.reshape(leaf.shape)


def _specials(d: np.dtype[Any]) -> np.ndarray:
    if d.kind in "iu":
        info = np.iinfo(d)
        return np.array([info.min, info.max, 0, -1 if d.kind == "i" else 1], d)
    with np.errstate(all="ignore"):
        if d.kind == "c":
            part = _specials(np.dtype(f"f{d.itemsize // 2}"))
            return (part[:, None] + 1j * part[None, :]).reshape(-1).astype(d)
        base = [np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0]
        try:
            info = ml_dtypes.finfo(d)
            base += [float(info.smallest_subnormal), float(info.max), float(info.min)]
        except (ValueError, TypeError):
            pass
        out = np.array(base, np.float64).astype(d)
        nan = np.float32(np.nan).view(np.uint32) | np.uint32(0x1234)  # a NaN with a payload
        if d.itemsize == 4:
            out = np.concatenate([out, np.array([nan], np.uint32).view(d)])
        return out


def stored(leaf: Leaf) -> np.ndarray:
    """What the checkpoint must store for ``leaf``: its value after the storage cast."""
    v = values(leaf)
    return v if leaf.stored_dtype == leaf.dtype else _cast(v, leaf.stored_dtype)


def expected(leaf: Leaf) -> np.ndarray:
    """What a load must return: the stored value after the target's cast."""
    v = stored(leaf)
    return v if leaf.loaded_dtype == leaf.stored_dtype else _cast(v, leaf.loaded_dtype)


def _cast(v: np.ndarray, to: str) -> np.ndarray:
    with np.errstate(all="ignore"):
        return v.astype(dtype(to))


def was_cast(leaf: Leaf) -> bool:
    return leaf.loaded_dtype != leaf.dtype


# ------------------------------------------------------------------------------ comparing
def _nan(a: np.ndarray) -> np.ndarray:
    if a.dtype.kind == "c":
        return np.isnan(a.real) | np.isnan(a.imag)
    try:
        return np.isnan(a)
    except TypeError:
        return np.zeros(a.shape, bool)


def _words(a: np.ndarray) -> np.ndarray:
    """Bit patterns, one unsigned int per element (sub-byte ints: their value)."""
    a = np.ascontiguousarray(a)
    if a.dtype.name in _RANGE:
        return a.astype(np.int8).view(np.uint8)
    if a.dtype.kind == "c":
        return a.view(np.dtype(f"u{a.dtype.itemsize // 2}")).reshape(*a.shape, 2)
    return a.view(np.dtype(f"u{a.dtype.itemsize}"))


def same_bits(got: Any, want: np.ndarray, *, any_nan: bool = False) -> str | None:
    """None when ``got`` holds ``want``'s dtype, shape and bit patterns, else what differs.
    ``any_nan``: a NaN matches any NaN (after a cast, where payloads are not specified)."""
    g = np.asarray(got)
    if g.dtype != want.dtype:
        return f"dtype {g.dtype} != {want.dtype}"
    if g.shape != want.shape:
        return f"shape {g.shape} != {want.shape}"
    gw, ww = _words(g), _words(want)
    if any_nan:
        gn, wn = _nan(g), _nan(want)
        if gw.ndim > g.ndim:  # complex: per part
            gn = gn[..., None]
            wn = wn[..., None]
        bad = (gw != ww) & ~(gn & wn)
        bad |= np.broadcast_to(gn != wn, bad.shape)
    else:
        bad = gw != ww
    if not bad.any():
        return None
    where = tuple(int(i) for i in np.argwhere(bad)[0])
    return f"{int(bad.sum())} elements differ, first at {where}: {g[where[: g.ndim]]!r} != {want[where[: g.ndim]]!r}"


# ------------------------------------------------------------------------------ the tree
def build_tree(case: Case) -> dict[str, Any]:
    """The tree a case saves: numpy arrays, jax.Arrays placed as asked, and inline scalars."""
    tree: dict[str, Any] = {}
    for leaf in case.leaves:
        put(tree, leaf.path, array(leaf))
    for key, value in case.scalars:
        tree[key] = value
    return tree


def array(leaf: Leaf) -> Any:
    """The leaf's value as the tree holds it: numpy, or a jax.Array placed as asked."""
    v = values(leaf)
    if leaf.place is None:
        return v
    import jax

    # Each process places the shards of its own devices (several JAX processes: the others').
    return jax.make_array_from_callback(
        leaf.shape, leaf.place.sharding(), lambda i: v[i], dtype=v.dtype
    )


def load(url: Any, case: Case) -> Any:
    """Load a case's checkpoint onto its target, through ``quire.load`` or through the lazy
    sources (``quire.load`` with the identity transform: ``quire.open`` + materialize)."""
    import quire

    target = None if case.target == "none" else abstract(case)
    partial = case.target == "partial"
    if case.reader == "lazy":
        return quire.load(
            str(url), target, transform=lambda tree: tree, partial=partial, casting=casting(case)
        )
    return quire.load(url, target, partial=partial, casting=casting(case))


def casting(case: Case) -> Any:
    """The ``casting=`` of a case's load: ``"unsafe"`` for each leaf whose target asks for
    another dtype than the stored one (``expected`` is numpy's unsafe cast: random bits
    narrowed, floats to ints...), the default for the others (None: every leaf's)."""
    cast = {lf.path for lf in case.leaves if lf.target is not None and was_load_cast(lf)}
    if not cast:
        return None
    return lambda path, target: "unsafe" if tuple(map(str, path)) in cast else None


def was_load_cast(leaf: Leaf) -> bool:
    return leaf.loaded_dtype != leaf.stored_dtype


def context(case: Case) -> Any:
    """The ``quire.Context`` a case saves and loads in (shared reads of any size when on)."""
    import quire

    opts: dict[str, Any] = {
        "layout": case.layout,
        "replica_writes": case.replica_writes,
        "replica_reads": case.replica_reads,
    }
    if case.replica_reads:
        opts["replica_read_min_bytes"] = 0
    if case.piece_bytes is not None:
        opts["replica_piece_bytes"] = case.piece_bytes
    return quire.Context(**opts)


def storage_of(case: Case) -> Any:
    """The ``storage=`` callable of a case: each leaf's ``Storage``, by key path."""
    by_path = {leaf.path: leaf.storage for leaf in case.leaves if leaf.storage is not None}

    def storage(path: tuple[Any, ...], leaf: Any) -> Any:
        s = by_path.get(tuple(str(k) for k in path))
        return None if s is None else s.options()

    return storage


def donate(tree: dict[str, Any]) -> None:
    """A training step right after save_async: every jax.Array donated to a jitted step
    that overwrites it (XLA reuses the buffer), every numpy array overwritten in place."""
    import jax

    for x in jax.tree.leaves(tree):
        if isinstance(x, jax.Array):  # one step per array: their meshes differ
            step = jax.jit(jax.numpy.zeros_like, donate_argnums=0, out_shardings=x.sharding)
            jax.block_until_ready(step(x))
        elif isinstance(x, np.ndarray) and x.size:
            x.reshape(-1).view(np.uint8)[...] = 0x5A


def put(tree: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    node = tree
    for k in path[:-1]:
        node = node.setdefault(k, {})
    node[path[-1]] = value


def get(tree: Any, path: tuple[str, ...]) -> Any:
    for k in path:
        tree = tree[k]
    return tree


def abstract(case: Case) -> dict[str, Any]:
    """The load target of a case ("tree": every leaf; "partial": those with a target)."""
    import jax

    out: dict[str, Any] = {}
    for leaf in case.leaves:
        t = leaf.target
        if t is None:
            assert case.target == "partial", leaf
            continue
        d = dtype(leaf.loaded_dtype)
        if t.kind == "numpy":
            put(out, leaf.path, np.zeros(leaf.shape, d))
        else:
            sharding = None if t.place is None else t.place.sharding()
            put(out, leaf.path, jax.ShapeDtypeStruct(leaf.shape, d, sharding=sharding))
    if case.target != "partial":
        for key, value in case.scalars:
            out[key] = type(value) if value is not None else None
    return out


def loaded_leaves(case: Case) -> list[Leaf]:
    """The leaves a load of ``case`` returns (each with its target; None: as saved)."""
    if case.target == "none":
        return [_untargeted(leaf) for leaf in case.leaves]
    return [leaf for leaf in case.leaves if leaf.target is not None]


def _untargeted(leaf: Leaf) -> Leaf:
    return Leaf(leaf.path, leaf.shape, leaf.dtype, leaf.seed, leaf.place, leaf.storage, None)


def check_loaded(case: Case, got: Any) -> list[str]:
    """Every difference between a loaded tree and what the case must load (empty: none)."""
    problems = []
    for lf in loaded_leaves(case):
        try:
            value = get(got, lf.path)
        except (KeyError, TypeError) as e:
            problems.append(f"{'/'.join(lf.path)}: missing ({e!r})")
            continue
        want = expected(lf)
        bad = _compare(value, want, was_cast(lf))
        if bad is None:
            bad = _placement(value, lf)
        if bad is not None:
            problems.append(f"{'/'.join(lf.path)} ({lf.dtype}{list(lf.shape)}): {bad}")
    if case.target != "partial":
        for key, value in case.scalars:
            if (
                key not in got
                or type(got[key]) is not type(value)
                or not _same_scalar(got[key], value)
            ):
                problems.append(f"{key}: {got.get(key)!r} != {value!r}")
    return problems


def _compare(value: Any, want: np.ndarray, any_nan: bool) -> str | None:
    """A numpy value whole; a jax.Array shard by shard (with several JAX processes, the
    shards of this process's devices), each against its region of ``want``."""
    shards = getattr(value, "addressable_shards", None)
    if shards is None:
        return same_bits(value, want, any_nan=any_nan)
    if value.shape != want.shape or value.dtype != want.dtype:
        return f"{value.dtype}{list(value.shape)} != {want.dtype}{list(want.shape)}"
    for s in shards:
        bad = same_bits(np.asarray(s.data), want[s.index], any_nan=any_nan)
        if bad is not None:
            return f"shard {s.index} on {s.device}: {bad}"
    return None


def _same_scalar(a: Any, b: Any) -> bool:
    if isinstance(b, float) and math.isnan(b):
        return isinstance(a, float) and math.isnan(a)
    return bool(a == b)


def _placement(value: Any, leaf: Leaf) -> str | None:
    """A jax target must come back on the devices and with the spec it asked for."""
    t = leaf.target
    if t is None or t.kind == "numpy":
        if t is not None and not isinstance(value, np.ndarray):
            return f"a numpy target came back as {type(value).__name__}"
        return None
    if t.place is None:
        return None
    want = t.place.sharding()
    got = getattr(value, "sharding", None)
    if got is None or not want.is_equivalent_to(got, len(leaf.shape)):
        return f"sharding {got} is not the target's {want}"
    return None


# ------------------------------------------------------------------------------ outside readers
# What plain zarr (format v2, through fsspec's reference file system) and tensorstore (format
# v1) cannot open, and why: the oracle skips that reader for those dtypes only.  zarr-python
# 3.1 has no bfloat16, float8 or sub-byte int data types of its own and does not load them
# from its entry-point group; quire registers its own when imported (README, "Known
# limitations"), so plain zarr reads them in this process, which has imported quire.
ZARR_CANNOT: dict[str, str] = {}
# tensorstore 0.1.86's zarr3 driver lists bool, int2, int4, (u)int8-64, float8_e3m4,
# float8_e4m3fn, float8_e4m3fnuz, float8_e4m3b11fnuz, float8_e5m2, float8_e5m2fnuz,
# float8_e8m0fnu, float4_e2m1fn, float16, bfloat16, float32, float64, complex64, complex128.
TENSORSTORE_CANNOT = {
    "uint4": "tensorstore's zarr3 driver has no uint4 data type",
    "uint2": "tensorstore's zarr3 driver has no uint2 data type",
    "float8_e4m3": "tensorstore's zarr3 driver has no float8_e4m3 (IEEE-style) data type",
}


def record_leaves(doc: dict[str, Any]) -> Iterator[tuple[tuple[str, ...], dict[str, Any]]]:
    """(key path, leaf entry) of every leaf of the ``pytree`` unit of a ``quire.json``,
    walked with ``json`` only (the record's node kinds, docs/format.md)."""

    def walk(node: dict[str, Any], path: tuple[str, ...]) -> Iterator[Any]:
        kind = node["kind"]
        if kind == "leaf":
            yield path, node
        elif kind == "dict":
            for k, child in zip(node["keys"], node["children"]):
                yield from walk(child, (*path, str(k)))
        else:
            for i, child in enumerate(node.get("children", [])):
                yield from walk(child, (*path, str(i)))

    yield from walk(doc["units"]["pytree"]["tree"], ())


# What the outside readers did, for a deep run's report: reader -> arrays read / skipped.
READS: Counter[str] = Counter()


def external_reads(ckpt: Path, case: Case) -> list[str]:
    """Read every stored array of a local checkpoint with software other than quire and
    compare it with what must be stored; the differences (empty: none)."""
    doc = json.loads((ckpt / "quire.json").read_text())
    entries = dict(record_leaves(doc))
    problems: list[str] = []
    refs = _reference_index(ckpt, doc) if doc["version"] == 2 else None
    for lf in case.leaves:
        entry = entries.get(lf.path)
        if entry is None:
            problems.append(f"{'/'.join(lf.path)}: not in quire.json")
            continue
        if "location" not in entry:
            continue  # stored inline (checked by the load)
        name = lf.stored_dtype
        reader = "zarr" if refs is not None else "tensorstore"
        if name in (ZARR_CANNOT if refs is not None else TENSORSTORE_CANNOT):
            READS[f"{reader} skipped ({name})"] += 1
            continue
        codecs = () if lf.storage is None else lf.storage.codecs
        if reader == "tensorstore" and any(c.startswith("numcodecs.") for c in codecs):
            # numcodecs' codecs are not zarr v3 codecs: tensorstore knows none of them.
            READS["tensorstore skipped (numcodecs codec)"] += 1
            continue
        if refs is not None:
            got = _zarr_read(ckpt, refs, entry["location"])
        else:
            got = _tensorstore_read(ckpt / entry["location"])
        READS[reader] += 1
        bad = same_bits(got, stored(lf), any_nan=False)
        if bad is not None:
            problems.append(f"{'/'.join(lf.path)} read by {reader}: {bad}")
    return problems


def _reference_index(ckpt: Path, doc: dict[str, Any]) -> dict[str, Any]:
    """The chunk indexes merged, their targets made relative to the checkpoint's parent
    (a borrowed target of an incremental step names a sibling step: docs/format.md)."""
    refs: dict[str, Any] = {}
    for e in doc.get("indexes") or []:
        index = json.loads((ckpt / e["object"]).read_text())
        for key, ref in index["refs"].items():
            if isinstance(ref, list):
                ref = [posixpath.normpath(f"{ckpt.name}/{ref[0]}"), *ref[1:]]
            refs[key] = ref
    return {"version": 1, "refs": refs}


def _zarr_read(ckpt: Path, refs: dict[str, Any], location: str) -> np.ndarray:
    import fsspec
    import zarr
    from fsspec.implementations.asyn_wrapper import AsyncFileSystemWrapper
    from fsspec.implementations.dirfs import DirFileSystem
    from fsspec.implementations.local import LocalFileSystem
    from zarr.storage import FsspecStore

    remote = DirFileSystem(
        path=str(ckpt.parent),
        fs=AsyncFileSystemWrapper(LocalFileSystem(), asynchronous=True),
        asynchronous=True,
    )
    fs = fsspec.filesystem("reference", fo=refs, fs={None: remote}, asynchronous=True)
    arr = zarr.open_array(FsspecStore(fs, path=location, read_only=True), mode="r")
    return np.asarray(arr[...])


def _tensorstore_read(path: Path) -> np.ndarray:
    import tensorstore as ts

    spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path)}}
    return np.asarray(ts.open(spec, open=True, read=True).result().read().result())
