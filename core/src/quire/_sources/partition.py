"""Partition rules: regexes over "/"-joined key paths → shardings on a mesh."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

import jax

from quire._format.tree import keystr, walk
from quire.errors import TreeMismatchError

__all__ = ["PartitionRules", "partition_rules", "sharding_for"]


class PartitionRules:
    """Ordered ``(regex, PartitionSpec)`` rules on a mesh; build with :func:`partition_rules`.

    Parameters
    ----------
    rules : sequence of (str, PartitionSpec)
        ``(regex, spec)`` pairs, in order; the first whose regex ``re.search``-es a leaf's
        ``"/"``-joined key path gives its spec (a tuple or list is taken as a spec).
    mesh : jax.sharding.Mesh
        The mesh the specs name axes of.
    """

    def __init__(self, rules: Sequence[tuple[str, Any]], mesh: Any) -> None:
        self.rules = [(re.compile(p), _spec(s)) for p, s in rules]
        self.mesh = mesh
        self._shardings: dict[Any, Any] = {}

    def spec_for(self, path: str, shape: Sequence[int]) -> Any:
        """The PartitionSpec for the leaf at ``path`` (``"/"``-joined) of ``shape``.

        Parameters
        ----------
        path : str
            The leaf's ``"/"``-joined key path.
        shape : sequence of int
            The leaf's shape (0-d leaves replicate).

        Raises
        ------
        TreeMismatchError
            No rule matches ``path``, or the spec does not divide ``shape``.
        """
        P = jax.sharding.PartitionSpec
        if len(shape) == 0:
            return P()
        for pat, spec in self.rules:
            if pat.search(path):
                self._check(path, tuple(shape), spec, pat.pattern)
                return spec
        raise TreeMismatchError(
            f"partition rules: no rule matches leaf {path!r} (shape {tuple(shape)}); add a rule "
            "for it or a catch-all such as ('.*', PartitionSpec()) as the last rule",
            extra=[path],
        )

    def sharding_for(self, path: str, shape: Sequence[int]) -> Any:
        """The ``NamedSharding`` on :attr:`mesh` for the leaf at ``path`` of ``shape``.

        Parameters
        ----------
        path, shape
            As for :meth:`spec_for`.

        Raises
        ------
        TreeMismatchError
            As for :meth:`spec_for`.
        """
        spec = self.spec_for(path, shape)
        out = self._shardings.get(spec)
        if out is None:  # one NamedSharding per spec: leaves share it (and JAX's caches)
            out = self._shardings[spec] = jax.sharding.NamedSharding(self.mesh, spec)
        return out

    def _check(self, path: str, shape: tuple[int, ...], spec: Any, pattern: str) -> None:
        if len(spec) > len(shape):
            raise TreeMismatchError(
                f"partition rules: leaf {path!r} has shape {shape} but rule {pattern!r} gives "
                f"{spec}, with more entries than axes; fix the rule",
                mismatched=[path],
            )
        sizes = dict(zip(self.mesh.axis_names, self.mesh.devices.shape))
        for d, entry in enumerate(spec):
            if entry is None:
                continue
            names = entry if isinstance(entry, tuple) else (entry,)
            unknown = [n for n in names if n not in sizes]
            if unknown:
                raise TreeMismatchError(
                    f"partition rules: rule {pattern!r} for leaf {path!r} names mesh axis "
                    f"{unknown[0]!r}; the mesh has {tuple(sizes)}",
                    mismatched=[path],
                )
            n = math.prod(sizes[a] for a in names)
            if shape[d] % n:
                raise TreeMismatchError(
                    f"partition rules: leaf {path!r} has shape {shape}; spec {spec} (rule "
                    f"{pattern!r}) splits axis {d} of size {shape[d]} into {n} parts, which does "
                    "not divide it; change the rule or the mesh",
                    mismatched=[path],
                )

    def apply(self, tree: Any) -> Any:
        """A tree of NamedShardings for a tree of shaped leaves (arrays, ShapeDtypeStructs...).

        Parameters
        ----------
        tree : pytree
            Leaves with a ``shape`` (arrays, ``jax.ShapeDtypeStruct``, lazy arrays).

        Returns
        -------
        pytree
            The same structure with a ``NamedSharding`` at each leaf.
        """
        root = walk(tree, lambda x: hasattr(x, "shape"), what="tree")
        return root.rebuild(lambda n: self.sharding_for(keystr(n.path), n.value.shape))

    def __repr__(self) -> str:
        rules = ", ".join(f"({p.pattern!r}, {s})" for p, s in self.rules)
        return f"partition_rules([{rules}], mesh={dict(self.mesh.shape)})"


def _spec(s: Any) -> Any:
    P = jax.sharding.PartitionSpec
    if isinstance(s, P):
        return s
    if s is None:
        return P()
    return P(*s)


def partition_rules(rules: Sequence[tuple[str, Any]], mesh: Any) -> PartitionRules:
    """Shardings by rule: ``[(regex, PartitionSpec), ...]`` matched (``re.search``) against each
    leaf's ``"/"``-joined key path, first match wins; 0-d leaves replicate.

    Pass the result as ``shardings=`` to :func:`quire.load`
    or ``Checkpointer.load``.

    Parameters
    ----------
    rules, mesh
        As for :class:`PartitionRules`.

    Returns
    -------
    PartitionRules
    """
    return PartitionRules(rules, mesh)


def sharding_for(shardings: Any, path: tuple[Any, ...], shape: Sequence[int]) -> Any:
    """The sharding for one leaf from ``shardings`` (rules, a single Sharding, or a lookup
    table ``{key path: sharding}`` made by :func:`sharding_table`)."""
    if shardings is None:
        return None
    if isinstance(shardings, PartitionRules):
        return shardings.sharding_for(keystr(path), shape)
    if isinstance(shardings, jax.sharding.Sharding):
        return shardings
    if isinstance(shardings, dict) and "__table__" in shardings:
        return shardings["__table__"].get(path)
    raise TypeError(f"shardings must be partition rules, a Sharding or a tree, not {shardings!r}")


def sharding_table(shardings: Any) -> Any:
    """Normalise ``shardings=``: rules / a Sharding / None pass through; a tree becomes a table."""
    if shardings is None or isinstance(shardings, PartitionRules | jax.sharding.Sharding):
        return shardings
    root = walk(
        shardings, lambda x: x is None or isinstance(x, jax.sharding.Sharding), what="shardings"
    )
    return {"__table__": {n.path: n.value for n in root.leaves()}}
