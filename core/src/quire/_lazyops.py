"""The lazy value nodes behind :mod:`quire.surgery`'s operations and LazyArray slicing:
constants, views (basic indexing), stacks, transposes, reshapes and casts.  Each reads
only the regions of its inputs that a requested region needs."""

from __future__ import annotations

import asyncio
import math
import operator
from collections.abc import Sequence
from typing import Any

import numpy as np

from quire._lazy import LazyArray, LazyValue, Region, full_region, region_shape


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
