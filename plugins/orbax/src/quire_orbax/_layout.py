"""Orbax's on-disk layout, read from its JSON metadata files only (never pickle, no orbax import).

What orbax-checkpoint writes (facts this module relies on):

* A **pytree item** directory holds ``_METADATA`` (JSON): ``tree_metadata`` maps each leaf's
  key tuple to ``key_metadata`` (one ``{"key", "key_type"}`` per level; key_type 1 = sequence
  index, 2 = dict key or attribute) and ``value_metadata`` (``value_type``: ``jax.Array``,
  ``np.ndarray``, ``scalar``, ``string``, or an empty container ``Dict`` / ``List`` /
  ``Tuple`` / ``NamedTuple`` / ``None`` with ``skip_deserialize``), plus ``use_ocdbt`` and
  ``use_zarr3``.  A leaf's *param name* is its keys joined by ``"."``; arrays and scalars are
  zarr (v2, or v3 with ``use_zarr3``) arrays named by it: a directory ``<item>/<param>/``
  without OCDBT, or key ``<param>`` of the OCDBT database rooted at ``<item>/``
  (``manifest.ocdbt`` + ``d/``; per-process ``ocdbt.process_N/`` databases are merged into it
  at commit).  Strings live in ``<item>/_strings.json`` under their param name.
* ``_CHECKPOINT_METADATA`` (JSON) sits in every checkpoint directory; ``item_handlers`` is the
  handler's class name (a single item saved in place) or a dict item name -> class name (a
  composite: ``CheckpointManager`` steps, whose unnamed item is ``default``, and v1
  ``save_pytree`` / ``save``, whose pytree is the checkpointable ``state``, or ``pytree`` in
  earlier v1 releases; v1 also drops an empty ``orbax.checkpoint`` marker file).
* ``JsonCheckpointHandler`` items are one JSON file ``<item>/metadata``.
* A typed PRNG key (``jax.random.key``) is saved as its uint32 key data, a ``jax.Array`` leaf;
  ``<item>/array_metadatas/process_<N>`` (JSON, one per writing process, alike) records
  ``{"array_metadatas": [{"array_metadata": {"param_name", ..., "ext_metadata":
  {"random_key_impl": "threefry2x32"}}}]}`` for it, and orbax restores it as a key.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from quire.errors import CheckpointNotFoundError, CorruptCheckpointError, UnsupportedLeafError
from quire_orbax._store import Store, local_path

__all__ = ["Layout", "Leaf", "PytreeItem", "Store", "local_path", "read_layout"]

METADATA = "_METADATA"
CHECKPOINT_METADATA = "_CHECKPOINT_METADATA"
V1_MARKER = "orbax.checkpoint"
STRINGS = "_strings.json"
JSON_ITEM_FILE = "metadata"
ARRAY_METADATAS = "array_metadatas"
RANDOM_KEY_IMPL = "random_key_impl"
# Item names that stand for "the" pytree of a checkpoint: the tree is shown unwrapped.
DEFAULT_ITEMS = ("default", "state", "pytree")
ARRAY_TYPES = ("jax.Array", "np.ndarray")
# Empty containers orbax records (and restores) by value type.  Orbax writes NamedTuple empties
# as None unless "rich types" are on; a rich-typed empty namedtuple has no plain-Python
# equivalent, so it is shown as None too.
EMPTY: dict[str, Callable[[], Any]] = {
    "Dict": dict,
    "List": list,
    "Tuple": tuple,
    "None": lambda: None,
    "NamedTuple": lambda: None,
}
# Refuse absurd metadata before parsing it (a pytree with a million leaves is ~200 MB).
MAX_METADATA_BYTES = 512 << 20


@dataclass(frozen=True)
class Leaf:
    """One leaf of a pytree item: where it sits and how orbax stored it."""

    key_path: tuple[str | int, ...]
    param: str  # orbax's param name: keys joined by "."
    value_type: str


@dataclass
class PytreeItem:
    """A directory holding ``_METADATA``: the tree's leaves and storage flags."""

    name: str | None
    path: str  # in the store's terms: a local path, or bucket/prefix
    leaves: list[Leaf]
    use_ocdbt: bool
    use_zarr3: bool
    custom_metadata: Any = None


@dataclass
class Layout:
    """What :func:`read_layout` found at a URL."""

    url: str
    version: str  # "v0" or "v1"
    items: dict[str | None, PytreeItem | Any] = field(default_factory=dict)
    checkpoint_metadata: dict[str, Any] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)

    @property
    def unwrapped(self) -> bool:
        """Whether the tree is the single pytree item itself (not ``{name: item}``)."""
        if list(self.items) == [None]:
            return True
        return (
            len(self.items) == 1
            and next(iter(self.items)) in DEFAULT_ITEMS
            and isinstance(next(iter(self.items.values())), PytreeItem)
        )


def _read(store: Store, path: str, url: str, what: str) -> bytes | None:
    try:
        size = store.size(path)
        if size > MAX_METADATA_BYTES:
            raise CorruptCheckpointError(
                f"{url}: {what} is {size} bytes, more than {MAX_METADATA_BYTES}; refusing to "
                "parse it (is this an Orbax checkpoint?)"
            )
        return store.read(path)
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None


