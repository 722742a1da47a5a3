"""Which casts a load makes without being asked: numpy's casting vocabulary, with ml_dtypes'
types placed in numpy's kinds, and the value check of a narrowed integer.

A load casts a leaf when its target asks for another dtype than the saved one.  ``casting``
takes numpy's values (``numpy.can_cast``):

* ``"no"`` / ``"equiv"``: no cast at all;
* ``"safe"``: only casts that keep every value (``int32 -> int64``, ``float32 -> float64``);
* ``"same_kind"`` (the default): safe casts, and casts within a kind or up the order
  bool < unsigned int < signed int < float < complex (``float32 -> bfloat16``,
  ``float64 -> float32``, ``int64 -> int32``); an integer narrowed this way must keep its
  values, which is checked region by region as they are read (numpy would wrap them), so
  with several processes the processes that read a value that does not fit raise;
* ``"unsafe"``: any cast numpy makes (floats truncated to ints, complex to real).

numpy's own ``can_cast(..., "same_kind")`` answers wrongly for ml_dtypes' types: they are
registered with numpy kind ``V``, so it calls ``float32 -> int4`` and ``complex64 -> bfloat16``
same-kind and ``bfloat16 -> float16`` not.  Here bfloat16 and the float8 types are floats and
int2 / int4 (uint2 / uint4) signed (unsigned) ints, and ``same_kind`` follows the order above
for every type, which is numpy's answer for numpy's own types.

A ``jax.Array`` result holds the dtype JAX gives it, not always the one the target names:
with ``jax_enable_x64`` off (JAX's default) a 64-bit type is its 32-bit one
(:func:`jax_dtype`).  That narrowing is asked for by no one, so whatever ``casting`` says it
is made only when every value fits (:func:`to_jax_dtype`: integers in range, floats and
complex numbers finite where they were), else a :class:`~quire.errors.LossyCastError` that
names the setting.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import ml_dtypes
import numpy as np

from quire._format.dtypes import ML_FLOAT_NAMES, ML_INT_NAMES, supported
from quire._format.tree import KeyPath, keystr
from quire.errors import LossyCastError
from quire.options import CASTINGS, CastingSpec

__all__ = [
    "CASTINGS",
    "DEFAULT",
    "CastingSpec",
    "can_cast",
    "casting_for",
    "check_cast",
    "check_casting",
    "check_spec",
    "check_storage_cast",
    "check_values",
    "int_range",
    "jax_dtype",
    "lossy",
    "misfit",
    "narrowed",
    "python_dtype",
    "refusal",
    "storage_cast_at",
    "stored_dtype",
    "target_dtype",
    "to_jax_dtype",
    "value_dtype",
]

DEFAULT = "same_kind"

_ORDER = {"b": 0, "u": 1, "i": 2, "f": 3, "c": 4}
_ML_KINDS = {name: "f" for name in ML_FLOAT_NAMES}
_ML_KINDS.update({name: "u" if name.startswith("u") else "i" for name in ML_INT_NAMES})
_PYTHON: dict[type, np.dtype[Any]] = {
    bool: np.dtype(bool),
    int: np.dtype(np.int64),
    float: np.dtype(np.float64),
    complex: np.dtype(np.complex128),
}
_PY_NAMES = {t.__name__: t for t in _PYTHON}


def check_casting(casting: Any, what: str = "casting") -> None:
    """Refuse a casting value that is not one of numpy's (``ValueError`` naming them)."""
    if casting not in CASTINGS:
        raise ValueError(f"{what} must be one of {', '.join(map(repr, CASTINGS))}, not {casting!r}")


def check_spec(spec: Any) -> None:
    """Refuse a ``casting=`` argument that is neither a casting, a callable nor None."""
    if spec is not None and not callable(spec):
        check_casting(spec)


