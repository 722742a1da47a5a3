"""quire-grain: Grain iterators as checkpointable units, found through the entry point."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import grain
import jax
import numpy as np
import pytest
from quire_grain import GrainIteratorHandler

import quire
from quire.testing import CheckpointableHandlerSuite


def dataset_iter(prefetch: bool = False) -> grain.DatasetIterator:
    """A shuffled, mapped, batched pipeline; with ``prefetch`` read by a thread pool (its
    iterator then holds locks and threads, as a training job's does)."""
    ds = grain.MapDataset.range(1000).shuffle(seed=7).map(lambda x: x * 3).batch(8)
    opts = grain.ReadOptions(num_threads=2, prefetch_buffer_size=4) if prefetch else None
    return iter(ds.to_iter_dataset(opts) if opts else ds.to_iter_dataset())


def loader_iter() -> Any:
    """A ``grain.DataLoader`` iterator over a range source (in-process, no workers)."""
    sampler = grain.samplers.IndexSampler(
        500, shuffle=True, seed=3, num_epochs=1, shard_options=grain.sharding.NoSharding()
    )
    loader = grain.DataLoader(
        data_source=grain.sources.RangeDataSource(0, 500, 1),
        sampler=sampler,
        operations=[grain.transforms.Batch(5)],
        worker_count=0,
    )
    return iter(loader)


def advance(it: Any, n: int) -> Any:
    for _ in range(n):
        next(it)
    return it


def same_position(a: Any, b: Any) -> None:
    """The same state, and the same next batches."""
    assert a.get_state() == b.get_state()
    for _ in range(2):
        np.testing.assert_array_equal(next(a), next(b))


class TestDatasetIterator(CheckpointableHandlerSuite):
    handler_id = "grain"

    @pytest.fixture
    def obj(self) -> Any:
        return advance(dataset_iter(prefetch=True), 3)

    def target(self, obj: Any) -> Any:
        return dataset_iter()

    def mutate(self, obj: Any) -> None:
        advance(obj, 5)

    def assert_restored(self, original: Any, restored: Any) -> None:
        same_position(original, restored)


class TestDataLoaderIterator(CheckpointableHandlerSuite):
    handler_id = "grain"

    @pytest.fixture
    def obj(self) -> Any:
        return advance(loader_iter(), 4)

    def target(self, obj: Any) -> Any:
        return loader_iter()

    def mutate(self, obj: Any) -> None:
        advance(obj, 2)

    def assert_restored(self, original: Any, restored: Any) -> None:
        same_position(original, restored)


def test_async_save_resumes_at_the_position_at_the_call(tmp_path: Path) -> None:
    """The loop moves on 50 batches while the save writes; the checkpoint holds the call's
    position (issue 29: a Grain iterator cannot be deep-copied, and its live state was
    written later)."""
    it = advance(dataset_iter(prefetch=True), 6)
    expected = advance(dataset_iter(), 6)
    url = str(tmp_path / "c")
    r = quire.save_checkpointables_async(url, {"data": it, "p": {"w": np.arange(3.0)}})
    advance(it, 50)
    r.result(timeout=60)
    back = quire.load_checkpointables(url, {"data": dataset_iter(prefetch=True)})["data"]
    same_position(expected, back)


@pytest.mark.parametrize("make", [dataset_iter, loader_iter], ids=["dataset", "dataloader"])
def test_checkpointer_steps_hold_their_positions(tmp_path: Path, make: Any) -> None:
    """A Checkpointer with a local tier, async saves every 3 steps while the loop runs."""
    it = make()
    with quire.Checkpointer(
        str(tmp_path / "run"), local=quire.LocalTier(str(tmp_path / "local"))
    ) as ckpt:
        for step in range(1, 13):
            next(it)
            if step % 3 == 0:
                ckpt.save_checkpointables(step, {"data": it, "step": {"n": np.int64(step)}})
        ckpt.wait()
        for step in (3, 6, 9, 12):
            got = ckpt.load_checkpointables(step, {"data": make(), "step": None})
            assert int(got["step"]["n"]) == step
            same_position(advance(make(), step), got["data"])
    (last,) = (tmp_path / "run").glob("*12/quire.json")
    assert quire.metadata(str(last.parent)).units["data"] == "grain"


def test_the_state_is_plain_json_under_the_unit(tmp_path: Path) -> None:
    url = tmp_path / "c"
    quire.save_checkpointables(str(url), {"data": advance(dataset_iter(), 2)})
    (state,) = url.rglob("state.json")
    assert json.loads(state.read_bytes()[:-4]) == {"next_index": 2}  # + its crc32c


def test_loading_needs_an_iterator_of_the_same_kind(tmp_path: Path) -> None:
    url = str(tmp_path / "c")
    quire.save_checkpointables(url, {"data": advance(dataset_iter(), 2)})
    for target in (None, loader_iter()):
        with pytest.raises(quire.TreeMismatchError, match=r"pass the iterator to restore into"):
            quire.load_checkpointables(url, {"data": target})


def test_a_loader_of_another_pipeline_is_refused(tmp_path: Path) -> None:
    url = str(tmp_path / "c")
    quire.save_checkpointables(url, {"data": advance(loader_iter(), 2)})
    other = iter(
        grain.DataLoader(
            data_source=grain.sources.RangeDataSource(0, 500, 1),
            sampler=grain.samplers.IndexSampler(
                500, shuffle=True, seed=4, shard_options=grain.sharding.NoSharding()
            ),
            worker_count=0,
        )
    )
    with pytest.raises(quire.TreeMismatchError, match=r"refused the saved state.*Sampler"):
        quire.load_checkpointables(url, {"data": other})


def test_each_process_saves_its_own_position(tmp_path: Path) -> None:
    """The handler declares its state per process: one record per process, the state under
    the process's folder (several real processes: tests/test_perprocess_multihost.py)."""
    assert GrainIteratorHandler.per_process is True
    url = tmp_path / "c"
    quire.save_checkpointables(str(url), {"data": advance(dataset_iter(), 2)})
    unit = quire.metadata(str(url)).record["units"]["data"]
    assert unit["processes"] == 1 and unit["records"] == [{"kind": "dataset", "version": 1}]
    (state,) = url.rglob("state.json")
    assert state.parent.name == "p00000" and state.parent.parent.name == "data"


def test_a_whole_unit_of_one_position_is_refused_by_several_processes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A unit saved as one whole state (as quire-grain did before it declared per_process)
    still loads in one process, and is refused by several: one position restored into all
    of them would resume each at the same batch."""
    url = str(tmp_path / "c")
    with monkeypatch.context() as m:
        m.setattr(GrainIteratorHandler, "per_process", False)
        quire.save_checkpointables(url, {"data": advance(dataset_iter(), 4)})
    assert "record" in quire.metadata(url).record["units"]["data"]
    back = quire.load_checkpointables(url, {"data": dataset_iter()})["data"]
    same_position(advance(dataset_iter(), 4), back)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(quire.errors.MultiProcessError, match=r"one Grain iterator position.*2 processes"):
        quire.load_checkpointables(url, {"data": dataset_iter()})


def test_other_units_do_not_import_grain_handlers_needlessly() -> None:
    """quire asks every handler about every unit: the answer for non-Grain objects comes
    from the class's module, before grain is looked at."""
    h = GrainIteratorHandler()
    assert not h.handles({"a": 1}) and not h.handles(iter(range(3)))
    assert h.handles(dataset_iter()) and h.handles(loader_iter())


def test_an_iterator_given_as_a_leaf_says_how_to_save_it(tmp_path: Path) -> None:
    it = iter(grain.MapDataset.range(10).to_iter_dataset())
    with pytest.raises(quire.errors.UnsupportedLeafError, match=r"save_checkpointables") as e:
        quire.save(str(tmp_path / "c"), {"data": it})
    assert "'data'" in str(e.value) and "quire-grain" in str(e.value)
    assert not (tmp_path / "c" / "quire.json").exists()
