"""The GCS backend: JSON-API requests on a gcsfs-configured session.

gcsfs turns ``storage_options`` (plus fsspec's config files, ``GOOGLE_APPLICATION_CREDENTIALS``
and ``STORAGE_EMULATOR_HOST``) into credentials, an endpoint and an aiohttp session; every
request is then made here, so that the commit uses GCS's own preconditions and every call
shares one retry policy:

* ``put_if_absent`` / ``replace_if_match``: multipart uploads with ``ifGenerationMatch=0`` /
  ``<generation>`` (412 = :class:`PreconditionFailed`); GCS applies them to every
  ``uploadType``, fake-gcs-server (the tests') to multipart only.  Never copy + delete;
* ``put`` uploads objects of ``resumable_threshold`` bytes or more with a resumable upload,
  which continues from the offset the server confirms after a failure; format-v2 packs
  stream into a resumable upload of unknown size (``stream_writer``, ``quire_gcs._stream``);
* ``get`` / ``get_into`` read byte ranges and stream into the caller's buffers;
* 408/429/5xx, resets, timeouts: retried (backoff, a deadline); 401/403, no bucket: fail at once.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import datetime
import json
import logging
import os
import uuid
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, TypeVar
from urllib.parse import quote, urlencode

import aiohttp
import yarl

from quire import errors
from quire.backends import ObjectInfo, ObjectStoreBackend, byte_slice, gather_all, read_into

__all__ = [
    "GCSBackend",
    "GCSBucketNotFoundError",
    "GCSEndpointError",
    "GCSError",
    "GCSPermissionError",
]

log = logging.getLogger("quire.gcs")
T = TypeVar("T")
MiB = 1 << 20
CHUNK_ALIGN = 256 * 1024  # resumable upload chunks are multiples of this
DELETE_CONCURRENCY = 32
_TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})
_TRANSIENT_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError)


class GCSError(errors.ObjectStoreError):
    """A GCS request failed for good: a permanent error, or transient ones past the deadline."""


class GCSPermissionError(GCSError, errors.ObjectStorePermissionError):
    """GCS refused the request (401 / 403)."""


class GCSBucketNotFoundError(GCSError, errors.BucketNotFoundError):
    """The bucket of the URL does not exist."""


class GCSEndpointError(GCSError, errors.EndpointUnreachableError):
    """The endpoint's host name does not resolve (no network, or a wrong endpoint_url)."""


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


def _multipart(name: str, data: bytes) -> tuple[bytes, str]:
    """A multipart upload's body (the object's metadata, then its bytes) and Content-Type."""
    b = f"quire-{uuid.uuid4().hex}"
    while f"--{b}".encode() in data:  # a boundary must not occur in the parts: checked
        b = f"quire-{uuid.uuid4().hex}"
    meta = f"Content-Type: application/json; charset=UTF-8\r\n\r\n{json.dumps({'name': name})}"
    head = f"--{b}\r\n{meta}\r\n--{b}\r\nContent-Type: application/octet-stream\r\n\r\n"
    return head.encode() + data + f"\r\n--{b}--\r\n".encode(), f"multipart/related; boundary={b}"


