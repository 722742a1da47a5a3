"""moto's S3 server for ``bench_s3.py``: started as its own process, optionally patched
(:func:`faithful_moto`) where moto's per-byte costs are not S3's, and the CPU-seconds
reading the benchmark reports per process.  See ``bench_s3.py``'s docstring."""

from __future__ import annotations

import base64
import os
import socket
import subprocess
import sys
import time
from typing import Any


def crc32_combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """``zlib.crc32(a + b)`` from ``crc32(a)``, ``crc32(b)`` and ``len(b)``, in O(log len_b).

    ``x -> crc32(zeros(n), x) ^ crc32(zeros(n), 0)`` is linear over GF(2); its matrix for
    one zero byte is squared up to ``len_b`` zeros and applied to ``crc_a``.
    """
    import binascii

    def apply(matrix: list[int], v: int) -> int:
        out, i = 0, 0
        while v:
            if v & 1:
                out ^= matrix[i]
            v >>= 1
            i += 1
        return out

    zero = binascii.crc32(b"\0")
    op = [binascii.crc32(b"\0", 1 << i) ^ zero for i in range(32)]
    n = len_b
    while n:
        if n & 1:
            crc_a = apply(op, crc_a)
        op = [apply(op, c) for c in op]
        n >>= 1
    return crc_a ^ crc_b


class PartsView:
    """A multipart object's bytes as its parts: a length, and ranges copied from the parts
    they fall in (what answering a ranged GET costs S3), without joining the parts."""

    def __init__(self, parts: list[bytes]) -> None:
        self.parts = parts
        self.size = sum(len(p) for p in parts)

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> Any:  # a full GET streams the parts (werkzeug iterates the body)
        return iter(self.parts)

    def __getitem__(self, s: slice) -> bytes:
        start, stop, _ = s.indices(self.size)
        out, pos = [], 0
        for p in self.parts:
            end = pos + len(p)
            if end > start and pos < stop:
                out.append(memoryview(p)[max(start - pos, 0) : min(stop, end) - pos])
            pos = end
            if pos >= stop:
                break
        return b"".join(out)


