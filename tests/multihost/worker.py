"""One JAX process of a multi-process quire run (launched by ``tests/test_multihost.py``).

Usage (through ``harness.launch``, which tells the process its index, the process count, the
coordinator and its CPU device count)::

    python tests/multihost/worker.py SCENARIO WORKDIR [JSON]

Joins the others with ``worker_harness.init()`` (``jax.distributed.initialize`` when there
is more than one process), runs SCENARIO and reports one line per result::

    QUIRE-MH {"pid": 0, "check": "...", ...}

and ``QUIRE-MH {"pid": 0, "check": "done"}`` at the end.  The parent asserts on them.

Every array is a deterministic function of its name and global index (``source``), so any
process of any topology knows the exact bytes a loaded shard must hold.  The worker wraps
the storage backends' private I/O methods to record, per checkpoint, which keys this
process wrote and how many bytes it read (``IO``).

Scenarios
---------
``save``       save / save_async / quire.partial / quire.Checkpointer / a disagreeing scalar /
               a write failing in one process, under WORKDIR/<tag>/, reporting what each
               process wrote; then the loads in ``args["loads"]``.
``load``       only the loads in ``args["loads"]`` (checkpoints written by another topology).
``kill``       save v1, then an overwrite with v2 during which ``args["victim"]`` SIGKILLs
               itself after ``args["after"]`` chunk writes; survivors report their error.
``verify``     after a kill: the checkpoint still holds v1, whole.
``s3``         save + load through ``s3://`` (moto server; endpoint in ``args``).
``replicas``   a ~100 MiB mostly replicated tree saved with replica-parallel writes on and
               off: per process, the bytes of its packs and the chunks it wrote; loads back.
"""

from __future__ import annotations

import time

T_START = time.time()

import itertools  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import traceback  # noqa: E402
import zlib  # noqa: E402
from collections import defaultdict  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
from worker_harness import init, report  # noqa: E402

SCENARIO, WORKDIR = sys.argv[1:3]
ARGS: dict[str, Any] = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
_init: dict[str, Any] = {}
if "heartbeat_timeout" in ARGS:
    _init["heartbeat_timeout_seconds"] = int(ARGS["heartbeat_timeout"])
ME = init(**_init)
PID_, NPROC_ = ME.process, ME.processes

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import quire  # noqa: E402
from quire._store.local import LocalBackend  # noqa: E402

T0 = time.monotonic()
T_READY = time.time() - T_START


def emit(check: str, **kw: Any) -> None:
    report(check=check, **kw)


def barrier(name: str, timeout_s: float = 120) -> None:
    if NPROC_ > 1:
        from jax._src import distributed

        client = distributed.global_state.client
        assert client is not None
        client.wait_at_barrier(f"mh-{name}", int(timeout_s * 1000))


# ============================================================== I/O instrumentation
class IO:
    """Keys written and bytes read by this process, per checkpoint root."""

    lock = threading.Lock()
    writes: dict[str, list[str]] = defaultdict(list)  # root -> keys (one per write call)
    reads: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))  # root -> key -> bytes
    lists: dict[str, int] = defaultdict(int)  # root -> list calls
    kill_after: int | None = None  # SIGKILL this process at that many chunk writes
    kill_count = 0
    fail_root: str | None = None  # raise OSError at the second chunk written under it
    fail_count = 0

    packs: dict[str, list[str]] = defaultdict(list)  # root -> pack / index objects written

    @classmethod
    def wrote(cls, root: str, key: str) -> None:
        with cls.lock:
            if "/%packs/" in key:  # format v2: the zarr keys are recorded by _install_packed
                cls.packs[root].append(key)
                return
            cls.writes[root].append(key)
            if root == cls.fail_root and "/c/" in key:
                cls.fail_count += 1
                if cls.fail_count == 2:
                    raise OSError(28, "No space left on device (injected)")
            if cls.kill_after is not None and "/c/" in key:
                cls.kill_count += 1
                if cls.kill_count >= cls.kill_after:
                    emit("dying", key=key, t=time.monotonic() - T0)
                    os.kill(os.getpid(), signal.SIGKILL)

    @classmethod
    def read(cls, root: str, key: str, n: int) -> None:
        with cls.lock:
            cls.reads[root][key] += n

    @classmethod
    def reset_reads(cls) -> None:
        with cls.lock:
            cls.reads.clear()
            cls.lists.clear()


