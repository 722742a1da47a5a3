"""The built-in ``json`` checkpointable handler: plain JSON configs, inline in ``quire.json``."""

from __future__ import annotations

import copy
import math
from typing import Any

from quire._handlers.units import UnitIO


def is_json_config(obj: Any, depth: int = 0) -> bool:
    """Plain JSON data: dicts with str keys, lists, str, int, finite float, bool, None."""
    if depth > 64:
        return False
    if obj is None or type(obj) in (str, int, bool):
        return True
    if type(obj) is float:
        return math.isfinite(obj)
    if type(obj) is list:
        return all(is_json_config(v, depth + 1) for v in obj)
    if type(obj) is dict:
        return all(type(k) is str and is_json_config(v, depth + 1) for k, v in obj.items())
    return False


class JsonHandler:
    """Plain JSON configs, stored inline in ``quire.json`` (readable, no extra objects).

    Only non-empty dicts whose values are all JSON data are taken by this handler; a dict
    with array leaves is a pytree unit.
    """

    id = "json"
    inline = True

    def handles(self, obj: Any) -> bool:
        """Whether ``obj`` is a non-empty dict of plain JSON data.

        Parameters
        ----------
        obj : Any
            A unit's value.
        """
        return type(obj) is dict and bool(obj) and is_json_config(obj)

    def snapshot(self, obj: Any) -> Any:
        """A copy for an async save (plain JSON data always deep-copies).

        Parameters
        ----------
        obj : dict
            The unit's value at the call.
        """
        return copy.deepcopy(obj)

    def save(self, obj: Any, io: UnitIO) -> Any:
        """The record is the config itself (inline in ``quire.json``; ``io`` is unused).

        Parameters
        ----------
        obj : dict
            The config.
        io : UnitIO
            The unit's byte access (not used: nothing is written beside the record).
        """
        return obj

    def load(self, io: UnitIO, record: Any, target: Any) -> Any:
        """The config, from its record.

        Parameters
        ----------
        io : UnitIO
            The unit's byte access (not used).
        record : dict
            What :meth:`save` returned.
        target : Any
            The unit's target (not used: a config comes back as saved).
        """
        return record
