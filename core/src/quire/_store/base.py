"""The storage backend contract: :class:`Backend`, :class:`Capabilities`, :data:`Buffer`,
:class:`PreconditionFailed`, :data:`QUIRE_STORAGE_OPTIONS`.  Published, with the call order
of a save (commit point marked) and the object-store toolkit, by :mod:`quire.backends`; this
module imports nothing of quire."""

from __future__ import annotations

import abc
import builtins
import errno
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

Buffer = bytes | bytearray | memoryview

#: Storage-option keys that quire's object-store backends consume themselves (retries, part
#: sizes); fsspec file systems do not take them, so code handing a user's storage options to
#: fsspec (an export, a source plugin) drops these first.
QUIRE_STORAGE_OPTIONS = frozenset(
    {
        "retry_deadline",
        "retry_backoff",
        "retry_max_backoff",
        "upload_budget",
        "multipart_threshold",
        "multipart_chunksize",
        "read_part_size",
        "request_timeout",
        "request_min_rate",
    }
)


class PreconditionFailed(Exception):
    """A conditional write lost: the object exists (create) or changed (replace)."""


# What a read of a key that holds no data object raises (errno): a directory, a file where
# a directory should be, a symbolic link or a FIFO / socket / device (refused by the local
# backend), a name too long.  The object is not what the reader needs: damage, not a
# transient failure.
NOT_DATA = frozenset({errno.EISDIR, errno.ENOTDIR, errno.ELOOP, errno.ENXIO, errno.ENAMETOOLONG})


@dataclass(frozen=True)
class Capabilities:
    """What a backend guarantees.

    Attributes
    ----------
    atomic_create : bool
        ``put_if_absent`` is a real conditional create (O_EXCL, If-None-Match, ...).
    atomic_replace : bool
        ``replace_if_match`` is a real compare-and-swap.
    durable : bool
        Data acknowledged by ``sync`` survives a crash of the machine.
    rename : bool
        The store can rename objects cheaply (local file systems).
    readinto : bool
        ``get_into`` reads straight into caller memory without an intermediate copy.
    stream_writes : bool
        ``stream_writer`` writes one object from concurrent writes at given offsets
        (format-v2 packs stream into it: local files written in place, S3 multipart).
    directories : bool
        The store has directories of its own (a local file system): a prefix can exist with
        no key under it (a writer killed between creating a folder and its first file
        leaves one); :meth:`Backend.list_dir` names it, :meth:`Backend.modified` gives its
        time and :meth:`Backend.delete_prefix` removes it.  Object stores have none.
    """

    atomic_create: bool = False
    atomic_replace: bool = False
    durable: bool = False
    rename: bool = False
    readinto: bool = False
    stream_writes: bool = False
    directories: bool = False


