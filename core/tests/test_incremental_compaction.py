"""Compaction of mostly-dead packs in an incremental root (``compact_below``): a save does
not keep a pack alive for a few borrowed chunks, so a root's stored bytes stay bounded by
its live bytes while every retained step loads and verifies."""

from __future__ import annotations

import json
import posixpath
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import quire
from quire._cli.main import main as cli
from quire._format import root as _root
from quire._runtime import ioloop as _io
from quire._store.url import open_backend
from quire.policies import LatestN

N_CHANGING = 9


def name(step: int) -> str:
    return _root.DEFAULT_STEP_FORMAT.format(step)


def rand(seed: int, shape: tuple[int, ...]) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def tree(step: int, frozen: jax.Array) -> dict[str, Any]:
    """Most bytes change every step; one small array (1/37 of them) never does."""
    return {"frozen": frozen} | {
        f"w{i}": jnp.asarray(rand(1000 * step + i, (128, 256))) for i in range(N_CHANGING)
    }


def same(a: Any, b: Any) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(
        np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb)
    )


def packs(root: str) -> dict[str, int]:
    """Every pack under the root: root-relative path -> bytes."""
    b = open_backend(root)
    keys = [k for k in _io.submit(b.list("")).result() if "/%packs/p" in k]
    keys = [k for k in keys if not k.endswith(".index.json")]
    return {k: _io.submit(b.size(k)).result() for k in keys}


def live(root: str, steps: list[int]) -> int:
    """Bytes the committed ``steps`` point at (each range counted once)."""
    b = open_backend(root)

    def get(key: str) -> Any:
        return json.loads(bytes(_io.submit(b.get(key)).result()))

    ranges: set[tuple[str, int, int]] = set()
    for s in steps:
        for entry in get(f"{name(s)}/quire.json")["indexes"]:
            for v in get(f"{name(s)}/{entry['object']}")["refs"].values():
                if isinstance(v, list):
                    ranges.add((posixpath.normpath(f"{name(s)}/{v[0]}"), v[1], v[2]))
    return sum(n for _, _, n in ranges)


def run(root: str, below: float, n: int = 8) -> tuple[list[dict[str, Any]], list[int]]:
    frozen = jnp.asarray(rand(7, (16, 256)))
    trees = [tree(s, frozen) for s in range(n)]
    with quire.Checkpointer(
        root, incremental=True, compact_below=below, keep=LatestN(2), gc_grace_period=None
    ) as ck:
        for s, t in enumerate(trees):
            ck.save(s, t)
            ck.wait()
        steps = ck.steps()
    return trees, steps


@pytest.mark.parametrize("where", ["local", "memory"])
def test_mostly_dead_pack_is_not_kept_alive(tmp_path: Path, where: str) -> None:
    """Local files stream chunks into packs; memory:// packs are uploaded whole."""
    root = str(tmp_path) if where == "local" else f"memory://compaction-{tmp_path.name}"
    trees, steps = run(root, 0.5)
    assert steps == [6, 7]
    stored, used = sum(packs(root).values()), live(root, steps)
    assert stored <= 1.1 * used, (stored, used)  # the retained steps' packs, little else
    assert not [p for p in packs(root) if p.startswith(name(0))]  # died with its record
    for s in steps:
        assert same(quire.load(f"{root}/{name(s)}"), trees[s])
        assert not quire.verify(f"{root}/{name(s)}").problems
    # the frozen chunk moved once (step 1) into a pack of its own, borrowed since
    rec = json.loads(bytes(_io.submit(open_backend(root).get(f"{name(7)}/quire.json")).result()))
    (lent,) = rec["indexes"][0]["borrowed"]
    assert lent.startswith(f"../{name(1)}/") and lent.endswith("p00000-00001"), lent


def test_without_compaction_the_first_pack_lives_on(tmp_path: Path) -> None:
    """The same run with ``compact_below=0`` (the behaviour before compaction): step 0's
    pack stays for one 16 KiB array, and the root stores far more than it uses."""
    trees, steps = run(str(tmp_path), 0.0)
    stored, used = sum(packs(str(tmp_path)).values()), live(str(tmp_path), steps)
    assert [p for p in packs(str(tmp_path)) if p.startswith(name(0))]
    assert stored > 1.3 * used, (stored, used)
    for s in steps:
        assert same(quire.load(str(tmp_path / name(s))), trees[s])


def test_compaction_moves_carried_and_hashed_chunks_checked(tmp_path: Path) -> None:
    """Carried leaves (the same object) and hash-equal ones (a new object) both move;
    the moved bytes are checked against their binding as they are read back."""
    frozen = jnp.asarray(rand(7, (16, 256)))
    with quire.Checkpointer(tmp_path, incremental=True) as ck:
        ck.save(0, tree(0, frozen) | {"again": jnp.asarray(rand(8, (16, 256)))})
        ck.wait()
        t1 = tree(1, frozen) | {"again": jnp.asarray(rand(8, (16, 256)))}  # equal bytes
        ck.save(1, t1)
        ck.wait()
    rec = json.loads((tmp_path / name(1) / "quire.json").read_text())
    assert "borrowed" not in rec["indexes"][0]
    assert same(quire.load(str(tmp_path / name(1))), t1)
    assert cli(["verify", str(tmp_path / name(1))]) == 0


def test_damaged_chunk_is_not_copied(tmp_path: Path) -> None:
    frozen = jnp.asarray(rand(7, (16, 256)))
    with quire.Checkpointer(tmp_path, incremental=True) as ck:
        ck.save(0, tree(0, frozen))
        ck.wait()
        (pack,) = (tmp_path / name(0)).rglob("p00000-00000")
        rec = json.loads((tmp_path / name(0) / "quire.json").read_text())
        idx = json.loads((tmp_path / name(0) / rec["indexes"][0]["object"]).read_text())
        (off, n) = next(v[1:] for k, v in idx["refs"].items() if "frozen/c/" in k)
        data = bytearray(pack.read_bytes())
        data[off + n // 2] ^= 1
        pack.write_bytes(bytes(data))
        with pytest.raises(quire.errors.CorruptCheckpointError, match="frozen"):
            ck.save(1, tree(1, frozen))
            ck.wait()


def test_compact_below_is_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="compact_below"):
        quire.Checkpointer(tmp_path, incremental=True, compact_below=1.5)
