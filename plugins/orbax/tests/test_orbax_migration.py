"""Migrating a Flax ``TrainState`` from Orbax to quire, as most Orbax users first try it (issue 35).

Orbax writes optax's ``EmptyState()`` (``clip_by_global_norm``'s and ``adamw``'s stateless
parts) as None; the same TrainState must load from the Orbax step, and from its ``quire cp``,
without ``partial=True``, bit-exactly and in the target's structure.
"""

from __future__ import annotations

from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax.training.train_state import TrainState

import quire

pytestmark = [pytest.mark.filterwarnings("ignore:Sharding info not provided:UserWarning")]


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return nn.Dense(3)(nn.relu(nn.Dense(8)(x)))


def make_state(seed: int = 0) -> TrainState:
    model = MLP()
    params = model.init(jax.random.key(seed), jnp.ones((1, 4)))["params"]
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))
    return TrainState.create(apply_fn=model.apply, params=params, tx=tx)


@jax.jit
def train_step(state: TrainState, x: jax.Array) -> TrainState:
    grads = jax.grad(lambda p: jnp.mean(state.apply_fn({"params": p}, x) ** 2))(state.params)
    return state.apply_gradients(grads=grads)


def _bits(got: Any, want: Any) -> None:
    """Every leaf: the same dtype, shape and bytes."""
    la, lb = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(la) == len(lb)
    for a, b in zip(la, lb):
        a, b = np.asarray(a), np.asarray(b)
        assert (a.dtype, a.shape) == (b.dtype, b.shape)
        assert a.tobytes() == b.tobytes()


def _quire_cli(*argv: str) -> int:
    (ep,) = entry_points(group="console_scripts", name="quire")
    return int(ep.load()(list(argv)))


@pytest.fixture(scope="module")
def orbax_step(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, TrainState]:
    """A CheckpointManager step of a TrainState trained for three steps (mu, nu non-zero)."""
    state = make_state()
    x = jnp.linspace(-1, 1, 8).reshape(2, 4)
    for _ in range(3):
        state = train_step(state, x)
    root = tmp_path_factory.mktemp("orbax") / "run"
    with ocp.CheckpointManager(root) as mngr:
        mngr.save(3, args=ocp.args.StandardSave(state))
        mngr.wait_until_finished()
    return str(root / "3"), state


def _check_resumes(got: TrainState, state: TrainState, abstract: TrainState) -> None:
    # The target's structure: optax's EmptyState() and ScaleByAdamState, not None or dicts.
    assert jax.tree.structure(got) == jax.tree.structure(abstract)
    assert isinstance(got.opt_state[0], optax.EmptyState)
    assert isinstance(got.opt_state[1][0], optax.ScaleByAdamState)
    _bits(got, state)
    # And it trains on exactly as the original does.
    x = jnp.linspace(1, 2, 8).reshape(2, 4)
    _bits(train_step(got, x), train_step(state, x))


def test_a_train_state_loads_from_an_orbax_step_without_partial(
    orbax_step: tuple[str, TrainState],
) -> None:
    path, state = orbax_step
    abstract = jax.eval_shape(make_state)
    got = quire.load(path, abstract)
    _check_resumes(got, state, abstract)


def test_a_train_state_loads_after_quire_cp(
    orbax_step: tuple[str, TrainState], tmp_path: Path
) -> None:
    path, state = orbax_step
    dst = str(tmp_path / "converted")
    assert _quire_cli("cp", path, dst, "-q") == 0
    abstract = jax.eval_shape(make_state)
    got = quire.load(dst, abstract)
    _check_resumes(got, state, abstract)


def test_a_mismatch_names_the_checkpoint_not_a_transform(
    orbax_step: tuple[str, TrainState],
) -> None:
    """No transform was given: the message is about the checkpoint (it said "the transform
    result of <url>")."""
    path, _ = orbax_step
    abstract = jax.eval_shape(make_state)
    params = dict(abstract.params)
    params.pop("Dense_1")
    with pytest.raises(quire.errors.TreeMismatchError) as ei:
        quire.load(path, abstract.replace(params=params))
    msg = str(ei.value)
    assert msg.startswith(f"checkpoint {path} does not match the target tree")
    assert "transform" not in msg.split("To fix")[0]
    assert "params/Dense_1/kernel" in ei.value.missing