class Backend(abc.ABC):
    """Byte storage under one checkpoint root URL.

    Parameters
    ----------
    url : str
        The checkpoint root URL (``/path``, ``file:///path``, ``memory://x``, ``s3://b/k``...).
    storage_options : dict, optional
        fsspec-style options for the underlying file system.
    """

    capabilities: ClassVar[Capabilities] = Capabilities()

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.url = url
        self.storage_options = dict(storage_options or {})

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    # -- reads -------------------------------------------------------------------
    @abc.abstractmethod
    async def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        """Bytes of ``key`` (``[start, end)`` when given). ``FileNotFoundError`` if absent.

        Parameters
        ----------
        key : str
            An object key, relative to the root (``/``-separated).
        start, end : int, optional
            The byte range ``[start, end)`` (default: all).
        """

    async def get_into(self, key: str, buffers: Sequence[memoryview], offset: int = 0) -> int:
        """Fill ``buffers`` in order with the bytes of ``key`` from ``offset``; return the count.

        The default reads a range and copies; backends with ``readinto`` override it.

        Parameters
        ----------
        key : str
            An object key, relative to the root (``/``-separated).
        buffers : sequence of memoryview
            Writable buffers, filled in order.
        offset : int
            The byte of ``key`` to start at.
        """
        total = sum(b.nbytes for b in buffers)
        data = await self.get(key, offset, offset + total)
        pos = 0
        for b in buffers:
            n = min(b.nbytes, len(data) - pos)
            if n <= 0:
                break
            b.cast("B")[:n] = memoryview(data)[pos : pos + n]
            pos += n
        return pos

    @abc.abstractmethod
    async def size(self, key: str) -> int:
        """Size in bytes of ``key``. ``FileNotFoundError`` if absent.

        Parameters
        ----------
        key : str
            An object key, relative to the root (``/``-separated).
        """

    @abc.abstractmethod
    async def exists(self, key: str) -> bool:
        """Whether ``key`` exists.

        Parameters
        ----------
        key : str
            An object key, relative to the root (``/``-separated).
        """

    async def modified(self, key: str) -> float | None:
        """Last-modification time of ``key`` (POSIX seconds), or None when the store can't say.

        Optional: garbage collection uses it to spare data younger than its grace period
        and treats None as "age unknown" (kept).  ``FileNotFoundError`` if absent.  With
        ``capabilities.directories``, ``key`` may also name a directory.

        Parameters
        ----------
        key : str
            An object key, relative to the root (``/``-separated).
        """
        return None

    @abc.abstractmethod
    async def version(self, key: str) -> str | None:
        """An opaque token that changes whenever ``key`` is replaced; None if absent.

        Parameters
        ----------
        key : str
            An object key, relative to the root (``/``-separated).
        """

    @abc.abstractmethod
    async def list(self, prefix: str = "") -> list[str]:
        """Every key under ``prefix`` (recursive), relative to the root, sorted.

        ``prefix`` is a directory-like path: the result holds ``prefix`` itself if it is a
        key, and every key starting with ``prefix + "/"`` — never ``prefix2/...``.  The
        empty prefix lists everything.

        Parameters
        ----------
        prefix : str
            A directory-like key prefix (empty: the whole root).
        """

    async def list_dir(self, prefix: str = "") -> tuple[builtins.list[str], builtins.list[str]]:
        """Names directly under ``prefix``: ``(keys, sub-prefixes)``, each sorted.

        Like an S3 listing with a ``/`` delimiter.  The default derives it from the
        recursive :meth:`list`; backends that can list one level override it (a
        Checkpointer root with many large steps is then cheap to scan).

        Parameters
        ----------
        prefix : str
            A directory-like key prefix (empty: the whole root).
        """
        base = prefix.rstrip("/")
        start = len(base) + 1 if base else 0
        files: set[str] = set()
        dirs: set[str] = set()
        for k in await self.list(base):
            rest = k[start:]
            head, sep, _ = rest.partition("/")
            (dirs if sep else files).add(head)
        return sorted(files), sorted(dirs)

    # -- writes ------------------------------------------------------------------
    @abc.abstractmethod
    async def put(self, key: str, data: Sequence[Buffer]) -> None:
        """Write the concatenation of ``data`` to ``key``, replacing any object there.

        Parameters
        ----------
        key : str
            An object key, relative to the root (``/``-separated).
        data : sequence of bytes-like
            The pieces of the object, in order.
        """

    @abc.abstractmethod
    async def put_if_absent(self, key: str, data: bytes) -> str:
        """Create ``key`` only if it does not exist; return its version.

        Raises :class:`PreconditionFailed` when it exists.  Must be atomic when
        ``capabilities.atomic_create``.

        Parameters
        ----------
        key : str
            An object key, relative to the root (``/``-separated).
        data : bytes
            The whole object.
        """

    @abc.abstractmethod
    async def replace_if_match(self, key: str, data: bytes, version: str) -> str:
        """Replace ``key`` only if its version is still ``version``; return the new one.

        Raises :class:`PreconditionFailed` when it changed or vanished.

        Parameters
        ----------
        key : str
            An object key, relative to the root (``/``-separated).
        data : bytes
            The whole new object.
        version : str
            The version the caller read (from :meth:`version` or a previous write).
        """

    @abc.abstractmethod
    async def delete(self, keys: Sequence[str]) -> None:
        """Delete ``keys``; missing keys are ignored.

        Parameters
        ----------
        keys : sequence of str
            The keys to delete.
        """

    async def delete_prefix(self, prefix: str) -> None:
        """Delete every key under ``prefix`` (directory-like, as in :meth:`list`); with
        ``capabilities.directories``, the directories left empty there too.

        Parameters
        ----------
        prefix : str
            A directory-like key prefix (empty: the whole root).
        """
        await self.delete(await self.list(prefix))

    async def stream_writer(self, key: str) -> Any:
        """Open ``key`` for streaming (only when ``capabilities.stream_writes``).

        Returns an object with ``async write(data, offset)`` (concurrent calls, each at an
        offset the caller reserved; together they cover ``[0, size)`` without holes),
        ``async close()`` (the object appears whole, as after ``put``) and ``async abort()``
        (nothing, or garbage under the caller's prefix, remains).

        Parameters
        ----------
        key : str
            An object key, relative to the root (``/``-separated).
        """
        raise NotImplementedError(f"{type(self).__name__} does not stream writes")

    async def sync(self) -> None:  # noqa: B027 - optional hook
        """Make every completed ``put`` durable (no-op where puts are durable already)."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources this backend created (never a file system it was handed)."""
