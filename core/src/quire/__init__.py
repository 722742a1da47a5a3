"""quire: atomic, verifiable checkpoints of JAX training state to any fsspec URL."""

from __future__ import annotations

from quire import errors, partial, policies, progress, sources, surgery
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
from quire._checkpointer.checkpointer import Checkpointer
from quire._checkpointer.localtier import LocalTier
from quire._format.dtypes import register_with_zarr as _register_with_zarr
from quire._ops import CopyResult, VerifyProblem, VerifyReport, copy, verify
from quire._peers.tls import PeerTLS
from quire._runtime.config import Config, Context, configure
from quire._runtime.registry import (
    register_checkpointable_handler,
    register_leaf_handler,
    unregister_checkpointable_handler,
    unregister_leaf_handler,
)
from quire._runtime.version import __version__
from quire._sources.diff import DiffReport, diff
from quire._sources.export import export
from quire._sources.materialize import load_and_transform
from quire._sources.partition import PartitionRules, partition_rules
from quire._sources.zarrstore import zarr_store
from quire.checkpointables import Checkpointable, CheckpointableHandler
from quire.errors import (
    CheckpointChangedError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    MultiProcessError,
    PluginError,
    QuireError,
    SnapshotError,
    TreeMismatchError,
    UnreadableRecordError,
    UnsupportedLeafError,
)
from quire.metadata import CheckpointMetadata, LeafMetadata
from quire.options import StorageOptions
from quire.sources import LazyArray, Source, open

_register_with_zarr()

__all__ = [
    "AsyncResponse",
    "CheckpointChangedError",
    "CheckpointExistsError",
    "CheckpointMetadata",
    "CheckpointNotFoundError",
    "Checkpointable",
    "CheckpointableHandler",
    "Checkpointer",
    "Config",
    "Context",
    "CopyResult",
    "CorruptCheckpointError",
    "DiffReport",
    "LazyArray",
    "LeafMetadata",
    "LocalTier",
    "MultiProcessError",
    "PartitionRules",
    "PeerTLS",
    "PluginError",
    "QuireError",
    "SnapshotError",
    "Source",
    "StorageOptions",
    "TreeMismatchError",
    "UnreadableRecordError",
    "UnsupportedLeafError",
    "VerifyProblem",
    "VerifyReport",
    "__version__",
    "configure",
    "copy",
    "diff",
    "errors",
    "export",
    "load",
    "load_and_transform",
    "load_async",
    "load_checkpointables",
    "metadata",
    "open",
    "partial",
    "partition_rules",
    "policies",
    "progress",
    "register_checkpointable_handler",
    "register_leaf_handler",
    "save",
    "save_async",
    "save_checkpointables",
    "save_checkpointables_async",
    "sources",
    "surgery",
    "unregister_checkpointable_handler",
    "unregister_leaf_handler",
    "verify",
    "zarr_store",
]