def casting_for(spec: CastingSpec, path: KeyPath, target: Any) -> str:
    """The casting of the leaf at ``path``: ``spec`` itself, or what the callable ``spec``
    returns for ``(key path, target leaf)`` (None: the default, ``"same_kind"``)."""
    if spec is None:
        return DEFAULT
    if isinstance(spec, str):
        return spec
    got = spec(path, target)
    if got is None:
        return DEFAULT
    check_casting(got, f"the casting callable's answer for {keystr(path)!r}")
    return str(got)


def kind(dtype: np.dtype[Any]) -> str | None:
    """numpy's kind letter of ``dtype`` (``b u i f c``), ml_dtypes' types placed as numbers."""
    if dtype.kind in _ORDER:
        return dtype.kind
    return _ML_KINDS.get(dtype.name)


def can_cast(src: np.dtype[Any], dst: np.dtype[Any], casting: str) -> bool:
    """Whether a load may cast ``src`` to ``dst`` under ``casting`` (values not looked at)."""
    if src == dst or casting == "unsafe":
        return True
    if casting == "same_kind":
        a, b = kind(src), kind(dst)
        if a is not None and b is not None:
            return _ORDER[a] <= _ORDER[b]
    return bool(np.can_cast(src, dst, casting))  # type: ignore[arg-type]


def lossy(src: np.dtype[Any], dst: np.dtype[Any], casting: str) -> bool:
    """Whether ``casting`` refuses the cast of ``src`` to ``dst`` as one that loses
    information (a cast numpy cannot make at all is not: its own error says so)."""
    return not can_cast(src, dst, casting) and bool(np.can_cast(src, dst, "unsafe"))


def python_dtype(t: type) -> np.dtype[Any] | None:
    """The dtype a Python number type stands for in a cast (``int``: int64), else None."""
    return _PYTHON.get(t)


def target_dtype(target: Any) -> np.dtype[Any] | None:
    """The numpy dtype a target leaf asks for; None for "as saved" (None, ``np.ndarray``,
    ``jax.Array``) and for dtypes numpy has no name for (typed PRNG keys, torch's)."""
    if target is None:
        return None
    if isinstance(target, type):
        if issubclass(target, np.generic):
            return np.dtype(target)
        return python_dtype(target)
    if type(target) in _PYTHON:
        return python_dtype(type(target))
    dtype = getattr(target, "dtype", None)
    return dtype if isinstance(dtype, np.dtype) else None


def value_dtype(value: Any) -> np.dtype[Any] | None:
    """The dtype of a value a load places into its target (an array, a lazy array, a
    number); None for what is not a number (None, strings, bytes)."""
    if type(value) in _PYTHON:
        return python_dtype(type(value))
    dtype = getattr(value, "dtype", None)
    return dtype if isinstance(dtype, np.dtype) else None


def stored_dtype(record: Mapping[str, Any]) -> np.dtype[Any] | None:
    """The dtype of the values a leaf record holds: an array's (any handler that records
    one by name, as the numpy array handlers do), an inline number's; None for the rest
    (typed PRNG keys: their target is checked by their handler)."""
    if record.get("handler") == "prng_key":
        return None
    name = record.get("dtype")
    if isinstance(name, str):
        return supported().get(name)
    if record.get("handler") == "scalar":
        return python_dtype(_PY_NAMES.get(str(record.get("type")), object))
    return None


def check_cast(
    src: np.dtype[Any], dst: np.dtype[Any], casting: str, *, url: str, path: KeyPath
) -> None:
    """Refuse (:class:`~quire.errors.LossyCastError`) a cast of ``src`` to ``dst`` that
    ``casting`` does not allow (the dtypes only; :func:`check_values` looks at values)."""
    if not lossy(src, dst, casting):
        return
    why = refusal(src, dst, casting)
    raise LossyCastError(
        f"{url}: leaf {keystr(path)!r}: {why}. To fix: {allow_hint(src)}",
        mismatched=[f"{keystr(path)!r}: {why}"],
    )


