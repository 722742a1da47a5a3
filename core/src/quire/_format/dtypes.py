"""dtype names: the numpy / ml_dtypes dtypes a checkpoint may hold, by the names records
use (the ones tensorstore's ``zarr3`` driver uses).  Their zarr v3 data types are
:mod:`quire._format.zarr_dtypes`'.

Reading a record needs only the names and their sizes (:data:`ITEMSIZES`): numpy and
ml_dtypes are imported on the first use of a dtype itself (:func:`supported`), so that
``quire ls`` and ``quire info`` start at once.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

# Names of the ml_dtypes float types that may appear in a checkpoint.
ML_FLOAT_NAMES = (
    "bfloat16",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "float8_e4m3b11fnuz",
    "float8_e4m3",
    "float8_e3m4",
    "float8_e8m0fnu",
)
ML_INT_NAMES = ("int4", "uint4", "int2", "uint2")

#: Every dtype a record may name, with its size in bytes (numpy's ``itemsize``; a test
#: holds the two to each other).
ITEMSIZES: dict[str, int] = {
    "bool": 1,
    "int8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "uint8": 1,
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
    "float16": 2,
    "float32": 4,
    "float64": 8,
    "complex64": 8,
    "complex128": 16,
    "bfloat16": 2,
    **dict.fromkeys(ML_FLOAT_NAMES[1:], 1),
    **dict.fromkeys(ML_INT_NAMES, 1),  # one value per byte, as numpy stores them
}


@functools.cache
def supported() -> dict[str, np.dtype[Any]]:
    """The numpy dtype of every name of :data:`ITEMSIZES` that this numpy / ml_dtypes has."""
    import ml_dtypes  # heavy: the first dtype used, not the first record read
    import numpy as np

    out: dict[str, np.dtype[Any]] = {}
    for name in ITEMSIZES:
        t = getattr(ml_dtypes, name, None) if name in (*ML_FLOAT_NAMES, *ML_INT_NAMES) else name
        if t is not None:
            out[name] = np.dtype(t)
    return out


def dtype_name(dtype: Any) -> str:
    """Canonical name of a numpy/ml_dtypes dtype, or raise ``TypeError``."""
    import numpy as np  # imported already: ``dtype`` is one

    d = np.dtype(dtype)
    for name, cand in supported().items():
        if cand == d:
            return name
    raise TypeError(f"dtype {d} is not supported (supported: {', '.join(supported())})")


def dtype_from_name(name: str) -> np.dtype[Any]:
    """The numpy dtype for a canonical name; ``KeyError`` when unknown."""
    return supported()[name]
