"""Plugin failures at load time are PluginErrors with a trustworthy fix; third-party
handler failures carry the key path; MultiProcessError is a quire error; no import cycle
between the registry, the handlers and the configuration."""

from __future__ import annotations

import ast
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import quire
from quire._format.record import record_checksum


def _craft(url: str, handler: str, plugins: dict[str, str]) -> None:
    quire.save(url, {"w": np.ones(3)})
    with open(f"{url}/quire.json") as f:
        doc = json.load(f)
    doc["units"]["pytree"]["tree"]["children"][0]["handler"] = handler
    doc["plugins"] = plugins
    doc["checksum"] = record_checksum(doc)
    with open(f"{url}/quire.json", "w") as f:
        json.dump(doc, f)


def test_unknown_distribution_in_the_record_is_quoted_never_advised(tmp_path: Path) -> None:
    url = str(tmp_path / "c")
    _craft(url, "acme-gone", {"quire.leaf_handlers:acme-gone": "evil-pkg"})
    with pytest.raises(quire.errors.PluginError) as info:
        quire.load(url)
    msg = str(info.value)
    assert "'acme-gone'" in msg
    assert "pip install evil-pkg" not in msg
    assert "the checkpoint says it was written with plugin distribution 'evil-pkg'" in msg.lower()
    assert info.value.group == "quire.leaf_handlers" and info.value.name == "acme-gone"


def test_first_party_distribution_in_the_record_is_advised(tmp_path: Path) -> None:
    url = str(tmp_path / "c")
    _craft(url, "orbax-array", {"quire.leaf_handlers:orbax-array": "quire-orbax"})
    with pytest.raises(quire.errors.PluginError, match=r"'orbax-array'.*pip install quire-orbax"):
        quire.load(url)


class _Broken:
    """A plugin whose framework is missing: it fails when instantiated."""

    id = "acme-broken"

    def __init__(self) -> None:
        raise ImportError("No module named 'acme_framework'")

    def handles(self, value: Any) -> bool:
        return False


@pytest.fixture
def broken(quire_fresh_registry: None) -> Iterator[None]:
    quire.handlers.register_leaf_handler(_Broken)
    yield
    quire.handlers.unregister_leaf_handler("acme-broken")


def test_a_handler_that_cannot_be_created_is_a_plugin_error(tmp_path: Path, broken: None) -> None:
    url = str(tmp_path / "c")
    _craft(url, "acme-broken", {})
    with pytest.raises(quire.errors.PluginError, match=r"'acme-broken'.*ImportError.*acme_framework"):
        quire.load(url)


class _Flaky:
    """A third-party handler whose save and load fail with a builtin error."""

    id = "acme-flaky"
    types = (complex,)

    def handles(self, value: Any) -> bool:
        return isinstance(value, complex)

    def handles_abstract(self, abstract: Any) -> bool:
        return False

    async def save(self, entries: Any, context: Any) -> list[dict[str, Any]]:
        if any(e.value == 1j for e in entries):
            raise ValueError("cannot encode 1j")
        return [{"handler": self.id, "value": [e.value.real, e.value.imag]} for e in entries]

    async def load(self, entries: Any, context: Any) -> list[Any]:
        raise KeyError("lost")

    def metadata(self, records: Any) -> list[Any]:
        return [None for _ in records]

    def check(self, entry: Any) -> str | None:
        return None

    def snapshot(self, entries: Any) -> Any:
        return entries


@pytest.fixture
def flaky(quire_fresh_registry: None) -> Iterator[None]:
    quire.handlers.register_leaf_handler(_Flaky())
    yield
    quire.handlers.unregister_leaf_handler("acme-flaky")


def test_third_party_handler_failures_name_the_key_path(tmp_path: Path, flaky: None) -> None:
    with pytest.raises(
        ValueError, match=r"'acme-flaky' failed saving leaf 'z'.*cannot encode"
    ) as e:
        quire.save(str(tmp_path / "a"), {"z": 1j})
    assert isinstance(e.value.__cause__, ValueError)
    url = str(tmp_path / "b")
    quire.save(url, {"z": 2j, "w": np.ones(1)})
    with pytest.raises(KeyError, match=r"failed loading leaf 'z'.*lost"):
        quire.load(url)


def test_multiprocess_error_is_a_quire_runtime_error() -> None:
    from quire import errors
    from quire._runtime import multihost as _multihost

    assert errors.MultiProcessError is _multihost.MultiProcessError is quire.errors.MultiProcessError
    assert issubclass(errors.MultiProcessError, errors.QuireError)
    assert issubclass(errors.MultiProcessError, RuntimeError)


def _imports(path: Path) -> set[str]:
    """Every quire module ``path`` imports, at any nesting level (function-level too)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("quire"):
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("quire")}
    return out


def test_no_import_cycle_between_registry_handlers_and_config() -> None:
    src = Path(quire.__file__).parent
    files = {
        "quire._runtime.registry": src / "_runtime" / "registry.py",
        "quire._handlers.select": src / "_handlers" / "select.py",
        "quire._runtime.config": src / "_runtime" / "config.py",
    }
    graph = {m: {n for n in files if n != m and n in _imports(p)} for m, p in files.items()}
    assert graph["quire._runtime.config"] == set()
    assert graph["quire._runtime.registry"] <= {"quire._runtime.config"}
