"""Sources (quire.open), safetensors read through quire, laziness by byte counting, bad input."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import quire
from quire import surgery
from quire._sources.lazy import as_lazy
from quire._store.local import LocalBackend
from quire.testing import SourceSuite

pytestmark = pytest.mark.quick  # the quick tier (CONTRIBUTING.md)

P = jax.sharding.PartitionSpec


def _tensors(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "model.embed_tokens.weight": rng.standard_normal((16, 8)).astype(np.float32),
        "model.layers.0.mlp.w": rng.standard_normal((8, 12)).astype(np.float16),
        "model.layers.1.mlp.w": rng.standard_normal((8, 12)).astype(np.float16),
        "model.norm.weight": rng.standard_normal((8,)).astype(ml_dtypes.bfloat16),
        "step": np.array(7, np.int64),
        "mask": rng.integers(0, 2, (3, 5)).astype(bool),
    }


def _get(tree: Any, dotted: str) -> Any:
    for k in dotted.split("."):
        tree = tree[k]
    return tree


def _hf_dir(root: Path, tensors: dict[str, np.ndarray], n_shards: int) -> Path:
    """An HF-layout directory: shards written by safetensors itself, plus the index."""
    root.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    weight_map = {}
    for i in range(n_shards):
        part = {k: tensors[k] for k in names[i::n_shards]}
        fname = f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors"
        save_file(part, str(root / fname), metadata={"format": "np"})
        weight_map.update(dict.fromkeys(part, fname))
    total = sum(t.nbytes for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    return root


def test_single_file_loads_equal_to_safetensors(tmp_path: Path) -> None:
    t = _tensors()
    f = tmp_path / "m.safetensors"
    save_file(t, str(f), metadata={"format": "pt", "note": "x"})
    ref = load_file(str(f))
    src = quire.open(f)
    assert src.format == "safetensors"
    assert src.metadata["__metadata__"] == {"format": "pt", "note": "x"}
    # Dotted names nest; numeric components stay string keys.
    assert set(src.tree["model"]["layers"]) == {"0", "1"}
    got = quire.load(f)
    for name, want in ref.items():
        arr = _get(got, name)
        assert arr.dtype == want.dtype and arr.shape == want.shape, name
        np.testing.assert_array_equal(arr, want)


def test_torch_written_bf16_and_float8(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file as tload
    from safetensors.torch import save_file as tsave

    g = torch.Generator().manual_seed(0)
    t = {
        "w.bf16": torch.randn(4, 6, generator=g).to(torch.bfloat16),
        "w.f8": torch.randn(3, 5, generator=g).to(torch.float8_e4m3fn),
        "w.f8b": torch.randn(2, 2, generator=g).to(torch.float8_e5m2),
        "w.i32": torch.arange(6, dtype=torch.int32).reshape(2, 3),
    }
    f = tmp_path / "t.safetensors"
    tsave(t, str(f))
    ref = tload(str(f))
    src = quire.open(f)
    assert src.tree["w"]["bf16"].dtype == np.dtype(ml_dtypes.bfloat16)
    assert src.tree["w"]["f8"].dtype == np.dtype(ml_dtypes.float8_e4m3fn)
    for k, v in ref.items():
        a = _get(src.tree, k).read()
        np.testing.assert_array_equal(a.astype(np.float32), v.float().numpy())


def test_hf_sharded_dir_local_and_memory(tmp_path: Path) -> None:
    t = _tensors(1)
    d = _hf_dir(tmp_path / "hf", t, 3)
    ref: dict[str, np.ndarray] = {}
    for f in sorted(d.glob("*.safetensors")):
        ref.update(load_file(str(f)))
    got = quire.load(d)
    assert sorted(surgery.flatten(got)) == sorted(ref)
    for k, v in ref.items():
        np.testing.assert_array_equal(_get(got, k), v)
    # The same directory on memory:// (any fsspec URL, through quire's backend).
    import fsspec

    mem = fsspec.filesystem("memory")
    for f in d.iterdir():
        mem.pipe_file(f"/hfmem-{os.getpid()}/{f.name}", f.read_bytes())
    src = quire.open(f"memory://hfmem-{os.getpid()}")
    assert src.metadata["index"]["total_size"] == sum(v.nbytes for v in t.values())
    for k, v in ref.items():
        np.testing.assert_array_equal(_get(src.tree, k).read(), v)
    mem.rm(f"/hfmem-{os.getpid()}", recursive=True)


class _Counter:
    """Counts bytes the local backend reads, independently of the source's own counters."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.bytes = 0
        self.ranges: list[tuple[str, int, int]] = []
        get, get_into = LocalBackend._get, LocalBackend._get_into
        counter = self

        def _get(self: Any, key: str, start: Any, end: Any) -> bytes:
            out: bytes = get(self, key, start, end)
            counter.bytes += len(out)
            counter.ranges.append((key, start or 0, len(out)))
            return out

        def _get_into(self: Any, key: str, buffers: Any, offset: int) -> int:
            n: int = get_into(self, key, buffers, offset)
            counter.bytes += n
            counter.ranges.append((key, offset, n))
            return n

        monkeypatch.setattr(LocalBackend, "_get", _get)
        monkeypatch.setattr(LocalBackend, "_get_into", _get_into)


