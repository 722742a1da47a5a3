"""The safetensors source: one ``.safetensors`` object, or an HF model directory / prefix
(``model.safetensors.index.json`` + shards, or a single ``model.safetensors``), on any URL.

Format (parsed here, no dependency): 8 bytes little-endian header length ``N``; ``N`` bytes of
JSON ``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}``;
then the data, offsets relative to byte ``8 + N``, each tensor C-contiguous little-endian.
Every header is validated before anything is allocated (JSON nested too deeply, a name
given twice, ``__metadata__`` values that are not strings, offsets outside the data: all
refused, as the reference ``safetensors`` library refuses them).  An index's shard names must
name files of the directory, and the index and the headers of the shards it names must agree
(each tensor in exactly one header, the one the index maps it to: nothing is dropped); a local file must be a regular file, and a symbolic link is
followed only where ``quire._sources.symlinks`` allows (a hub cache snapshot's blobs).
Tensors are read with byte-range requests covering only the region asked for.

Names become a nested tree by splitting on ``.``; numeric components (``layers.0``) stay
**string** dict keys (``tree["model"]["layers"]["0"]``), so names round-trip exactly.  When
names clash (``a.b`` is a tensor and ``a.b.c`` too) the tree stays flat (full names as keys).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import posixpath
import threading
from collections.abc import Callable
from typing import Any, ClassVar

import ml_dtypes
import numpy as np

from quire._format.untrusted import untrusted_json
from quire._runtime.ioloop import run_blocking, submit
from quire._sources.base import Source
from quire._sources.lazy import Region, SourceArray, region_shape
from quire._sources.surgery import unflatten
from quire._sources.symlinks import resolve_local
from quire._store.base import NOT_DATA, Backend
from quire._store.local import LocalBackend
from quire._store.url import open_backend, protocol_of
from quire.errors import CheckpointNotFoundError, CorruptCheckpointError

__all__ = ["DTYPES", "INDEX", "MAX_HEADER", "SafetensorsSource", "dtype_code", "parse_header"]

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
MAX_HEADER = 100 * 1024 * 1024
MAX_INDEX = 100 * 1024 * 1024

DTYPES: dict[str, np.dtype[Any]] = {
    "BOOL": np.dtype(bool),
    "U8": np.dtype("u1"),
    "I8": np.dtype("i1"),
    "U16": np.dtype("<u2"),
    "I16": np.dtype("<i2"),
    "U32": np.dtype("<u4"),
    "I32": np.dtype("<i4"),
    "U64": np.dtype("<u8"),
    "I64": np.dtype("<i8"),
    "F16": np.dtype("<f2"),
    "F32": np.dtype("<f4"),
    "F64": np.dtype("<f8"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
    "C64": np.dtype("<c8"),
}
_CODES = {v: k for k, v in DTYPES.items()}


def dtype_code(dt: Any) -> str:
    """The safetensors dtype code of a numpy dtype; ``TypeError`` when it has none."""
    d = np.dtype(dt).newbyteorder("<") if np.dtype(dt).byteorder == ">" else np.dtype(dt)
    try:
        return _CODES[d]
    except KeyError:
        raise TypeError(f"safetensors has no dtype for {d}") from None


def _split(url: str) -> tuple[str, str]:
    """``.../dir/file.safetensors`` → (``.../dir``, ``file.safetensors``)."""
    if protocol_of(url) == "file" and "://" not in url:
        head, tail = posixpath.split(url)
        return head or "/", tail
    proto, rest = url.split("://", 1)
    head, tail = posixpath.split(rest)
    return f"{proto}://{head}", tail


def bad_shard_name(name: str) -> str | None:
    """Why ``name`` (a file named by an HF index) is no file of the directory, or None.

    A shard is a file below the directory: relative, each ``/``-separated part a real name
    (not empty, ``.`` or ``..``), no NUL, no backslash (a separator elsewhere), no URL."""
    if not name or name.startswith("/") or "://" in name:
        return "is not a relative file name"
    if "\x00" in name or "\\" in name:
        return "holds a NUL byte or a backslash"
    if any(p in ("", ".", "..") for p in name.split("/")):
        return "leaves the directory or names no file (an empty, '.' or '..' part)"
    return None


def parse_header(
    raw_len: bytes, header: bytes, size: int, where: str
) -> tuple[int, dict[str, Any]]:
    """Validate one file's header; returns (data start, header dict).  Pure: no I/O."""

    def bad(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"{where}: not a valid safetensors file: {why}; re-download or re-export it"
        )

    if len(raw_len) < 8:
        raise bad(f"{size} bytes, too short for the 8-byte header length")
    n = int.from_bytes(raw_len[:8], "little")
    if n > MAX_HEADER:
        raise bad(f"header claims {n} bytes, more than the {MAX_HEADER}-byte limit")
    if 8 + n > size:
        raise bad(f"header claims {n} bytes but the object has {size}")
    try:
        doc = untrusted_json(bytes(header[:n]))
    except ValueError as e:
        raise bad(f"header is not JSON ({e})") from None
    if not isinstance(doc, dict):
        raise bad("header is not a JSON object")
    data_size = size - 8 - n
    spans = []
    for name, info in doc.items():
        if name == "__metadata__":
            # The reference library reads it as an optional map of string to string.
            if info is None:
                continue
            if not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values()):
                raise bad("__metadata__ is not an object of strings")
            continue
        if not isinstance(info, dict):
            raise bad(f"tensor {name!r}: entry is not an object")
        dt, shape, offs = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dt not in DTYPES:
            raise bad(f"tensor {name!r}: unknown dtype {dt!r}")
        if not isinstance(shape, list) or not all(type(s) is int and 0 <= s < 2**62 for s in shape):
            raise bad(f"tensor {name!r}: bad shape {shape!r}")
        if (
            not isinstance(offs, list)
            or len(offs) != 2
            or not all(type(o) is int for o in offs)
            or not 0 <= offs[0] <= offs[1]
        ):
            raise bad(f"tensor {name!r}: bad data_offsets {offs!r}")
        if offs[1] > data_size:
            raise bad(
                f"tensor {name!r}: data_offsets {offs} lie outside the {data_size} data bytes"
            )
        want = math.prod(shape) * DTYPES[dt].itemsize
        if offs[1] - offs[0] != want:
            raise bad(
                f"tensor {name!r}: {offs[1] - offs[0]} bytes for shape {shape} {dt} ({want} expected)"
            )
        spans.append((offs[0], offs[1], name))
    spans.sort()
    for (_a0, a1, an), (b0, _b1, bn) in itertools.pairwise(spans):
        if b0 < a1:
            raise bad(f"tensors {an!r} and {bn!r} overlap")
    return 8 + n, doc


