"""quire-grain: Grain data iterators (``grain.DatasetIterator``, ``grain.DataLoader``
iterators) as quire checkpointable units, one state per JAX process, found through the
``quire.checkpointables`` entry point ``grain``."""

from __future__ import annotations

from quire_grain._handler import GrainIteratorHandler, GrainState

__all__ = ["GrainIteratorHandler", "GrainState"]
