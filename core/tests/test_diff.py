"""Issue 14: ``quire.diff`` / ``quire diff A B`` between any two checkpoints or sources.

Every pairing kind: quire v2 vs quire v1, quire vs the safetensors file it was converted
from, an HF sharded directory vs a single file, safetensors vs safetensors (Orbax pairings
are in plugins/orbax/tests).  Values are read block by block: a recording source proves no
read is larger than the block and nothing is read twice.
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path
from typing import Any, ClassVar

import jax
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import save_file

import quire
from quire._cli.main import main as cli
from quire._sources.diff import blocks
from quire.sources import LazyArray, Region, Source


def _weights(scale: float = 1.0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "layers.0.w": (rng.standard_normal((16, 8)) * scale).astype(np.float32),
        "layers.1.w": (rng.standard_normal((16, 8)) * scale).astype(np.float32),
        "embed": np.arange(40, dtype=np.int32).reshape(10, 4),
        "norm": np.ones(8, ml_dtypes.bfloat16),
    }


def _nested(flat: dict[str, np.ndarray]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, v in flat.items():
        d = out
        *head, last = name.split(".")
        for h in head:
            d = d.setdefault(h, {})
        d[last] = v
    return out


# ----------------------------------------------------------------------------- quire vs quire
def test_quire_v2_vs_v1_same_then_structure_shape_dtype_and_metadata(tmp_path: Path) -> None:
    tree = {"w": np.arange(12.0).reshape(3, 4), "b": np.zeros(3, np.int8), "step": 5,
            "key": jax.random.key(1), "name": "run", "opt": [np.ones(2), None]}  # fmt: skip
    quire.save(tmp_path / "v2", tree, metadata={"loss": 1.0})
    quire.save(tmp_path / "v1", tree, metadata={"loss": 1.0}, layout="chunks")
    r = quire.diff(tmp_path / "v2", tmp_path / "v1", values=True)
    assert r.same, r.lines()
    assert r.formats == ("quire", "quire") and r.values_compared == r.leaves == 7
    assert r.bytes_compared == 96 + 3 + 16 + 8  # w, b, opt/0, and the key's data

    other = dict(tree, w=np.arange(12.0, dtype=np.float32).reshape(3, 4), step=6,
                 key=jax.random.key(2), opt=(np.ones(2), None), extra=1)  # fmt: skip
    del other["b"]
    quire.save(tmp_path / "o", other, metadata={"loss": 0.5})
    r = quire.diff(tmp_path / "v2", tmp_path / "o", values=True)
    assert not r.same
    assert r.only_a == ["b"] and r.only_b == ["extra"]
    assert "w: float64[3, 4] vs float32[3, 4]" in r.changed
    assert "opt: list vs tuple" in r.changed
    assert "step: value 5 vs 6" in r.changed
    assert any(line.startswith("key: ") and "values differ" in line for line in r.changed)
    assert r.metadata == ["loss: 1.0 vs 0.5"]
    r = quire.diff(tmp_path / "v2", tmp_path / "o", metadata=False)
    assert r.metadata == [] and not any("value" in line for line in r.changed)


def test_values_exact_nan_and_tolerance(tmp_path: Path) -> None:
    x = np.linspace(0, 1, 1000, dtype=np.float32)
    x[3] = np.nan
    y = x.copy()
    y[500:510] += 1e-4  # differs only beyond atol=1e-6, within atol=1e-3
    quire.save(tmp_path / "a", {"x": x})
    quire.save(tmp_path / "b", {"x": y})
    quire.save(tmp_path / "c", {"x": x.copy()})
    assert quire.diff(tmp_path / "a", tmp_path / "c", values=True).same  # NaN == NaN here
    r = quire.diff(tmp_path / "a", tmp_path / "b", values=True, block_bytes=256)
    (line,) = r.changed
    assert line.startswith("x: 10 of 1000 values differ (max |a-b| 0.0001") and "at [500]" in line
    assert quire.diff(tmp_path / "a", tmp_path / "b", atol=1e-3).same
    r = quire.diff(tmp_path / "a", tmp_path / "b", atol=1e-6)
    assert r.changed[0].startswith("x: 10 of 1000 values differ beyond atol=1e-06 rtol=0.0")
    assert quire.diff(tmp_path / "a", tmp_path / "b", rtol=1e-3).same
    assert not quire.diff(tmp_path / "a", tmp_path / "b", rtol=1e-6).same


# ----------------------------------------------------------------------------- safetensors
def test_quire_vs_the_safetensors_it_was_converted_from(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    f = tmp_path / "model.safetensors"
    save_file(_weights(), str(f), metadata={"format": "pt"})
    ck = tmp_path / "ckpt"
    assert cli(["cp", str(f), str(ck), "-q"]) == 0
    assert cli(["diff", str(ck), str(f), "--values"]) == 0
    out = capsys.readouterr().out
    assert "(quire)" in out and "(safetensors)" in out
    assert "# metadata not compared (quire vs safetensors)" in out
    assert "same structure, shapes and dtypes (4 leaves, values of 4 leaves equal)" in out

    # the same weights, one tensor nudged by 1e-5: equal within 1e-4, different beyond 1e-6
    w = _weights()
    w["layers.1.w"][2, 3] += 1e-5
    g = tmp_path / "nudged.safetensors"
    save_file(w, str(g), metadata={"format": "np"})
    assert cli(["diff", str(ck), str(g)]) == 0  # structure only
    capsys.readouterr()
    assert cli(["diff", str(ck), str(g), "--atol", "1e-4"]) == 0
    capsys.readouterr()
    assert cli(["diff", str(ck), str(g), "--atol", "1e-6"]) == 1
    out = capsys.readouterr().out
    assert "~ layers/1/w: 1 of 128 values differ beyond atol=1e-06" in out and "[2, 3]" in out
    # same format: metadata compared by default; --no-metadata turns it off
    assert cli(["diff", str(f), str(g)]) == 1
    assert "~ metadata format: 'pt' vs 'np'" in capsys.readouterr().out
    assert cli(["diff", str(f), str(g), "--no-metadata"]) == 0
    capsys.readouterr()
    assert cli(["diff", str(ck), str(f), "--metadata"]) == 1
    assert "~ metadata format: '<absent>' vs 'pt'" in capsys.readouterr().out


def test_hf_sharded_directory_vs_single_file_and_dtype_change(tmp_path: Path) -> None:
    w = _weights()
    d = tmp_path / "hf"
    d.mkdir()
    names = {"model-00001-of-00002.safetensors": ["layers.0.w", "embed"],
             "model-00002-of-00002.safetensors": ["layers.1.w", "norm"]}  # fmt: skip
    for fname, keys in names.items():
        save_file({k: w[k] for k in keys}, str(d / fname))
    index = {"metadata": {}, "weight_map": {k: f for f, ks in names.items() for k in ks}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    f = tmp_path / "one.safetensors"
    save_file(w, str(f))
    r = quire.diff(d, f, values=True)
    assert r.same and r.values_compared == 4, r.lines()

    w2 = dict(w, norm=np.ones(8, np.float16))
    save_file(w2, str(tmp_path / "two.safetensors"))
    r = quire.diff(d, tmp_path / "two.safetensors", values=True)
    assert r.changed == ["norm: bfloat16[8] vs float16[8]"] and r.values_compared == 3


def test_a_quire_tree_vs_safetensors_names_key_paths_alike(tmp_path: Path) -> None:
    quire.save(tmp_path / "q", _nested(_weights()))
    save_file(_weights(2.0), str(tmp_path / "s.safetensors"))
    r = quire.diff(tmp_path / "q", tmp_path / "s.safetensors", values=True)
    assert sorted(line.split(":")[0] for line in r.changed) == ["layers/0/w", "layers/1/w"]
    assert r.values_compared == 4 and not (r.only_a or r.only_b)


# ----------------------------------------------------------------------------- bounded reads
class _Recorder:
    def __init__(self, data: np.ndarray, log: list[Region]) -> None:
        self.data, self.log = data, log

    async def read_region(self, region: Region) -> np.ndarray:
        self.log.append(region)
        return np.ascontiguousarray(self.data[region])


class _MemSource(Source):
    format: ClassVar[str] = "memory-test"

    def __init__(self, arrays: dict[str, np.ndarray]) -> None:
        self.url = "mem://test"
        self.metadata = {}
        self.log: list[Region] = []
        self.tree = {k: LazyArray(v.shape, v.dtype, (k,), _Recorder(v, self.log), self.url)
                     for k, v in arrays.items()}  # fmt: skip

    @classmethod
    def detect(cls, url: str, storage_options: dict[str, Any]) -> bool:
        return False

    @classmethod
    def open(cls, url: str, storage_options: dict[str, Any]) -> Source:
        raise NotImplementedError


def test_values_are_read_in_bounded_blocks_each_once() -> None:
    x = np.random.default_rng(1).standard_normal((64, 33, 5)).astype(np.float32)
    a, b = _MemSource({"x": x}), _MemSource({"x": x.copy()})
    r = quire.diff(a, b, values=True, block_bytes=4096)
    assert r.same and r.bytes_compared == x.nbytes
    for src in (a, b):
        seen = np.zeros(x.shape, np.int32)
        for region in src.log:
            assert math.prod(s.stop - s.start for s in region) * 4 <= 4096
            seen[region] += 1
        assert (seen == 1).all()  # everything read, nothing twice


def test_quire_values_are_read_chunk_aligned(tmp_path: Path) -> None:
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("d",))
    sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
    x = jax.device_put(np.arange(64 * 16, dtype=np.float32).reshape(64, 16), sh)
    quire.save(tmp_path / "a", {"x": x})
    quire.save(tmp_path / "b", {"x": x})
    sa, sb = quire.open(tmp_path / "a"), quire.open(tmp_path / "b")
    r = quire.diff(sa, sb, values=True, block_bytes=16 * 16 * 4)  # one stored chunk
    assert r.same
    assert sa.bytes_read == sb.bytes_read == x.nbytes  # no chunk read twice
    events: list[quire.progress.ProgressEvent] = []
    quire.diff(tmp_path / "a", tmp_path / "b", values=True, progress=events.append)
    assert events[-1].finished and events[-1].bytes_done == x.nbytes


@settings(max_examples=60, deadline=None)
@given(
    shape=st.lists(st.integers(0, 7), min_size=0, max_size=3),
    unit=st.lists(st.integers(1, 4), min_size=3, max_size=3),
    limit=st.integers(1, 200),
)
def test_blocks_cover_every_element_once(shape: list[int], unit: list[int], limit: int) -> None:
    seen = np.zeros(shape, np.int32)
    u = unit[: len(shape)]
    for region in blocks(shape, 4, limit, u):
        n = math.prod(s.stop - s.start for s in region)
        assert n >= 1
        fits = math.prod(min(c, s) for c, s in zip(u, shape)) * 4 <= limit
        if fits:
            assert n * 4 <= limit or n <= math.prod(min(c, s) for c, s in zip(u, shape))
            # starts are whole multiples of the unit: no stored chunk split across blocks
            assert all(s.start % c == 0 for s, c in zip(region, u))
        elif limit >= 4:
            assert n * 4 <= limit
        seen[region] += 1
    assert (seen == 1).all()


# ----------------------------------------------------------------------------- CLI
def test_cli_exit_codes_and_side_options(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    quire.save(tmp_path / "a", {"x": np.ones(3)})
    assert cli(["diff", str(tmp_path / "a"), str(tmp_path / "missing")]) == 2
    assert "no installed quire source recognises it" in capsys.readouterr().err
    assert cli(["diff", str(tmp_path / "a"), str(tmp_path / "a"), "--b-options", "[1]"]) == 2
    assert "--b-options takes a JSON object" in capsys.readouterr().err
    args = ["diff", str(tmp_path / "a"), str(tmp_path / "a"), "--a-options", "{}", "--values"]
    assert cli(args) == 0
    assert "values of 1 leaves equal" in capsys.readouterr().out


def test_bool_int_and_0d_leaves(tmp_path: Path) -> None:
    t = {"m": np.array([True, False]), "i": np.arange(5, dtype=np.int64), "s": np.float32(2.0)}
    quire.save(tmp_path / "a", t)
    u = dict(t, m=np.array([True, True]), i=np.arange(5, dtype=np.int64) + (1 << 40))
    quire.save(tmp_path / "b", u)
    r = quire.diff(tmp_path / "a", tmp_path / "b", values=True)
    lines = {line.split(":")[0]: line for line in r.changed}
    assert set(lines) == {"m", "i"} and "1 of 2 values differ" in lines["m"]
    assert "5 of 5 values differ (max |a-b| 1.09951e+12" in lines["i"]
    assert not list(itertools.chain(r.only_a, r.only_b, r.metadata))


def test_a_key_holding_a_slash_is_its_own_leaf(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # hunt 2 finding 2: "/"-joined names made {"a/b": x} and {"a": {"b": y}} one leaf
    one, two = np.array([1.0], np.float32), np.array([2.0], np.float32)
    quire.save(tmp_path / "a", {"a/b": one, "a": {"b": two}})
    quire.save(tmp_path / "b", {"a/b": one + 554, "a": {"b": two}})
    r = quire.diff(tmp_path / "a", tmp_path / "b", values=True)
    assert r.leaves == r.values_compared == 2
    (line,) = r.changed
    assert line.startswith("'a/b': 1 of 1 values differ (max |a-b| 554")
    assert cli(["diff", "--values", str(tmp_path / "a"), str(tmp_path / "b")]) == 1
    assert "~ 'a/b': 1 of 1 values differ" in capsys.readouterr().out

    quire.save(tmp_path / "c", {"a/b": one, "a": {"b": two + 1}})
    r = quire.diff(tmp_path / "a", tmp_path / "c", values=True)
    assert [s.split(":")[0] for s in r.changed] == ["a/b"]  # the nested leaf, plainly named

    quire.save(tmp_path / "flat", {"a/b": one})
    quire.save(tmp_path / "nested", {"a": {"b": one}})
    r = quire.diff(tmp_path / "flat", tmp_path / "nested", values=True)
    assert r.only_a == ["'a/b'"] and r.only_b == ["a/b"] and not r.same


def test_ints_compare_without_float_rounding_and_max_diff_is_exact(tmp_path: Path) -> None:
    # hunt 2 finding 3: int64/uint64 went through float64, so 2**62+1 vs 2**62+2 was "equal"
    a = {"i": np.array([2**62 + 1, -(2**63), 7], np.int64), "u": np.array([2**63 + 1], np.uint64),
         "m": np.array([True, True]), "f": np.array([np.inf, 1.0], np.float32)}  # fmt: skip
    b = {"i": np.array([2**62 + 2, 2**63 - 1, 9], np.int64), "u": np.array([2**63 + 2], np.uint64),
         "m": np.array([True, False]), "f": np.array([-np.inf, 1.0], np.float32)}  # fmt: skip
    quire.save(tmp_path / "a", a)
    quire.save(tmp_path / "b", b)
    for kw in ({"values": True}, {"atol": 0}, {"atol": 0.5}, {"rtol": 1e-30}):
        r = quire.diff(tmp_path / "a", tmp_path / "b", **kw)  # type: ignore[arg-type]
        lines = {line.split(":")[0]: line for line in r.changed}
        assert set(lines) == {"i", "u", "m", "f"}, (kw, r.lines())
        assert "3 of 3 values differ" in lines["i"] and "(max |a-b| 1.84467e+19," in lines["i"]
        assert "(max |a-b| 1, first at [0])" in lines["u"]
        assert "1 of 2 values differ" in lines["m"] and "(max |a-b| 1, first at [1])" in lines["m"]
        assert "(max |a-b| inf, first at [0])" in lines["f"]
    # a tolerance still applies to ints, in exact arithmetic: |a-b| <= atol + rtol*|b|
    r = quire.diff(tmp_path / "a", tmp_path / "b", atol=2)
    line = next(s for s in r.changed if s.startswith("i:"))
    assert "1 of 3 values differ beyond atol=2" in line and "first at [1]" in line  # 7 vs 9 within
    assert not any(s.startswith("u:") for s in r.changed)
    assert any(s.startswith("m:") for s in r.changed)  # bools compare exactly
