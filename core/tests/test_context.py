"""quire.configure and quire.Context: validation, nesting and merging, thread and task
isolation, and propagation into quire's background threads; every option honoured."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import quire
from quire._runtime.config import OPTIONS, current

pytestmark = pytest.mark.quick  # the quick tier (CONTRIBUTING.md)


@pytest.fixture(autouse=True)
def restore_globals() -> Iterator[None]:
    saved = current()
    yield
    quire.configure(saved)


class Recorder:
    """A leaf handler that records what it sees while saving (in quire's loop and pool)."""

    id = "recorder"
    types = (type("Recorded", (), {}),)

    def __init__(self, gate: threading.Event | None = None) -> None:
        self.gate = gate
        self.seen: dict[str, Any] = {}

    def handles(self, v: Any) -> bool:
        return True

    def handles_abstract(self, a: Any) -> bool:
        return True

    def snapshot(self, entries: Any) -> list[Any]:
        return list(entries)

    async def save(self, entries: Any, ctx: Any) -> list[dict[str, Any]]:
        from quire._runtime import ioloop as _io

        if self.gate is not None:
            await _io.run_blocking(self.gate.wait, 30)
        self.seen["loop"] = current()
        self.seen["pool"] = await _io.run_blocking(current)
        self.seen["budget"] = ctx.budget.limit
        self.seen["backend_options"] = dict(ctx.backend.storage_options)
        return [{} for _ in entries]

    def check(self, entry: Any) -> None:
        return None

    async def load(self, entries: Any, ctx: Any) -> list[Any]:
        self.seen["load"] = current()
        return [self.types[0]() for _ in entries]

    def metadata(self, records: Any) -> list[Any]:
        return [object for _ in records]


def leaf() -> Any:
    return Recorder.types[0]()


# -- configure and validation ---------------------------------------------------------------


def test_every_option_is_documented_in_one_place() -> None:
    doc = quire.Config.__doc__ or ""
    page = (Path(__file__).parents[2] / "docs" / "configuration.md").read_text()
    for name in OPTIONS:
        assert f"{name} :" in doc, name
        assert f"`{name}`" in page, name


def test_configure_sets_and_validates() -> None:
    cfg = quire.configure(byte_budget=1 << 20, codecs="zstd", timeout=5)
    assert cfg is current() and cfg.byte_budget == 1 << 20
    assert cfg.codecs == ("zstd",) and cfg.timeout == 5.0
    with pytest.raises(TypeError, match=r"unknown quire option.*'byte_budgt'.*byte_budget"):
        quire.configure(byte_budgt=1)
    for bad in (
        {"byte_budget": 0},
        {"max_concurrency": True},
        {"primary_process": -1},
        {"timeout": -1},
        {"plugins": {"nogroup": "x"}},
    ):
        with pytest.raises(ValueError):
            quire.configure(**bad)
    for bad in (
        {"checksum": 1},
        {"pinned_staging": "yes"},
        {"storage_options": {"s3": 1}},
        {"leaf_handlers": [object()]},
    ):
        with pytest.raises(TypeError):
            quire.configure(**bad)
    assert current().byte_budget == 1 << 20  # a refused call changes nothing
    assert quire.configure(quire.Config()) == quire.Config()
    with pytest.raises(TypeError):
        quire.Context(nope=1)


# -- Context semantics ---------------------------------------------------------------------


def test_context_nests_merges_and_restores() -> None:
    quire.configure(storage_options={"s3": {"anon": True, "region": "eu"}}, checksum=True)
    outer_handler, inner_handler = Recorder(), Recorder()
    with quire.Context(
        storage_options={"s3": {"region": "us"}, "gs": {"project": "p"}},
        leaf_handlers=[outer_handler],
        plugins={"quire.backends:s3": "quire-s3"},
    ) as cfg:
        assert cfg is current()
        assert cfg.storage_options == {
            "s3": {"anon": True, "region": "us"},
            "gs": {"project": "p"},
        }
        with quire.Context(checksum=False, leaf_handlers=[inner_handler]) as inner:
            assert inner.checksum is False
            assert inner.leaf_handlers == (inner_handler, outer_handler)
            assert inner.plugins == {"quire.backends:s3": "quire-s3"}
        assert current() is cfg
    assert current().storage_options == {"s3": {"anon": True, "region": "eu"}}
    assert current().leaf_handlers == ()


def test_context_restores_on_error() -> None:
    with pytest.raises(RuntimeError), quire.Context(byte_budget=123):
        raise RuntimeError
    assert current().byte_budget == quire.Config().byte_budget


def test_threads_see_their_own_context() -> None:
    n = 8
    barrier = threading.Barrier(n)
    seen: dict[int, list[int]] = {}
    ctx = quire.Context(max_concurrency=999)  # one object shared by every thread

    def work(i: int) -> None:
        with quire.Context(byte_budget=1000 + i):
            barrier.wait()
            with ctx:
                barrier.wait()
                got = [current().byte_budget, current().max_concurrency]
            barrier.wait()
            seen[i] = [*got, current().max_concurrency]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    default = quire.Config().max_concurrency
    assert seen == {i: [1000 + i, 999, default] for i in range(n)}


def test_tasks_see_their_own_context() -> None:
    async def task(i: int, started: asyncio.Barrier) -> int:
        with quire.Context(primary_process=i):
            await started.wait()
            await asyncio.sleep(0.01 * (5 - i))
            return current().primary_process

    async def main() -> list[int]:
        started = asyncio.Barrier(5)
        return list(await asyncio.gather(*(task(i, started) for i in range(5))))

    assert asyncio.run(main()) == [0, 1, 2, 3, 4]


# -- propagation into the background -------------------------------------------------------


def test_context_applies_in_quires_threads(tmp_path: Path) -> None:
    h = Recorder()
    url = str(tmp_path / "c")
    with quire.Context(leaf_handlers=[h], byte_budget=12345) as cfg:
        quire.save(url, {"r": leaf()})
        assert quire.metadata(url).record["units"]["pytree"]["tree"]["children"][0]["handler"] == (
            "recorder"
        )
        quire.load(url)
    assert h.seen["loop"] is cfg and h.seen["pool"] is cfg and h.seen["load"] is cfg
    assert h.seen["budget"] == 12345
    # Outside the block the handler does not exist.
    with pytest.raises(quire.errors.PluginError, match="'recorder'"):
        quire.load(url)
    with pytest.raises(quire.errors.UnsupportedLeafError):
        quire.save(str(tmp_path / "d"), {"r": leaf()})


def test_save_async_keeps_the_context_of_its_call(tmp_path: Path) -> None:
    gate = threading.Event()
    h = Recorder(gate)
    url = str(tmp_path / "c")
    with quire.Context(leaf_handlers=[h], byte_budget=777) as cfg:
        pending = quire.save_async(url, {"r": leaf()})
    with quire.Context(byte_budget=1):  # another block, while the save still runs
        gate.set()
        pending.result(timeout=60)
    assert h.seen["loop"] is cfg and h.seen["pool"] is cfg and h.seen["budget"] == 777


def test_context_from_another_thread_does_not_leak(tmp_path: Path) -> None:
    """A blocking call in one thread, under a Context, while another thread saves without."""
    h = Recorder()
    gate = threading.Event()
    slow = Recorder(gate)
    slow.id = "slow"
    errors: list[BaseException] = []

    def other() -> None:
        try:
            with quire.Context(leaf_handlers=[slow], byte_budget=4242):
                quire.save(str(tmp_path / "other"), {"r": leaf()})
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=other)
    t.start()
    with quire.Context(leaf_handlers=[h], byte_budget=2121):
        quire.save(str(tmp_path / "mine"), {"r": leaf()})
    gate.set()
    t.join(60)
    assert not errors
    assert h.seen["budget"] == 2121 and slow.seen["budget"] == 4242