def _install_local() -> None:
    b = LocalBackend
    put, get, get_into = b._put, b._get, b._get_into
    pia, rim, lst = b._put_if_absent, b._replace_if_match, b._list

    def _put(self: Any, key: str, data: Any) -> None:
        IO.wrote(self.root, key)
        put(self, key, data)

    def _put_if_absent(self: Any, key: str, data: bytes) -> str:
        IO.wrote(self.root, key)
        return str(pia(self, key, data))

    def _replace_if_match(self: Any, key: str, data: bytes, version: str) -> str:
        IO.wrote(self.root, key)
        return str(rim(self, key, data, version))

    def _get(self: Any, key: str, start: int | None, end: int | None) -> bytes:
        out: bytes = get(self, key, start, end)
        IO.read(self.root, key, len(out))
        return out

    def _get_into(self: Any, key: str, buffers: Any, offset: int) -> int:
        n: int = get_into(self, key, buffers, offset)
        IO.read(self.root, key, n)
        return n

    def _list(self: Any, prefix: str) -> list[str]:
        with IO.lock:
            IO.lists[self.root] += 1
        out: list[str] = lst(self, prefix)
        return out

    b._put, b._get, b._get_into = _put, _get, _get_into  # type: ignore[method-assign]
    b._put_if_absent, b._replace_if_match, b._list = _put_if_absent, _replace_if_match, _list  # type: ignore[method-assign]


def _install_s3() -> None:
    from quire_s3 import S3Backend

    put, pia, get, get_into = (
        S3Backend.put,
        S3Backend.put_if_absent,
        S3Backend.get,
        S3Backend.get_into,
    )

    def root(self: Any) -> str:
        return str(self.url).rstrip("/")

    async def _put(self: Any, key: str, data: Any) -> None:
        IO.wrote(root(self), key)
        await put(self, key, data)

    async def _pia(self: Any, key: str, data: bytes) -> str:
        IO.wrote(root(self), key)
        return str(await pia(self, key, data))

    async def _get(self: Any, key: str, start: int | None = None, end: int | None = None) -> bytes:
        out: bytes = await get(self, key, start, end)
        IO.read(root(self), key, len(out))
        return out

    async def _get_into(self: Any, key: str, buffers: Any, offset: int = 0) -> int:
        n: int = await get_into(self, key, buffers, offset)
        IO.read(root(self), key, n)
        return n

    S3Backend.put, S3Backend.put_if_absent = _put, _pia  # type: ignore[method-assign]
    S3Backend.get, S3Backend.get_into = _get, _get_into  # type: ignore[method-assign]


def _root_of(b: Any) -> str:
    if str(b.url).startswith("s3://"):
        return str(b.url).rstrip("/")  # as _install_s3 records it
    return str(getattr(b, "root", None) or str(b.url).rstrip("/"))


def _install_packed() -> None:
    """Format v2: record the zarr keys written into packs and read out of them, so the
    ownership and byte-count checks stay per chunk."""
    from quire._format.pack import PackWriter
    from quire._format.packedreader import PackedReader

    put, get, get_into = PackWriter.put_bound, PackedReader.get, PackedReader.get_into

    async def _put(self: Any, key: str, data: Any, **how: Any) -> None:
        IO.wrote(_root_of(self.base), key)
        await put(self, key, data, **how)

    async def _get(self: Any, key: str, start: int | None = None, end: int | None = None) -> bytes:
        out: bytes = await get(self, key, start, end)
        if self.index.owns(key):
            IO.read(_root_of(self.base), key, len(out))
        return out

    async def _get_into(self: Any, key: str, buffers: Any, offset: int = 0) -> int:
        n: int = await get_into(self, key, buffers, offset)
        if self.index.owns(key):
            IO.read(_root_of(self.base), key, n)
        return n

    PackWriter.put_bound = _put  # type: ignore[method-assign]  # every put goes through it
    PackedReader.get, PackedReader.get_into = _get, _get_into  # type: ignore[method-assign]


_install_local()
_install_packed()


# ============================================================== deterministic trees
def meshes() -> dict[str, Mesh]:
    devs = np.array(jax.devices())
    out = {"m1": Mesh(devs[:1].reshape(1), ("s",))}
    if devs.size == 8:
        out |= {
            "m8": Mesh(devs.reshape(8), ("d",)),
            "m24": Mesh(devs.reshape(2, 4), ("x", "y")),
            "m42": Mesh(devs.reshape(4, 2), ("a", "b")),
        }
    return out


