"""A leaf's codec chain as zarr v3 defines it: its array-to-array codecs (filters), ``bytes``
(little endian), its bytes-to-bytes codecs (compressors, checksums), then the ``crc32c``
quire appends, all inside ``sharding_indexed`` when the leaf has inner chunks.

This module puts each codec the user names where its kind goes (:func:`place`), reads a
record's chain back (:func:`from_record`), says which codecs lose information
(:func:`lossy`), and runs one codec on quire's worker threads (:func:`encode`,
:func:`decode`), whether the codec offers zarr's synchronous methods or only its async ones.
"""

from __future__ import annotations

import asyncio
import math
import threading
import warnings
from collections.abc import Callable, Coroutine, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import ml_dtypes
import numpy as np

from quire._format.bounds import MAX_CLAIMED_BYTES, MAX_CODEC_CONFIG, MAX_CODEC_NAME, MAX_CODECS
from quire._format.codecrecord import (
    BYTES,
    BYTES_JSON,
    PLACED_BY_QUIRE,
    config_dtype,
    config_size,
    split,
)
from quire._format.dtypes import dtype_name
from quire._handlers.codecs import brief, check_built, placed_error, resolve
from quire.errors import CodecError, CorruptCheckpointError, PluginError

T = TypeVar("T")

#: The three kinds of zarr v3 codec, as :func:`kind_of` names them.
ARRAY_TO_ARRAY = "array_to_array"
ARRAY_TO_BYTES = "array_to_bytes"
BYTES_TO_BYTES = "bytes_to_bytes"
KINDS = (ARRAY_TO_ARRAY, ARRAY_TO_BYTES, BYTES_TO_BYTES)


def kind_of(codec: Any) -> str | None:
    """The kind of a zarr v3 codec object, or None if it is none of the three."""
    from zarr.abc.codec import ArrayArrayCodec, ArrayBytesCodec, BytesBytesCodec

    if isinstance(codec, ArrayArrayCodec):
        return ARRAY_TO_ARRAY
    if isinstance(codec, ArrayBytesCodec):
        return ARRAY_TO_BYTES
    if isinstance(codec, BytesBytesCodec):
        return BYTES_TO_BYTES
    return None


def name_of(codec: Any) -> str:
    """The name a codec is stored under (its ``to_dict()["name"]``)."""
    return str(codec.to_dict().get("name", type(codec).__name__))


@dataclass(frozen=True)
class Chain:
    """The codecs of a chain that vary by leaf: array-to-array ones before ``bytes``,
    bytes-to-bytes ones after it (quire's ``crc32c`` is the layout's ``checksum``)."""

    filters: tuple[Any, ...] = ()
    compressors: tuple[Any, ...] = ()

    def record(self) -> list[dict[str, Any]]:
        """The record's ``codecs``: ``bytes`` is listed only after array-to-array codecs."""
        bb = [c.to_dict() for c in self.compressors]
        if not self.filters:
            return bb
        return [*(c.to_dict() for c in self.filters), dict(BYTES_JSON), *bb]


def _is_little_bytes(codec: Any) -> bool:
    d = codec.to_dict()
    endian = (d.get("configuration") or {}).get("endian", "little")
    return d.get("name") in (BYTES, "endian") and endian in ("little", None)


