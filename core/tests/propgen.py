"""Hypothesis strategies for generated round trips: meshes, partition specs, shapes, dtypes,
storage options, targets and whole cases (``propcase.Case``).

Shapes are odd on purpose: dimensions are prime, 0 or 1 unless a mesh axis splits them, and a
split dimension is the product of its axes times such a factor, so shards are of prime or
odd sizes and chunk grids, replica pieces and inner chunks rarely line up.  ``devices`` is
the number of devices a mesh may use (8 in one process; the global count with several).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from hypothesis import strategies as st
from propcase import (
    COMPLEX,
    DTYPES,
    FLOAT8,
    FLOATS,
    INTS,
    JAX_DTYPES,
    SUBBYTE,
    Case,
    Leaf,
    MeshCase,
    Place,
    Storage,
    Target,
    dtype,
)

ODD = (0, 1, 2, 3, 5, 7, 11, 13, 17, 31)
AXIS_NAMES = ("data", "model", "x", "y", "z")
MAX_ELEMENTS = 1 << 14  # per leaf: generated cases stay fast on a loaded 2-core machine
# Bytes-to-bytes codecs: quire's own, and numcodecs' through zarr's registry (issue 37).
CODECS = ("zstd", "gzip", "blosc", "numcodecs.lz4", "numcodecs.shuffle")
KEYS = ("w", "b", "kernel", "a.b", "..", "x y", "ü", "layer/0", "0")


@st.composite
def meshes(draw: Any, devices: int = 8) -> MeshCase:
    """1 to ``devices`` devices (a random subset, in random order), 1-3 named axes, each
    Auto or Explicit."""
    n = draw(st.integers(1, devices))
    rank = draw(st.integers(1, 3))
    shape = _factor(draw, n, rank)
    names = tuple(draw(st.permutations(AXIS_NAMES))[:rank])
    types = tuple(draw(st.sampled_from(("auto", "explicit"))) for _ in range(rank))
    ids = tuple(draw(st.permutations(range(devices)))[:n])
    return MeshCase(shape, names, types, ids)


def _factor(draw: Any, n: int, rank: int) -> tuple[int, ...]:
    """``n`` as a product of ``rank`` positive ints, in a drawn order."""
    sizes = [1] * rank
    rest = n
    for p in _primes(n):
        sizes[draw(st.integers(0, rank - 1))] *= p
        rest //= p
    assert rest == 1
    return tuple(sizes)


def _primes(n: int) -> list[int]:
    out, p = [], 2
    while n > 1:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 1
    return out


def _spec(dims: list[list[str]]) -> tuple[Any, ...]:
    """The PartitionSpec entries of per-dimension axis lists, trailing Nones dropped
    (``P("x", None) == P("x")``: ``placed_shapes`` draws both spellings)."""
    spec = [None if not axes else axes[0] if len(axes) == 1 else tuple(axes) for axes in dims]
    while spec and spec[-1] is None:
        spec.pop()
    return tuple(spec)


@st.composite
def placed_shapes(
    draw: Any, mesh: MeshCase, rank: int, max_elements: int = MAX_ELEMENTS
) -> tuple[tuple[int, ...], tuple[Any, ...]]:
    """A shape of ``rank`` and a partition spec of ``mesh`` for it: each axis splits one
    dimension or none (replicated, partly replicated); a split dimension is its axes'
    product times an odd factor."""
    dims: list[list[str]] = [[] for _ in range(rank)]
    for name in draw(st.permutations(mesh.names)):
        if rank and draw(st.booleans()):
            dims[draw(st.integers(0, rank - 1))].append(name)
    size = dict(zip(mesh.names, mesh.shape))
    shape = []
    for axes in dims:
        split = math.prod(size[a] for a in axes)
        shape.append(split * draw(st.sampled_from(ODD)))
    splits = [math.prod(size[a] for a in axes) for axes in dims]
    shape = cap_shape(shape, splits, max_elements)
    spec = _spec(dims)
    if draw(st.booleans()):
        spec = spec + (None,) * (rank - len(spec))
    return tuple(shape), spec


def cap_shape(shape: list[int], splits: list[int], cap: int) -> list[int]:
    """Halve the largest factor (a dimension over its split) until the element count is
    within ``cap``; splits stay (their product is at most the device count, below any cap)."""
    while math.prod(shape) > cap:
        factors = [n // s for n, s in zip(shape, splits)]
        i = max(range(len(shape)), key=lambda j: factors[j])
        if factors[i] <= 1:
            break
        shape[i] = splits[i] * (factors[i] // 2)
    return shape


@st.composite
def specs_for(draw: Any, mesh: MeshCase, shape: tuple[int, ...]) -> tuple[Any, ...]:
    """A partition spec of ``mesh`` that fits ``shape`` (a split dimension is divisible)."""
    rank = len(shape)
    dims: list[list[str]] = [[] for _ in range(rank)]
    size = dict(zip(mesh.names, mesh.shape))
    for name in draw(st.permutations(mesh.names)):
        fits = [
            i
            for i in range(rank)
            if shape[i] % (math.prod(size[a] for a in dims[i]) * size[name]) == 0
        ]
        if fits and draw(st.booleans()):
            dims[draw(st.sampled_from(fits))].append(name)
    return _spec(dims)


def jax_ok(name: str) -> bool:
    return name in JAX_DTYPES


def _casts(name: str, *, for_jax: bool) -> list[str]:
    """Dtypes ``name`` may be cast to, in numpy's well-defined casts: float to float,
    int to int (sub-byte ints only widen), complex to complex."""
    if name in FLOATS or name in FLOAT8:
        out = [*FLOATS, *FLOAT8]
    elif name in INTS:
        out = list(INTS)
    elif name in SUBBYTE:
        out = ["int8", "int16", "int32", "uint8"] if name.startswith("u") else ["int8", "int32"]
    elif name in COMPLEX:
        out = list(COMPLEX)
    else:
        out = []
    return [d for d in out if d != name and (not for_jax or jax_ok(d)) and castable(name, d)]


def castable(a: str, b: str) -> bool:
    """Whether numpy (with ml_dtypes) casts ``a`` to ``b`` at all: there is no direct cast
    between float8_e8m0fnu and the other float8 types, nor between sub-byte int types."""
    try:
        np.zeros(1, dtype(a)).astype(dtype(b))
    except TypeError:
        return False
    return True


@st.composite
def storages(draw: Any, name: str, shape: tuple[int, ...], for_jax: bool) -> Storage | None:
    """Storage options for a leaf: none, or a cast, codecs (bytes-to-bytes, and an array-to-array
    ``transpose`` of a drawn axis order), inner chunking, no checksum."""
    if draw(st.integers(0, 2)) == 0:
        return None
    casts = _casts(name, for_jax=for_jax)
    cast = draw(st.sampled_from(casts)) if casts and draw(st.booleans()) else None
    codecs = tuple(draw(st.lists(st.sampled_from(CODECS), max_size=2, unique=True)))
    # A shuffle regroups the bytes of each element: after a compressor it has no elements.
    codecs = tuple(sorted(codecs, key=lambda c: c != "numcodecs.shuffle"))
    order = None
    if len(shape) >= 2 and draw(st.booleans()):
        order = tuple(draw(st.permutations(range(len(shape)))))
    nbytes = math.prod(shape) * dtype(cast or name).itemsize
    chunk = None
    if nbytes and draw(st.booleans()):
        chunk = draw(st.integers(max(1, nbytes // 64), max(1, nbytes)))
    return Storage(cast, codecs, chunk, draw(st.booleans()), order)


@st.composite
def targets(draw: Any, leaf: Leaf, devices: int = 8) -> Target:
    """How a leaf is loaded: as numpy, onto its own sharding, another mesh and spec, or as
    another dtype."""
    stored = leaf.stored_dtype
    kind = draw(st.sampled_from(("numpy", "same", "mesh", "cast")))
    if kind == "same" and leaf.place is None:
        kind = "mesh"
    casts = _casts(stored, for_jax=True)
    cast = draw(st.sampled_from(casts)) if kind == "cast" and casts else None
    if kind == "numpy":
        return Target("numpy", None, draw(st.sampled_from([None, *_casts(stored, for_jax=False)])))
    out = cast or stored
    if not jax_ok(out):  # a 64-bit value onto devices: cast it to its 32-bit kin
        out = {"int64": "int32", "uint64": "uint32", "float64": "float32"}.get(out, "complex64")
    if kind == "same" and leaf.place is not None:
        return Target("jax", leaf.place, None if out == stored else out)
    mesh = draw(meshes(devices))
    spec = draw(specs_for(mesh, leaf.shape))
    return Target("jax", Place(mesh, spec), None if out == stored else out)


@st.composite
def leaves(
    draw: Any,
    path: tuple[str, ...],
    devices: int = 8,
    max_elements: int = MAX_ELEMENTS,
    storage: bool = True,
) -> Leaf:
    """One array leaf: a numpy array or a jax.Array on a drawn mesh, rank 0-5; ``storage``:
    with drawn storage options (a Checkpointer takes none per leaf)."""
    on_device = draw(st.booleans())
    name = draw(st.sampled_from(JAX_DTYPES if on_device else DTYPES))
    rank = draw(st.integers(0, 5))
    if on_device:
        mesh = draw(meshes(devices))
        shape, spec = draw(placed_shapes(mesh, rank, max_elements))
        place: Place | None = Place(mesh, spec)
    else:
        shape = tuple(draw(st.sampled_from(ODD)) for _ in range(rank))
        shape = tuple(cap_shape(list(shape), [1] * rank, max_elements))
        place = None
    options = draw(storages(name, shape, on_device)) if storage else None
    seed = draw(st.integers(0, 2**32 - 1))
    return Leaf(path, shape, name, seed, place, options)


@st.composite
def key_paths(draw: Any, n: int) -> list[tuple[str, ...]]:
    """``n`` distinct key paths, none a prefix of another, 1-3 levels, odd keys included."""
    out: list[tuple[str, ...]] = []
    while len(out) < n:
        depth = draw(st.integers(1, 3))
        path = (*(draw(st.sampled_from(KEYS)) for _ in range(depth - 1)), f"L{len(out)}")
        if any(p[: len(path)] == path or path[: len(p)] == p for p in out):
            continue
        out.append(path)
    return out


SCALARS = st.sampled_from(
    [("step", 7), ("lr", 0.125), ("name", "run ü"), ("none", None), ("flag", True)]
)


@st.composite
def cases(
    draw: Any,
    paths: tuple[str, ...] = ("save", "save_async", "partial", "tier", "incremental"),
    devices: int = 8,
    max_leaves: int = 5,
    max_elements: int = MAX_ELEMENTS,
    layouts: tuple[str, ...] = ("packed", "chunks"),
) -> Case:
    """A whole case: leaves, inline scalars, the save path, the layout, replica options,
    the target, and (journal, incremental) the versions."""
    path = draw(st.sampled_from(paths))
    n = draw(st.integers(1, max_leaves))
    ks = draw(key_paths(n))
    per_leaf = path not in ("tier", "incremental")  # a Checkpointer takes no storage options
    ls = [draw(leaves(k, devices, max_elements, per_leaf)) for k in ks]
    target = draw(st.sampled_from(("none", "tree", "partial")))
    out = []
    for leaf in ls:
        t = draw(targets(leaf, devices))
        if target == "partial" and draw(st.booleans()):
            t = None
        out.append(Leaf(leaf.path, leaf.shape, leaf.dtype, leaf.seed, leaf.place, leaf.storage, t))
    if target == "none":
        out = [Leaf(x.path, x.shape, x.dtype, x.seed, x.place, x.storage, None) for x in out]
    scalars = tuple(dict(draw(st.lists(SCALARS, max_size=2, unique_by=lambda s: s[0]))).items())
    layout = draw(st.sampled_from(layouts))
    if path in ("incremental", "tier"):
        layout = "packed" if path == "incremental" else layout
    versions: tuple[Any, ...] = ()
    deleted: tuple[int, ...] = ()
    if path == "partial":
        versions, deleted = draw(_journal(len(out)))
        scalars = ()  # the journal holds arrays here; inline leaves have their own tests
    elif path == "incremental":
        versions = draw(_steps(out))
    return Case(
        tuple(out),
        path,
        target,
        layout,
        draw(st.booleans()),
        draw(st.sampled_from((None, True, False))),
        scalars,
        draw(st.none() | st.integers(1, 4096)),
        draw(st.sampled_from(("load", "lazy"))),
        versions,
        deleted,
    )


@st.composite
def _journal(draw: Any, n: int) -> tuple[Any, tuple[int, ...]]:
    """Journal versions over ``n`` leaves: each leaf first saved in some version, some saved
    again with new values (replacements), some deleted at the end (never all)."""
    count = draw(st.integers(1, 3))
    first = [draw(st.integers(0, count - 1)) for _ in range(n)]
    versions: list[list[tuple[int, int]]] = [[] for _ in range(count)]
    for i, v in enumerate(first):
        versions[v].append((i, -1))  # -1: the leaf's own seed
    for v in range(1, count):
        for i in range(n):
            if first[i] < v and draw(st.integers(0, 3)) == 0:
                versions[v].append((i, draw(st.integers(0, 2**32 - 1))))
    versions = [v for v in versions if v]
    deleted = tuple(i for i in range(n) if n > 1 and draw(st.integers(0, 4)) == 0)
    if len(deleted) == n:
        deleted = deleted[1:]
    return tuple(tuple(v) for v in versions), deleted


@st.composite
def _steps(draw: Any, ls: list[Leaf]) -> tuple[tuple[tuple[int, int], ...], ...]:
    """1-2 steps after the first: each changes some leaves (new values, or a new object with
    the same bytes)."""
    out = []
    seeds = [leaf.seed for leaf in ls]
    for _ in range(draw(st.integers(1, 2))):
        step = []
        for i in range(len(ls)):
            how = draw(st.sampled_from(("same", "same", "changed", "recomputed")))
            if how == "changed":
                seeds[i] = draw(st.integers(0, 2**32 - 1))
                step.append((i, seeds[i]))
            elif how == "recomputed":
                step.append((i, seeds[i]))
        out.append(tuple(step))
    return tuple(out)
