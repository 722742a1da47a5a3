"""Incremental Checkpointer steps (``incremental=True``): borrowed bytes, their gc, and
every way of reading one step alone (load, verify, info, cp, quire.open, fsspec + zarr)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import quire
from quire._cli.main import main as cli
from quire._engine import garbage as _gc
from quire._format import root as _root
from quire._handlers.arrays import ArrayHandler
from quire._runtime import ioloop as _io
from quire._store.url import open_backend
from quire.errors import CorruptCheckpointError
from quire.policies import LatestN

N_FROZEN = 9
SHAPE = (128, 256)


def name(step: int) -> str:
    return _root.DEFAULT_STEP_FORMAT.format(step)


def rand(seed: int, shape: tuple[int, ...] = SHAPE) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def frozen_tree() -> dict[str, Any]:
    return {f"layer{i}": jnp.asarray(rand(100 + i)) for i in range(N_FROZEN)}


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def same(a: Any, b: Any) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(
        np.asarray(x).dtype == np.asarray(y).dtype and np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(la, lb)
    )


def steps_bytes(root: Path, trees: list[dict[str, Any]], **kw: Any) -> list[int]:
    """Bytes each step adds at the backend (its directory; leases are gone by then)."""
    out = []
    with quire.Checkpointer(root, **kw) as ck:
        for s, t in enumerate(trees):
            before = du(root)
            ck.save(s, t)
            ck.wait()
            out.append(du(root) - before)
    return out


# ----------------------------------------------------------------------------- bytes
def test_frozen_90_percent_writes_at_most_12_percent(tmp_path: Path) -> None:
    frozen = frozen_tree()
    trees = [{"frozen": frozen, "lora": jnp.asarray(rand(s))} for s in range(4)]
    got = steps_bytes(tmp_path / "r", trees, incremental=True)
    assert all(b <= 0.12 * got[0] for b in got[1:]), got
    for s, t in enumerate(trees):
        assert same(quire.load(str(tmp_path / "r" / name(s))), t)


def test_recomputed_identical_tree_writes_at_most_1_percent(tmp_path: Path) -> None:
    base = {f"w{i}": rand(i) for i in range(10)}
    # new jax.Array objects every step, same bytes: found by the chunk hashes
    trees = [jax.tree.map(jnp.asarray, base) for _ in range(3)]
    got = steps_bytes(tmp_path / "r", trees, incremental=True)
    assert all(b <= 0.01 * got[0] for b in got[1:]), got
    assert same(quire.load(str(tmp_path / "r" / name(2))), base)


def test_everything_changed_costs_at_most_5_percent_more(tmp_path: Path) -> None:
    trees = [{f"w{i}": jnp.asarray(rand(10 * s + i)) for i in range(10)} for s in range(3)]
    inc = steps_bytes(tmp_path / "inc", trees, incremental=True)
    plain = steps_bytes(tmp_path / "plain", trees)
    assert all(i <= 1.05 * p for i, p in zip(inc, plain)), (inc, plain)


def test_same_object_is_not_copied_to_host(tmp_path: Path, monkeypatch: Any) -> None:
    seen: list[int] = []
    orig = ArrayHandler.snapshot

    def counting(self: Any, entries: Any) -> Any:
        seen.append(len(entries))
        return orig(self, entries)

    monkeypatch.setattr(ArrayHandler, "snapshot", counting)
    frozen = frozen_tree()
    with quire.Checkpointer(tmp_path, incremental=True) as ck:
        ck.save(0, {"frozen": frozen, "lora": jnp.asarray(rand(0))})
        ck.wait()
        ck.save(1, {"frozen": frozen, "lora": jnp.asarray(rand(1))})
        ck.wait()
    assert seen == [N_FROZEN + 1, 1]  # step 1: only the changed leaf went to host
    assert same(quire.load(str(tmp_path / name(1)))["frozen"], frozen)


def test_resumed_run_borrows_from_the_latest_step(tmp_path: Path) -> None:
    frozen = frozen_tree()
    steps_bytes(tmp_path, [{"frozen": frozen, "x": jnp.asarray(rand(0))}], incremental=True)
    first = du(tmp_path)
    with quire.Checkpointer(tmp_path, incremental=True) as ck:  # a new run: no objects known
        ck.save(1, {"frozen": frozen_tree(), "x": jnp.asarray(rand(1))})
    assert du(tmp_path) - first <= 0.15 * first
    assert same(quire.load(str(tmp_path / name(1)))["frozen"], frozen)


# ----------------------------------------------------------------------------- format
def test_unchanged_0d_arrays_are_borrowed_whole(tmp_path: Path) -> None:
    """A 0-d array's one chunk key is ``<loc>/c`` (no coordinates): the carry of an unchanged
    leaf missed it, and the next step's index had the array's zarr.json but no chunk, so
    that step failed to load ("missing chunk object"; issue 29's generated round trips)."""
    tree = {"flag": jnp.asarray(True), "step": jnp.asarray(np.int32(7)), "n": np.float32(2.5)}
    root = tmp_path / "root"
    with quire.Checkpointer(root, incremental=True, gc_grace_period=None) as ck:
        ck.save(1, tree)
        ck.save(2, dict(tree))  # the same objects: carried
        ck.save(3, {k: np.asarray(v) for k, v in tree.items()})  # new objects: hashed
        ck.wait()
    for step in (2, 3):
        url = root / name(step)
        assert same(quire.load(url), {k: np.asarray(v) for k, v in tree.items()}), step
        assert not quire.verify(url).problems
        entries = json.loads((url / "quire.json").read_text())["indexes"]
        assert entries[0].get("borrowed"), entries  # nothing written again


@pytest.mark.parametrize(
    ("key", "location", "chunk"),
    [
        ("d/t/pytree/w/zarr.json", "d/t/pytree/w", False),
        ("d/t/pytree/w/c/0/3", "d/t/pytree/w", True),
        ("d/t/pytree/w/c", "d/t/pytree/w", True),  # a 0-d array's one chunk
        ("d/t/pytree/c/c", "d/t/pytree/c", True),  # ... of a leaf named "c"
        ("d/t/pytree/c/c/1", "d/t/pytree/c", True),
        ("d/t/pytree/x/c/0/c/2", "d/t/pytree/x/c/0", True),  # key path x/c/0
    ],
)
def test_zarr_key_locations(key: str, location: str, chunk: bool) -> None:
    from quire._format.paths import is_chunk_of, location_of

    assert location_of(key) == location
    assert is_chunk_of(key, location) is chunk


def test_record_declares_borrowed_packs_and_index_hashes(tmp_path: Path) -> None:
    frozen = frozen_tree()
    trees = [{"frozen": frozen, "lora": jnp.asarray(rand(s))} for s in range(3)]
    steps_bytes(tmp_path, trees, incremental=True)
    rec = json.loads((tmp_path / name(2) / "quire.json").read_text())
    (entry,) = rec["indexes"]
    # step 2 borrows from step 0's pack directly (no chains through step 1)
    (lent,) = entry["borrowed"]
    assert lent.startswith(f"../{name(0)}/d/") and lent.endswith("/%packs/p00000-00000")
    assert entry["borrowed"][lent] == N_FROZEN * 4 * 128 * 256 + N_FROZEN * 4 * 0 + 4 * N_FROZEN
    idx = json.loads((tmp_path / name(2) / entry["object"]).read_text())
    assert set(idx["quire"]["xxh3"]) == {k for k in idx["refs"] if not k.endswith("zarr.json")}
    assert all(len(h) == 32 for h in idx["quire"]["xxh3"].values())
    targets = {v[0] for v in idx["refs"].values() if isinstance(v, list)}
    assert targets - set(entry["borrowed"]) == {f"d/{entry['txid']}/%packs/p00000-00000"}


def test_undeclared_borrowed_target_is_refused(tmp_path: Path) -> None:
    frozen = frozen_tree()
    trees = [{"frozen": frozen, "lora": jnp.asarray(rand(s))} for s in range(2)]
    steps_bytes(tmp_path, trees, incremental=True)
    path = tmp_path / name(1) / "quire.json"
    rec = json.loads(path.read_text())
    rec["indexes"][0].pop("borrowed")
    from quire._format.record import record_checksum

    rec["checksum"] = record_checksum(rec)
    path.write_text(json.dumps(rec))
    with pytest.raises(CorruptCheckpointError, match="nor a borrowed pack it declares"):
        quire.load(str(tmp_path / name(1)))


def test_malformed_borrowed_declaration_is_refused(tmp_path: Path) -> None:
    trees = [{"a": jnp.asarray(rand(0)), "b": jnp.asarray(rand(s))} for s in range(2)]
    frozen = trees[0]["a"]
    trees[1]["a"] = frozen
    steps_bytes(tmp_path, trees, incremental=True)
    path = tmp_path / name(1) / "quire.json"
    rec = json.loads(path.read_text())
    (t,) = rec["indexes"][0]["borrowed"]
    rec["indexes"][0]["borrowed"] = {"../../etc" + t[2:]: 1}
    from quire._format.record import record_checksum

    rec["checksum"] = record_checksum(rec)
    path.write_text(json.dumps(rec))
    with pytest.raises(CorruptCheckpointError, match="malformed chunk-index entry"):
        quire.load(str(tmp_path / name(1)))


def test_one_step_reads_alone(tmp_path: Path, capsys: Any) -> None:
    frozen = frozen_tree()
    trees = [{"frozen": frozen, "lora": jnp.asarray(rand(s))} for s in range(3)]
    steps_bytes(tmp_path / "r", trees, incremental=True)
    url = str(tmp_path / "r" / name(2))
    assert cli(["verify", url]) == 0
    assert cli(["info", url]) == 0
    out = capsys.readouterr().out
    assert "incremental: owns 128.0 KiB" in out and "borrows 1.1 MiB from 1 pack(s)" in out
    src = quire.open(url)
    assert np.array_equal(np.asarray(src.tree["frozen"]["layer3"]), np.asarray(frozen["layer3"]))
    # quire.zarr_store, as documented: plain zarr reads every array
    import zarr

    store = quire.zarr_store(url)
    rec = json.loads((tmp_path / "r" / name(2) / "quire.json").read_text())
    loc = rec["units"]["pytree"]["tree"]["children"][0]["children"][3]["location"]
    arr = zarr.open_array(store, path=loc, mode="r")
    assert np.array_equal(arr[...], np.asarray(frozen["layer3"]))
    # cp writes a self-contained checkpoint: it loads with the root gone
    assert cli(["cp", url, str(tmp_path / "copy")]) == 0
    shutil.rmtree(tmp_path / "r")
    assert not (tmp_path / name(0)).exists()  # nothing written beside the copy
    assert "borrowed" not in (tmp_path / "copy" / "quire.json").read_text()
    assert cli(["verify", str(tmp_path / "copy")]) == 0
    assert same(quire.load(str(tmp_path / "copy")), trees[2])


def test_damaged_borrowed_byte_fails_load_and_verify(tmp_path: Path) -> None:
    frozen = frozen_tree()
    trees = [{"frozen": frozen, "lora": jnp.asarray(rand(s))} for s in range(2)]
    steps_bytes(tmp_path, trees, incremental=True)
    (pack,) = (tmp_path / name(0)).rglob("p00000-00000")
    data = bytearray(pack.read_bytes())
    data[100] ^= 1  # inside the first chunk (frozen, borrowed by step 1)
    pack.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError):
        quire.load(str(tmp_path / name(1)))
    assert cli(["verify", str(tmp_path / name(1))]) != 0