def place(specs: Iterable[Any], *, url: str | None = None) -> Chain:
    """Each codec of ``specs`` (ids, ``{"name", "configuration"}`` dicts, zarr codec objects)
    where its kind goes, in the order given within a kind.

    ``bytes`` (little endian) and zarr's ``crc32c`` are already in the chain and are
    dropped.  Raises :class:`CodecError` naming a codec that has no place in it: an
    array-to-bytes codec other than ``bytes``, ``sharding_indexed`` (quire shards when
    ``StorageOptions(chunk_bytes=...)`` asks), an object that is no zarr v3 codec; and
    :class:`~quire.errors.PluginError` for a name no registry knows.
    """
    filters: list[Any] = []
    compressors: list[Any] = []
    given = list(specs)
    if len(given) > MAX_CODECS:
        raise CodecError(f"{len(given)} codecs for one leaf: at most {MAX_CODECS} may be chained")
    for spec in given:
        codec = resolve(spec, url=url)
        name = name_of(codec)
        if len(name) > MAX_CODEC_NAME:
            raise CodecError(f"codec name {name[:80]!r}... is over {MAX_CODEC_NAME} characters")
        if config_size(codec.to_dict().get("configuration") or {}) > MAX_CODEC_CONFIG:
            raise CodecError(
                f"codec {name!r}: its configuration is over {MAX_CODEC_CONFIG} characters of JSON"
            )
        kind = kind_of(codec)
        if kind == ARRAY_TO_ARRAY:
            filters.append(codec)
        elif kind == BYTES_TO_BYTES:
            if type(codec).__name__ != "Crc32cCodec":  # quire appends its own
                compressors.append(codec)
        elif kind == ARRAY_TO_BYTES and _is_little_bytes(codec):
            continue
        elif name in PLACED_BY_QUIRE:
            raise placed_error(name)
        elif kind == ARRAY_TO_BYTES:
            raise CodecError(
                f"codec {name!r} is an array-to-bytes codec, and the chain's one array-to-bytes "
                "place holds 'bytes' (little endian); give array-to-array codecs (before it) "
                "and bytes-to-bytes codecs (after it)"
            )
        else:
            raise CodecError(
                f"codec {name!r} ({type(codec).__name__}) is none of zarr v3's three kinds "
                "(array-to-array, array-to-bytes, bytes-to-bytes)"
            )
    names = [name_of(c) for c in filters]
    if "transpose" in names and any(n.startswith("numcodecs.") for n in names):
        raise CodecError(
            f"codecs {names}: zarr-python reads 'transpose' together with numcodecs' "
            "array-to-array codecs wrongly (it hands them transposed views, which they flatten "
            "in memory order), and quire writes nothing plain zarr misreads; use one or the other"
        )
    return Chain(tuple(filters), tuple(compressors))


def from_record(entries: Sequence[dict[str, Any]], *, url: str | None, where: str) -> Chain:
    """The chain a (schema-checked) record's ``codecs`` names; a codec of the wrong kind for
    its place, or one quire refuses, is a :class:`CorruptCheckpointError` naming it."""
    aa, bb = split(list(entries))
    out: list[list[Any]] = [[], []]
    for entry, want in [(e, ARRAY_TO_ARRAY) for e in aa] + [(e, BYTES_TO_BYTES) for e in bb]:
        try:
            codec = check_built(resolve(entry, url=url))
        except CodecError as e:
            raise CorruptCheckpointError(
                f"{url}: {where}: {e}; the record names a codec quire does not read"
            ) from e
        except PluginError as e:
            raise PluginError(f"{where}: {e}", group=e.group, name=e.name) from e
        kind = kind_of(codec)
        if kind != want:
            raise CorruptCheckpointError(
                f"{url}: {where}: codec {entry.get('name')!r} is {kind or 'no zarr codec'}, "
                f"listed where a {want} codec goes; the record is damaged"
            )
        out[want == BYTES_TO_BYTES].append(codec)
    return Chain(tuple(out[0]), tuple(out[1]))


def check_specs(filters: Sequence[Any], spec: Any) -> list[Any]:
    """The chunk spec each array-to-array codec of ``filters`` gets, then the one ``bytes``
    encodes; :class:`CodecError` unless every step keeps to dtypes quire stores."""
    from zarr.core.chunk_grids import RegularChunkGrid

    specs = [spec]
    for c in filters:
        name = name_of(c)
        _check_input_dtype(c, spec.dtype.to_native_dtype())
        try:
            c.validate(
                shape=spec.shape,
                dtype=spec.dtype,
                chunk_grid=RegularChunkGrid(chunk_shape=spec.shape),
            )
            spec = c.resolve_metadata(spec)
            native = spec.dtype.to_native_dtype()
            dtype_name(native)
        except Exception as e:
            raise CodecError(
                f"codec {name!r} cannot encode {specs[-1].dtype} chunks: {brief(e)}"
            ) from e
        if math.prod(spec.shape) * native.itemsize > MAX_CLAIMED_BYTES:
            raise CodecError(f"codec {name!r} makes chunks of shape {spec.shape}")
        specs.append(spec)
    return specs