class _Reader:
    """Byte-range reads of one tensor: one request per contiguous run of the region."""

    MAX_RUNS = 256

    def __init__(
        self,
        src: SafetensorsSource,
        backend: Backend,
        key: str,
        start: int,
        shape: tuple[int, ...],
        dtype: np.dtype[Any],
    ) -> None:
        self.src, self.backend, self.key, self.start = src, backend, key, start
        self.shape, self.dtype = shape, dtype

    async def read_region(self, region: Region) -> np.ndarray:
        shape, item = self.shape, self.dtype.itemsize
        out = np.empty(region_shape(region), self.dtype)
        if out.size == 0:
            return out
        nd = len(shape)
        k = 0  # axes after k are read whole: a run is one index of the axes before k
        for d in range(nd - 1, -1, -1):
            if (region[d].start, region[d].stop) != (0, shape[d]):
                k = d
                break
        strides = [math.prod(shape[d + 1 :]) for d in range(nd)]
        outer = region[:k]
        n_runs = math.prod(r.stop - r.start for r in outer)
        run_len = (region[k].stop - region[k].start) * strides[k] * item if nd else item
        if n_runs > self.MAX_RUNS and run_len < (64 << 10):
            # Many small runs: read the rows of axis 0 the region spans, then cut.
            r0 = region[0]
            rows = np.empty((r0.stop - r0.start, *shape[1:]), self.dtype)
            await self._get(r0.start * strides[0] * item, rows.reshape(-1).view(np.uint8))
            out[...] = rows[(slice(None), *region[1:])]
            return out
        if n_runs == 1:  # the usual case: the region is one contiguous byte range
            off = sum(r.start * strides[d] for d, r in enumerate(region))
            await self._get(off * item, out.reshape(-1).view(np.uint8))
            return out
        flat = out.reshape(n_runs, -1).view(np.uint8)
        sem = asyncio.Semaphore(32)
        idx = np.indices([r.stop - r.start for r in outer]).reshape(len(outer), -1).T if k else [()]

        async def one(i: int, pos: Any) -> None:
            off = sum((int(p) + r.start) * strides[d] for d, (p, r) in enumerate(zip(pos, outer)))
            off += region[k].start * strides[k] if nd else 0
            async with sem:
                await self._get(off * item, flat[i])

        await asyncio.gather(*(one(i, pos) for i, pos in enumerate(idx)))
        return out

    def blocking(self, region: Region) -> Callable[[], np.ndarray] | None:
        """One blocking read (``preadv``) when the file is local and ``region`` is one
        contiguous byte range (a whole tensor, or whole rows: what a sharded load reads);
        None otherwise."""
        if not isinstance(self.backend, LocalBackend):
            return None
        shape = self.shape
        lead = 0  # axes before the first partial one must have extent 1
        while lead < len(shape) and region[lead].stop - region[lead].start == 1:
            lead += 1
        if any((r.start, r.stop) != (0, n) for r, n in zip(region[lead + 1 :], shape[lead + 1 :])):
            return None
        off = sum(r.start * math.prod(shape[d + 1 :]) for d, r in enumerate(region))
        backend = self.backend

        def read() -> np.ndarray:
            out = np.empty(region_shape(region), self.dtype)
            mv = out.reshape(-1).view(np.uint8).data
            if mv.nbytes:
                at = self.start + off * out.itemsize
                try:
                    n = backend._get_into(self.key, [mv], at)
                except OSError as e:
                    if e.errno in NOT_DATA:
                        raise _not_data(e, f"{self.src.url}: {self.key}") from e
                    raise
                self._check(n, mv, at)
            return out

        return read

    async def _get(self, offset: int, dest: np.ndarray) -> None:
        mv = memoryview(dest.data).cast("B")
        at = self.start + offset
        try:
            n = await self.backend.get_into(self.key, [mv], at)
        except OSError as e:
            if e.errno in NOT_DATA:
                raise _not_data(e, f"{self.src.url}: {self.key}") from e
            raise
        self._check(n, mv, at)

    def _check(self, n: int, mv: memoryview, at: int) -> None:
        with self.src.lock:  # blocking reads count from worker threads
            self.src.bytes_read += n
            self.src.requests += 1
        if n < mv.nbytes:
            raise CorruptCheckpointError(
                f"{self.src.url}: {self.key} is truncated ({n} of {mv.nbytes} bytes at offset "
                f"{at}); re-download it"
            )


