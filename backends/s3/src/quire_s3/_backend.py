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
import functools
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

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

from quire import _objstore as objstore
from quire._budget import ByteBudget
from quire._config import current
from quire._objstore import RetriesExhausted, RetryPolicy, retrying
from quire.backends import Backend, Buffer, Capabilities, PreconditionFailed
from quire.errors import QuireError

__all__ = ["S3Backend", "S3BucketNotFoundError", "S3Error", "S3PermissionError"]

log = logging.getLogger("quire.s3")
T = TypeVar("T")
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
_SECRET_OPTIONS = ("key", "secret", "token", "username", "password")
_SECRET_CLIENT_KWARGS = ("aws_access_key_id", "aws_secret_access_key", "aws_session_token")


class S3Error(QuireError, OSError):
    """An S3 request failed for good: a permanent error, or transient ones past the deadline."""


class S3PermissionError(S3Error, PermissionError):
    """S3 refused the request (403, unknown key id, bad signature, no credentials)."""


class S3BucketNotFoundError(S3Error, FileNotFoundError):
    """The bucket of the URL does not exist."""


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


def _client_options(options: dict[str, Any]) -> dict[str, Any]:
    opts = dict(options)
    config = dict(opts.get("config_kwargs") or {})
    # One retry loop (ours, with its deadline) instead of botocore's nested in s3fs's.
    config.setdefault("retries", {"mode": "standard", "total_max_attempts": 1})
    # quire keeps many chunk transfers in flight; botocore's default pool is 10.
    config.setdefault("max_pool_connections", 64)
    opts["config_kwargs"] = config
    return opts


def _secrets(options: dict[str, Any]) -> list[str]:
    found = [options.get(k) for k in _SECRET_OPTIONS]
    ck = options.get("client_kwargs") or {}
    found += [ck.get(k) for k in _SECRET_CLIENT_KWARGS]
    return [s for s in found if isinstance(s, str) and len(s) >= 4]


def _safe_endpoint(url: str | None) -> str | None:
    """An endpoint URL without user:password@."""
    if not url:
        return url
    parts = urlsplit(url)
    if parts.username or parts.password:
        netloc = parts.hostname or ""
        if parts.port:
            netloc += f":{parts.port}"
        return urlunsplit(parts._replace(netloc=netloc))
    return url


# ----------------------------------------------------------------------------- clients
def _new_filesystem(options: dict[str, Any]) -> Any:
    from s3fs import S3FileSystem

    return S3FileSystem(
        asynchronous=True,
        loop=asyncio.get_running_loop(),
        skip_instance_cache=True,
        **options,
    )


async def _close_filesystem(fs: Any) -> None:
    creator = getattr(fs, "_s3creator", None)
    if creator is not None:
        fs._s3creator = fs._s3 = None
        with contextlib.suppress(Exception):
            await creator.__aexit__(None, None, None)


# One s3fs file system (aiobotocore client, connection pool) per option set on quire's loop.
_clients = objstore.ClientCache(_new_filesystem, _close_filesystem)


