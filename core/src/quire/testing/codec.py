"""Conformance suite for codecs (entry-point group ``quire.codecs``, or a codec zarr's registry
knows by name, such as ``numcodecs.lz4``).

A codec plugin is a factory: ``factory(**configuration)`` returns a zarr v3 codec of one of
the three kinds (array-to-array, array-to-bytes, bytes-to-bytes) whose ``to_dict()`` is
``{"name": <codec id>, "configuration": {...}}``.  Subclass :class:`CodecSuite`, name the id
and, unless it is a bytes-to-bytes codec, its kind::

    from quire.testing import CodecSuite

    class TestMyCodec(CodecSuite):
        codec_id = "my-codec"
        configurations = [{}, {"level": 9}]

A lossy codec (one that does not restore its input bit for bit) declares how close it
restores it and the dtypes it supports; it must also say it is lossy (a ``lossy = True``
attribute on the codec object), so that ``quire info`` marks it::

    class TestMyQuantizer(CodecSuite):
        codec_id = "my-quantizer"
        kind = "array_to_array"
        configurations = [{"decimals": 2}]
        tolerance = {"atol": 0.005}
        dtypes = ("float32", "float64")

Never override a ``test_*`` method to make it pass.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
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
        "f64": (rng.standard_normal((9, 11)) * 1000).astype(np.float64),
        "f16": rng.standard_normal((4, 25)).astype(np.float16),
        "zeros": np.zeros((64, 64), np.float64),
        "i64": np.arange(1000, dtype=np.int64).reshape(10, 100),
        "u8": rng.integers(0, 255, 4099, dtype=np.uint8),
        "bool": rng.integers(0, 2, (5, 5)).astype(bool),
        "bf16": rng.standard_normal(17).astype(ml_dtypes.bfloat16),
        "scalar": np.array(3.5, np.float32),
        "empty": np.zeros((0, 4), np.int32),
    }


def _dtype_name(a: np.ndarray) -> str:
    from quire._format.dtypes import dtype_name

    return dtype_name(a.dtype)


class CodecSuite(UrlFixture):
    """Tests every codec plugin passes.

    Attributes
    ----------
    codec_id : str
        The codec's ``quire.codecs`` entry-point name (or the name zarr's registry knows
        it by); the plugin coverage check counts the codec as covered by this attribute.
    kind : str
        ``"bytes_to_bytes"`` (the default: compressors, checksums), ``"array_to_array"``
        (filters: placed before ``bytes``) or ``"array_to_bytes"``.
    configurations : list of dict
        Configurations to test (each passed as ``factory(**configuration)``).
    tolerance : dict, optional
        For a lossy codec, ``rtol`` and / or ``atol`` (as ``numpy.testing.assert_allclose``
        takes them) within which every configuration restores every array of ``dtypes``.
        None (the default): the codec restores its input bit for bit.
    dtypes : sequence of str, optional
        The dtypes the codec supports (quire's names: ``"float32"``, ``"bfloat16"``...); a
        save of another dtype must fail with a typed error, never store something else.
        None (the default): every dtype.
    """

    group: ClassVar[str] = "quire.codecs"
    codec_id: ClassVar[str]
    kind: ClassVar[str] = "bytes_to_bytes"
    configurations: ClassVar[list[dict[str, Any]]] = [{}]
    tolerance: ClassVar[Mapping[str, float] | None] = None
    dtypes: ClassVar[Sequence[str] | None] = None

    def codecs(self) -> list[Any]:
        """The codec objects for :attr:`codec_id` with each of :attr:`configurations`."""
        from quire._handlers import codecs as _codecs

        return [_codecs.resolve(self.spec(c)) for c in self.configurations]

    def spec(self, configuration: Mapping[str, Any]) -> dict[str, Any]:
        """The ``{"name", "configuration"}`` spec of one configuration.

        Parameters
        ----------
        configuration : dict
            One of :attr:`configurations`.
        """
        return {"name": self.codec_id, "configuration": dict(configuration)}

    def arrays(self) -> dict[str, np.ndarray]:
        """The suite's arrays of the dtypes the codec supports."""
        return {
            k: a
            for k, a in _arrays().items()
            if self.dtypes is None or _dtype_name(a) in self.dtypes
        }

    def assert_restored(self, got: np.ndarray, want: np.ndarray, what: str) -> None:
        """Assert that ``got`` is ``want`` bit for bit, or within :attr:`tolerance` for a
        lossy codec.

        Parameters
        ----------
        got, want : numpy.ndarray
            What a load gave, and what was saved.
        what : str
            Names the case in the failure message.
        """
        assert got.dtype == want.dtype and got.shape == want.shape, what
        if self.tolerance is None:
            np.testing.assert_array_equal(got, want, err_msg=what)
            return
        np.testing.assert_allclose(
            np.asarray(got, np.float64),
            np.asarray(want, np.float64),
            rtol=float(self.tolerance.get("rtol", 0.0)),
            atol=float(self.tolerance.get("atol", 0.0)),
            err_msg=what,
        )

    def _sample(self) -> np.ndarray:
        """A larger array of a supported dtype (int32 when the codec takes any)."""
        if self.dtypes is None:
            return np.arange(4096, dtype=np.int32)
        from quire._format.dtypes import dtype_from_name

        rng = np.random.default_rng(3)
        return (rng.standard_normal(4096) * 50).astype(dtype_from_name(self.dtypes[0]))

    def test_found_by_name(self) -> None:
        """A ``quire.codecs`` factory makes it, or zarr's registry knows its name."""
        from quire._runtime.registry import codecs

        if self.codec_id in codecs.names():
            factory = codecs.get(self.codec_id)
            assert callable(factory)
            for config in self.configurations:
                assert hasattr(factory(**config), "to_dict")
        else:
            from zarr.registry import get_codec_class

            assert get_codec_class(self.codec_id) is not None
        assert len(self.codecs()) == len(self.configurations)

    def test_makes_codecs_of_its_kind(self) -> None:
        from quire._handlers.chain import KINDS, kind_of

        assert self.kind in KINDS, f"kind must be one of {KINDS}"
        for c in self.codecs():
            assert kind_of(c) == self.kind, f"{c!r} is a {kind_of(c)} codec, not {self.kind}"

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
        """Arrays of several dtypes and shapes, one chunk and many, compressed after it or
        not, restore bit-exactly (within :attr:`tolerance` for a lossy codec)."""
        import quire

        arrays = self.arrays()
        assert arrays, f"the suite has no array of the dtypes {self.dtypes}"
        for i, config in enumerate(self.configurations):
            spec = self.spec(config)
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
                    self.assert_restored(got[k], a, f"{k}, configuration {config}")

    def test_lossiness_is_declared(self, url: str) -> None:
        """An exact codec is never marked lossy; a lossy one is, on some supported dtype
        (``quire info`` shows the mark, and ``LeafMetadata.lossy`` names it)."""
        import quire

        arrays = {k: a for k, a in self.arrays().items() if a.size}
        for i, config in enumerate(self.configurations):
            u = f"{url}-{i}"
            quire.save(u, arrays, storage=quire.StorageOptions(codecs=[self.spec(config)]))
            tree = quire.metadata(u).tree
            marked = {k for k in arrays if self.codec_id in tree[k].lossy}
            if self.tolerance is None:
                assert not marked, (
                    f"{sorted(marked)} marked lossy: an exact array-to-array codec says so "
                    "with a `lossy = False` attribute"
                )
            else:
                assert marked, (
                    f"configuration {config} restores within a tolerance, but no array is "
                    "marked lossy: give the codec a `lossy = True` attribute"
                )

    def test_refuses_dtypes_it_does_not_support(self, tmp_path: Any) -> None:
        """With :attr:`dtypes` declared, a save of another dtype is a typed error."""
        import quire

        if self.dtypes is None:
            return
        spec = self.spec(self.configurations[0])
        for k, a in _arrays().items():
            if not a.size or _dtype_name(a) in self.dtypes:
                continue
            with pytest.raises(quire.QuireError):
                quire.save(str(tmp_path / k), {"x": a}, storage=quire.StorageOptions(codecs=[spec]))

    def test_recorded_in_quire_json(self, url: str) -> None:
        import quire

        spec = self.spec(self.configurations[0])
        quire.save(url, {"x": self._sample()}, storage=quire.StorageOptions(codecs=[spec]))
        leaf = record_of(url)["units"]["pytree"]["tree"]["children"][0]
        names = [c["name"] for c in leaf.get("codecs", [])]
        if self.kind == "array_to_array":
            expected = [self.codec_id, "bytes"]
        elif type(self.codecs()[0]).__name__ == "Crc32cCodec":
            expected = []  # folded into quire's own per-chunk checksum
        else:
            expected = [self.codec_id]
        assert names == expected, names

    def test_damaged_chunk_is_detected(self, tmp_path: Any) -> None:
        """With checksums on, a flipped byte in an encoded chunk fails the load."""
        import quire

        url = str(tmp_path / "ckpt")
        spec = self.spec(self.configurations[0])
        quire.save(url, {"x": self._sample()}, storage=quire.StorageOptions(codecs=[spec]))
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
        """Plain ``zarr.open_array`` reads the values quire loads (the codec is known to zarr)."""
        import zarr

        import quire

        spec = self.spec(self.configurations[0])
        a = self._sample().reshape(32, 128)
        for layout in ("chunks", "packed"):  # format v1 and v2
            url = str(tmp_path / layout)
            quire.save(url, {"a": a}, storage=quire.StorageOptions(codecs=[spec]), layout=layout)
            loc = record_of(url)["units"]["pytree"]["tree"]["children"][0]["location"]
            if layout == "chunks":
                z = zarr.open_array(str(tmp_path / layout / loc), mode="r")
            else:
                z = zarr.open_array(quire.zarr_store(url), path=loc, mode="r")
            loaded = quire.load(url)["a"]
            np.testing.assert_array_equal(z[...], loaded)
            self.assert_restored(loaded, a, layout)