def _check_input_dtype(codec: Any, dtype: np.dtype[Any]) -> None:
    """numcodecs' array-to-array codecs name the dtype they decode to (``dtype``,
    ``decode_dtype``): it must be the dtype of the chunks they get, or the decode would
    hand back another type than was saved."""
    config = codec.to_dict().get("configuration") or {}
    for key in ("dtype", "decode_dtype"):
        v = config.get(key)
        if v is None:
            continue
        named = config_dtype(v)
        if named is None or named != dtype.newbyteorder("="):
            raise CodecError(
                f"codec {name_of(codec)!r} has {key}={v!r}, and the chunks it gets are {dtype}: "
                f"give {key}={dtype_name(dtype)!r} (or leave it out where the codec infers it)"
            )


# ------------------------------------------------------------------------------ lossiness
def _dtype(v: Any, default: np.dtype[Any]) -> np.dtype[Any]:
    return default if v is None else np.dtype(v)


def _numcodecs_lossy(name: str, cfg: dict[str, Any], dtype: np.dtype[Any]) -> bool | None:
    """Whether one of numcodecs' / zarr's array-to-array codecs loses information on
    ``dtype`` arrays, or None for a codec this table does not know."""
    if name in ("transpose", "numcodecs.packbits"):
        return False
    if name == "numcodecs.quantize":
        return True
    if name == "numcodecs.bitround":
        if dtype.kind != "f":
            return True
        return int(cfg.get("keepbits", 0)) < int(ml_dtypes.finfo(dtype).nmant)
    if name == "numcodecs.astype":
        src = _dtype(cfg.get("decode_dtype"), dtype)
        return not np.can_cast(src, _dtype(cfg.get("encode_dtype"), src), "safe")
    if name == "numcodecs.delta":  # exact on integers (wrapping), not on floats
        return not (dtype.kind in "biu" and _dtype(cfg.get("astype"), dtype) == dtype)
    if name == "numcodecs.fixedscaleoffset":
        exact = cfg.get("scale", 1) == 1 and cfg.get("offset", 0) == 0
        wide = np.can_cast(dtype, _dtype(cfg.get("astype"), dtype), "safe")
        return not (dtype.kind in "iu" and exact and wide)
    return None


def is_lossy(codec: Any, dtype: np.dtype[Any]) -> bool:
    """Whether ``codec`` may fail to restore ``dtype`` input bit for bit.

    A codec says so itself with a ``lossy`` attribute (a bool, or a callable taking the
    input dtype); numcodecs' array-to-array codecs are judged from their configuration;
    any other array-to-array codec counts as lossy, bytes-to-bytes codecs as exact.
    """
    declared = getattr(codec, "lossy", None)
    if isinstance(declared, bool):
        return declared
    if callable(declared):
        return bool(declared(dtype))
    if kind_of(codec) != ARRAY_TO_ARRAY:
        return False
    d = codec.to_dict()
    verdict = _numcodecs_lossy(str(d.get("name")), dict(d.get("configuration") or {}), dtype)
    return True if verdict is None else verdict


def lossy(chain: Chain, specs: Sequence[Any]) -> tuple[str, ...]:
    """Names of the codecs of ``chain`` that may lose information (``specs`` as
    :func:`check_specs` gives them)."""
    out = []
    for c, spec in zip(chain.filters, specs):
        if is_lossy(c, spec.dtype.to_native_dtype()):
            out.append(name_of(c))
    dtype = specs[-1].dtype.to_native_dtype()
    out += [name_of(c) for c in chain.compressors if is_lossy(c, dtype)]
    return tuple(dict.fromkeys(out))


def evolved(codecs: Sequence[Any], spec: Any) -> tuple[Any, ...]:
    """``codecs`` with what they infer from the array filled in, as zarr does when it
    opens an array (every codec sees the array's spec)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # numcodecs' codecs warn when made: see codecs.py
        try:
            out = tuple(c.evolve_from_array_spec(spec) for c in codecs)
        except Exception as e:
            raise CodecError(f"codecs {[name_of(c) for c in codecs]}: {brief(e)}") from e
    return tuple(check_built(c) for c in out)


# ------------------------------------------------------------------------------ running
class _Inline(ThreadPoolExecutor):
    """Runs what a codec hands ``asyncio.to_thread`` at once, in the calling thread: the
    chain already runs on one of quire's worker threads, another hop would only cost."""

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        f: Future[T] = Future()
        try:
            f.set_result(fn(*args, **kwargs))
        except BaseException as e:
            f.set_exception(e)
        return f


