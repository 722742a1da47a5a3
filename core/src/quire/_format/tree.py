"""Pytree walking: JSON tree structure, key paths, and rebuilding in a target's structure.

quire records the tree as JSON node kinds and keys, never as a pickled treedef:

* ``{"kind": "dict", "keys": [...], "children": [...]}`` (``"type"`` names a custom node
  class for display only: nothing is ever imported from it),
* ``{"kind": "list" | "tuple", "children": [...]}``,
* ``{"kind": "leaf", "handler": id, ...handler metadata}``.

Dicts, lists and tuples are walked natively (empty ones survive); any other registered
JAX pytree node (namedtuples, dataclasses, flax structs) is walked one level at a time
through ``jax.tree_util`` and recorded as a dict (named children) or a list.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from quire._format import jaxlibs
from quire._format.bounds import MAX_DEPTH, MAX_TYPE_NAME
from quire.errors import UnsupportedLeafError

Key = str | int
KeyPath = tuple[Key, ...]


def keystr(path: KeyPath) -> str:
    """Human-readable key path: ``params/layer1/w`` (``<root>`` for the empty path)."""
    return "/".join(str(k) for k in path) if path else "<root>"


@dataclass
class Node:
    """One node of a walked tree, with what is needed to rebuild it."""

    kind: str  # "dict" | "list" | "tuple" | "leaf"
    keys: list[Key] = field(default_factory=list)
    children: list[Node] = field(default_factory=list)
    value: Any = None  # the leaf itself
    path: KeyPath = ()
    typename: str | None = None
    treedef: Any = None  # custom JAX node: rebuild with treedef.unflatten(children)
    variable: str | None = None  # a leaf's Flax NNX Variable class (quire._format.jaxlibs)

    def leaves(self) -> Iterator[Node]:
        if self.kind == "leaf":
            yield self
        else:
            for c in self.children:
                yield from c.leaves()

    def rebuild(self, value_of: Callable[[Node], Any]) -> Any:
        """Rebuild in this node's own structure, leaf values from ``value_of(leaf)``."""
        if self.kind == "leaf":
            return value_of(self)
        vals = [c.rebuild(value_of) for c in self.children]
        if self.treedef is not None:
            return self.treedef.unflatten(vals)
        if self.kind == "dict":
            return dict(zip(self.keys, vals))
        if self.kind == "tuple":
            return tuple(vals)
        return vals


def _jax_key(k: Any) -> Key:
    import jax  # heavy; a key of a JAX pytree node means JAX is imported already

    tu = jax.tree_util
    if isinstance(k, tu.DictKey):
        return k.key if isinstance(k.key, str | int) else str(k.key)
    if isinstance(k, tu.GetAttrKey):
        return k.name
    if isinstance(k, tu.SequenceKey):
        return k.idx
    if isinstance(k, tu.FlattenedIndexKey):
        return k.key
    return str(k)


