"""Model surgery: lazy operations and tree helpers for ``quire.load(..., transform=fn)``.

Lazy operations (``stack``, ``concatenate``, ``transpose``, ``reshape``, ``astype``) take
:class:`quire.sources.LazyArray` values (a source's arrays, slices of them, results of other lazy
operations) or concrete arrays, and return a :class:`quire.sources.LazyArray`: nothing is read until
it is read or quire materialises it, and then each device shard reads only the regions of
the inputs it needs.

Tree helpers work on any nested dict / list / tuple tree (lazy or concrete leaves):
:func:`rename`, :func:`flatten`, :func:`unflatten`, :func:`stack_layers`,
:func:`split_layers` and :func:`torch_linear`.
"""

from __future__ import annotations

from quire._sources.lazy import LazyArray, LazyValue
from quire._sources.partition import PartitionRules, partition_rules
from quire._sources.surgery import (
    astype,
    concatenate,
    flatten,
    rename,
    reshape,
    split_layers,
    stack,
    stack_layers,
    torch_linear,
    transpose,
    unflatten,
)

__all__ = [
    "LazyArray",
    "LazyValue",
    "PartitionRules",
    "astype",
    "concatenate",
    "flatten",
    "partition_rules",
    "rename",
    "reshape",
    "split_layers",
    "stack",
    "stack_layers",
    "torch_linear",
    "transpose",
    "unflatten",
]