class SafetensorsSource(Source):
    """A safetensors file or an HF directory of them, as a lazy tree.

    ``metadata``: ``{"__metadata__": {...}, "files": [...], "index": {...}}`` (the merged
    ``__metadata__`` of the files; the index's ``metadata`` for a sharded directory).
    ``bytes_read`` / ``requests`` count the tensor bytes and requests made so far.
    """

    format: ClassVar[str] = "safetensors"

    def __init__(self, url: str, tree: Any, metadata: dict[str, Any]) -> None:
        self.url, self.tree, self.metadata = url, tree, metadata
        self.bytes_read = 0
        self.requests = 0
        self.header_bytes = 0
        self.lock = threading.Lock()

    @classmethod
    def detect(cls, url: str, storage_options: dict[str, Any]) -> bool:
        if url.endswith(".safetensors"):
            return True

        async def probe() -> bool:
            b = open_backend(url, storage_options)
            return await b.exists(INDEX) or await b.exists(SINGLE)

        try:
            return submit(probe()).result()
        except (FileNotFoundError, NotADirectoryError):
            return False

    @classmethod
    def open(cls, url: str, storage_options: dict[str, Any]) -> SafetensorsSource:
        return submit(cls._open(url, storage_options)).result()

    @classmethod
    async def _open(cls, url: str, storage_options: dict[str, Any]) -> SafetensorsSource:
        if url.endswith(".safetensors"):
            root, name = _split(url)
            backend = open_backend(root, storage_options)
            files, index_meta, weight_map = [name], None, None
        else:
            backend = open_backend(url, storage_options)
            if await backend.exists(INDEX):
                index_meta, weight_map, files = await cls._index(backend, url)
            elif await backend.exists(SINGLE):
                files, index_meta, weight_map = [SINGLE], None, None
            else:
                raise CheckpointNotFoundError(
                    f"{url}: neither {INDEX} nor {SINGLE} exists; pass the .safetensors file's URL"
                )
        src = cls(url, None, {})
        headers = await asyncio.gather(*(cls._header(src, backend, url, f) for f in files))
        flat: dict[str, SourceArray] = {}
        merged: dict[str, str] = {}
        held: dict[str, str] = {}  # tensor name -> the first file whose header holds it
        for f, (fb, key, start, doc) in zip(files, headers):
            merged.update(
                {k: v for k, v in (doc.get("__metadata__") or {}).items() if k not in merged}
            )
            for name, info in doc.items():
                if name == "__metadata__":
                    continue
                if name in held:  # even where the index picks one: which is the weight?
                    raise CorruptCheckpointError(
                        f"{url}: tensor {name!r} appears in two files, {held[name]} and {f}; "
                        "the directory is inconsistent, re-download it"
                    )
                held[name] = f
                if weight_map is not None and name not in weight_map:
                    raise CorruptCheckpointError(
                        f"{url}: shard {f} holds tensor {name!r}, which {INDEX} does not list "
                        "(following the index would drop it); the directory is inconsistent, "
                        "re-download it"
                    )
                if weight_map is not None and weight_map[name] != f:
                    continue  # the index names a shard whose header lacks it: refused below
                dt = DTYPES[info["dtype"]]
                shape = tuple(info["shape"])
                reader = _Reader(src, fb, key, start + info["data_offsets"][0], shape, dt)
                flat[name] = SourceArray(shape, dt, tuple(name.split(".")), reader, url)
        if weight_map is not None:
            lost = sorted(set(weight_map) - set(flat))
            if lost:
                raise CorruptCheckpointError(
                    f"{url}/{INDEX} maps {lost[:5]} to shards whose headers lack them; the "
                    "directory is inconsistent, re-download it"
                )
        try:
            tree: Any = unflatten(flat)
        except ValueError:
            tree = dict(flat)
            for name, arr in flat.items():
                arr.key_path = (name,)
        src.tree = tree
        src.metadata = {"__metadata__": merged, "files": files}
        if index_meta is not None:
            src.metadata["index"] = index_meta
        return src

    @staticmethod
    async def _index(backend: Backend, url: str) -> tuple[Any, dict[str, str], list[str]]:
        where = f"{url}/{INDEX}"
        fb, key = await run_blocking(resolve_local, backend, INDEX, where)
        if await fb.size(key) > MAX_INDEX:
            raise CorruptCheckpointError(f"{where}: larger than {MAX_INDEX} bytes; refusing it")
        try:
            doc = untrusted_json(await _read(fb, key, where))
        except ValueError as e:
            raise CorruptCheckpointError(f"{where}: not JSON ({e}); re-download it") from None
        wm = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(wm, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in wm.items()
        ):
            raise CorruptCheckpointError(f"{where}: no weight_map of name → file; re-download it")
        if not wm:
            raise CorruptCheckpointError(
                f"{where}: its weight_map names no tensor (the directory would load as an "
                "empty tree); the index is damaged, re-download it"
            )
        files = sorted(set(wm.values()))
        for f in files:
            why = bad_shard_name(f)
            if why:
                raise CorruptCheckpointError(
                    f"{where}: shard name {f[:200]!r} {why}; the index is damaged, re-download it"
                )
        return doc.get("metadata"), wm, files

    @staticmethod
    async def _header(
        src: SafetensorsSource, backend: Backend, url: str, name: str
    ) -> tuple[Backend, str, int, dict[str, Any]]:
        where = url if url.endswith(name) else f"{url}/{name}"
        try:
            backend, key = await run_blocking(resolve_local, backend, name, where)
            size = await backend.size(key)
        except FileNotFoundError:
            raise CheckpointNotFoundError(
                f"{where}: safetensors shard not found"
                + ("" if url.endswith(name) else f" (named by {INDEX})")
                + "; the download is incomplete, fetch the missing shard"
            ) from None
        head = await _read(backend, key, where, 0, min(size, 8))
        n = int.from_bytes(head, "little") if len(head) == 8 else 0
        if len(head) < 8 or n > MAX_HEADER or 8 + n > size:
            parse_header(head, b"", size, where)  # raises with the reason
        body = await _read(backend, key, where, 8, 8 + n)
        src.header_bytes += 8 + len(body)
        return (backend, key, *parse_header(head, body, size, where))


def _not_data(e: OSError, where: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{where}: not a readable file ({e.strerror}); replace it with the file it should be"
    )


async def _read(
    backend: Backend, key: str, where: str, start: int = 0, end: int | None = None
) -> bytes:
    try:
        return await backend.get(key, start, end)
    except OSError as e:
        if e.errno in NOT_DATA:
            raise _not_data(e, where) from e
        raise
