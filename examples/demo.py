"""quire demo: save a small JAX model's state locally, list it, load it back.

Run:  python examples/demo.py [DIR]
"""

from __future__ import annotations

import itertools
import os
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


def main() -> None:
    root = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="quire-demo-")
    url = os.path.join(root, "step_100")

    # Shard the first layer's weights over the 8 CPU devices, as a real run would over GPUs.
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data", "model"))
    params = init_mlp(jax.random.key(0), [64, 128, 10])
    params["layer0"]["w"] = jax.device_put(params["layer0"]["w"], sharding)
    state = {"params": params, "step": 100, "rng": jax.random.key(7), "run": "demo"}

    quire.save(url, state, metadata={"loss": 0.125}, overwrite=True)
    print(f"saved the model state to {url}")

    print("\n$ quire info", url)
    from quire._cli import main as cli

    cli(["info", url])
    print("\n$ quire verify", url)
    cli(["verify", url])

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
