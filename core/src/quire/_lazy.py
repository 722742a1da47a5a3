"""Lazy arrays: a shape, a dtype and a reader of regions; nothing is read until asked.

Every lazy value (a source's :class:`LazyArray`, a view of one, or an operation node: constants,
stacks, transposes, reshapes, casts) answers :meth:`LazyValue.read_region` for any step-1
region by reading only the parts of its inputs it needs.  :meth:`LazyValue.read` runs the
materialiser that :mod:`quire._materialize` (above this module) installs at its import
(:func:`install_materializer`).
"""

from __future__ import annotations

import asyncio
import math
import operator
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from quire import _io
from quire._dtypes import dtype_from_name

if TYPE_CHECKING:
    from collections.abc import Callable, Coroutine

Region = tuple[slice, ...]

__all__ = ["LazyArray", "LazyValue", "Region", "RegionReader", "full_region", "region_shape"]


@runtime_checkable
class RegionReader(Protocol):
    """What a source gives a :class:`LazyArray` to read its bytes.

    ``read_region(region)`` returns a C-contiguous numpy array of exactly the region's shape
    and the LazyArray's (stored) dtype.  ``region`` has one ``slice(start, stop)`` per axis
    (step 1, ``0 <= start <= stop <= shape[axis]``, in the array's own coordinates; ``()``
    for a 0-d array).  It is awaited on quire's event loop, possibly many times at once for
    disjoint regions: do blocking work in a thread (``await asyncio.to_thread(...)``) or
    through an async client.  Read only what the region needs — quire's laziness promise
    (a slice reads only the bytes it covers) rests on it.  Raise
    :class:`quire.CorruptCheckpointError` for damaged data, naming the URL and key path.

    Optionally a reader may define ``nbytes_hint(region) -> int`` (host bytes one read
    holds; default ``prod(region) * itemsize``), which quire charges to its byte budget, and
    ``blocking(region) -> Callable[[], numpy.ndarray] | None``: a function that does the same
    read as one blocking call (a local file), which quire then runs in a worker thread together
    with placing the result on devices; None where the reader cannot (quire awaits
    ``read_region``).
    """

    async def read_region(self, region: Region) -> np.ndarray:
        """Read ``region`` of the stored array (see the class docstring for the contract).

        Parameters
        ----------
        region : tuple of slice
            One ``slice(start, stop)`` per axis (step 1, within the shape; ``()`` for 0-d).

        Returns
        -------
        numpy.ndarray
            C-contiguous, of exactly the region's shape and the stored dtype.
        """
        ...


def region_shape(region: Region) -> tuple[int, ...]:
    return tuple(s.stop - s.start for s in region)


def full_region(shape: Sequence[int]) -> Region:
    return tuple(slice(0, int(n)) for n in shape)


# The materialiser behind LazyValue.read: ``fn(value, dtype, sharding)``, a coroutine reading
# ``value`` whole.  quire._materialize installs it at import, and ``import quire`` imports that.
_materialize: Callable[[LazyValue, Any, Any], Coroutine[Any, Any, Any]] | None = None


def install_materializer(fn: Callable[[LazyValue, Any, Any], Coroutine[Any, Any, Any]]) -> None:
    """Set the coroutine function that :meth:`LazyValue.read` runs on quire's event loop."""
    global _materialize
    _materialize = fn


def _axis(axis: int, ndim: int) -> int:
    if not -ndim <= axis < ndim:
        raise ValueError(f"axis {axis} is out of bounds for {ndim} dimensions")
    return axis % ndim


