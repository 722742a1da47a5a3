"""``OrbaxSource``: an Orbax checkpoint opened read-only as a lazy quire tree.

Metadata comes from orbax's JSON files (:mod:`quire_orbax._layout`); array bytes come from
tensorstore (the zarr / zarr3 driver over the file kvstore, or over the OCDBT kvstore based at
the item directory), reading only the chunks a region covers.  tensorstore is imported on
:meth:`OrbaxSource.open`, never on ``import quire`` or on detection.
"""

from __future__ import annotations

from typing import Any, ClassVar

import jax
import numpy as np

from quire.errors import (
    CorruptCheckpointError,
    EndpointUnreachableError,
    ObjectStorePermissionError,
    PluginError,
)
from quire.sources import LazyArray, Region, Source
from quire_orbax import _layout
from quire_orbax._layout import ARRAY_TYPES, Layout, PytreeItem
from quire_orbax._store import PROTOCOLS, Store, protocol

# OCDBT b-tree nodes are cached per source (array chunks are not: each is read once).
_OCDBT_CACHE_BYTES = 64 << 20


def _tensorstore() -> Any:
    try:
        import tensorstore as ts
    except ImportError as e:  # pragma: no cover - tensorstore is a hard dependency
        raise PluginError(
            "quire-orbax needs tensorstore to read Orbax arrays: pip install tensorstore"
        ) from e
    return ts


def array_spec(store: Store, item: PytreeItem, param: str) -> dict[str, Any]:
    """The tensorstore spec of one orbax array, as orbax itself builds it for reading."""
    if item.use_ocdbt:
        kvstore: dict[str, Any] = {
            "driver": "ocdbt",
            "base": store.kvstore(item.path),
            "path": param,
            "cache_pool": "cache_pool#ocdbt",
        }
    else:
        kvstore = store.kvstore(f"{item.path.rstrip('/')}/{param}")
    return {
        "driver": "zarr3" if item.use_zarr3 else "zarr",
        "kvstore": kvstore,
        "recheck_cached_data": False,
        "recheck_cached_metadata": False,
        # Orbax writes every chunk (even all-fill ones): a missing chunk is damage, never zeros.
        "fill_missing_data_reads": False,
    }


class TensorstoreReader:
    """A :class:`quire.sources.RegionReader` over one opened tensorstore array."""

    def __init__(self, store: Any, url: str, key: str, where: Store | None = None) -> None:
        self.store = store
        self.url = url
        self.key = key
        self._where = where  # keeps the location (and its credentials file) alive

    async def read_region(self, region: Region) -> np.ndarray:
        try:
            out = await self.store[region].read()
        except Exception as e:
            raise storage_error(e, f"{self.url}: reading {self.key}{list(region)}") from e
        # Not np.ascontiguousarray: it turns a 0-d array into a 1-d one.
        return np.require(out, requirements="C")


def storage_error(e: Exception, what: str) -> Exception:
    """The quire error for a failed tensorstore open or read (``what`` names URL and leaf).

    tensorstore reports absl status codes in its messages: access and connection failures are
    storage errors, anything else means the checkpoint is damaged or incomplete.
    """
    msg = f"{what} failed ({type(e).__name__}: {e})"
    text = str(e)
    if text.startswith(("PERMISSION_DENIED", "UNAUTHENTICATED")):
        return ObjectStorePermissionError(
            f"{msg}; check the credentials (storage options key/secret, or the environment)"
        )
    if text.startswith(("UNAVAILABLE", "DEADLINE_EXCEEDED")):
        return EndpointUnreachableError(f"{msg}; check the endpoint and the network")
    return CorruptCheckpointError(f"{msg}; the checkpoint is damaged or incomplete")


def _key_data_shape(impl: Any, where: str, key: str, shape: tuple[int, ...], dtype: Any) -> None:
    """Refuse a recorded PRNG key that no key could be: an implementation this JAX does not
    know, or key data that is not uint32 ending in that implementation's key shape."""
    try:
        if not isinstance(impl, str):
            raise ValueError(f"not a string: {impl!r:.200}")
        want = tuple(
            jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0, impl=impl))).shape
        )
    except (ValueError, TypeError, KeyError) as e:
        raise CorruptCheckpointError(
            f"{where}: leaf {key} is recorded as a PRNG key of implementation {impl!r:.200} in "
            f"{_layout.ARRAY_METADATAS}, which this JAX does not know ({e}); the checkpoint is "
            "damaged or forged"
        ) from None
    if np.dtype(dtype) != np.uint32 or shape[len(shape) - len(want) :] != want:
        raise CorruptCheckpointError(
            f"{where}: leaf {key} is recorded as {impl} PRNG keys, whose data is uint32 ending "
            f"in shape {want}, but it holds {np.dtype(dtype)} of shape {shape}; the checkpoint "
            "is damaged or forged"
        )


