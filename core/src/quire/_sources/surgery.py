"""Model surgery, published by :mod:`quire.surgery`: the lazy operations (``stack``,
``concatenate``, ``transpose``, ``reshape``, ``astype``) over the op nodes of
:mod:`quire._sources.lazy`, and tree helpers over nested dict / list / tuple trees."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from quire._sources.lazy import (
    LazyArray,
    _AsType,
    _axis,
    _Reshape,
    _Stack,
    _Transpose,
    as_lazy,
)


# ----------------------------------------------------------------------------- operations
def stack(xs: Sequence[Any], axis: int = 0) -> LazyArray:
    """Lazy ``np.stack``: all inputs of one shape; a region reads only the inputs it covers.

    Parameters
    ----------
    xs : sequence of array or LazyArray
        The inputs, all of one shape and dtype.
    axis : int
        The new axis.

    Returns
    -------
    LazyArray
        Reads only what a region of it needs.
    """
    vals = [as_lazy(x) for x in xs]
    if not vals:
        raise ValueError("stack needs at least one array")
    if any(v.shape != vals[0].shape for v in vals):
        raise ValueError(f"stack: shapes differ: {[v.shape for v in vals]}")
    return _Stack(vals, _axis(axis, vals[0].ndim + 1), concat=False)


def concatenate(xs: Sequence[Any], axis: int = 0) -> LazyArray:
    """Lazy ``np.concatenate`` along ``axis``.

    Parameters
    ----------
    xs : sequence of array or LazyArray
        The inputs, equal but along ``axis``.
    axis : int
        The axis to join along.

    Returns
    -------
    LazyArray
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


def transpose(x: Any, axes: Sequence[int] | None = None) -> LazyArray:
    """Lazy ``np.transpose`` (reverses the axes by default).

    Parameters
    ----------
    x : array or LazyArray
        The input (a numpy/jax array is wrapped as a lazy value).
    axes : sequence of int, optional
        The permutation (default: reversed).

    Returns
    -------
    LazyArray
        Reads only what a region of it needs.
    """
    return _Transpose(as_lazy(x), axes)


def reshape(x: Any, shape: Sequence[int]) -> LazyArray:
    """Lazy C-order reshape (one ``-1`` allowed).

    Parameters
    ----------
    x : array or LazyArray
        The input (a numpy/jax array is wrapped as a lazy value).
    shape : sequence of int
        The new shape, of the same size.

    Returns
    -------
    LazyArray
        Reads only what a region of it needs.
    """
    return _Reshape(as_lazy(x), shape)


def astype(x: Any, dtype: Any) -> LazyArray:
    """Lazy cast (``ml_dtypes`` names such as ``"bfloat16"`` work).

    Parameters
    ----------
    x : array or LazyArray
        The input (a numpy/jax array is wrapped as a lazy value).
    dtype : numpy dtype or str
        The dtype to cast to when read.

    Returns
    -------
    LazyArray
        Reads only what a region of it needs.
    """
    return _AsType(as_lazy(x), dtype)


def torch_linear(x: Any) -> Any:
    """A torch ``Linear`` weight ``[out, in]`` as a JAX kernel ``[in, out]`` (lazy transpose).

    Parameters
    ----------
    x : array or LazyArray
        The ``[out, in]`` weight.

    Returns
    -------
    LazyArray
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

    Raises
    ------
    ValueError
        Two key paths join to one name (``("a.b",)`` and ``("a", "b")`` with ``sep="."``).
    """
    out: dict[str, Any] = {}
    paths: dict[str, tuple[Any, ...]] = {}

    def go(x: Any, prefix: str, path: tuple[Any, ...]) -> None:
        if _is_leaf(x):
            if prefix in paths:
                raise ValueError(
                    f"key paths {paths[prefix]!r} and {path!r} both join to {prefix!r} with "
                    f"sep={sep!r}; pick a sep no key holds, or rename one key in the tree"
                )
            out[prefix], paths[prefix] = x, path
            return
        items = x.items() if isinstance(x, dict) else enumerate(x)
        for k, v in items:
            go(v, f"{prefix}{sep}{k}" if prefix else str(k), (*path, k))

    go(tree, "", ())
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

    Raises
    ------
    ValueError
        Two key paths join to one name before renaming (a key holding ``sep``), or two
        leaves are renamed to one name.
    """
    flat = flatten(tree, sep)
    out: dict[str, Any] = {}
    old_of: dict[str, str] = {}
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
            raise ValueError(f"rename: {old_of[new]!r} and {name!r} are both renamed to {new!r}")
        out[new], old_of[new] = leaf, name
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
        return v[idx] if isinstance(v, LazyArray) else np.asarray(v)[idx]

    out = []
    for i in range(n):
        layer = {k: take(v, i) for k, v in flat.items()}
        out.append(layer[""] if set(layer) == {""} else unflatten(layer, "\x00"))
    return out
