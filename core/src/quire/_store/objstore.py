"""Machinery shared by the object-store backends (quire-s3, quire-gcs).

* :class:`RetryPolicy` and :func:`retrying`: transient failures retried with jittered
  exponential backoff until a deadline;
* buffer helpers: flat views of the buffers a backend is handed, byte-range slices of
  them without copying, reading a response stream into them, a large ranged read as
  concurrent spans;
* :func:`strip_userinfo` / :func:`name_resolution_error`: credentials out of endpoint
  URLs; DNS failures told apart from transient ones;
* :func:`list_under` / :func:`dir_entries`: :meth:`Backend.list` and
  :meth:`Backend.list_dir` from a store's prefix listing.
"""

from __future__ import annotations

import asyncio
import random
import socket
import warnings
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

from quire._store.base import Buffer

T = TypeVar("T")


# ----------------------------------------------------------------------------- retries
@dataclass(frozen=True)
class RetryPolicy:
    """How long transient failures are retried.

    Attempt ``n`` (from 0) that fails transiently is followed by a pause drawn uniformly
    from ``[b/2, b]``, ``b = min(max_backoff, backoff * 2**n)`` ("equal jitter": clients
    that failed together do not retry together), unless that pause would end past
    ``deadline`` seconds after the first attempt.

    Parameters
    ----------
    deadline : float
        Seconds after the first attempt past which no retry starts.
    backoff : float
        The first pause's upper bound, in seconds (doubled per attempt).
    max_backoff : float
        The largest pause, in seconds.
    """

    deadline: float = 120.0
    backoff: float = 0.1
    max_backoff: float = 10.0

    @classmethod
    def pop_from(cls, options: dict[str, Any]) -> RetryPolicy:
        """The policy set by ``retry_*`` keys of ``options`` (removed from it).

        Parameters
        ----------
        options : dict
            Storage options; ``retry_deadline``, ``retry_backoff`` and ``retry_max_backoff`` are popped.
        """
        d = cls()
        return cls(
            deadline=float(options.pop("retry_deadline", d.deadline)),
            backoff=float(options.pop("retry_backoff", d.backoff)),
            max_backoff=float(options.pop("retry_max_backoff", d.max_backoff)),
        )

    def pause(self, attempt: int) -> float:
        """The jittered pause after failed attempt number ``attempt`` (from 0).

        Parameters
        ----------
        attempt : int
            The failed attempt's number, from 0.
        """
        b = min(self.max_backoff, self.backoff * 2.0 ** min(attempt, 60))
        return random.uniform(b / 2, b)


class AttemptTimeout(TimeoutError):
    """One attempt of a request did not end within its deadline (it was abandoned).

    Parameters
    ----------
    limit : float
        The attempt's deadline, in seconds.
    """

    def __init__(self, limit: float) -> None:
        super().__init__(f"no complete reply within {limit:.1f}s (request_timeout)")
        self.limit = limit


class RetriesExhausted(Exception):
    """Transient failures lasted past the deadline; ``last`` is the final one.

    Parameters
    ----------
    attempts : int
        How many attempts were made.
    elapsed : float
        Seconds since the first attempt.
    last : BaseException
        The final transient failure.
    """

    def __init__(self, attempts: int, elapsed: float, last: BaseException) -> None:
        super().__init__(f"{attempts} attempts in {elapsed:.1f}s")
        self.attempts = attempts
        self.elapsed = elapsed
        self.last = last


async def retrying(
    attempt: Callable[[int], Awaitable[T]],
    policy: RetryPolicy,
    is_transient: Callable[[BaseException], bool],
    on_retry: Callable[[int, float, BaseException], None] | None = None,
) -> T:
    """``await attempt(n)`` for n = 0, 1, ... until it returns or fails for good.

    Parameters
    ----------
    attempt : callable
        One try; ``n`` tells it that an earlier one may have reached the server before
        its reply was lost.
    policy : RetryPolicy
        Backoff and deadline.
    is_transient : callable
        Whether a failure may heal when repeated.
    on_retry : callable, optional
        ``on_retry(n, pause, error)`` before each pause (to log it).

    Returns
    -------
    What ``attempt`` returned.

    Raises
    ------
    RetriesExhausted
        Transient failures lasted past ``policy.deadline``.
    Exception
        A non-transient failure, as it was raised.
    """
    loop = asyncio.get_running_loop()
    start = loop.time()
    n = 0
    while True:
        try:
            return await attempt(n)
        except Exception as e:
            if not is_transient(e):
                raise
            pause = policy.pause(n)
            elapsed = loop.time() - start
            if elapsed + pause > policy.deadline:
                raise RetriesExhausted(n + 1, elapsed, e) from e
            if on_retry is not None:
                on_retry(n + 1, pause, e)
        await asyncio.sleep(pause)
        n += 1


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