# -- every option honoured -------------------------------------------------------------------


def test_storage_options_per_protocol(tmp_path: Path) -> None:
    h = Recorder()
    url = str(tmp_path / "c")
    with quire.Context(
        leaf_handlers=[h],
        storage_options={"file": {"fsync": False, "a": 1}, "memory": {"b": 2}},
    ):
        quire.save(url, {"r": leaf()}, storage_options={"a": 9})
    assert h.seen["backend_options"] == {"fsync": False, "a": 9}


def test_default_codecs_and_checksum(tmp_path: Path) -> None:
    url = str(tmp_path / "c")
    with quire.Context(codecs=("zstd",), checksum=False):
        quire.save(url, {"x": np.arange(100.0)})
    rec = quire.metadata(url).record["units"]["pytree"]["tree"]["children"][0]
    assert [c["name"] for c in rec["codecs"]] == ["zstd"] and rec["checksum"] is False
    np.testing.assert_array_equal(quire.load(url)["x"], np.arange(100.0))
    # An explicit StorageOptions wins over the defaults.
    url2 = str(tmp_path / "d")
    with quire.Context(codecs=("zstd",)):
        quire.save(url2, {"x": np.arange(3.0)}, storage=quire.StorageOptions(codecs=["gzip"]))
    rec = quire.metadata(url2).record["units"]["pytree"]["tree"]["children"][0]
    assert [c["name"] for c in rec["codecs"]] == ["gzip"]