def test_laziness_two_of_fifty_leaves_and_a_slice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(2)
    t = {f"layer.{i}.w": rng.standard_normal((64, 32)).astype(np.float32) for i in range(50)}
    d = _hf_dir(tmp_path / "hf", t, 4)
    header_bytes = sum(
        8 + struct.unpack("<Q", f.read_bytes()[:8])[0] for f in d.glob("*.safetensors")
    )
    index_bytes = (d / "model.safetensors.index.json").stat().st_size
    counter = _Counter(monkeypatch)
    src = quire.open(d)
    assert counter.bytes == header_bytes + index_bytes  # open reads headers and index only
    out = quire.load(
        src, transform=lambda tr: {"a": tr["layer"]["3"]["w"], "b": tr["layer"]["41"]["w"]}
    )
    np.testing.assert_array_equal(out["a"], t["layer.3.w"])
    np.testing.assert_array_equal(out["b"], t["layer.41.w"])
    tensor_bytes = counter.bytes - header_bytes - index_bytes
    assert tensor_bytes == 2 * 64 * 32 * 4
    assert src.bytes_read == tensor_bytes
    # A slice of rows reads exactly those rows; a column slice only its runs.
    before = counter.bytes
    part = src.tree["layer"]["7"]["w"][10:14].read()
    np.testing.assert_array_equal(part, t["layer.7.w"][10:14])
    assert counter.bytes - before == 4 * 32 * 4
    before = counter.bytes
    col = src.tree["layer"]["7"]["w"][5:9, 3:5].read()
    np.testing.assert_array_equal(col, t["layer.7.w"][5:9, 3:5])
    assert counter.bytes - before == 4 * 2 * 4