# name -> (shape, dtype, {layout name -> (mesh, PartitionSpec)}); "save" is how it is saved.
ARRAYS: dict[str, tuple[tuple[int, ...], str, dict[str, tuple[str, Any]]]] = {
    # an even 2-D grid over all 8 devices
    "params/w": (
        (64, 32),
        "float32",
        {
            "save": ("m24", P("x", "y")),
            "swapped": ("m24", P("y", "x")),  # another grid on the same mesh
            "mesh42": ("m42", P("a", "b")),  # another mesh shape
        },
    ),
    # 1-D, 8 ways
    "params/b": (
        (64,),
        "float32",
        {
            "save": ("m8", P("d")),
            "swapped": ("m24", P("y")),
            "mesh42": ("m42", P("a")),
        },
    ),
    # partially replicated: 4 row blocks, each on 2 devices of one process (4x2) or of
    # one process (2x4) — replica_id decides the writer
    "params/emb": (
        (32, 8),
        "float32",
        {
            "save": ("m42", P("a", None)),
            "swapped": ("m24", P(None, "y")),
            "mesh42": ("m42", P(None, "a")),
        },
    ),
    # partially replicated across processes: 4 row blocks, replicated over x (processes
    # with x=1 hold only replicas and write nothing of it)
    "params/col": (
        (16, 24),
        "int32",
        {
            "save": ("m24", P("y", None)),
            "swapped": ("m24", P(None, ("x", "y"))),
            "mesh42": ("m42", P("b", "a")),
        },
    ),
    # fully replicated: one chunk, written by one process
    "opt/count": (
        (6, 5),
        "int32",
        {
            "save": ("m8", P()),
            "swapped": ("m24", P()),
            "mesh42": ("m42", P("b")),
        },
    ),
    # a 2-byte dtype
    "opt/mu": (
        (24, 3),
        "bfloat16",
        {
            "save": ("m8", P("d")),
            "swapped": ("m42", P("b")),
            "mesh42": ("m42", P("a")),
        },
    ),
}
NUMPY = {"host/np": ((10, 3), "float64")}
SCALARS = {"step": 7, "lr": 0.5, "name": "run-a", "blob": b"\x00\x01q", "nothing": None}


def source(name: str, shape: tuple[int, ...], dtype: str, salt: str = "") -> np.ndarray:
    """The global value of array ``name``: a deterministic function of the index."""
    n = math.prod(shape)
    k = zlib.crc32((name + salt).encode()) % 9973
    base = (np.arange(n, dtype=np.int64) * 7 + k) % 65521
    if np.dtype(jnp.dtype(dtype)).kind == "f":
        # (the cast rounds for bfloat16 - identically in every process)
        return ((base.astype(np.float64) - 32000) / 8).astype(jnp.dtype(dtype)).reshape(shape)
    return base.astype(jnp.dtype(dtype)).reshape(shape)


def sharding_for(layout: str, name: str) -> Any:
    if layout == "single":
        return SingleDeviceSharding(jax.local_devices()[0])
    mesh_name, spec = ARRAYS[name][2][layout]
    return NamedSharding(meshes()[mesh_name], spec)


def build_tree(salt: str = "") -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for name, (shape, dtype, _) in ARRAYS.items():
        src = source(name, shape, dtype, salt)
        sh = sharding_for("save", name)
        arr = jax.make_array_from_callback(shape, sh, src.__getitem__)
        _put(tree, name, arr)
    for name, (shape, dtype) in NUMPY.items():
        _put(tree, name, source(name, shape, dtype, salt))
    tree["key"] = jax.random.key(42)
    tree.update(SCALARS)
    return tree


def _put(tree: dict[str, Any], name: str, value: Any) -> None:
    *parents, last = name.split("/")
    for p in parents:
        tree = tree.setdefault(p, {})
    tree[last] = value


def _get(tree: Any, name: str) -> Any:
    for p in name.split("/"):
        tree = tree[p]
    return tree


def abstract_tree(layout: str) -> Any:
    """The load target: ``None`` (as saved), ``numpy`` or a sharding layout of ARRAYS."""
    if layout == "none":
        return None
    tree: dict[str, Any] = {}
    for name, (shape, dtype, _) in ARRAYS.items():
        if layout == "numpy":
            _put(tree, name, np.ndarray)
        else:
            _put(
                tree,
                name,
                jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=sharding_for(layout, name)),
            )
    for name in NUMPY:
        _put(tree, name, np.ndarray)
    tree["key"] = None
    tree.update({"step": int, "lr": float, "name": str, "blob": bytes, "nothing": None})
    return tree


# ============================================================== checks
def local_root(url: str) -> str:
    return url.rstrip("/") if url.startswith("s3://") else os.path.abspath(url)