def faithful_moto() -> None:
    """Patch moto (in its server process) where its per-byte costs are not S3's, for every
    client alike; requests, replies, ETags and part validation stay moto's own.

    * An object's value is one immutable ``bytes`` in memory (not a spooled temporary
      file, which moto reads whole for every GET - ranged or not - and writes to this
      machine's disk above ~5 MiB): a GET costs what it returns.
    * ``CompleteMultipartUpload`` keeps the parts as they are (the object is their
      concatenation; moto copies it four times in that one request and checksums the
      whole), and derives the object's checksum from the parts' CRC-32s, each computed as
      its part arrives.  A ranged GET copies the range from the parts it falls in; a full
      GET streams them.  S3 likewise assembles an object from its stored parts and
      combines part checksums, without a pass over the data at completion.

    The part CRC-32 stands for moto's fallback when its CRT extension (CRC64NVME) is not
    installed, as here; another requested algorithm is computed over the joined parts.
    """
    import binascii
    import contextvars
    import hashlib

    from moto.core.compat import HAS_CRT
    from moto.s3 import exceptions, models, responses

    serving_get: contextvars.ContextVar[bool] = contextvars.ContextVar("serving", default=False)

    def get_value(self: Any) -> Any:
        parts = self.__dict__.get("_bench_parts")
        if parts is not None:
            if serving_get.get():
                return PartsView(parts)
            with self.lock:  # any other use: join once
                if self.__dict__.get("_bench_parts") is not None:
                    self._bench_value = b"".join(parts)
                    self._bench_parts = None
        return self.__dict__.get("_bench_value", b"")

    def set_value(self: Any, new: Any) -> None:
        if isinstance(new, PartsView):
            self._bench_parts, self._bench_value = new.parts, b""
        else:
            new = new.encode() if isinstance(new, str) else bytes(new)  # no copy of bytes
            self._bench_parts, self._bench_value = None, new
        self.contentsize = len(new)

    def etag(self: Any) -> str:
        if self._etag is None:
            self._etag = hashlib.md5(get_value(self), usedforsecurity=False).hexdigest()
        return f'"{self._etag}"'

    original_dispose = models.FakeKey.dispose

    def dispose(self: Any, garbage: bool = False) -> None:
        original_dispose(self, garbage)
        self._bench_value, self._bench_parts = b"", None

    original_set_part = models.FakeMultipart.set_part

    def set_part(self: Any, part_id: int, value: bytes) -> Any:
        key = original_set_part(self, part_id, value)
        key._bench_crc32 = binascii.crc32(key.value)  # as the part arrives
        return key

    def complete(self: Any, body: Any) -> tuple[PartsView, str, Any]:
        parts, previous = [], None
        for number, tag in body:
            part = self.parts.get(number)
            if part is None or part.etag.strip('"') != tag.strip('"'):
                raise exceptions.InvalidPart()
            if previous is not None and previous.contentsize < models.S3_UPLOAD_PART_MIN_SIZE:
                raise exceptions.EntityTooSmall()
            parts.append(part)
            previous = part
        if not parts:
            raise exceptions.MalformedXML()
        digests = b"".join(bytes.fromhex(p.etag.strip('"')) for p in parts)
        tag = f"{hashlib.md5(digests, usedforsecurity=False).hexdigest()}-{len(parts)}"
        values = [p.value for p in parts]
        checksums = models.MultipartChecksumBuilder(
            self.metadata.get("x-amz-checksum-algorithm"),
            self.metadata.get("x-amz-checksum-type"),
        )
        if checksums.checksum_type == "COMPOSITE":
            for v in values:
                checksums.addPart(v)
            summary = checksums.build()
        elif checksums.checksum_algorithm == "CRC32" or (
            checksums.checksum_algorithm == "CRC64NVME" and not HAS_CRT
        ):
            crc = 0
            for p, v in zip(parts, values):
                crc = crc32_combine(crc, p._bench_crc32, len(v))
            digest = base64.b64encode(crc.to_bytes(4, "big")).decode()
            summary = (checksums.checksum_type, digest, 1)
        else:
            checksums.complete_object = b"".join(values)
            checksums.part_count = len(values)
            summary = checksums.build()
        return PartsView(values), tag, summary

    original_get_object = responses.S3Response.get_object

    def get_object(self: Any) -> Any:
        token = serving_get.set(True)
        try:
            return original_get_object(self)
        finally:
            serving_get.reset(token)

    models.FakeKey.value = property(get_value, set_value)  # type: ignore[assignment]
    models.FakeKey.etag = property(etag)  # type: ignore[assignment]
    models.FakeKey.dispose = dispose  # type: ignore[method-assign]
    models.FakeMultipart.set_part = set_part  # type: ignore[method-assign]
    models.FakeMultipart.complete = complete  # type: ignore[method-assign]
    responses.S3Response.get_object = get_object  # type: ignore[method-assign]


def serve_moto(port: int, faithful: bool) -> None:
    """moto's S3 server on 127.0.0.1:``port`` (this process), patched by
    :func:`faithful_moto` when ``faithful``."""
    if faithful:
        faithful_moto()
    from moto.server import main as moto_main

    moto_main(["-H", "127.0.0.1", "-p", str(port)])


def start_moto(
    env: dict[str, str] | None = None, faithful: bool = False
) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve = f"import sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r}); "
    serve += f"import moto_server; moto_server.serve_moto({port}, {faithful})"
    proc = subprocess.Popen(
        [sys.executable, "-c", serve],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, **(env or {})},
    )
    endpoint = f"http://127.0.0.1:{port}"
    for _ in range(400):
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return proc, endpoint
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("moto server did not start")


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU seconds of process ``pid`` (None: this one) so far."""
    if pid is None:
        t = os.times()
        return t.user + t.system
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return float("nan")