def test_byte_budget_bounds_a_save(tmp_path: Path) -> None:
    from quire import _api

    stats: dict[str, Any] = {}
    tree = {f"x{i}": np.random.default_rng(i).standard_normal(64 * 1024) for i in range(8)}
    chunk = tree["x0"].nbytes
    with quire.Context(byte_budget=chunk, codecs=("zstd",)):
        _api._start_save(
            "save", str(tmp_path / "c"), {"pytree": tree}, False, {}, stats=stats
        ).result(timeout=60)
    # One chunk in flight at a time: a chunk's request (its encoded copies, 2 x chunk with a
    # compressor) exceeds the budget, and such a request is admitted only alone.
    assert 0 < stats["budget_peak"] <= 2 * chunk


def test_primary_process_and_timeout_reach_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    from quire._engine import save as _saving

    with quire.Context(primary_process=3):
        assert _saving.process_layout()[2] == 3
    seen: list[tuple[int, float | None]] = []
    import quire._runtime.multihost as mh

    class Probe(mh.Coordinator):
        def __init__(
            self, url: str, what: str, *, primary: int, timeout: float | None, **kw: Any
        ) -> None:
            seen.append((primary, timeout))
            super().__init__(url, what, primary=primary, timeout=timeout, **kw)

    monkeypatch.setattr(_saving, "Coordinator", Probe)
    with quire.Context(timeout=12.5):
        quire.save("memory://quire-tests/ctx-timeout", {"x": np.ones(1)}, overwrite=True)
    assert seen and seen[0] == (0, 12.5)


def test_config_fields_are_all_known() -> None:
    assert set(OPTIONS) == {f.name for f in dataclasses.fields(quire.Config)}
    assert set(OPTIONS) == {
        "byte_budget",
        "max_concurrency",
        "storage_options",
        "plugins",
        "primary_process",
        "checksum",
        "codecs",
        "timeout",
        "leaf_handlers",
        "verify_record",
        "progress",
        "layout",
        "pack_bytes",
        "replica_writes",
        "replica_piece_bytes",
        "replica_reads",
        "replica_read_min_bytes",
        "pinned_staging",
    }


def test_max_concurrency_bounds_requests_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    from quire._store.memory import MemoryBackend

    in_flight = peak = 0
    real_put, real_get = MemoryBackend.put, MemoryBackend.get

    async def counted(real: Any, *args: Any, **kwargs: Any) -> Any:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        try:
            await asyncio.sleep(0.002)
            return await real(*args, **kwargs)
        finally:
            in_flight -= 1

    async def put(self: Any, *a: Any, **k: Any) -> Any:
        return await counted(real_put, self, *a, **k)

    async def get(self: Any, *a: Any, **k: Any) -> Any:
        return await counted(real_get, self, *a, **k)

    monkeypatch.setattr(MemoryBackend, "put", put)
    monkeypatch.setattr(MemoryBackend, "get", get)
    tree = {f"x{i}": np.arange(64.0) for i in range(32)}
    url = "memory://quire-tests/ctx-concurrency"
    with quire.Context(max_concurrency=3):
        quire.save(url, tree, overwrite=True)
        save_peak, peak = peak, 0
        quire.load(url)
    assert save_peak <= 3 and peak <= 3, (save_peak, peak)
