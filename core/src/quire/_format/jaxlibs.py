"""What the tree walk knows of JAX libraries' nodes, found without importing the libraries.

Flax and Equinox are not dependencies of quire: a value can only be one of their objects if
the library is already imported, so each check looks its class up in ``sys.modules``.

* A Flax NNX ``Variable`` (``nnx.Param``, ``nnx.BatchStat``, ``nnx.RngKey``, an optimizer's
  ``OptState`` ...) is a pytree node with one child, its value, under the key ``value``.
  The walk records the Variable's class name on each leaf under it (the leaf record's
  ``variable``, :attr:`quire.metadata.LeafMetadata.variable`).
* ``nnx.update(model, quire.load(url))`` with a target-less load sets each Variable's value
  to the ``{"value": array}`` dict that load returns for it, silently.  Such a Variable is
  refused wherever quire meets it (the next save of the model, or a load into its state),
  with the call that restores NNX state: :func:`nested_value_error`.
* An Equinox ``Module`` holds functions (``eqx.nn.MLP``'s activation) among its arrays: the
  error for such a leaf names ``eqx.filter`` / ``eqx.combine`` (:func:`equinox_hint`); a
  function elsewhere in a tree (``jax.nn.relu``, a lambda) names what leaves functions out
  (:func:`function_hint`).
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = [
    "equinox_hint",
    "function_hint",
    "is_equinox_module",
    "is_function",
    "nested_value_error",
    "nnx_variable_type",
]


def _nnx_variable_class() -> Any:
    nnx = sys.modules.get("flax.nnx")
    return getattr(nnx, "Variable", None) if nnx is not None else None


def nnx_variable_type(x: Any) -> str | None:
    """The class name of ``x`` (``"Param"``, ``"BatchStat"``, ...) if it is an NNX
    ``Variable``, else None."""
    cls = _nnx_variable_class()
    if cls is None or not isinstance(x, cls):
        return None
    return type(x).__qualname__


def nested_value_error(variable: str, child: Any) -> str | None:
    """Why a Variable whose one child is ``child`` cannot be saved or loaded into, or None:
    a ``{"value": ...}`` dict is a target-less load merged into the model."""
    if type(child) is not dict or list(child) != ["value"]:
        return None
    return (
        f"is an NNX {variable} whose value is a {{'value': ...}} dict: a target-less "
        "quire.load was merged into the model (nnx.update(model, quire.load(url)) nests each "
        "array one level down). Restore NNX state into its abstract state instead: "
        "state = quire.load(url, nnx.state(nnx.eval_shape(make_model))); nnx.update(model, "
        "state) - see the JAX libraries page of the docs"
    )


def is_equinox_module(x: Any) -> bool:
    """Whether ``x`` is an ``equinox.Module``."""
    eqx = sys.modules.get("equinox")
    cls = getattr(eqx, "Module", None) if eqx is not None else None
    return cls is not None and isinstance(x, cls)


def iterator_hint(x: object) -> str:
    """The fix for a Grain data iterator given as a leaf (it is a checkpointable unit)."""
    if type(x).__module__.split(".")[0] != "grain":
        return ""
    return (
        "; a Grain iterator is a checkpointable unit, not a leaf: with quire-grain installed "
        "(pip install quire-grain), save it beside the state, e.g. "
        "quire.save_checkpointables(url, {'state': state, 'data': iterator})"
    )


def equinox_hint(module: str) -> str:
    """The fix for a leaf no handler saves inside the Equinox module class ``module``."""
    return (
        f"; it is a field of the Equinox module {module} (functions such as eqx.nn.MLP's "
        "activation are not state): save params = eqx.filter(model, eqx.is_array), and "
        "restore with params, static = eqx.partition(new_model, eqx.is_array); "
        "model = eqx.combine(quire.load(url, params), static)"
    )


def is_function(x: object) -> bool:
    """Whether ``x`` is a function or another callable that is no class (``jax.nn.relu``, a
    lambda, a bound method, a ``functools.partial``): code, not state."""
    return callable(x) and not isinstance(x, type)


def function_hint() -> str:
    """The fix for a function among a tree's leaves (outside an Equinox module)."""
    return (
        ": save only the arrays, e.g. eqx.filter(model, eqx.is_array) for an Equinox model, "
        "nnx.state(model) for a Flax NNX one, the params and optimizer state of a training "
        "state (flax's TrainState keeps apply_fn and tx as static fields, out of the tree); "
        "a load's target leaves them out the same way"
    )
