"""``quire diff A B``: structure, shapes, dtypes, metadata and (optionally) values.

Works on :class:`quire._describe.Tree` descriptions, so any source that can describe its
leaves and read their values can be compared.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from quire._describe import Tree


@dataclass
class DiffReport:
    """Differences between two trees; ``same`` when there are none."""

    only_a: list[str] = field(default_factory=list)
    only_b: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)  # one line per differing leaf
    metadata: list[str] = field(default_factory=list)
    values_compared: int = 0

    @property
    def same(self) -> bool:
        return not (self.only_a or self.only_b or self.changed or self.metadata)


def _as_np(v: Any) -> np.ndarray:
    if hasattr(v, "dtype") and str(v.dtype).startswith("key<"):
        import jax

        v = jax.random.key_data(v)
    return np.asarray(v)


def compare(
    a: Tree,
    b: Tree,
    *,
    values: bool = False,
    atol: float = 0.0,
    rtol: float = 0.0,
) -> DiffReport:
    """Compare two descriptions; with ``values``, also every leaf's values (exact, or
    ``|a - b| <= atol + rtol * |b|`` when a tolerance is given)."""
    r = DiffReport()
    r.only_a = sorted(set(a.leaves) - set(b.leaves))
    r.only_b = sorted(set(b.leaves) - set(a.leaves))
    common = sorted(set(a.leaves) & set(b.leaves))
    for k in common:
        la, lb = a.leaves[k], b.leaves[k]
        if la.kind != lb.kind:
            r.changed.append(f"{k}: {la.kind} vs {lb.kind}")
        elif la.kind == "array" and (la.shape, la.dtype) != (lb.shape, lb.dtype):
            r.changed.append(f"{k}: {la.dtype}{list(la.shape)} vs {lb.dtype}{list(lb.shape)}")
        elif la.kind == "inline" and la.value != lb.value:
            r.changed.append(f"{k}: {la.value} vs {lb.value}")
    for key in sorted(set(a.custom) | set(b.custom)):
        va, vb = a.custom.get(key, "<absent>"), b.custom.get(key, "<absent>")
        if va != vb:
            r.metadata.append(f"{key}: {va!r} vs {vb!r}")
    if values and a.read is not None and b.read is not None:
        bad = {line.split(":", 1)[0] for line in r.changed}
        va, vb = a.read(), b.read()
        for k in common:
            if k in bad or k not in va or k not in vb:
                continue
            r.values_compared += 1
            x, y = va[k], vb[k]
            if a.leaves[k].kind == "inline":
                if x != y:
                    r.changed.append(f"{k}: value {x!r} vs {y!r}")
                continue
            xa, ya = _as_np(x), _as_np(y)
            if atol or rtol:
                fx, fy = xa.astype(np.float64), ya.astype(np.float64)
                ok = np.isclose(fx, fy, atol=atol, rtol=rtol, equal_nan=True)
                if not ok.all():
                    n = int((~ok).sum())
                    err = float(np.nanmax(np.abs(fx - fy)))
                    r.changed.append(
                        f"{k}: {n} of {ok.size} values differ beyond atol={atol} rtol={rtol} "
                        f"(max |a-b| {err:.6g})"
                    )
            elif not np.array_equal(xa, ya, equal_nan=xa.dtype.kind in "fc"):
                if xa.dtype.kind in "fciu":
                    diff = xa.astype(np.float64) != ya.astype(np.float64)
                    n = int(diff.sum())
                    err = float(np.nanmax(np.abs(xa.astype(np.float64) - ya.astype(np.float64))))
                    r.changed.append(f"{k}: {n} of {xa.size} values differ (max |a-b| {err:.6g})")
                else:
                    r.changed.append(f"{k}: values differ")
    return r


def render(r: DiffReport, a: Tree, b: Tree) -> list[str]:
    lines = [f"--- {a.url}", f"+++ {b.url}"]
    lines += [f"- {k}  (only in A)" for k in r.only_a]
    lines += [f"+ {k}  (only in B)" for k in r.only_b]
    lines += [f"~ {line}" for line in r.changed]
    lines += [f"~ metadata {line}" for line in r.metadata]
    if r.same:
        extra = f", values of {r.values_compared} leaves equal" if r.values_compared else ""
        lines.append(f"same structure, shapes, dtypes and metadata ({len(a.leaves)} leaves{extra})")
    return lines
