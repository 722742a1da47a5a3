"""First-party codec factories (``quire.codecs`` entry points): id + JSON config -> zarr codec."""

from __future__ import annotations

import json
from typing import Any

from quire._runtime.registry import codecs as _registry
from quire.errors import PluginError


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


_resolved: dict[str, Any] = {}


def resolve(spec: Any, *, url: str | None = None) -> Any:
    """A zarr bytes-to-bytes codec from an id, a ``{"name", "configuration"}`` dict or a codec.

    zarr codecs are immutable, so one object per distinct spec is shared.
    """
    if isinstance(spec, str | dict):
        try:
            key = json.dumps(spec, sort_keys=True)
        except (TypeError, ValueError):
            key = None
        if key is not None:
            hit = _resolved.get(key)
            if hit is None:
                hit = _resolve(spec, url=url)
                _resolved[key] = hit
            return hit
    return _resolve(spec, url=url)


def _resolve(spec: Any, *, url: str | None = None) -> Any:
    name: Any
    if isinstance(spec, str):
        name, config = spec, {}
    elif isinstance(spec, dict):
        name, config = spec.get("name"), dict(spec.get("configuration") or {})
        if not isinstance(name, str):
            raise PluginError(f"codec spec {spec!r} has no 'name'")
    elif hasattr(spec, "to_dict"):
        return spec
    else:
        raise PluginError(f"cannot use {spec!r} as a codec: give an id, a dict or a zarr codec")
    factory = _registry.get(name, url=url)
    try:
        return factory(**config)
    except ImportError as e:  # the plugin loaded, the library it wraps did not
        raise _registry.creation_error(name, "codec", e) from e
