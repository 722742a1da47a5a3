"""Format v2 loads on object stores read packs in planned windows (``quire._format.packread``):
few large requests instead of one per chunk, staging within the byte budget, every chunk
still checked, and nothing read for arrays the load does not ask for.

The memory backend stands in for an object store: giving it a ``read_part_size`` (what
``ObjectStoreBackend`` has) turns the windows on; the real S3/GCS servers are in
``tests/test_object_stores.py``."""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import quire
from quire._store.memory import MemoryBackend
from quire.errors import CorruptCheckpointError

KiB = 1 << 10


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, int, int]]]:
    """Ranged reads of pack objects as ``(key, offset, bytes)``, with windows of 256 KiB."""
    got: list[tuple[str, int, int]] = []
    orig = MemoryBackend.get_into

    async def spy(self: Any, key: str, buffers: Any, offset: int = 0) -> int:
        n: int = await orig(self, key, buffers, offset)
        if "%packs/" in key and not key.endswith(".index.json"):
            got.append((key, offset, sum(memoryview(b).nbytes for b in buffers)))
        return n

    monkeypatch.setattr(MemoryBackend, "get_into", spy)
    monkeypatch.setattr(MemoryBackend, "read_part_size", 256 * KiB, raising=False)
    yield got


def _tree(n: int = 40) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    return {f"p{i:02d}": rng.standard_normal(256 + 64 * i).astype(np.float32) for i in range(n)}


def _url() -> str:
    return f"memory://quire-tests/{uuid.uuid4().hex}"


def test_small_leaves_load_in_few_window_requests(reads: list[tuple[str, int, int]]) -> None:
    """40 leaves (1-11 KiB each, 250 KiB in all) in one pack: one request per window of
    at most 256 KiB, not one per chunk; every leaf loads exactly."""
    tree = _tree()
    url = _url()
    quire.save(url, tree)
    got = quire.load(url)
    assert all(np.array_equal(got[k], v) for k, v in tree.items())
    total = sum(v.nbytes + 4 for v in tree.values())
    assert 1 <= len(reads) <= 2, reads
    assert sum(n for _, _, n in reads) == total  # no byte read twice, none left out
    assert all(n <= 256 * KiB for _, _, n in reads)


def test_without_read_part_size_no_windows_are_planned(monkeypatch: Any) -> None:
    """The local and memory backends (no ``read_part_size``) plan no windows (a window
    would only add a copy there): reads stay per chunk, merged only when queued together."""
    from quire._format import packedreader as _packedreader

    made: list[Any] = []
    orig = _packedreader.reader

    def spy(*a: Any, **k: Any) -> Any:
        made.append(orig(*a, **k))
        return made[-1]

    monkeypatch.setattr(_packedreader, "reader", spy)
    tree = _tree(40)
    url = _url()
    quire.save(url, tree)
    got = quire.load(url)
    assert all(np.array_equal(got[k], v) for k, v in tree.items())
    assert made and made[-1].windows is None and made[-1].requests > 2


def test_staging_within_the_byte_budget(reads: list[tuple[str, int, int]]) -> None:
    """With a byte budget smaller than a window, chunks nobody waits for yet are staged
    only up to the budget: windows end early, the load stays exact and reads each byte
    once."""
    tree = _tree()
    url = _url()
    quire.save(url, tree)
    with quire.Context(byte_budget=32 * KiB):
        got = quire.load(url)
    assert all(np.array_equal(got[k], v) for k, v in tree.items())
    assert sum(n for _, _, n in reads) == sum(v.nbytes + 4 for v in tree.values())
    assert 2 < len(reads) < len(tree)


def test_partial_load_reads_only_the_asked_leaves(
    reads: list[tuple[str, int, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A load of 3 of 40 leaves plans windows over those 3 only.  Gaps of up to
    ``MAX_GAP`` bytes between planned chunks are read rather than split (a round trip
    costs more); with no gap allowed, exactly the 3 chunks are read."""
    from quire._format import packread as _packread

    tree = _tree()
    url = _url()
    quire.save(url, tree)
    want = {k: tree[k] for k in ("p03", "p17", "p31")}
    abstract = {k: np.zeros_like(v) for k, v in want.items()}
    got = quire.load(url, abstract, partial=True)
    assert all(np.array_equal(got[k], v) for k, v in want.items())
    need = sum(v.nbytes + 4 for v in want.values())
    assert need <= sum(n for _, _, n in reads) <= need + 2 * _packread.MAX_GAP
    reads.clear()
    monkeypatch.setattr(_packread, "MAX_GAP", 0)
    got = quire.load(url, abstract, partial=True)
    assert all(np.array_equal(got[k], v) for k, v in want.items())
    assert sum(n for _, _, n in reads) == need and len(reads) == 3


def test_a_damaged_chunk_in_a_window_fails_the_load(reads: list[tuple[str, int, int]]) -> None:
    """A byte flipped inside a pack: the chunk read out of a window (staged or not)
    still fails its checks, naming the leaf."""
    tree = _tree()
    url = _url()
    quire.save(url, tree)
    store = MemoryBackend(url).fs.store
    pack = next(k for k in store if "%packs/p00000-" in k and url.split("://")[1] in k)
    data = bytearray(store[pack].getvalue())
    data[len(data) // 2] ^= 0xFF
    MemoryBackend(url).fs.pipe_file(pack, bytes(data))
    with pytest.raises(CorruptCheckpointError, match=r"leaf 'p\d\d'"):
        quire.load(url)


def test_zarr_shards_are_read_by_range_not_through_windows(
    reads: list[tuple[str, int, int]],
) -> None:
    """A sharded array (``chunk_bytes``) is read by ranges (its shard index, then its inner
    chunks): no window fetches its shard bytes, so none are staged for readers that never
    come, and no byte of a pack is read twice."""
    rng = np.random.default_rng(5)
    tree = {
        "plain": _tree(8),
        "sharded": {f"s{i}": rng.standard_normal(4096).astype(np.float32) for i in range(3)},
    }
    url = _url()
    shard = quire.StorageOptions(chunk_bytes=4 * KiB)
    quire.save(url, tree, storage=lambda path, leaf: shard if "sharded" in str(path) else None)
    got = quire.load(url)
    assert all(np.array_equal(got["sharded"][k], v) for k, v in tree["sharded"].items())
    assert all(np.array_equal(got["plain"][k], v) for k, v in tree["plain"].items())
    spans = sorted((k, o, o + n) for k, o, n in reads)
    for (k1, _, e1), (k2, s2, _) in itertools.pairwise(spans):
        assert k1 != k2 or e1 <= s2, spans  # no byte read twice
    sharded = sum(v.nbytes for v in tree["sharded"].values())
    plain = sum(v.nbytes for v in tree["plain"].values())
    assert sum(n for _, _, n in reads) < plain + sharded + 4 * KiB, reads
