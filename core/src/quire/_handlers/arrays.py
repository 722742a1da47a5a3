"""Array leaves (numpy, jax, typed PRNG keys) stored as zarr v3 arrays, one chunk per shard."""

from __future__ import annotations

import asyncio
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import jax
import numpy as np

from quire._format import zarr_dtypes  # noqa: F401 - registers them: zarr reads what we write
from quire._format.dtypes import dtype_name
from quire._format.tree import keystr
from quire._handlers.arrayplan import (
    ArrayPlan,
    _layout,
    _norm_index,
    _plan,
    layout_from_record,
    lossy_codecs,
)
from quire._handlers.arraysnap import snapshot_plans
from quire._handlers.base import LoadContext, LoadEntry, SaveContext, SaveEntry, StoredObject
from quire._handlers.casting import (
    check_cast,
    check_values,
    jax_dtype,
    storage_cast_at,
    target_dtype,
    to_jax_dtype,
)
from quire._handlers.descriptions import describe_arrays
from quire._handlers.inline import convert
from quire._handlers.meshes import saved_sharding
from quire._handlers.zarr_io import (
    ArrayLayout,
    ChunkError,
    array_objects,
    read_region,
    write_chunk,
)
from quire._runtime.budget import ByteBudget
from quire._runtime.config import current
from quire._runtime.hostbuf import aligned_empty, for_device, is_aligned
from quire._runtime.ioloop import run_blocking
from quire._runtime.tasks import gather_cancelling
from quire.errors import (
    CorruptCheckpointError,
    LossyCastError,
    QuireError,
    UnsupportedLeafError,
)


def _phys_mem() -> int:
    try:
        return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return 2**62


def _chunks_span_regions(
    layout: ArrayLayout,
    box: tuple[tuple[int, int], ...],
    regions: Mapping[tuple[tuple[int, int], ...], Any],
) -> bool:
    """Whether some stored chunk overlaps more than one target region (then reading the
    bounding box once saves reading that chunk once per region)."""
    for coords in layout.chunks_in(tuple(slice(a, b) for a, b in box)):
        creg = layout.chunk_region(coords)
        hits = 0
        for key in regions:
            if all(max(c.start, a) < min(c.stop, b) for c, (a, b) in zip(creg, key)):
                hits += 1
                if hits > 1:
                    return True
    return False


async def _device_put(host: np.ndarray, device: Any) -> Any:
    """``jax.device_put(host, device)``: on the loop when XLA adopts the aligned buffer
    (a CPU device: no copy, ~40 µs, less than a trip to a worker thread), else in a
    worker thread (a copy, or a transfer to an accelerator)."""
    if getattr(device, "platform", None) == "cpu" and is_aligned(host):
        return jax.device_put(host, device)
    return await run_blocking(jax.device_put, host, device)


def _target_kind(target: Any, handler_id: str) -> str:
    if target is None:
        return "numpy" if handler_id == "numpy" else "jax"
    if isinstance(target, np.ndarray) or target is np.ndarray or isinstance(target, np.generic):
        return "numpy"
    if isinstance(target, jax.ShapeDtypeStruct | jax.Array) or target is jax.Array:
        return "jax"
    if isinstance(target, type | bool | int | float | complex):
        return "python"
    return "jax"