class LazyValue:
    """Base of every lazy node: ``shape``, ``dtype`` and an async region reader.

    Subclasses implement ``_read(region)``; :meth:`read_region` checks the region.
    """

    shape: tuple[int, ...]
    dtype: np.dtype[Any]

    @property
    def ndim(self) -> int:
        """Number of axes."""
        return len(self.shape)

    @property
    def size(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the whole value in its dtype (what :meth:`read` returns)."""
        return self.size * self.dtype.itemsize

    def sources(self) -> list[LazyArray]:
        """The source arrays this value reads from (for error messages and accounting)."""
        return []

    async def _read(self, region: Region) -> np.ndarray:
        raise NotImplementedError

    async def read_region(self, region: Region) -> np.ndarray:
        """Read ``region`` of this value, on quire's event loop (checked against the shape).

        Parameters
        ----------
        region : tuple of slice
            As for :meth:`RegionReader.read_region`.

        Returns
        -------
        numpy.ndarray
            Of exactly the region's shape.

        Raises
        ------
        IndexError
            The region is outside the shape.
        """
        if len(region) != len(self.shape) or any(
            not (0 <= s.start <= s.stop <= n) for s, n in zip(region, self.shape)
        ):
            raise IndexError(f"region {region} is outside shape {self.shape}")
        out = await self._read(region)
        if out.shape != region_shape(region):
            raise AssertionError(f"reader returned shape {out.shape} for region {region}")
        return out

    def read(self, dtype: Any = None, sharding: Any = None) -> Any:
        """Read the whole value: a numpy array, or a ``jax.Array`` placed with ``sharding``.

        Each device shard reads only its own region.

        Parameters
        ----------
        dtype : numpy dtype, optional
            Cast to this dtype (default: the value's own).
        sharding : jax.sharding.Sharding, optional
            Place the result as a ``jax.Array`` with this sharding (default: numpy).

        Returns
        -------
        numpy.ndarray or jax.Array
        """
        if _materialize is None:
            raise RuntimeError("quire._materialize is not imported (import quire first)")
        return _io.submit(_materialize(self, dtype, sharding)).result()

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out: np.ndarray = self.read(dtype)
        return out

    def __getitem__(self, index: Any) -> LazyValue:
        return _index(self, index)

    @property
    def T(self) -> LazyValue:
        """The lazy transpose (:func:`quire.surgery.transpose`)."""
        return _Transpose(self, None)

    def astype(self, dtype: Any) -> LazyValue:
        """A lazy cast (:func:`quire.surgery.astype`).

        Parameters
        ----------
        dtype : numpy dtype or str
            The dtype to cast to when read (``ml_dtypes`` names such as ``"bfloat16"`` work).
        """
        return _AsType(self, dtype)

    def reshape(self, *shape: Any) -> LazyValue:
        """A lazy reshape (:func:`quire.surgery.reshape`).

        Parameters
        ----------
        *shape : int or tuple of int
            The new shape, as ints or one tuple (as for ``numpy.reshape``).
        """
        if len(shape) == 1 and not isinstance(shape[0], int):
            shape = tuple(shape[0])
        return _Reshape(self, shape)

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d lazy array")
        return self.shape[0]


class LazyArray(LazyValue):
    """One array of a :class:`quire.Source`, not yet read.

    Slicing (``x[a:b, :, i]``, ``x[..., 0]``; ints, step-1 slices, Ellipsis, None) gives a
    lazy view reading only what it covers; :meth:`read` reads it.

    Parameters
    ----------
    shape, dtype
        As stored.
    key_path : tuple of str/int
        Where the leaf sits in the source's tree (``key`` is it "/"-joined).
    reader : RegionReader
        Reads regions of the stored array (see :class:`RegionReader`).
    url : str
        The source's URL (error messages name it).
    """

    def __init__(
        self,
        shape: Sequence[int],
        dtype: Any,
        key_path: Sequence[str | int],
        reader: RegionReader,
        url: str,
    ) -> None:
        self.shape = tuple(operator.index(n) for n in shape)
        self.dtype = np.dtype(dtype)
        self.key_path = tuple(key_path)
        self.reader = reader
        self.url = url

    @property
    def key(self) -> str:
        """The key path, "/"-joined."""
        return "/".join(str(k) for k in self.key_path)

    def sources(self) -> list[LazyArray]:
        return [self]

    def nbytes_hint(self, region: Region) -> int:
        """Host bytes one read of ``region`` holds (charged to quire's byte budget): the
        reader's ``nbytes_hint(region)`` if it has one, else the region's bytes.

        Parameters
        ----------
        region : tuple of slice
            As for :meth:`RegionReader.read_region`.
        """
        hint = getattr(self.reader, "nbytes_hint", None)
        if hint is not None:
            return int(hint(region))
        return math.prod(region_shape(region)) * self.dtype.itemsize

    def _read(self, region: Region) -> Coroutine[Any, Any, np.ndarray]:
        return self.reader.read_region(region)

    def blocking(self, region: Region) -> Callable[[], np.ndarray] | None:
        """The reader's blocking read of ``region`` (see :class:`RegionReader`), or None.

        Parameters
        ----------
        region : tuple of slice
            The region of this array to read, one ``slice`` per dimension.

        Returns
        -------
        callable or None
            A function that reads the region when called in a worker thread, or None when
            the reader has no blocking path for it (then :meth:`read_region` is used).
        """
        fn = getattr(self.reader, "blocking", None)
        return fn(region) if fn is not None else None

    async def read_region(self, region: Region) -> np.ndarray:
        out = await super().read_region(region)
        if out.dtype != self.dtype:
            out = out.view(self.dtype) if out.dtype.itemsize == self.dtype.itemsize else out
        return out

    def __repr__(self) -> str:
        return f"LazyArray({self.key!r}, shape={self.shape}, dtype={self.dtype}, url={self.url!r})"


# ----------------------------------------------------------------------------- operation nodes
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
    """``np.transpose(x, axes)``; ``axes`` None reverses them."""

    def __init__(self, x: LazyValue, axes: Sequence[int] | None) -> None:
        n = x.ndim
        ax = tuple(reversed(range(n))) if axes is None else tuple(_axis(a, n) for a in axes)
        if sorted(ax) != list(range(n)):
            raise ValueError(f"transpose: {axes} is not a permutation of {n} axes")
        self.x, self.axes = x, ax
        self.shape = tuple(x.shape[a] for a in ax)
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
    """A C-order reshape (one ``-1`` allowed); reads the input rows the output rows need."""

    def __init__(self, x: LazyValue, shape: Sequence[int]) -> None:
        shp = [int(n) for n in shape]
        if shp.count(-1) > 1:
            raise ValueError("reshape: only one -1 allowed")
        if -1 in shp:
            rest = math.prod(n for n in shp if n != -1)
            shp[shp.index(-1)] = x.size // rest if rest else 0
        if math.prod(shp) != x.size:
            raise ValueError(f"reshape: cannot reshape {x.shape} into {tuple(shape)}")
        self.x, self.shape, self.dtype = x, tuple(shp), x.dtype

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
    """A cast when read; ``dtype`` may be an ``ml_dtypes`` name such as ``"bfloat16"``."""

    def __init__(self, x: LazyValue, dtype: Any) -> None:
        self.x, self.shape = x, x.shape
        self.dtype = dtype_from_name(dtype) if isinstance(dtype, str) else np.dtype(dtype)

    def sources(self) -> list[LazyArray]:
        return self.x.sources()

    async def _read(self, region: Region) -> np.ndarray:
        return (await self.x.read_region(region)).astype(self.dtype)
