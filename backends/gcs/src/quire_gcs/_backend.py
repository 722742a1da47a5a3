"""The GCS backend: JSON-API requests on a gcsfs-configured session.

gcsfs turns ``storage_options`` (plus fsspec's config files, ``GOOGLE_APPLICATION_CREDENTIALS``
and ``STORAGE_EMULATOR_HOST``) into credentials, an endpoint and an aiohttp session; every
request is then made here, so that the commit uses GCS's own preconditions and every call
shares one retry policy:

* ``put_if_absent`` uploads with ``ifGenerationMatch=0`` and ``replace_if_match`` with
  ``ifGenerationMatch=<generation>`` (412 = :class:`PreconditionFailed`); nothing is ever
  "renamed" by copy + delete;
* ``put`` uploads objects of ``resumable_threshold`` bytes or more with a resumable upload,
  which continues from the offset the server confirms after a failure;
* ``get`` / ``get_into`` read byte ranges and stream into the caller's buffers;
* 408, 429, 5xx, resets and timeouts are retried with jittered backoff up to a deadline;
  401/403 and a missing bucket fail at once.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import datetime
import functools
import json
import logging
import os
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar
from urllib.parse import quote, urlencode

import aiohttp
import yarl

from quire import _objstore as objstore
from quire._budget import ByteBudget
from quire._config import current
from quire._objstore import RetriesExhausted, RetryPolicy, retrying
from quire.backends import Backend, Buffer, Capabilities, PreconditionFailed
from quire.errors import QuireError

__all__ = ["GCSBackend", "GCSBucketNotFoundError", "GCSError", "GCSPermissionError"]

log = logging.getLogger("quire.gcs")
T = TypeVar("T")
MiB = 1 << 20
CHUNK_ALIGN = 256 * 1024  # resumable upload chunks are multiples of this
DELETE_CONCURRENCY = 32
_BOUNDARY = "quire-f2b1c0de"
_TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})
_TRANSIENT_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError)
_SECRET_OPTIONS = ("token", "secret", "password", "access_token", "client_secret")


class GCSError(QuireError, OSError):
    """A GCS request failed for good: a permanent error, or transient ones past the deadline."""


class GCSPermissionError(GCSError, PermissionError):
    """GCS refused the request (401 / 403)."""


class GCSBucketNotFoundError(GCSError, FileNotFoundError):
    """The bucket of the URL does not exist."""


class HTTPStatusError(Exception):
    """A non-success reply; ``status`` and the server's message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status} {message}".strip())
        self.status = status
        self.message = message


# ----------------------------------------------------------------------------- helpers
def _is_transient(e: BaseException) -> bool:
    if isinstance(e, HTTPStatusError):
        return e.status in _TRANSIENT_STATUS
    return isinstance(e, _TRANSIENT_ERRORS)


def _join(views: Sequence[memoryview]) -> bytes | memoryview:
    """One request body (aiohttp sends a lone memoryview without copying it)."""
    if len(views) == 1:
        return views[0]
    return b"".join(views)


def _progress(status: int, headers: Any, body: bytes) -> int | str:
    """A resumable upload's state from a reply: the generation once complete (200/201),
    else the count of bytes the server holds (308, ``Range: bytes=0-N``)."""
    if status in (200, 201):
        return str(json.loads(body)["generation"])
    rng = headers.get("Range")
    return int(rng.rsplit("-", 1)[1]) + 1 if rng else 0


def _message(body: bytes) -> str:
    try:
        err = json.loads(body)["error"]
        return str(err.get("message", "")) if isinstance(err, dict) else str(err)
    except (ValueError, KeyError, TypeError):
        return body[:200].decode("utf-8", "replace").strip()


def _secrets(options: dict[str, Any]) -> list[str]:
    found = [options.get(k) for k in _SECRET_OPTIONS]
    token = options.get("token")
    if isinstance(token, dict):
        found += [token.get(k) for k in ("private_key", "client_secret", "refresh_token")]
    return [
        s
        for s in found
        if isinstance(s, str)
        and len(s) >= 4
        and s not in ("anon", "cloud", "google_default", "browser", "cache")
    ]


# ----------------------------------------------------------------------------- sessions
def _new_filesystem(options: dict[str, Any]) -> Any:
    # gcsfs.core's class, not the package's default: quire makes its own requests, and the
    # experimental zonal-bucket subclass probes every bucket first.
    from gcsfs.core import GCSFileSystem

    return GCSFileSystem(
        asynchronous=True,
        loop=asyncio.get_running_loop(),
        skip_instance_cache=True,
        **options,
    )


