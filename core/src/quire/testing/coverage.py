"""Which installed plugins have a conformance suite run against them.

Each suite subclass names the plugin it covers through a class attribute:
``BackendSuite.protocol``, ``CodecSuite.codec_id``, ``LeafHandlerSuite.handler_id`` and
``CheckpointableHandlerSuite.handler_id`` (a str, or a tuple of str for several names).
An entry point counts as covered when a suite covers its name in its group, or another
name of the same group whose entry point loads the same object (an alias, e.g. the
``file`` and ``local`` backends).
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

__all__ = ["Installed", "covered_by", "import_test_modules", "installed", "suites", "uncovered"]

# suite base class name -> (entry-point group, class attribute naming the plugin)
SUITES = {
    "BackendSuite": ("quire.backends", "protocol"),
    "CodecSuite": ("quire.codecs", "codec_id"),
    "LeafHandlerSuite": ("quire.leaf_handlers", "handler_id"),
    "CheckpointableHandlerSuite": ("quire.checkpointables", "handler_id"),
    "SourceSuite": ("quire.sources", "source_format"),
}


@dataclass(frozen=True)
class Installed:
    group: str
    name: str
    value: str
    distribution: str

    def __str__(self) -> str:
        return f"{self.group}:{self.name} ({self.value}, from {self.distribution})"


def installed(groups: Iterable[str] | None = None) -> list[Installed]:
    """Every installed entry point of quire's groups (a fresh scan, not the cache)."""
    from quire._runtime.registry import GROUPS, _dist

    out = set()
    for g in groups or GROUPS:
        for ep in entry_points(group=g):
            out.add(Installed(g, ep.name, ep.value, _dist(ep)[0]))
    return sorted(out, key=lambda i: (i.group, i.name, i.distribution))


def covered_by(cls: type) -> list[tuple[str, str]]:
    """The (group, name) pairs a suite subclass covers (empty for a base/abstract class)."""
    for base in cls.__mro__:
        spec = SUITES.get(base.__name__)
        if spec is None or not base.__module__.startswith("quire.testing"):
            continue
        group, attr = spec
        val = getattr(cls, attr, None)
        names = [val] if isinstance(val, str) else list(val) if isinstance(val, tuple) else []
        return [(group, n) for n in names if isinstance(n, str)]
    return []


def suites(*, collected_only: bool = True) -> list[type]:
    """Every subclass of a suite base defined so far (import test modules first).

    With ``collected_only``, only classes pytest collects (named ``Test*``).
    """
    bases: list[type] = []
    for modname in ("backend", "codec", "leaf", "checkpointable", "source"):
        mod = sys.modules.get(f"quire.testing.{modname}")
        for name in SUITES:
            b = getattr(mod, name, None) if mod is not None else None
            if isinstance(b, type):
                bases.append(b)
    seen: set[type] = set()
    stack: list[type] = list(bases)
    while stack:
        subs: list[type] = stack.pop().__subclasses__()
        for sub in subs:
            if sub not in seen:
                seen.add(sub)
                stack.append(sub)
    out = [c for c in seen if c not in bases]
    if collected_only:
        out = [c for c in out if c.__name__.startswith("Test")]
    return sorted(out, key=lambda c: (c.__module__, c.__qualname__))


def uncovered(
    classes: Iterable[type], *, ignore_distributions: Iterable[str] = ()
) -> list[Installed]:
    """Installed entry points no suite class in ``classes`` covers."""
    from quire._runtime.registry import canonical

    ignore = {canonical(d) for d in ignore_distributions}
    covered = {pair for c in classes for pair in covered_by(c)}
    rows = installed()
    covered_values = {(r.group, r.value) for r in rows if (r.group, r.name) in covered}
    return [
        r
        for r in rows
        if canonical(r.distribution) not in ignore
        and (r.group, r.name) not in covered
        and (r.group, r.value) not in covered_values
    ]


def import_test_modules(paths: Iterable[Path]) -> tuple[list[Any], dict[Path, str]]:
    """Import test modules by path (reusing ones already imported); returns
    (modules, {path: import error}).  Each module's folder is on ``sys.path`` while it
    imports, as pytest's default import mode arranges."""
    by_file = {}
    for m in list(sys.modules.values()):
        f = getattr(m, "__file__", None)
        if f:
            by_file[str(Path(f).resolve())] = m
    modules, errors = [], {}
    for p in paths:
        p = Path(p).resolve()
        if str(p) in by_file:
            modules.append(by_file[str(p)])
            continue
        name = "_quire_coverage_." + "_".join(p.with_suffix("").parts[-3:])
        spec = importlib.util.spec_from_file_location(name, p)
        if spec is None or spec.loader is None:
            errors[p] = "cannot import"
            continue
        mod = importlib.util.module_from_spec(spec)
        sys.path.insert(0, str(p.parent))
        sys.modules[name] = mod
        try:
            spec.loader.exec_module(mod)
        except (Exception, pytest_skip_exception()) as e:
            sys.modules.pop(name, None)
            errors[p] = f"{type(e).__name__}: {e}"
            continue
        finally:
            try:
                sys.path.remove(str(p.parent))
            except ValueError:
                pass
        modules.append(mod)
    return modules, errors


def pytest_skip_exception() -> type[BaseException]:
    """``pytest.skip``'s exception (a module calling importorskip at import time)."""
    import pytest

    return pytest.skip.Exception
