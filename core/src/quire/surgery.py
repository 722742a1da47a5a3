"""Model surgery: lazy operations and tree helpers for ``quire.load(..., transform=fn)``.

Lazy operations (``stack``, ``concatenate``, ``transpose``, ``reshape``, ``astype``) take
:class:`quire.LazyArray` values (or slices of them, other lazy values, or concrete arrays)
and return lazy values: nothing is read until quire materialises the result, and then each
device shard reads only the regions of the inputs it needs.

Tree helpers work on any nested dict / list / tuple tree (lazy or concrete leaves):
:func:`rename`, :func:`flatten`, :func:`unflatten`, :func:`stack_layers`,
:func:`split_layers` and :func:`torch_linear`.
"""

from __future__ import annotations

import asyncio
import math
import operator
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from quire._lazy import LazyArray, LazyValue, Region, full_region, region_shape

__all__ = [
    "LazyArray",
    "LazyValue",
    "astype",
    "concatenate",
    "flatten",
    "rename",
    "reshape",
    "split_layers",
    "stack",
    "stack_layers",
    "torch_linear",
    "transpose",
    "unflatten",
]


# ----------------------------------------------------------------------------- nodes
class _Const(LazyValue):
    """A concrete array taking part in a lazy operation."""

    def __init__(self, value: Any) -> None:
        self.value = np.asarray(value)
        self.shape = self.value.shape
        self.dtype = self.value.dtype

    async def _read(self, region: Region) -> np.ndarray:
        return np.array(self.value[region or ...], order="C")


def as_lazy(x: Any) -> LazyValue:
    """``x`` itself if lazy, else a constant node around ``np.asarray(x)``."""
    return x if isinstance(x, LazyValue) else _Const(x)


class _View(LazyValue):
    """``base[region]`` with the integer-indexed axes dropped."""

    def __init__(self, base: LazyValue, region: Region, keep: tuple[bool, ...]) -> None:
        self.base, self.region, self.keep = base, region, keep
        self.shape = tuple(s.stop - s.start for s, k in zip(region, keep) if k)
        self.dtype = base.dtype

    def sources(self) -> list[LazyArray]:
        return self.base.sources()

    async def _read(self, region: Region) -> np.ndarray:
        it = iter(region)
        sub = []
        for s, k in zip(self.region, self.keep):
            if k:
                r = next(it)
                sub.append(slice(s.start + r.start, s.start + r.stop))
            else:
                sub.append(s)
        out = await self.base.read_region(tuple(sub))
        return out.reshape(region_shape(region))

    def __repr__(self) -> str:
        return f"{self.base!r}[{self.region}]"


def _index(x: LazyValue, index: Any) -> LazyValue:
    idx = index if isinstance(index, tuple) else (index,)
    n_ell = sum(1 for i in idx if i is Ellipsis)
    if n_ell > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    if n_ell:
        at = next(j for j, i in enumerate(idx) if i is Ellipsis)
        fill = (slice(None),) * (x.ndim - len(idx) + 1)
        idx = idx[:at] + fill + idx[at + 1 :]
    if len(idx) > x.ndim:
        raise IndexError(f"too many indices for a lazy array of shape {x.shape}")
    idx = idx + (slice(None),) * (x.ndim - len(idx))
    region, keep = [], []
    for i, n in zip(idx, x.shape):
        if isinstance(i, slice):
            start, stop, step = i.indices(n)
            if step != 1:
                raise IndexError(
                    f"lazy arrays support step-1 slices only (got {i}); read the slice and "
                    "step the result: x[a:b].read()[::step]"
                )
            region.append(slice(start, max(start, stop)))
            keep.append(True)
        else:
            try:
                j = operator.index(i)
            except TypeError:
                raise IndexError(
                    f"lazy arrays take ints, step-1 slices and '...' as indices, not {i!r}"
                ) from None
            if not -n <= j < n:
                raise IndexError(f"index {j} is out of bounds for an axis of size {n}")
            j %= n
            region.append(slice(j, j + 1))
            keep.append(False)
    if isinstance(x, _View):  # fold views of views
        it = iter(zip(region, keep))
        base_region, base_keep = [], []
        for s, k in zip(x.region, x.keep):
            if k:
                r, kk = next(it)
                base_region.append(slice(s.start + r.start, s.start + r.stop))
                base_keep.append(kk)
            else:
                base_region.append(s)
                base_keep.append(False)
        return _View(x.base, tuple(base_region), tuple(base_keep))
    return _View(x, tuple(region), tuple(keep))