def ownership(url: str, tree: dict[str, Any]) -> None:
    """Report the keys this process wrote under ``url`` and the chunks it owns."""
    meta = quire.metadata(url).tree
    expected: list[str] = []

    def key(location: str, coords: list[int]) -> str:
        return "/".join([location, "c", *map(str, coords)])

    holds: list[str] = []  # the chunks this process holds a copy of: it may write them
    for name in ARRAYS:
        arr, m = _get(tree, name), _get(meta, name)
        for s in arr.addressable_shards:
            box = _norm(s.index, m.shape)
            for coords in itertools.product(
                *(range(b.start // c, -(-b.stop // c)) for b, c in zip(box, m.chunk_shape))
            ):
                holds.append(key(m.location, list(coords)))
            if s.replica_id == 0:  # JAX's own notion of the shard's first copy
                coords = [(sl.start or 0) // c for sl, c in zip(s.index, m.chunk_shape)]
                expected.append(key(m.location, coords))
    if PID_ == 0:  # process-local values: the primary writes them
        for name in [*NUMPY, "key"]:
            m = _get(meta, name)
            expected.append(key(m.location, [0] * len(m.chunk_shape)))
    chunks = {}
    for name in ARRAYS:
        m = _get(meta, name)
        chunks[m.location] = math.prod(math.ceil(s / c) for s, c in zip(m.shape, m.chunk_shape))
    for name in [*NUMPY, "key"]:
        chunks[_get(meta, name).location] = 1
    emit(
        "ownership",
        url=url,
        wrote=IO.writes.get(local_root(url), []),
        packs=IO.packs.get(local_root(url), []),
        indexes=sorted(e["process"] for e in quire.metadata(url).record.get("indexes", [])),
        expected=sorted(expected),
        holds=sorted(set(holds) | set(expected)),
        chunks=chunks,
    )


def compare(loaded: Any, layout: str, salt: str = "") -> list[str]:
    """Bit-exact comparison of a loaded tree with the source; returns the problems."""
    bad: list[str] = []
    for name, (shape, dtype, _) in ARRAYS.items():
        want = source(name, shape, dtype, salt)
        got = _get(loaded, name)
        if layout == "numpy":
            if (
                not isinstance(got, np.ndarray)
                or got.dtype != want.dtype
                or got.tobytes() != want.tobytes()
            ):
                bad.append(f"{name}: numpy mismatch")
            continue
        if not isinstance(got, jax.Array) or got.shape != shape or got.dtype != want.dtype:
            bad.append(f"{name}: {type(got).__name__} {getattr(got, 'shape', None)}")
            continue
        if layout not in ("none",):
            target = sharding_for(layout, name)
            if not got.sharding.is_equivalent_to(target, len(shape)):
                bad.append(f"{name}: sharding {got.sharding} != {target}")
        for s in got.addressable_shards:
            if np.asarray(s.data).tobytes() != want[s.index].tobytes():
                bad.append(f"{name}: shard {s.index} on {s.device} differs")
    for name, (shape, dtype) in NUMPY.items():
        got = _get(loaded, name)
        want = source(name, shape, dtype, salt)
        if not isinstance(got, np.ndarray) or got.tobytes() != want.tobytes():
            bad.append(f"{name}: numpy leaf differs")
    key = loaded["key"]
    if not np.array_equal(
        np.asarray(jax.random.key_data(key)), np.asarray(jax.random.key_data(jax.random.key(42)))
    ):
        bad.append("key differs")
    for k, v in SCALARS.items():
        if loaded[k] != v or type(loaded[k]) is not type(v):
            bad.append(f"{k}: {loaded[k]!r} != {v!r}")
    return bad


def do_load(url: str, layout: str, salt: str = "") -> None:
    """Load ``url`` onto ``layout``; report problems and bytes read per array leaf."""
    meta = quire.metadata(url).tree
    IO.reset_reads()
    t = time.monotonic()
    loaded = quire.load(url, abstract_tree(layout))
    dt = time.monotonic() - t
    bad = compare(loaded, layout, salt)
    reads = IO.reads.get(local_root(url), {})
    leaves = {}
    for name, (shape, dtype, _) in ARRAYS.items():
        m = _get(meta, name)
        got = _get(loaded, name)
        itemsize = np.dtype(jnp.dtype(dtype)).itemsize
        if isinstance(got, jax.Array):
            regions = {
                tuple((sl.start, sl.stop) for sl in _norm(s.index, shape))
                for s in got.addressable_shards
            }
        else:
            regions = {tuple((0, n) for n in shape)}
        # the stored chunks that overlap this process's shards, each counted once
        needed: set[tuple[int, ...]] = set()
        for r in regions:
            needed |= set(
                itertools.product(
                    *(range(a // c, -(-b // c)) for (a, b), c in zip(r, m.chunk_shape))
                )
            )
        chunk = math.prod(m.chunk_shape) * itemsize + 4  # + its crc32c
        leaves[name] = {
            "read": sum(n for k, n in reads.items() if k.startswith(m.location + "/")),
            "share": sum(math.prod(b - a for a, b in r) for r in regions) * itemsize,
            "needed": len(needed) * chunk,
            "chunk": chunk,
            "total": math.prod(shape) * itemsize,
        }
    other = sorted(k for k in reads if not k.startswith("d/"))
    emit(
        "load",
        url=url,
        layout=layout,
        bad=bad,
        leaves=leaves,
        other_reads=other,
        lists=IO.lists.get(local_root(url), 0),
        seconds=dt,
    )


def _norm(index: tuple[slice, ...], shape: tuple[int, ...]) -> list[slice]:
    return [slice(*s.indices(n)[:2]) for s, n in zip(index, shape)]


def guarded(check: str, fn: Any, *a: Any, **kw: Any) -> Any:
    try:
        return fn(*a, **kw)
    except Exception as e:
        emit(check, failed=f"{type(e).__name__}: {e}", tb=traceback.format_exc()[-2000:])
        return None


# ============================================================== scenarios
def scenario_save() -> None:
    tag = ARGS["tag"]
    base = os.path.join(WORKDIR, tag)
    tree = build_tree()

    # 1. quire.save
    url = os.path.join(base, "ck")
    t = time.monotonic()
    quire.save(url, tree, metadata={"tag": tag})
    root = local_root(url)
    index_reads = {k: n for k, n in IO.reads[root].items() if k.endswith(".index.json")}
    index_sizes = {
        os.path.relpath(os.path.join(d, f), root): os.path.getsize(os.path.join(d, f))
        for d, _, files in os.walk(root)
        for f in files
        if f.endswith(".index.json")
    }
    emit(
        "saved",
        url=url,
        seconds=time.monotonic() - t,
        index_reads=index_reads,
        index_sizes=index_sizes,
    )
    ownership(url, tree)

    # 2. quire.save_async: returns after the host copy; the caller may then mutate
    url = os.path.join(base, "async")
    resp = quire.save_async(url, tree)
    resp.result()
    ownership(url, tree)
    bad = compare(quire.load(url, abstract_tree("save")), "save")
    emit("async", url=url, bad=bad)
    # 2b. the same through pinned host staging (the GPU default; CPU devices have pinned_host)
    url = os.path.join(base, "async-pinned")
    with quire.Context(pinned_staging=True):
        quire.save_async(url, tree).result()
    emit("async-pinned", url=url, bad=compare(quire.load(url, abstract_tree("save")), "save"))

    # 3. quire.partial: two versions, a delete, finalize
    url = os.path.join(base, "partial")
    params = {"params": tree["params"]}
    v1 = quire.partial.save(url, params)
    v2 = quire.partial.save(url, {k: v for k, v in tree.items() if k != "params"} | {"extra": 1})
    v3 = quire.partial.delete(url, [("extra",)])
    mid = quire.partial.load(url, abstract_tree("save"))
    quire.partial.finalize(url)
    final = quire.load(url, abstract_tree("save"))
    emit(
        "partial",
        url=url,
        versions=[v1, v2, v3],
        bad_mid=compare(mid, "save"),
        bad_final=compare(final, "save"),
        journal_left=os.path.exists(os.path.join(url, "journal"))
        and bool(os.listdir(os.path.join(url, "journal"))),
        wrote=IO.writes.get(local_root(url), []),
    )

    # 3b. quire.partial, a version replacing all but opt/count: every process's first pack is
    # left mostly dead, and finalize (run by the primary) rewrites them all
    guarded("partial_rw", partial_rewrite, os.path.join(base, "partial-rw"), tree)

    # 4. quire.Checkpointer
    if hasattr(quire, "Checkpointer"):
        guarded("checkpointer", checkpointer, os.path.join(base, "run"), tree)
    else:
        emit("checkpointer", missing=True)

    # 4b. an incremental Checkpointer: steps 2 and 3 borrow every chunk
    guarded("checkpointer_inc", checkpointer_incremental, os.path.join(base, "run-inc"), tree)

    # 5. a scalar that differs between processes
    failing_save("disagree", os.path.join(base, "disagree"), dict(tree, step=100 + PID_))

    # 6. a write that fails in one process: the last one, then the primary
    for who in (NPROC_ - 1, 0):
        url = os.path.join(base, f"fail-{who}")
        IO.fail_root, IO.fail_count = (local_root(url) if who == PID_ else None), 0
        failing_save(f"fail-{who}", url, tree)
    IO.fail_root = None

    barrier("saved")
    run_loads()


def partial_rewrite(url: str, tree: dict[str, Any]) -> None:
    quire.partial.save(url, tree)
    quire.partial.save(url, dict(tree, opt={"mu": tree["opt"]["mu"]}))
    quire.partial.finalize(url)
    final = quire.load(url, abstract_tree("save"))
    loc = quire.metadata(url).tree["opt"]["count"].location  # d/<rewrite>/<v1>/pytree/...
    with open(os.path.join(url, "quire.json")) as f:
        record = json.load(f)
    root = local_root(url)
    emit(
        "partial_rw",
        url=url,
        bad_final=compare(final, "save"),
        location=loc,
        indexes=[[e["txid"], e["process"]] for e in record["indexes"]],
        txids=record["txids"],
        rewrote=[k for k in IO.writes.get(root, []) if k.startswith(f"d/{loc.split('/')[1]}/")],
        on_disk=sorted(os.listdir(os.path.join(url, "d"))),
    )


def failing_save(check: str, url: str, tree: dict[str, Any]) -> None:
    """A save expected to fail in every process: report the error and what is left."""
    t = time.monotonic()
    try:
        quire.save(url, tree)
        err = None
    except Exception as e:
        err = {
            "type": type(e).__name__,
            "quire": isinstance(e, quire.QuireError),
            "message": str(e),
        }
    dt = time.monotonic() - t
    barrier(check)
    leftover = []
    if os.path.isdir(os.path.join(url, "d")):
        for dirpath, _dirs, files in os.walk(os.path.join(url, "d")):
            leftover += [os.path.join(dirpath, f) for f in files]
    emit(
        check,
        url=url,
        error=err,
        seconds=dt,
        committed=os.path.exists(os.path.join(url, "quire.json")),
        leftover=len(leftover),
    )


def checkpointer(root: str, tree: dict[str, Any]) -> None:
    from quire.policies import LatestN

    steps_saved = []
    with quire.Checkpointer(root, keep=LatestN(2), gc_grace_period=None) as ck:
        for step in (1, 2, 3):
            tree_s = dict(tree, step=step)
            if ck.save(step, tree_s, metrics={"loss": 1.0 / step}):
                steps_saved.append(step)
        ck.wait()
        steps = ck.steps()
        latest = ck.latest_step()
        loaded = ck.load(latest, abstract_tree("save"))
    loaded = dict(loaded, step=7)
    barrier("checkpointer")
    writes = {k: v for k, v in IO.writes.items() if k.startswith(os.path.abspath(root))}
    emit(
        "checkpointer",
        root=root,
        saved=steps_saved,
        steps=steps,
        latest=latest,
        bad=compare(loaded, "save"),
        on_disk=sorted(d for d in os.listdir(root) if d.startswith("step")),
        wrote={os.path.relpath(k, root): v for k, v in writes.items()},
    )


def checkpointer_incremental(root: str, tree: dict[str, Any]) -> None:
    """The same tree objects at steps 1, 2, 3 of an incremental root (keep the latest 2):
    each process borrows only from its own earlier packs and writes no pack after step 1."""
    from quire.policies import LatestN

    with quire.Checkpointer(root, keep=LatestN(2), gc_grace_period=None, incremental=True) as ck:
        for step in (1, 2, 3):
            ck.save(step, dict(tree, step=step))
        ck.wait()
        steps = ck.steps()
        loaded = ck.load(3, abstract_tree("save"))
    loaded = dict(loaded, step=7)
    barrier("checkpointer_inc")
    with open(os.path.join(root, "step_00000003", "quire.json")) as f:
        record = json.load(f)
    packs = {
        os.path.relpath(k, root): v
        for k, v in IO.packs.items()
        if k.startswith(os.path.abspath(root))
    }
    emit(
        "checkpointer_inc",
        steps=steps,
        bad=compare(loaded, "save"),
        borrowed={str(e["process"]): sorted(e.get("borrowed", {})) for e in record["indexes"]},
        packs=packs,
        step1_record=os.path.exists(os.path.join(root, "step_00000001", "quire.json")),
    )


def run_loads() -> None:
    for spec in ARGS.get("loads", []):
        url = (
            os.path.join(WORKDIR, spec["ckpt"])
            if not spec["ckpt"].startswith("s3://")
            else spec["ckpt"]
        )
        for layout in spec["layouts"]:
            guarded("load", do_load, url, layout)


def scenario_load() -> None:
    run_loads()


def scenario_kill() -> None:
    url = os.path.join(WORKDIR, ARGS["tag"])
    quire.save(url, build_tree("v1"))
    barrier("v1")
    quire.configure(timeout=float(ARGS["timeout"]))
    if ARGS["victim"] == PID_:
        IO.kill_after = int(ARGS["after"])
    emit("armed")
    t = time.monotonic()
    try:
        quire.save(url, build_tree("v2"), overwrite=True)
        emit("survivor", error=None, seconds=time.monotonic() - t)
    except Exception as e:
        emit(
            "survivor",
            error={
                "type": type(e).__name__,
                "quire": isinstance(e, quire.QuireError),
                "message": str(e),
            },
            seconds=time.monotonic() - t,
        )
    # A peer is dead: jax.distributed.shutdown() would wait for it at its barrier.
    sys.stdout.flush()
    os._exit(0)


def scenario_verify() -> None:
    url = os.path.join(WORKDIR, ARGS["tag"])
    bad = compare(quire.load(url, abstract_tree("save")), "save", "v1")
    with open(os.path.join(url, "quire.json")) as f:
        doc = json.load(f)
    present = sorted(os.listdir(os.path.join(url, "d")))
    emit("verify", bad=bad, txids=doc["txids"], present=present)
    # and the debris does not stop a new save
    quire.save(url, build_tree("v3"), overwrite=True)
    emit("resave", bad=compare(quire.load(url, abstract_tree("save")), "save", "v3"))


def scenario_s3() -> None:
    _install_s3()
    quire.configure(storage_options={"s3": ARGS["storage_options"]})
    url = ARGS["url"]
    tree = build_tree()
    quire.save(url, tree)
    ownership(url, tree)
    resp = quire.save_async(url + "-async", tree)
    resp.result()
    emit("async", url=url, bad=compare(quire.load(url + "-async", abstract_tree("save")), "save"))
    for layout in ARGS["layouts"]:
        guarded("load", do_load, url, layout)
    # partial through s3
    purl = url + "-partial"
    quire.partial.save(purl, {"params": tree["params"]})
    quire.partial.save(purl, {k: v for k, v in tree.items() if k != "params"})
    quire.partial.finalize(purl)
    emit("partial", url=purl, bad_final=compare(quire.load(purl, abstract_tree("save")), "save"))


# ============================================================== replica-parallel writes
# name -> (shape, dtype, PartitionSpec on the (2, 4) mesh "m24"): ~100 MiB, mostly
# replicated (shapes 4 does not divide), some replicated over one mesh axis, some sharded.
REPLICA_ARRAYS: dict[str, tuple[tuple[int, ...], str, Any]] = {
    "rep/big": ((4099, 1024), "float32", P()),
    "rep/odd": ((1001, 257), "float32", P()),
    "rep/bf16": ((2053, 2048), "bfloat16", P()),
    "rep/cube": ((3, 5, 7), "float32", P()),
    "rep/col": ((7, 300001), "float32", P()),
    "half/x": ((4096, 1030), "float32", P("x")),
    "half/y": ((1030, 2048), "float32", P(None, "y")),
    "shard/w": ((4096, 2048), "float32", P(("x", "y"))),
    **{f"small/n{i}": ((257 + 31 * i,), "float32", P()) for i in range(40)},
}
REPLICA_NUMPY = {"host/np": ((1000, 100), "float64")}


def replica_tree() -> dict[str, Any]:
    mesh = meshes()["m24"]
    tree: dict[str, Any] = {}
    for name, (shape, dtype, spec) in REPLICA_ARRAYS.items():
        src = source(name, shape, dtype)
        _put(
            tree,
            name,
            jax.make_array_from_callback(shape, NamedSharding(mesh, spec), src.__getitem__),
        )
    for name, (shape, dtype) in REPLICA_NUMPY.items():
        _put(tree, name, source(name, shape, dtype))
    return tree


def replica_abstract() -> dict[str, Any]:
    mesh = meshes()["m24"]
    tree: dict[str, Any] = {}
    for name, (shape, dtype, spec) in REPLICA_ARRAYS.items():
        sds = jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=NamedSharding(mesh, spec))
        _put(tree, name, sds)
    for name in REPLICA_NUMPY:
        _put(tree, name, np.ndarray)
    return tree


def replica_compare(loaded: Any) -> list[str]:
    bad = []
    for name, (shape, dtype, _) in REPLICA_ARRAYS.items():
        want, got = source(name, shape, dtype), _get(loaded, name)
        for s in got.addressable_shards:
            if np.asarray(s.data).tobytes() != want[s.index].tobytes():
                bad.append(f"{name}: shard {s.index} differs")
    for name, (shape, dtype) in REPLICA_NUMPY.items():
        if _get(loaded, name).tobytes() != source(name, shape, dtype).tobytes():
            bad.append(f"{name} differs")
    return bad


def scenario_replicas() -> None:
    """Save ``replica_tree`` with replica-parallel writes on and off; report per process
    the bytes of its packs (sizes on disk) and the chunk keys it wrote; load both back."""
    tree = replica_tree()
    for mode in ("on", "off"):
        url = os.path.join(WORKDIR, f"rw-{mode}")
        t = time.monotonic()
        with quire.Context(replica_writes=mode == "on"):
            quire.save(url, tree)
        seconds = time.monotonic() - t
        barrier(f"saved-{mode}")
        packs = os.path.join(url, "d", quire.metadata(url).record["txids"][0], "%packs")
        mine = [f for f in os.listdir(packs) if f.startswith(f"p{PID_:05d}-")]
        meta = quire.metadata(url).tree
        stored = {}  # location -> (chunks, bytes of one stored chunk)
        dtypes = {k: v[1] for k, v in (REPLICA_ARRAYS | REPLICA_NUMPY).items()}
        for name, dtype in dtypes.items():
            m = _get(meta, name)
            n = math.prod(-(-a // c) for a, c in zip(m.shape, m.chunk_shape))
            stored[m.location] = (
                n,
                math.prod(m.chunk_shape) * np.dtype(jnp.dtype(dtype)).itemsize + 4,
            )
        emit(
            "replicas",
            mode=mode,
            save_seconds=seconds,
            pack_bytes=sum(os.path.getsize(os.path.join(packs, f)) for f in mine),
            chunks=[k for k in IO.writes.get(local_root(url), []) if is_chunk_key(k)],
            stored=stored,
        )
    # loads: shared reads (each shared chunk read by one process, then exchanged) or not
    # ("min": shared reads on, but the shared chunks are below replica_read_min_bytes)
    for ckpt, reads in (("rw-on", True), ("rw-on", False), ("rw-off", True), ("rw-on", "min")):
        url = os.path.join(WORKDIR, ckpt)
        barrier(f"load-{ckpt}-{reads}")
        IO.reset_reads()
        t = time.monotonic()
        opts: dict[str, Any] = {"replica_reads": bool(reads)}
        if reads == "min":
            opts["replica_read_min_bytes"] = 1 << 40
        with quire.Context(**opts):
            loaded = quire.load(url, replica_abstract())
        seconds = time.monotonic() - t
        got = IO.reads.get(local_root(url), {})
        emit(
            "replica_load",
            ckpt=ckpt,
            reads=reads,
            seconds=seconds,
            read=sum(n for k, n in got.items() if is_chunk_key(k)),
            requests=sum(1 for k in got if is_chunk_key(k)),
            bad=replica_compare(loaded),
        )
    if "stall" in ARGS:
        stalled_load(os.path.join(WORKDIR, "rw-on"), float(ARGS["stall"]))


def stalled_load(url: str, timeout: float) -> None:
    """The last process never joins a load: the others fail within ``timeout``."""
    barrier("stall")
    if PID_ == NPROC_ - 1:
        time.sleep(3 * timeout)
        emit("stall", stalled=True)
    else:
        t = time.monotonic()
        try:
            with quire.Context(timeout=timeout, replica_reads=True):
                quire.load(url, replica_abstract())
            emit("stall", error=None, seconds=time.monotonic() - t)
        except Exception as e:
            emit(
                "stall",
                error=f"{type(e).__name__}: {e}",
                quire=isinstance(e, quire.QuireError),
                seconds=time.monotonic() - t,
            )
    emit("done", seconds=time.monotonic() - T0)
    sys.stdout.flush()
    os._exit(0)  # a peer is stalled: jax.distributed.shutdown() would wait for it


def is_chunk_key(key: str) -> bool:
    return "/c/" in key or key.endswith("/c")


def main() -> None:
    try:
        {
            "save": scenario_save,
            "load": scenario_load,
            "kill": scenario_kill,
            "verify": scenario_verify,
            "s3": scenario_s3,
            "replicas": scenario_replicas,
        }[SCENARIO]()
    except BaseException as e:
        emit("crashed", failed=f"{type(e).__name__}: {e}", tb=traceback.format_exc()[-3000:])
        sys.stdout.flush()
        os._exit(2)
    emit("done", seconds=time.monotonic() - T0, startup=T_READY, started=T_START)
    if NPROC_ > 1:
        jax.distributed.shutdown()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
