"""``quire.Checkpointer`` for training loops (``checkpointer``): numbered steps under one root,
with its retention, loading and inspection (``retain``) and its background task chain
(``tasks``).

May import: everything below the package face (``quire._api`` and the subpackages under it),
never ``quire`` itself or ``quire._cli``.
"""
