"""The layout under a checkpoint URL, without transactions: checksums (``crc``), the JSON
tree and key paths (``tree``, ``paths``), dtype names (``dtypes``), the commit record
``quire.json`` (``record`` builds and parses it, ``schema`` validates every value in it),
format v2's chunk identity (``chunkid``, ``shardid``, ``chunkcheck``), chunk index
(``chunkindex``), the read view that serves zarr keys out of packs (``packedreader``), pack
writer (``pack``) and read windows (``packread``), borrowed packs of an incremental root
(``borrow``), a Checkpointer root's layout (``root``), what a metadata tree counts
(``describe``) and the JSON parser for documents quire did not write (``untrusted``).

Nothing here writes a commit record or decides what is garbage: that is ``quire._engine``.

May import: ``quire._runtime``, ``quire._store`` and quire's contract modules.
"""
