"""The codec chain a leaf record names (its ``codecs`` and ``lossy`` fields), checked before
any codec is built from it: shared by the record's checker (:mod:`quire._format.schema`) and
the chain builder (:mod:`quire._handlers.chain`).

A record lists a leaf's codecs in chain order, without the ``crc32c`` quire appends: its
array-to-array codecs, then ``bytes`` (little endian), then its bytes-to-bytes codecs.  A
chain without array-to-array codecs leaves ``bytes`` out (it is then first), as every record
written before array-to-array codecs existed does.  ``lossy`` names the codecs of the chain
that do not restore their input bit for bit.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from quire._format.bounds import MAX_CODEC_CONFIG, MAX_CODEC_NAME, MAX_CODECS
from quire._format.dtypes import supported
from quire._format.schema_values import Invalid, _dict, _list, _short, _str

if TYPE_CHECKING:
    import numpy as np

#: The array-to-bytes codec of every chain quire writes, as a record names it.
BYTES = "bytes"
BYTES_JSON: dict[str, Any] = {"name": BYTES, "configuration": {"endian": "little"}}

#: numcodecs' codecs whose decoded values are Python objects (``pickle`` runs code when it
#: decodes).  quire stores numbers only: it refuses them by name under any prefix a registry
#: gives them (``numcodecs.pickle``, ``pickle``), and by class once built
#: (``quire._handlers.codecs``).
OBJECT_CODEC_IDS = frozenset(
    {
        "pickle",
        "json",
        "json2",
        "msgpack",
        "msgpack2",
        "vlen-utf8",
        "vlen-bytes",
        "vlen-array",
        "categorize",
    }
)

#: Configuration keys that hold a dtype in numcodecs' codecs (``numcodecs.astype``,
#: ``numcodecs.delta``, ``numcodecs.fixedscaleoffset``, ``numcodecs.quantize``): a decode
#: makes arrays of that dtype, so a record's value must be one quire stores (an object or
#: a ten-megabyte string dtype would be allocated per element).
DTYPE_KEYS = ("dtype", "astype", "encode_dtype", "decode_dtype")

#: Codecs a record never names: quire writes the sharding codec itself (``inner_shape``).
PLACED_BY_QUIRE = frozenset({"sharding_indexed"})


def is_object_codec(name: str) -> bool:
    """Whether ``name`` is one of the codecs that decode to Python objects."""
    return name.removeprefix("numcodecs.") in OBJECT_CODEC_IDS


def config_dtype(value: Any) -> np.dtype[Any] | None:
    """The numeric dtype a codec configuration's dtype value names, or None if it names none
    quire stores (an object, string, void or structured dtype, or not a dtype at all)."""
    import numpy as np  # heavy: only a codec configuration naming a dtype needs it

    if type(value) is not str or not 0 < len(value) <= 32:
        return None
    d = supported().get(value)
    if d is not None:
        return d
    try:
        d = np.dtype(value)
    except (TypeError, ValueError, SyntaxError):
        return None
    if d.fields is not None or d.subdtype is not None:
        return None
    native = d.newbyteorder("=")
    return native if any(native == s for s in supported().values()) else None


def config_size(config: Any) -> int:
    """Characters of a codec configuration as JSON (what :data:`MAX_CODEC_CONFIG` bounds)."""
    return len(json.dumps(config, separators=(",", ":")))


def split(codecs: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A record's codec list cut at ``bytes``: (array-to-array, bytes-to-bytes) entries."""
    names = [c.get("name") for c in codecs]
    if BYTES not in names:
        return [], list(codecs)
    i = names.index(BYTES)
    return list(codecs[:i]), list(codecs[i + 1 :])


def check(codecs: Any, lossy: Any, where: str) -> None:
    """Raise :class:`Invalid` unless ``codecs`` (and ``lossy``) form a chain quire would write."""
    codecs = _list(codecs, where + "/codecs", MAX_CODECS)
    names = []
    for i, c in enumerate(codecs):
        w = f"{where}/codecs[{i}]"
        c = _dict(c, w)
        name = _str(c.get("name"), w + "/name", MAX_CODEC_NAME)
        if is_object_codec(name):
            raise Invalid(
                w + "/name",
                f"{name!r} decodes to Python objects, which quire never loads (no pickle)",
            )
        if name in PLACED_BY_QUIRE:
            raise Invalid(w + "/name", f"{name!r} is written by quire itself, never listed")
        config = _dict(c.get("configuration", {}), w + "/configuration")
        if config_size(config) > MAX_CODEC_CONFIG:
            raise Invalid(w + "/configuration", f"over {MAX_CODEC_CONFIG} characters of JSON")
        for key in DTYPE_KEYS:
            v = config.get(key)
            if v is not None and config_dtype(v) is None:
                raise Invalid(
                    f"{w}/configuration/{key}", f"{_short(v)} is not a dtype quire stores"
                )
        if name == BYTES:
            if BYTES in names:
                raise Invalid(w, "a second 'bytes' codec: a chain has one")
            if config != BYTES_JSON["configuration"]:
                raise Invalid(w + "/configuration", f"{_short(config)} is not little endian")
            if i == 0:
                raise Invalid(w, "'bytes' listed with no array-to-array codec before it")
        names.append(name)
    for i, n in enumerate(_list(lossy, where + "/lossy", MAX_CODECS)):
        if type(n) is not str or n not in names or n == BYTES:
            raise Invalid(f"{where}/lossy[{i}]", f"{_short(n)} is not a codec of this chain")
