"""The versioned partial-save journal: semantics, model-based test, crashes, two writers."""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
import threading
import uuid
from pathlib import Path
from typing import Any

import forkserver
import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import quire
from quire import partial
from quire._engine import commit as _commit
from quire._engine import packrewrite as _packrewrite
from quire._format.chunkindex import parse_index
from quire._runtime import ioloop as _io
from quire._store.url import open_backend


# ----------------------------------------------------------------------------- packs (format v2)
def stored(url: str) -> dict[str, int]:
    """Every object under ``<url>/d/`` and its size."""
    b = open_backend(url)

    async def go() -> dict[str, int]:
        keys = await b.list("d")
        return {k: await b.size(k) for k in keys}

    return _io.submit(go()).result()


def pack_report(url: str) -> tuple[dict[str, tuple[int, int]], set[str]]:
    """For a finalized checkpoint: ``{pack: (live bytes, size)}`` over every index the
    record names, and every object the record references (indexes and packs)."""
    b = open_backend(url)
    doc = json.loads(_io.submit(b.get("quire.json")).result())
    tree = doc["units"]["pytree"]["tree"]
    live = set(_packrewrite.leaf_records(tree))
    refs = []
    referenced = set()
    for e in doc.get("indexes", []):
        refs.append(parse_index(_io.submit(b.get(e["object"])).result(), e, url))
        referenced.add(e["object"])
    liveness = _packrewrite.pack_liveness(refs, live)
    return liveness, referenced | set(liveness)


def assert_tidy(url: str) -> None:
    """After a finalize: no pack the record names is less than half live, and nothing under
    ``d/`` is left that the record does not reference."""
    liveness, referenced = pack_report(url)
    low = {p: v for p, v in liveness.items() if _packrewrite.rewrites(*v)}
    assert not low, low
    assert set(stored(url)) == referenced


def collect_garbage(url: str) -> None:
    """``quire gc URL --yes --grace 0``, with the current Context's storage options."""
    from quire._engine import prefix_garbage

    def opener(path: str) -> Any:
        return open_backend(f"{url}/{path}")

    _io.submit(
        prefix_garbage.collect_any(open_backend(url), url, opener, grace_period=0, dry_run=False)
    ).result()


class _Killed(RuntimeError):
    """Stands for a SIGKILL in the model (the real ones: test_packrewrite.py)."""


def test_versions_add_replace_delete_and_metadata(url: str) -> None:
    assert (
        partial.save(
            url,
            {"params": {"w": np.ones(3), "b": np.zeros(2)}, "step": 1},
            metadata={"a": 1, "x": 0},
        )
        == 1
    )
    assert (
        partial.save(
            url, {"params": {"w": np.full(3, 2.0)}, "opt": [np.ones(1)]}, metadata={"x": 9}
        )
        == 2
    )
    assert partial.delete(url, [("params", "b")]) == 3
    vs = partial.versions(url)
    assert [v.version for v in vs] == [1, 2, 3]
    assert vs[0].added == [("params", "w"), ("params", "b"), ("step",)] and not vs[0].replaced
    assert vs[1].added == [("opt", 0)] and vs[1].replaced == [("params", "w")]
    assert vs[2].deleted == [("params", "b")]
    assert all(v.created.tzinfo is not None for v in vs)
    latest = partial.load(url)
    assert set(latest) == {"params", "step", "opt"} and set(latest["params"]) == {"w"}
    assert np.array_equal(latest["params"]["w"], np.full(3, 2.0))
    v1 = partial.load(url, version=1)
    assert np.array_equal(v1["params"]["b"], np.zeros(2))
    # Not a checkpoint until finalized, and the error says so.
    with pytest.raises(quire.CheckpointNotFoundError, match="finalize"):
        quire.load(url)
    partial.finalize(url)
    out = quire.load(url)
    assert np.array_equal(out["params"]["w"], np.full(3, 2.0)) and out["step"] == 1
    assert quire.metadata(url).custom == {"a": 1, "x": 9}
    with pytest.raises(quire.CheckpointExistsError):
        partial.save(url, {"z": 1})
    with pytest.raises(quire.CheckpointExistsError):
        partial.finalize(url)


