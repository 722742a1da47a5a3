"""Real object-store servers for the tests, and a fault-injecting HTTP proxy in front of them.

* :class:`MotoS3` - moto's S3 server (``ThreadedMotoServer``) on 127.0.0.1, a random port;
  it enforces ``If-None-Match`` / ``If-Match`` on PutObject.
* :class:`GcsEmulator` - gcp-storage-emulator, in memory, on 127.0.0.1; it ignores
  ``ifGenerationMatch`` (tests that rely on preconditions say so).
* :class:`FaultProxy` - an HTTP/1.1 proxy between the client and either server (a real
  network hop): per request it forwards, or answers 5xx / 4xx itself, resets the
  connection before or after the server saw the request, stalls past the client's timeout,
  or holds the request until the test releases it.  It logs every request.
  :class:`ProxyProcess` runs one that only adds latency in a process of its own.

Start-up takes ~1 s each; the test modules share one of each per module.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import socket
import struct
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

S3_KEY = "quire-test-key-id"
S3_SECRET = "quire-test-secret-0123456789"  # never to appear in messages or logs
S3_BUCKET = "quire-test"
GCS_BUCKET = "quire-test"
STREAM_LIMIT = 1 << 20  # the proxy's read size (asyncio's 64 KiB default costs a loop turn each)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ----------------------------------------------------------------------------- servers
class MotoS3:
    """moto's S3 server on 127.0.0.1 with one bucket."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.host, self.port = host, int(port)
        self.endpoint = f"http://{host}:{port}"
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
        return {
            "endpoint_url": endpoint or self.endpoint,
            "key": S3_KEY,
            "secret": S3_SECRET,
            **extra,
        }

    def fresh_url(self) -> str:
        return f"s3://{S3_BUCKET}/{uuid.uuid4().hex[:12]}"

    def stop(self) -> None:
        self._server.stop()


class GcsEmulator:
    """gcp-storage-emulator, in memory, on 127.0.0.1 with one bucket."""

    def __init__(self) -> None:
        os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
        from gcp_storage_emulator.server import create_server

        self.port = free_port()
        self._server = create_server(
            "127.0.0.1", self.port, in_memory=True, default_bucket=GCS_BUCKET
        )
        self._server.start()
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def options(self, endpoint: str | None = None, **extra: Any) -> dict[str, Any]:
        return {
            "endpoint_url": endpoint or self.endpoint,
            "token": "anon",
            "project": "quire",
            **extra,
        }

    def fresh_url(self) -> str:
        return f"gs://{GCS_BUCKET}/{uuid.uuid4().hex[:12]}"

    def stop(self) -> None:
        self._server.stop()


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
    has gone; released requests reach the server one at a time, each after the previous
    one's reply, because moto checks a conditional write and then stores it in two steps,
    so two conditional PUTs it handles at the same moment can both succeed, where S3
    decides them atomically).  ``times`` matching requests are affected (-1: all), after ``skip`` of them,
    and with ``every=n`` only every n-th of them.
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
    ) -> bool:
        """Send the request upstream on a fresh connection and stream the reply to
        ``writer`` as it arrives (None: read and drop it); whether to keep the client
        connection open."""
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
            # The server closes after one reply (Connection: close): copy to EOF.
            while block := await ur.read(STREAM_LIMIT):
                if writer is not None:
                    writer.write(block)
                    await writer.drain()
        finally:
            uw.close()
        lower = head.lower()
        framed = b"content-length:" in lower or b"chunked" in lower or method == "HEAD"
        return framed and b"connection: close" not in lower

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
                serial = rule._serial if action == "hold" and rule is not None else None
                async with serial or contextlib.nullcontext():
                    keep = await self._forward(
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


def _proxy_main(host: str, port: int, flavor: str, delay: float) -> None:
    """A :class:`ProxyProcess`'s process: the endpoint on stdout, then one reply per line
    of stdin (``log``: the request log since the last one, as JSON) until EOF or ``stop``."""
    import json
    import sys

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
        import subprocess
        import sys

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
        import json

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
