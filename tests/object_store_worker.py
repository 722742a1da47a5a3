"""Saving processes for tests/test_object_stores.py: a zygote that forks one per save.

``python object_store_worker.py`` imports jax, quire and both object-store backends once
(no jax backend, event loop or client is started, so forking is safe), prints
``zygote ready``, then reads one JSON spec per line on stdin::

    {"url": ..., "options": {...}, "seed": 1, "overwrite": false, "out": "/tmp/x"}

and forks a child per spec, answering ``forked <pid>``.  The child writes ``ready`` and
then one JSON line - ``{"result": "committed"}`` or ``{"result": "exists"}`` - to
``out`` (its stdout and stderr go to ``out + ".log"``).  Tests kill children mid-save.
Forking keeps a process at ~0.3 s instead of a jax import each (seconds on 2 cores).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import traceback
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def build_tree(seed: int) -> dict[str, Any]:
    """A small tree of every common leaf kind; every value depends on ``seed``."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(seed)
    return {
        "params": {
            "w": rng.standard_normal((128, 96)).astype(np.float32),
            "emb": jnp.asarray(rng.standard_normal((64, 32)), dtype=jnp.bfloat16),
            "b": rng.integers(0, 1000, 50).astype(np.int32),
        },
        "opt": {"mu": rng.standard_normal(300).astype(np.float32), "count": seed},
        "rng": jax.random.key(seed),
        "tag": f"writer-{seed}",
    }


def assert_tree(got: Any, seed: int) -> None:
    """``got`` is, entirely, the tree of ``seed``."""
    import jax
    import numpy as np

    want = build_tree(seed)
    assert got["tag"] == want["tag"], (got["tag"], want["tag"])
    assert got["opt"]["count"] == seed
    for a, b in (
        (got["params"]["w"], want["params"]["w"]),
        (got["params"]["emb"], want["params"]["emb"]),
        (got["params"]["b"], want["params"]["b"]),
        (got["opt"]["mu"], want["opt"]["mu"]),
        (jax.random.key_data(got["rng"]), jax.random.key_data(want["rng"])),
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _child(spec: dict[str, Any]) -> int:
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    log = os.open(spec["out"] + ".log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    import quire

    def say(line: str) -> None:
        with open(spec["out"], "a") as f:
            f.write(line + "\n")

    try:
        tree = build_tree(spec["seed"])
        say("ready")
        quire.save(
            spec["url"],
            tree,
            overwrite=spec.get("overwrite", False),
            storage_options=spec.get("options"),
        )
        say(json.dumps({"result": "committed"}))
    except quire.CheckpointExistsError as e:
        say(json.dumps({"result": "exists", "error": str(e)}))
    except BaseException as e:
        traceback.print_exc()
        say(json.dumps({"result": "error", "error": f"{type(e).__name__}: {e}"}))
        return 1
    return 0


def main() -> int:
    import quire_gcs._backend  # noqa: F401
    import quire_s3._backend  # noqa: F401
    from gcsfs.core import GCSFileSystem  # noqa: F401
    from s3fs import S3FileSystem  # noqa: F401

    import quire  # noqa: F401

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped automatically
    print("zygote ready", flush=True)
    for line in sys.stdin:
        spec = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = _child(spec)
            finally:
                os._exit(code)
        print(f"forked {pid}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
