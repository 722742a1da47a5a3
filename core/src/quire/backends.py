"""The storage backend contract.

A backend gives quire byte-level access to one checkpoint root (a URL prefix).  All keys
are ``/``-separated paths relative to that root.  Third-party backends subclass
:class:`Backend` and register under the ``quire.backends`` entry-point group, with the
URL protocol as the name.

Call order during a save (the commit point is marked)::

    put(...)* ; sync()                     # every process writes the chunks it owns
    put(zarr metadata)* ; sync()           # primary process, after the barrier
    put_if_absent("quire.json")            # <-- COMMIT (new checkpoint)
    replace_if_match("quire.json", v)      # <-- COMMIT (overwrite)
    delete_prefix(old data)                # after the commit only

A backend declares what it guarantees through :class:`Capabilities`; quire never probes
by trial and error.

Toolkit for backends over object stores (what quire-s3 and quire-gcs are built on):
:class:`ObjectStoreBackend` (retries with a deadline, fail-fast on unresolvable hosts,
byte budget, credential redaction, part uploads, an error-mapping hook),
:class:`RetryPolicy` / :func:`retrying` / :class:`RetriesExhausted`, :class:`ByteBudget`,
and the buffer helpers :func:`byte_slice`, :func:`read_into`, :func:`gather_all` and
:class:`PartBuffers`.
"""

from __future__ import annotations

from quire._runtime.budget import ByteBudget
from quire._runtime.tasks import gather_all
from quire._store.base import (
    QUIRE_STORAGE_OPTIONS,
    Backend,
    Buffer,
    Capabilities,
    PreconditionFailed,
)
from quire._store.buffers import PartBuffers, byte_slice, read_into
from quire._store.object_backend import ObjectStoreBackend
from quire._store.object_hooks import ObjectInfo
from quire._store.retries import RetriesExhausted, RetryPolicy, retrying

__all__ = [
    "QUIRE_STORAGE_OPTIONS",
    "Backend",
    "Buffer",
    "ByteBudget",
    "Capabilities",
    "ObjectInfo",
    "ObjectStoreBackend",
    "PartBuffers",
    "PreconditionFailed",
    "RetriesExhausted",
    "RetryPolicy",
    "byte_slice",
    "gather_all",
    "read_into",
    "retrying",
]