def test_errors(url: str) -> None:
    with pytest.raises(quire.CheckpointNotFoundError):
        partial.finalize(url)
    with pytest.raises(quire.CheckpointNotFoundError):
        partial.discard(url)
    partial.save(url, {"a": np.ones(1)})
    with pytest.raises(quire.TreeMismatchError, match="nope"):
        partial.delete(url, [("nope",)])
    with pytest.raises(TypeError):
        partial.delete(url, ["a"])  # type: ignore[list-item]
    with pytest.raises(quire.CheckpointNotFoundError, match="version 5"):
        partial.load(url, version=5)
    partial.discard(url)
    with pytest.raises(quire.CheckpointNotFoundError):
        partial.load(url)


def test_finalized_checkpoint_is_ordinary(tmp_path: Path) -> None:
    from quire._cli.main import main

    url = str(tmp_path / "c")
    for i in range(3):
        partial.save(url, {f"layer{i}": {"w": np.full((4, 4), i, np.float32)}})
    partial.save(url, {"layer0": {"w": np.full((4, 4), 7, np.float32)}})
    partial.finalize(url)
    assert main(["verify", url]) == 0
    assert main(["info", url]) == 0
    assert not (tmp_path / "c" / "journal").exists()
    # Only live data remains: three arrays, one chunk each (+ zarr.json).
    files = [p for p in (tmp_path / "c" / "d").rglob("*") if p.is_file()]
    assert len(files) == 6, files
    m = quire.metadata(url)
    assert {k: v.shape for k, v in ((k, m.tree[k]["w"]) for k in m.tree)} == {
        f"layer{i}": (4, 4) for i in range(3)
    }


def test_async_saves_apply_in_call_order(url: str) -> None:
    rs = [partial.save_async(url, {"v": np.full(8, i)}, metadata={"i": i}) for i in range(6)]
    assert [r.result(timeout=60) for r in rs] == list(range(1, 7))
    assert np.array_equal(partial.load(url)["v"], np.full(8, 5))


def test_writes_only_new_data(tmp_path: Path) -> None:
    url = str(tmp_path / "c")
    partial.save(url, {"big": np.ones(1 << 18, np.float32)})
    before = sum(p.stat().st_size for p in (tmp_path / "c").rglob("*") if p.is_file())
    partial.save(url, {"small": np.ones(4, np.float32)})
    after = sum(p.stat().st_size for p in (tmp_path / "c").rglob("*") if p.is_file())
    assert after - before < 4096  # the new leaf and a small record, not a copy of "big"


