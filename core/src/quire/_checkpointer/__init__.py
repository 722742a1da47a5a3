"""``quire.Checkpointer`` for training loops (``checkpointer``): numbered steps under one root,
with its save decision (``deciding``) and policies (``save_policies``, ``keep_policies``),
its retention, loading and inspection (``retain``) and its background task chain
(``tasks``), and its fast per-process local tier under the persistent root (``tiers``:
``quire.LocalTier``, promotion from local bytes, reads local first; with several processes
``tiermulti``: the agreed step and restore from peers, ``tierplan``: that agreement as data,
``tierplace``: which processes hold each one's copies (spread over failure domains),
``tierpull``: peer copies over TCP, ``tierread``: a restore's read-only view, byte ranges
from the nearest live holder).

May import: everything below the package face (``quire._api`` and the subpackages under it),
never ``quire`` itself or ``quire._cli``.
"""
