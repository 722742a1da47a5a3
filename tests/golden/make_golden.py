"""Write the golden checkpoints of an on-disk format version (run once per format version).

    .venv/bin/python tests/golden/make_golden.py            # format v1 (layout="chunks")
    .venv/bin/python tests/golden/make_golden.py --v2       # format v2 (packed)
    .venv/bin/python tests/golden/make_golden.py --v2-rewritten   # v2/rewritten only
    .venv/bin/python tests/golden/make_golden.py --v2-index3      # v2 with chunk index format 3
    .venv/bin/python tests/golden/make_golden.py --incremental    # an incremental root
    .venv/bin/python tests/golden/make_golden.py --jaxlibs        # axis types, NNX Variables
    .venv/bin/python tests/golden/make_golden.py --units          # every kind of unit
    .venv/bin/python tests/golden/make_golden.py --codecs         # codec chains of issue 37

``v2`` holds chunk indexes of format 2 (a CRC-32 for every key), written before the crc32c
trailer binding; ``v2-index3`` the same checkpoints (and the rewritten journal) with format-3
indexes (``quire.crc32c`` for plain array chunks, docs/format.md).

The files are committed; tests/test_golden.py loads them and fails if any is missing —
it never regenerates them.  Values are deterministic so the test can rebuild them.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


def expected() -> dict[str, object]:
    import ml_dtypes

    return {
        "params": {
            "w": np.arange(24, dtype=np.float32).reshape(4, 6) / 7,
            "b": np.arange(6, dtype=ml_dtypes.bfloat16),
            "f8": np.linspace(-2, 2, 8).astype(ml_dtypes.float8_e4m3fn),
        },
        "opt": [np.arange(5, dtype=np.int64), (np.array(2.5), np.array([True, False]))],
        "step": 1234,
        "lr": 0.001,
        "name": "golden",
        "blob": b"\x00\xff",
        "nothing": None,
        "c": np.complex64(1 - 2j),
    }


def rewritten_expected() -> dict[str, object]:
    return {
        "a": np.zeros(500, np.float32),
        "a2": np.arange(10, dtype=np.int16),
        "z": np.arange(1000, dtype=np.float32) / 3,
    }


def rewritten(version: str = "v2") -> None:
    """``<version>/rewritten``: a journal finalized with a pack rewrite.  Version 1 writes
    [a | a2] and [z] (pack_bytes=5000); version 2 replaces a, so the first pack is 24 of
    2,028 bytes live: finalize copies a2 into a new pack and points at z's pack, kept, in
    place."""
    import json

    import quire

    out = os.path.join(HERE, version, "rewritten")
    if os.path.exists(out) and "--force" not in sys.argv:
        sys.exit(f"{out} exists; pass --force to rewrite it")
    shutil.rmtree(out, ignore_errors=True)
    want = rewritten_expected()
    with quire.Context(pack_bytes=5000):
        quire.partial.save(out, {"a": np.arange(500, dtype=np.float32), "a2": want["a2"],
                                 "z": want["z"]})  # fmt: skip
        quire.partial.save(out, {"a": want["a"]})
        quire.partial.finalize(out)
    with open(os.path.join(out, "quire.json")) as f:
        doc = json.load(f)
    targets = set()
    for e in doc["indexes"]:
        with open(os.path.join(out, e["object"])) as f:
            refs = json.load(f)["refs"]
        targets |= {(e["txid"], v[0].split("/")[1]) for v in refs.values() if isinstance(v, list)}
    assert any(t == p for t, p in targets) and any(t != p for t, p in targets), targets
    print("wrote", out)


def incremental_expected(step: int) -> dict[str, object]:
    """Step ``step`` of the golden incremental root: ``frozen`` the same every step,
    ``x`` new each step."""
    return {
        "frozen": {
            "e": np.arange(40, dtype=np.int32).reshape(5, 8),
            "w": np.arange(96, dtype=np.float32).reshape(8, 12) / 3,
        },
        "x": np.arange(6, dtype=np.float32) + step,
        "step": step,
    }


def incremental() -> None:
    """``incremental``: a ``Checkpointer(incremental=True, keep=LatestN(2))`` root after
    steps 1, 2, 3: step 1's record was deleted by retention, its pack is kept (steps 2 and
    3 borrow ``frozen`` from it), the adapters-like ``x`` are owned by each step."""
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    import jax.numpy as jnp

    import quire
    from quire.policies import LatestN

    out = os.path.join(HERE, "incremental")
    if os.path.exists(out) and "--force" not in sys.argv:
        sys.exit(f"{out} exists; pass --force to rewrite it")
    shutil.rmtree(out, ignore_errors=True)
    first: dict[str, np.ndarray] = incremental_expected(0)["frozen"]  # type: ignore[assignment]
    frozen = {k: jnp.asarray(v) for k, v in first.items()}
    with quire.Checkpointer(out, keep=LatestN(2), incremental=True) as ck:
        for step in (1, 2, 3):
            tree = dict(incremental_expected(step), frozen=frozen)
            tree["x"] = jnp.asarray(tree["x"])
            ck.save(step, tree)
            ck.wait()
    print("wrote", out)


def jaxlibs_expected() -> dict[str, np.ndarray]:
    """The values of ``jaxlibs``: ``x`` (sharded on an Explicit (4, 2) mesh) and the NNX
    Variables' values, by key path."""
    return {
        "x": np.arange(64, dtype=np.float32).reshape(8, 8),
        "nnx/w/value": np.arange(6, dtype=np.float32).reshape(2, 3) / 4,
        "nnx/mean/value": np.full(3, 0.5, np.float32),
    }


