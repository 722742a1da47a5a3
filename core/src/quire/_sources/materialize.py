"""Materialise lazy trees: ``quire.load(..., transform=...)`` and ``LazyValue.read``.

Each leaf of the transformed tree is placed into its target (numpy array, or ``jax.Array``
with a sharding); each device shard reads only its own region of the lazy inputs, regions
shared by several devices are read once, and every host buffer is held under one
:class:`ByteBudget` so that all leaves load in parallel within ``Config.byte_budget``.
"""

from __future__ import annotations

import asyncio
import functools
import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from quire._engine.pairing import pair_with_target, refuse_misfits, sharding_misfit
from quire._format.tree import KeyPath, Node, keystr, walk
from quire._handlers import casting as _casting
from quire._handlers.inline import convert, mismatch
from quire._handlers.jax_arrays import key_impl_name, key_mismatch
from quire._handlers.meshes import Placer, is_abstract
from quire._runtime import ioloop as _io
from quire._runtime.budget import ByteBudget
from quire._runtime.config import current
from quire._runtime.ioloop import run_blocking
from quire._runtime.tasks import for_each
from quire._sources.base import Source
from quire._sources.lazy import LazyValue, Region, full_region, install_materializer
from quire._sources.opening import open as open_source
from quire._sources.partition import sharding_for, sharding_table
from quire.errors import QuireError, TreeMismatchError

__all__ = ["load_and_transform", "materialize_leaf"]


def _norm(idx: tuple[slice, ...], shape: tuple[int, ...]) -> Region:
    out = []
    for s, n in zip(idx, shape):
        a, b, _ = s.indices(n)
        out.append(slice(a, b))
    return tuple(out)


class _Cast:
    """The cast of one leaf's regions to ``named`` under ``casting``; the leaf at ``path`` of
    ``url`` (for messages).  ``to_jax``: the regions go into a ``jax.Array``, whose dtype
    (``dtype``) may be narrower than ``named`` (:func:`quire._handlers.casting.jax_dtype`)."""

    def __init__(
        self, named: np.dtype[Any], casting: str, url: str, path: KeyPath, to_jax: bool = False
    ) -> None:
        self.named, self.casting, self.url, self.path = named, casting, url, path
        self.dtype = _casting.jax_dtype(named) if to_jax else named

    def __call__(self, a: np.ndarray) -> np.ndarray:
        """``a`` as the dtype; a narrowed integer's values checked first."""
        if a.dtype == self.dtype:
            return a
        _casting.check_values(a, self.named, self.casting, url=self.url, path=self.path)
        if self.dtype != self.named:
            return _casting.to_jax_dtype(a, self.named, url=self.url, path=self.path, saved=a.dtype)
        return a.astype(self.dtype)


async def _read_cast(
    v: LazyValue, region: Region, cast: _Cast, budget: ByteBudget
) -> tuple[np.ndarray, int]:
    dtype = cast.dtype
    n = math.prod(r.stop - r.start for r in region) * v.dtype.itemsize
    need = (
        n if dtype == v.dtype else n + math.prod(r.stop - r.start for r in region) * dtype.itemsize
    )
    await budget.acquire(need)
    try:
        a = await v.read_region(region)
        if a.dtype != dtype:
            a = await run_blocking(cast, a)
    except BaseException:
        await budget.release(need)
        raise
    return a, need


def _read_put(read: Callable[[], np.ndarray], cast: _Cast, sharding: Any) -> Any:
    return jax.device_put(cast(read()), sharding)


def _plan(sharding: Any, shape: tuple[int, ...]) -> tuple[Any, list[Any], Region | None]:
    """(device → index map, [(region, devices)] with each distinct region once, box or None).

    The box is the regions' bounding box when they tile it (the usual case: one read of it
    feeds every device shard, and a byte range or chunk that several shards need is read
    once).  Leaves with the same sharding and shape share the plan (cached).
    """
    try:
        return _plan_cached(sharding, shape)
    except TypeError:  # an unhashable sharding
        return _make_plan(sharding, shape)


