"""Flax NNX, Optax, Equinox and typed PRNG keys as their users save them (issue 31).

The real libraries (test dependencies), no stand-ins: ``nnx.state`` / ``nnx.eval_shape`` /
``nnx.Optimizer``, optax's state classes, ``eqx.filter`` / ``eqx.combine``.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import quire


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