# ----------------------------------------------------------------------------- backend
class S3Backend(Backend):
    """Checkpoints under ``s3://bucket/prefix``.

    Parameters
    ----------
    url : str
        ``s3://bucket/path`` (or ``s3a://``).
    storage_options : dict, optional
        quire's keys ``retry_deadline`` (s, 120), ``retry_backoff`` (s, 0.1),
        ``retry_max_backoff`` (s, 10), ``upload_budget`` (bytes; ``quire.configure``'s
        ``byte_budget``), ``multipart_threshold`` (64 MiB), ``multipart_chunksize``
        (16 MiB), ``read_part_size`` (64 MiB); every other key goes to
        ``s3fs.S3FileSystem`` (``key``, ``secret``, ``endpoint_url``, ``profile``, ...).

    Notes
    -----
    A conditional write whose precondition fails checks whether the object holds exactly
    the bytes it sent: an earlier attempt whose reply was lost (retried by us, or repeated
    by the HTTP client on its own) may have written them, and then the call succeeds.
    quire's commit records are unique (txid, timestamp), so equal bytes mean this writer's.
    """

    capabilities = Capabilities(
        atomic_create=True,
        atomic_replace=True,
        durable=True,
        rename=False,
        readinto=True,
        stream_writes=True,
    )

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        super().__init__(url, storage_options)
        opts = dict(self.storage_options)
        self.retry = RetryPolicy.pop_from(opts)
        self.upload_budget = int(opts.pop("upload_budget", current().byte_budget))
        self.multipart_threshold = int(opts.pop("multipart_threshold", 64 * MiB))
        self.part_size = int(opts.pop("multipart_chunksize", 16 * MiB))
        self.read_part_size = max(1, int(opts.pop("read_part_size", 64 * MiB)))
        if self.part_size < MIN_PART:
            raise ValueError("multipart_chunksize must be at least 5 MiB (S3's minimum part)")
        self.multipart_threshold = max(self.multipart_threshold, self.part_size)
        self.bucket, self.root = objstore.split_bucket_url(url)
        self._options = _client_options(opts)
        self._token = repr(sorted(self._options.items(), key=lambda kv: kv[0]))
        self._secret_values = _secrets(opts)
        self._fs: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._private = False
        self._budget: ByteBudget | None = None

    # -- plumbing ----------------------------------------------------------------
    def _key(self, key: str) -> str:
        return f"{self.root}/{key}" if self.root else key

    def _where(self, key: str) -> str:
        return f"s3://{self.bucket}/{self._key(key)}"

    def _bind(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._fs, self._private = _clients.get(self._options, self._token)
            self._loop = loop
            self._budget = ByteBudget(self.upload_budget)

    async def _client(self) -> Any:
        self._bind()
        return await self._fs.set_session()  # (re)creates the client when needed

    def _kwargs(self, client: Any, method: str, key: str | None, **kw: Any) -> Any:
        kw["Bucket"] = self.bucket
        if key is not None:
            kw["Key"] = self._key(key)
        fn = getattr(client, method)
        return fn, self._fs._get_s3_method_kwargs(fn, **kw)

    async def _request(self, client: Any, method: str, key: str | None, **kw: Any) -> Any:
        fn, kwargs = self._kwargs(client, method, key, **kw)
        return await fn(**kwargs)

    def _endpoint(self) -> str | None:
        client = getattr(self._fs, "_s3", None)
        url = getattr(getattr(client, "meta", None), "endpoint_url", None)
        return url or self._options.get("endpoint_url")

    def _redact(self, text: str) -> str:
        for s in self._secret_values:
            text = text.replace(s, "***")
        return text

    def _describe(self, e: BaseException) -> str:
        if isinstance(e, ClientError):
            err = e.response.get("Error", {})
            msg = err.get("Message") or ""
            return self._redact(f"{_status(e) or '?'} {_code(e)}" + (f" ({msg})" if msg else ""))
        return self._redact(f"{type(e).__name__}: {e}")

    def _fail(self, e: Exception, op: str, key: str | None) -> Exception:
        """The error to raise for a failure that retrying cannot fix."""
        where = self._where(key) if key is not None else f"s3://{self.bucket}"
        if isinstance(e, RetriesExhausted):
            return S3Error(
                f"{where}: {op} kept failing with transient errors; gave up after "
                f"{e.attempts} attempts in {e.elapsed:.1f}s (storage_options "
                f"retry_deadline={self.retry.deadline:g}); last: {self._describe(e.last)}"
            )
        if isinstance(e, NoCredentialsError | PartialCredentialsError):
            return S3PermissionError(
                f"{where}: {op}: no usable AWS credentials ({type(e).__name__}); set "
                "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or a profile, pass "
                "storage_options key/secret, or anon=True for public buckets"
            )
        if not isinstance(e, ClientError):
            return e
        code = _code(e)
        if code == "NoSuchBucket":
            return S3BucketNotFoundError(
                f"{where}: {op}: bucket {self.bucket!r} does not exist "
                f"(endpoint {_safe_endpoint(self._endpoint())}); "
                "create it or fix the URL"
            )
        if _is_missing(e):
            return FileNotFoundError(f"{where} does not exist")
        if code in _DENIED_CODES or _status(e) in (401, 403):
            return S3PermissionError(
                f"{where}: {op} denied: {self._describe(e)}. Check the credentials "
                "(storage_options key/secret/profile, AWS_* environment, ~/.aws) and the "
                "bucket policy"
            )
        return S3Error(f"{where}: {op} failed: {self._describe(e)}")

    async def _run(self, op: str, key: str | None, attempt: Callable[[int], Awaitable[T]]) -> T:
        def on_retry(n: int, pause: float, e: BaseException) -> None:
            log.info(
                "%s: %s failed (%s); retry %d in %.2fs",
                self._where(key or ""),
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
            err = self._fail(e, op, key)
            if err is e:
                raise
            raise err from (e.last if isinstance(e, RetriesExhausted) else e)

    async def _call(self, op: str, method: str, key: str | None, **kw: Any) -> Any:
        async def attempt(_n: int) -> Any:
            return await self._request(await self._client(), method, key, **kw)

        return await self._run(op, key, attempt)

    # -- reads -------------------------------------------------------------------
    async def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        rng: dict[str, str] = {}
        if start is not None or end is not None:
            s = start or 0
            if end is not None and end <= s:
                await self.size(key)  # FileNotFoundError for a missing key, as for any read
                return b""
            rng["Range"] = f"bytes={s}-" + ("" if end is None else str(end - 1))

        async def attempt(_n: int) -> bytes:
            try:
                r = await self._request(await self._client(), "get_object", key, **rng)
            except ClientError as e:
                if _is_bad_range(e):
                    return b""
                raise
            async with r["Body"] as body:
                return bytes(await body.read())

        return await self._run("GetObject", key, attempt)

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
            client = await self._client()
            try:
                r = await self._request(
                    client, "get_object", key, Range=f"bytes={start}-{start + length - 1}"
                )
            except ClientError as e:
                if _is_bad_range(e):
                    return 0
                raise
            async with r["Body"] as body:
                return await objstore.read_into(body, views)

        return await self._run("GetObject", key, attempt)

    async def _head(self, key: str) -> dict[str, Any] | None:
        async def attempt(_n: int) -> dict[str, Any] | None:
            try:
                return dict(await self._request(await self._client(), "head_object", key))
            except ClientError as e:
                if _is_missing(e):
                    return None
                raise

        return await self._run("HeadObject", key, attempt)

    async def size(self, key: str) -> int:
        head = await self._head(key)
        if head is None:
            raise FileNotFoundError(f"{self._where(key)} does not exist")
        return int(head["ContentLength"])

    async def exists(self, key: str) -> bool:
        return await self._head(key) is not None

    async def version(self, key: str) -> str | None:
        head = await self._head(key)
        return None if head is None else str(head["ETag"])

    async def modified(self, key: str) -> float | None:
        head = await self._head(key)
        if head is None:
            raise FileNotFoundError(f"{self._where(key)} does not exist")
        when = head.get("LastModified")
        return when.timestamp() if when is not None else None

    async def _listing(
        self, prefix: str, limit: int | None = None, delimiter: str | None = None
    ) -> tuple[builtins.list[str], builtins.list[str]]:
        """Keys starting with ``prefix`` (and common prefixes, with a ``delimiter``)."""
        keys: builtins.list[str] = []
        dirs: builtins.list[str] = []
        token: str | None = None
        while True:
            kw: dict[str, Any] = {"Prefix": prefix}
            if token:
                kw["ContinuationToken"] = token
            if limit:
                kw["MaxKeys"] = limit
            if delimiter:
                kw["Delimiter"] = delimiter
            page = await self._call("ListObjectsV2", "list_objects_v2", None, **kw)
            keys += [o["Key"] for o in page.get("Contents", ())]
            dirs += [p["Prefix"] for p in page.get("CommonPrefixes", ())]
            token = page.get("NextContinuationToken")
            if not token or not page.get("IsTruncated") or (limit and len(keys) >= limit):
                return keys, dirs

    async def _list(self, prefix: str, limit: int | None) -> builtins.list[str]:
        return (await self._listing(prefix, limit))[0]

    async def list(self, prefix: str = "") -> builtins.list[str]:
        return await objstore.list_under(self._list, self.root, prefix)

    async def list_dir(self, prefix: str = "") -> tuple[builtins.list[str], builtins.list[str]]:
        under = objstore.dir_prefix(self.root, prefix)
        keys, dirs = await self._listing(under, delimiter="/")
        return objstore.dir_entries(under, keys, dirs)

    # -- writes ------------------------------------------------------------------
    async def put(self, key: str, data: Sequence[Buffer]) -> None:
        views = objstore.views(data)
        total = sum(v.nbytes for v in views)
        if total >= self.multipart_threshold:
            await self._put_multipart(key, views, total)
            return
        self._bind()
        assert self._budget is not None
        async with self._budget.hold(total):
            await self._call("PutObject", "put_object", key, Body=_join(views))

    async def stream_writer(self, key: str) -> Any:
        """A multipart upload fed by concurrent writes at offsets (``quire_s3._stream``)."""
        from quire_s3._stream import MultipartStream

        self._bind()
        mpu = await self._call("CreateMultipartUpload", "create_multipart_upload", key)
        return MultipartStream(self, key, mpu["UploadId"], self.part_size)

    async def _put_multipart(self, key: str, views: builtins.list[memoryview], total: int) -> None:
        self._bind()
        budget = self._budget
        assert budget is not None
        size = max(self.part_size, -(-total // MAX_PARTS))
        mpu = await self._call("CreateMultipartUpload", "create_multipart_upload", key)
        upload_id = mpu["UploadId"]

        async def part(number: int, a: int, b: int) -> dict[str, Any]:
            async with budget.hold(b - a):
                body = _join(objstore.byte_slice(views, a, b))
                r = await self._call(
                    "UploadPart", "upload_part", key,
                    UploadId=upload_id, PartNumber=number, Body=body,
                )  # fmt: skip
            return {"PartNumber": number, "ETag": r["ETag"]}

        try:
            parts = await objstore.gather_all(
                [part(i + 1, a, min(a + size, total)) for i, a in enumerate(range(0, total, size))]
            )

            async def complete(n: int) -> None:
                try:
                    await self._request(
                        await self._client(), "complete_multipart_upload", key,
                        UploadId=upload_id, MultipartUpload={"Parts": parts},
                    )  # fmt: skip
                except ClientError as e:
                    # An earlier attempt completed it and its reply was lost.
                    if n and _code(e) == "NoSuchUpload":
                        head = await self._head(key)
                        if head is not None and int(head["ContentLength"]) == total:
                            return
                    raise

            await self._run("CompleteMultipartUpload", key, complete)
        except BaseException:
            with contextlib.suppress(Exception):
                await self._request(
                    await self._client(), "abort_multipart_upload", key, UploadId=upload_id
                )
            raise

    async def _holds(self, key: str, data: bytes) -> str | None:
        """The ETag of ``key`` if it holds exactly ``data`` (an earlier attempt wrote it)."""
        try:
            r = await self._request(await self._client(), "get_object", key)
        except ClientError as e:
            if _is_missing(e):
                return None
            raise
        async with r["Body"] as body:
            got = await body.read()
        return str(r["ETag"]) if got == data else None

    async def _conditional_put(self, key: str, data: bytes, condition: dict[str, str]) -> str:
        body = bytes(data)

        async def attempt(_n: int) -> str:
            try:
                r = await self._request(await self._client(), "put_object", key, Body=body,
                                        **condition)  # fmt: skip
                return str(r["ETag"])
            except ClientError as e:
                if not (_is_precondition(e) or ("IfMatch" in condition and _is_missing(e))):
                    raise
            # An earlier attempt - ours, or one the HTTP client repeated on its own after a
            # lost reply - may have written it: then the key holds exactly our bytes.
            mine = await self._holds(key, body)
            if mine is not None:
                return mine
            if "IfMatch" in condition:
                raise PreconditionFailed(
                    f"{self._where(key)} changed or vanished (expected {condition['IfMatch']})"
                )
            raise PreconditionFailed(f"{self._where(key)} exists")

        return await self._run(f"PutObject({next(iter(condition))})", key, attempt)

    async def put_if_absent(self, key: str, data: bytes) -> str:
        return await self._conditional_put(key, data, {"IfNoneMatch": "*"})

    async def replace_if_match(self, key: str, data: bytes, version: str) -> str:
        return await self._conditional_put(key, data, {"IfMatch": version})

    async def delete(self, keys: Sequence[str]) -> None:
        full = [self._key(k) for k in keys]
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

        await objstore.gather_all(
            [batch(full[i : i + DELETE_BATCH]) for i in range(0, len(full), DELETE_BATCH)]
        )

    async def close(self) -> None:
        if self._fs is not None:
            await _clients.release(self._fs, self._private)
        self._fs = self._loop = None
