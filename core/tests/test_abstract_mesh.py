"""Targets on an abstract mesh and Explicit mesh axes (issue 31).

``jax.make_mesh`` makes Explicit axes; ``jax.eval_shape`` of a state sharded on such a mesh
gives ``NamedSharding(AbstractMesh)`` targets, which have no devices.  A load makes them
concrete on the mesh in context (``jax.set_mesh``), else on the saved mesh when its axes and
the device count agree, else reports the key path and the fix.  The record keeps the mesh's
axis types, and a load without a target (or without a sharding) restores them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import quire
from quire._cli.main import main
from quire._format.record import record_checksum

Explicit, Auto = AxisType.Explicit, AxisType.Auto


def _mesh() -> jax.sharding.Mesh:
    return jax.make_mesh((4, 2), ("data", "model"))  # Explicit axes by default


def _init() -> dict[str, Any]:
    return {
        "w": jnp.arange(32.0).reshape(8, 4),
        "b": jnp.arange(4, dtype=jnp.bfloat16),
        "step": jnp.array(7, jnp.int32),
    }


def _shardings(mesh: jax.sharding.Mesh) -> dict[str, Any]:
    return {
        "w": NamedSharding(mesh, P("data", "model")),
        "b": NamedSharding(mesh, P("model")),
        "step": NamedSharding(mesh, P()),
    }


def _state(mesh: jax.sharding.Mesh) -> dict[str, Any]:
    # device_put on an Explicit mesh: jax.eval_shape of it gives AbstractMesh shardings.
    return jax.device_put(_init(), _shardings(mesh))


def _same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and np.array_equal(np.asarray(a[k]), np.asarray(b[k])), k


def test_eval_shape_target_loads_on_the_saved_mesh(tmp_path: Path) -> None:
    """Before issue 31: ``ValueError: _device_assignment is not implemented for
    jax.sharding.AbstractMesh`` from ``_handlers/arrays._read_array``, naming no key."""
    mesh = _mesh()
    state = _state(mesh)
    url = str(tmp_path / "ckpt")
    quire.save(url, state)
    abstract = jax.eval_shape(lambda: _state(mesh))
    assert isinstance(abstract["w"].sharding.mesh, jax.sharding.AbstractMesh)
    out = quire.load(url, abstract)
    _same(state, out)
    for k in state:
        got = out[k].sharding
        assert isinstance(got.mesh, jax.sharding.Mesh) and got.spec == state[k].sharding.spec
        assert got.mesh.axis_types == (Explicit, Explicit)
        assert got.is_equivalent_to(state[k].sharding, state[k].ndim)
    with jax.set_mesh(mesh):  # the loaded arrays work where Explicit axes are required
        y = jax.jit(lambda w, b: w.astype(jnp.bfloat16) * b)(out["w"], out["b"])
    assert y.sharding.spec == P("data", "model")


def test_mesh_in_context_wins_over_the_saved_one(tmp_path: Path) -> None:
    """Inside ``jax.set_mesh(mesh)`` the target lands on that very mesh (here with the devices
    in another order than ``jax.make_mesh`` gives), also when the saved mesh has other axes."""
    url = str(tmp_path / "ckpt")
    quire.save(url, _state(_mesh()))
    devices = np.array(jax.devices()[::-1]).reshape(2, 4)
    other = jax.sharding.Mesh(devices, ("data", "model"), axis_types=(Explicit, Explicit))
    abstract = jax.eval_shape(lambda: _state(other))
    with jax.set_mesh(other):
        out = quire.load(url, abstract)
    _same(_state(_mesh()), out)
    assert out["w"].sharding.mesh.devices.tolist() == devices.tolist()
    assert out["w"].sharding.mesh.axis_types == (Explicit, Explicit)


def test_abstract_mesh_that_nothing_matches_is_a_mismatch_naming_keys_and_fix(
    tmp_path: Path,
) -> None:
    url = str(tmp_path / "ckpt")
    quire.save(url, _state(_mesh()))
    other = jax.make_mesh((2, 4), ("data", "model"))
    abstract = jax.eval_shape(lambda: _state(other))
    with pytest.raises(quire.TreeMismatchError) as ei:
        quire.load(url, abstract)
    msg = str(ei.value)
    assert len(ei.value.mismatched) == 3  # every leaf, not the first one only
    for key in ("'w'", "'b'", "'step'"):
        assert key in msg
    assert "abstract mesh ('data': 2, 'model': 4)" in msg
    assert "saved mesh (('data': 4, 'model': 2)" in msg
    assert "jax.set_mesh(mesh)" in msg
    # The fix it names works: the mesh the target was made for, in context.
    with jax.set_mesh(other):
        out = quire.load(url, abstract)
    _same(_state(_mesh()), out)
    assert out["w"].sharding.mesh.shape == other.shape


def test_checkpointer_readme_pattern_with_a_sharded_state(tmp_path: Path) -> None:
    """The README's ``ckpt.load(start, jax.eval_shape(init_state))`` once the state is
    sharded on a ``jax.make_mesh`` mesh."""
    mesh = _mesh()

    def init_state() -> dict[str, Any]:
        return _state(mesh)

    with quire.Checkpointer(str(tmp_path / "run")) as ckpt:
        ckpt.save(3, init_state())
        ckpt.wait()
        state = ckpt.load(ckpt.latest_step(), jax.eval_shape(init_state))
    _same(init_state(), state)
    assert state["w"].sharding.mesh.axis_types == (Explicit, Explicit)


def test_transform_and_lazy_reads_place_abstract_targets(tmp_path: Path) -> None:
    """The lazy path (``_sources/materialize``): a transform into an eval_shape target, and
    ``LazyArray.read(sharding=...)`` with an abstract-mesh sharding."""
    mesh = _mesh()
    url = str(tmp_path / "ckpt")
    quire.save(url, _state(mesh))
    abstract = jax.eval_shape(lambda: _state(mesh))
    out = quire.load(url, abstract, transform=lambda t: t)
    _same(_state(mesh), out)
    assert out["w"].sharding.mesh.axis_types == (Explicit, Explicit)
    # A lazy operation (not the source array itself) is placed on the saved mesh too.
    out = quire.load(url, abstract, transform=lambda t: {**t, "w": t["w"].T.T})
    _same(_state(mesh), out)
    src = quire.open(url)
    w = src.tree["w"].read(sharding=abstract["w"].sharding)
    assert w.sharding.spec == P("data", "model") and w.sharding.mesh.axis_types[0] == Explicit
    bad = jax.eval_shape(lambda: _state(jax.make_mesh((2, 4), ("data", "model"))))
    with pytest.raises(quire.TreeMismatchError, match=r"'w'.*jax.set_mesh"):
        quire.load(url, bad, transform=lambda t: t)
    with pytest.raises(quire.TreeMismatchError, match=r"ckpt:w.*jax.set_mesh"):
        src.tree["w"].read(sharding=bad["w"].sharding)


def test_axis_types_come_back_without_a_target(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before issue 31 the record kept names and sizes only: the array came back on Auto
    axes and a jitted ``x @ w`` under ``jax.set_mesh(explicit_mesh)`` failed
    (``context mesh ... Explicit should match the aval mesh ... Auto``)."""
    mesh = jax.make_mesh((8,), ("data",))
    x = jax.device_put(jnp.arange(64.0).reshape(8, 8), NamedSharding(mesh, P("data")))
    w = jax.device_put(jnp.eye(8), NamedSharding(mesh, P()))
    url = str(tmp_path / "ckpt")
    quire.save(url, {"x": x, "w": w})
    leaf = quire.metadata(url).tree["x"]
    assert leaf.sharding["axis_types"] == ["Explicit"]
    assert main(["info", url]) == 0
    assert "mesh={'data': 8} spec=['data'], axis_types=[Explicit]" in capsys.readouterr().out
    out = quire.load(url)
    no_sharding = quire.load(url, {"x": jax.ShapeDtypeStruct((8, 8), jnp.float32), "w": None})
    for got in (out, no_sharding):
        assert got["x"].sharding.mesh.axis_types == (Explicit,)
        with jax.set_mesh(mesh):
            y = jax.jit(lambda a, b: a @ b)(got["x"], out["w"])
        assert np.array_equal(np.asarray(y), np.arange(64.0).reshape(8, 8))


