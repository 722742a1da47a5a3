"""The partial-save journal on S3 (moto) and GCS (fake-gcs-server): the same
model-based test as on memory and local disk, plus a racing second writer on each, where
the conditional create of journal records is enforced by the server."""

from __future__ import annotations

import importlib.util
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from object_store_servers import SCHEMES, STORES, MotoS3

import quire
from quire import partial
from quire._runtime import ioloop as _io

_spec = importlib.util.spec_from_file_location(
    "_quire_journal_model", Path(__file__).parent.parent / "core" / "tests" / "test_partial.py"
)
assert _spec is not None and _spec.loader is not None
_model = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_model)

_SETTINGS = settings(
    max_examples=6, stateful_step_count=8, deadline=None, suppress_health_check=list(HealthCheck)
)


def _run_machine(server: Any, protocol: str) -> None:
    class Machine(_model.JournalMachine):  # type: ignore[name-defined,misc]
        def make_url(self) -> str:
            return str(server.fresh_url())

    with quire.Context(storage_options={protocol: server.options()}):
        test = Machine.TestCase
        test.settings = _SETTINGS
        test().runTest()


@pytest.mark.parametrize("scheme", SCHEMES)
def test_journal_model(scheme: str, request: pytest.FixtureRequest) -> None:
    _run_machine(request.getfixturevalue(STORES[scheme].fixture), scheme)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_concurrent_appends_never_lose_a_version(
    scheme: str, request: pytest.FixtureRequest
) -> None:
    server = request.getfixturevalue(STORES[scheme].fixture)
    url = server.fresh_url()
    opts = server.options()
    partial.save(url, {"init": np.zeros(1)}, storage_options=opts)
    errors: list[BaseException] = []

    from quire._engine import journal as _journal
    from quire._engine import save as _saving
    from quire._runtime import ioloop as _io

    def writer(who: str) -> None:
        for i in range(6):
            try:
                # The engine directly, not quire.partial.save: that would queue the two
                # writers one after the other; here they race for versions on the server.
                with quire.Context(storage_options={scheme: opts}):
                    prep = _saving.prepare_save(
                        {"pytree": {who: {f"k{i}": np.full(2, i)}}}, None, copy=True, url=url
                    )
                    _io.submit(_journal.append(url, prep=prep)).result()
            except BaseException as e:  # pragma: no cover - reported below
                errors.append(e)

    ts = [threading.Thread(target=writer, args=(w,)) for w in ("A", "B")]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors
    versions = partial.versions(url, storage_options=opts)
    assert [v.version for v in versions] == list(range(1, 14))
    final = partial.load(url, storage_options=opts)
    assert sorted(final["A"]) == [f"k{i}" for i in range(6)] == sorted(final["B"])
    partial.finalize(url, storage_options=opts)
    assert sorted(quire.load(url, storage_options=opts)) == ["A", "B", "init"]


def test_finalize_rewrites_mostly_dead_packs_on_s3(moto: MotoS3) -> None:
    """Format v2 on S3: versions left mostly dead are rewritten into one new pack at
    finalize (ranged GETs, a multipart pack), an index that keeps a pack in place too."""
    from quire._engine.verify import verify

    url = moto.fresh_url()
    with quire.Context(storage_options={"s3": moto.options()}):
        with quire.Context(pack_bytes=9000):  # version 1: [a | b] and [c] in two packs
            partial.save(url, {"a": np.ones(1000, np.float32), "b": np.full(900, 2.0),
                               "c": np.full(1000, 3, np.float32)})  # fmt: skip
        for i in range(3):
            partial.save(url, {"a": np.full(1000, i, np.float32), f"x{i}": np.arange(50 + i)})
        partial.save(url, {"a": np.zeros(1000, np.float32)})
        want = partial.load(url)
        before = _model.stored(url)
        partial.finalize(url)
        after = _model.stored(url)
        got = quire.load(url)
        assert got.keys() == want.keys() == {"a", "b", "c", "x0", "x1", "x2"}
        for k in want:
            assert np.array_equal(got[k], want[k])
        assert len(after) < len(before) and sum(after.values()) < sum(before.values())
        _model.assert_tidy(url)
        checked, problems = _io.submit(verify(url)).result()
        assert checked == 12 and problems == []