def test_transform_stacks_layers_onto_8_devices_with_rules(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    n_layers = 4
    t: dict[str, np.ndarray] = {
        "model.embed.weight": rng.standard_normal((32, 16)).astype(np.float32)
    }
    for i in range(n_layers):
        t[f"model.layers.{i}.q.weight"] = rng.standard_normal((24, 16)).astype(np.float32)
    d = _hf_dir(tmp_path / "hf", t, 2)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
    rules = quire.surgery.partition_rules(
        [(r"embed", P("data", None)), (r"layers/.*kernel", P(None, None, "model")), (".*", P())],
        mesh,
    )

    def transform(tree: Any) -> Any:
        layers = tree["model"]["layers"]
        return {
            "embed": tree["model"]["embed"]["weight"],
            "layers": {
                "q": {
                    "kernel": surgery.stack(
                        [
                            surgery.torch_linear(layers[str(i)]["q"]["weight"])
                            for i in range(n_layers)
                        ]
                    )
                }
            },
        }

    out = quire.load(d, transform=transform, shardings=rules)
    k = out["layers"]["q"]["kernel"]
    assert isinstance(k, jax.Array) and k.shape == (n_layers, 16, 24)
    assert k.sharding.spec == P(None, None, "model")
    want = np.stack([t[f"model.layers.{i}.q.weight"].T for i in range(n_layers)])
    np.testing.assert_array_equal(np.asarray(k), want)
    assert out["embed"].sharding.spec == P("data", None)
    # Into an abstract tree with casts: strict, abstract dtype wins.
    abstract = {
        "embed": jax.ShapeDtypeStruct((32, 16), ml_dtypes.bfloat16),
        "layers": {"q": {"kernel": jax.ShapeDtypeStruct((n_layers, 16, 24), np.float32)}},
    }
    out2 = quire.load(d, abstract, transform=transform, shardings=rules)
    assert out2["embed"].dtype == ml_dtypes.bfloat16
    bad = {**abstract, "extra": jax.ShapeDtypeStruct((1,), np.float32)}
    with pytest.raises(quire.TreeMismatchError, match="extra"):
        quire.load(d, bad, transform=transform)


def test_partition_rule_errors() -> None:
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
    rules = quire.surgery.partition_rules([("w", P("data")), ("b", P(None, "model"))], mesh)
    assert rules.spec_for("x/w", (8, 3)) == P("data")
    assert rules.spec_for("anything", ()) == P()  # 0-d replicate
    with pytest.raises(quire.TreeMismatchError, match="no rule matches leaf 'x/c'"):
        rules.spec_for("x/c", (4,))
    with pytest.raises(quire.TreeMismatchError, match=r"x/w.*\(6, 3\).*does not divide"):
        rules.spec_for("x/w", (6, 3))
    with pytest.raises(quire.TreeMismatchError, match="more entries than axes"):
        rules.spec_for("b", (4,))


def _write(tmp_path: Path, name: str, data: bytes) -> Path:
    p = tmp_path / name
    p.write_bytes(data)
    return p


def _st(header: Any, data: bytes = b"", raw: bytes | None = None) -> bytes:
    h = raw if raw is not None else json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + data


@pytest.mark.parametrize(
    ("blob", "why"),
    [
        (_st(None, raw=b"{not json"), "not JSON"),
        (_st({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4), "outside"),
        (
            _st(
                {
                    "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                    "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
                },
                b"\0" * 12,
            ),
            "overlap",
        ),
        (
            _st(
                {"a": {"dtype": "F32", "shape": [2**40, 2**40], "data_offsets": [0, 8]}}, b"\0" * 8
            ),
            "bad shape|bytes for shape",
        ),
        (struct.pack("<Q", 200 * 2**20) + b"{}", "limit"),
        (struct.pack("<Q", 50) + b"{}", "object has"),
        (_st({"a": {"dtype": "X9", "shape": [1], "data_offsets": [0, 1]}}, b"\0"), "unknown dtype"),
        (b"abc", "too short"),
    ],
)
def test_bad_headers_are_corrupt_naming_the_url(tmp_path: Path, blob: bytes, why: str) -> None:
    f = _write(tmp_path, "bad.safetensors", blob)
    with pytest.raises(quire.CorruptCheckpointError, match=why) as ei:
        quire.open(f)
    assert str(f) in str(ei.value)


def test_index_naming_a_missing_shard(tmp_path: Path) -> None:
    d = _hf_dir(tmp_path / "hf", _tensors(), 2)
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(quire.CheckpointNotFoundError, match=r"model-00002-of-00002\.safetensors"):
        quire.open(d)


def test_unknown_format_lists_installed_and_the_pip_hint(tmp_path: Path) -> None:
    (tmp_path / "junk").mkdir()
    with pytest.raises(quire.CheckpointNotFoundError) as ei:
        quire.open(tmp_path / "junk")
    msg = str(ei.value)
    # quire-orbax may be installed too (it is in this workspace): it is listed like the others.
    assert ", ".join(quire.sources.available()) in msg
    # The install hint only when quire-orbax is not installed already.
    assert ("pip install quire-orbax" in msg) == ("orbax" not in quire.sources.available())


@pytest.fixture
def v1_layout() -> Any:
    """Counts reads per chunk object: format v1 (in v2 chunks are ranges of packs, whose
    own-process-only reads test_packed.py counts)."""
    with quire.Context(layout="chunks"):
        yield


def test_quire_source_and_merging_two_checkpoints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, v1_layout: None
) -> None:
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("x",))
    body = jax.device_put(
        np.arange(64, dtype=np.float32).reshape(16, 4), jax.sharding.NamedSharding(mesh, P("x"))
    )
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    quire.save(
        a, {"body": {"w": body, "b": np.ones(4, np.float32)}, "head": np.zeros((4, 2)), "step": 3}
    )
    quire.save(b, {"head": np.full((4, 2), 5.0), "step": 9})
    src = quire.open(a)
    assert src.format == "quire" and src.tree["step"] == 3
    counter = _Counter(monkeypatch)
    part = src.tree["body"]["w"][3:5].read()
    np.testing.assert_array_equal(part, np.asarray(body)[3:5])
    # Rows 3:5 lie in the saved chunks of rows 2:4 and 4:6: only those two objects are read.
    touched = sorted(k.split("/body/w/")[-1] for k, _, _ in counter.ranges)
    assert touched == ["c/1/0", "c/2/0"], counter.ranges
    assert counter.bytes == 2 * (2 * 4 * 4 + 4)  # two chunks of 2 rows, each with its crc32c

    def merge(pre: Any, ft: Any) -> Any:
        return {"body": pre["body"], "head": ft["head"], "step": ft["step"]}

    out = quire.load({"pre": a, "ft": b}, None, transform=merge)
    np.testing.assert_array_equal(out["head"], np.full((4, 2), 5.0))
    np.testing.assert_array_equal(out["body"]["w"], np.asarray(body))
    assert out["step"] == 9
    seq = quire.load([a, b], None, transform=merge)
    assert seq["step"] == 9

    def broken(pre: Any, ft: Any) -> Any:
        raise KeyError("oops")

    with pytest.raises(KeyError) as ei:
        quire.load([a, b], None, transform=broken)
    notes = " ".join(getattr(ei.value, "__notes__", []))
    assert a in notes and b in notes
    # no transform: one tree per source, a list for a sequence as a dict for a dict (hunt 2
    # finding 4: a list gave the first source's tree only and dropped the rest silently)
    both = quire.load([a, b])
    assert isinstance(both, list) and len(both) == 2
    assert both[0]["step"] == 3 and both[1]["step"] == 9
    np.testing.assert_array_equal(both[1]["head"], np.full((4, 2), 5.0))
    assert [t["step"] for t in quire.load((b,))] == [9]
    assert quire.load({"ft": b})["ft"]["step"] == 9
    with pytest.raises(quire.TreeMismatchError):  # b's leaves are in no target: strict refuses
        quire.load([a, b], {"head": np.zeros((4, 2)), "step": 0}, partial=False)
    # Checkpointer.load takes transform and shardings.
    ck = quire.Checkpointer(str(tmp_path / "run"))
    ck.save(1, {"w": np.arange(8.0)})
    ck.wait()
    got = ck.load(transform=lambda t: {"w2": t["w"][2:4]})
    np.testing.assert_array_equal(got["w2"], [2.0, 3.0])
    ck.close()


