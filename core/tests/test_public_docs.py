"""Every public function and method has a numpydoc docstring, with a "Parameters" section
where it takes parameters.

Public means: the names in ``quire.__all__`` (and the public names of the modules listed
there), and the public names of ``quire.handlers``, ``quire.backends``, ``quire.sources``,
``quire.surgery`` and ``quire.testing``; for a class, its own and its quire base classes'
public methods and properties, and its constructor (documented in the class docstring, as
numpydoc does; a dataclass may say "Attributes" instead).  The ``test_*`` methods of the
conformance suites in ``quire.testing`` are tests, not API, and are left out.
"""

from __future__ import annotations

import importlib
import inspect
import re
import types
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import quire

MODULES = ["quire", "quire.handlers", "quire.backends", "quire.sources", "quire.surgery"]
MODULES += ["quire.testing"]
_SECTION = r"^{}\n-{{3,}}$"
PARAMETERS = re.compile(_SECTION.format("Parameters"), re.M)
FIELDS = re.compile(_SECTION.format("(Parameters|Attributes)"), re.M)


def _public(mod: types.ModuleType) -> Iterator[tuple[str, Any]]:
    names = getattr(mod, "__all__", None)
    if names is None:
        names = [n for n in vars(mod) if not n.startswith("_")]
    for n in names:
        obj = getattr(mod, n)
        if isinstance(obj, types.ModuleType):
            if obj.__name__.startswith("quire"):
                yield n, obj
        elif (getattr(obj, "__module__", None) or "").startswith("quire"):
            yield n, obj


def _params(fn: Callable[..., Any]) -> list[str]:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return []
    return [p for p in sig.parameters if p not in ("self", "cls")]


def _check_function(
    where: str, fn: Callable[..., Any], out: list[str], base_docs: tuple[str, ...] = ()
) -> None:
    """``base_docs``: the docstrings of the methods ``fn`` overrides; an override may say
    only what differs when a base documents the parameters."""
    doc = inspect.getdoc(fn)
    if not doc:
        out.append(f"{where}: no docstring")
    elif (
        _params(fn)
        and not PARAMETERS.search(doc)
        and not any(PARAMETERS.search(d) for d in base_docs)
    ):
        out.append(f"{where}: no Parameters section for ({', '.join(_params(fn))})")


def _own_init_params(cls: type) -> list[str]:
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is not None:
            if not (klass.__module__ or "").startswith("quire"):
                return []  # object's, Protocol's, Exception's: nothing of ours to document
            params = _params(init)
            # (*args, **kwargs) passes through to a base: nothing of its own to document
            return [] if params == ["args", "kwargs"] else params
    return []


def _check_class(where: str, cls: type, out: list[str]) -> None:
    doc = inspect.getdoc(cls) if cls.__doc__ else None
    if not doc:
        out.append(f"{where}: no docstring")
    params = _own_init_params(cls)
    if params:
        init_doc = inspect.getdoc(cls.__init__) or ""
        if not FIELDS.search(doc or "") and not PARAMETERS.search(init_doc):
            out.append(f"{where}: no Parameters section for the constructor ({', '.join(params)})")
    seen: set[str] = set()
    for klass in cls.__mro__:
        if not (klass.__module__ or "").startswith("quire"):
            continue
        for name, attr in vars(klass).items():
            if name.startswith("_") or name in seen:
                continue
            seen.add(name)
            if "testing" in klass.__module__ and name.startswith("test_"):
                continue
            member = f"{where}.{name}"
            if isinstance(attr, property):
                if not inspect.getdoc(attr):
                    out.append(f"{member}: no docstring")
                continue
            if isinstance(attr, staticmethod | classmethod):
                attr = attr.__func__
            if inspect.isfunction(attr):
                bases = tuple(
                    inspect.cleandoc(getattr(k, name).__doc__ or "")
                    for k in klass.__mro__[1:]
                    if name in vars(k)
                )
                # getattr on the class, so a method inherits its base method's docstring
                _check_function(member, getattr(cls, name), out, bases)


def problems() -> list[str]:
    out: list[str] = []
    seen: set[int] = set()

    def walk(modname: str, mod: types.ModuleType, top: bool) -> None:
        for name, obj in _public(mod):
            if id(obj) in seen:
                continue
            seen.add(id(obj))
            where = f"{modname}.{name}"
            if isinstance(obj, types.ModuleType):
                if top:
                    walk(obj.__name__, obj, False)
            elif inspect.isclass(obj):
                _check_class(where, obj, out)
            elif callable(obj):
                _check_function(where, obj, out)

    for m in MODULES:
        walk(m, importlib.import_module(m), True)
    return out


def test_public_api_has_numpydoc() -> None:
    found = problems()
    assert not found, "public API without numpydoc:\n" + "\n".join(found)


def test_the_walk_sees_what_it_should() -> None:
    """The walker reaches the Checkpointer's methods and flags an undocumented function."""

    def bare(x: int) -> int:
        return x

    out: list[str] = []
    _check_function("f", bare, out)
    assert out == ["f: no docstring"]
    out = []
    _check_class("quire.Checkpointer", quire.Checkpointer, out)
    assert not [p for p in out if "Checkpointer.load:" in p]
    names = {n for k in quire.Checkpointer.__mro__ for n in vars(k)}
    assert {"load", "gc", "save", "steps"} <= names


@pytest.mark.parametrize("fn", [quire.save, quire.save_async, quire.partial.save])
def test_save_options_reject_unknown_keywords(tmp_path: Any, fn: Callable[..., Any]) -> None:
    with pytest.raises(TypeError, match="unexpected keyword argument 'overwrit'"):
        fn(str(tmp_path / "c"), {"a": 1}, overwrit=True)
    assert not (tmp_path / "c").exists()