# ----------------------------------------------------------------------------- retention, gc
def test_retention_deletes_records_and_gc_frees_bytes_nobody_uses(tmp_path: Path) -> None:
    frozen = frozen_tree()
    trees = [{"frozen": frozen, "lora": jnp.asarray(rand(s))} for s in range(6)]
    with quire.Checkpointer(tmp_path, incremental=True, keep=LatestN(2)) as ck:
        for s, t in enumerate(trees):
            ck.save(s, t)
            ck.wait()
        assert ck.steps() == [4, 5]
        # step 0's pack holds the frozen bytes steps 4 and 5 borrow: kept; the rest gone
        assert not (tmp_path / name(0) / "quire.json").exists()
        left = sorted(p.name for p in (tmp_path / name(0)).rglob("*") if p.is_file())
        assert left == ["p00000-00000", "retired.json"]
        for s in (1, 2, 3):
            assert not (tmp_path / name(s)).exists()
        ck.gc(0)
        for s in ck.steps():
            assert same(ck.load(s), trees[s])
            assert cli(["verify", str(tmp_path / name(s))]) == 0
        # a new frozen tree: once no retained step borrows step 0's pack, it goes
        other = {"frozen": frozen_tree(), "lora": jnp.asarray(rand(99))}
        other["frozen"] = jax.tree.map(lambda x: x + 1, other["frozen"])
        ck.save(6, other)
        ck.wait()
        ck.save(7, other)
        ck.wait()
        assert ck.steps() == [6, 7]
        ck.gc(0)
    assert not list((tmp_path / name(0)).rglob("p00000-00000"))
    assert same(quire.load(str(tmp_path / name(7))), other)


