"""Generated round trips in one process (issue 29): whatever the tree, mesh, spec, storage
options, layout and target, a save loads back bit for bit, ``quire.verify`` passes, and
software other than quire reads every stored array identically.

Cases are drawn by ``propgen.cases`` (trees of every dtype, ranks 0-5, odd and prime shapes,
meshes of 1-8 of the 8 CPU devices with 1-3 Auto or Explicit axes in random device order,
replicated / partly replicated / split specs, casts, codecs, inner chunks, checksums off,
both layouts, replica writes and reads on and off) and checked by ``propcase`` (values from
numpy alone; bit patterns compared; plain zarr over fsspec's reference file system for the
packed layout, tensorstore's zarr3 driver for the chunks layout).

One test per save path: ``save``; ``save_async`` followed at once by a jitted step that
donates every jax.Array of the tree and an in-place overwrite of every numpy array;
the partial-save journal (versions adding, replacing and deleting leaves, then finalize);
a Checkpointer with a local tier (the step loaded from the local tier and from the
persistent one); an incremental Checkpointer (steps changing some leaves, borrowing the
rest).  And one for the class of issue 39: whatever the case, a save whose writer loses a
chunk (``dropchunk``) never commits, and the checkpoint it was to replace stays whole.  Each
load goes to the case's target: as saved, an abstract tree (the same
sharding, another mesh and spec, numpy, a cast), or a partial tree.

Budget: the ``ci`` profile (``conftest.py``) runs each test on a fixed set of examples;
``--hypothesis-profile deep`` (or ``QUIRE_HYPOTHESIS_PROFILE=deep``) runs many more with
fresh randomness (docs/reliability.md, "Generated tests").
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import dataclasses
import math
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import jax
import numpy as np
import propgen
import pytest
from dropchunk import dropping
from hypothesis import event, example, given
from hypothesis import strategies as st
from propcase import (
    Case,
    Leaf,
    MeshCase,
    Place,
    Storage,
    abstract,
    array,
    build_tree,
    casting,
    check_loaded,
    context,
    donate,
    external_reads,
    load,
    put,
    storage_of,
    values,
)
from props_budget import examples

import quire
from quire.errors import IncompleteCheckpointError

pytestmark = [
    pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (CPU) devices"),
    # Random bit patterns cast to narrower types overflow: numpy says so, as asked.
    pytest.mark.filterwarnings("ignore:(overflow|invalid value) encountered in cast"),
]


# ------------------------------------------------------------------------------ running a case
@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("props")


@contextmanager
def folder(base: Path) -> Iterator[Path]:
    """A fresh folder for one example, removed afterwards (examples run by the hundred)."""
    d = base / uuid.uuid4().hex[:12]
    d.mkdir()
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def check_checkpoint(url: Path, case: Case) -> None:
    """The oracle: the load matches, verify passes, outside readers read the same bytes."""
    problems = check_loaded(case, load(url, case))
    assert not problems, "\n".join(problems)
    report = quire.verify(str(url))
    assert not report.problems, report.problems
    outside = external_reads(url, case)
    assert not outside, "\n".join(outside)


# ------------------------------------------------------------------------------ the paths
# The defect of issue 29 (a replica-parallel save whose piece plan the schema rejects), in one
# process: a (2050, 4096) float32 array split over "model" and replicated over "data".
ISSUE_29_MESH = MeshCase((4, 2), ("data", "model"), ("auto", "auto"), tuple(range(8)))
ISSUE_29 = Case(
    (Leaf(("params", "proj"), (2050, 4096), "float32", 29, Place(ISSUE_29_MESH, (None, "model"))),),
)


ONE_DEVICE = MeshCase((1,), ("data",), ("auto",), (0,))


@examples(ci=40)
@given(case=propgen.cases(paths=("save",)))
@example(case=ISSUE_29)
# A compressed sub-byte int: zarr's codecs had no data type for int4 ("No Zarr data type").
@example(
    case=Case(
        (
            Leaf(("L0",), (), "int4", 0, Place(ONE_DEVICE, ()), Storage(codecs=("zstd",))),
            Leaf(("L1",), (3, 5), "uint2", 1, None, Storage(codecs=("blosc",), chunk_bytes=4)),
        ),
        layout="chunks",
    )
)
def test_save_round_trips(case: Case, base: Path) -> None:
    with folder(base) as d, context(case):
        url = d / "ckpt"
        quire.save(url, build_tree(case), storage=storage_of(case))
        check_checkpoint(url, case)


OLD = {"old": np.arange(5, dtype=np.int16)}


@examples(ci=10)
@given(case=propgen.cases(paths=("save",)), which=st.integers(0, 4), flat=st.integers(0, 2))
@example(case=ISSUE_29, which=0, flat=1)  # a piece of a replica-split shard
def test_a_save_that_loses_a_chunk_never_commits(
    case: Case, which: int, flat: int, base: Path
) -> None:
    """Chunk ``flat`` (C order in the grid quire chose) of leaf ``which`` is lost by the
    array writer: the overwrite is refused, naming it, and the old checkpoint loads; when
    the grid has no such chunk nothing is lost and the save commits.  The oracle is what
    the faulty writer reports it lost, not the check under test."""
    leaf = case.leaves[which % len(case.leaves)]
    with folder(base) as d:
        url = d / "ckpt"
        quire.save(url, OLD)
        with context(case), dropping(leaf.path, flat) as lost:
            try:
                quire.save(url, build_tree(case), storage=storage_of(case), overwrite=True)
            except IncompleteCheckpointError as e:
                event("a chunk lost: refused")
                assert lost, f"refused, but the writer lost nothing: {e}"
                assert e.key is not None and e.key.startswith(lost[0][0] + "/"), (e.key, lost)
                assert e.chunk == lost[0][1] and e.missing == len(lost), (e.chunk, lost)
                np.testing.assert_array_equal(quire.load(url)["old"], OLD["old"])
                return
        assert not lost, f"committed without {lost}"
        event("no such chunk: committed")
        with context(case):
            problems = check_loaded(case, load(url, case))
        assert not problems, "\n".join(problems)


def _one(name: str, byte: int | None = None) -> Case:
    """A 0-d numpy leaf of ``name`` holding the bit pattern ``byte`` (a seed found for it)."""
    for seed in range(10_000):
        leaf = Leaf(("w",), (), name, seed)
        if byte is None or values(leaf).view(np.uint8)[()] == byte:
            return Case((leaf,), path="save_async")
    raise AssertionError((name, byte))


@examples(ci=30)
@given(
    case=propgen.cases(paths=("save_async",)),
    before=st.none() | propgen.cases(paths=("save_async",), max_leaves=3),
)
# A float8_e4m3fn NaN after a float8_e3m4 save_async: the staging pool handed out the other
# type's buffer (same type string '<V1'), and the copy converted the value.
@example(case=_one("float8_e4m3fn", 0x7F), before=_one("float8_e3m4"))
def test_save_async_holds_the_values_at_the_call(
    case: Case, before: Case | None, base: Path
) -> None:
    """``before``: an earlier save_async in this process (its staging buffers stay)."""
    with folder(base) as d:
        if before is not None:
            with context(before):
                quire.save_async(
                    d / "before", build_tree(before), storage=storage_of(before)
                ).result()
        with context(case):
            url = d / "ckpt"
            tree = build_tree(case)
            pending = quire.save_async(url, tree, storage=storage_of(case))
            donate(tree)
            pending.result()
            check_checkpoint(url, case)


@examples(ci=24)
@given(case=propgen.cases(paths=("partial",)))
def test_partial_journal_round_trips(case: Case, base: Path) -> None:
    with folder(base) as d, context(case):
        url = d / "ckpt"
        seeds: dict[int, int] = {}
        storage = storage_of(case)
        for version in case.versions:
            part: dict[str, Any] = {}
            for i, seed in version:
                leaf = case.leaves[i]
                seeds[i] = leaf.seed if seed == -1 else seed
                put(part, leaf.path, array(leaf.with_seed(seeds[i])))
            quire.partial.save(url, part, storage=storage)
        if case.deleted:
            quire.partial.delete(url, [case.leaves[i].path for i in case.deleted])
        final = case.at(seeds, case.deleted)
        assert not check_loaded(_as_saved(final), quire.partial.load(url))
        quire.partial.finalize(url)
        check_checkpoint(url, final)


def _as_saved(case: Case) -> Case:
    return dataclasses.replace(
        case,
        target="none",
        leaves=tuple(dataclasses.replace(x, target=None) for x in case.leaves),
    )


@examples(ci=20)
@given(case=propgen.cases(paths=("tier",)))
def test_checkpointer_with_a_local_tier(case: Case, base: Path) -> None:
    with (
        folder(base) as d,
        context(case),
        quire.Checkpointer(
            d / "persistent", local=quire.LocalTier(d / "local"), gc_grace_period=None
        ) as ckpt,
    ):
        assert ckpt.save(1, build_tree(case))
        ckpt.wait()
        assert ckpt.tiers_of(1) == ("local", "persistent")
        problems = check_loaded(case, _ckpt_load(ckpt, 1, case))
        assert not problems, "\n".join(problems)
        check_checkpoint(d / "persistent" / "step_00000001", case)
        check_checkpoint(Path(quire.LocalTier(d / "local").process_url(0)) / "step_00000001", case)


def _ckpt_load(ckpt: quire.Checkpointer, step: int, case: Case) -> Any:
    if case.target == "none":
        return ckpt.load(step)
    return ckpt.load(step, abstract(case), partial=case.target == "partial", casting=casting(case))


@examples(ci=20)
@given(case=propgen.cases(paths=("incremental",)))
# An unchanged 0-d jax.Array: its chunk key <loc>/c was not carried to the next step's index.
@example(
    case=Case(
        (Leaf(("L0",), (), "bool", 0, Place(ONE_DEVICE, ())),), path="incremental", versions=((),)
    )
)
def test_incremental_steps_round_trip(case: Case, base: Path) -> None:
    with (
        folder(base) as d,
        context(case),
        quire.Checkpointer(d / "root", incremental=True, gc_grace_period=None) as ckpt,
    ):
        tree = build_tree(case)
        ckpt.save(1, tree)
        steps = {1: case}
        seeds = {i: leaf.seed for i, leaf in enumerate(case.leaves)}
        for n, changes in enumerate(case.versions, start=2):
            tree = dict(tree)
            for i, seed in changes:
                seeds[i] = seed
                put(tree, case.leaves[i].path, array(case.leaves[i].with_seed(seed)))
            ckpt.save(n, _copy_tree(tree))
            steps[n] = case.at(dict(seeds))
        ckpt.wait()
        for n, at in steps.items():
            check_checkpoint(d / "root" / f"step_{n:08d}", at)


def _copy_tree(tree: Any) -> Any:
    """The containers copied, the leaves (same objects) kept."""
    if isinstance(tree, dict):
        return {k: _copy_tree(v) for k, v in tree.items()}
    return tree


def test_values_are_random_bits() -> None:
    """The oracle's floats cover NaNs with payloads, infinities and -0.0 (a bit-exact
    comparison that never sees them proves less)."""
    leaf = Leaf(("w",), (4096,), "float32", 1)
    v = values(leaf)
    assert len({x.tobytes() for x in v[np.isnan(v)]}) > 1  # NaNs of several payloads
    assert np.isinf(v).any() and (np.signbit(v) & (v == 0)).any()  # and -0.0


@pytest.mark.parametrize(
    ("shape", "splits", "cap"),
    [([8, 7, 7, 7, 7], [8, 1, 1, 1, 1], 1 << 12), ([31] * 5, [1] * 5, 1 << 14), ([8], [8], 4)],
)
def test_generated_shapes_stay_within_their_cap(
    shape: list[int], splits: list[int], cap: int
) -> None:
    """The generator's shape cap halves factors, not splits, and ends: it once picked a
    split dimension at its smallest again and again (a deep run stalled on it for an hour)."""
    got = propgen.cap_shape(list(shape), splits, cap)
    assert all(n % s == 0 for n, s in zip(got, splits))
    assert math.prod(got) <= max(cap, math.prod(splits))
