"""The S3 backend: aiobotocore calls through an s3fs-configured client.

s3fs turns ``storage_options`` (plus fsspec's config files and the ``AWS_*`` environment)
into an aiobotocore client; every request is then made here, straight on that client, so
that the commit uses S3's own preconditions and every call shares one retry policy:

* ``put_if_absent`` is ``PutObject`` with ``If-None-Match: *`` and ``replace_if_match`` is
  ``PutObject`` with ``If-Match: <etag>`` (412 / a vanished key = :class:`PreconditionFailed`);
  nothing is ever "renamed" by copy + delete;
* ``put`` uploads objects of ``multipart_threshold`` bytes or more as concurrent multipart
  parts; every upload holds its bytes in one byte budget per backend;
* ``get`` / ``get_into`` read byte ranges (zarr shards are read chunk by chunk) and stream
  into the caller's buffers, as concurrent ranges for large objects;
* 5xx, throttling, resets and timeouts are retried with jittered backoff up to a deadline;
  403, bad credentials and a missing bucket fail at once.

botocore's and s3fs's own retry loops are switched off (unless ``config_kwargs["retries"]``
is given) so that the deadline is the only one.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import logging
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import aiohttp
from botocore.exceptions import (
    ClientError,
    HTTPClientError,
    IncompleteReadError,
    NoCredentialsError,
    PartialCredentialsError,
    ResponseStreamingError,
    SSLError,
)
from botocore.exceptions import ConnectionError as BotoConnectionError
from botocore.parsers import ResponseParserError

from quire import errors
from quire.backends import ObjectInfo, ObjectStoreBackend, gather_all, read_into

__all__ = [
    "S3Backend",
    "S3BucketNotFoundError",
    "S3EndpointError",
    "S3Error",
    "S3PermissionError",
]

log = logging.getLogger("quire.s3")
MiB = 1 << 20
MIN_PART = 5 * MiB  # S3's smallest multipart part (but the last)
MAX_PARTS = 10_000
DELETE_BATCH = 1000  # DeleteObjects' limit

_TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "InternalError",
        "ServiceUnavailable",
        "RequestTimeout",
        "Throttling",
        "ThrottlingException",
        "TooManyRequests",
        "RequestLimitExceeded",
        "ProvisionedThroughputExceededException",
        "BandwidthLimitExceeded",
        # A concurrent conditional write to the key is in progress: AWS says retry. The
        # retry then either wins or gets 412 - the true answer - never a guess.
        "ConditionalRequestConflict",
        "OperationAborted",
    }
)
_TRANSIENT_ERRORS = (
    BotoConnectionError,  # refused / reset while sending, connect timeouts
    HTTPClientError,  # closed / reset while reading, read timeouts
    ResponseStreamingError,
    IncompleteReadError,
    ResponseParserError,  # throttling replies are sometimes not valid XML
    aiohttp.ClientError,
    asyncio.TimeoutError,
    ConnectionError,
)
_DENIED_CODES = frozenset(
    {
        "AccessDenied",
        "AllAccessDisabled",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "InvalidToken",
        "TokenRefreshRequired",
        "AccountProblem",
    }
)


class S3Error(errors.ObjectStoreError):
    """An S3 request failed for good: a permanent error, or transient ones past the deadline."""


class S3PermissionError(S3Error, errors.ObjectStorePermissionError):
    """S3 refused the request (403, unknown key id, bad signature, no credentials)."""


class S3BucketNotFoundError(S3Error, errors.BucketNotFoundError):
    """The bucket of the URL does not exist."""


class S3EndpointError(S3Error, errors.EndpointUnreachableError):
    """The endpoint's host name does not resolve (no network, or a wrong endpoint_url)."""


# ----------------------------------------------------------------------------- helpers
def _status(e: ClientError) -> int:
    return int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)


def _code(e: ClientError) -> str:
    return str(e.response.get("Error", {}).get("Code") or "")


def _is_transient(e: BaseException) -> bool:
    if isinstance(e, ClientError):
        return _code(e) in _TRANSIENT_CODES or _status(e) in (429, 500, 502, 503, 504)
    if isinstance(e, SSLError):  # a certificate problem does not heal
        return False
    return isinstance(e, _TRANSIENT_ERRORS)


def _is_missing(e: BaseException) -> bool:
    return isinstance(e, ClientError) and _code(e) in ("NoSuchKey", "404", "NotFound")


