"""Flax NNX, Optax, Equinox and typed PRNG keys as their users save them (issue 31).

The real libraries (test dependencies), no stand-ins: ``nnx.state`` / ``nnx.eval_shape`` /
``nnx.Optimizer``, optax's state classes, ``eqx.filter`` / ``eqx.combine``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import quire
from quire._cli.main import main


class Model(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, sharded: bool = False) -> None:
        init: Any = nnx.initializers.lecun_normal()
        if sharded:
            init = nnx.with_partitioning(init, (None, "model"))
        self.lin = nnx.Linear(4, 8, kernel_init=init, rngs=rngs)
        self.bn = nnx.BatchNorm(8, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.drop(self.bn(self.lin(x)))


def _leaves_equal(a: Any, b: Any) -> None:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            assert jax.random.key_impl(x) == jax.random.key_impl(y)
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        assert x.dtype == y.dtype and np.array_equal(np.asarray(x), np.asarray(y))


@nnx.jit
def _train_step(model: Model, opt: nnx.Optimizer, x: jax.Array) -> None:
    grads = nnx.grad(lambda m: jnp.mean(m(x) ** 2))(model)
    opt.update(model, grads)


# --------------------------------------------------------------------------------- NNX
def test_nnx_state_round_trips_and_records_variable_types(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each leaf's Variable class is in ``quire.metadata`` and ``quire info`` (issue 31)."""
    model = Model(nnx.Rngs(0, dropout=1))
    x = jnp.ones((2, 4))
    model(x)  # advances the dropout RNG count and the batch statistics
    url = str(tmp_path / "ckpt")
    quire.save(url, nnx.state(model))
    tree = quire.metadata(url).tree
    assert tree["lin"]["kernel"]["value"].variable == "Param"
    assert tree["bn"]["mean"]["value"].variable == "BatchStat"
    assert tree["drop"]["rngs"]["key"]["value"].variable == "RngKey"
    assert tree["drop"]["rngs"]["count"]["value"].variable == "RngCount"
    # The typed key, as ``quire info`` says (issue 35: the metadata said uint32).
    key = tree["drop"]["rngs"]["key"]["value"]
    assert key.handler == "prng_key" and key.shape == ()
    assert key.dtype == model.drop.rngs.key[...].dtype and str(key.dtype) == "key<fry>"
    assert jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key) and key.nbytes == 8
    assert main(["info", url]) == 0
    info = capsys.readouterr().out
    assert "kernel/" in info and "nnx.Param" in info and "nnx.RngKey, prng key" in info
    # Restored into the abstract model's state: NNX's own classes, bit-exact.
    fresh = Model(nnx.Rngs(7, dropout=8))
    state = quire.load(url, nnx.state(nnx.eval_shape(lambda: Model(nnx.Rngs(0, dropout=1)))))
    assert isinstance(state, nnx.State)
    nnx.update(fresh, state)
    _leaves_equal(nnx.state(model), nnx.state(fresh))
    assert np.array_equal(np.asarray(model(x)), np.asarray(fresh(x)))  # dropout RNG too


def test_nnx_optimizer_resumes_bit_exactly(tmp_path: Path) -> None:
    model = Model(nnx.Rngs(0, dropout=1))
    opt = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
    x = jnp.arange(8.0).reshape(2, 4)
    _train_step(model, opt, x)
    url = str(tmp_path / "ckpt")
    quire.save(url, {"model": nnx.state(model), "opt": nnx.state(opt)})
    assert quire.metadata(url).tree["opt"]["step"]["value"].variable == "OptState"

    def make() -> tuple[Model, nnx.Optimizer]:
        m = Model(nnx.Rngs(0, dropout=1))
        return m, nnx.Optimizer(m, optax.adamw(1e-2), wrt=nnx.Param)

    abstract_model, abstract_opt = nnx.eval_shape(make)
    got = quire.load(url, {"model": nnx.state(abstract_model), "opt": nnx.state(abstract_opt)})
    model2, opt2 = make()
    nnx.update(model2, got["model"])
    nnx.update(opt2, got["opt"])
    _train_step(model, opt, x)
    _train_step(model2, opt2, x)
    _leaves_equal(nnx.state(opt), nnx.state(opt2))
    _leaves_equal(nnx.state(model), nnx.state(model2))