def _make_plan(sharding: Any, shape: tuple[int, ...]) -> tuple[Any, list[Any], Region | None]:
    idx_map = sharding.addressable_devices_indices_map(shape)
    # Keys are (start, stop) pairs: slices are unhashable before Python 3.12.
    by_key: dict[tuple[tuple[int, int], ...], list[Any]] = {}
    for dev, idx in idx_map.items():
        reg = _norm(idx, shape) if shape else ()
        by_key.setdefault(tuple((r.start, r.stop) for r in reg), []).append(dev)
    regions = [(tuple(slice(a, b) for a, b in k), devs) for k, devs in by_key.items()]
    keys = list(by_key)
    box: Region | None = None
    if shape and len(regions) > 1:
        box = tuple(
            slice(min(k[d][0] for k in keys), max(k[d][1] for k in keys)) for d in range(len(shape))
        )
        area = sum(math.prod(b - a for a, b in k) for k in keys)
        if math.prod(s.stop - s.start for s in box) != area:
            box = None
    elif len(regions) == 1 and regions[0][0] == full_region(shape):
        box = full_region(shape)
    return idx_map, regions, box


_plan_cached = functools.lru_cache(maxsize=256)(_make_plan)


async def materialize_leaf(
    v: LazyValue,
    dtype: Any = None,
    sharding: Any = None,
    budget: ByteBudget | None = None,
    casting: str = "unsafe",
    path: KeyPath | None = None,
) -> Any:
    """Read ``v`` into a numpy array (``sharding`` None) or a ``jax.Array`` with ``sharding``.

    ``casting`` limits the cast to ``dtype`` (:mod:`quire._handlers.casting`): ``"unsafe"``
    for ``LazyArray.read(dtype=...)``, a cast asked for by name; a load passes the target
    leaf's, and its key path ``path`` for messages.
    """
    out_dtype = np.dtype(dtype) if dtype is not None else v.dtype
    url = ", ".join(sorted({s.url for s in v.sources()})) or "a lazy value"
    at = getattr(v, "key_path", ()) if path is None else path
    if out_dtype != v.dtype:
        _casting.check_cast(v.dtype, out_dtype, casting, url=url, path=at)
    budget = budget or ByteBudget(current().byte_budget)
    shape = v.shape
    if is_abstract(sharding):  # LazyArray.read(sharding=...) of an eval_shape target
        sharding, why = Placer(saved_shardings([v])).sharding(sharding)
        if why is not None:
            where = ", ".join(sorted({f"{s.url}:{s.key}" for s in v.sources()})) or "a value"
            raise TreeMismatchError(f"reading {where}: {why}", mismatched=[why])
    cast = _Cast(out_dtype, casting, url, at, to_jax=sharding is not None)
    out_dtype = cast.dtype
    if sharding is None:
        a, need = await _read_cast(v, full_region(shape), cast, budget)
        await budget.release(need)  # handed to the caller
        return a
    idx_map, regions, box = _plan(sharding, shape)
    if not idx_map:  # a mesh of other processes' devices: no shard here (JAX needs the dtype)
        return jax.make_array_from_single_device_arrays(shape, sharding, [], dtype=out_dtype)
    arrays: dict[Any, Any] = {}
    box_bytes = math.prod(s.stop - s.start for s in box) * v.dtype.itemsize if box else 0
    if len(regions) > 1 and box_bytes > budget.limit:
        box = None  # read the regions one by one, within the budget

    async def put(host: np.ndarray, devs: list[Any]) -> None:
        for d in devs:
            arrays[d] = await run_blocking(jax.device_put, host, d)

    # One device_put of the whole host array only when every device is this process's: onto
    # a sharding with other processes' devices, jax.device_put first checks by a collective
    # that every process passed equal values (NaN != NaN fails it); place the shards here.
    local = getattr(sharding, "is_fully_addressable", True)
    whole_here = box is not None and box == full_region(shape) and bool(local)
    read = v.blocking(box) if box is not None and whole_here else None  # a source's, or None
    if read is not None:
        # One hop: a worker thread reads the whole array and places it on the devices.
        n = math.prod(shape) * v.dtype.itemsize
        need = n if out_dtype == v.dtype else n + math.prod(shape) * out_dtype.itemsize
        async with budget.hold(need):
            return await run_blocking(_read_put, read, cast, sharding)
    if box is not None:
        whole, need = await _read_cast(v, box, cast, budget)
        if whole_here:
            # Every shard is local: one device_put of the host array (JAX slices it per device).
            try:
                return await run_blocking(jax.device_put, whole, sharding)
            finally:
                await budget.release(need)
        try:
            parts = []
            for reg, devs in regions:
                cut = tuple(slice(r.start - b.start, r.stop - b.start) for r, b in zip(reg, box))
                # (ascontiguousarray makes a 0-d array 1-d: keep a 0-d one as it is)
                parts.append(put(np.ascontiguousarray(whole[cut]) if cut else whole, devs))
            await asyncio.gather(*parts)
        finally:
            await budget.release(need)
    else:

        async def one(reg: Region, devs: list[Any]) -> None:
            host, need = await _read_cast(v, reg, cast, budget)
            try:
                await put(host, devs)
            finally:
                await budget.release(need)

        await asyncio.gather(*(one(r, d) for r, d in regions))
    return jax.make_array_from_single_device_arrays(shape, sharding, [arrays[d] for d in idx_map])