def _is_precondition(e: BaseException) -> bool:
    return isinstance(e, ClientError) and (_code(e) == "PreconditionFailed" or _status(e) == 412)


def _is_bad_range(e: BaseException) -> bool:
    return isinstance(e, ClientError) and (_code(e) == "InvalidRange" or _status(e) == 416)


def _join(views: Sequence[memoryview]) -> bytes:
    """One ``bytes`` body (botocore takes no memoryviews); no copy of a lone bytes object."""
    if len(views) == 1 and isinstance(views[0].obj, bytes) and views[0].nbytes == len(views[0].obj):
        return views[0].obj
    return b"".join(views)


# ----------------------------------------------------------------------------- backend
class S3Backend(ObjectStoreBackend):
    """Checkpoints under ``s3://bucket/prefix`` (or ``s3a://``).

    Storage options: those of :class:`quire.backends.ObjectStoreBackend` (``retry_*``,
    ``upload_budget``, ``read_part_size``), then ``multipart_threshold`` (64 MiB) and
    ``multipart_chunksize`` (16 MiB, at least S3's 5 MiB); every other key goes to
    ``s3fs.S3FileSystem`` (``key``, ``secret``, ``endpoint_url``, ``profile``, ...).

    A conditional write that loses checks whether the object holds exactly its bytes
    (an earlier attempt, retried by us or repeated by the HTTP client, may have made it;
    commit records are unique, so equal bytes are this writer's): then it succeeds.
    """

    # Commits by conditional request (If-None-Match / If-Match, generation preconditions)
    # and packs streamed as multipart / resumable uploads, over the object-store base's.
    capabilities = replace(
        ObjectStoreBackend.capabilities, atomic_create=True, atomic_replace=True, stream_writes=True
    )
    scheme = "s3"
    log = log
    error = S3Error
    permission_error = S3PermissionError
    bucket_error = S3BucketNotFoundError
    endpoint_error = S3EndpointError
    fsspec_class = "s3fs.S3FileSystem"
    secret_options = (
        "key", "secret", "token", "username", "password",
        "aws_access_key_id", "aws_secret_access_key", "aws_session_token",
    )  # fmt: skip

    def configure(self, options: dict[str, Any]) -> dict[str, Any]:
        self.multipart_threshold = int(options.pop("multipart_threshold", 64 * MiB))
        self.part_size = int(options.pop("multipart_chunksize", 16 * MiB))
        if self.part_size < MIN_PART:
            raise ValueError("multipart_chunksize must be at least 5 MiB (S3's minimum part)")
        self.large_threshold = self.multipart_threshold = max(
            self.multipart_threshold, self.part_size
        )
        config = dict(options.get("config_kwargs") or {})
        # One retry loop (ours, with its deadline) instead of botocore's nested in s3fs's.
        config.setdefault("retries", {"mode": "standard", "total_max_attempts": 1})
        # quire keeps many chunk transfers in flight; botocore's default pool is 10.
        config.setdefault("max_pool_connections", 64)
        self.max_requests = int(config["max_pool_connections"])
        return {**options, "config_kwargs": config}

    # -- clients -----------------------------------------------------------------
    @staticmethod
    async def close_client(client: Any) -> None:
        creator = getattr(client, "_s3creator", None)
        if creator is not None:
            client._s3creator = client._s3 = None
            with contextlib.suppress(Exception):
                await creator.__aexit__(None, None, None)

    @staticmethod
    def connections_in_use(client: Any) -> int:
        # s3fs's aiobotocore client keeps its aiohttp sessions in its endpoint's session.
        hs = getattr(getattr(getattr(client, "_s3", None), "_endpoint", None), "http_session", None)
        sessions = list(getattr(hs, "_sessions", {}).values())
        return sum(
            len(getattr(s.connector, "_acquired", ()) or ()) for s in sessions if s.connector
        )

    async def _client(self) -> Any:
        return await self.client.set_session()  # (re)creates the client when needed

    async def _request(self, method: str, key: str | None, **kw: Any) -> Any:
        client = await self._client()
        kw["Bucket"] = self.bucket
        if key is not None:
            kw["Key"] = self.key(key)
        fn = getattr(client, method)
        return await fn(**self.client._get_s3_method_kwargs(fn, **kw))

    async def _call(self, op: str, method: str, key: str | None, **kw: Any) -> Any:
        body = kw.get("Body")
        nbytes = len(body) if body is not None else 0
        return await self.run(op, key, lambda _n: self._request(method, key, **kw), nbytes=nbytes)

    async def abort_upload(self, key: str, upload_id: str) -> None:
        """Abort a multipart upload after a failure already being reported: one try,
        within a request deadline; a failure here leaves only an incomplete upload,
        which the bucket's lifecycle rule (or ``quire gc``'s listing) cleans up."""
        with contextlib.suppress(Exception):  # broad: clean-up after a failure being raised
            async with asyncio.timeout(self.request_deadline()):
                await self._request("abort_multipart_upload", key, UploadId=upload_id)

    # -- errors ------------------------------------------------------------------
    def endpoint(self) -> str | None:
        client = getattr(self.existing_client, "_s3", None)
        url = getattr(getattr(client, "meta", None), "endpoint_url", None)
        return url or self.client_options.get("endpoint_url") or "https://s3.amazonaws.com"

    def is_transient(self, e: BaseException) -> bool:
        return _is_transient(e)

    def describe(self, e: BaseException) -> str:
        if isinstance(e, ClientError):
            msg = e.response.get("Error", {}).get("Message") or ""
            return f"{_status(e) or '?'} {_code(e)}" + (f" ({msg})" if msg else "")
        return f"{type(e).__name__}: {e}"

    def map_error(self, e: Exception, op: str, key: str | None, missing: str) -> Exception | None:
        if isinstance(e, NoCredentialsError | PartialCredentialsError):
            return S3PermissionError(
                f"{self.where(key)}: {op}: no usable AWS credentials ({type(e).__name__}); set "
                "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or a profile, pass "
                "storage_options key/secret, or anon=True for public buckets"
            )
        if not isinstance(e, ClientError):
            return None
        if _code(e) == "NoSuchBucket":
            return self.no_bucket(op, key)
        if _is_missing(e):
            return FileNotFoundError(f"{self.where(key)} does not exist")
        if _code(e) in _DENIED_CODES or _status(e) in (401, 403):
            fix = "Check the credentials (storage_options key/secret/profile, AWS_* environment, "
            return self.denied(e, op, key, fix + "~/.aws) and the bucket policy")
        return self.failed(e, op, key)

    # -- reads -------------------------------------------------------------------
    async def _get_object(self, key: str, start: int, end: int | None) -> Any:
        rng = f"bytes={start}-" + ("" if end is None else str(end - 1))
        try:
            return await self._request(
                "get_object", key, **({"Range": rng} if start or end else {})
            )
        except ClientError as e:
            if _is_bad_range(e):
                return None
            raise

    async def read_range(self, key: str, start: int, end: int | None) -> bytes:
        r = await self._get_object(key, start, end)
        if r is None:
            return b""
        async with r["Body"] as body:
            return bytes(await body.read())

    async def read_range_into(
        self, key: str, start: int, views: builtins.list[memoryview], length: int
    ) -> int:
        r = await self._get_object(key, start, start + length)
        if r is None:
            return 0
        async with r["Body"] as body:
            return await read_into(body, views)

    async def _head(self, key: str) -> dict[str, Any] | None:
        async def attempt(_n: int) -> dict[str, Any] | None:
            try:
                return dict(await self._request("head_object", key))
            except ClientError as e:
                if _is_missing(e):
                    return None
                raise

        return await self.run("HeadObject", key, attempt)

    async def stat(self, key: str) -> ObjectInfo | None:
        head = await self._head(key)
        if head is None:
            return None
        when = head.get("LastModified")
        return ObjectInfo(
            int(head["ContentLength"]),
            str(head["ETag"]),
            when.timestamp() if when is not None else None,
        )

    async def list_page(
        self, prefix: str, token: str | None, limit: int | None, delimiter: str | None
    ) -> tuple[builtins.list[str], builtins.list[str], str | None]:
        kw: dict[str, Any] = {"Prefix": prefix}
        if token:
            kw["ContinuationToken"] = token
        if limit:
            kw["MaxKeys"] = limit
        if delimiter:
            kw["Delimiter"] = delimiter
        page = await self._call("ListObjectsV2", "list_objects_v2", None, **kw)
        more = page.get("NextContinuationToken") if page.get("IsTruncated") else None
        return (
            [o["Key"] for o in page.get("Contents", ())],
            [p["Prefix"] for p in page.get("CommonPrefixes", ())],
            more,
        )

    # -- writes ------------------------------------------------------------------
    async def put_small(self, key: str, views: builtins.list[memoryview], total: int) -> None:
        await self._call("PutObject", "put_object", key, Body=_join(views))

    async def stream_writer(self, key: str) -> Any:
        """A multipart upload fed by concurrent writes at offsets (``quire_s3._stream``)."""
        from quire_s3._stream import MultipartStream

        return MultipartStream(self, key, self.part_size)

    async def put_large(self, key: str, views: builtins.list[memoryview], total: int) -> None:
        size = max(self.part_size, -(-total // MAX_PARTS))
        mpu = await self._call("CreateMultipartUpload", "create_multipart_upload", key)
        upload_id = mpu["UploadId"]

        async def part(number: int, piece: builtins.list[memoryview]) -> dict[str, Any]:
            r = await self._call(
                "UploadPart", "upload_part", key,
                UploadId=upload_id, PartNumber=number, Body=_join(piece),
            )  # fmt: skip
            return {"PartNumber": number, "ETag": r["ETag"]}

        try:
            parts = await self.upload_parts(views, total, size, part)

            await self.complete_upload(key, upload_id, parts, total)
        except BaseException:
            await self.abort_upload(key, upload_id)
            raise

    async def complete_upload(
        self, key: str, upload_id: str | None, parts: builtins.list[Any], total: int
    ) -> None:
        """``CompleteMultipartUpload``, retried; an attempt whose reply was lost may have
        completed it: then the retry's ``NoSuchUpload`` is success if the object has
        ``total`` bytes."""

        async def complete(n: int) -> None:
            try:
                await self._request(
                    "complete_multipart_upload", key,
                    UploadId=upload_id, MultipartUpload={"Parts": parts},
                )  # fmt: skip
            except ClientError as e:
                if n and _code(e) == "NoSuchUpload":
                    head = await self._head(key)
                    if head is not None and int(head["ContentLength"]) == total:
                        return
                raise

        # The server assembles the parts before it answers: time for reading ``total``.
        await self.run("CompleteMultipartUpload", key, complete, nbytes=total)

    async def holds(self, key: str, data: bytes) -> str | None:
        # One GET gives the bytes and the ETag of the same version.
        try:
            r = await self._request("get_object", key)
        except ClientError as e:
            if _is_missing(e):
                return None
            raise
        async with r["Body"] as body:
            got = await body.read()
        return str(r["ETag"]) if got == data else None

    async def _put_if(self, key: str, data: bytes, condition: dict[str, str], what: str) -> str:
        async def write(body: bytes) -> str:
            return str((await self._request("put_object", key, Body=body, **condition))["ETag"])

        def lost(e: BaseException) -> bool:
            return _is_precondition(e) or ("IfMatch" in condition and _is_missing(e))

        op = f"PutObject({next(iter(condition))})"
        return await self.conditional_put(op, key, data, write, lost, what)

    async def put_if_absent(self, key: str, data: bytes) -> str:
        return await self._put_if(key, data, {"IfNoneMatch": "*"}, "exists")

    async def replace_if_match(self, key: str, data: bytes, version: str) -> str:
        what = f"changed or vanished (expected {version})"
        return await self._put_if(key, data, {"IfMatch": version}, what)

    async def delete(self, keys: Sequence[str]) -> None:
        full = [self.key(k) for k in keys]
        if not full:
            return

        async def batch(chunk: builtins.list[str]) -> None:
            r = await self._call(
                "DeleteObjects", "delete_objects", None,
                Delete={"Objects": [{"Key": k} for k in chunk], "Quiet": True},
            )  # fmt: skip
            errors = [e for e in r.get("Errors", ()) if e.get("Code") != "NoSuchKey"]
            if errors:
                first = errors[0]
                raise S3Error(
                    f"s3://{self.bucket}: could not delete {len(errors)} object(s), e.g. "
                    f"{first.get('Key')}: {first.get('Code')} ({first.get('Message')})"
                )

        await gather_all(
            [batch(full[i : i + DELETE_BATCH]) for i in range(0, len(full), DELETE_BATCH)]
        )
