""":class:`ObjectStoreBackend`: what every HTTP object-store backend shares.

Published as :class:`quire.backends.ObjectStoreBackend`; quire-s3 and quire-gcs are built
on it, and so can a third-party backend for another store.  A subclass makes single,
un-retried requests; this base adds the rest (see the class docstring for the hooks and
their call order).  It is composed of parts it holds, each owning its state: its client on
the running loop (``clients.BackendClient``), its error messages (``request_errors``) and
its uploads (``uploads``).
"""

from __future__ import annotations

import asyncio
import builtins
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, ClassVar, TypeVar

from quire._runtime.budget import ByteBudget
from quire._runtime.config import current
from quire._store import listing
from quire._store.base import Buffer, PreconditionFailed
from quire._store.buffers import flat_views, read_spans
from quire._store.clients import AttemptTimeout, BackendClient, ClientCache, bounded
from quire._store.endpoints import (
    name_resolution_error,
    resolution_retryable,
    strip_endpoint_credentials,
)
from quire._store.object_hooks import MiB, ObjectInfo, ObjectStoreHooks
from quire._store.request_errors import ErrorTypes, RequestErrors
from quire._store.retries import RetriesExhausted, RetryPolicy, retrying
from quire._store.uploads import Uploads

T = TypeVar("T")


