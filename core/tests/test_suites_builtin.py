"""The conformance suites of quire.testing on every built-in codec, leaf handler and
checkpointable handler (the built-in backends run theirs in test_backend_suite.py)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from quire.testing import CheckpointableHandlerSuite, CodecSuite, LeafHandlerSuite

# -- codecs ---------------------------------------------------------------------------


class TestZstd(CodecSuite):
    codec_id = "zstd"
    configurations = [{}, {"level": 9, "checksum": True}]


class TestGzip(CodecSuite):
    codec_id = "gzip"
    configurations = [{}, {"level": 1}]


class TestBlosc(CodecSuite):
    codec_id = "blosc"
    configurations = [{}, {"cname": "lz4", "clevel": 1, "shuffle": "bitshuffle"}]


class TestCrc32c(CodecSuite):
    codec_id = "crc32c"


# numcodecs' codecs, by the names zarr's registry gives them (no quire.codecs plugin).
class TestNumcodecsLz4(CodecSuite):
    codec_id = "numcodecs.lz4"
    configurations = [{}, {"acceleration": 8}]


class TestNumcodecsZstd(CodecSuite):
    codec_id = "numcodecs.zstd"
    configurations = [{"level": 1}, {"level": 5, "checksum": True}]


class TestNumcodecsBitround(CodecSuite):
    codec_id = "numcodecs.bitround"
    kind = "array_to_array"
    configurations = [{"keepbits": 5}, {"keepbits": 9}]
    tolerance = {"rtol": 2.0**-5}
    dtypes = ("float16", "float32", "float64")


# -- leaf handlers --------------------------------------------------------------------


class TestNumpyHandler(LeafHandlerSuite):
    handler_id = "numpy"

    @pytest.fixture
    def values(self) -> list[Any]:
        rng = np.random.default_rng(1)
        return [
            rng.standard_normal((5, 3)).astype(np.float32),
            np.arange(12, dtype=np.int64).reshape(3, 4)[:, ::2],  # a non-contiguous view
            rng.integers(0, 2, 7).astype(bool),
            rng.standard_normal(9).astype(ml_dtypes.bfloat16),
            rng.standard_normal(4).astype(ml_dtypes.float8_e4m3fn),
            np.array(7, np.uint16),
            np.zeros((0, 3), np.complex64),
        ]


class TestJaxHandler(LeafHandlerSuite):
    handler_id = "jax"

    @pytest.fixture
    def values(self) -> list[Any]:
        mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("a", "b"))
        sharded = jax.device_put(
            jnp.arange(32.0).reshape(8, 4), NamedSharding(mesh, PartitionSpec("a", "b"))
        )
        return [
            jnp.arange(6, dtype=jnp.int32),
            jnp.ones((3, 2), jnp.bfloat16),
            jnp.array(2.5),
            sharded,
        ]


class TestPRNGKeyHandler(LeafHandlerSuite):
    handler_id = "prng_key"

    @pytest.fixture
    def values(self) -> list[Any]:
        key = jax.random.key(42)
        return [key, jax.random.split(key, 3), jax.random.key(1, impl="rbg")]

    def assert_leaf_equal(self, expected: Any, actual: Any) -> None:
        assert jax.dtypes.issubdtype(actual.dtype, jax.dtypes.prng_key)
        assert str(jax.random.key_impl(actual)) == str(jax.random.key_impl(expected))
        np.testing.assert_array_equal(
            np.asarray(jax.random.key_data(actual)), np.asarray(jax.random.key_data(expected))
        )


class TestScalarHandler(LeafHandlerSuite):
    handler_id = "scalar"

    @pytest.fixture
    def values(self) -> list[Any]:
        return [
            3,
            -(2**62),
            2.5,
            float("nan"),
            float("-inf"),
            True,
            complex(1, -2),
            np.float32(1.5),
            np.int8(-3),
            np.uint64(2**63 + 1),
            ml_dtypes.bfloat16(0.5),
            np.complex64(1 + 1j),
        ]


class TestStringHandler(LeafHandlerSuite):
    handler_id = "str"

    @pytest.fixture
    def values(self) -> list[Any]:
        return ["", "héllo wörld", "../../etc/passwd", "a\x00b"]


class TestBytesHandler(LeafHandlerSuite):
    handler_id = "bytes"

    @pytest.fixture
    def values(self) -> list[Any]:
        return [b"", b"\x00\xff" * 100, bytes(range(256))]


class TestNoneHandler(LeafHandlerSuite):
    handler_id = "none"

    @pytest.fixture
    def values(self) -> list[Any]:
        return [None]


# -- checkpointable handlers ------------------------------------------------------------


class TestJsonCheckpointable(CheckpointableHandlerSuite):
    handler_id = "json"

    @pytest.fixture
    def obj(self) -> Any:
        return {"lr": 0.1, "layers": [64, 64], "name": "run-1", "nested": {"x": None, "b": True}}

    def mutate(self, obj: Any) -> None:
        obj["nested"]["x"] = "changed"
        obj["layers"].append(128)
