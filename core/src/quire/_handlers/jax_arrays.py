"""JAX array leaves: ``jax.Array`` with any sharding, and typed PRNG keys (key data plus
the impl name), stored as :class:`~quire._handlers.arrays.ArrayHandler` stores arrays."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import jax
import numpy as np

from quire._format.bounds import prng_impls
from quire._format.tree import keystr
from quire._handlers.arrayplan import ArrayPlan
from quire._handlers.arrays import ArrayHandler
from quire._handlers.base import LoadContext, LoadEntry, SaveContext, SaveEntry
from quire.errors import CorruptCheckpointError, UnsupportedLeafError


def key_impl_name(value: Any) -> str | None:
    """The PRNG implementation's name (``"threefry2x32"``, ``"rbg"``, ...) of a typed key
    array or ``jax.ShapeDtypeStruct`` of one; None for anything else."""
    dtype = getattr(value, "dtype", None)
    try:
        if dtype is None or not jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
            return None
    except TypeError:
        return None
    impl: Any = (
        jax.random.key_impl(value)
        if isinstance(value, jax.Array)
        else getattr(dtype, "_impl", None)  # a ShapeDtypeStruct: key_impl takes arrays only
    )
    name = getattr(impl, "name", impl)
    return str(name) if name is not None else None


def key_mismatch(value: Any, target: Any, what: str) -> str | None:
    """Why a value (a source's leaf, a transform's result) cannot fill ``target`` as keys or
    as key data, or None: typed PRNG keys go only into typed keys of their implementation and
    shape, and only keys fill a typed key target (a Python type as target: None)."""
    if isinstance(target, type) or getattr(target, "shape", None) is None:
        return None
    saved, want = key_impl_name(value), key_impl_name(target)
    if saved is None and want is None:
        return None
    shape, tshape = tuple(getattr(value, "shape", ())), tuple(target.shape)
    if want is None:
        return (
            f"{what} holds {saved} PRNG keys of shape {shape}, target {target.dtype} of shape "
            f"{tshape}, not a typed key: make the target a key (jax.random.key(0, "
            f"impl={saved!r}) or its jax.eval_shape), or take jax.random.key_data in transform="
        )
    if saved is None:
        return (
            f"{what} holds {getattr(value, 'dtype', type(value).__name__)} of shape {shape}, "
            f"target {want} PRNG keys of shape {tshape}: wrap key data into keys with "
            f"jax.random.wrap_key_data(data, impl={want!r}) in transform="
        )
    if saved != want:
        return (
            f"{what} holds {saved} PRNG keys, target {want} keys: a key's bits mean nothing to "
            f"another implementation; make the target {saved} keys or start from fresh keys"
        )
    if shape != tshape:
        return f"{what} holds {saved} PRNG keys of shape {shape}, target keys of shape {tshape}"
    return None


class JaxArrayHandler(ArrayHandler):
    """``jax.Array`` leaves with any sharding over the process's devices."""

    id = "jax"

    def handles(self, value: Any) -> bool:
        return isinstance(value, jax.Array) and not jax.dtypes.issubdtype(
            value.dtype, jax.dtypes.prng_key
        )


def _impl_and_shape(value: Any) -> tuple[str, tuple[int, ...]]:
    """A key's (or its host snapshot's) implementation name and key shape."""
    if isinstance(value, ArrayPlan):
        impl, shape = value.impl, value.key_shape  # type: ignore[attr-defined]
    else:
        impl, shape = jax.random.key_impl(value), value.shape
    return str(getattr(impl, "name", impl)), tuple(shape)