class _Stack(LazyValue):
    def __init__(self, xs: Sequence[LazyValue], axis: int, concat: bool) -> None:
        self.xs, self.axis, self.concat = list(xs), axis, concat
        self.dtype = np.result_type(*(x.dtype for x in xs))
        if concat:
            self.offsets = [0]
            for x in xs:
                self.offsets.append(self.offsets[-1] + x.shape[axis])
            s = list(xs[0].shape)
            s[axis] = self.offsets[-1]
            self.shape = tuple(s)
        else:
            s = list(xs[0].shape)
            s.insert(axis, len(xs))
            self.shape = tuple(s)

    def sources(self) -> list[LazyArray]:
        return [s for x in self.xs for s in x.sources()]

    async def _read(self, region: Region) -> np.ndarray:
        ax = self.axis
        r = region[ax]
        parts: list[Any] = []
        if self.concat:
            for i, x in enumerate(self.xs):
                lo, hi = max(r.start, self.offsets[i]), min(r.stop, self.offsets[i + 1])
                if hi > lo:
                    sub = list(region)
                    sub[ax] = slice(lo - self.offsets[i], hi - self.offsets[i])
                    parts.append(x.read_region(tuple(sub)))
        else:
            rest = region[:ax] + region[ax + 1 :]
            parts = [self.xs[i].read_region(rest) for i in range(r.start, r.stop)]
        if not parts:
            return np.empty(region_shape(region), self.dtype)
        got = [a.astype(self.dtype, copy=False) for a in await asyncio.gather(*parts)]
        return np.concatenate(got, axis=ax) if self.concat else np.stack(got, axis=ax)


class _Transpose(LazyValue):
    def __init__(self, x: LazyValue, axes: tuple[int, ...]) -> None:
        self.x, self.axes = x, axes
        self.shape = tuple(x.shape[a] for a in axes)
        self.dtype = x.dtype

    def sources(self) -> list[LazyArray]:
        return self.x.sources()

    async def _read(self, region: Region) -> np.ndarray:
        src: list[slice] = [slice(0, 0)] * len(self.axes)
        for out_ax, in_ax in enumerate(self.axes):
            src[in_ax] = region[out_ax]
        a = await self.x.read_region(tuple(src))
        return np.array(np.transpose(a, self.axes), order="C")