def test_conflicting_concurrent_writer_fails_clearly(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writer whose base is stale and who touches the same key loses with a clear error;
    one touching other keys lands on top."""
    from quire._engine import journal as _journal

    partial.save(url, {"w": np.zeros(2), "other": np.zeros(1)})
    gate = threading.Event()
    go = threading.Event()
    calls = {"n": 0}

    # Drive two writers deterministically: A reads base 1, then B commits 2, then A retries.
    real_write_units = _journal._saving.write_units

    async def write_units_hook(*a: Any, **k: Any) -> Any:
        r = await real_write_units(*a, **k)
        calls["n"] += 1
        if calls["n"] == 1:  # writer A: after reading base, wait for B
            gate.set()
            import asyncio

            while not go.is_set():
                await asyncio.sleep(0.01)
        return r

    monkeypatch.setattr(_journal._saving, "write_units", write_units_hook)
    errors: list[BaseException] = []

    def writer_a() -> None:
        try:
            partial.save(url, {"w": np.ones(2)})
        except BaseException as e:
            errors.append(e)

    ta = threading.Thread(target=writer_a)
    ta.start()
    assert gate.wait(30)
    # Writer B goes through the engine directly (quire.partial.save would queue it behind A).
    from quire._engine import save as _saving
    from quire._runtime import ioloop as _io

    prep = _saving.prepare_save({"pytree": {"w": np.full(2, 5.0)}}, None, copy=False, url=url)
    assert _io.submit(_journal.append(url, prep=prep)).result() == 2
    go.set()
    ta.join(60)
    assert len(errors) == 1 and isinstance(errors[0], partial.JournalConflictError)
    assert (
        isinstance(errors[0], quire.CheckpointExistsError) and "'w'" in str(errors[0])
    ) or "w" in str(errors[0])
    assert np.array_equal(partial.load(url)["w"], np.full(2, 5.0))
    assert [v.version for v in partial.versions(url)] == [1, 2]


def test_non_conflicting_concurrent_writer_lands_on_top(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from quire._engine import journal as _journal
    from quire._engine import save as _saving
    from quire._runtime import ioloop as _io

    partial.save(url, {"a": np.zeros(1)})
    real = _journal._saving.write_units
    state = {"n": 0}

    async def hook(*a: Any, **k: Any) -> Any:
        r = await real(*a, **k)
        state["n"] += 1
        if state["n"] == 1:
            prep = _saving.prepare_save({"pytree": {"b": np.ones(1)}}, None, copy=False, url=url)
            await _journal.append(url, prep=prep)  # sneaks in as version 2
        return r

    monkeypatch.setattr(_journal._saving, "write_units", hook)
    assert partial.save(url, {"c": np.full(1, 2.0)}) == 3
    out = partial.load(url)
    assert sorted(out) == ["a", "b", "c"]
    assert partial.versions(url)[2].added == [("c",)]
    _ = _io


# ----------------------------------------------------------------------------- model-based
KEYS = ["a", "b", "c", "d"]


class JournalMachine(RuleBasedStateMachine):
    """Random save / delete / finalize / discard against a dict model."""

    backend_kind = "memory"

    def make_url(self) -> str:
        if self.backend_kind == "memory":
            return f"memory://journal-model/{uuid.uuid4().hex}"
        return os.path.join(self.tmp_base, uuid.uuid4().hex, "c")

    @initialize()
    def setup(self) -> None:
        self.url = self.make_url()
        self.model: dict[str, dict[str, float]] = {}
        self.history: list[dict[str, dict[str, float]]] = []
        self.finalized = False
        self.meta: dict[str, int] = {}
        self.debris = False

    @precondition(lambda self: not self.finalized)
    @rule(
        group=st.sampled_from(["g1", "g2"]),
        keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=4, unique=True),
        value=st.integers(0, 100),
    )
    def save(self, group: str, keys: list[str], value: int) -> None:
        tree = {group: {k: np.full(2, float(value), np.float32) for k in keys}}
        partial.save(self.url, tree, metadata={group: value})
        self.model.setdefault(group, {}).update({k: float(value) for k in keys})
        self.meta[group] = value
        self.history.append({g: dict(v) for g, v in self.model.items()})

    @precondition(lambda self: not self.finalized)
    @rule(group=st.sampled_from(["g1", "g2"]), keep=st.sampled_from(KEYS), value=st.integers(0, 99))
    def save_wide_then_most(self, group: str, keep: str, value: int) -> None:
        # A version of every key, then one replacing all but ``keep``: the first is left a
        # quarter live, and a finalize rewrites its pack (unless ``keep`` changes later).
        for v, keys in ((value, KEYS), (value + 1, [k for k in KEYS if k != keep])):
            partial.save(self.url, {group: {k: np.full(2, float(v), np.float32) for k in keys}})
            self.model.setdefault(group, {}).update({k: float(v) for k in keys})
            self.history.append({g: dict(d) for g, d in self.model.items()})

    @precondition(lambda self: not self.finalized and any(self.model.values()))
    @rule(data=st.data())
    def delete(self, data: st.DataObject) -> None:
        g = data.draw(st.sampled_from(sorted(g for g in self.model if self.model[g])))
        k = data.draw(st.sampled_from(sorted(self.model[g])))
        partial.delete(self.url, [(g, k)])
        del self.model[g][k]
        self.history.append({g: dict(v) for g, v in self.model.items()})

    @precondition(lambda self: not self.finalized and self.history)
    @rule()
    def finalize(self) -> None:
        partial.finalize(self.url)
        self.finalized = True
        if self.debris:  # what killed finalizes left: unreferenced now, so gc removes it
            collect_garbage(self.url)
            self.debris = False
        assert_tidy(self.url)  # mostly dead packs were rewritten; nothing else is left

    @precondition(lambda self: not self.finalized and self.history)
    @rule()
    def finalize_killed_before_its_commit(self) -> None:
        """A finalize that did all its work (rewritten packs included) and died right
        before the commit point: the journal is as it was (the invariant checks it)."""
        real = _commit.publish

        async def killed(*a: Any, **k: Any) -> None:
            raise _Killed

        _commit.publish = killed  # type: ignore[assignment]
        try:
            with pytest.raises(_Killed):
                partial.finalize(self.url)
        finally:
            _commit.publish = real  # type: ignore[assignment]
        self.debris = True

    @precondition(lambda self: not self.finalized and self.history)
    @rule()
    def discard(self) -> None:
        partial.discard(self.url)
        self.model, self.history, self.meta = {}, [], {}

    @precondition(lambda self: self.finalized)
    @rule()
    def start_another(self) -> None:
        self.check(quire.load(self.url), self.model)
        self.setup()

    @precondition(lambda self: len(self.history) > 1 and not self.finalized)
    @rule(data=st.data())
    def load_old_version(self, data: st.DataObject) -> None:
        v = data.draw(st.integers(1, len(self.history)))
        self.check(partial.load(self.url, version=v), self.history[v - 1])

    def check(self, got: dict[str, Any], want: dict[str, dict[str, float]]) -> None:
        got_plain = {g: {k: float(arr[0]) for k, arr in d.items()} for g, d in got.items()}
        assert got_plain == want

    @invariant()
    def matches_model(self) -> None:
        if not hasattr(self, "url"):
            return
        if self.finalized:
            self.check(quire.load(self.url), self.model)
            assert quire.metadata(self.url).custom == self.meta
            with pytest.raises(quire.CheckpointExistsError):
                partial.save(self.url, {"x": 1})
        elif self.history:
            self.check(partial.load(self.url), self.model)
            assert len(partial.versions(self.url)) == len(self.history)
        else:
            with pytest.raises(quire.CheckpointNotFoundError):
                partial.load(self.url)


class LocalJournalMachine(JournalMachine):
    backend_kind = "local"
    tmp_base = ""


@pytest.fixture(autouse=True, scope="module")
def _journal_tmp_base(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The local model's checkpoints go under pytest's temporary directory."""
    LocalJournalMachine.tmp_base = str(tmp_path_factory.mktemp("journal-model"))


_settings = settings(
    max_examples=15,
    stateful_step_count=10,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestJournalModelMemory = JournalMachine.TestCase
TestJournalModelMemory.settings = _settings
TestJournalModelLocal = LocalJournalMachine.TestCase
TestJournalModelLocal.settings = _settings


# ----------------------------------------------------------------------------- processes
CHILD = textwrap.dedent(
    """
    import os, signal, sys, json
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import numpy as np
    import quire
    from quire._store import local as L
    url, op, kill_at = sys.argv[1], sys.argv[2], int(sys.argv[3])
    count = [0]
    def wrap(name):
        orig = getattr(L.LocalBackend, name)
        def f(self, *a, **k):
            count[0] += 1
            if count[0] == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return orig(self, *a, **k)
        setattr(L.LocalBackend, name, f)
    for n in ("_put", "_put_if_absent", "_replace_if_match", "_delete"):
        wrap(n)
    orig_fsync_dir = L._fsync_dir
    def fsync_dir(path):
        count[0] += 1
        if count[0] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return orig_fsync_dir(path)
    L._fsync_dir = fsync_dir
    if op == "save":
        quire.partial.save(url, {"p": {"w": np.full(1000, 2.0), "new": np.arange(10)}}, metadata={"v": 3})
    else:
        quire.partial.finalize(url)
    print("CALLS", count[0])
    """
)


def _run_child(url: str, op: str, kill_at: int) -> subprocess.CompletedProcess[str]:
    return forkserver.run(["-c", CHILD, url, op, str(kill_at)], timeout=120)


def _base(url: str) -> None:
    partial.save(url, {"p": {"w": np.full(1000, 1.0), "b": np.zeros(3)}}, metadata={"v": 1})
    partial.save(url, {"q": np.ones(2)}, metadata={"v": 2})


def test_kill_during_partial_save_and_finalize(tmp_path: Path) -> None:
    probe, probe2 = str(tmp_path / "probe"), str(tmp_path / "probe2")
    _base(probe)
    _base(probe2)
    total_save = int(_run_child(probe, "save", 0).stdout.split("CALLS")[1])
    total_fin = int(_run_child(probe2, "finalize", 0).stdout.split("CALLS")[1])
    assert total_save >= 4 and total_fin >= 2
    for k in range(1, total_save + 1):
        url = str(tmp_path / f"s{k}")
        _base(url)
        r = _run_child(url, "save", k)
        assert r.returncode == -9, r.stderr
        got = partial.load(url)
        n = len(partial.versions(url))
        if n == 2:  # the interrupted version never appeared: version 2 is whole
            assert np.array_equal(got["p"]["w"], np.full(1000, 1.0)) and "new" not in got["p"]
        else:
            assert n == 3 and np.array_equal(got["p"]["w"], np.full(1000, 2.0))
    for k in range(1, total_fin + 1):
        url = str(tmp_path / f"f{k}")
        _base(url)
        r = _run_child(url, "finalize", k)
        assert r.returncode == -9, r.stderr
        if os.path.exists(os.path.join(url, "quire.json")):
            got = quire.load(url)
        else:  # the journal is still there and finalize can run again
            got = partial.load(url)
            partial.finalize(url)
            assert quire.load(url).keys() == got.keys()
        assert np.array_equal(got["p"]["w"], np.full(1000, 1.0)) and np.array_equal(
            got["q"], np.ones(2)
        )


WRITER = textwrap.dedent(
    """
    import os, sys
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import numpy as np
    import quire
    url, who, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    ok = conflicts = 0
    for i in range(n):
        try:
            quire.partial.save(url, {who: {f"k{i}": np.full(4, i)}, "shared": np.full(1, i)})
            ok += 1
        except quire.partial.JournalConflictError:
            conflicts += 1
    print("RESULT", ok, conflicts)
    """
)


def test_two_processes_appending_never_lose_a_version(tmp_path: Path) -> None:
    url = str(tmp_path / "c")
    partial.save(url, {"init": np.zeros(1)})
    n = 12
    procs = [
        forkserver.popen(
            ["-c", WRITER, url, who, str(n)],
            stdout=forkserver.PIPE,
            stderr=forkserver.PIPE,
            text=True,
        )
        for who in ("A", "B")
    ]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, err
        ok, conflicts = map(int, out.split("RESULT")[1].split())
        assert ok + conflicts == n
        results.append(ok)
    vs = partial.versions(url)
    assert [v.version for v in vs] == list(range(1, 2 + sum(results)))  # no gaps, nothing lost
    final = partial.load(url)
    # Every successful save is visible: its private keys are all there.
    for who, ok in zip("AB", results):
        assert len(final.get(who, {})) == ok
    # Conflicts only ever arise on the shared key, never silently.
    for v in vs[1:]:
        assert ("shared",) in v.added + v.replaced
    json.dumps([v.version for v in vs])


REPLACER = textwrap.dedent(
    """
    import os, sys
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import numpy as np
    from quire import partial
    url = sys.argv[1]
    partial.discard(url)
    partial.save(url, {"x": np.full(4, 7.0, np.float32)})
    partial.save(url, {"y": np.full(4, 8.0, np.float32)})
    print("RESULT", [v.version for v in partial.versions(url)])
    """
)


def test_a_journal_another_process_replaced_is_read_again(tmp_path: Path) -> None:
    # hunt3 finding 3: this process kept the discarded journal's records: versions() showed
    # them, load called the new (healthy) journal damaged and finalize was refused.
    url = str(tmp_path / "c")
    partial.save(url, {"k0": np.zeros(4, np.float32)})
    partial.save(url, {"k1": np.ones(4, np.float32)})
    assert sorted(partial.load(url)) == ["k0", "k1"]
    p = forkserver.popen(
        ["-c", REPLACER, url], stdout=forkserver.PIPE, stderr=forkserver.PIPE, text=True
    )
    out, err = p.communicate(timeout=180)
    assert p.returncode == 0, err
    assert "RESULT [1, 2]" in out
    assert [v.added for v in partial.versions(url)] == [[("x",)], [("y",)]]
    got = partial.load(url)
    assert sorted(got) == ["x", "y"] and got["x"][0] == 7 and got["y"][0] == 8
    partial.save(url, {"z": np.full(4, 9.0, np.float32)})
    assert [v.version for v in partial.versions(url)] == [1, 2, 3]
    partial.finalize(url)
    assert {k: float(v[0]) for k, v in quire.load(url).items()} == {"x": 7, "y": 8, "z": 9}


def test_partial_load_after_finalize_killed_before_journal_removal_sees_committed_state(
    tmp_path: Path,
) -> None:
    # issue 13: finalize deletes journal records highest first; killed after committing
    # quire.json and deleting version 2, the journal holds only version 1, which still
    # has the deleted leaf. Once quire.json exists the journal is dead.
    url = str(tmp_path / "ckpt")
    partial.save(url, {"a": np.ones(2), "b": 5})
    partial.delete(url, [("b",)])
    stale = Path(url, "journal", "0000000001.json").read_bytes()
    partial.finalize(url)
    Path(url, "journal").mkdir(exist_ok=True)
    Path(url, "journal", "0000000001.json").write_bytes(stale)  # the crash state
    got = partial.load(url)
    assert set(got) == {"a"} and np.array_equal(got["a"], np.ones(2))
    assert set(partial.load(url, version=2)) == {"a"}
    with pytest.raises(quire.errors.CheckpointNotFoundError, match="finalized"):
        partial.load(url, version=1)


@pytest.mark.parametrize("layout", ["packed", "chunks"])
def test_finalize_cleanup_lists_a_packed_txid_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str
) -> None:
    """Leaves replaced inside a txid that stays live (its pack is more than half live, so
    finalize keeps it): v1 deletes each dead location's
    prefix; v2 (whose chunks are in packs) lists the txid once instead of once per leaf."""
    from quire._engine import journal as _journal

    calls: list[tuple[str, str]] = []

    def counting(url: str, options: Any = None) -> Any:
        b = open_backend(url, options)
        for name in ("list", "delete_prefix"):
            real = getattr(b, name)

            async def hook(prefix: str = "", _real: Any = real, _name: str = name) -> Any:
                calls.append((_name, prefix))
                return await _real(prefix)

            setattr(b, name, hook)
        return b

    url = str(tmp_path / "c")
    with quire.Context(layout=layout):
        partial.save(url, {f"l{i}": np.full(64, i, np.float32) for i in range(6)})
        partial.save(url, {f"l{i}": np.full(64, 10 + i, np.float32) for i in range(2)})
        monkeypatch.setattr(_journal, "open_backend", counting)
        partial.finalize(url)
    got = quire.load(url)
    assert {k: int(v[0]) for k, v in got.items()} == {
        f"l{i}": 10 + i if i < 2 else i for i in range(6)
    }
    dropped = [p for n, p in calls if n == "delete_prefix" and p.count("/") > 1]
    listed = [p for n, p in calls if n == "list" and p.startswith("d/")]
    if layout == "packed":
        assert dropped == [] and len(listed) == 1, calls
    else:
        assert len(dropped) == 2, calls
    assert main_verify(url) == 0


def main_verify(url: str) -> int:
    from quire._cli.main import main

    return main(["verify", url])


def test_a_plain_save_does_not_replace_an_unfinalized_partial_save(url: str) -> None:
    """Without ``overwrite=True`` a save (or a Checkpointer's save of that step) refuses a
    URL that holds a journal: committing over it lost the partial save (its versions read
    as the new checkpoint, and ``quire gc`` then deleted the journal)."""
    partial.save(url, {"a": np.arange(10)})
    partial.save(url, {"b": np.ones(3)})
    with pytest.raises(quire.errors.CheckpointExistsError, match="unfinalized partial save"):
        quire.save(url, {"z": np.zeros(2)})
    assert [v.version for v in partial.versions(url)] == [1, 2]
    assert sorted(partial.load(url)) == ["a", "b"]
    quire.save(url, {"z": np.zeros(2)}, overwrite=True)  # asked for: replaced
    assert sorted(quire.load(url)) == ["z"]
