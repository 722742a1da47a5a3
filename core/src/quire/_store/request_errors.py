"""The error side of :class:`quire.backends.ObjectStoreBackend`: naming keys in messages,
keeping credentials out of them, and turning a failed request into a ``quire.errors`` type.

A mixin of :class:`~quire._store.object_backend.ObjectStoreBackend` (published through it); the
hooks a backend overrides (:meth:`is_transient`, :meth:`describe`, :meth:`map_error`,
:meth:`endpoint`) are documented there.
"""

from __future__ import annotations

import asyncio
import socket
from typing import ClassVar
from urllib.parse import urlsplit

from quire._store.endpoints import name_resolution_error
from quire._store.retries import RetriesExhausted, RetryPolicy
from quire.errors import (
    BucketNotFoundError,
    EndpointUnreachableError,
    ObjectStoreError,
    ObjectStorePermissionError,
)


class ErrorMapping:
    """Messages and error types of an object-store backend (see ``ObjectStoreBackend``)."""

    scheme: ClassVar[str]
    error: ClassVar[type[ObjectStoreError]] = ObjectStoreError
    permission_error: ClassVar[type[ObjectStoreError]] = ObjectStorePermissionError
    bucket_error: ClassVar[type[ObjectStoreError]] = BucketNotFoundError
    endpoint_error: ClassVar[type[ObjectStoreError]] = EndpointUnreachableError
    bucket: str
    root: str
    retry: RetryPolicy
    _secret_values: list[str]

    # -- hooks: errors --------------------------------------------------------------------
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

    def endpoint(self) -> str | None:
        """The endpoint URL requests go to, for messages (None when unknown)."""
        return None

    def redact(self, text: str) -> str:
        """``text`` with every credential this backend was given replaced by ``***``.

        Parameters
        ----------
        text : str
            A message or log line.
        """
        for s in self._secret_values:
            text = text.replace(s, "***")
        return text

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

    def denied(self, e: BaseException, op: str, key: str | None, fix: str) -> Exception:
        """The ``permission_error`` for a refused request; ``fix`` says where credentials
        come from.

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
        return self.permission_error(
            f"{self.where(key)}: {op} denied: {self.redact(self.describe(e))}. {fix}"
        )

    def no_bucket(self, op: str, key: str | None) -> Exception:
        """The ``bucket_error`` for a bucket that does not exist.

        Parameters
        ----------
        op, key
            As for :meth:`denied`.
        """
        return self.bucket_error(
            f"{self.where(key)}: {op}: bucket {self.bucket!r} does not exist (endpoint "
            f"{self.endpoint()}); create it or fix the URL"
        )

    def failed(self, e: BaseException, op: str, key: str | None) -> Exception:
        """The ``error`` for any other permanent failure.

        Parameters
        ----------
        e, op, key
            As for :meth:`denied`.
        """
        return self.error(f"{self.where(key)}: {op} failed: {self.redact(self.describe(e))}")

    def _fail(self, e: Exception, op: str, key: str | None, missing: str) -> Exception:
        where = self.where(key)
        if isinstance(e, RetriesExhausted):
            return self.error(
                f"{where}: {op} kept failing with transient errors; gave up after "
                f"{e.attempts} attempts in {e.elapsed:.1f}s (storage_options "
                f"retry_deadline={self.retry.deadline:g}); last: {self.redact(self.describe(e.last))}"
            )
        dns = name_resolution_error(e)
        if dns is not None:
            return self._unresolved(dns, op, key)
        mapped = self.map_error(e, op, key, missing)
        return e if mapped is None else mapped

    def _unresolved(self, dns: socket.gaierror, op: str, key: str | None) -> Exception:
        endpoint = self.endpoint()
        host = urlsplit(endpoint).hostname if endpoint else None
        return self.endpoint_error(
            f"{self.where(key)}: {op}: cannot resolve host {host or '?'!r} of endpoint "
            f"{endpoint or '?'} ({dns.strerror or dns}); check the network and "
            "storage_options endpoint_url"
        )