class ObjectStoreBackend(ObjectStoreHooks):
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
      :meth:`configure` returned (:attr:`client_options`);
    * :meth:`stat`: an object's size, version and age, or None (retried);
    * :meth:`read_range` / :meth:`read_range_into`: one ranged read;
    * :meth:`list_page`: one page of a listing of names under a name prefix;
    * :meth:`put_small` / :meth:`put_large`: uploads below / from ``large_threshold``;
    * :meth:`is_transient`, :meth:`describe`, :meth:`map_error`: error classification;
    * :meth:`endpoint`: the endpoint named in errors;
    * :meth:`connections_in_use`: a client's checked-out connections (for test suites).

    Subclasses set ``scheme``, the error classes (``error``, ``permission_error``,
    ``bucket_error``, ``endpoint_error``, each a subclass of the ``quire.errors``
    type of the same role), ``secret_options`` and ``log``; ``max_requests`` and
    ``large_threshold`` may be set in :meth:`configure`.

    Call order (what this base calls on the hooks, and when)::

        __init__          secret_values(options) ; configure(options) -> client_options
        first request     new_client(client_options)   # once per option set, on quire's loop
        every request     run(op, key, attempt): attempt(n) in a request slot, under
                          request_deadline(nbytes); on failure is_transient(e)? retry
                          with backoff : map_error(e, op, key, missing); describe(e) in
                          logs and messages, endpoint() when the host does not resolve
        size, exists,     stat(key)
          version, modified
        get, get_into     read_range / read_range_into, one per read_part_size span
        list, list_dir    list_page(prefix, token, ...) until the last page
        put               put_small (its bytes held in the budget), or from
                          large_threshold put_large -> upload_parts(send): each part
                          held in the budget while in flight
        put_if_absent,    (the subclass's) conditional_put(op, key, data, write, lost):
          replace_if_match    write(data) with the store's precondition  <-- COMMIT;
                          a lost precondition asks holds(key, data) whether an earlier
                          attempt of this write made it
        close             close_client(client) for a private client; shared ones at exit

    Attributes
    ----------
    bucket, root : str
        The bucket, and the object-name prefix of the checkpoint root in it.
    client_options : dict
        What :meth:`configure` returned: the options the client is made from.
    """

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
        secrets = self.secret_values(opts) + found
        self.client_options = self.configure(opts)
        token = repr(sorted(self.client_options.items(), key=lambda kv: kv[0]))
        # The parts, each owning its state.
        self._clients = BackendClient(
            self._client_cache, self.client_options, token, self.max_requests, self.upload_budget
        )
        types = ErrorTypes(
            self.error, self.permission_error, self.bucket_error, self.endpoint_error
        )
        self._errors = RequestErrors(self, types, self.bucket, secrets, self.retry.deadline)
        self._uploads = Uploads(lambda: self._clients.budget, self.run, self.holds, self.where)

    # -- clients ------------------------------------------------------------------------
    @classmethod
    def checked_out_connections(cls) -> builtins.list[str]:
        """One line per shared client of this class and its subclasses that has
        connections checked out (:meth:`connections_in_use`).  Between operations there
        should be none: a reply never released keeps its connection for good.  Test
        suites check it after each test.
        """
        out = []
        todo: builtins.list[type[ObjectStoreBackend]] = [cls]
        while todo:
            klass = todo.pop()
            todo += klass.__subclasses__()
            cache = vars(klass).get("_client_cache")
            for token, n in cache.in_use(klass.connections_in_use) if cache else ():
                out.append(
                    f"{klass.__name__} client {token[:60]}...: {n} connection(s) checked out"
                )
        return out

    @property
    def client(self) -> Any:
        """This backend's client on the running event loop (made on first use)."""
        return self._clients.client

    @property
    def existing_client(self) -> Any:
        """The client made on the event loop this backend last ran on, or None before its
        first request (makes none: for messages, such as :meth:`endpoint`'s)."""
        return self._clients.existing

    @property
    def budget(self) -> ByteBudget:
        """The byte budget uploads hold on the running event loop."""
        return self._clients.budget

    async def close(self) -> None:
        await self._clients.close()

    # -- names and errors ---------------------------------------------------------------
    def key(self, key: str) -> str:
        """The object name of ``key`` (relative to the checkpoint root) in the bucket.

        Parameters
        ----------
        key : str
            An object key, relative to the checkpoint root.
        """
        return f"{self.root}/{key}" if self.root else key

    def where(self, key: str | None) -> str:
        """``scheme://bucket/object`` of ``key`` (the bucket alone for None), for messages.

        Parameters
        ----------
        key : str or None
            The object key concerned (None: the bucket).
        """
        return f"{self.scheme}://{self.bucket}" + (f"/{self.key(key)}" if key is not None else "")

    def redact(self, text: str) -> str:
        """``text`` with every credential this backend was given replaced by ``***``.

        Parameters
        ----------
        text : str
            A message or log line.
        """
        return self._errors.redact(text)

    def denied(self, e: BaseException, op: str, key: str | None, fix: str) -> Exception:
        """The ``permission_error`` for a refused request (for :meth:`map_error`).

        Parameters
        ----------
        e : BaseException
            The failure a request raised.
        op : str
            What was attempted (``"get"``, ``"put"``...), for the message.
        key : str or None
            The object key concerned (None: the bucket).
        fix : str
            Where the credentials come from, for the message.
        """
        return self._errors.denied(e, op, key, fix)

    def no_bucket(self, op: str, key: str | None) -> Exception:
        """The ``bucket_error`` for a bucket that does not exist (for :meth:`map_error`).

        Parameters
        ----------
        op, key
            As for :meth:`denied`.
        """
        return self._errors.no_bucket(op, key)

    def failed(self, e: BaseException, op: str, key: str | None) -> Exception:
        """The ``error`` for any other permanent failure (for :meth:`map_error`).

        Parameters
        ----------
        e, op, key
            As for :meth:`denied`.
        """
        return self._errors.failed(e, op, key)

    # -- requests ------------------------------------------------------------------------
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
                return resolution_retryable(dns, loop.time() - start)
            return isinstance(e, AttemptTimeout) or self.is_transient(e)

        limit, slots = self.request_deadline(nbytes), self._clients.slots

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
            err = self._errors.final(e, op, key, missing)
            if err is e:
                raise
            raise err from (e.last if isinstance(e, RetriesExhausted) else e)

    # -- reads ---------------------------------------------------------------------------
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
    async def put(self, key: str, data: Sequence[Buffer]) -> None:
        views = flat_views(data)
        total = sum(v.nbytes for v in views)
        if total >= self.large_threshold:
            await self.put_large(key, views, total)
            return
        async with self.budget.hold(total):
            await self.put_small(key, views, total)

    async def upload_parts(
        self,
        views: builtins.list[memoryview],
        total: int,
        part_size: int,
        send: Callable[[int, builtins.list[memoryview]], Awaitable[T]],
    ) -> builtins.list[T]:
        """Send ``views`` as concurrent parts of ``part_size`` bytes, each held in the
        budget while in flight: ``send(number, part_views)`` for numbers 1, 2, ...

        Parameters
        ----------
        views, total, part_size : list of memoryview, int, int
            The object's bytes in order, their total size, and bytes per part (the last
            may be shorter).
        send : callable
            ``await send(number, part_views)`` uploads one part (numbered from 1) and
            returns its receipt.

        Returns
        -------
        list
            What each ``send`` returned, in part order.  On the first failure the other
            parts are cancelled and that failure is raised.
        """
        return await self._uploads.parts(views, total, part_size, send)

    async def conditional_put(
        self,
        op: str,
        key: str,
        data: bytes,
        write: Callable[[bytes], Awaitable[str]],
        lost: Callable[[BaseException], bool],
        what: str,
        missing: str = "object",
    ) -> str:
        """A retried conditional write (the commit); the new version.

        Parameters
        ----------
        op, key : str
            The operation's name and the key written.
        data : bytes
            The object's bytes.
        write : callable
            ``write(data)`` makes one conditional request and returns the new version.
        lost : callable
            ``lost(e)``: whether ``e`` says the precondition failed.
        what : str
            The message of :class:`PreconditionFailed` after ``where(key)``
            (``"exists"``, ``"changed or vanished ..."``).
        missing : str
            What a "not found" reply means (see :meth:`map_error`).

        Raises
        ------
        PreconditionFailed
            The precondition failed and ``key`` does not hold ``data``.
        """
        return await self._uploads.conditional(op, key, data, write, lost, what, missing)
