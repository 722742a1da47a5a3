"""quire: atomic, verifiable checkpoints of JAX training state to any fsspec URL.

The top level holds what most users call: save and load (blocking and async, one tree or
several units), the Checkpointer with its local tier, the tools (``open``, ``copy``,
``verify``, ``diff``, ``export``, ``zarr_store``), configuration and the errors one
catches most.  Everything else lives in a public module named for its concern:
``quire.errors`` (every error), ``quire.tiers``, ``quire.policies``, ``quire.partial``,
``quire.sources``, ``quire.surgery``, ``quire.handlers``, ``quire.checkpointables``,
``quire.backends``, ``quire.reports``, ``quire.metadata``, ``quire.progress``,
``quire.testing``.

Each name is imported on first use (PEP 562): ``import quire`` is cheap, and the ``quire``
command starts without JAX or zarr where its command needs neither.  ``from quire import
save`` and ``quire.save`` work as usual.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from quire import (
        backends,
        checkpointables,
        errors,
        handlers,
        partial,
        policies,
        progress,
        reports,
        sources,
        surgery,
        tiers,
    )
    from quire._api import (
        AsyncResponse,
        load,
        load_async,
        load_checkpointables,
        load_checkpointables_async,
        metadata,
        save,
        save_async,
        save_checkpointables,
        save_checkpointables_async,
    )
    from quire._checkpointer.checkpointer import Checkpointer
    from quire._checkpointer.localtier import LocalTier
    from quire._ops import copy, verify
    from quire._runtime.config import Config, Context, configure
    from quire._runtime.version import __version__
    from quire._sources.diff import diff
    from quire._sources.export import export
    from quire._sources.zarrstore import zarr_store
    from quire.errors import (
        CheckpointExistsError,
        CheckpointNotFoundError,
        CorruptCheckpointError,
        QuireError,
        TreeMismatchError,
    )
    from quire.options import StorageOptions
    from quire.sources import open

__all__ = [
    "AsyncResponse",
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "Checkpointer",
    "Config",
    "Context",
    "CorruptCheckpointError",
    "LocalTier",
    "QuireError",
    "StorageOptions",
    "TreeMismatchError",
    "__version__",
    "backends",
    "checkpointables",
    "configure",
    "copy",
    "diff",
    "errors",
    "export",
    "handlers",
    "load",
    "load_async",
    "load_checkpointables",
    "load_checkpointables_async",
    "metadata",
    "open",
    "partial",
    "policies",
    "progress",
    "reports",
    "save",
    "save_async",
    "save_checkpointables",
    "save_checkpointables_async",
    "sources",
    "surgery",
    "tiers",
    "verify",
    "zarr_store",
]

#: Where each public name lives: the module that defines it.
_WHERE = {
    "AsyncResponse": "quire._api",
    "load": "quire._api",
    "load_async": "quire._api",
    "load_checkpointables": "quire._api",
    "load_checkpointables_async": "quire._api",
    "metadata": "quire._api",
    "save": "quire._api",
    "save_async": "quire._api",
    "save_checkpointables": "quire._api",
    "save_checkpointables_async": "quire._api",
    "Checkpointer": "quire._checkpointer.checkpointer",
    "LocalTier": "quire._checkpointer.localtier",
    "copy": "quire._ops",
    "verify": "quire._ops",
    "Config": "quire._runtime.config",
    "Context": "quire._runtime.config",
    "configure": "quire._runtime.config",
    "__version__": "quire._runtime.version",
    "diff": "quire._sources.diff",
    "export": "quire._sources.export",
    "zarr_store": "quire._sources.zarrstore",
    "CheckpointExistsError": "quire.errors",
    "CheckpointNotFoundError": "quire.errors",
    "CorruptCheckpointError": "quire.errors",
    "QuireError": "quire.errors",
    "TreeMismatchError": "quire.errors",
    "StorageOptions": "quire.options",
    "open": "quire.sources",
}
#: The public modules, imported on first use like the names.
_SUBMODULES = {
    "backends",
    "checkpointables",
    "errors",
    "handlers",
    "partial",
    "policies",
    "progress",
    "reports",
    "sources",
    "surgery",
    "tiers",
}

# ``quire.metadata`` is the function; the contract module of the same name (what it
# returns) would take its place in this namespace when first imported.  Import the module
# now and drop the attribute the import system set, so that the name resolves below.
importlib.import_module("quire.metadata")
globals().pop("metadata", None)

#: Names that left the top level, and where each lives now (a clear error, not a bare
#: AttributeError, for code written against the wider surface).
_MOVED = {
    "PeerTLS": "quire.tiers.PeerTLS",
    "register_leaf_handler": "quire.handlers.register_leaf_handler",
    "unregister_leaf_handler": "quire.handlers.unregister_leaf_handler",
    "register_checkpointable_handler": "quire.checkpointables.register_checkpointable_handler",
    "unregister_checkpointable_handler": (
        "quire.checkpointables.unregister_checkpointable_handler"
    ),
    "Checkpointable": "quire.checkpointables.Checkpointable",
    "CheckpointableHandler": "quire.checkpointables.CheckpointableHandler",
    "CopyResult": "quire.reports.CopyResult",
    "VerifyProblem": "quire.reports.VerifyProblem",
    "VerifyReport": "quire.reports.VerifyReport",
    "DiffReport": "quire.reports.DiffReport",
    "CheckpointMetadata": "from quire.metadata import CheckpointMetadata",
    "LeafMetadata": "from quire.metadata import LeafMetadata",
    "LazyArray": "quire.sources.LazyArray",
    "Source": "quire.sources.Source",
    "PartitionRules": "quire.surgery.PartitionRules",
    "partition_rules": "quire.surgery.partition_rules",
    "load_and_transform": "quire.load(sources, abstract, transform=fn, shardings=...)",
    "CheckpointChangedError": "quire.errors.CheckpointChangedError",
    "MultiProcessError": "quire.errors.MultiProcessError",
    "SnapshotError": "quire.errors.SnapshotError",
    "UnreadableRecordError": "quire.errors.UnreadableRecordError",
    "PluginError": "quire.errors.PluginError",
    "UnsupportedLeafError": "quire.errors.UnsupportedLeafError",
}


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        value = importlib.import_module(f"quire.{name}")
    elif name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name]), name)
    elif name in _MOVED:
        raise AttributeError(
            f"module 'quire' has no attribute {name!r}: use {_MOVED[name]} (the top level "
            "keeps what most users call; see docs/api.md)"
        )
    else:
        raise AttributeError(f"module 'quire' has no attribute {name!r}")
    globals()[name] = value  # the next access is a plain lookup
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