async def _close_filesystem(fs: Any) -> None:
    session = getattr(fs, "_session", None)
    if session is not None and not session.closed:
        fs._session = None
        with contextlib.suppress(Exception):
            await session.close()


# One gcsfs file system (credentials, aiohttp session) per option set on quire's loop.
_clients = objstore.ClientCache(_new_filesystem, _close_filesystem)


# ----------------------------------------------------------------------------- backend
class GCSBackend(Backend):
    """Checkpoints under ``gs://bucket/prefix``.

    Parameters
    ----------
    url : str
        ``gs://bucket/path`` (or ``gcs://``).
    storage_options : dict, optional
        quire's keys ``retry_deadline`` (s, 120), ``retry_backoff`` (s, 0.1),
        ``retry_max_backoff`` (s, 10), ``read_timeout`` (s, 60), ``connect_timeout``
        (s, 10), ``upload_budget`` (bytes; ``quire.configure``'s ``byte_budget``),
        ``resumable_threshold`` (32 MiB), ``resumable_chunksize`` (16 MiB),
        ``read_part_size`` (64 MiB); every other key goes to ``gcsfs.GCSFileSystem``
        (``project``, ``token``, ``endpoint_url``, ``requester_pays``, ...); with
        ``STORAGE_EMULATOR_HOST`` set, ``token`` defaults to ``"anon"``.

    Notes
    -----
    A conditional write whose precondition fails checks whether the object holds exactly
    the bytes it sent: an earlier attempt whose reply was lost may have written them, and
    then the call succeeds.  quire's commit records are unique (txid, timestamp), so equal
    bytes mean this writer's.
    """

    capabilities = Capabilities(
        atomic_create=True, atomic_replace=True, durable=True, rename=False, readinto=True
    )

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        super().__init__(url, storage_options)
        opts = dict(self.storage_options)
        self.retry = RetryPolicy.pop_from(opts)
        self.timeout = aiohttp.ClientTimeout(
            sock_connect=float(opts.pop("connect_timeout", 10.0)),
            sock_read=float(opts.pop("read_timeout", 60.0)),
        )
        self.upload_budget = int(opts.pop("upload_budget", current().byte_budget))
        chunk = int(opts.pop("resumable_chunksize", 16 * MiB))
        if chunk <= 0 or chunk % CHUNK_ALIGN:
            raise ValueError("resumable_chunksize must be a positive multiple of 256 KiB")
        self.chunk_size = chunk
        self.resumable_threshold = max(int(opts.pop("resumable_threshold", 32 * MiB)), 1)
        self.read_part_size = max(1, int(opts.pop("read_part_size", 64 * MiB)))
        self.bucket, self.root = objstore.split_bucket_url(url)
        if os.environ.get("STORAGE_EMULATOR_HOST") and "token" not in opts:
            opts["token"] = "anon"  # as google-cloud-storage does for an emulator
        self._options = opts
        self._token = repr(sorted(opts.items(), key=lambda kv: kv[0]))
        self._secret_values = _secrets(opts)
        self._fs: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._private = False
        self._budget: ByteBudget | None = None

    # -- plumbing ----------------------------------------------------------------
    def _key(self, key: str) -> str:
        return f"{self.root}/{key}" if self.root else key

    def _where(self, key: str | None) -> str:
        return f"gs://{self.bucket}" + (f"/{self._key(key)}" if key is not None else "")

    def _bind(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._fs, self._private = _clients.get(self._options, self._token)
            self._loop = loop
            self._budget = ByteBudget(self.upload_budget)

    def _object_url(self, key: str, media: bool = False) -> str:
        name = quote(self._key(key), safe="")
        if media:
            return f"{self._fs._location}/download/storage/v1/b/{quote(self.bucket)}/o/{name}"
        return f"{self._fs.base}b/{quote(self.bucket)}/o/{name}"

    def _upload_url(self) -> str:
        return f"{self._fs._location}/upload/storage/v1/b/{quote(self.bucket)}/o"

    async def _http(
        self,
        method: str,
        url: str,
        *,
        params: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
        data: Any = None,
        into: Sequence[memoryview] | None = None,
        ok: tuple[int, ...] = (200, 201, 204, 206),
    ) -> tuple[int, Any, Any]:
        """One request: ``(status, headers, body bytes | byte count read into ``into``)``.

        A status outside ``ok`` raises :class:`HTTPStatusError`.
        """
        self._bind()
        session = await self._fs._set_session()
        query = self._fs._get_params(params or {})
        full = url + ("&" if "?" in url else "?") + urlencode(query) if query else url
        async with session.request(
            method,
            yarl.URL(full, encoded=True),
            headers=self._fs._get_headers(headers),
            data=data,
            timeout=self.timeout,
        ) as r:
            if r.status not in ok:
                raise HTTPStatusError(r.status, _message(await r.read()))
            if into is not None and r.status in (200, 206):
                return r.status, r.headers, await objstore.read_into(r.content, into)
            return r.status, r.headers, await r.read()

    def _redact(self, text: str) -> str:
        for s in self._secret_values:
            text = text.replace(s, "***")
        return text

    def _describe(self, e: BaseException) -> str:
        return self._redact(
            str(e) if isinstance(e, HTTPStatusError) else f"{type(e).__name__}: {e}"
        )

    def _fail(self, e: Exception, op: str, key: str | None, missing: str) -> Exception:
        """The error to raise for a failure that retrying cannot fix.

        ``missing`` says what a 404 means here: ``"object"`` or ``"bucket"``.
        """
        where = self._where(key)
        if isinstance(e, RetriesExhausted):
            return GCSError(
                f"{where}: {op} kept failing with transient errors; gave up after "
                f"{e.attempts} attempts in {e.elapsed:.1f}s (storage_options "
                f"retry_deadline={self.retry.deadline:g}); last: {self._describe(e.last)}"
            )
        if not isinstance(e, HTTPStatusError):
            return e
        if e.status == 404:
            if missing == "object":
                return FileNotFoundError(f"{where} does not exist")
            return GCSBucketNotFoundError(
                f"{where}: {op}: bucket {self.bucket!r} does not exist (endpoint "
                f"{self._fs._location}); create it or fix the URL"
            )
        if e.status in (401, 403):
            return GCSPermissionError(
                f"{where}: {op} denied: {self._describe(e)}. Check the credentials "
                "(storage_options token/project, GOOGLE_APPLICATION_CREDENTIALS, gcloud auth) "
                "and the bucket's IAM policy"
            )
        return GCSError(f"{where}: {op} failed: {self._describe(e)}")

    async def _run(
        self,
        op: str,
        key: str | None,
        attempt: Callable[[int], Awaitable[T]],
        missing: str = "object",
    ) -> T:
        def on_retry(n: int, pause: float, e: BaseException) -> None:
            log.info(
                "%s: %s failed (%s); retry %d in %.2fs",
                self._where(key),
                op,
                self._describe(e),
                n,
                pause,
            )

        try:
            return await retrying(attempt, self.retry, _is_transient, on_retry)
        except PreconditionFailed:
            raise
        except Exception as e:
            err = self._fail(e, op, key, missing)
            if err is e:
                raise
            raise err from (e.last if isinstance(e, RetriesExhausted) else e)

    # -- reads -------------------------------------------------------------------
    async def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        headers: dict[str, str] = {}
        if start is not None or end is not None:
            s = start or 0
            if end is not None and end <= s:
                await self.size(key)  # FileNotFoundError for a missing key, as for any read
                return b""
            headers["Range"] = f"bytes={s}-" + ("" if end is None else str(end - 1))

        async def attempt(_n: int) -> bytes:
            self._bind()
            try:
                _, _, body = await self._http(
                    "GET", self._object_url(key, media=True), params={"alt": "media"},
                    headers=headers,
                )  # fmt: skip
            except HTTPStatusError as e:
                if e.status == 416:
                    return b""
                raise
            return bytes(body)

        return await self._run("download", key, attempt)

    async def get_into(self, key: str, buffers: Sequence[memoryview], offset: int = 0) -> int:
        views = objstore.views(buffers)
        total = sum(v.nbytes for v in views)
        if total == 0:
            await self.size(key)
            return 0
        return await objstore.read_spans(
            functools.partial(self._read_into, key), views, offset, self.read_part_size
        )

    async def _read_into(
        self, key: str, start: int, views: builtins.list[memoryview], length: int
    ) -> int:
        async def attempt(_n: int) -> int:
            self._bind()
            try:
                _, _, n = await self._http(
                    "GET", self._object_url(key, media=True), params={"alt": "media"},
                    headers={"Range": f"bytes={start}-{start + length - 1}"}, into=views,
                )  # fmt: skip
            except HTTPStatusError as e:
                if e.status == 416:
                    return 0
                raise
            return int(n)

        return await self._run("download", key, attempt)

    async def _stat(self, key: str) -> dict[str, Any] | None:
        async def attempt(_n: int) -> dict[str, Any] | None:
            self._bind()
            try:
                _, _, body = await self._http(
                    "GET", self._object_url(key), params={"fields": "size,generation,updated"}
                )
            except HTTPStatusError as e:
                if e.status == 404:
                    return None
                raise
            return dict(json.loads(body))

        return await self._run("stat", key, attempt)

    async def size(self, key: str) -> int:
        st = await self._stat(key)
        if st is None:
            raise FileNotFoundError(f"{self._where(key)} does not exist")
        return int(st["size"])

    async def exists(self, key: str) -> bool:
        return await self._stat(key) is not None

    async def version(self, key: str) -> str | None:
        st = await self._stat(key)
        return None if st is None else str(st["generation"])

    async def modified(self, key: str) -> float | None:
        st = await self._stat(key)
        if st is None:
            raise FileNotFoundError(f"{self._where(key)} does not exist")
        when = st.get("updated")
        if not when:
            return None
        return datetime.datetime.fromisoformat(str(when).replace("Z", "+00:00")).timestamp()

    async def _listing(
        self, prefix: str, limit: int | None = None, delimiter: str | None = None
    ) -> tuple[builtins.list[str], builtins.list[str]]:
        """Names starting with ``prefix`` (and common prefixes, with a ``delimiter``)."""
        names: builtins.list[str] = []
        dirs: builtins.list[str] = []
        token: str | None = None
        while True:
            params: dict[str, Any] = {
                "prefix": prefix,
                "fields": "items(name),prefixes,nextPageToken",
                "maxResults": limit or 1000,
            }
            if token:
                params["pageToken"] = token
            if delimiter:
                params["delimiter"] = delimiter

            async def attempt(_n: int, params: dict[str, Any] = params) -> dict[str, Any]:
                self._bind()
                _, _, body = await self._http(
                    "GET", f"{self._fs.base}b/{quote(self.bucket)}/o", params=params
                )
                return dict(json.loads(body))

            page = await self._run("list", None, attempt, missing="bucket")
            names += [o["name"] for o in page.get("items", ())]
            dirs += list(page.get("prefixes", ()))
            token = page.get("nextPageToken")
            if not token or (limit and len(names) >= limit):
                return names, dirs

    async def _list(self, prefix: str, limit: int | None) -> builtins.list[str]:
        return (await self._listing(prefix, limit))[0]

    async def list(self, prefix: str = "") -> builtins.list[str]:
        return await objstore.list_under(self._list, self.root, prefix)

    async def list_dir(self, prefix: str = "") -> tuple[builtins.list[str], builtins.list[str]]:
        under = objstore.dir_prefix(self.root, prefix)
        names, dirs = await self._listing(under, delimiter="/")
        return objstore.dir_entries(under, names, dirs)

    # -- writes ------------------------------------------------------------------
    async def _simple_upload(self, key: str, body: Any, cond: dict[str, Any]) -> str:
        """One media upload request (no retry); the new generation."""
        self._bind()
        params = {"uploadType": "media", "name": self._key(key), **cond}
        headers = {"Content-Type": "application/octet-stream"}
        if not len(body):
            # gcp-storage-emulator fails an empty media upload (it reads no body as None);
            # the multipart form of the same request works there and on GCS.
            meta = json.dumps({"name": self._key(key)})
            body = (
                f"--{_BOUNDARY}\r\nContent-Type: application/json; charset=UTF-8\r\n\r\n"
                f"{meta}\r\n--{_BOUNDARY}\r\nContent-Type: application/octet-stream\r\n\r\n"
                f"\r\n--{_BOUNDARY}--\r\n"
            ).encode()
            params = {"uploadType": "multipart", **cond}
            headers = {"Content-Type": f"multipart/related; boundary={_BOUNDARY}"}
        _, _, out = await self._http(
            "POST", self._upload_url(), params=params, headers=headers, data=body
        )
        return str(json.loads(out)["generation"])

    async def put(self, key: str, data: Sequence[Buffer]) -> None:
        views = objstore.views(data)
        total = sum(v.nbytes for v in views)
        if total >= self.resumable_threshold:
            await self._resumable(key, views, total)
            return
        self._bind()
        assert self._budget is not None
        async with self._budget.hold(total):
            body = _join(views) or b""
            await self._run(
                "upload", key, lambda _n: self._simple_upload(key, body, {}), missing="bucket"
            )

    async def _resumable(self, key: str, views: builtins.list[memoryview], total: int) -> str:
        async def start(_n: int) -> str:
            self._bind()
            _, headers, _ = await self._http(
                "POST", self._upload_url(),
                params={"uploadType": "resumable", "name": self._key(key)},
                headers={"X-Upload-Content-Type": "application/octet-stream",
                         "X-Upload-Content-Length": str(total)},
            )  # fmt: skip
            return str(headers["Location"])

        session_url = await self._run("start resumable upload", key, start, missing="bucket")
        budget = self._budget
        assert budget is not None
        offset = 0

        async def confirmed() -> int | str:
            """The server's byte count (or the generation, when the upload is complete)."""
            try:
                status, headers, body = await self._http(
                    "PUT", session_url, headers={"Content-Range": f"bytes */{total}"},
                    ok=(200, 201, 308),
                )  # fmt: skip
            except HTTPStatusError as e:
                # Some servers drop a session once complete (GCS answers 200 instead): the
                # object then exists, whole, under this key no one else writes (a txid's).
                if e.status in (404, 410):
                    st = await self._stat(key)
                    if st is not None and int(st["size"]) == total:
                        return str(st["generation"])
                raise
            return _progress(status, headers, body)

        async def send(n: int) -> int | str:
            """Send the chunk at the confirmed offset: the new offset, or the generation."""
            nonlocal offset
            if n:  # the last attempt may have delivered some or all of the chunk
                got = await confirmed()
                if isinstance(got, str):
                    return got
                offset = got
            end = min(offset + self.chunk_size, total)
            async with budget.hold(end - offset):
                try:
                    status, headers, body = await self._http(
                        "PUT", session_url,
                        headers={"Content-Range": f"bytes {offset}-{end - 1}/{total}"},
                        data=_join(objstore.byte_slice(views, offset, end)), ok=(200, 201, 308),
                    )  # fmt: skip
                except HTTPStatusError as e:
                    # aiohttp repeats a PUT whose connection dropped; if the first copy
                    # arrived, a strict server refuses the repeat (its start offset, or the
                    # session it completed). Resync.
                    if e.status not in (400, 404, 410):
                        raise
                    got = await confirmed()
                    if isinstance(got, str) or got > offset:
                        return got
                    raise
            return _progress(status, headers, body)

        try:
            while True:
                got = await self._run("resumable upload", key, send)
                if isinstance(got, str):
                    return got
                offset = got
        except BaseException:
            with contextlib.suppress(Exception):  # cancel the session; it would expire anyway
                await self._http("DELETE", session_url, ok=(200, 204, 499))
            raise

    async def _holds(self, key: str, data: bytes) -> str | None:
        """The generation of ``key`` if it holds exactly ``data`` (an earlier attempt wrote it)."""
        st = await self._stat(key)
        if st is None or int(st["size"]) != len(data):
            return None
        got = await self.get(key)
        return str(st["generation"]) if got == data else None

    async def _conditional(self, key: str, data: bytes, generation: str, what: str) -> str:
        # Commit records are small: one media upload, whatever resumable_threshold says.
        body = bytes(data)

        async def attempt(_n: int) -> str:
            try:
                return await self._simple_upload(key, body, {"ifGenerationMatch": generation})
            except HTTPStatusError as e:
                if e.status != 412:
                    raise
            mine = await self._holds(key, body)
            if mine is not None:
                return mine
            raise PreconditionFailed(f"{self._where(key)} {what}")

        return await self._run("conditional upload", key, attempt, missing="bucket")

    async def put_if_absent(self, key: str, data: bytes) -> str:
        return await self._conditional(key, data, "0", "exists")

    async def replace_if_match(self, key: str, data: bytes, version: str) -> str:
        return await self._conditional(
            key, data, version, f"changed or vanished (expected generation {version})"
        )

    async def delete(self, keys: Sequence[str]) -> None:
        sem = asyncio.Semaphore(DELETE_CONCURRENCY)

        async def one(key: str) -> None:
            async def attempt(_n: int) -> None:
                self._bind()
                await self._http("DELETE", self._object_url(key), ok=(200, 204, 404))

            async with sem:
                await self._run("delete", key, attempt)

        await objstore.gather_all([one(k) for k in keys])

    async def close(self) -> None:
        if self._fs is not None:
            await _clients.release(self._fs, self._private)
        self._fs = self._loop = None
