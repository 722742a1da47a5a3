""":class:`ObjectStoreBackend`: what every HTTP object-store backend shares.

Published as :class:`quire.backends.ObjectStoreBackend`; quire-s3 and quire-gcs are built
on it, and so can a third-party backend for another store.  A subclass makes single,
un-retried requests; this base adds the rest (see the class docstring for the hooks).
"""

from __future__ import annotations

import abc
import asyncio
import builtins
import errno
import logging
import socket
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from quire._runtime.budget import ByteBudget
from quire._runtime.config import current
from quire._store import listing
from quire._store.base import Backend, Buffer, Capabilities, PreconditionFailed
from quire._store.buffers import flat_views, read_spans
from quire._store.clients import AttemptTimeout, ClientCache, bounded
from quire._store.endpoints import (
    NO_SUCH_NAME,
    RESOLVE_DEADLINE,
    name_resolution_error,
    strip_endpoint_credentials,
)
from quire._store.request_errors import ErrorMapping
from quire._store.retries import RetriesExhausted, RetryPolicy, retrying
from quire._store.uploads import UploadHelpers

T = TypeVar("T")
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


class ObjectStoreBackend(ErrorMapping, UploadHelpers, Backend):
    """Base class for backends over an object store: one bucket, keys under a prefix.

    It gives every request one retry policy with a deadline (``retry_*`` storage
    options), fails at once on a host name that does not resolve, holds uploads in a
    byte budget, keeps credentials out of messages and logs, shares one client per
    option set on quire's event loop, and implements :meth:`get`, :meth:`get_into`,
    :meth:`list`, :meth:`list_dir`, :meth:`put` and :meth:`close` from a few one-request
    hooks.  The commit methods (``put_if_absent``, ``replace_if_match``) use
    :meth:`conditional_put`.

    Parameters
    ----------
    url : str
        ``scheme://bucket/prefix``.
    storage_options : dict, optional
        Keys read here (and removed before the client sees the rest):
        ``retry_deadline`` (s, 120), ``retry_backoff`` (s, 0.1), ``retry_max_backoff``
        (s, 10), ``upload_budget`` (bytes held by uploads in flight; default
        ``quire.configure``'s ``byte_budget``), ``read_part_size`` (bytes; larger
        reads are split into concurrent ranged requests; 64 MiB), ``request_timeout``
        (s, 60) and ``request_min_rate`` (bytes/s, 1 MiB): each attempt of a request -
        waiting for a connection, sending the body, reading the whole reply - must end
        within ``request_timeout + bytes / request_min_rate`` seconds, else it is
        abandoned and retried like any timeout (so no request waits without a
        deadline, whatever the server or the network does).  An ``endpoint_url``
        (top level or in ``client_kwargs``) carrying ``user:password@`` is stripped of
        it, with a warning: credentials go in the store's own options.

    Notes
    -----
    Hooks a subclass implements (each makes one request and never retries):

    * :meth:`close_client` (and :meth:`new_client`, unless ``fsspec_class`` names the
      fsspec file system to build): make and close a client from the options
      :meth:`configure` returned;
    * :meth:`stat`: an object's size, version and age, or None (retried);
    * :meth:`read_range` / :meth:`read_range_into`: one ranged read;
    * :meth:`list_page`: one page of a listing of names under a name prefix;
    * :meth:`put_small` / :meth:`put_large`: uploads below / from ``large_threshold``;
    * :meth:`is_transient`, :meth:`describe`, :meth:`map_error`: error classification;
    * :meth:`endpoint`: the endpoint named in errors.

    Subclasses set ``scheme``, the error classes (``error``, ``permission_error``,
    ``bucket_error``, ``endpoint_error``, each a subclass of the ``quire.errors``
    type of the same role), ``secret_options`` and ``log``.
    """

    scheme: ClassVar[str] = "objstore"
    #: What every object store gives (a subclass adds the conditional writes and streaming
    #: it implements, e.g. ``dataclasses.replace(ObjectStoreBackend.capabilities, ...)``).
    capabilities: ClassVar[Capabilities] = Capabilities(durable=True, readinto=True)
    log: ClassVar[logging.Logger] = logging.getLogger("quire.objstore")
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
    _client_cache: ClassVar[ClientCache]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # One cache (one shared client per option set on quire's loop) per backend class.
        cls._client_cache = ClientCache(cls.new_client, cls.close_client)

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        super().__init__(url, storage_options)
        self.bucket, self.root = listing.split_bucket_url(url)
        opts = dict(self.storage_options)
        found = strip_endpoint_credentials(opts, f"{self.scheme}://{self.bucket}")
        self.storage_options = dict(opts)  # as callers see it: no credentials in URLs
        self.retry = RetryPolicy.pop_from(opts)
        self.upload_budget = int(opts.pop("upload_budget", current().byte_budget))
        self.read_part_size = max(1, int(opts.pop("read_part_size", 64 * MiB)))
        self.request_timeout = float(opts.pop("request_timeout", 60.0))
        self.request_min_rate = float(opts.pop("request_min_rate", MiB))
        if not (self.request_timeout > 0 and self.request_min_rate > 0):
            raise ValueError(f"{url}: request_timeout and request_min_rate must be positive")
        self._secret_values = self.secret_values(opts) + found
        self._options = self.configure(opts)
        self._token = repr(sorted(self._options.items(), key=lambda kv: kv[0]))
        self._fs: Any = None
        self._slots: asyncio.Semaphore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._private = False
        self._budget: ByteBudget | None = None

    # -- hooks: configuration and clients -----------------------------------------------
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
            The storage options (after :meth:`configure`).
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
            The storage options (after :meth:`configure`).
        """
        import importlib

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

    @property
    def client(self) -> Any:
        """This backend's client on the running event loop (made on first use)."""
        self._bind()
        return self._fs

    @property
    def budget(self) -> ByteBudget:
        """The byte budget uploads hold on the running event loop."""
        self._bind()
        assert self._budget is not None
        return self._budget

    def _bind(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._fs, self._slots, self._private = self._client_cache.get(
                self._options, self._token, self.max_requests
            )
            self._loop = loop
            self._budget = ByteBudget(self.upload_budget)

    def _request_slots(self) -> asyncio.Semaphore:
        self._bind()
        assert self._slots is not None
        return self._slots

    async def close(self) -> None:
        if self._fs is not None:
            await self._client_cache.release(self._fs, self._private)
        self._fs = self._loop = None

    # -- retries -------------------------------------------------------------------------
    def request_deadline(self, nbytes: int = 0) -> float:
        """Seconds one attempt of a request moving ``nbytes`` may take, all of it (pooled
        connection, body sent, whole reply read): ``request_timeout + nbytes /
        request_min_rate``.  :meth:`run` applies it to every attempt; wrap a clean-up
        request made outside :meth:`run` in ``asyncio.timeout`` of it.

        Parameters
        ----------
        nbytes : int
            The bytes the request sends or reads (0 when small or unknown).
        """
        return self.request_timeout + max(0, nbytes) / self.request_min_rate

    async def run(
        self,
        op: str,
        key: str | None,
        attempt: Callable[[int], Awaitable[T]],
        missing: str = "object",
        nbytes: int = 0,
    ) -> T:
        """``await attempt(n)`` with retries; permanent failures become typed errors.

        Each attempt runs under :meth:`request_deadline` of ``nbytes``, or is cancelled and
        counts as a transient failure (a timeout).

        Parameters
        ----------
        op : str
            The operation's name, for log lines and messages.
        key : str or None
            The key it is about (None for bucket-wide calls such as listings).
        attempt : callable
            ``attempt(n)`` makes one request; ``n`` counts earlier attempts (an earlier
            one may have reached the server before its reply was lost).
        missing : str
            What a "not found" reply means (see :meth:`map_error`).
        nbytes : int
            The bytes the request moves (its body or the reply's), for its deadline.

        Raises
        ------
        PreconditionFailed
            As raised by ``attempt``.
        ObjectStoreError
            This backend's subclass of it: transient failures past ``retry_deadline``,
            a host name that does not resolve (``endpoint_error``), or what
            :meth:`map_error` says.
        """
        loop = asyncio.get_running_loop()
        start = loop.time()

        def transient(e: BaseException) -> bool:
            dns = name_resolution_error(e)
            if dns is not None:
                # A name that does not exist stays so; "try again" is retried briefly.
                return dns.errno not in NO_SUCH_NAME and (
                    dns.errno == getattr(socket, "EAI_AGAIN", errno.EAGAIN)
                    and loop.time() - start < RESOLVE_DEADLINE
                )
            return isinstance(e, AttemptTimeout) or self.is_transient(e)

        limit, slots = self.request_deadline(nbytes), self._request_slots()

        def attempt_in_time(n: int) -> Awaitable[T]:
            return bounded(attempt, n, limit, slots)

        def on_retry(n: int, pause: float, e: BaseException) -> None:
            self.log.info(
                "%s: %s failed (%s); retry %d in %.2fs",
                self.where(key),
                op,
                self.redact(self.describe(e)),
                n,
                pause,
            )

        try:
            return await retrying(attempt_in_time, self.retry, transient, on_retry)
        except PreconditionFailed:
            raise
        except Exception as e:
            err = self._fail(e, op, key, missing)
            if err is e:
                raise
            raise err from (e.last if isinstance(e, RetriesExhausted) else e)

    # -- reads ---------------------------------------------------------------------------
    @abc.abstractmethod
    async def stat(self, key: str) -> ObjectInfo | None:
        """``key``'s :class:`ObjectInfo`, or None when it does not exist (retried through
        :meth:`run`).

        Parameters
        ----------
        key : str
            An object key, relative to the checkpoint root.
        """

    async def _info(self, key: str) -> ObjectInfo:
        info = await self.stat(key)
        if info is None:
            raise FileNotFoundError(f"{self.where(key)} does not exist")
        return info

    async def size(self, key: str) -> int:
        return (await self._info(key)).size

    async def exists(self, key: str) -> bool:
        return await self.stat(key) is not None

    async def version(self, key: str) -> str | None:
        info = await self.stat(key)
        return None if info is None else info.version

    async def modified(self, key: str) -> float | None:
        return (await self._info(key)).modified

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

    async def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        s = start or 0
        if end is not None and end <= s:
            await self.size(key)  # FileNotFoundError for a missing key, as for any read
            return b""
        n = 0 if end is None else end - s
        return await self.run("read", key, lambda _n: self.read_range(key, s, end), nbytes=n)

    async def get_into(self, key: str, buffers: Sequence[memoryview], offset: int = 0) -> int:
        views = flat_views(buffers)
        if not sum(v.nbytes for v in views):
            await self.size(key)
            return 0

        async def span(start: int, part: builtins.list[memoryview], length: int) -> int:
            return await self.run(
                "read",
                key,
                lambda _n: self.read_range_into(key, start, part, length),
                nbytes=length,
            )

        return await read_spans(span, views, offset, self.read_part_size)

    # -- listings ------------------------------------------------------------------------
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

    async def listing(
        self, prefix: str, limit: int | None = None, delimiter: str | None = None
    ) -> tuple[builtins.list[str], builtins.list[str]]:
        """Object names starting with ``prefix`` (at least ``limit`` of them when given)
        and, with a ``delimiter``, the common prefixes: every page of :meth:`list_page`.

        Parameters
        ----------
        prefix, limit, delimiter : str, int or None, str or None
            The object-name prefix, a count after which to stop, and a separator to
            group names by (``"/"``).
        """
        names: builtins.list[str] = []
        dirs: dict[str, None] = {}
        token: str | None = None
        while True:
            page, subdirs, token = await self.list_page(prefix, token, limit, delimiter)
            names += page
            # Once each: S3 and GCS page a common prefix once, fake-gcs-server (the tests'
            # GCS) repeats every prefix on each later page.
            dirs.update(dict.fromkeys(subdirs))
            if not token or (limit and len(names) >= limit):
                return names, list(dirs)

    async def list(self, prefix: str = "") -> builtins.list[str]:
        async def names(p: str, limit: int | None) -> builtins.list[str]:
            return (await self.listing(p, limit))[0]

        return await listing.list_under(names, self.root, prefix)

    async def list_dir(self, prefix: str = "") -> tuple[builtins.list[str], builtins.list[str]]:
        under = listing.dir_prefix(self.root, prefix)
        names, dirs = await self.listing(under, delimiter="/")
        return listing.dir_entries(under, names, dirs)

    # -- writes --------------------------------------------------------------------------
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

    async def put(self, key: str, data: Sequence[Buffer]) -> None:
        views = flat_views(data)
        total = sum(v.nbytes for v in views)
        if total >= self.large_threshold:
            await self.put_large(key, views, total)
            return
        async with self.budget.hold(total):
            await self.put_small(key, views, total)
