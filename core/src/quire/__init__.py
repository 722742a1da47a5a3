"""quire: atomic, verifiable checkpoints of JAX training state to any fsspec URL."""

from __future__ import annotations

__version__ = "0.1.0"

from quire import errors, partial, policies
from quire._api import (
    AsyncResponse,
    load,
    load_async,
    load_checkpointables,
    metadata,
    save,
    save_async,
    save_checkpointables,
    save_checkpointables_async,
)
from quire._checkpointer import Checkpointer
from quire._config import Config, Context, configure
from quire._dtypes import register_with_zarr as _register_with_zarr
from quire._registry import (
    register_checkpointable_handler,
    register_leaf_handler,
    unregister_checkpointable_handler,
    unregister_leaf_handler,
)
from quire._zarrstore import zarr_store
from quire.checkpointables import Checkpointable, CheckpointableHandler
from quire.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    PluginError,
    QuireError,
    TreeMismatchError,
    UnsupportedLeafError,
)
from quire.metadata import CheckpointMetadata, LeafMetadata
from quire.options import StorageOptions

_register_with_zarr()

__all__ = [
    "AsyncResponse",
    "CheckpointExistsError",
    "CheckpointMetadata",
    "CheckpointNotFoundError",
    "Checkpointable",
    "CheckpointableHandler",
    "Checkpointer",
    "Config",
    "Context",
    "CorruptCheckpointError",
    "LeafMetadata",
    "PluginError",
    "QuireError",
    "StorageOptions",
    "TreeMismatchError",
    "UnsupportedLeafError",
    "__version__",
    "configure",
    "errors",
    "load",
    "load_async",
    "load_checkpointables",
    "metadata",
    "partial",
    "policies",
    "register_checkpointable_handler",
    "register_leaf_handler",
    "save",
    "save_async",
    "save_checkpointables",
    "save_checkpointables_async",
    "unregister_checkpointable_handler",
    "unregister_leaf_handler",
    "zarr_store",
]