def _keystr(key_path: tuple[str | int, ...]) -> str:
    return "/".join(str(k) for k in key_path)


def _insert(root: dict[Any, Any], key_path: tuple[str | int, ...], value: Any, url: str) -> None:
    """Put ``value`` at ``key_path``; sequence levels are dicts keyed by int until finished."""
    node = root
    for k in key_path[:-1]:
        child = node.setdefault(k, {})
        if not isinstance(child, dict):
            raise CorruptCheckpointError(
                f"{url}: _METADATA puts a leaf under {_keystr(key_path)}, inside another leaf"
            )
        node = child
    if key_path[-1] in node:
        raise CorruptCheckpointError(f"{url}: _METADATA lists {_keystr(key_path)} twice")
    node[key_path[-1]] = value


def _finish(node: Any, url: str, path: tuple[str | int, ...] = ()) -> Any:
    """Turn int-keyed levels into lists (as orbax restores sequences)."""
    if not isinstance(node, dict):
        return node
    keys = list(node)
    if keys and all(isinstance(k, int) for k in keys):
        if sorted(keys) != list(range(len(keys))):
            raise CorruptCheckpointError(
                f"{url}: sequence {_keystr(path) or '<root>'} has indices {sorted(keys)}, "
                "not 0..n-1"
            )
        return [_finish(node[i], url, (*path, i)) for i in range(len(keys))]
    if any(isinstance(k, int) for k in keys):
        raise CorruptCheckpointError(
            f"{url}: {_keystr(path) or '<root>'} mixes sequence indices and dict keys"
        )
    return {k: _finish(v, url, (*path, k)) for k, v in node.items()}


class OrbaxSource(Source):
    """An Orbax checkpoint (orbax-checkpoint v0 or v1 API; with or without OCDBT; zarr v2/v3).

    Open it with ``quire.open(path)`` (or ``format="orbax"``).  ``tree`` mirrors what orbax
    restores without a target: dicts, lists (orbax restores tuples as lists), a
    :class:`quire.sources.LazyArray` per ``jax.Array`` / ``np.ndarray`` leaf, a typed PRNG key
    array per key orbax saved (by the implementation it records), Python scalars and
    strings as values, empty containers and None as saved.  A composite checkpoint (a
    ``CheckpointManager`` step with named items) is ``{item: tree}``; a single item named
    ``default`` (CheckpointManager) or ``state`` / ``pytree`` (v1 ``save_pytree``) is shown
    unwrapped.  JSON items (``JsonSave``) are inline values; items of other handlers are
    listed in ``metadata["skipped_items"]`` and left out.

    Local paths (and ``file://`` URLs), ``s3://`` and ``gs://`` (see
    :mod:`quire_orbax._store` for how storage options reach tensorstore).
    """

    format: ClassVar[str] = "orbax"

    def __init__(
        self,
        url: str,
        tree: Any,
        metadata: dict[str, Any],
        context: Any,
        store: Store | None = None,
    ) -> None:
        self.url = url
        self.tree = tree
        self.metadata = metadata
        self._context = context
        self._store = store

    @classmethod
    def detect(cls, url: str, storage_options: dict[str, Any]) -> bool:
        if protocol(url) not in PROTOCOLS:
            return False
        try:
            store = Store(url, storage_options)
            try:
                return _layout.is_orbax_dir(store, store.root)
            finally:
                store.close()
        except Exception:  # broad: detection never raises: "not mine"
            return False

    @classmethod
    def open(cls, url: str, storage_options: dict[str, Any]) -> OrbaxSource:
        store = Store(url, storage_options)
        try:
            layout = _layout.read_layout(url, store)
            ts = _tensorstore()
            context = ts.Context({"cache_pool#ocdbt": {"total_bytes_limit": _OCDBT_CACHE_BYTES}})
            trees = {
                name: _open_item(store, item, url, ts, context)
                for name, item in layout.items.items()
            }
        except BaseException:
            store.close()
            raise
        tree = next(iter(trees.values())) if layout.unwrapped else trees
        return cls(url, tree, _metadata(layout), context, store)

    def close(self) -> None:
        self._context = None
        if self._store is not None:
            self._store.close()
            self._store = None


