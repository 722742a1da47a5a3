"""quire-torch: torch.Tensor leaves, found through the entry point only."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch

import quire
from quire.testing import LeafHandlerSuite

warnings.filterwarnings("ignore", message="ComplexHalf support is experimental")


def _bits(t: torch.Tensor) -> bytes:
    """The bytes of a tensor's values (compares every dtype, NaNs included)."""
    t = t.detach().contiguous().reshape(-1)
    return bytes(t.view(torch.uint8).numpy()) if t.numel() else b""


def _all_dtypes() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(3, 4, generator=g)
    out = [
        base.to(d)
        for d in (
            torch.float32,
            torch.float64,
            torch.float16,
            torch.bfloat16,
            torch.complex64,
            torch.complex128,
            torch.float8_e4m3fn,
            torch.float8_e5m2,
            torch.float8_e4m3fnuz,
            torch.float8_e5m2fnuz,
            torch.float8_e8m0fnu,
        )
    ]
    ints = torch.randint(0, 100, (5, 2), generator=g)
    out += [ints.to(d) for d in (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)]
    out += [ints.to(d) for d in (torch.uint16, torch.uint32, torch.uint64)]
    out.append(ints > 50)  # bool
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out.append(torch.complex(base, -base).to(torch.complex32))
    raw = torch.randint(0, 255, (6,), dtype=torch.uint8, generator=g)
    out += [raw.view(torch.float4_e2m1fn_x2), raw.view(torch.bits8), raw.view(torch.int16)]
    return out


class TestTorchHandler(LeafHandlerSuite):
    handler_id = "torch"

    @pytest.fixture
    def values(self) -> list[Any]:
        base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
        return [
            *_all_dtypes(),
            base.T,  # non-contiguous
            base[1:3, ::2],  # a strided view
            base[0],  # a view sharing storage
            torch.tensor(3.5),  # 0-d
            torch.zeros(0, 3),  # empty
            torch.nn.Parameter(torch.ones(2, 2)),  # requires grad
            torch.randn(3, dtype=torch.complex64).conj(),  # conjugate bit
            -torch.randn(3, dtype=torch.complex64).conj().imag,  # negative bit view
        ]

    def assert_leaf_equal(self, expected: Any, actual: Any) -> None:
        assert isinstance(actual, torch.Tensor), type(actual)
        assert actual.dtype == expected.dtype and actual.shape == expected.shape
        assert actual.device == expected.device
        assert _bits(actual.resolve_conj().resolve_neg()) == _bits(
            expected.resolve_conj().resolve_neg()
        )


def _model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 2)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(16, 4)).pow(2).mean().backward()
        opt.step()
    return model, opt


def test_model_state_dict_round_trip(tmp_path: Path) -> None:
    model, _ = _model_and_optimizer()
    url = str(tmp_path / "ckpt")
    quire.save(url, {"model": model.state_dict()})
    m2, _ = _model_and_optimizer()
    with torch.no_grad():
        for p in m2.parameters():
            p.zero_()
    m2.load_state_dict(quire.load(url)["model"])
    for k, v in model.state_dict().items():
        assert torch.equal(m2.state_dict()[k], v), k
    again = quire.load(url, {"model": model.state_dict()})["model"]
    assert type(again) is type(model.state_dict())  # OrderedDict, from the target
    assert list(again) == list(model.state_dict())


def test_state_dicts_round_trip(tmp_path: Path) -> None:
    model, opt = _model_and_optimizer()
    url = str(tmp_path / "ckpt")
    quire.save(url, {"model": model.state_dict(), "optim": opt.state_dict()})

    out = quire.load(url)
    m2, o2 = _model_and_optimizer()
    with torch.no_grad():
        for p in m2.parameters():
            p.zero_()
    o2 = torch.optim.AdamW(m2.parameters(), lr=0.5)
    m2.load_state_dict(out["model"])
    o2.load_state_dict(out["optim"])
    assert o2.state_dict()["param_groups"] == opt.state_dict()["param_groups"]
    for k, v in model.state_dict().items():
        assert torch.equal(m2.state_dict()[k], v), k
    for i, s in opt.state_dict()["state"].items():
        for k, v in s.items():
            assert torch.equal(o2.state_dict()["state"][i][k], v), (i, k)
    # Both continue identically.
    x = torch.randn(16, 4)
    for m, o in ((model, opt), (m2, o2)):
        o.zero_grad()
        m(x).pow(2).mean().backward()
        o.step()
    for (k, a), b in zip(model.state_dict().items(), m2.state_dict().values()):
        assert torch.equal(a, b), k

    # Into the state_dicts themselves as the abstract tree (strict: every key checked).
    again = quire.load(url, {"model": model.state_dict(), "optim": opt.state_dict()})
    assert type(again["model"]) is type(model.state_dict())  # OrderedDict
    assert set(again["optim"]["state"]) == set(opt.state_dict()["state"])  # int keys


