"""Validation of commit records (``quire.json``) and journal records before anything acts on them.

A record's checksum only proves that it was not damaged by accident: anyone can write a
record and sign it.  So every value a record holds is checked here, once, against what
quire itself writes, before numpy, jax, zarr or the operating system sees it; a defect
is a :class:`~quire.errors.CorruptCheckpointError` that names the record's URL and the
key path of the offending value.

Why a hand-written validator rather than pydantic or msgspec: most of the rules are not
about types but about consistency between values (an int8 scalar within int8's range; a
mesh that divides the shape it shards; a location under one of the record's own txids
and inside no other array's directory; a chunk grid no larger than the mesh that made
it); a schema library would need a custom validator for each of them anyway, would add a
runtime dependency to the core, and would turn its own error paths into ours.  The rules
live in small tables, so a new field or leaf kind is one entry:

* :data:`LEAF_RULES` maps a leaf handler id to its checker; leaves of third-party
  handlers get the common checks only (they validate their own records).
* :data:`COMMIT_FIELDS` / :data:`JOURNAL_FIELDS` map a top-level field to its checker;
  fields not listed are tolerated (they are covered by the checksum and nothing acts on
  them), so a newer writer may add fields a v1 reader ignores.
"""

from __future__ import annotations

import base64
import binascii
import math
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

from quire._format.bounds import (
    MAX_CHUNKS,
    MAX_CLAIMED_BYTES,
    MAX_COMPONENT,
    MAX_DEPTH,
    MAX_DIM,
    MAX_LOCATION,
    MAX_MESH_DEVICES,
    MAX_NDIM,
    MAX_PROCESSES,
    MAX_TYPE_NAME,
    is_distribution_name,
    max_chunks,
    prng_impls,
)
from quire._format.codecrecord import check as check_codecs
from quire._format.dtypes import ITEMSIZES, supported
from quire._format.paths import is_safe_location
from quire._format.schema_values import (
    Invalid,
    _dict,
    _int,
    _list,
    _req,
    _short,
    _str,
    _timestamp,
)
from quire.errors import CorruptCheckpointError

# Every bound is in quire._format.bounds, with the reason it is out of the writers' reach.
_TXID = re.compile(r"^[A-Za-z0-9]{1,64}$")
#: A mesh axis's type, as ``jax.sharding.AxisType`` names it.
AXIS_TYPES = ("Auto", "Explicit", "Manual")


# ------------------------------------------------------------------------------ scalars
def _finite_or_named(v: Any, where: str) -> float:
    """A JSON float (or int) or one of "nan" / "inf" / "-inf", as a Python float."""
    if type(v) is str:
        if v not in ("nan", "inf", "-inf"):
            raise Invalid(where, f"{_short(v)} is not a number")
        return float(v)
    if type(v) not in (int, float):
        raise Invalid(where, f"{_short(v)} is not a number")
    try:
        return float(v)
    except OverflowError:
        raise Invalid(where, f"{_short(v)} overflows a float") from None


def _in_dtype(x: float, dtype: np.dtype[Any], where: str) -> None:
    import numpy as np  # heavy: only a record holding numpy scalars needs it

    if math.isfinite(x):
        with np.errstate(over="raise", invalid="raise"):
            try:
                y = dtype.type(x)
            except (FloatingPointError, OverflowError, ValueError):
                raise Invalid(where, f"{x!r} overflows {dtype}") from None
        if not np.isfinite(np.float64(y)):
            raise Invalid(where, f"{x!r} overflows {dtype}")


def _int_range(dtype: np.dtype[Any]) -> tuple[int, int]:
    import numpy as np  # heavy: only a record holding numpy scalars needs it

    try:
        info = np.iinfo(dtype)
        return int(info.min), int(info.max)
    except ValueError:
        import ml_dtypes

        ml = ml_dtypes.iinfo(dtype)
        return int(ml.min), int(ml.max)


def _complex(v: Any, where: str) -> tuple[float, float]:
    if type(v) is not list or len(v) != 2:
        raise Invalid(where, f"{_short(v)} is not a [real, imag] pair")
    return _finite_or_named(v[0], where + "[0]"), _finite_or_named(v[1], where + "[1]")


