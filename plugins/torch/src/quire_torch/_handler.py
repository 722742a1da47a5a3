"""The ``torch`` leaf handler: ``torch.Tensor`` leaves stored as quire's zarr v3 arrays.

A tensor is stored exactly like a numpy array of the same dtype (the ``numpy`` handler's
format: one zarr v3 array per leaf, crc32c on every chunk), plus its torch dtype in the
leaf record.  bfloat16 and the float8 dtypes map to their ``ml_dtypes`` equivalents, so
the arrays read as such with plain zarr; dtypes numpy has no equivalent for
(``complex32``, ``float4_e2m1fn_x2``, ``bits*``) are stored as their raw bytes, shape
``(*shape, itemsize)`` of uint8, with the tensor's shape in the record.

Loading restores a ``torch.Tensor`` when the target is None, ``torch.Tensor`` or a tensor
(then with that tensor's dtype and device), and a numpy or jax array (or a Python scalar)
when the target asks for one.

torch is imported only when a tensor is seen (a value can only be a tensor once torch is
imported) or a tensor leaf is loaded, so having quire-torch installed costs nothing to
programs that do not use torch.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from quire.errors import CorruptCheckpointError, UnsupportedLeafError
from quire.handlers import LoadContext, LoadEntry, SaveContext, SaveEntry, StoredObject

__all__ = ["TorchTensorHandler"]

# torch dtypes numpy has natively (``Tensor.numpy()`` works).
_NATIVE = frozenset(
    [
        "bool",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "int8",
        "int16",
        "int32",
        "int64",
        "float16",
        "float32",
        "float64",
        "complex64",
        "complex128",
    ]
)
# torch dtypes with an ml_dtypes equivalent of the same name and size.
_ML_DTYPES = frozenset(
    [
        "bfloat16",
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
    ]
)
_UINT_OF_SIZE = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _keystr(path: tuple[Any, ...]) -> str:
    return "/".join(str(k) for k in path) if path else "<root>"


def _torch() -> Any:
    import torch

    return torch


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class _Converted:
    """A tensor turned into what the numpy handler stores, plus the record's extras."""

    entry: SaveEntry
    extras: dict[str, Any]


