"""Pairing a saved tree with the load target: strict by default, empty nodes matched to empty
nodes, the casts the target asks for checked, and each kind of mismatch named with its fix.

Both loads use it: ``quire.load`` pairs the saved records (``quire._engine.load``), and a
load through a source or a transform pairs the lazy values (``quire._sources.materialize``).

Empty nodes hold no data: None, and containers with no children (``()``, ``[]``, ``{}``,
optax's ``EmptyState()``, any registered pytree node with no leaves).  Orbax stores
``EmptyState()`` as None, so a None on one side matches any empty node (or a subtree of
them) at the same key path on the other, or under an empty node there, and the result has
the target's structure (the ``EmptyState()`` of ``jax.eval_shape(tx.init, params)`` comes
back as itself).  A None in the target is "as saved" where the checkpoint holds a leaf.
Everything else is as strict as before: a leaf (None included) on one side only is a
mismatch, and an empty container on one side only is left alone (a partial save's delete
leaves one; it holds nothing to lose or to miss).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from quire._format.tree import KeyPath, Node, keystr, walk
from quire._handlers import casting as _casting
from quire._handlers import select as _selection
from quire.errors import LossyCastError, TreeMismatchError

__all__ = ["Pairing", "pair_with_target"]


def _is_abstract_leaf(x: Any) -> bool:
    if x is None or isinstance(x, type):
        return True
    if isinstance(x, jax.ShapeDtypeStruct | jax.Array | np.ndarray | np.generic):
        return True
    if type(x) in (bool, int, float, complex, str, bytes):
        return True
    return _selection.for_value(x) is not None


@dataclass
class Pairing:
    """What :func:`pair_with_target` found: the walked target, each target leaf with the
    saved value at its key path, the target leaves that load as None, and each leaf's casting.

    Attributes
    ----------
    root : Node
        The walked target (its structure is the result's).
    pairs : list of (Node, Any, Any)
        (target leaf, saved record or value, target) for every leaf to load.
    empty : list of Node
        Target None leaves over an empty node of the checkpoint: they load as None.
    castings : dict
        ``id(target leaf)`` -> its casting (``"same_kind"`` where not given).
    """

    root: Node
    pairs: list[tuple[Node, Any, Any]]
    empty: list[Node] = field(default_factory=list)
    castings: dict[int, str] = field(default_factory=dict)

    def casting(self, node: Node) -> str:
        """The casting of target leaf ``node``."""
        return self.castings.get(id(node), _casting.DEFAULT)

    def rebuild(self, values: Mapping[int, Any]) -> Any:
        """The target's structure with ``values[id(leaf)]`` at each paired leaf."""
        none = {id(n) for n in self.empty}
        return self.root.rebuild(lambda n: None if id(n) in none else values[id(n)])


@dataclass
class _Shape:
    """One side's key paths: every node's, the hollow ones' (no data below: only empty
    nodes), and the empty nodes' own (None leaves, containers with no children)."""

    paths: set[KeyPath]
    hollow: set[KeyPath]
    empties: set[KeyPath]

    @classmethod
    def of(cls, root: Node, is_empty: Callable[[Any], bool]) -> _Shape:
        out = cls(set(), set(), set())

        def go(n: Node) -> bool:
            out.paths.add(n.path)
            # (a list, not a generator: every child is walked)
            hollow = is_empty(n.value) if n.kind == "leaf" else all([go(c) for c in n.children])
            if hollow and (n.kind == "leaf" or not n.children):
                out.empties.add(n.path)
            if hollow:
                out.hollow.add(n.path)
            return hollow

        go(root)
        return out

    def under_empty(self, path: KeyPath) -> bool:
        """Whether an empty node of this side sits above ``path``."""
        return any(path[:i] in self.empties for i in range(len(path)))


def sharding_misfit(sharding: Any, shape: Any) -> str | None:
    """Why an array of ``shape`` cannot take ``sharding`` (an axis split into a number of
    parts that does not divide it), or None (also for no sharding or no shape)."""
    if sharding is None or shape is None or not hasattr(sharding, "shard_shape"):
        return None
    try:
        sharding.shard_shape(tuple(shape))
    except ValueError as e:  # jax's IndivisibleError
        return (
            f"target shape {tuple(shape)}: its sharding does not divide it ({e}); give this "
            "leaf a sharding whose mesh axes divide each axis they split, or replicate it"
        )
    return None


def refuse_misfits(subject: str, bad: list[str], transform: bool = False) -> None:
    """A :class:`TreeMismatchError` for the leaves ``bad`` (``'key': why``), if any."""
    if bad:
        raise TreeMismatchError(
            _diff_message(subject, [], [], bad, transform), missing=[], extra=[], mismatched=bad
        )


def pair_with_target(
    saved: Node,
    abstract: Any,
    *,
    partial: bool,
    check: Callable[[Node, Any], str | None],
    subject: str,
    is_empty: Callable[[Any], bool],
    casting: _casting.CastingSpec = None,
    dtype_of: Callable[[Any], np.dtype[Any] | None] | None = None,
    transform: bool = False,
) -> Pairing:
    """Pair each leaf of ``abstract`` with the value at its key path in ``saved`` (a saved
    tree's records, or a transform's values).

    Strict: a leaf of ``saved`` missing from the target (unless ``partial``), a leaf of the
    target missing from ``saved``, and every pair ``check`` objects to (it returns why) are
    reported together in one :class:`~quire.errors.TreeMismatchError` about ``subject``;
    a None (``is_empty`` says which saved leaves are) matches empty nodes.  Then each
    pair whose cast (``dtype_of`` the saved value to the target's dtype) its ``casting``
    refuses is reported, all of them, in one :class:`~quire.errors.LossyCastError`.
    ``transform``: ``saved`` is a transform's result (the fixes the message names differ).
    """
    root = walk(abstract, _is_abstract_leaf, what="abstract tree")
    leaves = {n.path: n.value for n in saved.leaves()}
    tleaves = list(root.leaves())
    tpaths = {t.path for t in tleaves}
    shapes: dict[str, _Shape] = {}  # each side's, made when a None has no leaf to pair with

    def covered(path: KeyPath, side: str, hollow: bool) -> bool:
        """A None at ``path`` on one side has its match on the other (``side``): a node
        there (``hollow``: one with no data), or an empty node above it."""
        if side not in shapes:
            both = {"saved": (saved, is_empty), "target": (root, lambda v: v is None)}
            shapes[side] = _Shape.of(*both[side])
        other = shapes[side]
        here = path in other.hollow if hollow else path in other.paths
        return here or other.under_empty(path)

    missing = [
        keystr(p)
        for p, v in leaves.items()
        if not partial
        and p not in tpaths
        and not (is_empty(v) and covered(p, "target", hollow=False))
    ]
    extra: list[str] = []
    pairs: list[tuple[Node, Any, Any]] = []
    empty: list[Node] = []
    for n in tleaves:
        if n.path in leaves:
            pairs.append((n, leaves[n.path], n.value))
        elif n.value is None and covered(n.path, "saved", hollow=True):
            empty.append(n)
        else:
            extra.append(keystr(n.path))
    bad = [f"{keystr(t.path)!r}: {why}" for t, v, _ in pairs if (why := check(t, v))]
    if missing or extra or bad:
        raise TreeMismatchError(
            _diff_message(subject, missing, extra, bad, transform),
            missing=missing,
            extra=extra,
            mismatched=bad,
        )
    out = Pairing(root, pairs, empty)
    if casting is None and dtype_of is None:
        return out
    refused: list[tuple[KeyPath, Any, Any, str]] = []
    for t, v, target in pairs:
        c = _casting.casting_for(casting, t.path, t.value)
        out.castings[id(t)] = c
        src = dtype_of(v) if dtype_of is not None else None
        dst = _casting.target_dtype(target)
        if src is not None and dst is not None and _casting.lossy(src, dst, c):
            refused.append((t.path, src, dst, c))
    if refused:
        raise LossyCastError(
            _cast_message(subject, refused),
            mismatched=[f"{keystr(p)!r}: {_casting.refusal(s, d, c)}" for p, s, d, c in refused],
        )
    return out


def _cast_message(subject: str, lossy: list[tuple[KeyPath, Any, Any, str]]) -> str:
    lines = [f"{subject}: the target asks for casts that lose information ({len(lossy)}):"]
    lines += [f"  {keystr(p)!r}: {_casting.refusal(s, d, c)}" for p, s, d, c in lossy]
    _, src, _, _ = lossy[0]
    lines.append(f"  To fix: {_casting.allow_hint(src)}.")
    return "\n".join(lines)


def _diff_message(
    subject: str, missing: list[str], extra: list[str], bad: list[str], transform: bool
) -> str:
    lines = [f"{subject} does not match the target tree:"]
    fixes = []
    if missing:
        lines.append(
            f"  in the checkpoint, missing from the target ({len(missing)}): " + ", ".join(missing)
        )
        fixes.append(
            "for keys only in the checkpoint: pass partial=True to load the target's keys only"
            + (" (or leave them out of the transform's result)" if transform else "")
        )
    if extra:
        lines.append(
            f"  in the target, missing from the checkpoint ({len(extra)}): " + ", ".join(extra)
        )
        if transform:
            fixes.append(
                "for keys only in the target: return them from the transform (a freshly "
                "initialised array for a new layer), or leave them out of the target"
            )
        else:
            fixes.append(
                "for keys only in the target (a layer added since the save?): give them "
                "fresh values with transform=, e.g. quire.load(url, target, transform=lambda "
                "saved: {**saved, 'new_layer': fresh_params}) (see 'Sources and model surgery' "
                "in the docs), or load a target without them and add them after loading"
            )
    if bad:
        lines.append(f"  mismatched ({len(bad)}): " + "; ".join(bad))
        fixes.append(
            "for mismatched keys: build the target with the saved shapes and dtypes listed "
            "(quire.metadata(url).tree describes every saved leaf), or reshape / slice the saved "
            "arrays into the target's with transform= (see 'Sources and model surgery')"
            if not transform
            else "for mismatched keys: return the target's shapes from the transform "
            "(slices, quire.surgery.reshape / transpose), or change the target"
        )
    lines.append("  To fix: " + "; ".join(fixes) + ".")
    nnx = _nnx_hint(missing, extra)
    if nnx:
        lines.append(f"  {nnx}")
    return "\n".join(lines)


def _nnx_hint(missing: list[str], extra: list[str]) -> str | None:
    """The likely cause when the two sides differ by Flax NNX's ``/value`` level."""
    if {f"{p}/value" for p in extra} & set(missing):
        return (
            "The checkpoint holds Flax NNX Variables (key paths end in /value) and the target "
            "a pure dict: load into nnx.state(nnx.eval_shape(make_model)) instead."
        )
    if {f"{p}/value" for p in missing} & set(extra):
        return (
            "The checkpoint holds a pure dict (nnx.to_pure_dict) and the target Flax NNX "
            "Variables: load it into nnx.to_pure_dict(abstract_state), then "
            "nnx.replace_by_pure_dict(abstract_state, loaded)."
        )
    return None