install_materializer(materialize_leaf)  # LazyValue.read runs it: _lazy sits below this module


# ----------------------------------------------------------------------------- transform
def saved_shardings(values: Any) -> list[Any]:
    """The sharding records the lazy values among ``values`` were saved with, where their
    source says (quire's own: ``saved_sharding`` of its readers)."""
    return [
        getattr(s.reader, "saved_sharding", None)
        for v in values
        if isinstance(v, LazyValue)
        for s in v.sources()
    ]


def _is_value_leaf(x: Any) -> bool:
    return isinstance(x, LazyValue) or not isinstance(x, dict | list | tuple)


def open_sources(sources: Any, storage_options: dict[str, Any] | None) -> tuple[Any, list[Source]]:
    """URLs → Sources, keeping the shape (one, a sequence, a mapping) of ``sources``."""
    opened: list[Source] = []

    def one(s: Any) -> Source:
        src = s if isinstance(s, Source) else open_source(s, **(storage_options or {}))
        opened.append(src)
        return src

    if isinstance(sources, Source | str | os.PathLike):
        return one(sources), opened
    if isinstance(sources, Mapping):
        return {k: one(v) for k, v in sources.items()}, opened
    if isinstance(sources, Sequence):
        return [one(s) for s in sources], opened
    raise TypeError(
        f"sources must be a URL, a Source, a sequence or a dict of them, not {sources!r}"
    )


def call_transform(fn: Callable[..., Any], shaped: Any, opened: list[Source]) -> Any:
    try:
        if isinstance(shaped, Source):
            return fn(shaped.tree)
        if isinstance(shaped, Mapping):
            return fn(**{k: s.tree for k, s in shaped.items()})
        return fn(*(s.tree for s in shaped))
    except Exception as e:
        urls = ", ".join(s.url for s in opened)
        e.add_note(f"quire: raised by the transform function over source(s) {urls}")
        raise


def _target_of(t: Any) -> tuple[Any, Any, str]:
    """(dtype, sharding, kind) asked for by an abstract leaf."""
    if isinstance(t, type):
        # np.ndarray / jax.Array: an array as saved; any other type: what inline.convert makes
        return None, None, "numpy" if t is np.ndarray or t is jax.Array else "python"
    if isinstance(t, np.ndarray | np.generic):
        return t.dtype, None, "numpy"
    if isinstance(t, jax.ShapeDtypeStruct | jax.Array):
        return t.dtype, getattr(t, "sharding", None), "jax"
    if t is None or isinstance(t, bool | int | float | complex | str | bytes):
        return None, None, "python"
    return getattr(t, "dtype", None), getattr(t, "sharding", None), "jax"


def _is_none(v: Any) -> bool:
    return v is None