def test_lazy_operations_equal_numpy() -> None:
    rng = np.random.default_rng(4)
    a = rng.standard_normal((6, 4, 5)).astype(np.float32)
    b = rng.standard_normal((6, 4, 5)).astype(np.float32)
    la, lb = as_lazy(a), as_lazy(b)
    cases = [
        (surgery.stack([la, lb], 1), np.stack([a, b], 1)),
        (surgery.concatenate([la, lb], 2), np.concatenate([a, b], 2)),
        (surgery.transpose(la, (2, 0, 1)), np.transpose(a, (2, 0, 1))),
        (surgery.reshape(la, (3, 8, 5)), a.reshape(3, 8, 5)),
        (surgery.reshape(la, (-1,)), a.reshape(-1)),
        (surgery.astype(la, "bfloat16"), a.astype(ml_dtypes.bfloat16)),
        (la[1:5, 2, ...][1:3], a[1:5, 2][1:3]),
        (la[..., -1], a[..., -1]),
    ]
    for lazy, want in cases:
        np.testing.assert_array_equal(lazy.read(), want)
        if lazy.ndim:
            sl = tuple(slice(1, max(2, n - 1)) for n in lazy.shape)
            np.testing.assert_array_equal(lazy[sl].read(), want[sl])
    with pytest.raises(IndexError, match="step-1"):
        la[::2]