def test_a_record_without_axis_types_loads_auto_axes(tmp_path: Path) -> None:
    """Records written before issue 31 (no ``axis_types``) still load, on Auto axes."""
    url = str(tmp_path / "ckpt")
    quire.save(url, _state(_mesh()))
    doc = json.loads(Path(url, "quire.json").read_text())
    for leaf in doc["units"]["pytree"]["tree"]["children"]:
        del leaf["sharding"]["axis_types"]
    doc.pop("checksum")
    Path(url, "quire.json").write_text(json.dumps({**doc, "checksum": record_checksum(doc)}))
    out = quire.load(url)
    assert out["w"].sharding.mesh.axis_types == (Auto, Auto)
    assert out["w"].sharding.spec == P("data", "model")
    _same(_state(_mesh()), out)


_FACTORS = [(8,), (4, 2), (2, 4), (2, 2, 2), (1, 8)]


@st.composite
def _layouts(draw: st.DrawFn) -> tuple[tuple[int, ...], tuple[AxisType, ...], P]:
    sizes = draw(st.sampled_from(_FACTORS))
    types = tuple(draw(st.sampled_from([Auto, Explicit])) for _ in sizes)
    axes = [f"a{i}" for i in range(len(sizes))]
    order = draw(st.permutations(axes))
    cut = draw(st.integers(0, len(order)))
    spec = P(
        tuple(order[:cut]) or None,
        draw(st.sampled_from([None, *order[cut:]]) if order[cut:] else st.none()),
    )
    return sizes, types, spec


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(layout=_layouts())
def test_any_mesh_round_trips_with_and_without_an_eval_shape_target(
    tmp_path: Path, layout: tuple[tuple[int, ...], tuple[AxisType, ...], P]
) -> None:
    """Property: for any mesh of the 8 devices, axis types and spec, a target-less load and a
    load into ``jax.eval_shape`` of the value give the saved values, spec and axis types (the
    oracle is the saved array itself)."""
    sizes, types, spec = layout
    mesh = jax.make_mesh(sizes, tuple(f"a{i}" for i in range(len(sizes))), axis_types=types)
    x = jax.device_put(
        jnp.arange(16 * 8, dtype=jnp.float32).reshape(16, 8), NamedSharding(mesh, spec)
    )
    url = str(tmp_path / f"ckpt-{sizes}-{[t.name for t in types]}-{spec}")
    quire.save(url, {"x": x}, overwrite=True)
    for out in (quire.load(url), quire.load(url, jax.eval_shape(lambda: {"x": x}))):
        got = out["x"].sharding
        assert np.array_equal(np.asarray(out["x"]), np.asarray(x))
        assert got.mesh.axis_types == types and got.mesh.shape == mesh.shape
        assert got.is_equivalent_to(x.sharding, 2)