async def materialize_tree(
    value_tree: Any,
    abstract: Any,
    *,
    shardings: Any = None,
    partial: bool = False,
    what: str = "transform result",
    subject: str | None = None,
    transform: bool = True,
    casting: _casting.CastingSpec = None,
) -> Any:
    """Place each leaf of ``value_tree`` into ``abstract`` (or its own structure when None).

    ``what`` names the values in messages ("transform result", "saved"), ``subject`` the
    whole (default ``the {what}``); ``transform``: the values are a transform's result.
    """
    vroot = walk(value_tree, _is_value_leaf, what=what)
    table = sharding_table(shardings)
    placed: dict[int, Any] = {}
    castings: dict[int, str] = {}
    if abstract is None:
        troot = vroot
        pairs = [(n, n.value, None) for n in vroot.leaves()]
        rebuild = troot.rebuild
    else:
        # Targets on an abstract mesh (jax.eval_shape of a sharded state) made concrete.
        placer = Placer(saved_shardings(n.value for n in vroot.leaves()))

        def check(t: Node, v: Any) -> str | None:
            target, why = placer.target(t.value)
            if why is not None:
                return why
            placed[id(t)] = target
            want, got = getattr(t.value, "shape", None), getattr(v, "shape", None)
            if v is None and t.value is not None:
                asked = f"target shape {tuple(want)}" if want is not None else f"target {t.value!r}"
                return f"the {what} holds None here, the {asked}"
            if got is None and not isinstance(v, LazyValue):  # a number, a str or bytes
                return mismatch(type(v).__name__, t.value, what)
            why = key_mismatch(v, t.value, what)
            if why is not None:
                return why
            if (
                want is not None
                and not isinstance(t.value, type)
                and got is not None
                and tuple(got) != tuple(want)
            ):
                return f"{what} shape {tuple(got)}, target shape {tuple(want)}"
            return None

        pairing = pair_with_target(
            vroot,
            abstract,
            partial=partial,
            check=check,
            subject=subject or f"the {what}",
            is_empty=_is_none,
            casting=casting,
            dtype_of=_casting.value_dtype,
            transform=transform,
        )
        pairs = [(n, v, placed.get(id(n), target)) for n, v, target in pairing.pairs]
        castings = {id(n): pairing.casting(n) for n, _, _ in pairs}

        def rebuild(value_of: Callable[[Node], Any]) -> Any:
            return pairing.rebuild({id(n): value_of(n) for n, _, _ in pairs})

    budget = ByteBudget(current().byte_budget)
    results: dict[int, Any] = {}
    where = subject or f"the {what}"

    def placement(node: Node, v: Any, target: Any) -> tuple[Any, Any, str]:
        """(dtype, sharding, kind) of the leaf's result: the target's, else ``shardings=``'s."""
        dtype, sharding, kind = _target_of(target) if abstract is not None else (None, None, "")
        shape = getattr(v, "shape", None)
        if sharding is None and shape is not None and kind != "numpy":
            sharding = sharding_for(table, node.path, tuple(shape))
            if sharding is not None:
                kind = "jax"
        return dtype, sharding, kind

    # Each leaf's placement once; before anything is read, every sharding that does not
    # divide its leaf's shape.
    placed_as = {id(node): placement(node, v, target) for node, v, target in pairs}
    misfits = []
    for node, v, _ in pairs:
        why = sharding_misfit(placed_as[id(node)][1], getattr(v, "shape", None))
        if why is not None:
            misfits.append(f"{keystr(node.path)!r}: {why}")
    refuse_misfits(where, misfits, transform)

    async def one(node: Node, v: Any, target: Any) -> None:
        dtype, sharding, kind = placed_as[id(node)]
        how = castings.get(id(node), "unsafe")
        shape = getattr(v, "shape", None)
        try:
            if isinstance(v, LazyValue):
                out = await materialize_leaf(v, dtype, sharding, budget, how, node.path)
                if kind == "python" and target is not None:
                    out = convert(np.asarray(out)[()], target, node.path, how, where)
            elif key_impl_name(v) is not None:  # typed keys (checked against the target)
                out = jax.device_put(v, sharding) if sharding is not None else v
            elif kind == "jax" and shape is not None:
                host = _concrete(v, dtype, how, node.path, to_jax=True)
                out = (
                    jax.device_put(host, sharding) if sharding is not None else jax.device_put(host)
                )
            elif kind == "numpy" and v is not None:
                out = _concrete(v, dtype, how, node.path)
            elif kind == "python" and target is not None and v is not None:
                out = convert(
                    np.asarray(v)[()] if shape is not None else v, target, node.path, how, where
                )
            else:
                out = v
        except QuireError:
            raise
        except Exception as e:
            srcs = ", ".join(sorted({f"{s.url}:{s.key}" for s in getattr(v, "sources", list)()}))
            e.add_note(
                f"quire: loading leaf {keystr(node.path)!r} from {srcs or 'a concrete value'}"
            )
            raise
        results[id(node)] = out

    # At most max_concurrency leaves in flight (each waits for the budget, then reads its
    # regions): gathering thousands of leaf coroutines at once made every budget release wake
    # all of them, and kept them alive long enough to trigger full garbage collections.
    await for_each(pairs, lambda p: one(*p), max(1, current().max_concurrency))
    return rebuild(lambda n: results[id(n)])