def _metadata(layout: Layout) -> dict[str, Any]:
    cm = layout.checkpoint_metadata
    items: dict[str, Any] = {}
    handlers = cm.get("item_handlers")
    for name, item in layout.items.items():
        handler = handlers.get(name) if isinstance(handlers, dict) else handlers
        entry: dict[str, Any] = {"handler": handler}
        if isinstance(item, PytreeItem):
            entry.update(
                kind="pytree",
                use_ocdbt=item.use_ocdbt,
                use_zarr3=item.use_zarr3,
                custom_metadata=item.custom_metadata,
            )
        else:
            entry["kind"] = "json"
        items["" if name is None else name] = entry
    return {
        "format": "orbax",
        "api": layout.version,
        "items": items,
        "skipped_items": dict(layout.skipped),
        "custom_metadata": cm.get("custom_metadata"),
        "init_timestamp_nsecs": cm.get("init_timestamp_nsecs"),
        "commit_timestamp_nsecs": cm.get("commit_timestamp_nsecs"),
    }


def _open_item(location: Store, item: PytreeItem | Any, url: str, ts: Any, context: Any) -> Any:
    if not isinstance(item, PytreeItem):
        return item  # a JSON item's value
    where = url if item.name is None else f"{url} (item {item.name!r})"
    strings = _layout.read_strings(location, item, where)
    key_impls = _layout.read_key_impls(location, item, where)
    stored = [leaf for leaf in item.leaves if leaf.value_type in (*ARRAY_TYPES, "scalar")]
    # Open every array at once (each reads its zarr metadata only), then collect.
    futures = [
        ts.open(array_spec(location, item, leaf.param), context=context, read=True)
        for leaf in stored
    ]
    stores = {}
    for leaf, fut in zip(stored, futures):
        try:
            store = fut.result()
        except Exception as e:
            what = f"{where}: opening {_keystr(leaf.key_path)} (orbax param {leaf.param!r})"
            raise storage_error(e, what) from e
        if any(int(m) != 0 for m in store.domain.inclusive_min):
            store = store.translate_to[(0,) * store.rank]
        stores[leaf.param] = store
    keys = {leaf.param for leaf in stored if leaf.value_type == "jax.Array"} & set(key_impls)
    for leaf in stored:
        if leaf.param in keys:
            store = stores[leaf.param]
            shape = tuple(int(n) for n in store.shape)
            _key_data_shape(
                key_impls[leaf.param],
                where,
                _keystr(leaf.key_path),
                shape,
                store.dtype.numpy_dtype,
            )
    # Scalars and typed PRNG keys are values, read now (all at once); arrays stay lazy.
    eager = {
        leaf.param: stores[leaf.param].read()
        for leaf in stored
        if leaf.value_type == "scalar" or leaf.param in keys
    }
    root: dict[Any, Any] = {}
    for leaf in item.leaves:
        key = _keystr(leaf.key_path)
        value: Any
        if leaf.param in keys:
            try:
                data = np.asarray(eager[leaf.param].result())
            except Exception as e:
                raise storage_error(e, f"{where}: reading {key}") from e
            # As orbax restores it: a typed key array, which quire saves as one.
            value = jax.random.wrap_key_data(jax.numpy.asarray(data), impl=key_impls[leaf.param])
        elif leaf.value_type in ARRAY_TYPES:
            store = stores[leaf.param]
            value = LazyArray(
                tuple(int(n) for n in store.shape),
                np.dtype(store.dtype.numpy_dtype),
                leaf.key_path,
                TensorstoreReader(store, where, key, location),
                url,
            )
        elif leaf.value_type == "scalar":
            try:
                value = np.asarray(eager[leaf.param].result()).item()
            except Exception as e:
                raise CorruptCheckpointError(
                    f"{where}: reading scalar {key} failed ({type(e).__name__}: {e})"
                ) from e
        elif leaf.value_type == "string":
            if leaf.param not in strings:
                raise CorruptCheckpointError(
                    f"{where}: string leaf {key} is missing from {_layout.STRINGS}"
                )
            value = strings[leaf.param]
            if not isinstance(value, str):
                # Orbax would restore str(value); a dict would be a subtree here: refuse both.
                raise CorruptCheckpointError(
                    f"{where}: string leaf {key} in {_layout.STRINGS} holds a "
                    f"{type(value).__name__}, not a string; the checkpoint is damaged or forged"
                )
        else:
            value = _layout.EMPTY[leaf.value_type]()
        if not leaf.key_path:
            return value  # the whole item is one leaf
        _insert(root, leaf.key_path, value, where)
    return _finish(root, where)
