"""The error side of :class:`quire.backends.ObjectStoreBackend`: a failed request turned into
a ``quire.errors`` type whose message names the object, with every credential the backend was
given replaced by ``***``.

:class:`RequestErrors` is the backend's part that does it; it asks the backend only for the
hooks of :class:`ErrorHooks` (documented on ``ObjectStoreBackend``, which a backend
overrides).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import urlsplit

from quire._store.endpoints import name_resolution_error
from quire._store.retries import RetriesExhausted
from quire.errors import ObjectStoreError


@dataclass(frozen=True)
class ErrorTypes:
    """The ``quire.errors`` subclasses one backend raises, by role.

    Attributes
    ----------
    error, permission, bucket, endpoint : type
        Any permanent failure; a refused request; a bucket that does not exist; an
        endpoint whose host name does not resolve.
    """

    error: type[ObjectStoreError]
    permission: type[ObjectStoreError]
    bucket: type[ObjectStoreError]
    endpoint: type[ObjectStoreError]


class ErrorHooks(Protocol):
    """What :class:`RequestErrors` asks of its backend (``ObjectStoreBackend``'s hooks)."""

    def where(self, key: str | None) -> str: ...
    def endpoint(self) -> str | None: ...
    def describe(self, e: BaseException) -> str: ...
    def map_error(
        self, e: Exception, op: str, key: str | None, missing: str
    ) -> Exception | None: ...


class RequestErrors:
    """Messages and error types of one backend's failed requests.

    Parameters
    ----------
    hooks : ErrorHooks
        The backend: where a key is, its endpoint, a failure in one line, its own mapping.
    types : ErrorTypes
        The error types it raises.
    bucket : str
        Its bucket, for messages.
    secrets : list of str
        Strings that must never appear in a message or log line.
    retry_deadline : float
        The retry deadline, for the message of transient failures that outlasted it.
    """

    def __init__(
        self,
        hooks: ErrorHooks,
        types: ErrorTypes,
        bucket: str,
        secrets: list[str],
        retry_deadline: float,
    ) -> None:
        self._hooks = hooks
        self._types = types
        self._bucket = bucket
        self._secrets = list(secrets)
        self._retry_deadline = retry_deadline

    def redact(self, text: str) -> str:
        """``text`` with every secret replaced by ``***``."""
        for s in self._secrets:
            text = text.replace(s, "***")
        return text

    def _said(self, e: BaseException) -> str:
        return self.redact(self._hooks.describe(e))

    def denied(self, e: BaseException, op: str, key: str | None, fix: str) -> Exception:
        """The permission error for a refused request; ``fix`` says where credentials
        come from."""
        return self._types.permission(
            f"{self._hooks.where(key)}: {op} denied: {self._said(e)}. {fix}"
        )

    def no_bucket(self, op: str, key: str | None) -> Exception:
        """The error for a bucket that does not exist."""
        return self._types.bucket(
            f"{self._hooks.where(key)}: {op}: bucket {self._bucket!r} does not exist (endpoint "
            f"{self._hooks.endpoint()}); create it or fix the URL"
        )

    def failed(self, e: BaseException, op: str, key: str | None) -> Exception:
        """The error for any other permanent failure."""
        return self._types.error(f"{self._hooks.where(key)}: {op} failed: {self._said(e)}")

    def final(self, e: Exception, op: str, key: str | None, missing: str) -> Exception:
        """What a request that failed for good raises: for transient failures past the
        deadline and unresolvable hosts, this backend's error; else what the backend's
        ``map_error`` says, or ``e`` itself."""
        where = self._hooks.where(key)
        if isinstance(e, RetriesExhausted):
            return self._types.error(
                f"{where}: {op} kept failing with transient errors; gave up after "
                f"{e.attempts} attempts in {e.elapsed:.1f}s (storage_options "
                f"retry_deadline={self._retry_deadline:g}); last: {self._said(e.last)}"
            )
        dns = name_resolution_error(e)
        if dns is not None:
            return self._unresolved(dns, op, key)
        mapped = self._hooks.map_error(e, op, key, missing)
        return e if mapped is None else mapped

    def _unresolved(self, dns: socket.gaierror, op: str, key: str | None) -> Exception:
        endpoint = self._hooks.endpoint()
        host = urlsplit(endpoint).hostname if endpoint else None
        return self._types.endpoint(
            f"{self._hooks.where(key)}: {op}: cannot resolve host {host or '?'!r} of endpoint "
            f"{endpoint or '?'} ({dns.strerror or dns}); check the network and "
            "storage_options endpoint_url"
        )
