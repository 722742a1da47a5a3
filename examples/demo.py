"""quire demo: save a small JAX model's state locally, inspect and verify it with the
``quire`` command, load it back onto another sharding.

Run:  python examples/demo.py [DIR]

With DIR the checkpoint stays in DIR/step_100 (look at it with ``quire info``); without,
it goes to a temporary directory that is removed at the end.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import subprocess
import sys
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np

import quire


def init_mlp(key: jax.Array, sizes: list[int]) -> dict[str, dict[str, jax.Array]]:
    params = {}
    for i, (n_in, n_out) in enumerate(itertools.pairwise(sizes)):
        key, sub = jax.random.split(key)
        params[f"layer{i}"] = {
            "w": jax.random.normal(sub, (n_in, n_out), jnp.float32) / np.sqrt(n_in),
            "b": jnp.zeros((n_out,), jnp.bfloat16),
        }
    return params


def quire_cli(*args: str) -> None:
    """Run the ``quire`` command as a user would (the installed console script)."""
    print("\n$ quire", " ".join(args), flush=True)
    subprocess.run([sys.executable, "-m", "quire", *args], check=True)


def main() -> None:
    with contextlib.ExitStack() as stack:
        if len(sys.argv) > 1:
            root = sys.argv[1]
        else:
            root = stack.enter_context(tempfile.TemporaryDirectory(prefix="quire-demo-"))
        demo(os.path.join(root, "step_100"))


def demo(url: str) -> None:
    # Shard the first layer's weights over the 8 CPU devices, as a real run would over GPUs.
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data", "model"))
    params = init_mlp(jax.random.key(0), [64, 128, 10])
    params["layer0"]["w"] = jax.device_put(params["layer0"]["w"], sharding)
    state = {"params": params, "step": 100, "rng": jax.random.key(7), "run": "demo"}

    quire.save(url, state, metadata={"loss": 0.125}, overwrite=True)
    print(f"saved the model state to {url}")

    quire_cli("info", url)
    quire_cli("verify", url)

    # Load it back onto a different sharding: a single device.
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0]))
        if isinstance(x, jax.Array) and not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
        else x,
        state,
    )
    restored = quire.load(url, abstract)
    same = jax.tree.all(
        jax.tree.map(
            lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b)))
            if isinstance(a, jax.Array) and not jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key)
            else True,
            state, restored,
        )
    )
    w = restored["params"]["layer0"]["w"]
    print(f"\nloaded it back: step={restored['step']}, layer0/w {w.dtype}{list(w.shape)} on {w.sharding}")
    print(f"every array equal to what was saved: {same}")
    print(f"custom metadata: {quire.metadata(url).custom}")
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
