"""Array records and layouts: the save plan of an array leaf and its zarr layout."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import jax
import numpy as np

from quire._format.bounds import MAX_CLAIMED_BYTES
from quire._format.dtypes import dtype_from_name, dtype_name
from quire._format.tree import keystr
from quire._handlers import chain as _chain
from quire._handlers.casting import check_storage_cast
from quire._handlers.meshes import sharding_json
from quire._handlers.replicas import Writers, piece_source
from quire._handlers.zarr_layout import ArrayLayout, inner_chunks_for
from quire._runtime.config import current
from quire.errors import CodecError, CorruptCheckpointError, QuireError, UnsupportedLeafError


def _norm_index(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape))


@dataclass
class ArrayPlan:
    """Where an array's owned chunks come from (host copies for async saves)."""

    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    chunk_shape: tuple[int, ...]
    owned: list[tuple[tuple[int, ...], Callable[[], np.ndarray]]]
    allocates: bool  # whether producing a chunk allocates host memory
    sharding: dict[str, Any] | None = None
    source_dtype: str | None = None


def _const(a: np.ndarray) -> Callable[[], np.ndarray]:
    return lambda: a


def _host(x: Any) -> Callable[[], np.ndarray]:
    return lambda: np.asarray(x)


def _cast(
    f: Callable[[], np.ndarray], dtype: np.dtype[Any], casting: str, path: tuple[Any, ...]
) -> Callable[[], np.ndarray]:
    def cast() -> np.ndarray:
        a = f()
        check_storage_cast(a.dtype, dtype, casting, a, path=path)  # a narrowed int's values
        return a.astype(dtype)

    return cast


def _check_not_held_by_one_other(value: jax.Array, path: tuple[Any, ...]) -> None:
    """Refuse a ``jax.Array`` that lies on the devices of one process other than the
    primary.  That process holds all of it (fully addressable there), which is also what a
    per-process copy of a process-local value looks like, and those only the primary
    writes (below): nobody would write it, and the commit would name chunks that do not
    exist.  Each process that holds none of it sees the case and raises, the primary
    included, so the save is aborted before anything is committed."""
    if jax.process_count() == 1 or value.addressable_shards:
        return
    devices: set[Any] = set(value.sharding.device_set)
    owners = {int(d.process_index) for d in devices}
    primary = current().primary_process
    if len(owners) == 1 and primary not in owners:
        (owner,) = owners
        raise UnsupportedLeafError(
            f"leaf {keystr(path)!r} lies on the devices of process {owner} only, which quire "
            f"cannot tell from that process's own copy of a process-local value (those only "
            f"primary process {primary} writes); give its mesh devices of another process "
            "too, or put it on the primary process's devices"
        )


