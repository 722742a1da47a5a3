"""One codec from its spec: the first-party factories (``quire.codecs`` entry points: id + JSON
config -> zarr codec), then zarr's own codec registry for names no ``quire.codecs`` plugin
provides (numcodecs' codecs: ``numcodecs.zstd``, ``numcodecs.bitround``, ...); codecs that
decode to Python objects are refused whichever registry offers them.

Where each codec goes in a leaf's chain is :mod:`quire._handlers.chain`'s business.
"""

from __future__ import annotations

import json
import warnings
from typing import Any

from quire._format.codecrecord import OBJECT_CODEC_IDS, PLACED_BY_QUIRE, is_object_codec
from quire._runtime import registry as _registries
from quire._runtime.registry import canonical, installed
from quire._runtime.registry import codecs as _registry
from quire.errors import CodecError, PluginError


def zstd(level: int = 3, checksum: bool = False, **_: Any) -> Any:
    from zarr.codecs import ZstdCodec

    return ZstdCodec(level=level, checksum=checksum)


def gzip(level: int = 5, **_: Any) -> Any:
    from zarr.codecs import GzipCodec

    return GzipCodec(level=level)


def blosc(
    cname: str = "zstd",
    clevel: int = 5,
    shuffle: str = "shuffle",
    typesize: int | None = None,
    blocksize: int = 0,
    **_: Any,
) -> Any:
    from zarr.codecs import BloscCodec

    opts: dict[str, Any] = {
        "cname": cname,
        "clevel": clevel,
        "shuffle": shuffle,
        "typesize": typesize,
        "blocksize": blocksize,
    }
    return BloscCodec(**opts)


def crc32c(**_: Any) -> Any:
    from zarr.codecs import Crc32cCodec

    return Crc32cCodec()


# zarr codecs are immutable, so one object per distinct spec is shared; a record may name
# any number of distinct specs, so the cache is emptied when it grows past this, and when a
# registry changes (a plugin installed or registered at run time).
_CACHE_SIZE = 512
_resolved: dict[str, Any] = {}
_generation = 0


def resolve(spec: Any, *, url: str | None = None) -> Any:
    """A zarr v3 codec of any kind from an id, a ``{"name", "configuration"}`` dict or a codec.

    Raises
    ------
    PluginError
        No ``quire.codecs`` plugin and no zarr codec has that name, or the library it
        wraps is not installed.
    CodecError
        The codec decodes to Python objects, or its configuration is refused.
    """
    global _generation
    if isinstance(spec, str | dict):
        try:
            key = json.dumps(spec, sort_keys=True)
        except (TypeError, ValueError):
            key = None
        if key is not None:
            if _generation != _registries.generation:
                _resolved.clear()
                _generation = _registries.generation
            hit = _resolved.get(key)
            if hit is None:
                hit = _resolve(spec, url=url)
                if len(_resolved) >= _CACHE_SIZE:
                    _resolved.clear()
                _resolved[key] = hit
            return hit
    return _resolve(spec, url=url)


def _resolve(spec: Any, *, url: str | None = None) -> Any:
    name: Any
    config: Any
    if isinstance(spec, str):
        name, config = spec, {}
    elif isinstance(spec, dict):
        name, config = spec.get("name"), spec.get("configuration") or {}
        if not isinstance(name, str):
            raise CodecError(f"codec spec {_clip(spec)} has no 'name'")
        if not isinstance(config, dict):
            raise CodecError(f"codec {name[:200]!r}: configuration {_clip(config)} is not a dict")
    elif hasattr(spec, "to_dict"):
        return refuse_objects(spec, _clip(spec))
    else:
        raise CodecError(f"cannot use {_clip(spec)} as a codec: give an id, a dict or a zarr codec")
    if is_object_codec(name):
        raise _object_error(name)
    if name in PLACED_BY_QUIRE:
        raise placed_error(name)
    if name in _registry.names():
        factory = _registry.get(name, url=url)
        try:
            codec = factory(**config)
        except ImportError as e:  # the plugin loaded, the library it wraps did not
            raise _registry.creation_error(name, "codec", e) from e
        except (TypeError, ValueError) as e:
            raise CodecError(
                f"codec {name!r} refuses configuration {_clip(config)}: {brief(e)}"
            ) from e
        if not hasattr(codec, "to_dict"):
            raise CodecError(
                f"quire.codecs plugin {name!r} made {codec!r}, not a zarr v3 codec; "
                "its factory must return one"
            )
    else:
        codec = _from_zarr(name, config, url)
    return refuse_objects(codec, name)