def test_a_target_sharding_that_does_not_divide_a_shape_names_the_leaf(tmp_path: Path) -> None:
    """Before anything is read, as partition rules do: the key path, shape, sharding and
    the URL, for a target sharding and for ``shardings=`` alike."""
    url = str(tmp_path / "ckpt")
    tree = {"layers": {f"k{i}": np.zeros((8, 3), np.float32) for i in range(3)}}
    tree["layers"]["k1"] = np.zeros((10, 3), np.float32)
    quire.save(url, tree)
    mesh = jax.make_mesh((4,), ("a",))
    sh = NamedSharding(mesh, P("a"))
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), tree)
    for load in (lambda: quire.load(url, abstract), lambda: quire.load(url, shardings=sh)):
        with pytest.raises(quire.TreeMismatchError) as ei:
            load()
        msg = str(ei.value)
        (bad,) = ei.value.mismatched
        assert bad.startswith("'layers/k1'"), msg
        assert url in msg and "(10, 3)" in msg and "does not divide" in msg
    abstract["layers"]["k1"] = jax.ShapeDtypeStruct((10, 3), np.float32)  # the fix: replicated
    got = quire.load(url, abstract)
    assert got["layers"]["k0"].sharding == sh and got["layers"]["k1"].shape == (10, 3)