def check_storage_cast(
    src: np.dtype[Any], dst: np.dtype[Any], casting: str, a: Any = None, *, path: KeyPath
) -> None:
    """Refuse (:class:`~quire.errors.LossyCastError`) the cast ``StorageOptions(dtype=dst,
    casting=casting)`` asks of a leaf of dtype ``src``, by the load side's rule: the dtypes
    (``a`` None), or the values ``a`` (an integer narrowed past one of them).  The message
    names the leaf, both dtypes and the fix; the save adds its URL in front."""
    if a is None:
        if not lossy(src, dst, casting):
            return
        why = f"{_why(src, dst)} loses information (casting={casting!r})"
    else:
        found = misfit(a, dst, casting)
        if found is None:
            return
        why = (
            f"values {found} do not fit {dst} ({int_range(dst)}); casting='same_kind' "
            "narrows an integer only when every value fits"
        )
    why = f"StorageOptions(dtype={dst}) casts the leaf's {src} to {dst}: {why}"
    raise LossyCastError(
        f"leaf {keystr(path)!r}: {why}. To fix: store it as {src} (no dtype=) or as a dtype "
        f"that holds it, or allow the cast: StorageOptions(dtype={dst}, casting='unsafe') "
        "(a storage= callable (key_path, leaf) gives it to some leaves only)",
        mismatched=[f"{keystr(path)!r}: {why}"],
    )


def storage_cast_at(url: str, err: LossyCastError) -> LossyCastError:
    """``err`` (raised by :func:`check_storage_cast`) with the save's URL in front."""
    return LossyCastError(f"{url}: {err}", mismatched=list(err.mismatched))


def _why(src: np.dtype[Any], dst: np.dtype[Any]) -> str:
    a, b = kind(src), kind(dst)
    names = {"b": "a bool", "u": "an unsigned int", "i": "an int", "f": "a float", "c": "a complex"}
    if a is not None and b is not None and a != b:
        return f"{names[a]} cast to {names[b]}"
    return f"{src} does not fit {dst} exactly"


def refusal(src: np.dtype[Any], dst: np.dtype[Any], casting: str) -> str:
    """Why a leaf's cast is refused (for a ``mismatched`` entry)."""
    return f"saved {src}, target {dst}: {_why(src, dst)} loses information (casting={casting!r})"


def allow_hint(src: np.dtype[Any]) -> str:
    """The fixes of a refused cast: the saved dtype as the target's, or a casting that allows it."""
    return (
        f"make the target's dtype {src} (and cast after loading), or allow the cast: "
        "casting='unsafe' for every leaf, or a callable (key_path, target) -> 'unsafe' | None "
        "for some of them (quire.load, quire.load_and_transform, Checkpointer.load)"
    )


def _range(dtype: np.dtype[Any]) -> tuple[int, int]:
    info: Any = np.iinfo(dtype) if dtype.kind in "ui" else ml_dtypes.iinfo(dtype)
    return int(info.min), int(info.max)


def narrowed(src: np.dtype[Any] | None, dst: np.dtype[Any], casting: str) -> bool:
    """Whether casting ``src`` (None: a Python int) to ``dst`` under ``casting`` must check
    the values: ``"same_kind"`` narrowing an integer."""
    if casting != "same_kind" or kind(dst) not in ("u", "i"):
        return False
    if src is None:
        return True
    return kind(src) in ("u", "i") and src != dst and not np.can_cast(src, dst, "safe")


def misfit(a: Any, dst: np.dtype[Any], casting: str) -> str | None:
    """The values of ``a`` (an array, a numpy scalar or a Python int) that refuse its cast to
    ``dst``, when that narrows an integer past one of them under ``casting="same_kind"``
    (``"1 to 300"``: the least and the greatest); None when the cast is not refused."""
    py = type(a) is int
    src = None if py else np.asarray(a).dtype
    if not narrowed(src, dst, casting):
        return None
    if py:
        lo = hi = int(a)
    else:
        arr = np.asarray(a)
        if arr.size == 0:
            return None
        if arr.dtype.kind not in "ui":
            arr = arr.astype(np.int8)  # int2 / int4 / uint2 / uint4: each value fits an int8
        lo, hi = int(arr.min()), int(arr.max())
    bounds = _range(dst)
    if bounds[0] <= lo and hi <= bounds[1]:
        return None
    return f"{lo}" if lo == hi else f"{lo} to {hi}"


