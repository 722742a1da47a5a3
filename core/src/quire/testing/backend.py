"""The conformance suite every quire storage backend passes.

A backend package subclasses :class:`BackendSuite` in its tests and provides a fresh, empty
root URL per test::

    from quire.testing import BackendSuite

    class TestMyBackend(BackendSuite):
        protocol = "mystore"

        @pytest.fixture
        def backend_url(self, my_server):
            return f"mystore://bucket/{uuid.uuid4().hex}"

        @pytest.fixture
        def storage_options(self, my_server):
            return {"endpoint_url": my_server.url}

Everything goes through :func:`quire._store.url.open_backend`, so the suite also checks that the
protocol resolves to the backend through the ``quire.backends`` entry points.

Backends whose *test server* does not enforce preconditions (an emulator more lenient than
the store it stands for) set ``preconditions_enforced = False`` and say why in
``preconditions_note``: the tests that need a real conditional write are then skipped with
that reason, in the open, and the behaviour must be proven against a server that enforces
it.  Never override a suite test to make it pass.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Coroutine, Iterator
from typing import Any, ClassVar, TypeVar

import numpy as np
import pytest

import quire
from quire._runtime import ioloop as _io
from quire._runtime.registry import backends as _backends
from quire._store.url import open_backend, protocol_of
from quire.backends import Backend, Buffer, Capabilities, PreconditionFailed

__all__ = ["BackendSuite"]

T = TypeVar("T")
MiB = 1 << 20


def _run(coro: Coroutine[Any, Any, T]) -> T:
    return _io.submit(coro).result(timeout=120)


def _blob(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


class BackendSuite:
    """Conformance tests for a :class:`quire.backends.Backend`.

    Subclasses set ``protocol`` and provide the ``backend_url`` fixture (a fresh, empty
    root per test) and optionally ``storage_options``.
    """

    #: The URL protocol the backend is registered under (``quire.backends`` entry point).
    protocol: ClassVar[str]
    #: False when the test server accepts writes that should fail their precondition.
    preconditions_enforced: ClassVar[bool] = True
    #: Why preconditions are not enforced (shown in the skip reason).
    preconditions_note: ClassVar[str] = ""
    #: Size of the object in ``test_large_object`` (set the backend's multipart / resumable
    #: threshold below it in ``storage_options`` to exercise that path).
    large_object_bytes: ClassVar[int] = 12 * MiB
    #: Concurrent writers in the conditional-create race.
    race_writers: ClassVar[int] = 8
    #: ``storage_options`` keys holding credentials, never to be shown.
    credential_options: ClassVar[tuple[str, ...]] = ("key", "secret", "token", "password")

    # -- fixtures ----------------------------------------------------------------
    @pytest.fixture
    def backend_url(self) -> str:
        pytest.fail(f"{type(self).__name__} must provide a `backend_url` fixture (a fresh root)")

    @pytest.fixture
    def storage_options(self) -> dict[str, Any]:
        return {}

    @pytest.fixture
    def backend(self, backend_url: str, storage_options: dict[str, Any]) -> Iterator[Backend]:
        b = open_backend(backend_url, storage_options)
        yield b
        _run(b.close())

    def require_preconditions(self) -> None:
        """Skip, saying so, when the test server does not enforce preconditions."""
        if not self.preconditions_enforced:
            pytest.skip(
                f"{self.protocol}: the test server ignores write preconditions "
                f"({self.preconditions_note or 'preconditions_enforced = False'}); "
                "this behaviour is proven against servers that enforce them"
            )

    # -- discovery and declarations ---------------------------------------------------
    def test_protocol_resolves_to_backend(self, backend: Backend, backend_url: str) -> None:
        assert self.protocol in _backends.names()
        assert protocol_of(backend_url) == self.protocol
        assert isinstance(backend, _backends.get(self.protocol))
        assert isinstance(type(backend).capabilities, Capabilities)

    def test_repr_hides_credentials(
        self, backend: Backend, storage_options: dict[str, Any]
    ) -> None:
        text = repr(backend)
        for name in self.credential_options:
            value = storage_options.get(name)
            if isinstance(value, str) and len(value) >= 8:
                assert value not in text, name

    # -- reads ----------------------------------------------------------------------
    def test_missing_key(self, backend: Backend) -> None:
        assert _run(backend.exists("nope")) is False
        assert _run(backend.version("nope")) is None
        with pytest.raises(FileNotFoundError):
            _run(backend.get("nope"))
        with pytest.raises(FileNotFoundError):
            _run(backend.get("nope", 0, 4))
        with pytest.raises(FileNotFoundError):
            _run(backend.size("nope"))
        with pytest.raises(FileNotFoundError):
            _run(backend.get_into("nope", [memoryview(bytearray(4))]))
        with pytest.raises(FileNotFoundError):
            _run(backend.get("dir/nope"))

    def test_put_get_buffers(self, backend: Backend) -> None:
        arr = np.arange(10, dtype=np.float32)
        parts: list[Buffer] = [
            b"head-",
            bytearray(b"middle-"),
            arr.view(np.uint8).data,
            b"",
            b"tail",
        ]
        _run(backend.put("a/b/c", parts))
        want = b"head-middle-" + arr.tobytes() + b"tail"
        assert _run(backend.get("a/b/c")) == want
        assert _run(backend.size("a/b/c")) == len(want)
        assert _run(backend.exists("a/b/c")) is True

    def test_empty_object(self, backend: Backend) -> None:
        _run(backend.put("empty", []))
        assert _run(backend.get("empty")) == b""
        assert _run(backend.size("empty")) == 0
        assert _run(backend.exists("empty")) is True
        assert _run(backend.get_into("empty", [memoryview(bytearray(8))])) == 0

    def test_range_get(self, backend: Backend) -> None:
        data = bytes(range(100))
        _run(backend.put("r", [data]))
        assert _run(backend.get("r", 10, 20)) == data[10:20]
        assert _run(backend.get("r", 0, 1)) == data[:1]
        assert _run(backend.get("r", 90)) == data[90:]
        assert _run(backend.get("r", None, 5)) == data[:5]
        assert _run(backend.get("r", 95, 500)) == data[95:]  # past the end: clamped
        assert _run(backend.get("r", 40, 40)) == b""

    def test_get_into(self, backend: Backend) -> None:
        data = _blob(3000, seed=1)
        _run(backend.put("g", [data]))
        a, b = bytearray(1000), bytearray(24)
        assert _run(backend.get_into("g", [memoryview(a), memoryview(b)], 100)) == 1024
        assert bytes(a) == data[100:1100] and bytes(b) == data[1100:1124]
        # Reading past the end fills what exists and says how much.
        c = bytearray(64)
        assert _run(backend.get_into("g", [memoryview(c)], 2990)) == 10
        assert bytes(c[:10]) == data[2990:]
        d = np.zeros(750, np.float32)
        assert _run(backend.get_into("g", [d.view(np.uint8).data])) == 3000
        assert d.tobytes() == data

    def test_large_object(self, backend: Backend) -> None:
        """Big enough for multipart / resumable uploads and split reads where configured."""
        n = self.large_object_bytes
        arr = np.frombuffer(_blob(n, seed=2), np.uint8)
        _run(backend.put("big/obj", [arr[: n // 3].data, arr[n // 3 :].data, b"crc!"]))
        assert _run(backend.size("big/obj")) == n + 4
        out = np.empty(n + 8, np.uint8)
        assert _run(backend.get_into("big/obj", [out.data])) == n + 4
        assert np.array_equal(out[:n], arr) and out[n : n + 4].tobytes() == b"crc!"
        assert _run(backend.get("big/obj", n - 10, n + 4)) == arr[-10:].tobytes() + b"crc!"

    # -- versions -------------------------------------------------------------------
    def test_put_overwrites_and_changes_version(self, backend: Backend) -> None:
        _run(backend.put("k", [b"one"]))
        v1 = _run(backend.version("k"))
        assert isinstance(v1, str) and v1
        _run(backend.put("k", [b"two!"]))
        assert _run(backend.get("k")) == b"two!"
        v2 = _run(backend.version("k"))
        assert v2 != v1

    def test_modified(self, backend: Backend) -> None:
        _run(backend.put("m", [b"x"]))
        when = _run(backend.modified("m"))
        if when is not None:
            assert abs(when - time.time()) < 3600
        if type(backend).modified is not Backend.modified:
            with pytest.raises(FileNotFoundError):
                _run(backend.modified("nope"))

    # -- listing ----------------------------------------------------------------------
    def test_list(self, backend: Backend) -> None:
        keys = ["a/b", "a/c/d", "a/c/e", "ab/x", "a.txt", "z"]
        for k in keys:
            _run(backend.put(k, [k.encode()]))
        assert _run(backend.list()) == sorted(keys)
        assert _run(backend.list("")) == sorted(keys)
        assert _run(backend.list("a")) == ["a/b", "a/c/d", "a/c/e"]
        assert _run(backend.list("a/")) == ["a/b", "a/c/d", "a/c/e"]
        assert _run(backend.list("a/c")) == ["a/c/d", "a/c/e"]
        assert _run(backend.list("z")) == ["z"]  # a key is listed under its own name
        assert _run(backend.list("nope")) == []
        assert _run(backend.list("a/c/d/")) == ["a/c/d"]

    def test_list_dir(self, backend: Backend) -> None:
        for k in ["a/b", "a/c/d", "a/c/e", "a/x/y/z", "ab/x", "top"]:
            _run(backend.put(k, [b"."]))
        assert _run(backend.list_dir()) == (["top"], ["a", "ab"])
        assert _run(backend.list_dir("a")) == (["b"], ["c", "x"])
        assert _run(backend.list_dir("a/")) == (["b"], ["c", "x"])
        assert _run(backend.list_dir("a/x")) == ([], ["y"])
        assert _run(backend.list_dir("nope")) == ([], [])

    def test_list_empty_root(self, backend: Backend) -> None:
        assert _run(backend.list()) == []

    def test_escaped_keys(self, backend: Backend) -> None:
        # What quire's key-path escaping produces (percent signs, ~, +=,@ ...).
        keys = ["d/t/%", "d/t/a%2Fb/c/0", "d/t/%2E%2E", "d/t/x~2", "d/t/+=,@-_.~", "d/t/%20 "]
        for i, k in enumerate(keys):
            _run(backend.put(k, [bytes([i])]))
        for i, k in enumerate(keys):
            assert _run(backend.get(k)) == bytes([i]), k
        assert _run(backend.list("d/t")) == sorted(keys)

    # -- conditional writes ----------------------------------------------------------
    def test_put_if_absent_creates(self, backend: Backend) -> None:
        v = _run(backend.put_if_absent("rec.json", b'{"v": 1}'))
        assert isinstance(v, str) and v
        assert _run(backend.get("rec.json")) == b'{"v": 1}'
        assert _run(backend.version("rec.json")) == v

    def test_put_if_absent_refuses_existing(self, backend: Backend) -> None:
        self.require_preconditions()
        _run(backend.put_if_absent("rec.json", b"first"))
        with pytest.raises(PreconditionFailed):
            _run(backend.put_if_absent("rec.json", b"second"))
        assert _run(backend.get("rec.json")) == b"first"
        _run(backend.put("plain", [b"x"]))
        with pytest.raises(PreconditionFailed):
            _run(backend.put_if_absent("plain", b"y"))
        assert _run(backend.get("plain")) == b"x"

    def test_put_if_absent_race_has_one_winner(
        self, backend_url: str, storage_options: dict[str, Any], backend: Backend
    ) -> None:
        """Writers in their own threads, event loops and backend instances race to create."""
        self.require_preconditions()
        n = self.race_writers
        barrier = threading.Barrier(n)
        outcome: dict[int, str] = {}

        async def write(i: int) -> str:
            b = open_backend(backend_url, storage_options)
            try:
                await b.put_if_absent("race.json", f"writer {i}".encode())
                return "won"
            except PreconditionFailed:
                return "lost"
            finally:
                await b.close()

        def worker(i: int) -> None:
            barrier.wait()
            try:
                outcome[i] = asyncio.run(write(i))
            except BaseException as e:  # reported by the assertion below
                outcome[i] = f"error: {type(e).__name__}: {e}"

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        winners = [i for i, o in outcome.items() if o == "won"]
        assert sorted(outcome.values()).count("lost") == n - 1, outcome
        assert len(winners) == 1, outcome
        assert _run(backend.get("race.json")) == f"writer {winners[0]}".encode()

    def test_replace_if_match_with_current_version(self, backend: Backend) -> None:
        v1 = _run(backend.put_if_absent("rec.json", b"one"))
        v2 = _run(backend.replace_if_match("rec.json", b"two", v1))
        assert v2 != v1
        assert _run(backend.get("rec.json")) == b"two"
        assert _run(backend.version("rec.json")) == v2
        v3 = _run(backend.replace_if_match("rec.json", b"three", v2))
        assert _run(backend.get("rec.json")) == b"three" and v3 not in (v1, v2)

    def test_replace_if_match_refuses_stale_version(self, backend: Backend) -> None:
        self.require_preconditions()
        v1 = _run(backend.put_if_absent("rec.json", b"one"))
        _run(backend.replace_if_match("rec.json", b"two", v1))
        with pytest.raises(PreconditionFailed):
            _run(backend.replace_if_match("rec.json", b"stale", v1))
        assert _run(backend.get("rec.json")) == b"two"

    def test_replace_if_match_refuses_missing_key(self, backend: Backend) -> None:
        self.require_preconditions()
        v1 = _run(backend.put_if_absent("rec.json", b"one"))
        _run(backend.delete(["rec.json"]))
        with pytest.raises(PreconditionFailed):
            _run(backend.replace_if_match("rec.json", b"two", v1))
        assert _run(backend.exists("rec.json")) is False

    # -- deletes ----------------------------------------------------------------------
    def test_delete(self, backend: Backend) -> None:
        _run(backend.put("x/1", [b"1"]))
        _run(backend.put("x/2", [b"2"]))
        _run(backend.delete(["x/1", "x/missing", "missing"]))
        assert _run(backend.exists("x/1")) is False
        assert _run(backend.list()) == ["x/2"]
        _run(backend.delete([]))

    def test_delete_prefix(self, backend: Backend) -> None:
        keys = ["d/t1/a", "d/t1/b/c", "d/t10/a", "d/t2/a", "top"]
        for k in keys:
            _run(backend.put(k, [b"."]))
        _run(backend.delete_prefix("d/t1"))
        assert _run(backend.list()) == ["d/t10/a", "d/t2/a", "top"]
        _run(backend.delete_prefix("nothing/here"))

    # -- through quire's API ----------------------------------------------------------
    def _tree(self, seed: int) -> dict[str, Any]:
        rng = np.random.default_rng(seed)
        return {
            "params": {
                "w": rng.standard_normal((64, 33)).astype(np.float32),
                "b": rng.integers(0, 100, 7).astype(np.int64),
            },
            "step": seed,
            "name": f"run-{seed}",
            "blob": f"bytes-{seed}".encode(),
            "nothing": None,
        }

    def _assert_tree(self, got: Any, want: dict[str, Any]) -> None:
        assert got["step"] == want["step"] and got["name"] == want["name"]
        assert got["blob"] == want["blob"] and got["nothing"] is None
        for k in ("w", "b"):
            np.testing.assert_array_equal(np.asarray(got["params"][k]), want["params"][k])

    def test_save_load_overwrite(
        self, backend_url: str, storage_options: dict[str, Any], backend: Backend
    ) -> None:
        url = f"{backend_url}/ckpt"
        old, new = self._tree(1), self._tree(2)
        quire.save(url, old, metadata={"loss": 0.5}, storage_options=storage_options)
        self._assert_tree(quire.load(url, storage_options=storage_options), old)
        assert quire.metadata(url, storage_options=storage_options).custom == {"loss": 0.5}
        with pytest.raises(quire.CheckpointExistsError):
            quire.save(url, new, storage_options=storage_options)
        self._assert_tree(quire.load(url, storage_options=storage_options), old)
        quire.save(url, new, overwrite=True, storage_options=storage_options)
        self._assert_tree(quire.load(url, storage_options=storage_options), new)
        # The superseded data is gone; only the new txid and the record remain.
        keys = _run(backend.list("ckpt"))
        txids = {k.split("/")[2] for k in keys if k.startswith("ckpt/d/")}
        assert len(txids) == 1 and "ckpt/quire.json" in keys
