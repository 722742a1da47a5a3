"""Meshes: a sharding's JSON form, the sharding a load rebuilds, and abstract-mesh targets.

A ``named`` sharding is recorded with its mesh's axis names and sizes, its spec, and (since
issue 31) the mesh's axis types (``Auto`` / ``Explicit`` / ``Manual``).  A load without a
target, or with a target that names no sharding, rebuilds that mesh over this process's
devices with the recorded axis types, so a jitted ``x @ w`` under
``jax.set_mesh(explicit_mesh)`` sees Explicit axes, as it did before the save.

``jax.make_mesh`` makes Explicit axes, and ``jax.eval_shape`` / ``nnx.eval_shape`` of a state
sharded on such a mesh give ``NamedSharding(AbstractMesh)`` targets: axis names, sizes and
types, but no devices to place anything on.  :class:`Placer` makes each such target
concrete, in this order:

1. the mesh in context (``with jax.set_mesh(mesh):`` around the load; JAX keeps it per
   thread, so :func:`quire._runtime.ioloop.submit` carries the caller's over to quire's
   loop) when its axis names and sizes are the target's;
2. else a mesh the checkpoint was saved on (any of its leaves', or of the leaves a transform
   reads), when its axis names and sizes are the target's and this machine has that many
   devices: the mesh ``jax.make_mesh`` builds over them (the record keeps no device order);
3. else nothing: the caller reports the leaf as mismatched, naming the fix.

The target's axis types win (its spec was written for them); its spec and memory kind
are kept.  One abstract mesh becomes one concrete mesh for the whole load, so the leaves of
one target stay on one mesh.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding

from quire._format.schema import AXIS_TYPES
from quire._runtime.ioloop import caller_mesh

__all__ = ["Placer", "is_abstract", "saved_sharding", "sharding_json"]


def sharding_json(s: Any) -> dict[str, Any] | None:
    """The JSON record of sharding ``s`` (``named``: mesh axes, sizes, types and spec)."""
    if isinstance(s, NamedSharding):
        # axis names as strings on both sides (JAX takes any hashable name)
        spec = [
            None if p is None else [str(a) for a in p] if isinstance(p, tuple) else str(p)
            for p in s.spec
        ]
        return {
            "type": "named",
            "mesh": {str(k): int(v) for k, v in s.mesh.shape.items()},
            "spec": spec,
            "axis_types": [t.name for t in s.mesh.axis_types],
        }
    if isinstance(s, jax.sharding.SingleDeviceSharding):
        return {"type": "single"}
    return {"type": type(s).__name__}


def _axis_types(s: Mapping[str, Any], n: int) -> tuple[AxisType, ...]:
    """The recorded axis types (the schema checked them); Auto where a record predates them."""
    names = s.get("axis_types")
    if not isinstance(names, list) or len(names) != n or not set(names) <= set(AXIS_TYPES):
        return (AxisType.Auto,) * n
    return tuple(AxisType[t] for t in names)


def saved_sharding(rec: Mapping[str, Any]) -> Any:
    """The sharding a leaf loads with when its target names none: the saved named mesh
    (its axis types included) over this process's devices where it has that many, else
    the first local device."""
    s = rec.get("sharding") or {}
    if s.get("type") == "named" and jax.process_count() == 1:
        mesh_shape = s.get("mesh") or {}
        sizes = [int(v) for v in mesh_shape.values()]
        if math.prod(sizes) == jax.device_count():
            devs = np.array(jax.devices()).reshape(sizes)
            mesh = Mesh(devs, tuple(mesh_shape), axis_types=_axis_types(s, len(sizes)))
            spec = [tuple(p) if isinstance(p, list) else p for p in s.get("spec", [])]
            return NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))
    return jax.sharding.SingleDeviceSharding(jax.local_devices()[0])


def is_abstract(sharding: Any) -> bool:
    """Whether ``sharding`` is a ``NamedSharding`` on an ``AbstractMesh`` (no devices)."""
    return isinstance(sharding, NamedSharding) and isinstance(sharding.mesh, AbstractMesh)


def _axes(mesh: Any) -> tuple[tuple[str, int], ...]:
    return tuple(zip(map(str, mesh.axis_names), map(int, mesh.axis_sizes)))


def _describe(axes: Iterable[tuple[str, int]]) -> str:
    return "(" + ", ".join(f"{k!r}: {v}" for k, v in axes) + ")"


@functools.lru_cache(maxsize=64)
def _made_mesh(axes: tuple[tuple[str, int], ...], types: tuple[AxisType, ...]) -> Mesh:
    return jax.make_mesh(tuple(v for _, v in axes), tuple(k for k, _ in axes), axis_types=types)


class Placer:
    """Makes targets on an abstract mesh concrete, for one load (see the module docstring).

    Create it where the load runs (on quire's loop or in the caller's thread): it reads the
    mesh in context then.  One abstract mesh becomes one concrete mesh for the whole load.

    Parameters
    ----------
    saved : iterable of dict or None
        The sharding records of the checkpoint's leaves (of the leaves a transform reads).
    """

    def __init__(self, saved: Iterable[Mapping[str, Any] | None] = ()) -> None:
        ctx = caller_mesh()
        self.context = ctx if ctx is not None and not ctx.empty else None
        self.saved = {
            tuple((str(k), v) for k, v in (rec.get("mesh") or {}).items())
            for rec in saved
            if isinstance(rec, Mapping) and rec.get("type") == "named"
        }
        self._meshes: dict[Any, Mesh | None] = {}

    def sharding(self, s: Any) -> tuple[Any, str | None]:
        """``(concrete sharding, None)`` for ``s``, or ``(s, why not)``; ``s`` unchanged
        when it is not on an abstract mesh.

        Parameters
        ----------
        s : jax.sharding.Sharding
            The target's sharding.
        """
        if not is_abstract(s):
            return s, None
        am = s.mesh
        key = (_axes(am), tuple(am.axis_types))
        if key not in self._meshes:
            self._meshes[key] = self._concrete(*key)
        mesh = self._meshes[key]
        if mesh is None:
            return s, self._why(key[0])
        return NamedSharding(mesh, s.spec, memory_kind=s.memory_kind), None

    def target(self, t: Any) -> tuple[Any, str | None]:
        """``t`` with its sharding made concrete (a ``jax.ShapeDtypeStruct`` on an abstract
        mesh), else ``t`` itself; the reason when it cannot be."""
        s = getattr(t, "sharding", None)
        if not isinstance(t, jax.ShapeDtypeStruct) or not is_abstract(s):
            return t, None
        got, why = self.sharding(s)
        return (t, why) if why else (t.update(sharding=got), None)

    def _concrete(self, axes: tuple[tuple[str, int], ...], types: tuple[Any, ...]) -> Mesh | None:
        ctx = self.context
        if ctx is not None and _axes(ctx) == axes:
            if tuple(ctx.axis_types) == types:
                return ctx
            return Mesh(ctx.devices, tuple(ctx.axis_names), axis_types=types)
        if axes in self.saved and math.prod(v for _, v in axes) == jax.device_count():
            return _made_mesh(axes, types)
        return None

    def _why(self, axes: tuple[tuple[str, int], ...]) -> str:
        ctx = _describe(_axes(self.context)) if self.context is not None else "none"
        saved = ", ".join(sorted(_describe(a) for a in self.saved)) or "none"
        return (
            f"its sharding is on an abstract mesh {_describe(axes)} (from jax.eval_shape / "
            f"nnx.eval_shape), which has no devices, and neither the mesh in context ({ctx}) "
            f"nor a saved mesh ({saved}; {jax.device_count()} devices here) matches it: load "
            "inside `with jax.set_mesh(mesh):` with the mesh the target was made for, or give "
            "the leaf a NamedSharding on a concrete mesh"
        )