def _json(store: Store, path: str, url: str, what: str) -> Any:
    raw = _read(store, path, url, what)
    if raw is None:
        return None
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        why = "nested too deeply to parse" if isinstance(e, RecursionError) else str(e)
        raise CorruptCheckpointError(
            f"{url}: {what} is not valid JSON ({why}); the checkpoint is damaged or was not "
            "written by orbax-checkpoint"
        ) from None


def bad_name(name: str) -> bool:
    """Whether ``name`` (an item name, a param path) could reach outside its directory or
    name none: absolute, empty / ``.`` / ``..`` parts, a NUL byte."""
    return (
        not name
        or name.startswith("/")
        or "\x00" in name
        or any(p in ("", ".", "..") for p in name.split("/"))
    )


def _join(path: str, *parts: str) -> str:
    return "/".join([path.rstrip("/"), *parts])


def is_orbax_dir(store: Store, path: str) -> bool:
    """Cheap detection: orbax's marker files exist (and it is not a quire checkpoint)."""
    try:
        entries = set(store.listdir(path))
    except (OSError, ValueError):
        return False
    if not entries or "quire.json" in entries:
        return False
    if any(
        store.isfile(_join(path, n))
        for n in (METADATA, CHECKPOINT_METADATA, V1_MARKER)
        if n in entries
    ):
        return True
    return bool(manager_steps(store, path, sorted(entries)))


def manager_steps(store: Store, path: str, entries: list[str] | None = None) -> list[str]:
    """Step directories of a ``CheckpointManager`` root (``<root>/<int>/_CHECKPOINT_METADATA``)."""
    if entries is None:
        try:
            entries = store.listdir(path)
        except OSError:
            return []
    steps = [
        e
        for e in entries
        if re.fullmatch(r"(?:[A-Za-z_]*_)?\d+", e)
        and store.isfile(_join(path, e, CHECKPOINT_METADATA))
    ]
    return sorted(steps, key=lambda e: int(re.sub(r"\D", "", e)))


def parse_tree_metadata(meta: Any, url: str) -> list[Leaf]:
    """The leaves listed by a ``_METADATA`` document, in its order."""
    if not isinstance(meta, dict) or not isinstance(meta.get("tree_metadata"), dict):
        raise CorruptCheckpointError(
            f"{url}: _METADATA has no 'tree_metadata' object; orbax checkpoints older than "
            "orbax-checkpoint 0.5 (msgpack 'checkpoint' files) are not supported: restore it "
            "with orbax and save it with quire.save"
        )
    leaves = []
    for tuple_key, entry in meta["tree_metadata"].items():
        try:
            keys = entry["key_metadata"]
            key_path: list[str | int] = []
            for k in keys:
                if k["key_type"] == 1:
                    key_path.append(int(k["key"]))
                elif k["key_type"] == 2:
                    key_path.append(str(k["key"]))
                else:
                    raise ValueError(f"unknown key_type {k['key_type']!r}")
            value_type = str(entry["value_metadata"]["value_type"])
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptCheckpointError(
                f"{url}: _METADATA entry {tuple_key} is malformed ({type(e).__name__}: {e})"
            ) from e
        param = ".".join(str(k) for k in key_path)
        leaves.append(Leaf(tuple(key_path), param, value_type))
    return leaves


def read_pytree_item(store: Store, path: str, url: str, name: str | None) -> PytreeItem:
    where = url if name is None else f"{url} (item {name!r})"
    meta = _json(store, _join(path, METADATA), where, "_METADATA")
    if meta is None:
        raise CheckpointNotFoundError(f"{where}: no _METADATA file")
    leaves = parse_tree_metadata(meta, where)
    for leaf in leaves:
        if leaf.key_path and leaf.value_type in (*ARRAY_TYPES, "scalar") and bad_name(leaf.param):
            # Orbax stores the leaf at <item>/<param>: a key of '..' (or with '/') would
            # make tensorstore read outside the item, which it refuses untyped.
            raise CorruptCheckpointError(
                f"{where}: leaf {leaf.key_path!r} has orbax param name {leaf.param[:200]!r}, "
                "which leaves the item directory; the _METADATA file is damaged or forged"
            )
        if leaf.value_type not in (*ARRAY_TYPES, "scalar", "string", *EMPTY):
            raise UnsupportedLeafError(
                f"{where}: leaf {'/'.join(map(str, leaf.key_path))} has orbax value type "
                f"{leaf.value_type!r}, which quire-orbax cannot read (it reads arrays, scalars, "
                "strings and empty containers); restore it with orbax and save it with quire.save"
            )
    return PytreeItem(
        name=name,
        path=path,
        leaves=leaves,
        use_ocdbt=bool(meta.get("use_ocdbt", False)),
        use_zarr3=bool(meta.get("use_zarr3", False)),
        custom_metadata=meta.get("custom_metadata"),
    )


