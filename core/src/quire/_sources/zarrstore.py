"""``quire.zarr_store``: a read-only zarr store over a checkpoint of either layout.

Format v1 arrays are plain objects under the checkpoint root; format v2 arrays are
served by fsspec's reference file system from the merged chunk indexes, with the pack
targets resolved against the checkpoint root (a ``DirFileSystem``).  Either way the
store's root is the checkpoint root, so an array opens at its record's ``location``::

    store = quire.zarr_store(url)
    arr = zarr.open_array(store, path=quire.metadata(url).tree["w"].location, mode="r")
"""

from __future__ import annotations

import json
import os
from typing import Any

from quire._engine import commit as _commit
from quire._format import chunkindex as _chunkindex
from quire._format import record as _records
from quire._format import zarr_dtypes  # noqa: F401 - registers them: the store's user reads
from quire._runtime import ioloop as _io
from quire._store.url import normalize, open_backend


def _async_fs(fs: Any) -> Any:
    if getattr(fs, "async_impl", False):
        return fs
    from fsspec.implementations.asyn_wrapper import AsyncFileSystemWrapper

    return AsyncFileSystemWrapper(fs, asynchronous=True)


def zarr_store(
    url: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None
) -> Any:
    """A read-only ``zarr.storage.FsspecStore`` rooted at the checkpoint ``url``.

    Parameters
    ----------
    url : str or path
        A committed checkpoint (format v1 or v2).
    storage_options : dict, optional
        fsspec options for the checkpoint's file system.

    Returns
    -------
    zarr.storage.FsspecStore
        Arrays open at their ``location`` (``quire.metadata(url).tree[...].location``).

    Raises
    ------
    CheckpointNotFoundError
        No ``quire.json`` at ``url``.
    CorruptCheckpointError
        The record or a chunk index is damaged.
    """
    import fsspec
    from fsspec.implementations.dirfs import DirFileSystem
    from zarr.storage import FsspecStore

    u = normalize(url)
    backend = open_backend(u, storage_options)
    doc = _io.submit(_commit.read(backend, u)).result().doc
    fs, root = fsspec.url_to_fs(u, **(storage_options or {}))
    base = DirFileSystem(path=root, fs=_async_fs(fs), asynchronous=True)
    entries = doc.get("indexes")
    if doc["version"] == _records.VERSION or not entries:
        return FsspecStore(base, path="", read_only=True)

    async def merged() -> dict[str, Any]:
        refs: dict[str, Any] = {}
        for e in entries:
            data = await backend.get(e["object"])
            _chunkindex.parse_index(
                data, e, u, doc["txids"]
            )  # size, crc32c and shape of every entry
            refs.update(json.loads(data)["refs"])
        return {"version": 1, "refs": refs}

    try:
        fo = _io.submit(merged()).result()
    except _chunkindex.ChunkError as e:
        from quire.errors import CorruptCheckpointError

        raise CorruptCheckpointError(f"{u}: {e}; restore the checkpoint from a copy") from e
    ref = fsspec.filesystem("reference", fo=fo, fs={None: base}, asynchronous=True)
    return FsspecStore(ref, path="", read_only=True)
