"""Lazy arrays: a shape, a dtype and a reader of regions; nothing is read until asked.

Every lazy value (a source's :class:`LazyArray`, a view of one, or an operation from
:mod:`quire.surgery`) answers :meth:`LazyValue.read_region` for any step-1 region of its own
coordinates by reading only the parts of its inputs that region needs.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

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
        from quire._materialize import materialize_leaf
        from quire._runtime import ioloop as _io

        return _io.submit(materialize_leaf(self, dtype, sharding)).result()

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out: np.ndarray = self.read(dtype)
        return out

    def __getitem__(self, index: Any) -> LazyValue:
        from quire._lazyops import _index

        return _index(self, index)

    @property
    def T(self) -> LazyValue:
        """The lazy transpose (:func:`quire.surgery.transpose`)."""
        from quire.surgery import transpose

        return transpose(self)

    def astype(self, dtype: Any) -> LazyValue:
        """A lazy cast (:func:`quire.surgery.astype`).

        Parameters
        ----------
        dtype : numpy dtype
            The dtype to cast to when read.
        """
        from quire.surgery import astype

        return astype(self, dtype)

    def reshape(self, *shape: Any) -> LazyValue:
        """A lazy reshape (:func:`quire.surgery.reshape`).

        Parameters
        ----------
        *shape : int or tuple of int
            The new shape, as ints or one tuple (as for ``numpy.reshape``).
        """
        from quire.surgery import reshape

        if len(shape) == 1 and not isinstance(shape[0], int):
            shape = tuple(shape[0])
        return reshape(self, shape)

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
