"""``save_async`` returns before the write (issue 20): what the caller does next never
reaches the checkpoint.

After ``save_async`` returns, the caller donates the saved ``jax.Array``s to a jitted step,
deletes them, or mutates its numpy leaves in place, and the checkpoint still holds the state
at the call, bit for bit.  A *gate* (a write-operation queued on the same URL first, which
``save_async``'s write waits for) keeps the save from writing a byte until the caller has
done all that, so every test exercises the worst order.  Also: quire holds nothing once the
save is done (donation works again, staging buffers are reused, RSS stays flat over 50
saves), and a ``kill -9`` between return and commit leaves the previous step as latest.
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import psutil
import pytest

import quire
from quire._runtime.hostbuf import staging
from quire._runtime.responses import chain
from quire._store.url import normalize


@contextmanager
def gate(url: str) -> Iterator[None]:
    """Hold every later write-operation on ``url`` until the block exits."""
    opened = threading.Event()

    async def wait() -> None:
        while not opened.is_set():
            await _sleep()

    r = chain(normalize(url), wait, "test gate")
    try:
        yield
    finally:
        opened.set()
        r.result(timeout=30)


async def _sleep() -> None:
    import asyncio

    await asyncio.sleep(0.005)


def _mesh_sharding() -> jax.sharding.NamedSharding:
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("a", "b"))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("a", "b"))


def _jax_state(seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {
        "w": jax.device_put(rng.standard_normal((256, 128), np.float32), _mesh_sharding()),
        "b": jax.device_put(rng.standard_normal((512,), np.float32).astype(jnp.bfloat16)),
        "k": jax.random.key(seed),
        "n": jnp.asarray(rng.integers(0, 1 << 30, (64, 8), np.int32)),
    }


def _host(tree: dict[str, Any]) -> dict[str, np.ndarray]:
    out = {}
    for k, v in tree.items():
        if isinstance(v, jax.Array) and jax.dtypes.issubdtype(v.dtype, jax.dtypes.prng_key):
            v = jax.random.key_data(v)
        out[k] = np.array(v, copy=True)
    return out


def _bits_equal(got: dict[str, Any], want: dict[str, np.ndarray]) -> None:
    assert set(got) == set(want)
    for k, w in want.items():
        g = got[k]
        if isinstance(g, jax.Array) and jax.dtypes.issubdtype(g.dtype, jax.dtypes.prng_key):
            g = jax.random.key_data(g)
        g = np.asarray(g)
        assert g.dtype == w.dtype and g.shape == w.shape, k
        assert g.tobytes() == w.tobytes(), f"leaf {k!r} differs from the state at the call"


@jax.jit
def _bump(x: jax.Array) -> jax.Array:
    return x + jnp.ones((), x.dtype)


_step = jax.jit(
    lambda t: {
        k: (v if jax.dtypes.issubdtype(v.dtype, jax.dtypes.prng_key) else _bump(v))
        for k, v in t.items()
    },
    donate_argnums=0,
)


def test_donating_the_saved_arrays_right_after_return(tmp_path: Path) -> None:
    url = str(tmp_path / "c")
    state = _jax_state(1)
    want = _host(state)
    with gate(url):
        r = quire.save_async(url, state)
        for _ in range(3):  # a training loop: each step donates the previous state
            state = _step(state)
        jax.block_until_ready(state)
        # The step ran and wrote different values; none of it may reach the checkpoint.
        assert np.asarray(state["w"])[0, 0] == want["w"][0, 0] + 3
    r.result(timeout=60)
    _bits_equal(quire.load(url, {k: None for k in want}), want)


def test_donation_works_again_once_the_save_is_done(tmp_path: Path) -> None:
    """quire keeps no reference past the save: the next donation is a real one again
    (while the save reads the buffer, a donating step leaves the input alive)."""
    step = jax.jit(lambda a: a * 2, donate_argnums=0)
    url = str(tmp_path / "c")
    x = jax.device_put(np.arange(1 << 16, dtype=np.float32))
    with gate(url):
        r = quire.save_async(url, {"x": x})
        y = step(x)
        if jax.devices()[0].platform == "cpu":
            assert not x.is_deleted()  # held by quire's view: not donated, still valid
    r.result(timeout=60)
    np.testing.assert_array_equal(quire.load(url)["x"], np.arange(1 << 16, dtype=np.float32))
    for i in range(5):
        quire.save_async(str(tmp_path / f"d{i}"), {"y": y}).result(timeout=60)
        z = step(y)
        assert y.is_deleted()
        y = z


def test_deleting_the_saved_arrays_right_after_return(tmp_path: Path) -> None:
    url = str(tmp_path / "c")
    state = _jax_state(2)
    want = _host(state)
    with gate(url):
        r = quire.save_async(url, state)
        for v in state.values():
            v.delete()
        # Reuse freed memory: same sizes, other bytes.
        churn = [
            jnp.full(v.shape, 7, v.dtype) for k, v in want.items() if k != "k" for _ in range(4)
        ]
        jax.block_until_ready(churn)
    r.result(timeout=60)
    _bits_equal(quire.load(url, {k: None for k in want}), want)


@pytest.mark.parametrize("layout", ["packed", "chunks"])
def test_numpy_leaves_mutated_right_after_return(tmp_path: Path, layout: str) -> None:
    url = str(tmp_path / "c")
    rng = np.random.default_rng(3)
    tree = {
        "f": rng.standard_normal((300, 70), np.float32),
        "big_endian": rng.standard_normal(1000).astype(">f8"),  # stored byte-swapped
        "strided": rng.standard_normal((64, 64))[:, ::3],
        "scalar": np.asarray(5, np.int64),
        "cast": rng.standard_normal(4096).astype(np.float32),
    }
    want = {k: np.array(v, copy=True) for k, v in tree.items()}
    storage = lambda path, leaf: (  # noqa: E731
        quire.StorageOptions(dtype=np.float16) if path[-1] == "cast" else None
    )
    with gate(url):
        r = quire.save_async(url, tree, storage=storage, layout=layout)
        for v in tree.values():
            v[...] = 0
    r.result(timeout=60)
    got = quire.load(url)
    for k, w in want.items():
        if k == "cast":
            np.testing.assert_array_equal(got[k], w.astype(np.float16).astype(np.float32))
        else:
            np.testing.assert_array_equal(got[k], w.astype(w.dtype.newbyteorder("=")))


def test_checkpointer_save_is_as_safe(tmp_path: Path) -> None:
    state = _jax_state(4)
    state["host"] = np.arange(1000, dtype=np.float32)
    want = _host(state)
    with quire.Checkpointer(tmp_path / "run") as ckpt:
        with gate(ckpt._main.url(1)):
            assert ckpt.save(1, state)
            state["host"][:] = -1
            state = _step({k: v for k, v in state.items() if k != "host"})
        ckpt.wait()
        _bits_equal(ckpt.load(1, {k: None for k in want}), want)


def test_staging_buffers_are_reused(tmp_path: Path) -> None:
    tree = {f"p{i}": np.full((1000, 10), float(i), np.float32) for i in range(8)}
    staging.clear()
    quire.save_async(str(tmp_path / "a"), tree).result(timeout=60)
    gc.collect()
    pooled = staging.nbytes
    assert pooled == 8 * tree["p0"].nbytes  # one staging buffer per numpy leaf
    for i in range(3):
        quire.save_async(str(tmp_path / f"b{i}"), tree).result(timeout=60)
    assert staging.nbytes == pooled  # the same buffers, not new ones


def test_saves_in_flight_never_share_a_staging_buffer(tmp_path: Path) -> None:
    """A second save of same-shaped leaves, while the first still waits to write, gets its
    own staging buffers (the first save's are not idle yet)."""
    tree = {f"p{i}": np.full((100, 10), 1.0, np.float32) for i in range(4)}
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    with gate(a), gate(b):
        ra = quire.save_async(a, tree)
        gc.collect()
        for v in tree.values():
            v[...] = 2.0
        rb = quire.save_async(b, tree)
    ra.result(timeout=60)
    rb.result(timeout=60)
    assert all((v == 1.0).all() for v in quire.load(a).values())
    assert all((v == 2.0).all() for v in quire.load(b).values())


def test_rss_is_flat_over_50_async_saves(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    # 8 MiB of numpy leaves (staged copies) and 8 MiB of sharded jax arrays (views)
    state: dict[str, Any] = {f"np{i}": rng.standard_normal(1 << 17, np.float32) for i in range(16)}
    for i in range(4):
        state[f"jx{i}"] = jax.device_put(
            rng.standard_normal((512, 1024), np.float32), _mesh_sharding()
        )
    url = str(tmp_path / "c")
    proc = psutil.Process()
    rss = []
    for i in range(50):
        quire.save_async(url, state, overwrite=i > 0).result(timeout=60)
        gc.collect()
        rss.append(proc.memory_info().rss)
    assert rss[-1] <= 1.01 * rss[0], [f"{x / 2**20:.1f}" for x in rss]


KILL_SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    os.environ["JAX_PLATFORMS"] = "cpu"
    import numpy as np, quire
    from quire._store.local import LocalBackend
    root, where = sys.argv[1], sys.argv[2]
    def state(step):
        return {"w": np.full((256, 256), float(step), np.float32), "step": step}
    ckpt = quire.Checkpointer(root)
    ckpt.save(1, state(1))
    ckpt.wait()
    if where == "commit":  # let the data land, stop at the commit record
        async def hang(self, *a, **k):
            print("commit", flush=True)
            time.sleep(600)
        LocalBackend.put_if_absent = hang
    else:  # stop before any byte of step 2 is written
        async def hang(self, *a, **k):
            time.sleep(600)
        LocalBackend.stream_writer = hang
        LocalBackend.put = hang
    ckpt.save(2, state(2))
    print("returned", flush=True)
    time.sleep(600)
    """
)


@pytest.mark.skipif(sys.platform != "linux", reason="SIGKILL")
@pytest.mark.parametrize("where", ["return", "commit"])
def test_kill_between_return_and_commit_keeps_the_previous_step(tmp_path: Path, where: str) -> None:
    root = str(tmp_path / "run")
    p = subprocess.Popen(
        [sys.executable, "-c", KILL_SCRIPT, root, where],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    try:
        assert p.stdout is not None
        seen = []
        wanted = {"returned"} | ({"commit"} if where == "commit" else set())
        while not wanted <= set(seen):
            line = p.stdout.readline()
            assert line, f"child ended early: {p.stderr.read() if p.stderr else ''}"
            seen.append(line.strip())
    finally:
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=30)
    with quire.Checkpointer(root) as ckpt:
        assert ckpt.latest_step() == 1
        got = ckpt.load()
        assert got["step"] == 1 and float(got["w"][0, 0]) == 1.0


def test_an_async_save_writes_in_the_background_pool(tmp_path: Path, monkeypatch: Any) -> None:
    """Once save_async (or a Checkpointer's save, or partial.save_async) has returned, its
    blocking work runs in the smaller background pool, leaving the training steps most of
    the machine; a blocking save uses the full I/O pool."""
    from quire._handlers.zarr_layout import ArrayLayout
    from quire._runtime import ioloop

    names: list[str] = []
    real = ArrayLayout.encode_chunk

    def spy(self: ArrayLayout, arr: np.ndarray) -> Any:
        names.append(threading.current_thread().name)  # encoding runs in a pool's thread
        return real(self, arr)

    monkeypatch.setattr(ArrayLayout, "encode_chunk", spy)
    tree = {"w": np.ones((512, 1024), np.float32)}
    quire.save_async(str(tmp_path / "a"), tree).result()
    assert names and all(n.startswith("quire-bg") for n in names), names
    assert ioloop.background_threads() <= ioloop.io_threads()
    if sys.platform.startswith("linux") and ioloop.background_nice():  # a lower priority

        def probe() -> tuple[bool, int]:
            tid = threading.get_native_id()
            idle = os.sched_getscheduler(tid) == os.SCHED_IDLE
            return idle, os.getpriority(os.PRIO_PROCESS, tid)

        idle, niceness = ioloop.background_pool().submit(probe).result()
        if ioloop.background_nice() == "idle":
            assert idle
        else:
            assert niceness >= os.getpriority(os.PRIO_PROCESS, 0) + 1
    names.clear()
    quire.save(str(tmp_path / "b"), tree)
    assert names and all(n.startswith("quire-io") for n in names), names
    names.clear()
    quire.partial.save_async(str(tmp_path / "c"), tree).result()
    assert names and all(n.startswith("quire-bg") for n in names), names
    names.clear()
    with quire.Checkpointer(tmp_path / "run") as ckpt:
        ckpt.save(1, tree)
        ckpt.wait()
    assert names and all(n.startswith("quire-bg") for n in names), names


def test_a_one_thread_background_pool_does_not_deadlock(tmp_path: Path) -> None:
    """A checkpointable unit's handler runs in a background thread and blocks on the loop
    for each object it writes (UnitIO); that write's own blocking work must not wait for a
    background thread, or a one-thread background pool deadlocks (it did)."""
    script = textwrap.dedent(
        f"""
        import numpy as np, quire

        class Unit:
            def quire_save(self, io):
                for i in range(4):
                    io.write(f"part{{i}}", bytes(range(256)) * 64)
                return {{"parts": 4}}

            def quire_restore(self, io, record):
                return [io.read(f"part{{i}}") for i in range(record["parts"])]

        url = {str(tmp_path / "c")!r}
        units = {{"state": {{"w": np.ones((512, 1024), np.float32)}}, "data": Unit()}}
        quire.save_checkpointables_async(url, units).result()
        got = quire.load_checkpointables(url, {{"state": None, "data": Unit()}})
        assert got["data"] == [bytes(range(256)) * 64] * 4
        print("ok")
        """
    )
    env = {**os.environ, "QUIRE_BACKGROUND_THREADS": "1", "JAX_PLATFORMS": "cpu"}
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SCHED_IDLE is Linux's")
@pytest.mark.parametrize(("setting", "idle", "nice"), [("idle", True, 0), ("7", False, 7)])
def test_background_priority_setting(setting: str, idle: bool, nice: int) -> None:
    """QUIRE_BACKGROUND_NICE: "idle" puts the background threads in SCHED_IDLE (they run only
    on a CPU nothing else wants); a number lowers their nice value by that much."""
    code = (
        "import os, threading\n"
        "from quire._runtime import ioloop\n"
        "def probe():\n"
        "    tid = threading.get_native_id()\n"
        "    return os.sched_getscheduler(tid) == os.SCHED_IDLE, os.getpriority(os.PRIO_PROCESS, tid)\n"
        "print(*ioloop.background_pool().submit(probe).result(), os.getpriority(os.PRIO_PROCESS, 0))\n"
    )
    env = {**os.environ, "QUIRE_BACKGROUND_NICE": setting}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr[-2000:]
    got_idle, got_nice, base = out.stdout.split()
    assert got_idle == str(idle)
    assert int(got_nice) - int(base) == (min(nice + int(base), 19) - int(base))


def test_background_duty_rests_in_proportion_to_the_cpu_used(monkeypatch: Any) -> None:
    """QUIRE_BACKGROUND_DUTY=d: a background call that used t seconds of CPU is followed by
    t (1/d - 1) seconds of rest; "auto" is 0.5 with JAX computing on the CPU (as here)."""
    import time

    from quire._runtime import ioloop

    for raw, want in [("auto", 0.5), ("0.25", 0.25), ("1", 1.0), ("7", 1.0)]:
        monkeypatch.setenv("QUIRE_BACKGROUND_DUTY", raw)
        ioloop.background_duty.cache_clear()
        assert ioloop.background_duty() == want
    ioloop.background_duty.cache_clear()
    monkeypatch.delenv("QUIRE_BACKGROUND_DUTY")

    def spin() -> float:
        t0 = time.thread_time()
        while time.thread_time() - t0 < 0.05:
            pass
        return time.thread_time() - t0

    t0 = time.perf_counter()
    used = ioloop._paced(spin, 3.0)  # duty 0.25
    wall = time.perf_counter() - t0
    assert wall >= used * 4 * 0.95, (wall, used)


def test_pinned_staging_reads_quires_own_copies(tmp_path: Path) -> None:
    """``pinned_staging=True`` (the GPU default, forced here on CPU devices, which have
    ``pinned_host`` memory too): each written shard is copied to pinned host memory before
    ``save_async`` returns, so the caller's buffers are free at once — a donating step
    really donates them — and the checkpoint still holds the state at the call."""
    url = str(tmp_path / "c")
    state = _jax_state(3)
    want = _host(state)
    with quire.Context(pinned_staging=True), gate(url):
        r = quire.save_async(url, state)
        held = [v for k, v in state.items() if k != "k"]
        state = _step(state)
        jax.block_until_ready(state)
        assert all(v.is_deleted() for v in held)  # donated: quire holds none of them
        state = _step(state)
        jax.block_until_ready(state)
    r.result(timeout=60)
    _bits_equal(quire.load(url, {k: None for k in want}), want)


def test_pinned_staging_false_keeps_the_in_place_read(tmp_path: Path) -> None:
    step = jax.jit(lambda a: a * 2, donate_argnums=0)
    x = jax.device_put(np.arange(1 << 12, dtype=np.float32))
    with quire.Context(pinned_staging=False), gate(str(tmp_path / "c")):
        r = quire.save_async(str(tmp_path / "c"), {"x": x})
        step(x)
        assert not x.is_deleted()  # read in place through quire's view: not donated
    r.result(timeout=60)
    np.testing.assert_array_equal(quire.load(str(tmp_path / "c"))["x"], np.arange(1 << 12))