def _plan(
    value: Any,
    storage: Any,
    path: tuple[Any, ...],
    writers: Writers | None = None,
    stage: Callable[[Any], Any] | None = None,
) -> ArrayPlan:
    """The save plan of ``value``; ``stage(shard)``, if given, is the array a ``jax.Array``
    shard's bytes are read from (``quire._handlers.arraysnap``: a pinned host copy)."""
    cast = None if storage.dtype is None else np.dtype(storage.dtype)
    if isinstance(value, jax.Array):
        _check_not_held_by_one_other(value, path)
    if isinstance(value, jax.Array) and writers is not None:
        # replica-parallel (quire._handlers.replicas): this process's pieces, any replica
        on_cpu = all(getattr(d, "platform", "") == "cpu" for d in value.sharding.device_set)
        plan = ArrayPlan(
            tuple(value.shape),
            np.dtype(value.dtype),
            writers.chunk_shape,
            [(c, piece_source(value, writers.chunk_shape, c, stage)) for c in writers.mine],
            not on_cpu,
            sharding_json(value.sharding),
        )
    elif isinstance(value, jax.Array):
        shape = tuple(value.shape)
        src = np.dtype(value.dtype)
        sharding = value.sharding
        chunk = tuple(sharding.shard_shape(value.shape)) if shape else ()
        owned: list[tuple[tuple[int, ...], Callable[[], np.ndarray]]] = []
        aligned = True
        for s in value.addressable_shards:
            if s.replica_id != 0:
                continue
            idx = _norm_index(s.index, shape)
            coords = []
            for sl, c, n in zip(idx, chunk, shape):
                if c == 0 or sl.start % c or (sl.stop - sl.start != c and sl.stop != n):
                    aligned = False
                coords.append(sl.start // c if c else 0)
            owned.append((tuple(coords), _host(s.data if stage is None else stage(s))))
        on_cpu = all(getattr(d, "platform", "") == "cpu" for d in sharding.device_set)
        if not math.prod(shape):  # no element, no chunk: any grid will do
            aligned, owned = True, []
        if not aligned:
            if not value.is_fully_addressable:
                raise UnsupportedLeafError(
                    f"leaf {keystr(path)!r}: its sharding does not form a regular grid of shards, "
                    "which quire cannot save from several processes; reshard it to a NamedSharding"
                )
            chunk = shape
            owned = [(tuple(0 for _ in shape), _host(value))]
        plan = ArrayPlan(shape, src, chunk, owned, not on_cpu, sharding_json(sharding))
    else:
        arr = np.asarray(value)
        swapped = not arr.dtype.isnative and arr.dtype.kind in "iufc"
        if swapped:  # store little-endian, like every other array
            arr = arr.astype(arr.dtype.newbyteorder("="))
        shape = tuple(arr.shape)
        plan = ArrayPlan(shape, arr.dtype, shape, [(tuple(0 for _ in shape), _const(arr))], swapped)
    try:
        dtype_name(plan.dtype)
    except TypeError:
        raise UnsupportedLeafError(
            f"leaf {keystr(path)!r}: dtype {plan.dtype} is not supported; cast it to a numeric dtype"
        ) from None
    plan.chunk_shape = tuple(max(1, c) for c in plan.chunk_shape)
    local = not isinstance(value, jax.Array) or value.is_fully_addressable
    if local and jax.process_count() > 1 and jax.process_index() != current().primary_process:
        # Every process holds its own copy of a process-local value (numpy array,
        # single-device jax array): the primary's is saved, no chunk has two writers.
        plan.owned = []
    if cast is not None and cast != plan.dtype:
        if not np.can_cast(plan.dtype, cast, casting="unsafe"):
            raise UnsupportedLeafError(
                f"leaf {keystr(path)!r}: StorageOptions(dtype={cast}) asks for a cast numpy "
                f"cannot do from {plan.dtype} (ml_dtypes has no direct cast between some of "
                "its types); cast the leaf yourself first (e.g. through float32), or store it "
                "as another dtype"
            )
        casting = getattr(storage, "casting", "same_kind")
        check_storage_cast(plan.dtype, cast, casting, path=path)
        plan.source_dtype = dtype_name(plan.dtype)
        plan.owned = [(c, _cast(f, cast, casting, path)) for c, f in plan.owned]
        plan.dtype = cast
        plan.allocates = True
    return plan


def _layout(plan: ArrayPlan, storage: Any, url: str) -> ArrayLayout:
    chain = _chain.place(storage.codecs or (), url=url)
    inner = None
    if storage.chunk_bytes is not None:
        inner = inner_chunks_for(plan.chunk_shape, plan.dtype.itemsize, int(storage.chunk_bytes))
    layout = ArrayLayout(
        plan.shape,
        plan.dtype,
        plan.chunk_shape,
        inner,
        chain.compressors,
        storage.checksum,
        chain.filters,
    )
    if chain.filters or chain.compressors:
        spec = layout._spec(inner or plan.chunk_shape)
        layout = replace(
            layout,
            filters=_chain.evolved(chain.filters, spec),
            compressors=_chain.evolved(chain.compressors, spec),
        )
        layout.specs(inner or plan.chunk_shape)  # every step keeps to dtypes quire stores
    return layout


def lossy_codecs(
    layout: ArrayLayout, url: str, path: tuple[Any, ...], exact: str | None
) -> tuple[str, ...]:
    """The codecs of ``layout`` that may lose information; :class:`CodecError` if any does on
    a leaf of a handler whose leaves must come back bit for bit (``exact``: its id)."""
    lossy = layout.lossy()
    if lossy and exact is not None:
        raise CodecError(
            f"{url}: leaf {keystr(path)!r}: codec {lossy[0]!r} may lose information, and a "
            f"{exact} leaf must come back bit for bit; give StorageOptions for its other "
            "leaves only (a callable of (path, leaf))"
        )
    return lossy


def layout_from_record(
    rec: Mapping[str, Any], url: str | None = None, key: str | None = None
) -> ArrayLayout:
    """The layout a record describes; ``CorruptCheckpointError`` if it is malformed (naming
    the leaf ``key``, when given)."""
    where = f"leaf {key!r}" if key else "array record"
    try:
        shape = tuple(int(x) for x in rec["shape"])
        chunk = tuple(int(x) for x in rec["chunk_shape"])
        inner = rec.get("inner_shape")
        inner_t = None if inner is None else tuple(int(x) for x in inner)
        dtype = dtype_from_name(rec["dtype"])
        if not isinstance(rec["location"], str):
            raise TypeError("location")
        if any(type(x) is not int for x in (*rec["shape"], *rec["chunk_shape"])):
            raise TypeError("shape entries must be integers")
        if any(s < 0 for s in shape) or any(c <= 0 for c in chunk) or len(chunk) != len(shape):
            raise ValueError(f"bad shape {shape} / chunk shape {chunk}")
        if inner_t is not None and (
            len(inner_t) != len(chunk) or any(i <= 0 or c % i for i, c in zip(inner_t, chunk))
        ):
            raise ValueError(f"inner chunk shape {inner_t} does not divide {chunk}")
        nbytes = math.prod(shape) * dtype.itemsize
        chunk_bytes = math.prod(chunk) * dtype.itemsize if nbytes else 0  # empty: no chunk
        if nbytes > MAX_CLAIMED_BYTES or chunk_bytes > MAX_CLAIMED_BYTES:
            raise ValueError(f"claims {nbytes} bytes, beyond any real checkpoint")
        codecs = rec.get("codecs", [])
        if not isinstance(codecs, list) or not all(
            isinstance(c, dict) and isinstance(c.get("name"), str) for c in codecs
        ):
            raise TypeError(f"codecs must be a list of {{'name': ...}} objects, got {codecs!r}")
        chain = _chain.from_record(codecs, url=url, where=where)
        checksum = rec.get("checksum", True)
        if not isinstance(checksum, bool):
            raise TypeError("checksum must be a bool")
        layout = ArrayLayout(
            shape, dtype, chunk, inner_t, chain.compressors, checksum, chain.filters
        )
        if chain.filters and nbytes:
            layout.specs(inner_t or chunk)
    except CodecError as e:
        raise CorruptCheckpointError(
            f"{url}: {where}: {e}; the record names a codec chain quire does not read"
        ) from e
    except QuireError:
        raise
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptCheckpointError(
            f"{url}: malformed array record{' of ' + where if key else ''} ({e!r}); the "
            "commit record is damaged"
        ) from e
    return layout
