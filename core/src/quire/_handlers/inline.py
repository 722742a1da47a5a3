"""Leaves stored inline in ``quire.json``: scalars, strings, bytes and None."""

from __future__ import annotations

import base64
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from quire._format.bounds import MAX_INT_DIGITS
from quire._format.describe import SCALAR_TYPES, scalar_type
from quire._format.dtypes import dtype_from_name, dtype_name
from quire._format.tree import keystr
from quire._handlers.base import LoadContext, LoadEntry, SaveContext, SaveEntry, StoredObject
from quire._handlers.casting import (
    check_cast,
    check_values,
    kind,
    target_dtype,
    to_jax_dtype,
    value_dtype,
)
from quire.errors import CorruptCheckpointError, UnsupportedLeafError


def _enc_float(x: float) -> Any:
    if math.isfinite(x):
        return x
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")


def _dec_float(v: Any) -> float:
    if isinstance(v, str):
        if v not in ("nan", "inf", "-inf"):
            raise ValueError(v)
        return float(v)
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise ValueError(v)
    return float(v)


class _Inline:
    priority = 0
    id = ""

    def handles_abstract(self, abstract: Any) -> bool:
        return True

    def snapshot(self, entries: Sequence[SaveEntry]) -> list[SaveEntry]:
        return list(entries)

    async def save(self, entries: Sequence[SaveEntry], ctx: SaveContext) -> list[dict[str, Any]]:
        out = []
        for e in entries:
            try:
                out.append({"handler": self.id, **self.encode(e)})
            except UnsupportedLeafError as err:
                raise UnsupportedLeafError(f"{ctx.url}: {err}") from None
        return out

    def encode(self, entry: SaveEntry) -> dict[str, Any]:
        raise NotImplementedError

    def decode(self, record: Mapping[str, Any]) -> Any:
        raise NotImplementedError

    def check(self, entry: LoadEntry) -> str | None:
        """Why an array target cannot take this leaf (see :func:`mismatch`), or None."""
        return mismatch(self.id, entry.target)

    async def load(self, entries: Sequence[LoadEntry], ctx: LoadContext) -> list[Any]:
        out = []
        for e in entries:
            try:
                v = self.decode(e.record)
            except (KeyError, ValueError, TypeError) as err:
                raise CorruptCheckpointError(
                    f"{ctx.url}: leaf {'/'.join(map(str, e.path))!r} has a malformed "
                    f"{self.id!r} record ({err!r}); the commit record is damaged"
                ) from err
            out.append(convert(v, e.target, e.path, e.casting, ctx.url))
        return out

    async def objects(
        self, entries: Sequence[LoadEntry], ctx: LoadContext
    ) -> list[list[StoredObject]]:
        """Inline leaves own no stored objects (their value is in ``quire.json``)."""
        return [[] for _ in entries]

    def metadata(self, records: Sequence[Mapping[str, Any]]) -> list[Any]:
        return [type(self.decode(r)) for r in records]