_local = threading.local()


def _new_loop() -> asyncio.AbstractEventLoop:
    loop = asyncio.new_event_loop()
    loop.set_default_executor(_Inline(max_workers=1))
    return loop


def _run(make: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run an async codec method to completion from synchronous code."""
    try:
        asyncio.get_running_loop()
        running = True
    except RuntimeError:
        running = False
    if not running:  # (outside the except: a codec's error must not chain to that one)
        loop = getattr(_local, "loop", None)
        if loop is None:
            loop = _local.loop = _new_loop()
        return loop.run_until_complete(make())

    def aside() -> T:  # called on an event loop's thread: run it on a thread of its own
        loop = _new_loop()
        try:
            return loop.run_until_complete(make())
        finally:
            loop.close()

    with ThreadPoolExecutor(1) as ex:
        return ex.submit(aside).result()


def encode(codec: Any, data: Any, spec: Any) -> Any:
    """``codec`` applied to one chunk (a zarr ``NDBuffer`` or ``Buffer``)."""
    if callable(getattr(codec, "_encode_sync", None)):  # zarr's SupportsSyncCodec
        out = codec._encode_sync(data, spec)
    else:
        out = next(iter(_run(lambda: codec.encode([(data, spec)]))))
    if out is None:
        raise ValueError(f"codec {name_of(codec)!r} encoded a chunk to nothing")
    return out


def decode(codec: Any, data: Any, spec: Any) -> Any:
    """``codec`` undone on one chunk (a zarr ``Buffer`` or ``NDBuffer``)."""
    if callable(getattr(codec, "_decode_sync", None)):
        out = codec._decode_sync(data, spec)
    else:
        out = next(iter(_run(lambda: codec.decode([(data, spec)]))))
    if out is None:
        raise ValueError(f"codec {name_of(codec)!r} decoded a chunk to nothing")
    return out


def apply_filters(filters: Sequence[Any], arr: np.ndarray, specs: Sequence[Any]) -> np.ndarray:
    """``arr`` through each array-to-array codec, checked against the spec ``bytes`` gets."""
    from zarr.core.buffer.cpu import NDBuffer

    for c, spec, nxt in zip(filters, specs, specs[1:]):
        # C order: numcodecs' codecs flatten with order="A", which a transposed view (what
        # transpose hands on) would turn into Fortran order.
        arr = np.ascontiguousarray(arr)
        out = np.asarray(encode(c, NDBuffer.from_numpy_array(arr), spec).as_numpy_array())
        arr = _checked(out, nxt, c, "encoded")
    return arr


def undo_filters(filters: Sequence[Any], arr: np.ndarray, specs: Sequence[Any]) -> np.ndarray:
    """The array-to-array codecs undone in reverse order; each result is checked against
    the shape and dtype its codec got, so a codec cannot hand on anything else."""
    from zarr.core.buffer.cpu import NDBuffer

    for c, spec in reversed(list(zip(filters, specs))):
        arr = np.ascontiguousarray(arr)  # as apply_filters
        out = np.asarray(decode(c, NDBuffer.from_numpy_array(arr), spec).as_numpy_array())
        arr = _checked(out, spec, c, "decoded")
    return arr


def _checked(arr: np.ndarray, spec: Any, codec: Any, what: str) -> np.ndarray:
    """``arr`` as the shape and dtype of ``spec``.  An encoder's array of another dtype of
    the same item size is taken as its bytes (numcodecs' bit-round hands back the integer
    view it rounded), as zarr's ``bytes`` codec takes it; numcodecs' decoders may return
    flat arrays.  Anything else is an error."""
    want = spec.dtype.to_native_dtype()
    shape = tuple(spec.shape)
    have = arr.dtype.newbyteorder("=")
    if have != want.newbyteorder("=") and what == "encoded" and have.itemsize == want.itemsize:
        arr = np.ascontiguousarray(arr).view(want)
        have = arr.dtype
    if have == want.newbyteorder("=") and arr.size == math.prod(shape):
        return arr if arr.shape == shape else arr.reshape(shape)
    raise ValueError(
        f"codec {name_of(codec)!r} {what} a {arr.dtype} array of shape {arr.shape}, "
        f"expected {want} of shape {shape}"
    )
