"""How quire runs, below everything that knows a checkpoint: the background event loop and I/O
pool (``ioloop``), async responses (``responses``), the byte budget (``budget``),
configuration and contexts (``config``), the plugin registries (``registry``, with install hints
from ``install``, the one table of first-party plugins), the interpreter-exit hook (``exithook``), progress reporting (``progress``),
bounded fan-out (``tasks``), host buffers ``jax.device_put`` adopts (``hostbuf``), the multi-process
coordinator (``multihost``), byte exchange between processes behind a barrier with a deadline
(``collective``: an all-gather, ``ring_shift`` for peer copies, and small payloads through the
key-value store alone: ``kv_exchange``, ``kv_broadcast``) and the library version
(``version``).  The peer link over TLS has a room of its own, just above: ``quire._peers``.

May import: only quire's contract modules (``errors``, ``options``, ``metadata``).
"""
