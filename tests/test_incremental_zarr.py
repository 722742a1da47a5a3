"""Plain fsspec + zarr read a *borrowing* step of an incremental Checkpointer root with the
recipe of docs/format.md ("Reading one step alone"), run from the document itself: on a
local root and on S3 (moto, through s3fs), bit-identically, with no quire code on the read
path.  On S3 the borrowed targets (``../step_00000000/...``) must be made root-relative
as the recipe does: an object store does not resolve ``..``."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
from fsspec.implementations.asyn_wrapper import AsyncFileSystemWrapper
from fsspec.implementations.local import LocalFileSystem

import quire
from quire._runtime import ioloop as _io
from quire._store.url import open_backend

DOC = Path(__file__).resolve().parents[1] / "docs" / "format.md"


def recipe() -> Any:
    """``open_step_array`` as docs/format.md defines it."""
    text = DOC.read_text()
    m = re.search(r"```python\n(import json, posixpath\n.*?)```", text, re.S)
    assert m, "the fsspec + zarr recipe is gone from docs/format.md"
    ns: dict[str, Any] = {}
    exec(m[1], ns)
    return ns["open_step_array"]


def rand(seed: int, shape: tuple[int, ...]) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def incremental_root(url: str, options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Three steps: a frozen base (borrowed by steps 1 and 2 from step 0's pack) and a
    changing array; the tree of step 2."""
    frozen = {f"layer{i}": jnp.asarray(rand(i, (64, 128))) for i in range(4)}
    with quire.Checkpointer(url, incremental=True, storage_options=options) as ck:
        for s in range(3):
            tree = {"frozen": frozen, "head": jnp.asarray(rand(100 + s, (32, 64)))}
            ck.save(s, tree)
            ck.wait()
    return tree


def check(base_fs: Any, root_path: str, url: str, options: dict[str, Any] | None) -> None:
    open_step_array = recipe()
    tree = incremental_root(url, options)
    step = "step_00000002"
    backend = open_backend(url, options)

    def get(key: str) -> bytes:
        return bytes(_io.submit(backend.get(key)).result())

    rec = json.loads(get(f"{step}/quire.json"))
    (entry,) = rec["indexes"]
    assert entry["borrowed"], "step 2 borrows nothing: the test reads no borrowed byte"
    index_json = get(f"{step}/{entry['object']}")
    leaves = quire.metadata(f"{url}/{step}", storage_options=options).tree
    read = 0
    for group, arrays in tree.items():
        for key, want in arrays.items() if isinstance(arrays, dict) else [(None, arrays)]:
            meta = leaves[group][key] if key is not None else leaves[group]
            arr = open_step_array(base_fs, root_path, step, index_json, meta.location)
            got = arr[...]
            assert got.dtype == np.float32 and np.array_equal(got, np.asarray(want)), (group, key)
            read += 1
    assert read == 5


def test_plain_zarr_reads_a_borrowing_step_local(tmp_path: Path) -> None:
    base_fs = AsyncFileSystemWrapper(LocalFileSystem(), asynchronous=True)
    check(base_fs, str(tmp_path / "root"), str(tmp_path / "root"), None)


def test_plain_zarr_reads_a_borrowing_step_on_s3(moto: Any) -> None:
    import s3fs

    url = moto.fresh_url()
    opts = moto.options()
    base_fs = s3fs.S3FileSystem(
        asynchronous=True,
        key=opts["key"],
        secret=opts["secret"],
        client_kwargs={"endpoint_url": opts["endpoint_url"], "region_name": "us-east-1"},
    )
    check(base_fs, url[len("s3://") :], url, opts)
