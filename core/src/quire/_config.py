"""Global configuration and the (thread- and task-local) Context overrides."""

from __future__ import annotations

import contextvars
import dataclasses
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Config", "configure", "current"]


@dataclass(frozen=True)
class Config:
    """quire's options; every field can be set by ``quire.configure`` or ``quire.Context``.

    Attributes
    ----------
    byte_budget : int
        Host bytes a save or load may hold in flight beyond the tree itself (256 MiB).
    max_concurrency : int
        Chunk reads/writes in flight at once.
    storage_options : dict
        Per-protocol fsspec options, e.g. ``{"s3": {"endpoint_url": ...}}``.
    plugins : dict
        Plugin choices when two distributions claim a name: ``{"group:name": "dist"}``.
    primary_process : int
        The process that writes metadata and commits in multi-process runs.
    checksum : bool
        Default for ``StorageOptions.checksum``.
    codecs : tuple
        Default compressors for array leaves (none: raw bytes are fastest on local disks).
    timeout : float or None
        Seconds a multi-process barrier waits before the save is aborted.
    """

    byte_budget: int = 256 * 1024 * 1024
    max_concurrency: int = 64
    storage_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    plugins: dict[str, str] = field(default_factory=dict)
    primary_process: int = 0
    checksum: bool = True
    codecs: tuple[Any, ...] = ()
    timeout: float | None = 600.0


_global = Config()
_override: contextvars.ContextVar[Config | None] = contextvars.ContextVar(
    "quire_config", default=None
)


def current() -> Config:
    return _override.get() or _global


def configure(**options: Any) -> None:
    """Set global defaults (see :class:`Config` for the options)."""
    global _global
    _global = dataclasses.replace(_global, **options)


def _set_override(cfg: Config | None) -> contextvars.Token[Config | None]:
    return _override.set(cfg)


def _reset_override(token: contextvars.Token[Config | None]) -> None:
    _override.reset(token)