def _scalar_leaf(rec: dict[str, Any], where: str, ctx: _Ctx) -> None:
    t = _req(rec, "type", where)
    v = _req(rec, "value", where)
    w = where + "/value"
    if t == "bool":
        if type(v) is not bool:
            raise Invalid(w, f"{_short(v)} is not a bool")
    elif t == "int":
        if type(v) is not int:
            raise Invalid(w, f"{_short(v)} is not an integer")
    elif t == "float":
        _finite_or_named(v, w)
    elif t == "complex":
        _complex(v, w)
    elif t == "numpy":
        name = _req(rec, "dtype", where)
        if type(name) is not str or name not in supported():
            raise Invalid(where + "/dtype", f"{_short(name)} is not a supported dtype")
        d = supported()[name]
        if d.kind == "c":
            re_, im = _complex(v, w)
            part = supported()[f"float{d.itemsize * 4}"]
            _in_dtype(re_, part, w)
            _in_dtype(im, part, w)
        elif d.kind == "b":
            if type(v) is not bool:
                raise Invalid(w, f"{_short(v)} is not a bool")
        elif d.kind in "iu":
            lo, hi = _int_range(d)
            if type(v) is not int or not lo <= v <= hi:
                raise Invalid(w, f"{_short(v)} is not an integer in {name}'s range [{lo}, {hi}]")
        else:
            _in_dtype(_finite_or_named(v, w), d, w)
    else:
        raise Invalid(where + "/type", f"unknown scalar type {_short(t)}")


def _str_leaf(rec: dict[str, Any], where: str, ctx: _Ctx) -> None:
    _str(_req(rec, "value", where), where + "/value", None)


def _bytes_leaf(rec: dict[str, Any], where: str, ctx: _Ctx) -> None:
    v = _str(_req(rec, "value", where), where + "/value", None)
    try:
        base64.b64decode(v, validate=True)
    except (binascii.Error, ValueError):
        raise Invalid(where + "/value", "is not base64") from None


def _none_leaf(rec: dict[str, Any], where: str, ctx: _Ctx) -> None:
    return None


# ------------------------------------------------------------------------------- arrays
def _shape(v: Any, where: str, low: int) -> tuple[int, ...]:
    # The common case in one pass; the element-wise checks below only to name a defect.
    if (
        type(v) is list
        and len(v) <= MAX_NDIM
        and all(type(x) is int and low <= x <= MAX_DIM for x in v)
    ):
        return tuple(v)
    items = _list(v, where, MAX_NDIM)
    return tuple(_int(x, f"{where}[{i}]", low, MAX_DIM) for i, x in enumerate(items))


def _location(v: Any, where: str, ctx: _Ctx) -> str:
    loc = _str(v, where, MAX_LOCATION)
    parts = loc.split("/")
    if not is_safe_location(loc) or max(map(len, parts)) > MAX_COMPONENT:
        raise Invalid(where, f"{_short(loc)} is not a location inside d/")
    if len(parts) < 3 or parts[1] not in ctx.txids:
        raise Invalid(where, f"{_short(loc)} is not under d/<txid>/ of one of the record's txids")
    ctx.locations.append((loc, where))
    return loc