def test_nnx_sharded_model_restores_into_its_abstract_model(tmp_path: Path) -> None:
    """A model sharded on an Explicit mesh, restored into ``nnx.eval_shape`` of itself (whose
    shardings are on an abstract mesh), in and out of ``jax.set_mesh``."""
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    with jax.set_mesh(mesh):
        model = Model(nnx.Rngs(0), sharded=True)
        abstract = nnx.state(nnx.eval_shape(lambda: Model(nnx.Rngs(1), sharded=True)))
    assert isinstance(abstract["lin"]["kernel"].sharding.mesh, jax.sharding.AbstractMesh)
    url = str(tmp_path / "ckpt")
    quire.save(url, nnx.state(model))
    for inside in (False, True):
        if inside:
            with jax.set_mesh(mesh):
                state = quire.load(url, abstract)
        else:
            state = quire.load(url, abstract)
        kernel = state["lin"]["kernel"][...]
        assert kernel.sharding.spec == P(None, "model")
        assert kernel.sharding.mesh.axis_types == mesh.axis_types
        _leaves_equal(nnx.state(model), state)


def test_target_less_load_merged_into_nnx_is_refused_where_quire_sees_it(tmp_path: Path) -> None:
    """``nnx.update(model, quire.load(url))`` nests each array in a ``{'value': ...}`` dict
    (NNX accepts it silently); quire refuses that model at its next save and as a target,
    naming the Variable and the call that restores NNX state."""
    model = Model(nnx.Rngs(0))
    url = str(tmp_path / "ckpt")
    quire.save(url, nnx.state(model))
    raw = quire.load(url)
    assert set(raw["lin"]["kernel"]) == {"value"}  # the stored tree, as documented
    broken = Model(nnx.Rngs(1))
    nnx.update(broken, raw)
    with pytest.raises(quire.errors.UnsupportedLeafError) as ei:
        quire.save(str(tmp_path / "again"), nnx.state(broken))
    msg = str(ei.value)
    assert "'bn/bias'" in msg or "'lin/bias'" in msg
    assert "NNX Param" in msg and "nnx.state(nnx.eval_shape(make_model))" in msg
    with pytest.raises(quire.errors.UnsupportedLeafError, match="target-less"):
        quire.load(url, nnx.state(broken))
    # The documented call for a target-less restore: save the pure dict.
    pure_url = str(tmp_path / "pure")
    quire.save(pure_url, nnx.to_pure_dict(nnx.state(model)))
    fixed = Model(nnx.Rngs(1))
    nnx.update(fixed, quire.load(pure_url))
    _leaves_equal(nnx.state(model), nnx.state(fixed))


def test_pure_dict_and_nnx_state_mismatch_says_which_call_fits(tmp_path: Path) -> None:
    model = Model(nnx.Rngs(0))
    abstract = nnx.state(nnx.eval_shape(lambda: Model(nnx.Rngs(0))))
    state_url, pure_url = str(tmp_path / "state"), str(tmp_path / "pure")
    quire.save(state_url, nnx.state(model))
    quire.save(pure_url, nnx.to_pure_dict(nnx.state(model)))
    with pytest.raises(quire.TreeMismatchError, match=r"pure dict: load into nnx\.state"):
        quire.load(state_url, nnx.to_pure_dict(abstract))
    with pytest.raises(quire.TreeMismatchError, match=r"nnx\.replace_by_pure_dict"):
        quire.load(pure_url, abstract)
    # What the hint says works.
    loaded = quire.load(pure_url, nnx.to_pure_dict(abstract))
    nnx.replace_by_pure_dict(abstract, loaded)
    _leaves_equal(nnx.state(model), abstract)


