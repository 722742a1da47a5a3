"""Flax NNX + Optax + Grain on an Explicit 8-device mesh, checkpointed with quire.Checkpointer.

A small MLP (with dropout, so the model carries PRNG state) trains on a Grain pipeline, its
parameters sharded over the "model" axis and each batch over the "data" axis of a
``jax.make_mesh((4, 2), ("data", "model"))`` mesh of Explicit axes (8 CPU devices). A
``quire.Checkpointer`` with a local tier saves every few steps, asynchronously: the model
state, the optimizer state and the Grain iterator, as the units of one checkpoint.

Kill it at any moment (SIGKILL included, even while a save is being written) and run the same
command again: it resumes from the newest committed step and ends with exactly, bit for bit,
the parameters, optimizer state, PRNG state and data position of an uninterrupted run.

    python examples/nnx_train.py ROOT [--steps 40] [--die-at STEP]

``--die-at STEP`` sends the process SIGKILL right after step STEP (after that step's save
call, if it saves: the save is then still being written).  The last line printed is
``final <digest>``: a SHA-256 of every parameter, optimizer and PRNG leaf and of the data
position (the iterator's state and its next batch), to compare runs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
from typing import Any

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import quire
from quire.policies import EveryNSteps, LatestN, SpecificSteps

FEATURES, HIDDEN, BATCH = 16, 64, 32
EXAMPLES = 4096
LR = 3e-3
PARAM_SEED, DROPOUT_SEED, DATA_SEED, TEACHER_SEED = 0, 1, 2, 3
LOCAL_EVERY, PERSISTENT_EVERY = 4, 10


# ----------------------------------------------------------------------------- the mesh
def make_mesh() -> jax.sharding.Mesh:
    """Eight CPU devices as a (4, 2) mesh of Explicit axes: batches split over "data",
    hidden units over "model"."""
    return jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)


# ----------------------------------------------------------------------------- the model
class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        init = nnx.initializers.lecun_normal()
        zeros = nnx.initializers.zeros_init()
        self.hidden = nnx.Linear(
            FEATURES,
            HIDDEN,
            kernel_init=nnx.with_partitioning(init, (None, "model")),
            bias_init=nnx.with_partitioning(zeros, ("model",)),
            rngs=rngs,
        )
        self.dropout = nnx.Dropout(0.1, rngs=rngs)  # its key and count: PRNG state
        self.out = nnx.Linear(
            HIDDEN, 1, kernel_init=nnx.with_partitioning(init, ("model", None)), rngs=rngs
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        h = self.dropout(nnx.relu(self.hidden(x)))
        # The contraction runs over the sharded "model" axis: say how the output is sharded.
        return self.out(h, out_sharding=P("data", None))


def build(mesh: jax.sharding.Mesh) -> tuple[MLP, nnx.Optimizer]:
    """A freshly initialised model and optimizer, sharded on ``mesh``."""
    with jax.set_mesh(mesh):
        model = MLP(nnx.Rngs(params=PARAM_SEED, dropout=DROPOUT_SEED))
        opt = nnx.Optimizer(model, optax.adamw(LR), wrt=nnx.Param)
    return model, opt


def state_of(model: MLP, opt: nnx.Optimizer) -> dict[str, Any]:
    """What a checkpoint holds of the model and the optimizer (nnx.State pytrees)."""
    return {"model": nnx.state(model), "opt": nnx.state(opt)}


@nnx.jit
def train_step(model: MLP, opt: nnx.Optimizer, x: jax.Array, y: jax.Array) -> jax.Array:
    def loss_fn(model: MLP) -> jax.Array:
        return jnp.mean((model(x) - y) ** 2)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    opt.update(model, grads)
    return loss


# ----------------------------------------------------------------------------- the data
TEACHER = np.random.default_rng(TEACHER_SEED).standard_normal((FEATURES,)).astype(np.float32)


def example(i: int) -> dict[str, np.ndarray]:
    """Example ``i``: inputs from its index alone, targets from a fixed teacher."""
    x = np.random.default_rng((DATA_SEED, i)).standard_normal(FEATURES, np.float32)
    return {"x": x, "y": np.sin(x @ TEACHER / 4).astype(np.float32)[None]}


def pipeline() -> grain.DatasetIterator:
    """Shuffled (anew each epoch), batched, read ahead by two threads."""
    ds = (
        grain.MapDataset.range(EXAMPLES)
        .shuffle(seed=DATA_SEED)
        .repeat()
        .map(example)
        .batch(BATCH, drop_remainder=True)
    )
    return iter(ds.to_iter_dataset(grain.ReadOptions(num_threads=2, prefetch_buffer_size=4)))


# ----------------------------------------------------------------------------- comparing runs
def digest(model: MLP, opt: nnx.Optimizer, it: grain.DatasetIterator) -> str:
    """SHA-256 of every leaf of the model and optimizer state (PRNG keys by their key data)
    and of the data position (the iterator's state and the batch it yields next)."""
    h = hashlib.sha256()
    leaves = jax.tree_util.tree_leaves_with_path(state_of(model, opt))
    for path, leaf in sorted(leaves, key=lambda pl: jax.tree_util.keystr(pl[0])):
        if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        h.update(jax.tree_util.keystr(path).encode())
        h.update(np.asarray(leaf).tobytes())
    h.update(json.dumps(it.get_state(), sort_keys=True).encode())
    for v in next(it).values():
        h.update(np.asarray(v).tobytes())
    return h.hexdigest()


# ----------------------------------------------------------------------------- the loop
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("root", help="where this run's checkpoints go (a local folder)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--die-at", type=int, help="SIGKILL this process right after this step")
    args = ap.parse_args(argv)
    # Eight CPU devices (read when JAX first starts its backend, which is below).
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    jax.config.update("jax_platforms", "cpu")

    mesh = make_mesh()
    data = NamedSharding(mesh, P("data", None))
    model, opt = build(mesh)
    it = pipeline()
    ckpt = quire.Checkpointer(
        f"{args.root}/persistent",  # e.g. s3://bucket/run
        save_policy=EveryNSteps(PERSISTENT_EVERY) | SpecificSteps([args.steps]),
        keep=LatestN(2),
        local=quire.LocalTier(
            f"{args.root}/local",  # e.g. a local NVMe disk
            save_policy=EveryNSteps(LOCAL_EVERY),
            keep=LatestN(2),
        ),
    )
    with ckpt:
        start = ckpt.latest_step()
        if start is not None:
            # Targets: the state of the freshly built model and optimizer (arrays on the
            # mesh), so every restored array comes back with their sharding; the iterator of
            # a fresh pipeline is restored in place (set_state) to the saved position.
            got = ckpt.load_checkpointables(start, {"state": state_of(model, opt), "data": it})
            nnx.update(model, got["state"]["model"])
            nnx.update(opt, got["state"]["opt"])
            print(f"resumed from step {start} at data position {it.get_state()}", flush=True)
        step = start or 0
        while step < args.steps:
            batch = next(it)
            with jax.set_mesh(mesh):
                x, y = (jax.device_put(batch[k], data) for k in ("x", "y"))
                loss = train_step(model, opt, x, y)
            step += 1
            if ckpt.should_save(step):
                # Returns once the arrays are copied to host and the iterator's position is
                # taken; the training loop goes on while the step is written.
                ckpt.save_checkpointables(step, {"state": state_of(model, opt), "data": it})
            print(f"step {step} loss {float(loss):.6f} committed {ckpt.latest_step()}", flush=True)
            if step == args.die_at:
                os.kill(os.getpid(), signal.SIGKILL)
    # Leaving the with-block waited for the last saves and promotions.
    print(f"done at step {step}; steps kept {ckpt.steps()}", flush=True)
    print(f"final {digest(model, opt, it)}", flush=True)


if __name__ == "__main__":
    main()