class _Reshape(LazyValue):
    """Reads the input rows covering the output rows a region needs (C order)."""

    def __init__(self, x: LazyValue, shape: tuple[int, ...]) -> None:
        self.x, self.shape, self.dtype = x, shape, x.dtype

    def sources(self) -> list[LazyArray]:
        return self.x.sources()

    async def _read(self, region: Region) -> np.ndarray:
        if not self.shape or not self.x.shape or self.size == 0:
            a = await self.x.read_region(full_region(self.x.shape))
            return a.reshape(self.shape)[region or ...].copy()
        oi = math.prod(self.shape[1:])
        ii = math.prod(self.x.shape[1:])
        r0, r1 = region[0].start, region[0].stop
        f, g = r0 * oi, r1 * oi
        i0, i1 = (f // ii, -(-g // ii)) if ii else (0, 0)
        rows = await self.x.read_region((slice(i0, i1), *full_region(self.x.shape[1:])))
        flat = rows.reshape(-1)[f - i0 * ii : g - i0 * ii]
        block = flat.reshape((r1 - r0, *self.shape[1:]))
        return np.array(block[(slice(None), *region[1:])], order="C")


class _AsType(LazyValue):
    def __init__(self, x: LazyValue, dtype: Any) -> None:
        self.x, self.shape, self.dtype = x, x.shape, np.dtype(dtype)

    def sources(self) -> list[LazyArray]:
        return self.x.sources()

    async def _read(self, region: Region) -> np.ndarray:
        return (await self.x.read_region(region)).astype(self.dtype)


# ----------------------------------------------------------------------------- operations
def _axis(axis: int, ndim: int) -> int:
    if not -ndim <= axis < ndim:
        raise ValueError(f"axis {axis} is out of bounds for {ndim} dimensions")
    return axis % ndim


def stack(xs: Sequence[Any], axis: int = 0) -> LazyValue:
    """Lazy ``np.stack``: all inputs of one shape; a region reads only the inputs it covers.

    Parameters
    ----------
    xs : sequence of array or LazyValue
        The inputs, all of one shape and dtype.
    axis : int
        The new axis.

    Returns
    -------
    LazyValue
        Reads only what a region of it needs.
    """
    vals = [as_lazy(x) for x in xs]
    if not vals:
        raise ValueError("stack needs at least one array")
    if any(v.shape != vals[0].shape for v in vals):
        raise ValueError(f"stack: shapes differ: {[v.shape for v in vals]}")
    return _Stack(vals, _axis(axis, vals[0].ndim + 1), concat=False)


def concatenate(xs: Sequence[Any], axis: int = 0) -> LazyValue:
    """Lazy ``np.concatenate`` along ``axis``.

    Parameters
    ----------
    xs : sequence of array or LazyValue
        The inputs, equal but along ``axis``.
    axis : int
        The axis to join along.

    Returns
    -------
    LazyValue
        Reads only what a region of it needs.
    """
    vals = [as_lazy(x) for x in xs]
    if not vals:
        raise ValueError("concatenate needs at least one array")
    ax = _axis(axis, vals[0].ndim)
    for v in vals:
        if v.ndim != vals[0].ndim or v.shape[:ax] + v.shape[ax + 1 :] != (
            vals[0].shape[:ax] + vals[0].shape[ax + 1 :]
        ):
            raise ValueError(f"concatenate: shapes differ off axis {ax}: {[v.shape for v in vals]}")
    return _Stack(vals, ax, concat=True)


def transpose(x: Any, axes: Sequence[int] | None = None) -> LazyValue:
    """Lazy ``np.transpose`` (reverses the axes by default).

    Parameters
    ----------
    x : array or LazyValue
        The input (a numpy/jax array is wrapped as a lazy value).
    axes : sequence of int, optional
        The permutation (default: reversed).

    Returns
    -------
    LazyValue
        Reads only what a region of it needs.
    """
    v = as_lazy(x)
    ax = tuple(reversed(range(v.ndim))) if axes is None else tuple(_axis(a, v.ndim) for a in axes)
    if sorted(ax) != list(range(v.ndim)):
        raise ValueError(f"transpose: {axes} is not a permutation of {v.ndim} axes")
    return _Transpose(v, ax)


def reshape(x: Any, shape: Sequence[int]) -> LazyValue:
    """Lazy C-order reshape (one ``-1`` allowed).

    Parameters
    ----------
    x : array or LazyValue
        The input (a numpy/jax array is wrapped as a lazy value).
    shape : sequence of int
        The new shape, of the same size.

    Returns
    -------
    LazyValue
        Reads only what a region of it needs.
    """
    v = as_lazy(x)
    shp = [int(n) for n in shape]
    if shp.count(-1) > 1:
        raise ValueError("reshape: only one -1 allowed")
    if -1 in shp:
        rest = math.prod(n for n in shp if n != -1)
        shp[shp.index(-1)] = v.size // rest if rest else 0
    if math.prod(shp) != v.size:
        raise ValueError(f"reshape: cannot reshape {v.shape} into {tuple(shape)}")
    return _Reshape(v, tuple(shp))


def astype(x: Any, dtype: Any) -> LazyValue:
    """Lazy cast (``ml_dtypes`` names such as ``"bfloat16"`` work).

    Parameters
    ----------
    x : array or LazyValue
        The input (a numpy/jax array is wrapped as a lazy value).
    dtype : numpy dtype or str
        The dtype to cast to when read.

    Returns
    -------
    LazyValue
        Reads only what a region of it needs.
    """
    from quire._dtypes import dtype_from_name

    dt = dtype_from_name(dtype) if isinstance(dtype, str) else np.dtype(dtype)
    return _AsType(as_lazy(x), dt)


def torch_linear(x: Any) -> Any:
    """A torch ``Linear`` weight ``[out, in]`` as a JAX kernel ``[in, out]`` (lazy transpose).

    Parameters
    ----------
    x : array or LazyValue
        The ``[out, in]`` weight.

    Returns
    -------
    LazyValue
        The ``[in, out]`` kernel.
    """
    if getattr(x, "ndim", 2) != 2:
        raise ValueError(f"torch_linear expects a 2-d weight, got shape {getattr(x, 'shape', '?')}")
    return transpose(x)


# ----------------------------------------------------------------------------- tree helpers
def _is_leaf(x: Any) -> bool:
    return not isinstance(x, dict | list | tuple)


def flatten(tree: Any, sep: str = ".") -> dict[str, Any]:
    """``{"a.b.0": leaf}`` for a nested tree (list/tuple indices become digits).

    Parameters
    ----------
    tree : pytree
        Nested dicts, lists and tuples.
    sep : str
        The separator between key components.

    Returns
    -------
    dict
        Joined key path -> leaf.
    """
    out: dict[str, Any] = {}

    def go(x: Any, prefix: str) -> None:
        if _is_leaf(x):
            out[prefix] = x
            return
        items = x.items() if isinstance(x, dict) else enumerate(x)
        for k, v in items:
            go(v, f"{prefix}{sep}{k}" if prefix else str(k))

    go(tree, "")
    return out


def unflatten(flat: Mapping[str, Any], sep: str = ".", *, lists: bool = False) -> dict[str, Any]:
    """Nest dotted names: ``{"a.b.0": x}`` → ``{"a": {"b": {"0": x}}}``.

    Numeric components stay **string keys** (``"0"``), so names round-trip exactly and gaps
    (``layers.0``, ``layers.2``) are kept; with ``lists=True`` a dict whose keys are exactly
    ``"0".."n-1"`` becomes a list.

    Parameters
    ----------
    flat : mapping of str to leaf
        Joined names -> leaves.
    sep : str
        The separator between key components.
    lists : bool
        Turn dicts keyed exactly ``"0".."n-1"`` into lists.

    Raises
    ------
    ValueError
        A name is both a leaf and a prefix of another name (``a.b`` and ``a.b.c``).
    """
    root: dict[str, Any] = {}
    for name, value in flat.items():
        parts = name.split(sep)
        node = root
        for i, p in enumerate(parts[:-1]):
            nxt = node.setdefault(p, {})
            if not isinstance(nxt, dict):
                raise ValueError(
                    f"name {name!r} nests under {sep.join(parts[: i + 1])!r}, which is itself a "
                    "tensor; keep such trees flat"
                )
            node = nxt
        if parts[-1] in node:
            raise ValueError(f"name {name!r} is both a tensor and a prefix of other names")
        node[parts[-1]] = value
    return _listify(root) if lists else root


def _listify(x: Any) -> Any:
    if not isinstance(x, dict):
        return x
    kids = {k: _listify(v) for k, v in x.items()}
    if kids and sorted(kids) == sorted(str(i) for i in range(len(kids))):
        return [kids[str(i)] for i in range(len(kids))]
    return kids


Rule = tuple[str, str]


def rename(
    tree: Any,
    mapping: Mapping[str, str | None] | Sequence[Rule] | Callable[[str], str | None],
    *,
    sep: str = "/",
    strict: bool = False,
) -> dict[str, Any]:
    """Rename leaves by their ``sep``-joined key path; returns a nested dict.

    ``mapping`` is a dict ``{old: new}`` (exact names), a list of ``(regex, replacement)``
    applied with ``re.sub`` in order (first rule that matches wins), or a function.  A new
    name of None drops the leaf; unmatched names are kept (or, with ``strict``, an error).

    Parameters
    ----------
    tree : pytree
        The tree (or a flat dict) whose leaves to rename.
    mapping : dict, list of (str, str) or callable
        ``{old: new}``, ``[(regex, replacement), ...]`` or ``name -> new name or None``.
    sep : str
        The separator of key paths, in and out.
    strict : bool
        Raise ``KeyError`` for a name no rule matches instead of keeping it.

    Returns
    -------
    dict
        The renamed tree, nested by ``sep``.
    """
    flat = flatten(tree, sep)
    out: dict[str, Any] = {}
    for name, leaf in flat.items():
        new: str | None
        if callable(mapping):
            new = mapping(name)
        elif isinstance(mapping, Mapping):
            if name not in mapping and strict:
                raise KeyError(f"rename: no mapping for {name!r}")
            new = mapping.get(name, name)
        else:
            new = name
            for pat, rep in mapping:
                if re.fullmatch(pat, name):
                    new = re.sub(pat, rep, name)
                    break
            else:
                if strict:
                    raise KeyError(f"rename: no rule matches {name!r}")
        if new is None:
            continue
        if new in out:
            raise ValueError(f"rename: two leaves renamed to {new!r}")
        out[new] = leaf
    return unflatten(out, sep)


def _layer_list(layers: Any) -> list[Any]:
    if isinstance(layers, Mapping):
        try:
            keys = sorted(layers, key=int)
        except ValueError:
            raise ValueError(
                f"stack_layers: layer keys must be integers, got {list(layers)}"
            ) from None
        if [int(k) for k in keys] != list(range(len(keys))):
            raise ValueError(f"stack_layers: layers are not 0..n-1: {keys}")
        return [layers[k] for k in keys]
    return list(layers)


def stack_layers(layers: Any, axis: int = 0) -> Any:
    """Per-layer subtrees (a list, or a dict keyed ``"0".."n-1"``) → one tree of stacked leaves.

    Every layer must have the same structure; each leaf of the result is a lazy
    :func:`stack` along ``axis`` (the scanned layer axis).

    Parameters
    ----------
    layers : list or dict
        The per-layer subtrees, all of one structure.
    axis : int
        The new (scanned) layer axis.

    Returns
    -------
    pytree
        One subtree whose leaves are lazy stacks.
    """
    items = _layer_list(layers)
    if not items:
        raise ValueError("stack_layers: no layers")
    flats = [flatten(x, "\x00") for x in items]
    for i, f in enumerate(flats[1:], 1):
        if f.keys() != flats[0].keys():
            diff = sorted(set(f) ^ set(flats[0]))
            raise ValueError(f"stack_layers: layer {i} differs from layer 0 in {diff}")
    if set(flats[0]) == {""}:  # layers are leaves
        return stack([f[""] for f in flats], axis)
    return unflatten({k: stack([f[k] for f in flats], axis) for k in flats[0]}, "\x00")


def split_layers(tree: Any, axis: int = 0) -> list[Any]:
    """Undo :func:`stack_layers`: one subtree per index of ``axis`` (lazy where lazy).

    Parameters
    ----------
    tree : pytree
        Stacked leaves, all of one size along ``axis``.
    axis : int
        The layer axis.

    Returns
    -------
    list
        One subtree per layer.
    """
    flat = flatten(tree, "\x00")
    ns = {getattr(v, "shape", ())[axis] for v in flat.values()}
    if len(ns) != 1:
        raise ValueError(f"split_layers: leaves disagree on the size of axis {axis}: {ns}")
    n = ns.pop()

    def take(v: Any, i: int) -> Any:
        idx = (slice(None),) * (axis % v.ndim) + (i,)
        return v[idx] if isinstance(v, LazyValue) else np.asarray(v)[idx]

    out = []
    for i in range(n):
        layer = {k: take(v, i) for k, v in flat.items()}
        out.append(layer[""] if set(layer) == {""} else unflatten(layer, "\x00"))
    return out