def _concrete(v: Any, dtype: Any, casting: str, path: KeyPath, to_jax: bool = False) -> np.ndarray:
    """A concrete value of a transform's result as a numpy array of ``dtype`` (its own when
    None), the values of a narrowed integer checked; ``to_jax``: of the dtype its
    ``jax.Array`` will hold (:func:`quire._handlers.casting.jax_dtype`), values checked."""
    host = np.asarray(v)
    named = host.dtype if dtype is None else np.dtype(dtype)
    if host.dtype != named:
        _casting.check_values(host, named, casting, url="a concrete value", path=path)
    if to_jax and _casting.jax_dtype(named) != named:
        return _casting.to_jax_dtype(host, named, url="a concrete value", path=path)
    return host if host.dtype == named else host.astype(named)


def load_and_transform(
    sources: Any,
    abstract: Any = None,
    transform_fn: Callable[..., Any] | None = None,
    *,
    shardings: Any = None,
    partial: bool = False,
    storage_options: dict[str, Any] | None = None,
    casting: _casting.CastingSpec = None,
) -> Any:
    """Open ``sources`` lazily, apply ``transform_fn`` and load the result into ``abstract``.

    Parameters
    ----------
    sources : URL, Source, sequence of them, or dict name → URL/Source
        ``transform_fn`` gets one lazy tree (``Source.tree``) per source: positionally for a
        sequence, as keywords for a dict.
    abstract : pytree, optional
        The target (as for :func:`quire.load`); None: the transform's structure.
    transform_fn : callable, optional
        Returns a tree whose leaves are LazyArrays (or slices), :mod:`quire.surgery` lazy
        operations, concrete arrays or values, or None.  Identity when omitted: the one
        source's tree, a list of trees for a sequence, a dict of them for a dict.
    shardings : tree of shardings, :func:`quire.surgery.partition_rules`, or a Sharding
        For leaves whose abstract leaf carries no sharding.
    partial : bool
        Allow the transform's result to have leaves the abstract tree lacks (they are not read).
    casting : str or callable, optional
        Which casts to the abstract leaves' dtypes are allowed, as for :func:`quire.load`
        (default ``"same_kind"``); a lazy ``astype`` in the transform is a cast asked for.

    Raises
    ------
    TreeMismatchError
        The result does not match ``abstract`` (missing / extra / mis-shaped key paths).
    LossyCastError
        ``abstract`` asks for a cast that ``casting`` refuses (a float into an int, ...).
    Exception
        Whatever ``transform_fn`` raised, with a note naming the source URLs.
    """
    _casting.check_spec(casting)
    shaped, opened = open_sources(sources, storage_options)
    # Identity: the sources' trees in the sources' own shape (a list for a sequence, as a
    # dict for a dict), so a strict load never drops a source silently.
    fn = transform_fn or (lambda *a, **k: k if isinstance(shaped, Mapping) else
                          a[0] if isinstance(shaped, Source) else list(a))  # fmt: skip
    result = call_transform(fn, shaped, opened)
    urls = ", ".join(s.url for s in opened)
    if transform_fn is None:
        what, subject = "saved", f"checkpoint {urls}"
    else:
        what, subject = "transform result", f"the transform result of {urls}"
    return _io.submit(
        materialize_tree(
            result,
            abstract,
            shardings=shardings,
            partial=partial,
            what=what,
            subject=subject,
            transform=transform_fn is not None,
            casting=casting,
        )
    ).result()
