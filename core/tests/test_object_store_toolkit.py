"""The public object-store toolkit, ``quire.backends.ObjectStoreBackend`` and its helpers:
credentials out of endpoint URLs, DNS failures found however deep a client library wraps
them, and a backend built on the toolkit over an in-process store (retries, logs, the byte
budget, conditional writes, checked-out connections), as a third party would write one."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Sequence
from typing import Any

import pytest

from quire._runtime import ioloop as _io
from quire._store.endpoints import name_resolution_error, strip_userinfo
from quire.backends import (
    Capabilities,
    ObjectInfo,
    ObjectStoreBackend,
    PreconditionFailed,
    read_into,
)
from quire.errors import EndpointUnreachableError


@pytest.mark.parametrize(
    ("url", "clean", "removed"),
    [
        ("http://KEY:SECRET@host:9000/p", "http://host:9000/p", ["KEY", "SECRET"]),
        ("https://user@s3.example.com", "https://s3.example.com", ["user"]),
        ("http://k:s@[::1]:9000", "http://[::1]:9000", ["k", "s"]),
        ("http://host:9000", "http://host:9000", []),
    ],
)
def test_strip_userinfo(url: str, clean: str, removed: list[str]) -> None:
    assert strip_userinfo(url) == (clean, removed)


class _Wrapper(Exception):
    def __init__(self, error: BaseException) -> None:
        super().__init__("could not connect")
        self.kwargs = {"error": error}  # as botocore's EndpointConnectionError


class _Connector(Exception):
    def __init__(self, os_error: BaseException) -> None:
        super().__init__("connector")
        self.os_error = os_error  # as aiohttp's ClientConnectorDNSError


def test_name_resolution_error_is_found_through_wrappers() -> None:
    dns = socket.gaierror(socket.EAI_NONAME, "Name or service not known")
    assert name_resolution_error(_Wrapper(_Connector(dns))) is dns
    try:
        try:
            raise dns
        except socket.gaierror as e:
            raise RuntimeError("wrapped") from e
    except RuntimeError as outer:
        assert name_resolution_error(outer) is dns
    assert name_resolution_error(ConnectionRefusedError()) is None


def test_subclasses_must_implement_the_request_hooks() -> None:
    class Half(ObjectStoreBackend):
        scheme = "half"

    with pytest.raises(TypeError, match="abstract"):
        Half("half://bucket/p")  # type: ignore[abstract]


# ----------------------------------------------------------------------------- a store built on it
class _Store:
    """An in-process "object store" client: objects, versions, and faults to inject."""

    def __init__(self) -> None:
        self.objects: dict[str, tuple[bytes, str]] = {}
        self.faults: list[BaseException] = []
        self.n = 0
        self.busy = 0  # pooled connections checked out

    def request(self) -> None:
        if self.faults:
            raise self.faults.pop(0)


class DictBackend(ObjectStoreBackend):
    """The toolkit's hooks over :class:`_Store` - what a third-party backend writes."""

    scheme = "dict"
    capabilities = Capabilities(atomic_create=True, atomic_replace=True)
    large_threshold = 64

    @classmethod
    def new_client(cls, options: dict[str, Any]) -> Any:
        return options["store"]

    @staticmethod
    async def close_client(client: Any) -> None:
        return None

    @staticmethod
    def connections_in_use(client: Any) -> int:
        return int(client.busy)

    def _put_now(self, key: str, data: bytes) -> str:
        self.client.n += 1
        self.client.objects[self.key(key)] = (data, str(self.client.n))
        return str(self.client.n)

    async def stat(self, key: str) -> ObjectInfo | None:
        async def attempt(_n: int) -> ObjectInfo | None:
            self.client.request()
            hit = self.client.objects.get(self.key(key))
            return None if hit is None else ObjectInfo(len(hit[0]), hit[1])

        return await self.run("stat", key, attempt)

    async def read_range(self, key: str, start: int, end: int | None) -> bytes:
        self.client.request()
        if self.key(key) not in self.client.objects:
            raise FileNotFoundError(self.where(key))
        return self.client.objects[self.key(key)][0][start:end]

    async def read_range_into(self, key: str, start: int, views: list[memoryview], n: int) -> int:
        data = await self.read_range(key, start, start + n)
        return await read_into(_Reader(data), views)

    async def list_page(
        self, prefix: str, token: str | None, limit: int | None, delimiter: str | None
    ) -> tuple[list[str], list[str], str | None]:
        return sorted(k for k in self.client.objects if k.startswith(prefix)), [], None

    async def put_small(self, key: str, views: list[memoryview], total: int) -> None:
        await self.run("put", key, lambda _n: self._put(key, b"".join(views)))

    async def _put(self, key: str, data: bytes) -> None:
        self.client.request()
        self._put_now(key, data)

    async def put_large(self, key: str, views: list[memoryview], total: int) -> None:
        async def part(number: int, piece: list[memoryview]) -> bytes:
            assert self.budget.used <= max(self.upload_budget, 16)
            return b"".join(piece)

        self._put_now(key, b"".join(await self.upload_parts(views, total, 16, part)))

    async def put_if_absent(self, key: str, data: bytes) -> str:
        async def write(body: bytes) -> str:
            self.client.request()
            if self.key(key) in self.client.objects:
                raise FileExistsError(key)
            return self._put_now(key, body)

        lost = lambda e: isinstance(e, FileExistsError)  # noqa: E731
        return await self.conditional_put("create", key, data, write, lost, "exists")

    async def replace_if_match(self, key: str, data: bytes, version: str) -> str:
        raise NotImplementedError

    async def delete(self, keys: Sequence[str]) -> None:
        for k in keys:
            self.client.objects.pop(self.key(k), None)


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data = memoryview(data)

    async def read(self, n: int) -> bytes:
        out, self.data = bytes(self.data[:n]), self.data[n:]
        return out