def test_gc_honours_a_young_lease(tmp_path: Path) -> None:
    frozen = frozen_tree()
    trees = [{"frozen": frozen, "lora": jnp.asarray(rand(s))} for s in range(2)]
    steps_bytes(tmp_path, trees, incremental=True)
    (pack,) = (tmp_path / name(0)).rglob("p00000-00000")
    rel = str(pack.relative_to(tmp_path))
    # an in-flight save's lease names step 0's pack; then every step's record goes
    (tmp_path / "leases").mkdir(exist_ok=True)
    (tmp_path / "leases" / "step_00000009-x-p00000.json").write_text(json.dumps({"packs": [rel]}))
    for s in (0, 1):
        (tmp_path / name(s) / "quire.json").unlink()
    backend = open_backend(str(tmp_path))
    fmt = _root.StepFormat(_root.DEFAULT_STEP_FORMAT)

    def collect(grace: float) -> Any:
        return _io.submit(_gc.collect(backend, str(tmp_path), fmt, grace_period=grace)).result()

    os.utime(pack, (0, 0))
    collect(60)
    assert pack.exists()  # the lease is young
    lease = tmp_path / "leases" / "step_00000009-x-p00000.json"
    os.utime(lease, (0, 0))
    for p in tmp_path.rglob("*"):
        os.utime(p, (0, 0))
    collect(60)
    assert not pack.exists() and not lease.exists()  # an old lease is a dead save's


