"""What an object-store backend implements: :class:`ObjectStoreHooks`, the contract of
:class:`quire.backends.ObjectStoreBackend`'s subclasses, and :class:`ObjectInfo`, what
:meth:`~ObjectStoreHooks.stat` returns.

The hooks make one request each and never retry; ``ObjectStoreBackend`` (``object_backend``)
builds the :class:`~quire.backends.Backend` methods on them, with its parts.  This module
imports nothing of that implementation.
"""

from __future__ import annotations

import abc
import asyncio
import builtins
import importlib
import logging
from dataclasses import dataclass
from typing import Any, ClassVar

from quire._store.base import Backend, Capabilities
from quire.errors import (
    BucketNotFoundError,
    EndpointUnreachableError,
    ObjectStoreError,
    ObjectStorePermissionError,
)

MiB = 1 << 20


@dataclass(frozen=True)
class ObjectInfo:
    """What :meth:`quire.backends.ObjectStoreBackend.stat` says about an object.

    Attributes
    ----------
    size : int
        Its size in bytes.
    version : str
        The token :meth:`Backend.version` returns (ETag, generation).
    modified : float or None
        Last modification, POSIX seconds (None when the store does not say).
    """

    size: int
    version: str
    modified: float | None = None


class ObjectStoreHooks(Backend):
    """The hooks and settings a subclass of :class:`quire.backends.ObjectStoreBackend`
    provides: requests that each make one call to the store, error classification, its
    client's making and closing; see ``ObjectStoreBackend`` for their call order.
    """

    scheme: ClassVar[str] = "objstore"
    #: What every object store gives (a subclass adds the conditional writes and streaming
    #: it implements, e.g. ``dataclasses.replace(ObjectStoreBackend.capabilities, ...)``).
    capabilities: ClassVar[Capabilities] = Capabilities(durable=True, readinto=True)
    log: ClassVar[logging.Logger] = logging.getLogger("quire.objstore")
    error: ClassVar[type[ObjectStoreError]] = ObjectStoreError
    permission_error: ClassVar[type[ObjectStoreError]] = ObjectStorePermissionError
    bucket_error: ClassVar[type[ObjectStoreError]] = BucketNotFoundError
    endpoint_error: ClassVar[type[ObjectStoreError]] = EndpointUnreachableError
    #: Option names (top level or in ``client_kwargs``) whose string values are secrets.
    secret_options: ClassVar[tuple[str, ...]] = ("key", "secret", "token", "password")
    #: Values of those options that are modes, not secrets (e.g. ``token="anon"``).
    not_secret: ClassVar[frozenset[str]] = frozenset()
    #: ``module.Class`` of the fsspec file system :meth:`new_client` builds.
    fsspec_class: ClassVar[str] = ""
    #: Uploads of at least this many bytes go through :meth:`put_large`.
    large_threshold: int = 64 * MiB
    #: Requests one client may have in flight (keep it at most its connection pool's size:
    #: a request waits for a slot before its deadline starts).
    max_requests: int = 64

    # -- configuration and clients ---------------------------------------------------
    def configure(self, options: dict[str, Any]) -> dict[str, Any]:
        """Read (pop) this backend's own storage options; return the client's options.

        Parameters
        ----------
        options : dict
            The storage options left after the base class took its own keys.

        Returns
        -------
        dict
            Options handed to :meth:`new_client` (and identifying the shared client).
        """
        return options

    def secret_values(self, options: dict[str, Any]) -> builtins.list[str]:
        """Strings in ``options`` that must never appear in messages or logs.

        Parameters
        ----------
        options : dict
            The storage options left after the base class took its own keys (before
            :meth:`configure`).
        """
        ck = options.get("client_kwargs") or {}
        found = [options.get(k) for k in self.secret_options]
        found += [ck.get(k) for k in self.secret_options] if isinstance(ck, dict) else []
        return [s for s in found if isinstance(s, str) and len(s) >= 4 and s not in self.not_secret]

    @classmethod
    def new_client(cls, options: dict[str, Any]) -> Any:
        """A new client for ``options`` on the running loop.

        The default builds the fsspec ``AsyncFileSystem`` named by ``fsspec_class``
        (``"s3fs.S3FileSystem"``), asynchronous, on the running loop, outside fsspec's
        instance cache; its settings (credentials, endpoint, fsspec config files) are
        then what requests use.

        Parameters
        ----------
        options : dict
            The client's options (what :meth:`configure` returned).
        """
        module, _, name = cls.fsspec_class.rpartition(".")
        fs_class = getattr(importlib.import_module(module), name)
        return fs_class(
            asynchronous=True, loop=asyncio.get_running_loop(), skip_instance_cache=True, **options
        )

    @staticmethod
    @abc.abstractmethod
    async def close_client(client: Any) -> None:
        """Close a client made by :meth:`new_client`.

        Parameters
        ----------
        client : Any
            The client to close.
        """

    @staticmethod
    def connections_in_use(client: Any) -> int:
        """How many of ``client``'s pooled connections are checked out now (by a request
        in flight, or a reply not read to its end); 0 when the backend cannot tell (the
        default).  Read by :meth:`checked_out_connections`.

        Parameters
        ----------
        client : Any
            A client made by :meth:`new_client`.
        """
        return 0

    # -- errors -----------------------------------------------------------------------
    def endpoint(self) -> str | None:
        """The endpoint URL requests go to, for messages (None when unknown)."""
        return None

    def is_transient(self, e: BaseException) -> bool:
        """Whether a failed request may succeed when repeated (5xx, throttling, resets).

        Parameters
        ----------
        e : BaseException
            The failure a request raised.
        """
        return isinstance(e, asyncio.TimeoutError | ConnectionError)

    def describe(self, e: BaseException) -> str:
        """A one-line account of a failed request (redacted by the caller).

        Parameters
        ----------
        e : BaseException
            The failure a request raised.
        """
        return f"{type(e).__name__}: {e}"

    def map_error(self, e: Exception, op: str, key: str | None, missing: str) -> Exception | None:
        """The error to raise for a permanent failure ``e``, or None to keep ``e``.

        Parameters
        ----------
        e : Exception
            What the request raised (not transient, or not retried).
        op : str
            The operation, for the message.
        key : str or None
            The key it was about (None for bucket-wide calls).
        missing : str
            What a "not found" reply means here: ``"object"`` or ``"bucket"``.
        """
        return None

    # -- requests ---------------------------------------------------------------------
    @abc.abstractmethod
    async def stat(self, key: str) -> ObjectInfo | None:
        """``key``'s :class:`ObjectInfo`, or None when it does not exist (retried through
        :meth:`run`).

        Parameters
        ----------
        key : str
            An object key, relative to the checkpoint root.
        """

    @abc.abstractmethod
    async def read_range(self, key: str, start: int, end: int | None) -> bytes:
        """One request for bytes ``[start, end)`` of ``key`` (to its end for None).

        A range past the end of the object gives ``b""``; a missing object raises what
        :meth:`map_error` turns into ``FileNotFoundError``.

        Parameters
        ----------
        key, start, end : str, int, int or None
            The object key and the byte range ``[start, end)`` (None: to the object's end).
        """

    @abc.abstractmethod
    async def read_range_into(
        self, key: str, start: int, views: builtins.list[memoryview], length: int
    ) -> int:
        """One request for ``length`` bytes of ``key`` from ``start``, streamed into
        ``views`` (see :func:`quire.backends.read_into`); the byte count.

        Parameters
        ----------
        key, start, views, length : str, int, list of memoryview, int
            The object key, the first byte, writable buffers (filled in order) and how
            many bytes to read.
        """

    @abc.abstractmethod
    async def list_page(
        self, prefix: str, token: str | None, limit: int | None, delimiter: str | None
    ) -> tuple[builtins.list[str], builtins.list[str], str | None]:
        """One page of a listing (retried through :meth:`run`): object names starting
        with ``prefix``, common prefixes (with a ``delimiter``) and the next page's token
        (None on the last page).  ``token`` is None for the first page; ``limit``, when
        given, caps the page size.

        Parameters
        ----------
        prefix, token, limit, delimiter : str, Any, int or None, str or None
            The object-name prefix, the previous page's continuation token (None: the
            first page), the most names to ask for, and a separator to group names by.
        """

    @abc.abstractmethod
    async def put_small(self, key: str, views: builtins.list[memoryview], total: int) -> None:
        """Upload an object below ``large_threshold`` (retrying through :meth:`run`);
        the bytes are already held in the budget.

        Parameters
        ----------
        key, views, total : str, list of memoryview, int
            The object key, its bytes in order, and their total size.
        """

    @abc.abstractmethod
    async def put_large(self, key: str, views: builtins.list[memoryview], total: int) -> None:
        """Upload an object of ``large_threshold`` bytes or more in parts (multipart,
        resumable), each part held in :attr:`budget` while in flight (see
        :meth:`upload_parts`).

        Parameters
        ----------
        key, views, total : str, list of memoryview, int
            The object key, its bytes in order, and their total size.
        """

    async def holds(self, key: str, data: bytes) -> str | None:
        """The version of ``key`` if it holds exactly ``data``, else None.

        Used after a conditional write lost: an earlier attempt of the same write (whose
        reply was lost) may have made it.  The default compares :meth:`get` with
        ``data`` and reads :meth:`version`; override it where one request gives both.

        Parameters
        ----------
        key, data : str, bytes
            The object key and the bytes the caller wrote.
        """
        try:
            got = await self.get(key)
        except FileNotFoundError:
            return None
        return await self.version(key) if got == data else None