def read_strings(store: Store, item: PytreeItem, url: str) -> dict[str, Any]:
    """``_strings.json`` of an item (empty when it has no string leaves)."""
    if not any(leaf.value_type == "string" for leaf in item.leaves):
        return {}
    data = _json(store, _join(item.path, STRINGS), url, STRINGS)
    if not isinstance(data, dict):
        raise CorruptCheckpointError(
            f"{url}: {STRINGS} is missing or not a JSON object, but _METADATA lists string leaves"
        )
    return data


def read_key_impls(store: Store, item: PytreeItem, url: str) -> dict[str, Any]:
    """Param name -> PRNG implementation name (as recorded: untrusted, any JSON value) of the
    item's typed key leaves, from the lowest-numbered ``array_metadatas/process_<N>`` (as
    orbax reads it; every process records the same keys).  Empty when there is none."""
    if not any(leaf.value_type == "jax.Array" for leaf in item.leaves):
        return {}
    folder = _join(item.path, ARRAY_METADATAS)
    try:
        names = store.listdir(folder) if store.isdir(folder) else []
    except (FileNotFoundError, NotADirectoryError):
        names = []
    files = sorted(
        (int(n[len("process_") :]), n) for n in names if re.fullmatch(r"process_\d{1,9}", n)
    )
    if not files:
        return {}
    what = f"{ARRAY_METADATAS}/{files[0][1]}"
    data = _json(store, _join(folder, files[0][1]), url, what)
    entries = data.get("array_metadatas") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise CorruptCheckpointError(
            f"{url}: {what} has no 'array_metadatas' list; the checkpoint is damaged"
        )
    impls: dict[str, Any] = {}
    for entry in entries:
        meta = entry.get("array_metadata") if isinstance(entry, dict) else None
        ext = meta.get("ext_metadata") if isinstance(meta, dict) else None
        if not isinstance(ext, dict) or RANDOM_KEY_IMPL not in ext:
            continue
        param = meta.get("param_name")  # type: ignore[union-attr]
        if not isinstance(param, str):
            raise CorruptCheckpointError(
                f"{url}: {what} records a PRNG key without a string param_name ({param!r:.200})"
            )
        impls[param] = ext[RANDOM_KEY_IMPL]
    return impls


def read_layout(url: str, store: Store) -> Layout:
    """Find the pytree items (and JSON items) of the Orbax checkpoint at ``store.root``."""
    path = store.root
    try:
        entries = store.listdir(path) if store.isdir(path) else []
    except OSError:
        entries = []
    if not entries:
        raise CheckpointNotFoundError(f"{url}: no such directory (an Orbax checkpoint is one)")
    ckpt_meta = _json(store, _join(path, CHECKPOINT_METADATA), url, CHECKPOINT_METADATA)
    if ckpt_meta is not None and not isinstance(ckpt_meta, dict):
        raise CorruptCheckpointError(f"{url}: {CHECKPOINT_METADATA} is not a JSON object")
    ckpt_meta = ckpt_meta or {}
    version = "v1" if V1_MARKER in entries else "v0"
    layout = Layout(url=url, version=version, checkpoint_metadata=ckpt_meta)
    if METADATA in entries and store.isfile(_join(path, METADATA)):
        layout.items[None] = read_pytree_item(store, path, url, None)
        return layout
    handlers = ckpt_meta.get("item_handlers")
    if isinstance(handlers, dict):
        names = [str(n) for n in handlers]
    else:
        # Unknown handlers (older orbax): every sub-directory is a candidate item.
        names = [e for e in entries if store.isdir(_join(path, e))]
        handlers = {}
    for name in names:
        if bad_name(name) or "/" in name:
            raise CorruptCheckpointError(
                f"{url}: {CHECKPOINT_METADATA} names item {name[:200]!r}, which is not a "
                "directory of the checkpoint; the file is damaged or forged"
            )
        sub = _join(path, name)
        handler = str(handlers.get(name, ""))
        if store.isfile(_join(sub, METADATA)):
            layout.items[name] = read_pytree_item(store, sub, url, name)
        elif "Json" in handler and store.isfile(_join(sub, JSON_ITEM_FILE)):
            layout.items[name] = _json(store, _join(sub, JSON_ITEM_FILE), url, f"{name}/metadata")
        elif handlers:
            layout.skipped[name] = handler or "unknown handler"
    if not layout.items:
        steps = manager_steps(store, path, entries)
        if steps:
            raise CheckpointNotFoundError(
                f"{url}: this is an Orbax CheckpointManager directory holding steps "
                f"{', '.join(steps[-5:])}; open one step, e.g. {url.rstrip('/')}/{steps[-1]}"
            )
        found = ", ".join(entries[:10]) or "nothing"
        skipped = f" (items with unsupported handlers: {layout.skipped})" if layout.skipped else ""
        raise CorruptCheckpointError(
            f"{url}: not a readable Orbax checkpoint layout: no {METADATA} here or in an item "
            f"directory{skipped}; found {found}"
        )
    return layout