def convert(
    value: Any, target: Any, path: tuple[Any, ...], casting: str = "same_kind", url: str = ""
) -> Any:
    """A value loaded inline (a number, a str or bytes; a 0-d array's element) as the
    abstract target asks.

    The conversions made: a None target keeps the value; a str goes to ``str`` (or a str),
    bytes to ``bytes`` or ``bytearray`` (or a value of them); a number goes to a number
    type (``bool``, ``int``, ``float``, ``complex``, a numpy scalar type), a value of one or
    an array target (numpy, ``jax.ShapeDtypeStruct``, ``jax.Array``) of its dtype, a cast
    that ``casting`` refuses raising :class:`~quire.errors.LossyCastError`, and to
    ``np.ndarray`` (the type) as a 0-d array of its own dtype.  Any other pair (a number to
    ``bytes``, a str to ``bool`` or ``float``, bytes to ``str``, a type such as ``list``) is
    an :class:`~quire.errors.UnsupportedLeafError` naming the leaf and the targets that
    work: calling the type would give other data (``bytes(300)`` is 300 zero bytes,
    ``bool("False")`` is True).
    """
    if target is None:
        return value
    t = target if isinstance(target, type) else type(target)
    if isinstance(value, str | bytes):
        if t is type(value):
            return value
        if t is bytearray and isinstance(value, bytes):
            return bytearray(value)
        raise _refused(value, t, path, url)
    if np.ndim(value) != 0:
        raise UnsupportedLeafError(
            f"{_where(url)}leaf {keystr(path)!r} is an array of shape {np.shape(value)}; it "
            f"cannot load as {_name(t)}: use an array as the abstract leaf"
        )
    src, dst = value_dtype(value), target_dtype(target)
    if src is not None and target is np.ndarray:
        return np.asarray(value)
    if src is None or dst is None or kind(dst) is None:
        raise _refused(value, t, path, url)
    check_cast(src, dst, casting, url=url, path=path)
    if target not in SCALAR_TYPES.values() and type(target) not in SCALAR_TYPES.values():
        check_values(value, dst, casting, url=url, path=path)  # a Python int is unbounded
    if isinstance(target, np.generic):
        return target.dtype.type(value)
    if hasattr(target, "dtype") and hasattr(target, "shape") and not isinstance(target, type):
        arr = np.asarray(value, dtype=target.dtype)
        if isinstance(target, np.ndarray):
            return arr
        # A jax.Array of a 64-bit dtype is 32 bits while jax_enable_x64 is off.
        return _jax_scalar(to_jax_dtype(arr, arr.dtype, url=url, path=path, saved=src), target)
    try:
        return t(value)
    except (TypeError, ValueError) as e:  # a complex to a float under casting="unsafe"
        raise _refused(value, t, path, url) from e


def _where(url: str) -> str:
    return f"{url}: " if url else ""


def _name(t: type) -> str:
    mod = t.__module__.split(".")[0]
    if mod == "builtins":
        return t.__name__
    if mod in ("jax", "jaxlib"):
        return "jax.Array" if t.__name__ in ("Array", "ArrayImpl") else f"jax.{t.__name__}"
    return f"{'np' if mod == 'numpy' else mod}.{t.__qualname__}"


def _refused(value: Any, t: type, path: tuple[Any, ...], url: str) -> UnsupportedLeafError:
    """The error for a saved inline value its target type cannot take without changing it."""
    vt = type(value)
    if vt in (str, bytes):
        fix = f"{vt.__name__} (or a {vt.__name__} value)"
    else:
        types = dict.fromkeys([_name(vt), "int", "float", "np.float32"])
        fix = (
            f"a number type ({', '.join(types)}, ...), a value of one, or an array of shape "
            "() (np.zeros((), dtype), jax.ShapeDtypeStruct((), dtype))"
        )
    return UnsupportedLeafError(
        f"{_where(url)}leaf {keystr(path)!r} (a saved {_name(vt)}) cannot load as "
        f"{_name(t)}; make the abstract leaf {fix}, or None to load it as saved"
    )


def mismatch(held: str, target: Any, saved: str = "saved") -> str | None:
    """Why an array target (numpy, ``jax.ShapeDtypeStruct``, ``jax.Array``, a numpy scalar)
    cannot take an inline leaf holding ``held`` (a type's name): a str or bytes has no array
    to give, a number none of a shape other than (); None where it can (or for other
    targets, which :func:`convert` answers)."""
    shape = getattr(target, "shape", None)
    if shape is None or isinstance(target, type) or not hasattr(target, "dtype"):
        return None
    if held in ("str", "bytes"):
        fix = f"make the target {held} (or None)"
    elif tuple(shape) != ():
        fix = "a scalar has shape ()"
    else:
        return None
    return f"{saved} {held}, target {target.dtype} array of shape {tuple(shape)}: {fix}"


def _jax_scalar(arr: np.ndarray, target: Any) -> Any:
    import jax

    sharding = getattr(target, "sharding", None)
    return jax.device_put(arr, sharding) if sharding is not None else jax.numpy.asarray(arr)