# ----------------------------------------------------------------------------- endpoints
# getaddrinfo's answers that mean "this name does not exist": retrying cannot fix them.
NO_SUCH_NAME = frozenset(
    getattr(socket, n) for n in ("EAI_NONAME", "EAI_NODATA", "EAI_FAIL") if hasattr(socket, n)
)
# "Temporary failure in name resolution" (no DNS server reachable, e.g. no network):
# retried, but only this long, so a machine without network fails in seconds.
RESOLVE_DEADLINE = 5.0


def strip_userinfo(url: str) -> tuple[str, list[str]]:
    """``url`` without ``user:password@``, and the removed parts (to redact them).

    Parameters
    ----------
    url : str
        An endpoint URL such as ``http://KEY:SECRET@host:9000``.

    Returns
    -------
    tuple of (str, list of str)
        The URL with its userinfo removed, and the user name and password found.
    """
    try:
        parts = urlsplit(url)
        user, password, host, port = parts.username, parts.password, parts.hostname, parts.port
    except ValueError:
        return url, []
    if user is None and password is None:
        return url, []
    netloc = (f"[{host}]" if host and ":" in host else host or "") + (f":{port}" if port else "")
    return urlunsplit(parts._replace(netloc=netloc)), [s for s in (user, password) if s]


def strip_endpoint_credentials(opts: dict[str, Any], where: str) -> list[str]:
    """Remove ``user:password@`` from ``opts``' ``endpoint_url`` (top level or in
    ``client_kwargs``, copied before it is changed), with a warning; the parts removed.

    Parameters
    ----------
    opts : dict
        Storage options, changed in place.
    where : str
        ``scheme://bucket``, for the warning.
    """
    found: list[str] = []
    ck = opts.get("client_kwargs")
    for holder in (opts, ck if isinstance(ck, dict) else None):
        url = holder.get("endpoint_url") if holder is not None else None
        if holder is None or not isinstance(url, str):
            continue
        clean, parts = strip_userinfo(url)
        if parts:
            if holder is ck:
                holder = opts["client_kwargs"] = dict(ck)
            holder["endpoint_url"] = clean
            found += parts
            warnings.warn(
                f"{where}: endpoint_url {clean} carried user:password@; it was removed "
                "(credentials in a URL end up in logs): pass them as storage options instead",
                UserWarning,
                stacklevel=4,
            )
    return found


def name_resolution_error(e: BaseException) -> socket.gaierror | None:
    """The :class:`socket.gaierror` behind ``e`` (its cause chain, or the ``os_error`` /
    ``error`` attributes aiohttp and botocore wrap it in), or None."""
    seen: set[int] = set()
    todo: list[Any] = [e]
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen or not isinstance(x, BaseException):
            continue
        seen.add(id(x))
        if isinstance(x, socket.gaierror):
            return x
        kwargs = getattr(x, "kwargs", None)
        todo += [x.__cause__, x.__context__, getattr(x, "os_error", None)]
        if isinstance(kwargs, dict):
            todo.append(kwargs.get("error"))
    return None


# ----------------------------------------------------------------------------- buffers
def split_bucket_url(url: str) -> tuple[str, str]:
    """``scheme://bucket/a/b/`` -> ``("bucket", "a/b")``."""
    scheme, _, rest = url.partition("://")
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise ValueError(f"{url!r} names no bucket; use {scheme}://bucket/path/to/checkpoint")
    return bucket, prefix.strip("/")


def views(data: Sequence[Buffer]) -> list[memoryview]:
    """Flat byte views of the non-empty buffers of ``data``."""
    return [v for v in (memoryview(d).cast("B") for d in data) if v.nbytes]


def byte_slice(bufs: Sequence[memoryview], start: int, stop: int) -> list[memoryview]:
    """The pieces of the concatenation of ``bufs`` in ``[start, stop)``, without copying.

    Parameters
    ----------
    bufs : sequence of memoryview
        The buffers, in order.
    start, stop : int
        The byte range of their concatenation.
    """
    out = []
    pos = 0
    for v in bufs:
        end = pos + v.nbytes
        if end > start and pos < stop:
            out.append(v[max(start - pos, 0) : min(stop, end) - pos])
        pos = end
        if pos >= stop:
            break
    return out


async def read_into(stream: Any, bufs: Sequence[memoryview], block: int = 4 << 20) -> int:
    """Copy from ``stream`` (anything with ``async read(n)``) into ``bufs`` in order.

    Parameters
    ----------
    stream : Any
        An async reader: ``await stream.read(n)`` returns at most ``n`` bytes.
    bufs : sequence of memoryview
        Writable buffers, filled in order.
    block : int
        The largest read.
    """
    n = 0
    for v in bufs:
        pos = 0
        while pos < v.nbytes:
            chunk = await stream.read(min(v.nbytes - pos, block))
            if not chunk:
                return n
            v[pos : pos + len(chunk)] = chunk
            pos += len(chunk)
            n += len(chunk)
    return n


