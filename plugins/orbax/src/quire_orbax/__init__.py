"""quire-orbax: open Orbax checkpoints read-only and lazily through ``quire.open``.

quire finds :class:`OrbaxSource` through its ``quire.sources`` entry point (``orbax``);
nothing needs importing.  Importing this package imports neither orbax nor tensorstore
(tensorstore is imported when a checkpoint is opened).
"""

from __future__ import annotations

from quire_orbax._source import OrbaxSource

__all__ = ["OrbaxSource"]
__version__ = "0.1.0"