class PRNGKeyHandler(ArrayHandler):
    """Typed JAX PRNG keys (``jax.random.key``): the key data plus the impl name."""

    id = "prng_key"
    priority = 10
    exact = True  # a key's bits are its meaning

    def handles(self, value: Any) -> bool:
        return isinstance(value, jax.Array) and jax.dtypes.issubdtype(
            value.dtype, jax.dtypes.prng_key
        )

    def to_array(self, value: Any) -> Any:
        return jax.random.key_data(value)

    def extra_record(self, value: Any) -> dict[str, Any]:
        impl, shape = _impl_and_shape(value)
        return {"impl": impl, "key_shape": list(shape)}

    async def save(self, entries: Sequence[SaveEntry], ctx: SaveContext) -> list[dict[str, Any]]:
        """As :meth:`ArrayHandler.save`, after refusing keys no load could rebuild."""
        impls = prng_impls()
        for e in entries:
            impl = _impl_and_shape(e.value)[0]
            if impl not in impls:
                raise UnsupportedLeafError(
                    f"{ctx.url}: leaf {keystr(e.path)!r} is a PRNG key of implementation "
                    f"{impl!r}, which a load cannot find by name (it knows {sorted(impls)}); "
                    "save jax.random.key_data(key) instead and wrap it with your "
                    "implementation after loading"
                )
        return await super().save(entries, ctx)

    def snapshot(self, entries: Sequence[SaveEntry]) -> list[SaveEntry]:
        out = super().snapshot(entries)
        res = []
        for orig, snap in zip(entries, out):
            plan = snap.value
            plan.impl = jax.random.key_impl(orig.value)
            plan.key_shape = tuple(orig.value.shape)
            res.append(snap)
        return res

    def _record_shape(self, rec: Mapping[str, Any]) -> tuple[int, ...]:
        return tuple(rec.get("key_shape", rec["shape"]))

    def check(self, entry: LoadEntry) -> str | None:
        """Why ``entry``'s target cannot receive the saved keys, or None: a target that is
        not a typed key array, keys of another implementation (their bits mean nothing to
        it), or another shape.

        Parameters
        ----------
        entry : LoadEntry
            The saved record and the target leaf.
        """
        t = entry.target
        shape = getattr(t, "shape", None)
        if shape is None or isinstance(t, type):
            return None
        impl, saved = entry.record.get("impl"), self._record_shape(entry.record)
        want = key_impl_name(t)
        what = f"saved {impl} PRNG keys of shape {saved}"
        if want is None:
            return (
                f"{what}, target {getattr(t, 'dtype', '?')} of shape {tuple(shape)}, not a typed "
                f"key: make the target a key (jax.random.key(0, impl={impl!r}) or its "
                "jax.eval_shape), or load without one and take jax.random.key_data"
            )
        if want != impl:
            return (
                f"{what}, target {want} keys: a key's bits mean nothing to another "
                f"implementation; make the target {impl} keys (jax.random.key(0, impl={impl!r})) "
                "or start this run from fresh keys"
            )
        if tuple(shape) != saved:
            return f"{what}, target {want} keys of shape {tuple(shape)}"
        return None

    async def _load_one(self, e: LoadEntry, ctx: LoadContext) -> Any:
        impl = e.record.get("impl")
        if not isinstance(impl, str):
            raise CorruptCheckpointError(
                f"{ctx.url}: leaf {keystr(e.path)!r}: PRNG key record lacks its impl"
            )
        target = e.target
        data_target = None
        if (
            target is not None
            and getattr(target, "sharding", None) is not None
            and not isinstance(target, type)
        ):
            data_target = jax.ShapeDtypeStruct(tuple(e.record["shape"]), np.uint32)
        data = await self._read_array(e, ctx, data_target, "jax")
        key = jax.random.wrap_key_data(data, impl=impl)
        if data_target is not None:
            key = jax.device_put(key, target.sharding)
        return key

    def metadata(self, records: Sequence[Mapping[str, Any]]) -> list[Any]:
        """As :meth:`ArrayHandler.metadata`, with the keys' shape and typed key dtype
        (``key<fry>``: what ``jax.random.key(0).dtype`` is), not the key data's uint32."""
        out = super().metadata(records)
        return [
            replace(m, shape=tuple(r.get("key_shape", m.shape)), dtype=_key_dtype(r.get("impl")))
            for m, r in zip(out, records)
        ]


@functools.lru_cache(maxsize=16)
def _key_dtype(impl: Any) -> Any:
    """The typed key dtype of PRNG implementation ``impl`` (no array is made)."""
    if impl not in prng_impls():
        raise CorruptCheckpointError(
            f"a PRNG key record names implementation {impl!r}, which this JAX does not have "
            f"(it has {sorted(prng_impls())})"
        )
    return jax.eval_shape(lambda: jax.random.key(0, impl=impl)).dtype
