"""How quire runs, below everything that knows a checkpoint: the background event loop and
I/O pool (``ioloop``), async responses (``responses``), the byte budget (``budget``),
configuration and contexts (``config``), the plugin registries (``registry``, with install hints
from ``install``), the interpreter-exit hook (``exithook``), progress reporting (``progress``),
bounded fan-out (``tasks``), host buffers ``jax.device_put`` adopts (``hostbuf``), the multi-process
coordinator (``multihost``), byte exchange between processes behind a barrier with a deadline
(``collective``: an all-gather, and ``ring_shift`` for peer copies), files of another process's
local tier over TLS 1.3 with mutual authentication (``peerlink``, with the certificates in
``peertls``, the client in ``peerconn``, the server in ``peerserve``, what it serves in
``peerfiles`` and the messages in ``peerwire``) and the library version (``version``).

May import: only quire's contract modules (``errors``, ``options``, ``metadata``).
"""