def jaxlibs() -> None:
    """``jaxlibs``: a format-v2 checkpoint with the optional fields of issue 31: a mesh's
    ``axis_types`` (Explicit) in a sharding record and NNX Variable classes (``variable``)
    on leaves."""
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    import jax
    from flax import nnx

    import quire

    out = os.path.join(HERE, "jaxlibs")
    if os.path.exists(out) and "--force" not in sys.argv:
        sys.exit(f"{out} exists; pass --force to rewrite it")
    shutil.rmtree(out, ignore_errors=True)
    want = jaxlibs_expected()

    class Tiny(nnx.Module):
        def __init__(self) -> None:
            self.w = nnx.Param(jax.numpy.asarray(want["nnx/w/value"]))
            self.mean = nnx.BatchStat(jax.numpy.asarray(want["nnx/mean/value"]))
            self.key = nnx.RngKey(jax.random.key(5))

    mesh = jax.make_mesh((4, 2), ("x", "y"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    x = jax.device_put(
        want["x"], jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x", "y"))
    )
    quire.save(os.path.join(out, "plain"), {"x": x, "nnx": nnx.state(Tiny())})
    print("wrote", out)


class GoldenPosition:
    """A whole ``Checkpointable`` unit of the golden ``units`` checkpoint: its position, in
    the record and in an object of its own."""

    quire_per_process = False

    def __init__(self, pos: int) -> None:
        self.pos = pos

    def quire_save(self, io: Any) -> Any:
        io.write("pos.json", json.dumps({"pos": self.pos}).encode())
        return {"pos": self.pos}

    def quire_restore(self, io: Any, record: Any) -> GoldenPosition:
        stored = json.loads(io.read("pos.json"))
        assert stored == record, (stored, record)
        self.pos = int(stored["pos"])
        return self


class GoldenPerProcess(GoldenPosition):
    """The same, with one state per JAX process (``quire_per_process``)."""

    quire_per_process = True


def units_expected() -> dict[str, Any]:
    """The golden ``units`` checkpoint's units (``whole`` and ``it`` by their position)."""
    return {
        "state": {"w": np.arange(6, dtype=np.float32) / 4, "step": 7},
        "config": {"lr": 0.5, "name": "golden"},
        "whole": 21,
        "it": 13,
    }


def units() -> None:
    """``units``: a format-v2 checkpoint of ``save_checkpointables`` with a pytree unit, a
    JSON unit, a whole ``Checkpointable`` unit (``record``) and a per-process one
    (``processes``, ``records``, its object under ``p00000/``), saved by one process."""
    import quire

    out = os.path.join(HERE, "units")
    if os.path.exists(out) and "--force" not in sys.argv:
        sys.exit(f"{out} exists; pass --force to rewrite it")
    shutil.rmtree(out, ignore_errors=True)
    want = units_expected()
    quire.save_checkpointables(
        os.path.join(out, "plain"),
        {**want, "whole": GoldenPosition(want["whole"]), "it": GoldenPerProcess(want["it"])},
        metadata={"golden": True},
    )
    print("wrote", out)


BITROUND = {"name": "numcodecs.bitround", "configuration": {"keepbits": 10}}
DELTA = {"name": "numcodecs.delta", "configuration": {"dtype": "int32"}}
TRANSPOSE = {"name": "transpose", "configuration": {"order": [1, 0]}}


def codecs_expected() -> dict[str, tuple[np.ndarray, list[Any], int | None]]:
    """The golden ``codecs`` checkpoint's leaves: (value saved, codecs, chunk_bytes)."""
    rng = np.random.default_rng(37)
    return {
        "w": (rng.standard_normal((16, 12)).astype(np.float32), [BITROUND, "numcodecs.zstd"], None),
        "i": (np.cumsum(rng.integers(0, 9, 300)).astype(np.int32), [DELTA, "numcodecs.lz4"], None),
        "t": ((np.arange(96, dtype=np.float32) / 7).reshape(8, 12), ["zstd", TRANSPOSE], 96),
    }


def codecs() -> None:
    """``codecs``: format v2 (``plain``) and v1 (``chunks``) arrays whose chains hold array ->
    array codecs (issue 37): a lossy ``numcodecs.bitround`` before ``numcodecs.zstd``,
    ``numcodecs.delta`` before ``numcodecs.lz4``, ``transpose`` with ``zstd`` in inner chunks;
    records list ``bytes`` after the array -> array codecs and name the lossy ones."""
    import quire

    out = os.path.join(HERE, "codecs")
    if os.path.exists(out) and "--force" not in sys.argv:
        sys.exit(f"{out} exists; pass --force to rewrite it")
    shutil.rmtree(out, ignore_errors=True)
    want = codecs_expected()

    def storage(path: Any, leaf: Any) -> Any:
        _, chain, chunk_bytes = want[str(path[0])]
        return quire.StorageOptions(codecs=chain, chunk_bytes=chunk_bytes)

    tree = {k: v for k, (v, _, _) in want.items()}
    for name, layout in (("plain", "packed"), ("chunks", "chunks")):
        quire.save(os.path.join(out, name), tree, storage=storage, layout=layout)
    print("wrote", out)


def main() -> None:
    if "--codecs" in sys.argv:
        return codecs()
    if "--units" in sys.argv:
        return units()
    if "--v2-rewritten" in sys.argv:
        return rewritten()
    if "--incremental" in sys.argv:
        return incremental()
    if "--jaxlibs" in sys.argv:
        return jaxlibs()
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    import jax

    import quire

    version = "v2-index3" if "--v2-index3" in sys.argv else "v2" if "--v2" in sys.argv else "v1"
    layout = "chunks" if version == "v1" else "packed"
    out = os.path.join(HERE, version)
    if os.path.exists(out) and "--force" not in sys.argv:
        sys.exit(f"{out} exists; pass --force to rewrite the golden files of format {version}")
    ctx = quire.Context(layout=layout)
    ctx.__enter__()
    shutil.rmtree(out, ignore_errors=True)
    tree = expected()
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 2), ("x", "y"))
    sharded = jax.device_put(
        np.arange(64, dtype=np.float32).reshape(8, 8),
        jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x", "y")),
    )
    quire.save(
        os.path.join(out, "plain"),
        {**tree, "sharded": sharded, "key": jax.random.key(5)},
        metadata={"golden": True},
    )
    quire.save(
        os.path.join(out, "compressed"),
        tree,
        storage=quire.StorageOptions(codecs=["zstd"], chunk_bytes=32),
    )
    for i in range(2):
        quire.partial.save(os.path.join(out, "journal"), {f"part{i}": np.full(3, i, np.int32)})
    print("wrote", out)
    if version == "v2-index3":
        rewritten(version)


if __name__ == "__main__":
    main()