def test_targets_choose_the_array_type(tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    bf = torch.linspace(-1, 1, 8, dtype=torch.bfloat16)
    quire.save(url, {"t": t, "bf": bf, "s": torch.tensor(7, dtype=torch.int64)})

    as_np = quire.load(url, {"t": np.ndarray, "bf": np.ndarray, "s": int})
    assert isinstance(as_np["t"], np.ndarray) and as_np["t"].dtype == np.float32
    np.testing.assert_array_equal(as_np["t"], t.numpy())
    assert as_np["bf"].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(as_np["bf"].astype(np.float32), bf.float().numpy())
    assert as_np["s"] == 7 and type(as_np["s"]) is int

    as_jax = quire.load(
        url,
        {
            "t": jax.ShapeDtypeStruct((3, 4), jnp.float32),
            "bf": jax.ShapeDtypeStruct((8,), jnp.bfloat16),
            "s": jax.ShapeDtypeStruct((), jnp.int64),
        },
    )
    assert isinstance(as_jax["t"], jax.Array) and as_jax["bf"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(as_jax["t"]), t.numpy())

    cast = quire.load(
        url, {"t": torch.empty(3, 4, dtype=torch.float64), "bf": torch.Tensor, "s": None}
    )
    assert cast["t"].dtype == torch.float64 and torch.equal(cast["t"], t.double())
    assert cast["bf"].dtype == torch.bfloat16 and torch.equal(cast["bf"], bf)

    with pytest.raises(quire.TreeMismatchError, match=r"saved shape \(3, 4\)"):
        quire.load(url, {"t": torch.empty(4, 3), "bf": None, "s": None})


def test_dtype_without_numpy_equivalent_needs_a_tensor_target(tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        c = torch.ones(2, 3, dtype=torch.complex32)
    quire.save(url, {"c": c})
    with pytest.raises(quire.TreeMismatchError, match="load it as a torch tensor"):
        quire.load(url, {"c": np.zeros((2, 3), np.complex64)})
    assert quire.load(url, {"c": torch.Tensor})["c"].dtype == torch.complex32


def test_zarr_reads_tensors_as_arrays(tmp_path: Path) -> None:
    import zarr

    url = str(tmp_path / "ckpt")
    t = torch.randn(5, 3).to(torch.bfloat16)
    quire.save(url, {"t": t})
    leaf = quire.metadata(url).record["units"]["pytree"]["tree"]["children"][0]
    assert leaf["handler"] == "torch" and leaf["torch_dtype"] == "bfloat16"
    # Either layout: quire.zarr_store(url) is a plain zarr store over the checkpoint.
    z = zarr.open_array(quire.zarr_store(url), path=leaf["location"], mode="r")
    np.testing.assert_array_equal(z[...].astype(np.float32), t.float().numpy())
    assert quire.metadata(url).tree["t"].dtype == ml_dtypes.bfloat16


def test_a_forged_chunk_is_refused_for_every_target(tmp_path: Path) -> None:
    """A tensor's chunk is bound in the chunk index by its crc32c trailer (format v2,
    docs/format.md): a chunk whose body changed under an intact trailer passes that
    comparison, so the tensor load path must check the crc32c itself."""
    url = str(tmp_path / "ckpt")
    quire.save(url, {"t": torch.arange(64, dtype=torch.float32).reshape(8, 8)})
    (entry,) = json.loads(Path(url, "quire.json").read_text())["indexes"]
    index = json.loads(Path(url, entry["object"]).read_text())
    (key,) = [k for k in index["quire"]["crc32c"] if "/c/" in k]
    pack, off, n = index["refs"][key]
    raw = bytearray(Path(url, pack).read_bytes())
    raw[off + n // 2] ^= 0x10  # the body; the trailer (the index's value) is intact
    Path(url, pack).write_bytes(bytes(raw))
    for target in (None, torch.Tensor, np.ndarray):
        with pytest.raises(quire.CorruptCheckpointError, match="crc32c checksum mismatch"):
            quire.load(url, {"t": target})
    assert not quire.verify(url).ok


def test_save_async_copies_before_returning(tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    t = torch.zeros(1000)
    pending = quire.save_async(url, {"t": t, "view": t[::10]})
    t.fill_(1.0)  # the caller may mutate as soon as save_async returns
    pending.result(timeout=60)
    out = quire.load(url)
    assert torch.equal(out["t"], torch.zeros(1000)) and torch.equal(out["view"], torch.zeros(100))


def test_views_are_saved_by_value(tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    base = torch.arange(10.0)
    quire.save(url, {"base": base, "tail": base[5:], "rev": base.flip(0)})
    out = quire.load(url)
    out["tail"].fill_(-1)  # restored leaves do not share storage
    assert torch.equal(out["base"], torch.arange(10.0))
    assert torch.equal(out["rev"], torch.arange(9.0, -1.0, -1.0))


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: torch.eye(3).to_sparse(), "to_dense"),
        (lambda: torch.empty(3, device="meta"), "meta tensor"),
    ],
)
def test_unsupported_tensors_are_refused_clearly(tmp_path: Path, make: Any, match: str) -> None:
    with pytest.raises(quire.errors.UnsupportedLeafError, match=match) as e:
        quire.save(str(tmp_path / "c"), {"bad": make()})
    assert "bad" in str(e.value)
    assert not (tmp_path / "c" / "quire.json").exists()


def test_found_through_the_entry_point_only(tmp_path: Path) -> None:
    """Neither `import quire` nor a save without tensors imports torch or quire_torch's
    dependencies; a tensor save then uses the handler without any import of quire_torch."""
    code = f"""
import sys, numpy as np, quire
assert "torch" not in sys.modules and "quire_torch" not in sys.modules
quire.save({str(tmp_path / "np")!r}, {{"x": np.ones(3)}})
assert "torch" not in sys.modules, "saving numpy leaves imported torch"
import torch
quire.save({str(tmp_path / "t")!r}, {{"w": torch.ones(2, dtype=torch.bfloat16)}})
got = quire.load({str(tmp_path / "t")!r})["w"]
assert isinstance(got, torch.Tensor) and got.dtype == torch.bfloat16, got
print("ok")
"""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]
    rec = json.loads((tmp_path / "t" / "quire.json").read_text())
    assert rec["units"]["pytree"]["tree"]["children"][0]["handler"] == "torch"
    eps = importlib.metadata.entry_points(group="quire.leaf_handlers", name="torch")
    dists = {ep.dist.metadata["Name"] for ep in eps if ep.dist is not None}
    assert dists == {"quire-torch"}
