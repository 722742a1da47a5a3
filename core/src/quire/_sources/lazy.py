"""Lazy arrays: a shape, a dtype and a reader of regions; nothing is read until asked.

Every lazy value is a :class:`LazyArray`: a source's array (:class:`SourceArray`), a view of
one, or an operation node (constants, stacks, transposes, reshapes, casts).  Each answers
:meth:`LazyArray.read_region` for any step-1 region by reading only the parts of its inputs it
needs.  :meth:`LazyArray.read` runs the materialiser that :mod:`quire._sources.materialize` (above this
module) installs at its import (:func:`install_materializer`).
"""

from __future__ import annotations

import asyncio
import math
import operator
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from quire._format.dtypes import dtype_from_name
from quire._runtime import ioloop as _io

if TYPE_CHECKING:
    from collections.abc import Callable, Coroutine

Region = tuple[slice, ...]


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


# The materialiser behind LazyArray.read: ``fn(value, dtype, sharding)``, a coroutine reading
# ``value`` whole.  quire._sources.materialize installs it at import, and ``import quire`` imports that.
_materialize: Callable[[LazyArray, Any, Any], Coroutine[Any, Any, Any]] | None = None


def install_materializer(fn: Callable[[LazyArray, Any, Any], Coroutine[Any, Any, Any]]) -> None:
    """Set the coroutine function that :meth:`LazyArray.read` runs on quire's event loop."""
    global _materialize
    _materialize = fn


def _axis(axis: int, ndim: int) -> int:
    if not -ndim <= axis < ndim:
        raise ValueError(f"axis {axis} is out of bounds for {ndim} dimensions")
    return axis % ndim


class LazyArray:
    """An array not yet read: a source's array, a view of one, or a lazy operation on them.

    Slicing (``x[a:b, :, i]``, ``x[..., 0]``; ints, step-1 slices and Ellipsis, not bools)
    gives a lazy view reading only what it covers; ``.T``, :meth:`astype`, :meth:`reshape` and
    the operations of :mod:`quire.surgery` give lazy arrays too; :meth:`read` reads.

    ``LazyArray(shape, dtype, key_path, reader, url)`` makes a source's array (a
    :class:`SourceArray`, the only kind with a key path, URL and reader).

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

    shape: tuple[int, ...]
    dtype: np.dtype[Any]

    def __new__(cls, *args: Any, **kwargs: Any) -> LazyArray:
        # As pathlib.Path makes a PosixPath: the constructor sources call gives the leaf kind.
        return object.__new__(SourceArray if cls is LazyArray else cls)

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

    def sources(self) -> list[SourceArray]:
        """The source arrays this value reads from (for error messages and accounting)."""
        return []

    def blocking(self, region: Region) -> Callable[[], np.ndarray] | None:
        """A function that reads ``region`` when called in a worker thread, or None (here
        always; a source array whose reader has one gives it): then :meth:`read_region` is used.

        Parameters
        ----------
        region : tuple of slice
            The region of this array to read, one ``slice`` per dimension.
        """
        return None

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
            raise RuntimeError(
                "quire._sources.materialize is not imported (import quire.sources first)"
            )
        return _io.submit(_materialize(self, dtype, sharding)).result()

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        return np.asarray(self.read(dtype))

    def __getitem__(self, index: Any) -> LazyArray:
        return _index(self, index)

    @property
    def T(self) -> LazyArray:
        """The lazy transpose (:func:`quire.surgery.transpose`)."""
        return _Transpose(self, None)

    def astype(self, dtype: Any) -> LazyArray:
        """A lazy cast (:func:`quire.surgery.astype`).

        Parameters
        ----------
        dtype : numpy dtype or str
            The dtype to cast to when read (``ml_dtypes`` names such as ``"bfloat16"`` work).
        """
        return _AsType(self, dtype)

    def reshape(self, *shape: Any) -> LazyArray:
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

    _op = ""  # an operation node's repr is the call that builds it: op(*_args)
    _args: tuple[Any, ...] = ()

    def __repr__(self) -> str:
        args = ", ".join(map(repr, self._args)) or f"shape={self.shape}, dtype={self.dtype}"
        return f"{self._op or type(self).__name__[1:].lower()}({args})"


#: The former name of :class:`LazyArray`'s base, kept: every lazy value is a LazyArray.
LazyValue = LazyArray


class SourceArray(LazyArray):
    """One array of a :class:`quire.sources.Source`, read by its :class:`RegionReader`; made by
    ``LazyArray(shape, dtype, key_path, reader, url)`` (see :class:`LazyArray`)."""

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
        self.key_path, self.reader, self.url = tuple(key_path), reader, url

    @property
    def key(self) -> str:
        """The key path, "/"-joined."""
        return "/".join(str(k) for k in self.key_path)

    def sources(self) -> list[SourceArray]:
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
        """The reader's blocking read of ``region`` (see :class:`RegionReader`), or None."""
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
class _Const(LazyArray):
    """A concrete array taking part in a lazy operation."""

    def __init__(self, value: Any) -> None:
        self.value = np.asarray(value)
        self.shape, self.dtype = self.value.shape, self.value.dtype

    async def _read(self, region: Region) -> np.ndarray:
        return np.array(self.value[region or ...], order="C")


def as_lazy(x: Any) -> LazyArray:
    """``x`` itself if lazy, else a constant node around ``np.asarray(x)``."""
    return x if isinstance(x, LazyArray) else _Const(x)


