"""Conformance suite for codecs (entry-point group ``quire.codecs``).

A codec plugin is a factory: ``factory(**configuration)`` returns a zarr v3
bytes-to-bytes codec whose ``to_dict()`` is ``{"name": <codec id>, "configuration": {...}}``.
Subclass :class:`CodecSuite` and name the id::

    from quire.testing import CodecSuite

    class TestMyCodec(CodecSuite):
        codec_id = "my-codec"
        configurations = [{}, {"level": 9}]

Never override a ``test_*`` method to make it pass.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

import numpy as np
import pytest

from quire.testing._common import UrlFixture, flip_byte, record_of

__all__ = ["CodecSuite"]


def _arrays() -> dict[str, np.ndarray]:
    import ml_dtypes

    rng = np.random.default_rng(0)
    return {
        "f32": rng.standard_normal((33, 7)).astype(np.float32),
        "zeros": np.zeros((64, 64), np.float64),
        "i64": np.arange(1000, dtype=np.int64).reshape(10, 100),
        "u8": rng.integers(0, 255, 4099, dtype=np.uint8),
        "bool": rng.integers(0, 2, (5, 5)).astype(bool),
        "bf16": rng.standard_normal(17).astype(ml_dtypes.bfloat16),
        "scalar": np.array(3.5, np.float32),
        "empty": np.zeros((0, 4), np.int32),
    }


class CodecSuite(UrlFixture):
    """Tests every codec plugin passes.

    Attributes
    ----------
    codec_id : str
        The codec's ``quire.codecs`` entry-point name; the plugin coverage check counts
        the codec as covered by this attribute.
    configurations : list of dict
        Configurations to test (each passed as ``factory(**configuration)``).
    """

    group: ClassVar[str] = "quire.codecs"
    codec_id: ClassVar[str]
    configurations: ClassVar[list[dict[str, Any]]] = [{}]

    def codecs(self) -> list[Any]:
        """The codec objects for :attr:`codec_id` with each of :attr:`configurations`."""
        from quire._handlers import codecs as _codecs

        return [
            _codecs.resolve({"name": self.codec_id, "configuration": dict(c)})
            for c in self.configurations
        ]

    def test_factory_is_registered(self) -> None:
        from quire._runtime.registry import codecs

        factory = codecs.get(self.codec_id)
        assert callable(factory)
        for config in self.configurations:
            assert hasattr(factory(**config), "to_dict")

    def test_makes_bytes_to_bytes_codecs(self) -> None:
        from zarr.abc.codec import BytesBytesCodec

        for c in self.codecs():
            assert isinstance(c, BytesBytesCodec), f"{c!r} is not a zarr BytesBytesCodec"

    def test_to_dict_names_the_codec_id(self) -> None:
        """The stored form resolves back to the same codec (the id is the entry-point name)."""
        from quire._handlers import codecs as _codecs

        for c in self.codecs():
            d = c.to_dict()
            assert json.loads(json.dumps(d, allow_nan=False)) == d, "to_dict() must be JSON"
            assert d["name"] == self.codec_id
            again = _codecs.resolve(d)
            assert again.to_dict() == d

    def test_round_trip(self, url: str) -> None:
        """Arrays of several dtypes and shapes, one chunk and many, restore bit-exactly."""
        import quire

        arrays = _arrays()
        for i, config in enumerate(self.configurations):
            spec = {"name": self.codec_id, "configuration": dict(config)}
            for j, storage in enumerate(
                [
                    quire.StorageOptions(codecs=[spec]),
                    quire.StorageOptions(codecs=[spec], chunk_bytes=256),
                    quire.StorageOptions(codecs=[spec, "zstd"], checksum=False),
                ]
            ):
                u = f"{url}-{i}-{j}"
                quire.save(u, arrays, storage=storage)
                got = quire.load(u)
                for k, a in arrays.items():
                    assert got[k].dtype == a.dtype and got[k].shape == a.shape, k
                    np.testing.assert_array_equal(got[k], a, err_msg=k)

    def test_recorded_in_quire_json(self, url: str) -> None:
        import quire

        spec = {"name": self.codec_id, "configuration": dict(self.configurations[0])}
        quire.save(url, {"x": np.arange(100.0)}, storage=quire.StorageOptions(codecs=[spec]))
        leaf = record_of(url)["units"]["pytree"]["tree"]["children"][0]
        names = [c["name"] for c in leaf.get("codecs", [])]
        # A crc32c compressor is folded into quire's own per-chunk checksum.
        expected = [] if type(self.codecs()[0]).__name__ == "Crc32cCodec" else [self.codec_id]
        assert names == expected, names

    def test_damaged_chunk_is_detected(self, tmp_path: Any) -> None:
        """With checksums on, a flipped byte in a compressed chunk fails the load."""
        import quire

        url = str(tmp_path / "ckpt")
        spec = {"name": self.codec_id, "configuration": dict(self.configurations[0])}
        data = {"x": np.arange(4096, dtype=np.int32)}
        quire.save(url, data, storage=quire.StorageOptions(codecs=[spec]))
        root = tmp_path / "ckpt"
        chunks = [
            p
            for p in root.rglob("*")
            if p.is_file() and p.name != "zarr.json" and p.relative_to(root).parts[0] == "d"
        ]
        assert chunks, "no chunk files written"
        for p in chunks:
            flip_byte(p, offset=len(p.read_bytes()) // 2)
        with pytest.raises(quire.CorruptCheckpointError):
            quire.load(url)

    def test_readable_by_zarr(self, tmp_path: Any) -> None:
        """Plain ``zarr.open_array`` reads the stored array (the codec is known to zarr)."""
        import zarr

        import quire

        url = str(tmp_path / "ckpt")
        spec = {"name": self.codec_id, "configuration": dict(self.configurations[0])}
        a = np.arange(300, dtype=np.float32).reshape(3, 100)
        quire.save(url, {"a": a}, storage=quire.StorageOptions(codecs=[spec]), layout="chunks")
        loc = record_of(url)["units"]["pytree"]["tree"]["children"][0]["location"]
        for layout in ("chunks", "packed"):  # format v1 and v2
            if layout == "chunks":
                z = zarr.open_array(str(tmp_path / "ckpt" / loc), mode="r")
            else:
                z = zarr.open_array(quire.zarr_store(url), path=loc, mode="r")
            np.testing.assert_array_equal(z[...], a)
            if layout == "chunks":
                url = str(tmp_path / "ckpt2")
                quire.save(url, {"a": a}, storage=quire.StorageOptions(codecs=[spec]))
                loc = record_of(url)["units"]["pytree"]["tree"]["children"][0]["location"]