class TorchTensorHandler:
    """``torch.Tensor`` leaves (CPU; every dtype; views and non-contiguous tensors)."""

    id = "torch"
    priority = 0

    def __init__(self) -> None:
        from quire.handlers import NumpyArrayHandler

        # Tensors are stored in the numpy handler's array format.
        self._arrays = NumpyArrayHandler()

    @property
    def types(self) -> tuple[type, ...]:
        """``(torch.Tensor,)`` once torch is imported (no tensor can exist before)."""
        torch = sys.modules.get("torch")
        return (torch.Tensor,) if torch is not None else ()

    def handles(self, value: Any) -> bool:
        torch = sys.modules.get("torch")
        return torch is not None and isinstance(value, torch.Tensor)

    def handles_abstract(self, abstract: Any) -> bool:
        return True

    # -- save -------------------------------------------------------------------------
    def _convert(self, e: SaveEntry) -> _Converted:
        if isinstance(e.value, _Converted):
            return e.value
        torch = _torch()
        t = e.value
        where = f"leaf {_keystr(e.path)!r}"
        if t.is_quantized:
            raise UnsupportedLeafError(
                f"{where}: quantized tensors ({t.dtype}) are not supported; save "
                "t.dequantize() or t.int_repr() with the scale and zero point"
            )
        if t.layout != torch.strided:
            raise UnsupportedLeafError(
                f"{where}: {t.layout} tensors are not supported; save t.to_dense()"
            )
        if t.device.type == "meta":
            raise UnsupportedLeafError(f"{where}: a meta tensor has no data to save")
        t = t.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.resolve_conj().resolve_neg().contiguous()
        name = _dtype_name(t.dtype)
        extras: dict[str, Any] = {"torch_dtype": name}
        if name in _NATIVE:
            arr = t.numpy()
        elif name in _ML_DTYPES:
            import ml_dtypes

            size = t.element_size()
            raw = t.view(getattr(torch, f"uint{8 * size}") if size > 1 else torch.uint8)
            arr = raw.numpy().view(np.dtype(getattr(ml_dtypes, name)))
        else:
            extras["torch_shape"] = list(t.shape)
            arr = t.reshape(-1).view(torch.uint8).numpy().reshape(*t.shape, t.element_size())
        return _Converted(replace(e, value=arr), extras)

    def snapshot(self, entries: Sequence[SaveEntry]) -> list[SaveEntry]:
        conv = [self._convert(e) for e in entries]
        snaps = self._arrays.snapshot([c.entry for c in conv])
        return [replace(e, value=_Converted(s, c.extras)) for e, s, c in zip(entries, snaps, conv)]

    async def save(self, entries: Sequence[SaveEntry], ctx: SaveContext) -> list[dict[str, Any]]:
        conv = [self._convert(e) for e in entries]
        records = await self._arrays.save([c.entry for c in conv], ctx)
        return [{**r, **c.extras, "handler": self.id} for r, c in zip(records, conv)]

    # -- load -------------------------------------------------------------------------
    @staticmethod
    def _wants_tensor(target: Any) -> bool:
        if target is None:
            return True
        torch = sys.modules.get("torch")
        if torch is None:
            return False
        if isinstance(target, type):
            return issubclass(target, torch.Tensor)
        return isinstance(target, torch.Tensor)

    @staticmethod
    def _saved_shape(rec: Mapping[str, Any]) -> tuple[int, ...]:
        return tuple(rec.get("torch_shape", rec["shape"]))

    def check(self, entry: LoadEntry) -> str | None:
        t = entry.target
        if t is None or isinstance(t, type):
            return None
        if not self._wants_tensor(t):
            if "torch_shape" in entry.record:
                return (
                    f"saved as torch.{entry.record.get('torch_dtype')}, which numpy and jax "
                    "have no dtype for; load it as a torch tensor"
                )
            return self._arrays.check(entry)
        saved = self._saved_shape(entry.record)
        if tuple(t.shape) != saved:
            return (
                f"saved shape {saved} torch.{entry.record.get('torch_dtype')}, "
                f"target shape {tuple(t.shape)}"
            )
        return None

    async def load(self, entries: Sequence[LoadEntry], ctx: LoadContext) -> list[Any]:
        as_tensor = [self._wants_tensor(e.target) for e in entries]
        inner = [replace(e, target=None) if w else e for e, w in zip(entries, as_tensor)]
        for e, w in zip(entries, as_tensor):
            if not w and "torch_shape" in e.record:
                raise UnsupportedLeafError(f"{ctx.url}: leaf {_keystr(e.path)!r}: {self.check(e)}")
        arrays = await self._arrays.load(inner, ctx)
        return [
            self._to_tensor(a, e, ctx) if w else a for a, e, w in zip(arrays, entries, as_tensor)
        ]

    def _to_tensor(self, arr: np.ndarray, e: LoadEntry, ctx: LoadContext) -> Any:
        torch = _torch()
        name = e.record.get("torch_dtype", _dtype_name(arr.dtype))
        dtype = getattr(torch, name, None) if isinstance(name, str) else None
        if not isinstance(dtype, torch.dtype):
            raise CorruptCheckpointError(
                f"{ctx.url}: leaf {_keystr(e.path)!r} names torch dtype {name!r}, which this "
                f"torch ({torch.__version__}) does not have"
            )
        if not arr.flags.c_contiguous:  # (np.ascontiguousarray would make 0-d arrays 1-d)
            arr = arr.copy()
        if "torch_shape" in e.record:
            shape = self._saved_shape(e.record)
            t = torch.from_numpy(arr.reshape(-1)).view(dtype).reshape(shape)
        elif arr.dtype.kind == "V" or name in _ML_DTYPES:
            t = torch.from_numpy(arr.view(_UINT_OF_SIZE[arr.dtype.itemsize])).view(dtype)
        else:
            t = torch.from_numpy(arr)
            if t.dtype != dtype:
                t = t.to(dtype)
        target = e.target
        if target is not None and not isinstance(target, type):
            t = t.to(device=target.device, dtype=target.dtype)
        return t

    def metadata(self, records: Sequence[Mapping[str, Any]]) -> list[Any]:
        return self._arrays.metadata(records)

    async def objects(
        self, entries: Sequence[LoadEntry], ctx: LoadContext
    ) -> list[list[StoredObject]]:
        """The zarr array objects of each tensor, with their checks (for verify and cp)."""
        return await self._arrays.objects(entries, ctx)