class ArrayHandler:
    """Base of the leaf handlers that store arrays as zarr v3 arrays (public as
    :class:`quire.handlers.ArrayHandler`).

    Each leaf becomes one zarr v3 array under its location, one chunk (or zarr shard)
    per device shard, crc32c on every chunk; loads reshard, cast and verify.  A
    subclass sets ``id`` (and ``priority``), implements ``handles(value)``, and may
    override :meth:`to_array` (the array-like to store for a value) and
    :meth:`extra_record` (JSON fields added to the leaf record).  A handler that
    converts its leaves itself can instead hold a :class:`NumpyArrayHandler` and call
    its methods on numpy arrays (as quire-torch does).  A handler whose leaves must come
    back bit for bit whatever the user's codecs (PRNG keys) sets ``exact = True``: a
    lossy codec on one of its leaves is a :class:`~quire.errors.CodecError`.
    """

    id = "array"
    priority = 0
    exact = False

    # -- save -----------------------------------------------------------------------
    def handles_abstract(self, abstract: Any) -> bool:
        """Whether this handler loads a leaf whose target is ``abstract`` (any target).

        Parameters
        ----------
        abstract : Any
            The target leaf (an array, ``ShapeDtypeStruct``, a type or None).
        """
        return True

    def snapshot(self, entries: Sequence[SaveEntry]) -> list[SaveEntry]:
        """Every owned shard as host bytes the caller can no longer change (what
        ``save_async`` blocks on): a ``jax.Array`` shard costs its device-to-host transfer
        only (on a CPU device not even a copy: a view that keeps XLA from reusing the
        buffer), a numpy leaf a copy into host buffers reused across saves.

        Parameters
        ----------
        entries : sequence of SaveEntry
            The leaves this handler saves in one call.
        """
        plans = snapshot_plans([self.to_array(e.value) for e in entries], entries)
        return [replace(e, value=plan) for e, plan in zip(entries, plans)]

    def to_array(self, value: Any) -> Any:
        """The numpy or jax array to store for ``value`` (the value itself by default).

        Parameters
        ----------
        value : Any
            A leaf this handler ``handles``.

        Returns
        -------
        numpy.ndarray or jax.Array
        """
        return value

    def extra_record(self, value: Any) -> dict[str, Any]:
        """JSON fields to add to the leaf record of ``value`` (none by default).

        Called after :meth:`snapshot` too, with what it put in the entry.

        Parameters
        ----------
        value : Any
            The leaf (or its host copy).
        """
        return {}

    async def save(self, entries: Sequence[SaveEntry], ctx: SaveContext) -> list[dict[str, Any]]:
        """Write each leaf as a zarr v3 array (this process's chunks only); its records.

        Parameters
        ----------
        entries : sequence of SaveEntry
            The leaves this handler saves in one call.
        ctx : SaveContext
            The backend to write through, the txid and the process layout.

        Returns
        -------
        list of dict
            One JSON leaf record per entry.
        """
        budget = ctx.budget or ByteBudget(256 << 20)
        sem = ctx.limit or asyncio.Semaphore(current().max_concurrency)

        async def one(e: SaveEntry) -> dict[str, Any]:
            plan = (
                e.value
                if isinstance(e.value, ArrayPlan)
                else _plan(self.to_array(e.value), e.storage, e.path, e.writers)
            )
            layout = _layout(plan, e.storage, ctx.url)
            lossy = lossy_codecs(layout, ctx.url, e.path, self.id if self.exact else None)
            jobs = []
            if ctx.is_primary:
                import json

                meta = json.dumps(layout.zarr_json()).encode()

                async def put_meta(
                    key: str = f"{e.location}/zarr.json", meta: bytes = meta
                ) -> None:
                    async with sem:
                        await ctx.backend.put(key, [meta])

                jobs.append(put_meta())
                ctx.stats["objects"] += 1
            chunk_nbytes = math.prod(layout.chunk_shape) * layout.dtype.itemsize

            async def write(coords: tuple[int, ...], produce: Callable[[], np.ndarray]) -> None:
                # Host memory this chunk allocates: the cast/copy, then each encoded copy.
                need = (chunk_nbytes if plan.allocates else 0) + (
                    2 * chunk_nbytes if not layout.fast else 0
                )
                async with sem, budget.hold(need):
                    data = produce()
                    n = await write_chunk(ctx.backend, e.location, layout, coords, data)
                    ctx.stats["bytes"] += n
                    ctx.stats["objects"] += 1

            if math.prod(plan.shape):
                jobs += [write(c, f) for c, f in plan.owned]
            await asyncio.gather(*jobs)
            rec: dict[str, Any] = {
                "handler": self.id,
                "shape": list(plan.shape),
                "dtype": dtype_name(plan.dtype),
                "location": e.location,
                "chunk_shape": list(layout.chunk_shape),
                "codecs": layout.record_codecs(),
                "checksum": layout.checksum,
                "nbytes": layout.nbytes,
            }
            if lossy:
                rec["lossy"] = list(lossy)
            if layout.inner_shape is not None:
                rec["inner_shape"] = list(layout.inner_shape)
            if plan.sharding is not None:
                rec["sharding"] = plan.sharding
            if plan.source_dtype is not None:
                rec["source_dtype"] = plan.source_dtype
            rec.update(self.extra_record(e.value))
            return rec

        async def guarded(e: SaveEntry) -> dict[str, Any]:
            try:
                return await one(e)
            except LossyCastError as err:  # a storage cast refused: the URL in front
                raise storage_cast_at(ctx.url, err) from err
            except QuireError:
                raise
            except Exception as err:
                raise QuireError(
                    f"{ctx.url}: saving leaf {keystr(e.path)!r} failed: {err}"
                ) from err

        return list(await asyncio.gather(*(guarded(e) for e in entries)))

    # -- load -----------------------------------------------------------------------
    async def objects(
        self, entries: Sequence[LoadEntry], ctx: LoadContext
    ) -> list[list[StoredObject]]:
        """Each leaf's ``zarr.json`` and chunks (or zarr shards), with their checks.

        Parameters
        ----------
        entries, ctx
            As for :meth:`load`.
        """
        return [
            array_objects(
                layout_from_record(e.record, ctx.url, keystr(e.path)), e.record["location"]
            )
            for e in entries
        ]

    def _record_shape(self, rec: Mapping[str, Any]) -> tuple[int, ...]:
        return tuple(rec["shape"])

    def check(self, entry: LoadEntry) -> str | None:
        """Why ``entry``'s target cannot receive the saved array (a shape mismatch), or None.

        Parameters
        ----------
        entry : LoadEntry
            The saved record and the target leaf.
        """
        t = entry.target
        shape = getattr(t, "shape", None)
        if shape is None or isinstance(t, type):
            return None
        saved = self._record_shape(entry.record)
        if tuple(shape) != saved:
            return f"saved shape {saved} {entry.record.get('dtype')}, target shape {tuple(shape)}"
        return None

    async def load(self, entries: Sequence[LoadEntry], ctx: LoadContext) -> list[Any]:
        """Read each leaf into its target's kind (numpy, or jax with the target sharding).

        Parameters
        ----------
        entries : sequence of LoadEntry
            The leaves to load, one value each (returned in order).
        ctx : LoadContext
            The backend to read through, the URL and the process layout.
        """
        sem = asyncio.Semaphore(16)

        async def one(e: LoadEntry) -> Any:
            async with sem:
                try:
                    return await self._load_one(e, ctx)
                except ChunkError as err:
                    raise CorruptCheckpointError(
                        f"{ctx.url}: leaf {keystr(e.path)!r}: {err}; the checkpoint is damaged "
                        "(run `quire verify URL` to list every bad chunk, restore from a copy or re-save)"
                    ) from err

        return await gather_cancelling(*(one(e) for e in entries))

    async def _read_array(self, e: LoadEntry, ctx: LoadContext, target: Any, kind: str) -> Any:
        layout = layout_from_record(e.record, ctx.url, keystr(e.path))
        loc = e.record["location"]
        tdtype = getattr(target, "dtype", None) if kind != "python" else None
        if isinstance(target, type):
            tdtype = None
        out_dtype = np.dtype(tdtype) if tdtype is not None else layout.dtype
        if out_dtype != layout.dtype and not np.can_cast(layout.dtype, out_dtype, "unsafe"):
            raise UnsupportedLeafError(
                f"{ctx.url}: leaf {keystr(e.path)!r} is stored as {layout.dtype}, which numpy "
                f"cannot cast to the target's {out_dtype} (ml_dtypes has no direct cast between "
                f"some of its types); load it as {layout.dtype} and cast it yourself (e.g. "
                "through float32)"
            )
        if out_dtype != layout.dtype:
            check_cast(layout.dtype, out_dtype, e.casting, url=ctx.url, path=e.path)
        if kind == "python" and target is not None:
            # A Python number holds any int and a float64; the kind is what can be lost.
            want = target_dtype(target)
            if want is not None:
                check_cast(layout.dtype, want, e.casting, url=ctx.url, path=e.path)

        # A jax.Array holds jax_dtype(out_dtype): 32 bits for 64 while jax_enable_x64 is off.
        real = jax_dtype(out_dtype) if kind == "jax" else out_dtype

        def cast(a: np.ndarray) -> np.ndarray:
            """``a`` as the result's dtype (aligned for the device); narrowed ints checked."""
            check_values(a, out_dtype, e.casting, url=ctx.url, path=e.path)
            if real != out_dtype:
                a = to_jax_dtype(a, out_dtype, url=ctx.url, path=e.path, saved=layout.dtype)
            return for_device(a, real)

        shape = layout.shape
        if kind in ("numpy", "python"):
            self._check_memory(layout.nbytes, e, ctx)
            buf = np.empty(shape, layout.dtype)
            await read_region(
                ctx.backend, loc, layout, tuple(slice(0, n) for n in shape), buf, sem=ctx.limit
            )
            ctx.stats["bytes"] += buf.nbytes
            if out_dtype != layout.dtype:
                check_values(buf, out_dtype, e.casting, url=ctx.url, path=e.path)
            arr = buf if out_dtype == layout.dtype else buf.astype(out_dtype)
            if kind == "python":  # a 0-d array as a number type (or value); not by calling it
                return convert(arr[()], target, e.path, e.casting, ctx.url)
            return arr
        sharding = getattr(target, "sharding", None) if target is not None else None
        if sharding is None or isinstance(target, type):
            sharding = saved_sharding(e.record)
        idx_map = sharding.addressable_devices_indices_map(shape)
        if not idx_map:
            # A mesh of other processes' devices: this process holds no shard of the result
            # (JAX needs the dtype given when there is no shard to take it from).
            return jax.make_array_from_single_device_arrays(shape, sharding, [], dtype=real)
        regions: dict[tuple[tuple[int, int], ...], list[Any]] = {}
        for dev, idx in idx_map.items():
            norm = _norm_index(idx, shape) if shape else ()
            regions.setdefault(tuple((s.start, s.stop) for s in norm), []).append(dev)
        per_region = (
            math.prod(b - a for a, b in next(iter(regions))) * layout.dtype.itemsize if shape else 0
        )
        arrays: dict[Any, Any] = {}
        # When this process's regions tile their bounding box (the usual case: a process
        # holds a block of the mesh), read the box once: a stored chunk that overlaps
        # several of the regions (a resharded load) is then read once, not once each.
        box = None
        if shape and len(regions) > 1:
            box = tuple(
                (min(k[d][0] for k in regions), max(k[d][1] for k in regions))
                for d in range(len(shape))
            )
            area = sum(math.prod(b - a for a, b in k) for k in regions)
            if math.prod(b - a for a, b in box) > area or not _chunks_span_regions(
                layout, box, regions
            ):
                # Not a tiling, or every stored chunk feeds one region only (the same
                # sharding as saved): per-region reads overlap reading with device_put.
                box = None
        if box is not None:
            self._check_memory(math.prod(b - a for a, b in box) * layout.dtype.itemsize, e, ctx)
            whole = aligned_empty(tuple(b - a for a, b in box), layout.dtype)
            await read_region(
                ctx.backend, loc, layout, tuple(slice(a, b) for a, b in box), whole, sem=ctx.limit
            )
            ctx.stats["bytes"] += whole.nbytes

            async def place(key: tuple[tuple[int, int], ...], devs: list[Any]) -> None:
                assert box is not None
                part = whole[tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(key, box))]
                host = cast(part)
                for d in devs:
                    arrays[d] = await _device_put(host, d)

            await asyncio.gather(*(place(k, v) for k, v in regions.items()))
            return jax.make_array_from_single_device_arrays(
                shape, sharding, [arrays[d] for d in idx_map]
            )
        self._check_memory(per_region, e, ctx)

        budget = getattr(ctx, "budget", None) or ByteBudget(current().byte_budget)

        async def region(key: tuple[tuple[int, int], ...], devs: list[Any]) -> None:
            reg = tuple(slice(a, b) for a, b in key)
            nbytes = math.prod(b - a for a, b in key) * layout.dtype.itemsize
            # The host buffer lives until it is on the device: bounded by the byte budget.
            need = nbytes * (1 if real == layout.dtype else 2)
            async with budget.hold(need):
                # Aligned: on CPU, device_put adopts the buffer instead of copying it.
                buf = aligned_empty(tuple(b - a for a, b in key), layout.dtype)
                await read_region(ctx.backend, loc, layout, reg, buf, sem=ctx.limit)
                ctx.stats["bytes"] += buf.nbytes
                host = cast(buf)
                for d in devs:
                    arrays[d] = await _device_put(host, d)
                del buf, host

        await gather_cancelling(*(region(k, v) for k, v in regions.items()))
        return jax.make_array_from_single_device_arrays(
            shape, sharding, [arrays[d] for d in idx_map]
        )

    def _check_memory(self, nbytes: int, e: LoadEntry, ctx: LoadContext) -> None:
        mem = _phys_mem()
        if nbytes > mem:
            raise CorruptCheckpointError(
                f"{ctx.url}: leaf {keystr(e.path)!r} claims {nbytes} bytes per process, more than "
                f"this machine's {mem} bytes of memory; refusing to allocate. If the checkpoint is "
                "genuine, load it sharded over more devices/processes or leave it out (partial=True)"
            )

    async def _load_one(self, e: LoadEntry, ctx: LoadContext) -> Any:
        kind = _target_kind(e.target, self.id)
        return await self._read_array(e, ctx, e.target, kind)

    def metadata(self, records: Sequence[Mapping[str, Any]]) -> list[Any]:
        """A :class:`quire.metadata.LeafMetadata` per record.

        Parameters
        ----------
        records : sequence of dict
            Leaf records this handler wrote.
        """
        return describe_arrays(records)


class NumpyArrayHandler(ArrayHandler):
    """``numpy.ndarray`` leaves of every numeric dtype (bfloat16 and float8 included)."""

    id = "numpy"

    def handles(self, value: Any) -> bool:
        """Whether ``value`` is a ``numpy.ndarray``.

        Parameters
        ----------
        value : Any
            A leaf of the tree being saved.
        """
        return isinstance(value, np.ndarray)