# ------------------------------------------------------------------------------- Optax
def test_optax_state_with_and_without_a_target(tmp_path: Path) -> None:
    params = {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.zeros(3)}
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))
    opt_state = tx.init(params)
    grads = jax.tree.map(jnp.ones_like, params)
    _, opt_state = tx.update(grads, opt_state, params)
    url = str(tmp_path / "ckpt")
    quire.save(url, {"params": params, "opt_state": opt_state})
    # With a target (jax.eval_shape of tx.init): optax's own classes come back.
    abstract = {"params": params, "opt_state": jax.eval_shape(tx.init, params)}
    got = quire.load(url, abstract)
    assert jax.tree.structure(got["opt_state"]) == jax.tree.structure(opt_state)
    assert isinstance(got["opt_state"][1][0], optax.ScaleByAdamState)
    _leaves_equal(opt_state, got["opt_state"])
    a, _ = tx.update(grads, opt_state, params)
    b, _ = tx.update(grads, got["opt_state"], got["params"])
    _leaves_equal(a, b)
    # Without one: the stored tree, a NamedTuple as a dict of its fields.
    raw = quire.load(url)["opt_state"]
    adam = raw[1][0]
    assert isinstance(adam, dict) and list(adam) == ["count", "mu", "nu"]
    assert np.array_equal(np.asarray(adam["mu"]["w"]), np.asarray(opt_state[1][0].mu["w"]))


# ----------------------------------------------------------------------------- Equinox
def test_equinox_function_field_error_names_filter_and_combine(tmp_path: Path) -> None:
    model = eqx.nn.MLP(3, 2, 8, 2, key=jax.random.key(0))
    url = str(tmp_path / "ckpt")
    with pytest.raises(quire.errors.UnsupportedLeafError) as ei:
        quire.save(url, model)
    msg = str(ei.value)
    assert "'activation'" in msg and "Equinox module MLP" in msg
    assert "eqx.filter(model, eqx.is_array)" in msg and "eqx.combine" in msg
    # The fix it names, as the docs show it.
    quire.save(url, eqx.filter(model, eqx.is_array))
    new = eqx.nn.MLP(3, 2, 8, 2, key=jax.random.key(1))
    params, static = eqx.partition(new, eqx.is_array)
    restored = eqx.combine(quire.load(url, params), static)
    x = jnp.arange(3.0)
    assert np.array_equal(np.asarray(model(x)), np.asarray(restored(x)))


# ---------------------------------------------------------------------------- PRNG keys
def test_rbg_key_into_threefry_target_is_refused_naming_both(tmp_path: Path) -> None:
    """Before issue 31 the rbg key came back as rbg, silently, into a threefry target."""
    url = str(tmp_path / "ckpt")
    key = jax.random.key(3, impl="rbg")
    quire.save(url, {"k": key, "ks": jax.random.split(jax.random.key(1), 4)})
    threefry = jax.eval_shape(lambda: jax.random.key(0))
    with pytest.raises(quire.TreeMismatchError) as ei:
        quire.load(
            url,
            {"k": threefry, "ks": jax.eval_shape(lambda: jax.random.split(jax.random.key(0), 4))},
        )
    (why,) = ei.value.mismatched
    assert why.startswith("'k': saved rbg PRNG keys of shape (), target threefry2x32 keys")
    assert "impl='rbg'" in why
    got = quire.load(url, {"k": jax.eval_shape(lambda: jax.random.key(0, impl="rbg")), "ks": None})
    assert jax.random.key_impl(got["k"]) == jax.random.key_impl(key)
    assert np.array_equal(jax.random.key_data(got["k"]), jax.random.key_data(key))


def test_key_mismatch_says_what_was_saved_and_what_was_asked(tmp_path: Path) -> None:
    """The message said "saved shape () uint32" (the key data's dtype) before issue 31."""
    url = str(tmp_path / "ckpt")
    quire.save(url, {"k": jax.random.key(0)})
    split = jax.eval_shape(lambda: jax.random.split(jax.random.key(0), 2))
    with pytest.raises(quire.TreeMismatchError) as ei:
        quire.load(url, {"k": split})
    (why,) = ei.value.mismatched
    assert (
        why
        == "'k': saved threefry2x32 PRNG keys of shape (), target threefry2x32 keys of shape (2,)"
    )
    with pytest.raises(quire.TreeMismatchError) as ei:
        quire.load(url, {"k": jax.ShapeDtypeStruct((2,), jnp.uint32)})
    (why,) = ei.value.mismatched
    assert "target uint32 of shape (2,), not a typed key" in why and "key_data" in why