def int_range(dst: np.dtype[Any]) -> str:
    """``dst``'s range, for messages (``"range -128 to 127"``)."""
    lo, hi = _range(dst)
    return f"range {lo} to {hi}"


def check_values(a: Any, dst: np.dtype[Any], casting: str, *, url: str, path: KeyPath) -> None:
    """Refuse (:class:`~quire.errors.LossyCastError`) the cast of ``a`` (an array, a numpy
    scalar or a Python int) to ``dst`` when it narrows an integer past one of its values
    under ``casting="same_kind"``."""
    found = misfit(a, dst, casting)
    if found is None:
        return
    src = None if type(a) is int else np.asarray(a).dtype
    why = (
        f"saved {src or 'int'} values {found} do not fit the target's {dst} ({int_range(dst)}); "
        "casting='same_kind' narrows an integer only when every value fits"
    )
    raise LossyCastError(
        f"{url}: leaf {keystr(path)!r}: {why}. To fix: {allow_hint(src or np.dtype(np.int64))}",
        mismatched=[f"{keystr(path)!r}: {why}"],
    )


def jax_dtype(dtype: np.dtype[Any]) -> np.dtype[Any]:
    """The dtype a ``jax.Array`` of ``dtype`` really holds: a 64-bit type's 32-bit one while
    ``jax_enable_x64`` is off (JAX's default), else ``dtype`` itself."""
    return np.dtype(jax.dtypes.canonicalize_dtype(dtype))


def to_jax_dtype(
    a: np.ndarray, named: np.dtype[Any], *, url: str, path: KeyPath, saved: Any = None
) -> np.ndarray:
    """``a`` (values of the dtype ``named`` a target asks for, or that cast to it exactly)
    as :func:`jax_dtype` of ``named``, the dtype its ``jax.Array`` will hold; refused
    (:class:`~quire.errors.LossyCastError`) when a value does not fit it: an integer out of
    its range, or a finite number that would become inf.  ``saved`` names the saved dtype in
    the message (default: ``a``'s)."""
    real = jax_dtype(named)
    if a.dtype == real:
        return a
    if real == named:
        return a.astype(real)
    if a.dtype != named:
        a = a.astype(named)
    found = None
    if kind(real) in ("u", "i"):
        lo, hi = _range(real)
        if a.size and (int(a.min()) < lo or int(a.max()) > hi):
            found = f"{int(a.min())} to {int(a.max())}"
            found += f" do not fit {real} (range {lo} to {hi})"
        out = a.astype(real)
    else:
        with np.errstate(over="ignore", invalid="ignore"):
            out = a.astype(real)
        bad = ~np.isfinite(out)
        if bad.any():
            bad &= np.isfinite(a)
        if bad.any():
            found = f"{a[bad].flat[0]} (and any others past {np.finfo(real).max:g}) become inf in {real}"
    if found is None:
        return out
    src = np.dtype(saved) if saved is not None else named
    why = (
        f"a jax.Array of {named} is {real} while jax_enable_x64 is off (JAX's default): "
        f"saved {src} values {found}"
    )
    fix = (
        "turn on 64-bit types in JAX before making any array "
        "(jax.config.update('jax_enable_x64', True)), or load this leaf as numpy (a numpy "
        f"target such as np.zeros(shape, {named})), or name {real} as the target's dtype "
        + ("with casting='unsafe' to take the wrapped values" if kind(real) in ("u", "i") else "")
    ).rstrip()
    raise LossyCastError(
        f"{url}: leaf {keystr(path)!r}: {why}. To fix: {fix}",
        mismatched=[f"{keystr(path)!r}: {why}"],
    )
