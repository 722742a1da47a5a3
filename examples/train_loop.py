"""A resumable JAX training loop with quire.Checkpointer (plain JAX: no flax, no optax).

Run it, kill it at any moment (even with SIGKILL), run the same command again: it resumes
from the latest committed step and ends with exactly the parameters of an uninterrupted
run, because everything is deterministic (fixed seeds; the batch of step i is derived from
i alone).

    python examples/train_loop.py ROOT [--steps 300] [--init-from OTHER_ROOT/train]

What it shows, each being something training codebases usually write by hand:

* resumable checkpoints of the whole state every 25 steps, at the last step, and when
  the job is preempted (SIGTERM) — ``EveryNSteps | SpecificSteps | OnPreemption``;
* keep-last-N plus the best step by a validation metric — ``LatestN | BestN``;
* periodic checkpoints that keep only part of the state (the params, every 50 steps; every
  100th kept for good) — a second Checkpointer with ``KeepEveryNSteps``;
* continuing from another run's checkpoint with only chosen keys (``--init-from``):
  ``load(abstract={"params": ...}, partial=True)`` ignores that run's optimizer state;
* a check that every process restored the same step: built into ``Checkpointer.load``
  (a no-op with one process; with several, all processes compare their step first).
"""

from __future__ import annotations

import argparse
import itertools
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import quire
from quire.policies import (
    BestN,
    EveryNSteps,
    KeepEveryNSteps,
    LatestN,
    OnPreemption,
    SpecificSteps,
)

SIZES = (16, 64, 64, 1)
BATCH = 64
LR = 0.05
MOMENTUM = 0.9
PARAM_SEED, DATA_SEED, VAL_SEED, TEACHER_SEED = 0, 1, 2, 3


# ----------------------------------------------------------------------------- model
# Random numbers come from numpy generators seeded by constants (and, for data, by the step
# number): deterministic, and nothing to compile but the two jitted functions below.
def init_params() -> dict[str, Any]:
    rng = np.random.default_rng(PARAM_SEED)
    params = {}
    for i, (n_in, n_out) in enumerate(itertools.pairwise(SIZES)):
        w = rng.standard_normal((n_in, n_out), np.float32) / np.float32(np.sqrt(n_in))
        params[f"layer{i}"] = {"w": jnp.asarray(w), "b": jnp.zeros((n_out,), jnp.float32)}
    return params


def init_state(params: dict[str, Any]) -> dict[str, Any]:
    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, p.dtype), params)
    return {"params": params, "opt": {"momentum": zeros}}


def mlp(params: dict[str, Any], x: jax.Array) -> jax.Array:
    n = len(params)
    for i in range(n):
        layer = params[f"layer{i}"]
        x = x @ layer["w"] + layer["b"]
        if i < n - 1:
            x = jnp.tanh(x)
    return x


TEACHER = np.random.default_rng(TEACHER_SEED).standard_normal((SIZES[0],)) / np.sqrt(SIZES[0])


def batch(seed: tuple[int, ...], n: int) -> tuple[np.ndarray, np.ndarray]:
    """Inputs and a fixed teacher function's targets, from ``seed`` alone."""
    x = np.random.default_rng(seed).standard_normal((n, SIZES[0]), np.float32)
    return x, np.sin(x @ TEACHER).astype(np.float32)[:, None]


def train_batch(step: int) -> tuple[np.ndarray, np.ndarray]:
    """The batch of step ``step``: a function of the step number only, so resuming is exact."""
    return batch((DATA_SEED, step), BATCH)


VAL = batch((VAL_SEED,), 512)


def loss_fn(params: dict[str, Any], x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((mlp(params, x) - y) ** 2)


@jax.jit
def train_step(
    state: dict[str, Any], x: jax.Array, y: jax.Array
) -> tuple[dict[str, Any], jax.Array]:
    """One SGD-with-momentum update."""
    loss, grads = jax.value_and_grad(loss_fn)(state["params"], x, y)
    mom = jax.tree.map(lambda m, g: MOMENTUM * m + g, state["opt"]["momentum"], grads)
    params = jax.tree.map(lambda p, m: p - LR * m, state["params"], mom)
    return {"params": params, "opt": {"momentum": mom}}, loss


val_loss = jax.jit(loss_fn)


# ----------------------------------------------------------------------------- the loop
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("root", help="where this run's checkpoints go")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--every", type=int, default=25, help="save the full state every N steps")
    ap.add_argument("--init-from", help="another run's train/ root: start from its params")
    ap.add_argument("--sleep", type=float, default=0.0, help="seconds per step (for demos)")
    args = ap.parse_args(argv)

    abstract = jax.eval_shape(lambda: init_state(init_params()))
    train = quire.Checkpointer(
        f"{args.root}/train",
        save_policy=EveryNSteps(args.every) | SpecificSteps([args.steps]) | OnPreemption(),
        keep=LatestN(2) | BestN(1, metric="val_loss", mode="min"),
        metadata={"sizes": list(SIZES), "lr": LR, "momentum": MOMENTUM, "batch": BATCH},
    )
    # Only the params, every 50 steps; the latest one and every 100th are kept.
    params_only = quire.Checkpointer(
        f"{args.root}/params",
        save_policy=EveryNSteps(50),
        keep=LatestN(1) | KeepEveryNSteps(100),
    )
    with train, params_only:
        start = train.latest_step()
        if start is not None:
            # Every process checks here that all of them restore the same step.
            state = train.load(start, abstract)
            print(f"resumed from step {start}", flush=True)
        elif args.init_from:
            # Another run's params only: its optimizer state (and anything else) is ignored.
            with quire.Checkpointer(args.init_from) as other:
                got = other.load(None, {"params": abstract["params"]}, partial=True)
                print(f"initialised params from {args.init_from} step {other.latest_step()}")
            state, start = init_state(got["params"]), 0
        else:
            state, start = init_state(init_params()), 0

        step = start
        while step < args.steps:
            state, loss = train_step(state, *train_batch(step))
            step += 1
            if args.sleep:
                time.sleep(args.sleep)
            params_only.save(step, {"params": state["params"]})  # saves when its policy says
            if step % 10 == 0:
                print(
                    f"step {step} loss {float(loss):.6f} committed {train.latest_step()}",
                    flush=True,
                )
            if train.should_save(step):
                metrics = {"val_loss": float(val_loss(state["params"], *VAL)), "loss": float(loss)}
                train.save(step, state, metrics=metrics)  # returns after the host copy
                if train.preempted:  # SIGTERM: the state of this step is being saved; stop
                    print(f"preempted: saved step {step}, exiting", flush=True)
                    break
    # Leaving the with-block waited for the last saves and deletions.
    print(
        f"done at step {step}; kept steps {train.steps()}; "
        f"best val_loss at step {train.best_step('val_loss', mode='min')}",
        flush=True,
    )


if __name__ == "__main__":
    main()
