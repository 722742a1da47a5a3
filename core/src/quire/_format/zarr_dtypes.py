"""zarr v3 data types for ml_dtypes' bfloat16 / float8 / sub-byte int types.

zarr-python does not ship these, so quire declares them in zarr's own ``zarr.data_type``
entry-point group and, because zarr 3.1 never loads that group, registers them when this
module is imported: by quire's array handlers (any save or load of arrays) and by
:func:`quire.zarr_store`.  quire's own encoder needs them too: a compressed chunk goes through
zarr's codecs, which ask zarr for the array's data type.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import ml_dtypes
import numpy as np
from zarr.core.dtype.common import DataTypeValidationError
from zarr.core.dtype.npy.float import BaseFloat
from zarr.core.dtype.npy.int import BaseInt


def _make(name: str) -> type[BaseFloat[Any, Any]]:
    d = np.dtype(getattr(ml_dtypes, name))

    @dataclass(frozen=True, kw_only=True)
    class _MLFloat(BaseFloat[Any, Any]):
        dtype_cls = type(d)
        _zarr_v3_name: ClassVar[str] = name  # type: ignore[misc]
        _zarr_v2_names: ClassVar[tuple[str, ...]] = ()

        @property
        def item_size(self) -> int:
            return d.itemsize

        def to_native_dtype(self) -> Any:
            return d

    _MLFloat.__name__ = _MLFloat.__qualname__ = "".join(p.capitalize() for p in name.split("_"))
    return _MLFloat


BFloat16 = _make("bfloat16")
Float8E4M3FN = _make("float8_e4m3fn")
Float8E5M2 = _make("float8_e5m2")
Float8E4M3FNUZ = _make("float8_e4m3fnuz")
Float8E5M2FNUZ = _make("float8_e5m2fnuz")
Float8E4M3B11FNUZ = _make("float8_e4m3b11fnuz")
Float8E4M3 = _make("float8_e4m3")
Float8E3M4 = _make("float8_e3m4")
Float8E8M0FNU = _make("float8_e8m0fnu")


def _make_int(name: str) -> type[BaseInt[Any, Any]]:
    """A zarr data type for one of ml_dtypes' sub-byte ints: one value per byte, as numpy
    (and tensorstore's ``zarr3`` driver) store them; no zarr v2 spelling."""
    d = np.dtype(getattr(ml_dtypes, name))

    @dataclass(frozen=True, kw_only=True)
    class _MLInt(BaseInt[Any, Any]):
        dtype_cls = type(d)
        _zarr_v3_name: ClassVar[str] = name  # type: ignore[misc]
        _zarr_v2_names: ClassVar[tuple[str, ...]] = ()

        @classmethod
        def from_native_dtype(cls, dtype: Any) -> _MLInt:
            if cls._check_native_dtype(dtype):
                return cls()
            raise DataTypeValidationError(f"Invalid data type: {dtype}. Expected {d}")

        def to_native_dtype(self) -> Any:
            return d

        @classmethod
        def _from_json_v2(cls, data: Any) -> _MLInt:
            raise DataTypeValidationError(f"{name} has no zarr v2 spelling, got {data!r}")

        @classmethod
        def _from_json_v3(cls, data: Any) -> _MLInt:
            if cls._check_json_v3(data):
                return cls()
            raise DataTypeValidationError(f"expected the string {name!r}, got {data!r}")

        def to_json(self, zarr_format: Any) -> Any:
            if zarr_format == 3:
                return name
            raise ValueError(f"{name} has no zarr v2 spelling")

        @property
        def item_size(self) -> int:
            return d.itemsize

    _MLInt.__name__ = _MLInt.__qualname__ = name.capitalize().replace("Uint", "UInt")
    return _MLInt


Int4 = _make_int("int4")
UInt4 = _make_int("uint4")
Int2 = _make_int("int2")
UInt2 = _make_int("uint2")

_ZARR_TYPES = (
    BFloat16,
    Float8E4M3FN,
    Float8E5M2,
    Float8E4M3FNUZ,
    Float8E5M2FNUZ,
    Float8E4M3B11FNUZ,
    Float8E4M3,
    Float8E3M4,
    Float8E8M0FNU,
    Int4,
    UInt4,
    Int2,
    UInt2,
)


def register_with_zarr() -> None:
    """Register the ml_dtypes data types with zarr-python's registry (idempotent).

    The ``zarr.data_type`` entry points declare them too, but zarr 3.1 never loads that
    group, so quire registers them explicitly (on this module's import).
    """
    from zarr.core.dtype import data_type_registry

    for cls in _ZARR_TYPES:
        name = cls._zarr_v3_name
        if name not in data_type_registry.contents:
            data_type_registry.register(name, cls)


register_with_zarr()
