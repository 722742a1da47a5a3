"""``quire.diff`` / ``quire diff A B``: two checkpoints or sources, compared.

Both sides are opened with :func:`quire.open`, so any pairing works: two quire checkpoints
(either layout), a quire checkpoint and the safetensors file or HF directory it was
converted from, an Orbax checkpoint (with quire-orbax installed) and anything else.
Structure, shapes, dtypes and metadata come from the sources' headers; values, when asked
for, are read block by block (``block_bytes`` per side at a time, aligned to the stored
chunks when the source says what they are), so memory stays bounded whatever the size.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from quire._runtime import ioloop as _io
from quire._runtime import progress as _progress
from quire._sources.base import Source
from quire._sources.lazy import LazyValue, Region
from quire._sources.opening import opened

__all__ = ["DiffReport", "diff"]

DEFAULT_BLOCK_BYTES = 64 << 20


@dataclass
class DiffReport:
    """What :func:`quire.diff` found; :attr:`same` when nothing differs.

    Attributes
    ----------
    a, b : str
        The two URLs compared.
    formats : tuple of str
        The source format of each side (``"quire"``, ``"safetensors"``, ``"orbax"``, ...).
    leaves : int
        Leaves present on both sides.
    only_a, only_b : list of str
        Key paths of leaves present on one side only, ``"/"``-joined (a key that holds
        ``/`` or could otherwise read as more than one is quoted: ``'a/b'``).
    changed : list of str
        One line per difference on a common path: container kind, leaf kind, shape, dtype,
        and (when values were compared) the number of differing values with the largest
        ``|a - b|`` and the first differing index.
    metadata : list of str
        One line per differing metadata key.
    notes : list of str
        What was not compared, and why (e.g. metadata of two different formats).
    values_compared : int
        Leaves whose values were compared.
    bytes_compared : int
        Bytes read per side to compare values.
    metadata_compared : bool
        Whether user metadata was compared (see ``metadata=`` of :func:`quire.diff`).
    """

    a: str = ""
    b: str = ""
    formats: tuple[str, str] = ("", "")
    leaves: int = 0
    only_a: list[str] = field(default_factory=list)
    only_b: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)
    metadata: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    values_compared: int = 0
    bytes_compared: int = 0
    metadata_compared: bool = False

    @property
    def same(self) -> bool:
        """No difference found (notes do not count)."""
        return not (self.only_a or self.only_b or self.changed or self.metadata)

    def lines(self) -> list[str]:
        """The report as ``quire diff`` prints it (``-`` only in A, ``+`` only in B, ``~``
        differs)."""
        out = [f"--- {self.a} ({self.formats[0]})", f"+++ {self.b} ({self.formats[1]})"]
        out += [f"- {k}  (only in A)" for k in self.only_a]
        out += [f"+ {k}  (only in B)" for k in self.only_b]
        out += [f"~ {line}" for line in self.changed]
        out += [f"~ metadata {line}" for line in self.metadata]
        out += [f"# {n}" for n in self.notes]
        if self.same:
            extra = (
                f", values of {self.values_compared} leaves equal" if self.values_compared else ""
            )
            what = "shapes, dtypes and metadata" if self.metadata_compared else "shapes and dtypes"
            out.append(f"same structure, {what} ({self.leaves} leaves{extra})")
        return out


def diff(
    a: str | os.PathLike[str] | Source,
    b: str | os.PathLike[str] | Source,
    *,
    values: bool = False,
    atol: float | None = None,
    rtol: float | None = None,
    metadata: bool | None = None,
    storage_options: dict[str, Any] | None = None,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    progress: Any = None,
) -> DiffReport:
    """Compare two checkpoints or sources: structure, shapes, dtypes, metadata, values.

    Parameters
    ----------
    a, b : str, path or quire.sources.Source
        What to compare: anything :func:`quire.open` opens (a quire checkpoint in either
        layout, a ``.safetensors`` file, an HF directory, an Orbax checkpoint with
        quire-orbax installed) on any fsspec URL, or an already opened :class:`quire.sources.Source`
        (to give each side its own storage options or ``format=``). Sources passed in are
        not closed.
    values : bool, default False
        Also compare the values of every array and inline leaf whose kind, shape and dtype
        agree. Implied by ``atol`` or ``rtol``.
    atol, rtol : float, optional
        Compare values with this tolerance, as :func:`numpy.isclose` does
        (``|a - b| <= atol + rtol * |b|``, in float64 for floats; for ints in exact integer
        arithmetic); without either, values must be equal (NaNs at the same places count
        as equal). Bools always compare exactly.
    metadata : bool, optional
        Compare the sides' user metadata (a quire checkpoint's ``metadata=``, a
        safetensors ``__metadata__``, an Orbax checkpoint's ``custom_metadata``, another
        source's whole ``metadata``). Default: only when both sides are in the same
        format, since formats keep different things there.
    storage_options : dict, optional
        fsspec options for opening ``a`` and ``b`` by URL.
    block_bytes : int, default 64 MiB
        Values are read in blocks of at most about this many bytes per side (whole stored
        chunks when they fit), so memory stays bounded by the block, not the checkpoint.
    progress : bool or callable, optional
        Report the value pass (bytes, leaves) as ``quire.save(progress=...)`` does.

    Returns
    -------
    DiffReport
        ``report.same`` is True when nothing differs; ``report.lines()`` is what
        ``quire diff`` prints.

    Raises
    ------
    CheckpointNotFoundError
        ``a`` or ``b`` is not something an installed source recognises.
    CorruptCheckpointError
        A value read fails its checks.

    Examples
    --------
    >>> report = quire.diff("run/step_100", "model.safetensors", atol=1e-6)  # doctest: +SKIP
    >>> print("\\n".join(report.lines()))  # doctest: +SKIP
    """
    if block_bytes < 1:
        raise ValueError(f"block_bytes must be positive, got {block_bytes}")
    with contextlib.ExitStack() as stack:
        sa = stack.enter_context(opened(a, storage_options))
        sb = stack.enter_context(opened(b, storage_options))
        return _compare(sa, sb, values or atol is not None or rtol is not None,
                        atol, rtol, metadata, block_bytes, progress)  # fmt: skip


# ----------------------------------------------------------------------------- structure
Path = tuple[Any, ...]  # a leaf's key path, int keys as str (a list index matches a "0" key)


def _key(path: Path) -> str:
    """The printed form of a key path: ``"/"``-joined, a key that could read as more
    than one (holding ``/``, empty, or starting with a quote, ``[`` or ``<``) quoted as
    Python does, an int key that a str key of its dict shadows as ``[n]``."""
    return "/".join(_part(k) for k in path) if path else "<root>"


def _part(k: Any) -> str:
    if not isinstance(k, str):
        return f"[{k}]"
    return repr(k) if not k or "/" in k or k[0] in "'\"[<" else k


def _flatten(tree: Any) -> tuple[dict[Path, Any], dict[Path, str]]:
    """({key path: leaf}, {key path: container kind}) of a source tree."""
    leaves: dict[Path, Any] = {}
    containers: dict[Path, str] = {}

    def rec(node: Any, path: Path) -> None:
        if isinstance(node, LazyValue) or not isinstance(node, dict | list | tuple):
            leaves[path] = node
            return
        kind = "dict" if isinstance(node, dict) else "list" if isinstance(node, list) else "tuple"
        containers[path] = kind
        items = list(node.items() if isinstance(node, dict) else enumerate(node))
        names = {k for k, _ in items if isinstance(k, str)}
        for k, v in items:
            rec(v, (*path, k if isinstance(k, str) or str(k) in names else str(k)))

    rec(tree, ())
    return leaves, containers


def _is_key_array(v: Any) -> bool:
    return str(getattr(v, "dtype", "")).startswith("key<")


def _describe(v: Any) -> tuple[str, tuple[int, ...], str]:
    """(kind, shape, dtype or type name) of a leaf."""
    if isinstance(v, LazyValue):
        return "array", tuple(v.shape), v.dtype.name
    if hasattr(v, "shape") and hasattr(v, "dtype") and not isinstance(v, type):
        name = str(v.dtype) if _is_key_array(v) else np.dtype(v.dtype).name
        return "array", tuple(v.shape), name
    return "inline", (), type(v).__name__


def _show(d: tuple[str, tuple[int, ...], str]) -> str:
    return f"{d[2]}{list(d[1])}" if d[0] == "array" else d[2]


def _user_metadata(src: Source) -> dict[str, Any]:
    m = src.metadata if isinstance(src.metadata, dict) else {}
    if src.format == "quire":
        return dict(m.get("custom") or {})
    if src.format == "safetensors":
        return dict(m.get("__metadata__") or {})
    if "custom_metadata" in m:  # Orbax: the rest is layout and timestamps
        cm = m.get("custom_metadata")
        return dict(cm) if isinstance(cm, dict) else {"custom_metadata": cm}
    return dict(m)


def _compare(
    sa: Source, sb: Source, values: bool, atol: float | None, rtol: float | None,
    metadata: bool | None, block_bytes: int, progress: Any,
) -> DiffReport:  # fmt: skip
    r = DiffReport(sa.url, sb.url, (sa.format, sb.format))
    la, ca = _flatten(sa.tree)
    lb, cb = _flatten(sb.tree)
    r.only_a = sorted(_key(k) for k in set(la) - set(lb))
    r.only_b = sorted(_key(k) for k in set(lb) - set(la))
    for k in set(ca) & set(cb):
        if ca[k] != cb[k]:
            r.changed.append(f"{_key(k)}: {ca[k]} vs {cb[k]}")
    common = [k for k in la if k in lb]
    r.leaves = len(common)
    same_kind: list[Path] = []
    for k in common:
        da, db = _describe(la[k]), _describe(lb[k])
        if da != db:
            r.changed.append(f"{_key(k)}: {_show(da)} vs {_show(db)}")
        else:
            same_kind.append(k)
    if metadata is None:
        metadata = sa.format == sb.format
        if not metadata:
            r.notes.append(
                f"metadata not compared ({sa.format} vs {sb.format}); "
                "pass --metadata (metadata=True) to compare it anyway"
            )
    if metadata:
        r.metadata_compared = True
        ma, mb = _user_metadata(sa), _user_metadata(sb)
        for key in sorted(set(ma) | set(mb), key=str):
            va, vb = ma.get(key, "<absent>"), mb.get(key, "<absent>")
            if va != vb:
                r.metadata.append(f"{key}: {va!r} vs {vb!r}")
    if values:
        _values(r, [(_key(k), la[k], lb[k]) for k in same_kind], atol, rtol, block_bytes,
                progress)  # fmt: skip
    r.changed.sort(key=lambda line: line.split(": ", 1)[0])
    return r


# ----------------------------------------------------------------------------- values
def _values(
    r: DiffReport, pairs: list[tuple[str, Any, Any]], atol: float | None,
    rtol: float | None, block_bytes: int, progress: Any,
) -> None:  # fmt: skip

    arrays = [(k, x, y) for k, x, y in pairs if _describe(x)[0] == "array"]
    for k, x, y in pairs:
        if _describe(x)[0] == "inline":
            r.values_compared += 1
            if not _inline_equal(x, y):
                r.changed.append(f"{k}: value {x!r} vs {y!r}")
    total = sum(math.prod(_describe(x)[1]) * _itemsize(x) for _, x, _ in arrays)
    rep = _progress.make(progress, "diff", r.a, bytes_total=total, objects_total=len(arrays),
                         objects_name="leaves")  # fmt: skip

    async def run() -> None:
        for k, x, y in arrays:
            line = await _compare_array(r, k, x, y, atol, rtol, block_bytes, rep)
            r.values_compared += 1
            if line:
                r.changed.append(line)
            if rep is not None:
                rep.advance(0, 1)

    try:
        # The sources' own reads report nothing (None in effect): this pass counts bytes
        # compared (one side's) and leaves.
        _io.submit(_progress.tracked(None, run)).result()
        if rep is not None and rep is not progress:
            rep.set_total(rep.bytes_done, rep.objects_done)
    finally:
        if rep is not None and rep is not progress:
            rep.close()


def _inline_equal(x: Any, y: Any) -> bool:
    if type(x) is not type(y):
        return False
    if isinstance(x, float) and x != x:
        return y != y  # NaN equals NaN here, as in arrays
    try:
        return bool(x == y)
    except (TypeError, ValueError):  # e.g. an ambiguous truth value
        return repr(x) == repr(y)


def _itemsize(v: Any) -> int:
    return 8 if _is_key_array(v) else int(np.dtype(v.dtype).itemsize)


def _chunk_shape(v: Any) -> tuple[int, ...] | None:
    """The stored chunk shape, when the source's reader says (quire's does)."""
    reader = getattr(v, "reader", None)
    layout = getattr(reader, "layout", None)
    cs = getattr(layout, "chunk_shape", None)
    return tuple(int(c) for c in cs) if cs is not None and len(cs) == len(v.shape) else None


def blocks(
    shape: Sequence[int], itemsize: int, limit: int, unit: Sequence[int] | None = None
) -> Iterator[Region]:
    """Regions covering ``shape`` in C order, each at most about ``limit`` bytes.

    Blocks are whole multiples of ``unit`` (a stored chunk shape) when one unit fits in
    ``limit``, so no chunk is read twice; otherwise they ignore the chunking.
    """
    shape = tuple(int(n) for n in shape)
    if not shape:
        yield ()
        return
    if not all(shape):
        return
    u = tuple(max(1, min(int(c), n)) for c, n in zip(unit, shape)) if unit else None
    if u is None or math.prod(u) * itemsize > limit:
        u = (1,) * len(shape)
    n = len(shape)
    for k in range(n):
        # axes < k: one unit; axis k: a multiple of its unit; axes > k: whole.
        size = math.prod(u[: k + 1]) * math.prod(shape[k + 1 :]) * itemsize
        if size <= limit or k == n - 1:
            break
    step = u[k] * max(1, limit // max(1, size))
    step = min(step, shape[k]) if size <= limit else u[k]
    starts = [range(0, shape[j], u[j]) for j in range(k)] + [range(0, shape[k], step)]
    lens = [*u[:k], step]
    for origin in itertools.product(*starts):
        region = [slice(o, min(o + ln, shape[j])) for j, (o, ln) in enumerate(zip(origin, lens))]
        yield tuple(region + [slice(0, shape[j]) for j in range(k + 1, n)])


async def _read(v: Any, region: Region) -> np.ndarray:
    if isinstance(v, LazyValue):
        return await v.read_region(region)
    if _is_key_array(v):
        import jax

        return np.asarray(np.asarray(jax.random.key_data(v))[region])
    return np.asarray(np.asarray(v)[region])


def _numeric(x: np.ndarray) -> np.ndarray:
    """A float64/complex128 copy for tolerance arithmetic (ml_dtypes included)."""
    if x.dtype.kind == "c":
        return x.astype(np.complex128)
    return x.astype(np.float64)


def _int_gap(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """``|x - y|`` of two int arrays, exact as uint64 (no int64 wrap, no float rounding)."""
    if x.dtype.kind == "b":
        return (x != y).astype(np.uint64)
    big, small = np.maximum(x, y), np.minimum(x, y)
    return big.astype(np.uint64) - small.astype(np.uint64)  # wraps to the true gap < 2**64


def _int_beyond(gap: np.ndarray, y: np.ndarray, atol: float, rtol: float) -> np.ndarray:
    """``gap > atol + rtol * |y|`` decided exactly for an integer gap."""
    limit = np.floor(atol + rtol * np.abs(y.astype(np.float64)))
    huge = limit >= 2.0**64
    return ~huge & (gap > np.where(huge, 0, limit).astype(np.uint64))


async def _compare_array(
    r: DiffReport, k: str, x: Any, y: Any, atol: float | None, rtol: float | None,
    block_bytes: int, rep: Any,
) -> str | None:  # fmt: skip
    shape = tuple(_describe(x)[1])
    size = math.prod(shape)
    tol = atol is not None or rtol is not None
    unit = _chunk_shape(x) or _chunk_shape(y)
    ndiff: int = 0
    worst: float | int = 0
    first = None
    for region in blocks(shape, _itemsize(x), block_bytes, unit):
        xa, ya = await asyncio.gather(_read(x, region), _read(y, region))
        r.bytes_compared += xa.nbytes
        if rep is not None:
            rep.advance(xa.nbytes, 0)
        kind = xa.dtype.kind
        gap: np.ndarray | None = None
        if kind in "biu":  # ints and bools: exact integer arithmetic, never float64
            gap = _int_gap(xa, ya)
            bad = gap > 0
            if tol and kind != "b":
                bad &= _int_beyond(gap, ya, atol or 0.0, rtol or 0.0)
        elif kind in "fc" or (kind == "V" and xa.dtype.names is None and xa.dtype.itemsize <= 8):
            fx, fy = _numeric(xa), _numeric(ya)
            if tol:
                bad = ~np.isclose(fx, fy, atol=atol or 0.0, rtol=rtol or 0.0, equal_nan=True)
            else:
                bad = (fx != fy) & ~(np.isnan(fx) & np.isnan(fy))
            with np.errstate(invalid="ignore"):  # inf - inf is NaN; opposite infs: inf
                gap = np.where(np.isinf(fx) & np.isinf(fy) & (fx != fy), np.inf, abs(fx - fy))
        else:
            bad = np.asarray(xa != ya)
        if not bad.any():
            continue
        ndiff += int(bad.sum())
        if first is None:
            idx = np.argwhere(bad)[0]
            # (a PRNG key's data has a trailing axis the region does not cover)
            starts = [s.start for s in region] + [0] * (len(idx) - len(region))
            first = [int(i) + o for i, o in zip(idx, starts)]
        if gap is not None:
            err = gap[bad]
            err = err[~np.isnan(err)] if err.dtype.kind == "f" else err  # NaN vs a number
            if err.size:
                worst = max(worst, err.max().item())
    if not ndiff:
        return None
    how = f" beyond atol={atol or 0.0} rtol={rtol or 0.0}" if tol else ""
    return f"{k}: {ndiff} of {size} values differ{how} (max |a-b| {worst:.6g}, first at {first})"