@pytest.mark.parametrize("index", [True, False, np.True_, (0, True), (Ellipsis, False)])
def test_lazy_index_refuses_a_bool(index: Any) -> None:
    """numpy takes a bool index as a mask that adds an axis (``a[True]`` has shape
    ``(1, *a.shape)``), not as the row 0 or 1: a lazy array refuses one (a Python bool is an
    int to ``operator.index``) rather than read the wrong row."""
    la = as_lazy(np.arange(12, dtype=np.float32).reshape(3, 4))
    with pytest.raises(IndexError, match="lazy arrays take ints, step-1 slices"):
        la[index]


def test_tree_helpers() -> None:
    tree = {"model": {"layers": {"0": {"w": 1}, "1": {"w": 2}}, "emb": 3}}
    flat = surgery.flatten(tree)
    assert flat == {"model.layers.0.w": 1, "model.layers.1.w": 2, "model.emb": 3}
    assert surgery.unflatten(flat) == tree
    assert surgery.unflatten(flat, lists=True)["model"]["layers"] == [{"w": 1}, {"w": 2}]
    renamed = surgery.rename(tree, [(r"model/layers/(\d+)/w", r"blocks/\1/kernel")])
    assert renamed["blocks"]["1"]["kernel"] == 2 and renamed["model"]["emb"] == 3
    assert surgery.rename(tree, {"model/emb": None}) == {
        "model": {"layers": tree["model"]["layers"]}
    }
    layers = {str(i): {"w": as_lazy(np.full((2, 3), i))} for i in range(3)}
    stacked = surgery.stack_layers(layers)
    assert stacked["w"].shape == (3, 2, 3)
    back = surgery.split_layers(stacked)
    np.testing.assert_array_equal(back[2]["w"].read(), np.full((2, 3), 2))
    with pytest.raises(ValueError, match="itself a tensor"):
        surgery.unflatten({"a.b": 1, "a.b.c": 2})


def test_flatten_and_rename_refuse_two_key_paths_that_join_to_one_name() -> None:
    # hunt 2 finding 5: the second leaf silently replaced the first
    both = r"key paths \('a\.b',\) and \('a', 'b'\) both join to 'a\.b'"
    with pytest.raises(ValueError, match=both):
        surgery.flatten({"a.b": 1, "a": {"b": 2}})
    with pytest.raises(ValueError, match=r"\(0,\) and \('0',\) both join to '0'"):
        surgery.flatten({0: 1, "0": 2})
    slash = {"a/b": 1, "a": {"b": 2}}
    for mapping in ({}, {"a/b": "c"}, [(r"a/b", "c")], lambda name: name):
        with pytest.raises(ValueError, match=r"\('a/b',\) and \('a', 'b'\) both join to 'a/b'"):
            surgery.rename(slash, mapping)  # type: ignore[arg-type]
    assert surgery.rename(slash, {}, sep=".") == {"a/b": 1, "a": {"b": 2}}  # another sep
    assert surgery.flatten({"a.b": 1, "a": {"c": 2}}) == {"a.b": 1, "a.c": 2}
    with pytest.raises(ValueError, match="rename: 'x' and 'y' are both renamed to 'z'"):
        surgery.rename({"x": 1, "y": 2}, {"x": "z", "y": "z"})


# -- the conformance suite, run against both first-party sources -------------------------------
class TestQuireSourceSuite(SourceSuite):
    source_format = "quire"

    def write(self, directory: Path, arrays: dict[str, np.ndarray]) -> str:
        quire.save(directory, surgery.unflatten(arrays, "/"))
        return str(directory)


class TestSafetensorsSourceSuite(SourceSuite):
    source_format = "safetensors"

    def write(self, directory: Path, arrays: dict[str, np.ndarray]) -> str:
        flat = {k.replace("/", "."): v for k, v in arrays.items()}
        _hf_dir(directory, flat, 2)
        return str(directory)