def _from_zarr(name: str, config: dict[str, Any], url: str | None) -> Any:
    """The codec zarr's registry knows as ``name`` (numcodecs' codecs among them)."""
    from zarr.codecs.numcodecs import _NumcodecsCodec
    from zarr.registry import get_codec_class

    try:
        cls = get_codec_class(name)
    except KeyError:
        where = f" (needed for {url})" if url else ""
        have = ", ".join(_registry.names()) or "none"
        raise PluginError(
            f"no quire.codecs plugin named {name!r}{where}, and zarr knows no codec of that "
            f"name; install the package that provides it (installed quire.codecs plugins: "
            f"{have}; numcodecs' codecs are named numcodecs.<id>, such as numcodecs.zstd)",
            group="quire.codecs",
            name=name,
        ) from None
    with warnings.catch_warnings():
        # zarr warns that numcodecs' codecs are outside the zarr v3 specification: quire
        # uses them only where the user names them, and the docs say which readers know them.
        warnings.simplefilter("ignore")
        try:
            codec = cls.from_dict({"name": name, "configuration": config})
        except (TypeError, ValueError, KeyError) as e:
            raise CodecError(
                f"codec {name!r} refuses configuration {_clip(config)}: {brief(e)}"
            ) from e
    if isinstance(codec, _NumcodecsCodec):
        _check_numcodec(name, dict(codec.codec_config), complete=False)
    return codec


def _check_numcodec(name: str, config: dict[str, Any], *, complete: bool) -> None:
    """Build the numcodecs codec a zarr ``numcodecs.*`` codec wraps now (zarr builds it at
    its first chunk), so that a missing library, or with ``complete`` a configuration the
    codec refuses, is known up front (before ``complete``, zarr may still fill in what
    it infers from the array: ``numcodecs.quantize``'s dtype)."""
    import numcodecs
    from numcodecs.errors import UnknownCodecError

    ident = str(config.get("id"))
    try:
        inner = numcodecs.get_codec(config)
    except UnknownCodecError as e:
        raise PluginError(
            f"numcodecs has no codec {ident!r} here ({e}): it needs a library that is not "
            f"installed; install it with pip install 'numcodecs[{ident}]'",
            group="quire.codecs",
            name=name,
        ) from e
    except (TypeError, ValueError, KeyError) as e:
        if not complete:
            return
        raise CodecError(f"codec {name!r} refuses configuration {_clip(config)}: {brief(e)}") from e
    _refuse_numcodec(inner, name)


def check_built(codec: Any) -> Any:
    """``codec`` once its configuration is complete (evolved, or read from a record): for
    numcodecs' codecs, the codec they wrap is built now, so a configuration it refuses is a
    :class:`CodecError` here rather than at the first chunk."""
    from zarr.codecs.numcodecs import _NumcodecsCodec

    if isinstance(codec, _NumcodecsCodec):
        _check_numcodec(codec.codec_name, dict(codec.codec_config), complete=True)
    return codec


def brief(error: BaseException, limit: int = 300) -> str:
    """A codec's error message, clipped: a codec may quote a whole configuration in it."""
    text = str(error)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _clip(value: Any, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _object_classes() -> tuple[type, ...]:
    import numcodecs

    names = ("Pickle", "JSON", "MsgPack", "VLenUTF8", "VLenBytes", "VLenArray", "Categorize")
    return tuple(c for c in (getattr(numcodecs, n, None) for n in names) if isinstance(c, type))


def _refuse_numcodec(inner: Any, name: str) -> None:
    if isinstance(inner, _object_classes()) or getattr(inner, "codec_id", None) in OBJECT_CODEC_IDS:
        raise _object_error(name)


def refuse_objects(codec: Any, name: str) -> Any:
    """``codec``, unless it decodes to Python objects (then :class:`CodecError`)."""
    from zarr.codecs import VLenBytesCodec, VLenUTF8Codec
    from zarr.codecs.numcodecs import _NumcodecsCodec

    try:
        stored = codec.to_dict().get("name")
    except Exception as e:
        raise CodecError(f"codec {name}: to_dict() failed ({type(e).__name__}: {e})") from e
    if isinstance(codec, VLenBytesCodec | VLenUTF8Codec) or (
        isinstance(stored, str) and is_object_codec(stored)
    ):
        raise _object_error(name)
    if isinstance(codec, _NumcodecsCodec):
        ident = codec.codec_config.get("id")
        if ident in OBJECT_CODEC_IDS:
            raise _object_error(name)
        import numcodecs

        cls = numcodecs.registry.codec_registry.get(str(ident))
        if isinstance(cls, type) and issubclass(cls, _object_classes()):
            raise _object_error(name)
    return codec


def placed_error(name: str) -> CodecError:
    return CodecError(
        f"codec {name!r} has no place in the list: quire wraps the chain in it when "
        "StorageOptions(chunk_bytes=...) splits a shard into inner chunks"
    )


def _object_error(name: str) -> CodecError:
    return CodecError(
        f"codec {name!r} decodes to Python objects, which quire never writes or loads (no "
        "pickle: loading a checkpoint must never run code); store numbers, with numeric codecs"
    )


def distribution(name: str) -> str | None:
    """The distribution providing codec ``name``: its ``quire.codecs`` plugin, else the
    package that registers it with zarr (None for zarr's and numcodecs' own)."""
    dist = _registry.distribution(name)
    if dist is not None or name in _registry.names():
        return dist
    for group in ("zarr.codecs", f"zarr.codecs.{name}"):
        for ep in installed(group):
            if group == "zarr.codecs" and ep.name != name:
                continue
            d = getattr(ep, "dist", None)
            found = None if d is None else d.metadata["Name"]
            if found and canonical(found) not in ("zarr", "numcodecs"):
                return str(found)
    return None