def _sharding(v: Any, where: str, shape: tuple[int, ...]) -> int | None:
    """Check a sharding record; the number of devices of a named mesh (else None)."""
    s = _dict(v, where)
    t = _str(_req(s, "type", where), where + "/type", None)
    if t != "named":
        return None
    mesh = _dict(_req(s, "mesh", where), where + "/mesh")
    if len(mesh) > MAX_NDIM:  # no axes at all: a mesh of one device
        raise Invalid(where + "/mesh", f"a mesh has at most {MAX_NDIM} named axes")
    for k, n in mesh.items():
        _int(n, f"{where}/mesh/{k}", 1, MAX_MESH_DEVICES)
    devices = math.prod(mesh.values())
    if devices > MAX_MESH_DEVICES:
        raise Invalid(where + "/mesh", f"claims {devices} devices")
    if "axis_types" in s:  # since issue 31; a record without them rebuilds Auto axes
        types = _list(s["axis_types"], where + "/axis_types", len(mesh))
        if len(types) != len(mesh) or any(t not in AXIS_TYPES for t in types):
            raise Invalid(
                where + "/axis_types", f"is not one of {AXIS_TYPES} per mesh axis: {_short(types)}"
            )
    spec = _list(_req(s, "spec", where), where + "/spec", len(shape))
    used: set[str] = set()
    for d, p in enumerate(spec):
        w = f"{where}/spec[{d}]"
        axes = [] if p is None else [p] if type(p) is str else _list(p, w, MAX_NDIM)
        size = 1
        for a in axes:
            if type(a) is not str or a not in mesh:
                raise Invalid(w, f"{_short(a)} is not an axis of the mesh {sorted(mesh)}")
            if a in used:
                raise Invalid(w, f"mesh axis {a!r} is used twice")
            used.add(a)
            size *= mesh[a]
        if shape[d] % size:
            raise Invalid(w, f"dimension {d} of size {shape[d]} is not divisible by {size} devices")
    return devices