def walk(tree: Any, is_leaf: Callable[[Any], bool], *, what: str = "tree") -> Node:
    """Walk ``tree``; ``is_leaf`` says which values are leaves (checked before containers).

    A tree nested deeper than ``MAX_DEPTH`` is refused (``UnsupportedLeafError``): its
    record would be refused by every load.

    A leaf under a Flax NNX ``Variable`` gets the Variable's class name (``Node.variable``);
    a Variable holding a ``{"value": ...}`` dict, and an Equinox module's field that is no
    leaf, raise :class:`~quire.errors.UnsupportedLeafError` naming the fix
    (:mod:`quire._format.jaxlibs`).
    """

    def go(x: Any, path: KeyPath, variable: str | None, module: str | None) -> Node:
        if is_leaf(x):
            return Node("leaf", value=x, path=path, variable=variable)
        if len(path) >= MAX_DEPTH:
            raise UnsupportedLeafError(
                f"{what}: the tree is nested deeper than {MAX_DEPTH} levels at "
                f"{keystr(path[:8])}/... ; quire saves trees of at most {MAX_DEPTH} levels "
                "(flatten the deepest part into a list or a dict with joined keys)"
            )
        if type(x) is dict:
            keys = list(x)
            for k in keys:
                if not (isinstance(k, str) or type(k) is int):
                    raise UnsupportedLeafError(
                        f"{what}: dict key {k!r} at {keystr(path)!r} is a {type(k).__name__}; "
                        "quire saves dicts with str or int keys only (convert the key)"
                    )
            kids = [go(x[k], (*path, k), variable, module) for k in keys]
            return Node("dict", keys, kids, path=path)
        if type(x) in (list, tuple):
            kids = [go(v, (*path, i), variable, module) for i, v in enumerate(x)]
            return Node(
                "list" if type(x) is list else "tuple", list(range(len(x))), kids, path=path
            )
        # Any other registered JAX pytree node, one level at a time.
        import jax  # heavy: reading a record (``from_json``) never needs it

        kids_with_keys, treedef = jax.tree_util.tree_flatten_with_path(
            x, is_leaf=lambda c: c is not x
        )
        name = f"{type(x).__module__}.{type(x).__qualname__}"
        opaque = treedef.num_nodes == 1 and treedef.num_leaves == 1  # type: ignore[attr-defined]
        if opaque and jaxlibs.is_function(x):
            raise UnsupportedLeafError(
                f"{what}: leaf at {keystr(path)!r} is a function ({name}); functions are not "
                "state, leave them out of the tree"
                + (jaxlibs.equinox_hint(module) if module else jaxlibs.function_hint())
            )
        if opaque:
            raise UnsupportedLeafError(
                f"{what}: leaf at {keystr(path)!r} has type {name}, which no installed leaf "
                "handler saves; convert it to an array or scalar, register it as a JAX pytree "
                "node, or register a quire leaf handler for it"
                + (jaxlibs.equinox_hint(module) if module else jaxlibs.iterator_hint(x))
            )
        var = jaxlibs.nnx_variable_type(x)
        if var is not None and len(kids_with_keys) == 1:
            why = jaxlibs.nested_value_error(var, kids_with_keys[0][1])
            if why:
                raise UnsupportedLeafError(f"{what}: {keystr(path)!r} {why}")
        if jaxlibs.is_equinox_module(x):
            module = type(x).__qualname__
        keys = [_jax_key(kp[-1]) if kp else i for i, (kp, _) in enumerate(kids_with_keys)]
        # named children only when the names are distinct strings (keys turned into strings
        # may collide: 1.0 and "1.0"); else by position
        named = keys and all(isinstance(k, str) for k in keys) and len(set(keys)) == len(keys)
        kind = "dict" if named else "list"
        if kind == "list":
            keys = list(range(len(keys)))
        kids = [
            go(v, (*path, k), var or variable, module) for k, (_, v) in zip(keys, kids_with_keys)
        ]
        name = f"{type(x).__module__}.{type(x).__qualname__}"[:MAX_TYPE_NAME]
        return Node(kind, keys, kids, path=path, typename=name, treedef=treedef)

    return go(tree, (), None, None)


def to_json(node: Node, leaf_record: Callable[[Node], dict[str, Any]]) -> dict[str, Any]:
    """The JSON form of a walked tree; leaf records come from ``leaf_record``."""
    if node.kind == "leaf":
        rec = {"kind": "leaf", **leaf_record(node)}
        if node.variable is not None:
            rec["variable"] = node.variable
        return rec
    out: dict[str, Any] = {"kind": node.kind}
    if node.kind == "dict":
        out["keys"] = list(node.keys)
    if node.typename:
        out["type"] = node.typename
    out["children"] = [to_json(c, leaf_record) for c in node.children]
    return out


def from_json(doc: Any, path: KeyPath = ()) -> Node:
    """Parse a JSON tree (validated by the format module) back into nodes (no treedefs)."""
    kind = doc["kind"]
    if kind == "leaf":
        return Node("leaf", value=doc, path=path)
    children = doc["children"]
    keys: list[Key] = list(doc["keys"]) if kind == "dict" else list(range(len(children)))
    kids = [from_json(c, (*path, k)) for k, c in zip(keys, children)]
    return Node(kind, keys, kids, path=path, typename=doc.get("type"))