def test_gc_passes_over_a_lease_released_while_it_marks(tmp_path: Path) -> None:
    """Another process's save may release its lease between the gc's listing of the leases
    and its look at one (seen with 4 processes): the gc passes over it, it does not fail."""
    trees = [{"frozen": frozen_tree(), "lora": jnp.asarray(rand(s))} for s in range(2)]
    steps_bytes(tmp_path, trees, incremental=True)
    (tmp_path / "leases").mkdir(exist_ok=True)
    lease = tmp_path / "leases" / "step_00000009-x-p00003.json"
    lease.write_text('{"packs": []}')
    backend = open_backend(str(tmp_path))
    listed = backend.list

    async def list_then_release(prefix: str = "") -> list[str]:
        keys = await listed(prefix)
        lease.unlink(missing_ok=True)  # the other process's save released it just now
        return keys

    backend.list = list_then_release  # type: ignore[method-assign]
    steps = [_root.StepDir(name(s), s, (f"{name(s)}/quire.json",)) for s in range(2)]
    live = _io.submit(_gc.mark(backend, str(tmp_path), steps, 60)).result()
    assert not live.everything and live.stale_leases == ()
    assert any(p.endswith("p00000-00000") for p in live.packs)  # step 1 borrows step 0's


def test_cli_gc_keeps_borrowed_packs(tmp_path: Path) -> None:
    frozen = frozen_tree()
    trees = [{"frozen": frozen, "lora": jnp.asarray(rand(s))} for s in range(3)]
    steps_bytes(tmp_path, trees, incremental=True)
    # retention by hand: step 0's record goes; steps 1 and 2 borrow its pack
    (tmp_path / name(0) / "quire.json").unlink()
    (tmp_path / "leases").mkdir(exist_ok=True)
    (tmp_path / "leases" / "old.json").write_text('{"packs": []}')
    for p in tmp_path.rglob("*"):
        os.utime(p, (0, 0))
    assert cli(["gc", str(tmp_path), "--yes", "--grace", "0"]) == 0
    left = sorted(
        str(p.relative_to(tmp_path / name(0)))
        for p in (tmp_path / name(0)).rglob("*")
        if p.is_file()
    )
    assert len(left) == 1 and left[0].endswith("%packs/p00000-00000"), left
    assert not (tmp_path / "leases" / "old.json").exists()
    for s in (1, 2):
        assert same(quire.load(str(tmp_path / name(s))), trees[s])