# ----------------------------------------------------------------------------- backend
class GCSBackend(ObjectStoreBackend):
    """Checkpoints under ``gs://bucket/prefix`` (or ``gcs://``).

    Storage options: those of :class:`quire.backends.ObjectStoreBackend`, then
    ``read_timeout`` (s, 60), ``connect_timeout`` (s, 10), ``resumable_threshold``
    (32 MiB) and ``resumable_chunksize`` (16 MiB); the rest goes to
    ``gcsfs.GCSFileSystem`` (``project``, ``token``, ``endpoint_url``, ...).  With
    ``STORAGE_EMULATOR_HOST`` set, ``token`` defaults to ``"anon"``.  Conditional writes
    recognise their own earlier attempt (see ``S3Backend``).
    """

    scheme = "gs"
    error, permission_error = GCSError, GCSPermissionError
    bucket_error, endpoint_error = GCSBucketNotFoundError, GCSEndpointError
    log = log
    # Commits by conditional request (If-None-Match / If-Match, generation preconditions)
    # and packs streamed as multipart / resumable uploads, over the object-store base's.
    capabilities = replace(
        ObjectStoreBackend.capabilities, atomic_create=True, atomic_replace=True, stream_writes=True
    )
    secret_options = ("token", "secret", "password", "access_token", "client_secret")
    # gcsfs.core's class, not the package's default: quire makes its own requests, and the
    # experimental zonal-bucket subclass probes every bucket first.
    fsspec_class = "gcsfs.core.GCSFileSystem"
    not_secret = frozenset({"anon", "cloud", "google_default", "browser", "cache"})

    def configure(self, options: dict[str, Any]) -> dict[str, Any]:
        self.timeout = aiohttp.ClientTimeout(
            sock_connect=float(options.pop("connect_timeout", 10.0)),
            sock_read=float(options.pop("read_timeout", 60.0)),
        )
        chunk = int(options.pop("resumable_chunksize", 16 * MiB))
        if chunk <= 0 or chunk % CHUNK_ALIGN:
            raise ValueError("resumable_chunksize must be a positive multiple of 256 KiB")
        self.chunk_size = chunk
        self.large_threshold = max(int(options.pop("resumable_threshold", 32 * MiB)), 1)
        if os.environ.get("STORAGE_EMULATOR_HOST") and "token" not in options:
            options["token"] = "anon"  # as google-cloud-storage does for an emulator
        return options

    def secret_values(self, options: dict[str, Any]) -> builtins.list[str]:
        found = super().secret_values(options)
        token = options.get("token")
        if isinstance(token, dict):
            found += [
                s
                for s in (token.get(k) for k in ("private_key", "client_secret", "refresh_token"))
                if isinstance(s, str) and len(s) >= 4
            ]
        return found

    # -- sessions ----------------------------------------------------------------
    @staticmethod
    async def close_client(client: Any) -> None:
        session = getattr(client, "_session", None)
        if session is not None and not session.closed:
            client._session = None
            with contextlib.suppress(Exception):
                await session.close()

    @staticmethod
    def connections_in_use(client: Any) -> int:
        connector = getattr(getattr(client, "_session", None), "connector", None)
        return len(getattr(connector, "_acquired", ()) or ())

    def _object_url(self, key: str, media: bool = False) -> str:
        name = quote(self.key(key), safe="")
        if media:
            return f"{self.client._location}/download/storage/v1/b/{quote(self.bucket)}/o/{name}"
        return f"{self.client.base}b/{quote(self.bucket)}/o/{name}"

    def _upload_url(self) -> str:
        return f"{self.client._location}/upload/storage/v1/b/{quote(self.bucket)}/o"

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
        session = await self.client._set_session()
        query = self.client._get_params(params or {})
        full = url + ("&" if "?" in url else "?") + urlencode(query) if query else url
        async with session.request(
            method,
            yarl.URL(full, encoded=True),
            headers=self.client._get_headers(headers),
            data=data,
            timeout=self.timeout,
        ) as r:
            if r.status not in ok:
                raise HTTPStatusError(r.status, _message(await r.read()))
            if into is not None and r.status in (200, 206):
                return r.status, r.headers, await read_into(r.content, into)
            return r.status, r.headers, await r.read()

    # -- errors ------------------------------------------------------------------
    def endpoint(self) -> str | None:
        fs = self.existing_client
        return str(fs._location) if fs is not None else self.client_options.get("endpoint_url")

    def is_transient(self, e: BaseException) -> bool:
        return _is_transient(e)

    def describe(self, e: BaseException) -> str:
        return str(e) if isinstance(e, HTTPStatusError) else f"{type(e).__name__}: {e}"

    def map_error(self, e: Exception, op: str, key: str | None, missing: str) -> Exception | None:
        if not isinstance(e, HTTPStatusError):
            return None
        if e.status == 404:
            if missing == "object":
                return FileNotFoundError(f"{self.where(key)} does not exist")
            return self.no_bucket(op, key)
        if e.status in (401, 403):
            where_from = "token/project, GOOGLE_APPLICATION_CREDENTIALS, gcloud auth"
            return self.denied(
                e, op, key, f"Check the credentials ({where_from}) and the bucket's IAM policy"
            )
        return self.failed(e, op, key)

    # -- reads -------------------------------------------------------------------
    async def read_range(self, key: str, start: int, end: int | None) -> bytes:
        headers = {"Range": f"bytes={start}-" + ("" if end is None else str(end - 1))}
        try:
            _, _, body = await self._http(
                "GET", self._object_url(key, media=True), params={"alt": "media"},
                headers=headers if start or end is not None else {},
            )  # fmt: skip
        except HTTPStatusError as e:
            if e.status == 416:
                return b""
            raise
        return bytes(body)

    async def read_range_into(
        self, key: str, start: int, views: builtins.list[memoryview], length: int
    ) -> int:
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

    async def stat(self, key: str) -> ObjectInfo | None:
        async def attempt(_n: int) -> dict[str, Any] | None:
            try:
                _, _, body = await self._http(
                    "GET", self._object_url(key), params={"fields": "size,generation,updated"}
                )
            except HTTPStatusError as e:
                if e.status == 404:
                    return None
                raise
            return dict(json.loads(body))

        st = await self.run("stat", key, attempt)
        if st is None:
            return None
        when = st.get("updated")
        stamp = str(when).replace("Z", "+00:00") if when else None
        return ObjectInfo(
            int(st["size"]),
            str(st["generation"]),
            datetime.datetime.fromisoformat(stamp).timestamp() if stamp else None,
        )

    async def list_page(
        self, prefix: str, token: str | None, limit: int | None, delimiter: str | None
    ) -> tuple[builtins.list[str], builtins.list[str], str | None]:
        params: dict[str, Any] = {
            "prefix": prefix,
            "fields": "items(name),prefixes,nextPageToken",
            "maxResults": limit or 1000,
        }
        if token:
            params["pageToken"] = token
        if delimiter:
            params["delimiter"] = delimiter

        async def attempt(_n: int) -> dict[str, Any]:
            url = f"{self.client.base}b/{quote(self.bucket)}/o"
            return dict(json.loads((await self._http("GET", url, params=params))[2]))

        page = await self.run("list", None, attempt, missing="bucket")
        names = [o["name"] for o in page.get("items", ())]
        return names, list(page.get("prefixes", ())), page.get("nextPageToken")

    # -- writes ------------------------------------------------------------------
    async def _simple_upload(self, key: str, body: Any, cond: dict[str, Any]) -> str:
        """One upload (no retry), multipart with a precondition ``cond``; the new generation."""
        name = self.key(key)
        params = {"uploadType": "media", "name": name, **cond}
        headers = {"Content-Type": "application/octet-stream"}
        if cond:
            body, headers["Content-Type"] = _multipart(name, bytes(body))
            params["uploadType"] = "multipart"
        _, _, out = await self._http(
            "POST", self._upload_url(), params=params, headers=headers, data=body
        )
        return str(json.loads(out)["generation"])

    async def put_small(self, key: str, views: builtins.list[memoryview], total: int) -> None:
        body = _join(views) or b""
        await self.run(
            "upload", key, lambda _n: self._simple_upload(key, body, {}), missing="bucket",
            nbytes=total,
        )  # fmt: skip

    async def put_large(self, key: str, views: builtins.list[memoryview], total: int) -> None:
        session_url = await self.resumable_start(key, total)
        try:
            await self.resumable_send(session_url, key, views, 0, total, total)
        except BaseException:
            await self.resumable_cancel(session_url)
            raise

    # -- resumable uploads (``put_large`` and the streamed packs of quire_gcs._stream) ----
    async def resumable_start(self, key: str, total: int | None) -> str:
        """Open a resumable upload session for ``key`` (``total`` bytes, or None when the
        size is known only at the end); its session URL."""

        async def start(_n: int) -> str:
            headers = {"X-Upload-Content-Type": "application/octet-stream"}
            if total is not None:
                headers["X-Upload-Content-Length"] = str(total)
            _, got, _ = await self._http(
                "POST", self._upload_url(),
                params={"uploadType": "resumable", "name": self.key(key)}, headers=headers,
            )  # fmt: skip
            return str(got["Location"])

        return await self.run("start resumable upload", key, start, missing="bucket")

    async def resumable_send(
        self,
        session_url: str,
        key: str,
        views: builtins.list[memoryview],
        start: int,
        end: int,
        total: int | None,
    ) -> int | str:
        """Send bytes ``[start, end)`` of the object (``views`` hold exactly them), in
        chunks of ``resumable_chunksize``, each retried and resumed from the offset the
        server confirms.  ``total`` is the object's size (None while unknown: then
        ``end - start`` must be a multiple of 256 KiB).  Returns the offset the server
        holds, or the object's generation once this completed it."""
        size = "*" if total is None else str(total)
        budget = self.budget
        offset = start

        async def confirmed() -> int | str:
            """The server's byte count (or the generation, when the upload is complete)."""
            try:
                status, headers, body = await self._http(
                    "PUT", session_url, headers={"Content-Range": f"bytes */{size}"},
                    ok=(200, 201, 308),
                )  # fmt: skip
            except HTTPStatusError as e:
                # Some servers drop a session once complete (GCS answers 200 instead): the
                # object then exists, whole, under this key no one else writes (a txid's).
                if e.status in (404, 410) and total is not None:
                    st = await self.stat(key)
                    if st is not None and st.size == total:
                        return st.version
                raise
            got = _progress(status, headers, body)
            if isinstance(got, int) and got < start:
                raise self.error(
                    f"{self.where(key)}: resumable upload lost confirmed bytes "
                    f"(the server holds {got}, {start} were confirmed); save again"
                )
            return got

        async def send(n: int) -> int | str:
            """Send the chunk at the confirmed offset: the new offset, or the generation."""
            nonlocal offset
            if n:  # the last attempt may have delivered some or all of the chunk
                got = await confirmed()
                if isinstance(got, str):
                    return got
                offset = got
            stop = min(offset + self.chunk_size, end)
            rng = f"bytes {offset}-{stop - 1}/{size}" if stop > offset else f"bytes */{size}"
            try:
                status, headers, body = await self._http(
                    "PUT", session_url, headers={"Content-Range": rng},
                    data=_join(byte_slice(views, offset - start, stop - start)),
                    ok=(200, 201, 308),
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

        while True:
            # held in the budget outside the deadline: waiting for memory is no slow server
            piece = min(self.chunk_size, end - offset)
            async with budget.hold(piece):
                got = await self.run("resumable upload", key, send, nbytes=piece)
            if isinstance(got, str):
                return got
            offset = got
            if offset >= end and (total is None or end < total):
                return offset

    async def resumable_cancel(self, session_url: str) -> None:
        """Cancel a session after a failure (it would expire anyway): one try, bounded."""
        with contextlib.suppress(Exception):  # broad: clean-up after a failure being raised
            async with asyncio.timeout(self.request_deadline()):
                await self._http("DELETE", session_url, ok=(200, 204, 499))

    async def stream_writer(self, key: str) -> Any:
        """A resumable upload fed by concurrent writes at offsets (``quire_gcs._stream``)."""
        from quire_gcs._stream import ResumableStream

        return ResumableStream(self, key, self.chunk_size)

    async def holds(self, key: str, data: bytes) -> str | None:
        st = await self.stat(key)
        if st is None or st.size != len(data):
            return None
        got = await self.get(key)
        return st.version if got == data else None

    async def _upload_if(self, key: str, data: bytes, generation: str, what: str) -> str:
        # Commit records are small: one upload, whatever resumable_threshold says.
        def lost(e: BaseException) -> bool:
            return isinstance(e, HTTPStatusError) and e.status == 412

        async def write(body: bytes) -> str:
            return await self._simple_upload(key, body, {"ifGenerationMatch": generation})

        return await self.conditional_put(
            "conditional upload", key, data, write, lost, what, missing="bucket"
        )

    async def put_if_absent(self, key: str, data: bytes) -> str:
        return await self._upload_if(key, data, "0", "exists")

    async def replace_if_match(self, key: str, data: bytes, version: str) -> str:
        return await self._upload_if(
            key, data, version, f"changed or vanished (expected generation {version})"
        )

    async def delete(self, keys: Sequence[str]) -> None:
        sem = asyncio.Semaphore(DELETE_CONCURRENCY)

        async def one(key: str) -> None:
            async def attempt(_n: int) -> None:
                await self._http("DELETE", self._object_url(key), ok=(200, 204, 404))

            async with sem:
                await self.run("delete", key, attempt)

        await gather_all([one(k) for k in keys])
