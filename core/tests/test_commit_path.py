"""One commit path: only ``quire/_engine/commit.py`` writes records; it honours declared
capabilities, drops superseded data itself and announces the multi-process outcome."""

from __future__ import annotations

import ast
import logging
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest

import quire
from quire._engine import commit as _commit
from quire._format import record as _records
from quire._runtime import ioloop as _io
from quire._store.memory import MemoryBackend, forget
from quire.backends import Capabilities

SRC = Path(quire.__file__).parent
COMMIT = Path(_commit.__file__)
# The storage layer (the Backend contract, its implementations, the object-store toolkit and
# the wrapped view format v2's read and pack-writing views build on, which only delegates
# conditional writes to the backend it wraps) and the backend conformance suite call the
# primitives themselves; everything else must go through quire._engine.commit.
ALLOWED = {COMMIT}
ALLOWED_DIRS = (SRC / "_store", SRC / "testing")
CONDITIONAL = {"put_if_absent", "replace_if_match"}
WRITES = CONDITIONAL | {"put"}


def _is_record_name(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return _records.RECORD in node.value
    if isinstance(node, ast.JoinedStr):
        return any(_is_record_name(v) for v in node.values)
    if isinstance(node, ast.Attribute | ast.Name):
        return (node.attr if isinstance(node, ast.Attribute) else node.id) == "RECORD"
    return False


def _offenders() -> list[str]:
    out = []
    for path in sorted(SRC.rglob("*.py")):
        if path in ALLOWED or any(d in path.parents for d in ALLOWED_DIRS):
            continue
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            name = node.func.attr
            where = f"{path.relative_to(SRC)}:{node.lineno} {name}"
            if name in CONDITIONAL or (
                name in WRITES and node.args and _is_record_name(node.args[0])
            ):
                out.append(where)
    return out


def test_only_the_commit_module_writes_records() -> None:
    assert _offenders() == []
    # The scan sees what it must: the commit module itself is full of such calls.
    tree = ast.parse(COMMIT.read_text())
    calls = {
        n.func.attr
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
    }
    assert calls >= CONDITIONAL


class _NoSwapBackend(MemoryBackend):
    capabilities: ClassVar[Capabilities] = Capabilities(
        atomic_create=True, atomic_replace=False, durable=False
    )


def _record(txid: str) -> bytes:
    return _records.build(
        units={"pytree": {"kind": "pytree", "tree": {"kind": "dict", "keys": [], "children": []}}},
        txids=[txid],
        metadata={},
        process_count=1,
    )


def _run(coro: Any) -> Any:
    return _io.submit(coro).result()


def test_overwrite_without_atomic_replace_warns_and_drops_old_data(
    caplog: pytest.LogCaptureFixture,
) -> None:
    url = "memory://commit-path/noswap"
    b = _NoSwapBackend(url)
    try:
        caplog.set_level(logging.WARNING, logger="quire")
        _run(b.put("d/aaaa/x", [b"1"]))
        _run(_commit.publish(b, url, _record("aaaa"), ["aaaa"], overwrite=False))
        assert "atomic replace" not in caplog.text  # a create needs no swap
        _run(b.put("d/bbbb/x", [b"2"]))
        _run(_commit.publish(b, url, _record("bbbb"), ["bbbb"], overwrite=True))
        assert "no atomic replace" in caplog.text and url in caplog.text
        # The superseded txid went in the same step; the new one is referenced.
        assert _run(b.list("d")) == ["d/bbbb/x"]
        assert _run(_commit.read(b, url)).txids == {"bbbb"}
    finally:
        forget(url)


def test_losing_the_create_removes_only_our_data(quire_url: str) -> None:
    quire.save(quire_url, {"w": np.ones(2)})
    from quire._store.url import open_backend

    b = open_backend(quire_url)
    _run(b.put("d/cccc/x", [b"1"]))
    with pytest.raises(quire.CheckpointExistsError, match="another writer committed first"):
        _run(_commit.publish(b, quire_url, _record("cccc"), ["cccc"], overwrite=False))
    assert not _run(b.list("d/cccc"))
    np.testing.assert_array_equal(quire.load(quire_url)["w"], np.ones(2))


def test_read_refuses_locations_outside_d(quire_url: str) -> None:
    import json

    from quire._store.url import open_backend

    quire.save(quire_url, {"w": np.ones(2)})
    b = open_backend(quire_url)
    doc = json.loads(_run(b.get(_records.RECORD)))
    doc["units"]["pytree"]["tree"]["children"][0]["location"] = "../elsewhere"
    doc["checksum"] = _records.record_checksum(doc)
    _run(b.delete([_records.RECORD]))
    _run(b.put(_records.RECORD, [json.dumps(doc).encode()]))
    for fn in (quire.load, quire.metadata):
        with pytest.raises(quire.CorruptCheckpointError, match=r"(outside|inside) d/"):
            fn(quire_url)


def test_drop_warning_says_why_and_names_gc(caplog: pytest.LogCaptureFixture) -> None:
    import asyncio

    class Failing:
        async def delete_prefix(self, prefix: str) -> None:
            raise PermissionError("read-only bucket")

    with caplog.at_level("WARNING", logger="quire"):
        asyncio.run(_commit.drop_txids(Failing(), "s3://b/c", ["0123456789abcdef"]))  # type: ignore[arg-type]
    msg = caplog.records[-1].getMessage()
    assert "PermissionError: read-only bucket" in msg and "quire gc s3://b/c --yes" in msg