def _backend(store: _Store, **extra: Any) -> DictBackend:
    opts = {"store": store, "retry_backoff": 0.001, "retry_deadline": 5, **extra}
    return DictBackend("dict://bucket/root", opts)


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_a_backend_on_the_toolkit_retries_logs_and_budgets(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = _Store()
    b = _backend(store, upload_budget=32)
    store.faults = [ConnectionResetError("reset"), TimeoutError("slow")]
    caplog.set_level(logging.INFO, logger=DictBackend.log.name)
    _run(b.put("a", [b"x" * 10]))  # retried twice
    assert [r.levelno for r in caplog.records] == [logging.INFO] * 2
    assert "reset" in caplog.records[0].getMessage() and "dict://bucket/root/a" in caplog.text
    _run(b.put("big", [bytes(range(100))]))  # 7 parts of 16 bytes, within the budget
    assert _run(b.get("big", 10, 20)) == bytes(range(10, 20))
    buf = bytearray(100)
    assert _run(b.get_into("big", [memoryview(buf)])) == 100 and bytes(buf) == bytes(range(100))
    assert _run(b.list("")) == ["a", "big"]
    assert _run(b.size("a")) == 10 and _run(b.exists("zz")) is False


def test_conditional_put_recognises_its_own_lost_reply() -> None:
    store = _Store()
    b = _backend(store)
    v = _run(b.put_if_absent("quire.json", b"{}"))
    # The same bytes again: an earlier attempt's write, not a lost race.
    assert _run(b.put_if_absent("quire.json", b"{}")) == v
    with pytest.raises(PreconditionFailed, match="exists"):
        _run(b.put_if_absent("quire.json", b"{other}"))


def test_unresolvable_host_fails_at_once_and_secrets_are_redacted() -> None:
    store = _Store()
    dns = socket.gaierror(socket.EAI_NONAME, "Name or service not known")
    b = _backend(store, secret="s3cr3t-value", retry_deadline=60)
    store.faults = [_Wrapper(_Connector(dns))] * 50
    t0 = time.monotonic()
    with pytest.raises(EndpointUnreachableError, match="cannot resolve host"):
        _run(b.get("a"))
    assert time.monotonic() - t0 < 1 and len(store.faults) == 49  # one attempt only
    assert b.redact("key s3cr3t-value here") == "key *** here"


def test_part_buffers_gather_writes_at_offsets_into_parts() -> None:
    from quire.backends import PartBuffers

    p = PartBuffers(4)
    assert p.add([b"ab"], 6) == [] and p.tail() == (2, 0)  # bytes 6-7: half of part 1
    assert p.add([b"cd", memoryview(b"ef")], 2) == [1]  # bytes 2-5 complete part 1
    assert p.full(1) and not p.full(0)
    assert p.add([b"xy"], 0) == [0] and p.full(0)  # bytes 0-1 complete part 0
    assert bytes(p.take(0)) == b"xycd" and bytes(p.take(1)) == b"efab"
    assert p.whole() and p.end == 8
    q = PartBuffers(4)
    q.add([b"0123", b"45"], 0)
    assert q.tail() == (1, 2) and q.buffers.keys() == {0, 1} and not q.whole()
    q.take(0)
    assert q.whole() and bytes(q.buffers[1][:2]) == b"45"
    q.add([b"7"], 7)
    assert not q.whole()  # byte 6 never arrived: a hole


def test_checked_out_connections_ask_each_backend_class_through_its_hook() -> None:
    """What a test suite's isolation check asks: shared clients (on quire's loop) whose
    backend class counts connections still checked out, one line each."""
    store = _Store()
    b = _backend(store)
    _io.submit(b.exists("a")).result(timeout=30)  # the shared client, on quire's loop
    store.busy = 2
    try:
        found = [x for x in ObjectStoreBackend.checked_out_connections() if "DictBackend" in x]
        assert len(found) == 1 and found[0].endswith(": 2 connection(s) checked out"), found
        assert found == DictBackend.checked_out_connections()
    finally:
        store.busy = 0
    assert ObjectStoreBackend.checked_out_connections() == []
