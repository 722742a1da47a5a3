"""Loads hand device shards to XLA without a copy: aligned host buffers (``_hostbuf``)."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import pytest

import quire
from quire._runtime.hostbuf import ALIGN, StagingPool, aligned_empty, for_device, is_aligned

pytestmark = pytest.mark.quick  # the quick tier (CONTRIBUTING.md)


@pytest.mark.parametrize("shape", [(), (0,), (3,), (5, 7), (1000, 33)])
@pytest.mark.parametrize("dtype", [np.uint8, np.float32, np.complex128, jax.numpy.bfloat16])
def test_aligned_empty(shape: tuple[int, ...], dtype: Any) -> None:
    for _ in range(5):  # numpy's own allocations land on varying 16-byte boundaries
        a = aligned_empty(shape, dtype)
        assert a.shape == shape and a.dtype == np.dtype(dtype)
        assert a.flags.c_contiguous and a.flags.writeable
        assert a.size == 0 or a.ctypes.data % ALIGN == 0  # an empty array has no data


def test_for_device_copies_only_when_it_must() -> None:
    a = aligned_empty((64, 8), np.float32)
    a[...] = np.arange(a.size, dtype=np.float32).reshape(a.shape)
    assert for_device(a) is a
    # An address 16 bytes past a multiple of ALIGN: misaligned for XLA whatever np.empty
    # returns (a fresh allocation retried at another offset could land aligned again).
    raw = np.empty(a.nbytes + ALIGN + 16, np.uint8)
    off = (16 - raw.ctypes.data) % ALIGN
    moved = raw[off : off + a.nbytes].view(np.float32)
    assert moved.ctypes.data % ALIGN == 16
    moved[...] = a.reshape(-1)
    for src in (moved, a[:, ::2], a.T):  # unaligned, strided, Fortran order
        out = for_device(src)
        assert out is not src and is_aligned(out)
        np.testing.assert_array_equal(out, src)
    cast = for_device(a, np.float64)
    assert cast.dtype == np.float64 and is_aligned(cast)
    np.testing.assert_array_equal(cast, a)


def test_xla_adopts_an_aligned_buffer_on_cpu() -> None:
    """The premise: device_put of an aligned buffer on a CPU device shares its memory."""
    a = aligned_empty((1 << 16,), np.float32)
    a[...] = 1
    x = jax.device_put(a, jax.devices()[0])
    assert x.unsafe_buffer_pointer() == a.ctypes.data
    assert float(x.sum()) == a.size


@pytest.mark.parametrize("layout", ["packed", "chunks"])
@pytest.mark.parametrize("how", ["as saved", "resharded", "cast"])
def test_sharded_load_puts_every_shard_without_a_copy(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, layout: str, how: str
) -> None:
    devs = np.array(jax.devices()[:8])
    mesh = jax.sharding.Mesh(devs.reshape(8), ("x",))
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    mesh2 = jax.sharding.Mesh(devs.reshape(4, 2), ("a", "b"))
    blocks = jax.sharding.NamedSharding(mesh2, jax.sharding.PartitionSpec("a", "b"))
    value = np.arange(64 * 48, dtype=np.float32).reshape(64, 48)
    quire.save(str(tmp_path / "c"), {"w": jax.device_put(value, rows)}, layout=layout)
    target = {
        "as saved": jax.ShapeDtypeStruct(value.shape, np.float32, sharding=rows),
        "resharded": jax.ShapeDtypeStruct(value.shape, np.float32, sharding=blocks),
        "cast": jax.ShapeDtypeStruct(value.shape, jax.numpy.bfloat16, sharding=rows),
    }[how]
    puts: list[tuple[int, int]] = []
    real = jax.device_put

    def spy(x: Any, device: Any = None, **kw: Any) -> Any:
        out = real(x, device, **kw)
        if isinstance(x, np.ndarray):
            puts.append((x.ctypes.data, out.unsafe_buffer_pointer()))
        return out

    monkeypatch.setattr(jax, "device_put", spy)
    got = quire.load(str(tmp_path / "c"), {"w": target})["w"]
    monkeypatch.undo()
    assert got.sharding == target.sharding and got.dtype == target.dtype
    np.testing.assert_array_equal(np.asarray(got), value.astype(target.dtype))
    assert len(puts) == 8
    assert all(host == dev for host, dev in puts), "a device shard was copied by device_put"


def test_staging_pool_reuses_only_what_nothing_else_refers_to() -> None:
    """A staging buffer comes back only once no view, memoryview or holder remains: a save,
    codec or pack writer still reading it can never see it overwritten."""
    pool = StagingPool()
    a = pool.take((10, 4), np.float32, 1 << 20)
    assert pool.take((10, 4), np.float32, 1 << 20) is not a  # the caller still holds a
    held = {"view": a[2:], "memoryview": memoryview(a), "holder": [a]}
    first = id(a)
    del a
    for what in list(held):
        got = pool.take((10, 4), np.float32, 1 << 20)
        assert id(got) != first, f"reused while a {what} of it was alive"
        del got
        del held[what]
    again = pool.take((10, 4), np.float32, 1 << 20)
    assert id(again) == first and again.flags.c_contiguous and again.flags.writeable
    assert pool.take((10, 4), np.float64, 1 << 20).dtype == np.float64  # keyed by dtype too


def test_staging_pool_never_hands_out_another_dtype_of_one_spelling() -> None:
    """ml_dtypes' types share numpy's type string (every float8 and sub-byte int is '<V1'):
    a buffer of one handed out for another made save_async's copy a value conversion, and
    the checkpoint held converted bytes under the leaf's dtype (a float8_e4m3fn NaN, 0x7f,
    stored as 0x78 after a float8_e3m4 save; found by issue 29's generated round trips)."""
    import ml_dtypes

    names = ["float8_e4m3fn", "float8_e3m4", "float8_e5m2", "int4", "uint4", "int2", "uint8"]
    pool = StagingPool()
    for name in names:  # each leaves an idle buffer of its dtype behind
        d = np.dtype(getattr(ml_dtypes, name, None) or name)
        got = pool.take((3,), d, 1 << 20)
        assert got.dtype == d, (name, got.dtype)
        del got
    for name in reversed(names):
        d = np.dtype(getattr(ml_dtypes, name, None) or name)
        assert pool.take((3,), d, 1 << 20).dtype == d, name
    src = np.array([0x7F, 0x80, 0x01], np.uint8).view(ml_dtypes.float8_e4m3fn)
    dst = pool.take(src.shape, src.dtype, 1 << 20)
    np.copyto(dst, src)
    assert dst.tobytes() == src.tobytes()


def test_staging_pool_stays_within_its_limit() -> None:
    pool = StagingPool()
    a = pool.take((100,), np.uint8, 250)
    b = pool.take((100,), np.uint8, 250)
    assert pool.nbytes == 200
    c = pool.take((100,), np.uint8, 250)  # over the limit: an ordinary, unpooled buffer
    assert pool.nbytes == 200 and c.nbytes == 100
    del a
    d = pool.take((150,), np.uint8, 250)  # an idle buffer of another shape makes room
    assert pool.nbytes == 250 and d.nbytes == 150
    del b, c, d
    pool.clear()
    assert pool.nbytes == 0