def test_plain_checkpointer_prunes_an_incremental_root_safely(tmp_path: Path) -> None:
    """The marker ``leases/incremental.json`` makes any Checkpointer's retention delete
    records only: a run continued without ``incremental=True`` keeps borrowed packs."""
    frozen = frozen_tree()
    trees = [{"frozen": frozen, "lora": jnp.asarray(rand(s))} for s in range(3)]
    steps_bytes(tmp_path, trees, incremental=True)
    assert (tmp_path / "leases" / "incremental.json").exists()
    with quire.Checkpointer(tmp_path, keep=LatestN(2)) as ck:  # a plain run
        t = {"frozen": frozen, "lora": jnp.asarray(rand(9))}
        ck.save(3, t)
        ck.wait()
        assert ck.steps() == [2, 3]
    assert not (tmp_path / name(1)).exists()
    assert list((tmp_path / name(0)).rglob("p00000-00000"))  # step 2 borrows from it
    assert same(quire.load(str(tmp_path / name(2))), trees[2])
    assert same(quire.load(str(tmp_path / name(3))), t)


@pytest.mark.parametrize("how", ["save", "cp", "plain checkpointer"])
def test_replacing_a_step_others_borrow_from_keeps_their_bytes(tmp_path: Path, how: str) -> None:
    """A step of an incremental root replaced by an overwrite from outside the incremental
    Checkpointer (``quire.save(..., overwrite=True)``, ``quire cp --overwrite``, a plain
    Checkpointer's ``save(force=True)``) leaves the bytes of the step it replaces to the
    root's gc: later steps borrow them."""
    frozen = frozen_tree()
    trees = [{"frozen": frozen, "lora": jnp.asarray(rand(s))} for s in range(3)]
    steps_bytes(tmp_path / "run", trees, incremental=True)
    new = {"frozen": {k: v + 1 for k, v in frozen.items()}, "lora": jnp.asarray(rand(7))}
    step0 = tmp_path / "run" / name(0)
    if how == "save":
        quire.save(str(step0), new, overwrite=True)
    elif how == "cp":
        quire.save(str(tmp_path / "other"), new)
        assert cli(["cp", str(tmp_path / "other"), str(step0), "--overwrite"]) == 0
    else:
        with quire.Checkpointer(tmp_path / "run") as ck:
            ck.save(0, new, force=True)
            ck.wait()
    assert same(quire.load(str(step0)), new)
    for s in (1, 2):
        assert same(quire.load(str(tmp_path / "run" / name(s))), trees[s])
        assert quire.verify(str(tmp_path / "run" / name(s))).ok
    # the root's gc frees what nobody uses once the borrowers are gone
    for s in (1, 2):
        (tmp_path / "run" / name(s) / "quire.json").unlink()
    for p in (tmp_path / "run").rglob("*"):
        os.utime(p, (0, 0))
    assert cli(["gc", str(tmp_path / "run"), "--yes", "--grace", "0"]) == 0
    packs = sorted(p.name for p in step0.rglob("p00000-*"))
    assert len(packs) == 1, packs  # the replaced step's pack is gone, the new one stays
    assert same(quire.load(str(step0)), new)