async def gather_all(coros: Sequence[Coroutine[Any, Any, T]]) -> list[T]:
    """Run ``coros`` concurrently; on the first failure cancel the rest and raise it.

    Parameters
    ----------
    coros : sequence of coroutine
        The work to run.
    """
    tasks: list[asyncio.Task[T]] = []
    try:
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(c) for c in coros]
    except BaseExceptionGroup as group:
        raise group.exceptions[0] from None
    return [t.result() for t in tasks]


async def read_spans(
    read: Callable[[int, list[memoryview], int], Coroutine[Any, Any, int]],
    bufs: list[memoryview],
    offset: int,
    span: int,
) -> int:
    """Fill ``bufs`` from ``offset`` with concurrent ``read(start, views, length)`` calls of
    at most ``span`` bytes each; the byte count (short when the object ends early)."""
    total = sum(v.nbytes for v in bufs)
    spans = [(a, min(a + span, total)) for a in range(0, total, span)]
    counts = await gather_all([read(offset + a, byte_slice(bufs, a, b), b - a) for a, b in spans])
    n = 0
    for (a, b), got in zip(spans, counts):
        n += got
        if got < b - a:  # the object ended inside this span
            break
    return n


def dir_prefix(root: str, prefix: str) -> str:
    """The object-name prefix of the "directory" ``prefix`` under ``root`` (``""`` or
    ending in ``/``)."""
    base = "/".join(p for p in (root, prefix.strip("/")) if p)
    return f"{base}/" if base else ""


def dir_entries(under: str, names: list[str], prefixes: list[str]) -> tuple[list[str], list[str]]:
    """:meth:`Backend.list_dir` from a delimited listing of ``under``: object names and
    common prefixes (``under + "x/"``), made relative and sorted."""
    n = len(under)
    return sorted(k[n:] for k in names), sorted(p[n:].rstrip("/") for p in prefixes)


async def list_under(
    lister: Callable[[str, int | None], Awaitable[list[str]]], root: str, prefix: str
) -> list[str]:
    """:meth:`Backend.list` from ``lister(name_prefix, limit)``, a store's listing of the
    object names that start with ``name_prefix`` (sorted, at least ``limit`` of them)."""
    prefix = prefix.strip("/")
    base = "/".join(p for p in (root, prefix) if p)
    under = f"{base}/" if base else ""
    if prefix:
        # The key ``prefix`` itself sorts first among names that start with it.
        children, first = await asyncio.gather(lister(under, None), lister(base, 1))
        found = children + [k for k in first[:1] if k == base]
    else:
        found = await lister(under, None)
    cut = len(root) + 1 if root else 0
    return sorted(k[cut:] for k in found)


class PartBuffers:
    """Bytes written at any offsets, gathered into parts of a fixed size: the bookkeeping
    of a streamed upload (multipart, resumable) fed by concurrent writes at offsets, as
    ``Backend.stream_writer`` objects are.

    Parameters
    ----------
    size : int
        Bytes per part (the last part of the object may be shorter).

    Attributes
    ----------
    buffers : dict of int to bytearray
        Parts being filled (and full ones the caller has not taken), by index from 0.
    filled : dict of int to int
        Bytes received so far for each part in ``buffers``.
    end : int
        One past the highest byte written: the object's size once every write is in.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self.buffers: dict[int, bytearray] = {}
        self.filled: dict[int, int] = {}
        self.end = 0

    def add(self, data: Sequence[Any], offset: int) -> list[int]:
        """Copy ``data`` (buffers, in order) in at ``offset``.

        Parameters
        ----------
        data : sequence of bytes-like
            The bytes to write, back to back.
        offset : int
            Where the first byte goes in the object.

        Returns
        -------
        list of int
            The indexes of the parts this write completed.
        """
        done = []
        for buf in data:
            mv = memoryview(buf).cast("B")
            while mv.nbytes:
                i, at = divmod(offset, self.size)
                part = self.buffers.get(i)
                if part is None:
                    part = self.buffers[i] = bytearray(self.size)
                    self.filled[i] = 0
                n = min(mv.nbytes, self.size - at)
                part[at : at + n] = mv[:n]
                self.filled[i] += n
                if self.filled[i] == self.size:
                    done.append(i)
                mv, offset = mv[n:], offset + n
        self.end = max(self.end, offset)
        return done

    def full(self, i: int) -> bool:
        """Whether part ``i`` has every byte (and has not been taken).

        Parameters
        ----------
        i : int
            A part index.
        """
        return self.filled.get(i) == self.size

    def take(self, i: int) -> bytearray:
        """Remove part ``i`` and return its buffer.

        Parameters
        ----------
        i : int
            A part index.
        """
        self.filled.pop(i, None)
        return self.buffers.pop(i)

    def tail(self) -> tuple[int, int]:
        """(index of the last part, its length when shorter than ``size``, else 0)."""
        return divmod(self.end, self.size)

    def whole(self) -> bool:
        """Whether every byte below :attr:`end` not yet taken has arrived (no holes):
        only the last part may be left, holding exactly its bytes."""
        last, rest = self.tail()
        if not rest:
            return not self.buffers
        return set(self.buffers) == {last} and self.filled.get(last) == rest
