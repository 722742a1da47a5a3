"""What the built-in array handlers' leaf records say, as :class:`quire.metadata.LeafMetadata`.

The array handlers' own ``metadata`` (``numpy``, ``jax``) is :func:`describe_arrays`, over
the records as ``quire._format.describe`` reads them; :func:`describe` gives the same for
any handler id and reaches it without importing the handlers themselves (they import JAX).
:func:`built_in` says how each built-in handler's records read without numpy (a PRNG key's
as its key data, with the keys' shape): what ``quire info`` and ``quire ls`` show.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from quire._format.describe import BUILT_IN, ArrayRecord, array_record
from quire._format.dtypes import dtype_from_name
from quire._handlers.select import context_handler, get
from quire._runtime.registry import leaf_handlers
from quire.metadata import LeafMetadata


def _leaf(a: ArrayRecord) -> LeafMetadata:
    return LeafMetadata(
        shape=a.shape,
        dtype=dtype_from_name(a.dtype),
        nbytes=a.nbytes,
        handler=a.handler,
        chunk_shape=a.chunk_shape,
        codecs=a.codecs,
        checksum=a.checksum,
        sharding=a.sharding,
        location=a.location,
        codec_chain=a.codec_chain,
        filters=a.filters,
        lossy=a.lossy,
    )


def describe_arrays(records: Sequence[Mapping[str, Any]]) -> list[LeafMetadata]:
    """A :class:`quire.metadata.LeafMetadata` per array record (``numpy`` and ``jax`` leaves)."""
    return [_leaf(array_record(r)) for r in records]


def built_in(handler_id: str) -> Callable[[Mapping[str, Any]], Any] | None:
    """How a record of ``handler_id`` reads (``quire._format.describe.BUILT_IN``) when
    that id is a built-in handler here: not a Context's handler, a run-time registration or
    a plugin's of that name."""
    if context_handler(handler_id) is not None:
        return None
    return BUILT_IN.get(leaf_handlers.chosen(handler_id) or "")


def describe(
    handler_id: str, records: Sequence[Mapping[str, Any]], *, url: str | None = None
) -> list[Any]:
    """``get(handler_id).metadata(records)``: a built-in array handler's without importing
    it; any other handler's (inline ones, a Context's, a run-time registration, a plugin)
    by asking it."""
    if built_in(handler_id) is array_record:  # a PRNG key's dtype is JAX's: ask its handler
        return describe_arrays(records)
    return list(get(handler_id, url=url).metadata(records))
