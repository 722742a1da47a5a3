"""The commit record's chunk-index entries as the primary assembles them from what every
other process shared (``quire._engine.record_parts.index_entries``): in process order, and
refused, naming the process, when one shared none or one of another save or process."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from quire._engine.record_parts import index_entries
from quire._format.chunkindex import index_entry, index_key
from quire.errors import MultiProcessError

TXID = "0123456789abcdef"
URL = "memory://ck"


def entry(p: int, txid: str = TXID) -> dict[str, Any]:
    return index_entry(txid, p, index_key(txid, p), b'{"refs": {}}')


def primary(count: int) -> Any:
    """What ``index_entries`` reads of a Coordinator: the process count and this index."""
    return SimpleNamespace(count=count, index=0)


def test_entries_come_in_process_order_and_skip_processes_without_chunks() -> None:
    got = {2: {"index": entry(2)}, 1: {"index": None}, 3: {"index": entry(3), "records": {}}}
    out = index_entries(primary(4), TXID, entry(0), got, URL)
    assert out == [entry(0), entry(2), entry(3)]


def test_no_chunk_anywhere_is_no_indexes() -> None:
    assert index_entries(primary(2), TXID, None, {1: {"index": None}}, URL) is None
    assert index_entries(primary(1), TXID, None, {}, URL) is None


@pytest.mark.parametrize(
    "value",
    [None, {}, {"records": {}}, "index", ["index"]],
    ids=["nothing", "empty", "records only", "a string", "a list"],
)
def test_a_process_that_shared_no_entry_stops_the_commit(value: Any) -> None:
    got = {1: value} if value is not None else {}
    with pytest.raises(
        MultiProcessError, match=r"memory://ck: process 1 .*without its chunk-index"
    ):
        index_entries(primary(2), TXID, entry(0), got, URL)


@pytest.mark.parametrize(
    "bad",
    [
        entry(1, txid="fedcba9876543210"),  # another save's
        entry(2),  # another process's
        {**entry(1), "object": "d/elsewhere/p00001.index.json"},
        {**entry(1), "size": -1},
        {**entry(1), "crc32c": 7},
        "p00001.index.json",
    ],
    ids=["other save", "other process", "other object", "negative size", "crc type", "a string"],
)
def test_an_entry_of_another_save_or_process_stops_the_commit(bad: Any) -> None:
    with pytest.raises(
        MultiProcessError, match=r"process 1 shared a chunk-index entry that is not"
    ):
        index_entries(primary(2), TXID, entry(0), {1: {"index": bad}}, URL)


def test_a_malformed_entry_of_this_process_stops_the_commit_too() -> None:
    with pytest.raises(
        MultiProcessError, match=r"process 0 shared a chunk-index entry that is not"
    ):
        index_entries(
            primary(2), TXID, entry(0, txid="fedcba9876543210"), {1: {"index": None}}, URL
        )