class _View(LazyArray):
    """``base[region]`` with the integer-indexed axes dropped."""

    def __init__(self, base: LazyArray, region: Region, keep: tuple[bool, ...]) -> None:
        self.base, self.region, self.keep = base, region, keep
        self.shape = tuple(s.stop - s.start for s, k in zip(region, keep) if k)
        self.dtype = base.dtype

    def sources(self) -> list[SourceArray]:
        return self.base.sources()

    def _to_base(self, region: Region, keep: Sequence[bool]) -> tuple[Region, tuple[bool, ...]]:
        """``region`` and ``keep`` (one per axis of this view) in the base's coordinates."""
        it = iter(zip(region, keep))
        out, kept = [], []
        for s, k in zip(self.region, self.keep):
            r, kk = next(it) if k else (slice(0, 1), False)
            out.append(slice(s.start + r.start, s.start + r.stop))
            kept.append(kk)
        return tuple(out), tuple(kept)

    async def _read(self, region: Region) -> np.ndarray:
        sub, _ = self._to_base(region, [True] * len(region))
        return (await self.base.read_region(sub)).reshape(region_shape(region))

    def __repr__(self) -> str:
        idx = (f"{s.start}:{s.stop}" if k else str(s.start) for s, k in zip(self.region, self.keep))
        return f"{self.base!r}[{', '.join(idx)}]"


def _index(x: LazyArray, index: Any) -> LazyArray:
    idx = index if isinstance(index, tuple) else (index,)
    ell = [j for j, i in enumerate(idx) if i is Ellipsis]
    if len(ell) > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    if ell:
        idx = idx[: ell[0]] + (slice(None),) * (x.ndim - len(idx) + 1) + idx[ell[0] + 1 :]
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
                j = operator.index(np.asarray(i) if isinstance(i, bool) else i)  # bool: a mask
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
        return _View(x.base, *x._to_base(tuple(region), keep))
    return _View(x, tuple(region), tuple(keep))


class _Stack(LazyArray):
    """``np.stack`` (``concat`` False) or ``np.concatenate`` of ``xs`` along ``axis``."""

    def __init__(self, xs: Sequence[LazyArray], axis: int, concat: bool) -> None:
        self.xs, self.axis, self.concat = list(xs), axis, concat
        self._op, self._args = ("concatenate" if concat else "stack"), (self.xs, axis)
        self.dtype = np.result_type(*(x.dtype for x in xs))
        s = list(xs[0].shape)
        if concat:
            self.offsets = [0]
            for x in xs:
                self.offsets.append(self.offsets[-1] + x.shape[axis])
            s[axis] = self.offsets[-1]
        else:
            s.insert(axis, len(xs))
        self.shape = tuple(s)

    def sources(self) -> list[SourceArray]:
        return [s for x in self.xs for s in x.sources()]

    async def _read(self, region: Region) -> np.ndarray:
        ax, r = self.axis, region[self.axis]
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


class _Transpose(LazyArray):
    """``np.transpose(x, axes)``; ``axes`` None reverses them."""

    def __init__(self, x: LazyArray, axes: Sequence[int] | None) -> None:
        n = x.ndim
        ax = tuple(reversed(range(n))) if axes is None else tuple(_axis(a, n) for a in axes)
        if sorted(ax) != list(range(n)):
            raise ValueError(f"transpose: {axes} is not a permutation of {n} axes")
        self.x, self.axes, self._args = x, ax, (x, ax)
        self.shape = tuple(x.shape[a] for a in ax)
        self.dtype = x.dtype

    def sources(self) -> list[SourceArray]:
        return self.x.sources()

    async def _read(self, region: Region) -> np.ndarray:
        src: list[slice] = [slice(0, 0)] * len(self.axes)
        for out_ax, in_ax in enumerate(self.axes):
            src[in_ax] = region[out_ax]
        a = await self.x.read_region(tuple(src))
        return np.array(np.transpose(a, self.axes), order="C")


class _Reshape(LazyArray):
    """A C-order reshape (one ``-1`` allowed); reads the input rows the output rows need."""

    def __init__(self, x: LazyArray, shape: Sequence[int]) -> None:
        shp = [int(n) for n in shape]
        if shp.count(-1) > 1:
            raise ValueError("reshape: only one -1 allowed")
        if -1 in shp:
            rest = math.prod(n for n in shp if n != -1)
            shp[shp.index(-1)] = x.size // rest if rest else 0
        if math.prod(shp) != x.size:
            raise ValueError(f"reshape: cannot reshape {x.shape} into {tuple(shape)}")
        self.x, self.shape, self.dtype = x, tuple(shp), x.dtype
        self._args = (x, self.shape)

    def sources(self) -> list[SourceArray]:
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


class _AsType(LazyArray):
    """A cast when read; ``dtype`` may be an ``ml_dtypes`` name such as ``"bfloat16"``."""

    def __init__(self, x: LazyArray, dtype: Any) -> None:
        self.x, self.shape = x, x.shape
        self.dtype = dtype_from_name(dtype) if isinstance(dtype, str) else np.dtype(dtype)
        self._args = (x, self.dtype.name)

    def sources(self) -> list[SourceArray]:
        return self.x.sources()

    async def _read(self, region: Region) -> np.ndarray:
        return (await self.x.read_region(region)).astype(self.dtype)