class ScalarHandler(_Inline):
    """Python and numpy scalars (bool, int, float, complex; every numeric dtype)."""

    id = "scalar"

    def handles(self, value: Any) -> bool:
        if isinstance(value, np.generic):
            try:
                dtype_name(value.dtype)
                return True
            except TypeError:
                return False
        return type(value) in (bool, int, float, complex)

    def encode(self, entry: SaveEntry) -> dict[str, Any]:
        v = entry.value
        if isinstance(v, np.generic):
            name = dtype_name(v.dtype)
            py = v.item() if v.dtype.kind in "biucf" else float(v)
            if v.dtype.kind == "c":
                return {
                    "type": "numpy",
                    "dtype": name,
                    "value": [_enc_float(py.real), _enc_float(py.imag)],
                }
            if isinstance(py, float) or v.dtype.kind == "V":
                return {"type": "numpy", "dtype": name, "value": _enc_float(float(py))}
            return {"type": "numpy", "dtype": name, "value": py}
        t = type(v).__name__
        if t == "int" and abs(v) >= 10**MAX_INT_DIGITS:
            raise UnsupportedLeafError(
                f"leaf {keystr(entry.path)!r}: an integer of more than {MAX_INT_DIGITS} digits, "
                "which JSON readers refuse; save it as a string (str(value))"
            )
        if t == "complex":
            return {"type": t, "value": [_enc_float(v.real), _enc_float(v.imag)]}
        if t == "float":
            return {"type": t, "value": _enc_float(v)}
        return {"type": t, "value": v}

    def decode(self, r: Mapping[str, Any]) -> Any:
        t, v = r["type"], r["value"]
        if t == "numpy":
            d = dtype_from_name(r["dtype"])
            if d.kind == "c":
                return d.type(complex(_dec_float(v[0]), _dec_float(v[1])))
            if d.kind in "iub":
                if isinstance(v, float) or not isinstance(v, int | bool):
                    raise ValueError(v)
                return d.type(v)
            return d.type(_dec_float(v))
        if t == "bool":
            if not isinstance(v, bool):
                raise ValueError(v)
            return v
        if t == "int":
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(v)
            return v
        if t == "float":
            return _dec_float(v)
        if t == "complex":
            return complex(_dec_float(v[0]), _dec_float(v[1]))
        raise ValueError(f"unknown scalar type {t!r}")

    def check(self, entry: LoadEntry) -> str | None:
        """Why an array target cannot take this number (one of another shape), or None."""
        t = scalar_type(entry.record)
        return mismatch(t.__name__ if t else str(entry.record.get("dtype")), entry.target)

    def metadata(self, records: Sequence[Mapping[str, Any]]) -> list[Any]:
        out: list[Any] = []
        for r in records:
            t = scalar_type(r)
            out.append(dtype_from_name(r["dtype"]).type if t is None else t)
        return out


class StringHandler(_Inline):
    id = "str"

    def handles(self, value: Any) -> bool:
        return type(value) is str

    def encode(self, entry: SaveEntry) -> dict[str, Any]:
        return {"value": entry.value}

    def decode(self, r: Mapping[str, Any]) -> Any:
        v = r["value"]
        if not isinstance(v, str):
            raise TypeError(f"expected a string, got {type(v).__name__}")
        return v


class BytesHandler(_Inline):
    id = "bytes"

    def handles(self, value: Any) -> bool:
        return type(value) is bytes

    def encode(self, entry: SaveEntry) -> dict[str, Any]:
        return {"value": base64.b64encode(entry.value).decode("ascii")}

    def decode(self, r: Mapping[str, Any]) -> Any:
        return base64.b64decode(r["value"], validate=True)


class NoneHandler(_Inline):
    id = "none"

    def handles(self, value: Any) -> bool:
        return value is None

    def encode(self, entry: SaveEntry) -> dict[str, Any]:
        return {}

    def decode(self, r: Mapping[str, Any]) -> Any:
        return None

    def check(self, entry: LoadEntry) -> str | None:
        """None matches a None target ("as saved") only: a target asking for a value (an
        array, a number, a type) there has none in the checkpoint."""
        t = entry.target
        if t is None:
            return None
        shape = getattr(t, "shape", None)
        asked = f"target shape {tuple(shape)}" if shape is not None else f"target {t!r}"
        return f"saved None, {asked}"

    async def load(self, entries: Sequence[LoadEntry], ctx: LoadContext) -> list[Any]:
        return [None for _ in entries]

    def metadata(self, records: Sequence[Mapping[str, Any]]) -> list[Any]:
        return [type(None) for _ in records]