def _array_leaf(rec: dict[str, Any], where: str, ctx: _Ctx) -> None:
    shape = _shape(_req(rec, "shape", where), where + "/shape", 0)
    chunk = _shape(_req(rec, "chunk_shape", where), where + "/chunk_shape", 1)
    if len(chunk) != len(shape):
        raise Invalid(where + "/chunk_shape", f"{chunk} does not match shape {shape}")
    name = _req(rec, "dtype", where)
    if type(name) is not str or name not in ITEMSIZES:
        raise Invalid(where + "/dtype", f"{_short(name)} is not a supported dtype")
    itemsize = ITEMSIZES[name]
    nbytes = math.prod(shape) * itemsize
    if nbytes > MAX_CLAIMED_BYTES or (nbytes and math.prod(chunk) * itemsize > MAX_CLAIMED_BYTES):
        raise Invalid(where + "/shape", f"claims {nbytes} bytes, beyond any real checkpoint")
    if "nbytes" in rec and rec["nbytes"] != nbytes:
        raise Invalid(where + "/nbytes", f"{_short(rec['nbytes'])} is not {nbytes}")
    _location(_req(rec, "location", where), where + "/location", ctx)
    if "inner_shape" in rec and rec["inner_shape"] is not None:
        inner = _shape(rec["inner_shape"], where + "/inner_shape", 1)
        if len(inner) != len(chunk) or any(c % i for i, c in zip(inner, chunk)):
            raise Invalid(where + "/inner_shape", f"{inner} does not divide {chunk}")
    check_codecs(rec.get("codecs", []), rec.get("lossy", []), where)
    if type(rec.get("checksum", True)) is not bool:
        raise Invalid(where + "/checksum", "is not a bool")
    if "source_dtype" in rec and rec["source_dtype"] not in ITEMSIZES:
        raise Invalid(where + "/source_dtype", f"{_short(rec['source_dtype'])} is not a dtype")
    grid = math.prod(-(-n // c) for n, c in zip(shape, chunk))
    devices = None
    if rec.get("sharding") is not None:
        devices = _sharding(rec["sharding"], where + "/sharding", shape)
    limit = MAX_CHUNKS if devices is None else max_chunks(devices)
    if grid > limit:
        raise Invalid(
            where + "/chunk_shape",
            f"{chunk} cuts shape {shape} into {grid} chunks, more than the {limit} "
            "a saved array can have",
        )
    if rec.get("handler") == "prng_key":
        _prng(rec, where, shape, name)


def _prng(rec: dict[str, Any], where: str, shape: tuple[int, ...], dtype: str) -> None:
    impl = _str(_req(rec, "impl", where), where + "/impl", 200)
    impls = prng_impls()
    if impl not in impls:
        raise Invalid(where + "/impl", f"{impl!r} is not a PRNG implementation ({sorted(impls)})")
    key_shape = _shape(rec.get("key_shape", list(shape[: len(shape) - 1])), where + "/key_shape", 0)
    if dtype != "uint32" or shape != key_shape + impls[impl]:
        raise Invalid(
            where + "/shape",
            f"{shape} {dtype} is not the data of {impl} keys of shape {key_shape}",
        )


LeafRule = Callable[[dict[str, Any], str, "_Ctx"], None]

#: Checker per leaf handler id; leaves of other (third-party) handlers get the common checks.
LEAF_RULES: dict[str, LeafRule] = {
    "scalar": _scalar_leaf,
    "str": _str_leaf,
    "bytes": _bytes_leaf,
    "none": _none_leaf,
    "numpy": _array_leaf,
    "jax": _array_leaf,
    "prng_key": _array_leaf,
}


class _Ctx:
    def __init__(self, txids: set[str]) -> None:
        self.txids = txids
        self.locations: list[tuple[str, str]] = []


def _tree(node: Any, where: str, ctx: _Ctx, depth: int = 0) -> None:
    if depth > MAX_DEPTH:
        raise Invalid(where, f"tree deeper than {MAX_DEPTH}")
    n = _dict(node, where)
    kind = _req(n, "kind", where)
    if kind == "leaf":
        hid = _str(_req(n, "handler", where), where + "/handler", None)
        if "variable" in n:  # a Flax NNX Variable's class name, shown only (issue 31)
            _str(n["variable"], where + "/variable", None)
        rule = LEAF_RULES.get(hid)
        if rule is not None:
            rule(n, where, ctx)
        elif "location" in n:
            _location(n["location"], where + "/location", ctx)
        return
    if kind not in ("dict", "list", "tuple"):
        raise Invalid(where + "/kind", f"unknown node kind {_short(kind)}")
    if "type" in n and n["type"] is not None:
        _str(n["type"], where + "/type", MAX_TYPE_NAME)
    children = _list(_req(n, "children", where), where + "/children")
    if kind == "dict":
        keys = _list(_req(n, "keys", where), where + "/keys")
        if len(keys) != len(children) or not all(type(k) in (str, int) for k in keys):
            raise Invalid(where + "/keys", "not a list of strings/integers matching children")
        if len(set(keys)) != len(keys):
            raise Invalid(where + "/keys", "duplicate keys")
    else:
        keys = list(range(len(children)))
    for k, c in zip(keys, children):
        _tree(
            c,
            f"{where}/{k}" if where and not where.endswith(":") else f"{where}{k}",
            ctx,
            depth + 1,
        )


def _check_locations(ctx: _Ctx) -> None:
    """No two leaves share a location, nor does one lie inside another's directory."""
    seen: dict[str, str] = {}
    for loc, where in sorted(ctx.locations):
        if loc in seen:
            raise Invalid(where, f"location {loc!r} is also the location of {seen[loc]}")
        seen[loc] = where
    for b, where in seen.items():
        parts = b.split("/")
        for i in range(1, len(parts)):
            a = "/".join(parts[:i])
            if a in seen:
                raise Invalid(where, f"location {b!r} lies inside {seen[a]}'s directory {a!r}")


# -------------------------------------------------------------------------- top level
def _txids(v: Any, where: str) -> set[str]:
    items = _list(v, where)
    for i, t in enumerate(items):
        if type(t) is not str or not _TXID.match(t):
            raise Invalid(f"{where}[{i}]", f"{_short(t)} is not a txid")
    return set(items)


def _plugins(v: Any, where: str) -> None:
    for k, d in _dict(v, where).items():
        group, sep, name = k.partition(":")
        if not sep or not group or not name:
            raise Invalid(f"{where}/{k!r}", "is not '<group>:<name>'")
        if not is_distribution_name(d):
            raise Invalid(f"{where}/{k}", f"{_short(d)} is not a distribution name")


def _units(v: Any, where: str, ctx: _Ctx, process_count: int) -> None:
    for name, unit in _dict(v, where).items():
        w = f"{where}/{name}"
        kind = _req(_dict(unit, w), "kind", w)
        if kind == "pytree":
            _tree(_req(unit, "tree", w), "" if name == "pytree" else f"{name}:", ctx)
        elif kind == "handler":
            _str(_req(unit, "handler", w), w + "/handler", None)
            _location(_req(unit, "location", w), w + "/location", ctx)
            if "processes" in unit or "records" in unit:
                _per_process(unit, w, process_count)
        elif kind != "json":
            raise Invalid(w + "/kind", f"unknown unit kind {_short(kind)}")


def _per_process(unit: dict[str, Any], where: str, process_count: int) -> None:
    """A per-process unit: its process count (the save's) and one record per process."""
    n = _int(_req(unit, "processes", where), where + "/processes", 1, MAX_PROCESSES)
    if n != process_count:
        raise Invalid(
            where + "/processes",
            f"{n} processes, but the record was written by {process_count} (process_count)",
        )
    records = _list(_req(unit, "records", where), where + "/records", MAX_PROCESSES)
    if len(records) != n:
        raise Invalid(where + "/records", f"{len(records)} records for {n} processes")
    if "record" in unit:
        raise Invalid(where + "/record", "a per-process unit has one record per process only")


FieldRule = Callable[[Any, str], Any]

#: Checker per top-level field of ``quire.json`` (version 1); unlisted fields are tolerated.
COMMIT_FIELDS: dict[str, tuple[bool, FieldRule]] = {
    "created": (True, _timestamp),
    "library_version": (False, lambda v, w: _str(v, w, 200)),
    "process_count": (True, lambda v, w: _int(v, w, 1, MAX_PROCESSES)),
    "metadata": (True, _dict),
    "plugins": (False, _plugins),
    "journal_version": (False, lambda v, w: _int(v, w, 0)),
}

#: Checker per top-level field of a journal record; unlisted fields are tolerated.
JOURNAL_FIELDS: dict[str, tuple[bool, FieldRule]] = {
    "created": (True, _timestamp),
    "process_count": (False, lambda v, w: _int(v, w, 1, MAX_PROCESSES)),
    "metadata": (True, _dict),
    "base_version": (False, lambda v, w: _int(v, w, 0)),
    "deleted": (True, lambda v, w: _paths(v, w)),
    "added": (True, lambda v, w: _paths(v, w)),
    "replaced": (True, lambda v, w: _paths(v, w)),
}


def _paths(v: Any, where: str) -> None:
    for i, p in enumerate(_list(v, where)):
        w = f"{where}[{i}]"
        if not all(type(k) in (str, int) for k in _list(p, w, MAX_DEPTH)):
            raise Invalid(w, "is not a key path (strings and integers)")


def _fields(doc: dict[str, Any], rules: dict[str, tuple[bool, FieldRule]]) -> None:
    for key, (required, rule) in rules.items():
        if key in doc:
            rule(doc[key], key)
        elif required:
            raise Invalid(key, "required field is missing")


def _raise(where_url: str, e: Invalid, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{where_url} is not a valid {what}: at {e.where or '<root>'}: {e.why}. The checkpoint "
        "is damaged or was not written by quire; restore it from a copy"
    )


def check_commit(doc: dict[str, Any], record_url: str) -> None:
    """Validate a parsed ``quire.json`` (format and version already checked).

    Raises
    ------
    CorruptCheckpointError
        Naming ``record_url`` and the key path of the first bad value.
    """
    try:
        _fields(doc, COMMIT_FIELDS)
        ctx = _Ctx(_txids(_req(doc, "txids", ""), "txids"))
        _units(_req(doc, "units", ""), "units", ctx, doc["process_count"])
        _check_locations(ctx)
    except Invalid as e:
        raise _raise(record_url, e, "quire commit record") from None


def check_journal(doc: dict[str, Any], record_url: str) -> None:
    """Validate a parsed journal record (format, version and number already checked)."""
    try:
        _fields(doc, JOURNAL_FIELDS)
        txid = doc.get("txid")
        if txid is not None and (type(txid) is not str or not _TXID.match(txid)):
            raise Invalid("txid", f"{_short(txid)} is not a txid")
        ctx = _Ctx({txid} if txid else set())
        if doc.get("tree") is not None:
            _tree(doc["tree"], "", ctx)
        _check_locations(ctx)
    except Invalid as e:
        raise _raise(record_url, e, "quire journal record") from None
