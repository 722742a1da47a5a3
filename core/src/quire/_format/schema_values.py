"""The typed readers the commit-record schema (:mod:`quire._format.schema`) checks each value
with: each raises :class:`Invalid` naming the value's place in the record."""

from __future__ import annotations

import datetime
from typing import Any

from quire._format.bounds import MAX_TIMESTAMP


class Invalid(Exception):
    """Raised by a checker: ``where`` is the key path inside the record."""

    def __init__(self, where: str, why: str) -> None:
        super().__init__(f"{where}: {why}")
        self.where, self.why = where, why


def _req(obj: dict[str, Any], key: str, where: str) -> Any:
    if key not in obj:
        raise Invalid(where, f"required field {key!r} is missing")
    return obj[key]


def _is_int(v: Any) -> bool:
    return type(v) is int


def _int(v: Any, where: str, low: int = 0, high: int | None = None) -> int:
    if not _is_int(v) or v < low or (high is not None and v > high):
        rng = f">= {low}" + ("" if high is None else f" and <= {high}")
        raise Invalid(where, f"{_short(v)} is not an integer {rng}")
    return int(v)


def _str(v: Any, where: str, maxlen: int | None = 10_000) -> str:
    """A string, of at most ``maxlen`` characters unless ``maxlen`` is None."""
    if type(v) is not str:
        raise Invalid(where, f"{_short(v)} is not a string")
    if maxlen is not None and len(v) > maxlen:
        raise Invalid(where, f"{_short(v)} is not a string of at most {maxlen} characters")
    return v


def _dict(v: Any, where: str) -> dict[str, Any]:
    if type(v) is not dict:
        raise Invalid(where, f"{_short(v)} is not an object")
    return v


def _list(v: Any, where: str, maxlen: int | None = None) -> list[Any]:
    if type(v) is not list or (maxlen is not None and len(v) > maxlen):
        limit = "" if maxlen is None else f" of at most {maxlen} entries"
        raise Invalid(where, f"{_short(v)} is not a list{limit}")
    return v


def _short(v: Any) -> str:
    s = repr(v) if not isinstance(v, int) or abs(v) < 10**30 else f"<{v.bit_length()}-bit integer>"
    return s if len(s) <= 80 else s[:77] + "..."


def _timestamp(v: Any, where: str) -> None:
    try:
        datetime.datetime.fromisoformat(_str(v, where, MAX_TIMESTAMP))
    except ValueError:
        raise Invalid(where, f"{_short(v)} is not an ISO timestamp") from None
