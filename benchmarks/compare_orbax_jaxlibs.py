"""The JAX-library cases of issue 31, run against quire and against Orbax, as a table.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
        .venv/bin/python benchmarks/compare_orbax_jaxlibs.py [--json]

Each case does what a user of Flax NNX / Optax / Equinox / Grain would do, once with quire
(``quire.save`` / ``quire.load``; the Grain case ``save_checkpointables_async``) and once with
Orbax (``ocp.StandardCheckpointer``, the checkpointer Flax's docs use; the Grain case a
``CheckpointManager`` with Grain's own handler), orbax-checkpoint as installed (0.12.8 when
this was written), and reports what came
back: "ok" with what was checked, or the exception (type and first line).  Nothing is
hard-coded: every cell is the outcome of running the case here.  The markdown table goes to
stdout (``--json``: one object per case instead).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import traceback
import warnings
from collections.abc import Callable
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
warnings.filterwarnings("ignore")

import equinox as eqx  # noqa: E402
import grain  # noqa: E402
import grain.checkpoint  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import quire  # noqa: E402

ROOT = tempfile.mkdtemp(prefix="compare-orbax-jaxlibs-")


# ------------------------------------------------------------------------ the two libraries
class Quire:
    name = "quire"

    def save_units_async(self, path: str, units: dict[str, Any]) -> Callable[[], None]:
        return quire.save_checkpointables_async(path, units).result

    def load_units(self, path: str, targets: dict[str, Any]) -> dict[str, Any]:
        return quire.load_checkpointables(path, targets)

    def save(self, path: str, tree: Any) -> None:
        quire.save(path, tree)

    def load(self, path: str, target: Any = None) -> Any:
        return quire.load(path, target)


class Orbax:
    name = "Orbax"

    def __init__(self) -> None:
        self.ckptr = ocp.StandardCheckpointer()

    def save(self, path: str, tree: Any) -> None:
        self.ckptr.save(path, tree)
        self.ckptr.wait_until_finished()

    def load(self, path: str, target: Any = None) -> Any:
        return self.ckptr.restore(path, target) if target is not None else self.ckptr.restore(path)

    # A model state and a Grain iterator in one checkpoint: the CheckpointManager with
    # Grain's own handler, as Grain's docs show; the manager saves asynchronously.
    def save_units_async(self, path: str, units: dict[str, Any]) -> Callable[[], None]:
        mngr = ocp.CheckpointManager(path)
        mngr.save(
            0,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(units["state"]),
                data=grain.checkpoint.CheckpointSave(units["data"]),
            ),
        )

        def wait() -> None:
            mngr.wait_until_finished()
            mngr.close()

        return wait

    def load_units(self, path: str, targets: dict[str, Any]) -> dict[str, Any]:
        with ocp.CheckpointManager(path) as mngr:
            got = mngr.restore(
                0,
                args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(),
                    data=grain.checkpoint.CheckpointRestore(targets["data"]),
                ),
            )
        return {"state": got["state"], "data": targets["data"]}


# ------------------------------------------------------------------------------- helpers
def same(a: Any, b: Any) -> bool:
    """Bit-exact equality of two trees' leaves (typed keys compared by impl and data)."""
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    if len(la) != len(lb):
        return False
    for x, y in zip(la, lb):
        if hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            if not hasattr(y, "dtype") or not jax.dtypes.issubdtype(y.dtype, jax.dtypes.prng_key):
                return False
            if jax.random.key_impl(x) != jax.random.key_impl(y):
                return False
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        xa, ya = np.asarray(x), np.asarray(y)
        if xa.dtype != ya.dtype or xa.shape != ya.shape or not np.array_equal(xa, ya):
            return False
    return True


class Model(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, sharded: bool = False) -> None:
        init: Any = nnx.initializers.lecun_normal()
        if sharded:
            init = nnx.with_partitioning(init, (None, "model"))
        self.lin = nnx.Linear(4, 8, kernel_init=init, rngs=rngs)
        self.bn = nnx.BatchNorm(8, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.drop(self.bn(self.lin(x)))


@nnx.jit
def train_step(model: Model, opt: nnx.Optimizer, x: jax.Array) -> None:
    grads = nnx.grad(lambda m: jnp.mean(m(x) ** 2))(model)
    opt.update(model, grads)


# --------------------------------------------------------------------------------- cases
def nnx_state(lib: Any, path: str) -> str:
    model = Model(nnx.Rngs(0, dropout=1))
    lib.save(path, nnx.state(model))
    abstract = nnx.state(nnx.eval_shape(lambda: Model(nnx.Rngs(0, dropout=1))))
    got = lib.load(path, abstract)
    fresh = Model(nnx.Rngs(3, dropout=4))
    nnx.update(fresh, got)
    x = jnp.ones((2, 4))
    ok = same(nnx.state(model), nnx.state(fresh)) and np.array_equal(model(x), fresh(x))
    return "ok, bit-exact (RNG state included)" if ok else "loaded, values differ"


def nnx_optimizer(lib: Any, path: str) -> str:
    def make() -> tuple[Model, nnx.Optimizer]:
        m = Model(nnx.Rngs(0, dropout=1))
        return m, nnx.Optimizer(m, optax.adamw(1e-2), wrt=nnx.Param)

    x = jnp.arange(8.0).reshape(2, 4)
    model, opt = make()
    train_step(model, opt, x)
    lib.save(path, {"model": nnx.state(model), "opt": nnx.state(opt)})
    am, ao = nnx.eval_shape(make)
    got = lib.load(path, {"model": nnx.state(am), "opt": nnx.state(ao)})
    m2, o2 = make()
    nnx.update(m2, got["model"])
    nnx.update(o2, got["opt"])
    train_step(model, opt, x)
    train_step(m2, o2, x)
    ok = same(nnx.state(opt), nnx.state(o2)) and same(nnx.state(model), nnx.state(m2))
    return "ok, next step bit-exact" if ok else "loaded, next step differs"


def _explicit_state() -> tuple[Any, dict[str, Any]]:
    mesh = jax.make_mesh((4, 2), ("data", "model"))  # Explicit axes by default
    sh = {"w": NamedSharding(mesh, P("data", "model")), "b": NamedSharding(mesh, P("model"))}
    state = jax.device_put({"w": jnp.arange(32.0).reshape(8, 4), "b": jnp.arange(4.0)}, sh)
    return mesh, state


def abstract_mesh_target(lib: Any, path: str) -> str:
    mesh, state = _explicit_state()
    lib.save(path, state)
    abstract = jax.eval_shape(lambda: state)  # NamedSharding(AbstractMesh)
    outcomes = []
    for where in ("no mesh in context", "inside jax.set_mesh"):
        try:
            if where == "no mesh in context":
                got = lib.load(path, abstract)
            else:
                with jax.set_mesh(mesh):
                    got = lib.load(path, abstract)
            ok = same(state, got) and got["w"].sharding.spec == P("data", "model")
            outcomes.append(f"{where}: {'ok' if ok else 'wrong values'}")
        except Exception as e:
            outcomes.append(f"{where}: {_err(e)}")
    return "; ".join(outcomes)


def explicit_axis_types(lib: Any, path: str) -> str:
    mesh, state = _explicit_state()
    lib.save(path, state)
    got = lib.load(path)
    types = tuple(t.name for t in got["w"].sharding.mesh.axis_types)
    try:
        with jax.set_mesh(mesh):
            jax.jit(lambda w, b: w * b)(got["w"], got["b"])
        works = "a jitted op under jax.set_mesh works"
    except Exception as e:
        works = f"a jitted op under jax.set_mesh fails ({_err(e)})"
    return f"target-less load: axis types {types}; {works}"


def _batches() -> Any:
    ds = grain.MapDataset.range(10_000).map(lambda i: i % 97).batch(8)
    return iter(ds.to_iter_dataset(grain.ReadOptions(num_threads=2, prefetch_buffer_size=4)))


def grain_iterator_async(lib: Any, path: str) -> str:
    it = _batches()
    for _ in range(3):
        next(it)
    want = next(_skip(_batches(), 3))  # the batch after the call
    wait = lib.save_units_async(path, {"state": {"w": jnp.ones(3)}, "data": it})
    for _ in range(50):  # the loop moves on while the save runs
        next(it)
    wait()
    got = lib.load_units(path, {"state": None, "data": _batches()})
    nxt = next(got["data"])
    if np.array_equal(nxt, want):
        return "ok: resumes at the batch after the call (3 drawn, 50 more during the save)"
    return f"resumes at the wrong batch: first value {int(nxt.flat[0])}, wanted {int(want.flat[0])}"


def _skip(it: Any, n: int) -> Any:
    for _ in range(n):
        next(it)
    return it


def rbg_into_threefry(lib: Any, path: str) -> str:
    key = jax.random.key(3, impl="rbg")
    lib.save(path, {"k": key})
    try:
        got = lib.load(path, {"k": jax.eval_shape(lambda: jax.random.key(0))})["k"]
    except quire.TreeMismatchError as e:
        return f"TreeMismatchError: {e.mismatched[0][:150]}"
    is_key = jax.dtypes.issubdtype(got.dtype, jax.dtypes.prng_key)
    impl = jax.random.key_impl(got) if is_key else got.dtype
    return f"no error: came back as {impl} (threefry2x32 asked)"


def optax_without_target(lib: Any, path: str) -> str:
    params = {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.zeros(3)}
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))
    state = tx.init(params)
    _, state = tx.update(jax.tree.map(jnp.ones_like, params), state, params)
    lib.save(path, {"opt_state": state})
    raw = lib.load(path)["opt_state"]
    adam = raw[1][0] if isinstance(raw, list | tuple) else raw["1"]["0"]
    kind = type(adam).__name__
    ok = same(jax.tree.leaves(state[1][0]), jax.tree.leaves(adam))
    with_target = lib.load(path, {"opt_state": jax.eval_shape(tx.init, params)})["opt_state"]
    cls = type(with_target[1][0]).__name__
    return (
        f"ok{'' if ok else ' (values differ)'}: without a target the adam state is a "
        f"{kind} of {sorted(adam) if isinstance(adam, dict) else 'fields'}; with one, {cls}"
    )


def equinox_filter_combine(lib: Any, path: str) -> str:
    model = eqx.nn.MLP(3, 2, 8, 1, key=jax.random.key(0))
    try:
        lib.save(path + "-whole", model)
        whole = "saving the whole module: no error"
    except Exception as e:
        msg = str(e)
        fix = "eqx.filter" in msg and "eqx.combine" in msg
        where = " naming 'activation'" if "activation" in msg else ""
        whole = (
            f"saving the whole module: {type(e).__name__}{where}, "
            f"{'with' if fix else 'without'} the eqx.filter / eqx.combine fix"
        )
    lib.save(path, eqx.filter(model, eqx.is_array))
    params, static = eqx.partition(eqx.nn.MLP(3, 2, 8, 1, key=jax.random.key(1)), eqx.is_array)
    restored = eqx.combine(lib.load(path, params), static)
    x = jnp.ones(3)
    ok = np.array_equal(model(x), restored(x))
    return f"{whole}; filter/combine: {'ok, bit-exact' if ok else 'values differ'}"


def str_uint4_numpy_scalars(lib: Any, path: str) -> str:
    """Each leaf in its own checkpoint, so one refused leaf does not hide the others."""
    leaves = {
        "str": "run-7",
        "uint4": jnp.arange(8, dtype=jnp.uint4),
        "np.float32": np.float32(1.5),
        "np.int8": np.int8(-3),
    }
    out = []
    for name, v in leaves.items():
        try:
            lib.save(f"{path}-{name}", {"x": v})
            g = lib.load(f"{path}-{name}")["x"]
        except Exception as e:
            out.append(f"{name}: {_err(e)}")
            continue
        if isinstance(v, str | np.generic):
            kept = type(g) is type(v) and g == v
            got = f"{type(g).__name__} {np.asarray(g).dtype}" if not isinstance(g, str) else "str"
        else:
            kept = np.asarray(g).dtype == v.dtype and np.array_equal(np.asarray(g), v)
            got = str(np.asarray(g).dtype)
        out.append(f"{name}: {'kept' if kept else f'came back as {got}'}")
    return "; ".join(out)


def mismatched_shapes(lib: Any, path: str) -> str:
    """Two leaves with the wrong shape: does the error report both, and by key path?"""
    lib.save(path, {"a": jnp.zeros(3), "b": jnp.zeros(4), "c": jnp.zeros(5)})
    target = {
        "a": jax.ShapeDtypeStruct((7,), jnp.float32),
        "b": jax.ShapeDtypeStruct((8,), jnp.float32),
        "c": jax.ShapeDtypeStruct((5,), jnp.float32),
    }
    try:
        lib.load(path, target)
    except Exception as e:
        msg = str(e)
        shapes = sum(s in msg for s in ("(7,)", "(8,)"))
        keys = [k for k in ("'a'", "'b'") if k in msg or f"('{k[1]}',)" in msg]
        return (
            f"{type(e).__name__}: {shapes} of 2 bad shapes reported, key paths named: "
            f"{', '.join(keys) or 'none'}"
        )
    return "no error"


def mismatched_structure(lib: Any, path: str) -> str:
    """A key missing from the checkpoint and one missing from the target: the first line of
    what each library says."""
    lib.save(path, {"a": jnp.zeros(3), "d": jnp.zeros(6)})
    target = {
        "a": jax.ShapeDtypeStruct((3,), jnp.float32),
        "e": jax.ShapeDtypeStruct((6,), jnp.float32),
    }
    try:
        lib.load(path, target)
    except Exception as e:
        lines = [ln.strip() for ln in str(e).splitlines() if "missing" in ln or "not found" in ln]
        return f"{type(e).__name__}: " + " / ".join(lines or [_err(e)])[:300]
    return "no error"


CASES: list[tuple[str, Callable[[Any, str], str]]] = [
    ("NNX state round trip into nnx.eval_shape", nnx_state),
    ("nnx.Optimizer state, resume", nnx_optimizer),
    ("target on an abstract mesh (jax.eval_shape of an Explicit-mesh state)", abstract_mesh_target),
    ("Explicit axis types, load without a target", explicit_axis_types),
    ("rbg key saved, threefry2x32 key asked", rbg_into_threefry),
    ("optax state without / with a target", optax_without_target),
    ("Equinox MLP: whole module, then filter/combine", equinox_filter_combine),
    ("str / uint4 / numpy scalars, no target", str_uint4_numpy_scalars),
    ("mismatch report: 2 leaves of the wrong shape", mismatched_shapes),
    ("mismatch report: 1 key missing from each side", mismatched_structure),
    (
        "Grain DatasetIterator beside the state, async save, 50 batches drawn during it",
        grain_iterator_async,
    ),
]


def _err(e: BaseException) -> str:
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {first[:160]}"


def run(lib: Any, name: str, fn: Callable[[Any, str], str]) -> str:
    path = os.path.join(ROOT, lib.name, fn.__name__)
    try:
        return fn(lib, path)
    except Exception as e:
        if "-v" in sys.argv:
            traceback.print_exc()
        return _err(e)


def main() -> None:
    libs = [Quire(), Orbax()]
    rows = []
    try:
        for name, fn in CASES:
            rows.append({"case": name, **{lib.name: run(lib, name, fn) for lib in libs}})
    finally:
        shutil.rmtree(ROOT, ignore_errors=True)
    if "--json" in sys.argv:
        print(json.dumps(rows, indent=2))
        return
    print(f"jax {jax.__version__}, orbax-checkpoint {ocp.__version__}, quire {quire.__version__}\n")
    print("| case | quire | Orbax |")
    print("|---|---|---|")
    for r in rows:
        cells = [r["case"], r["quire"], r["Orbax"]]
        print("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")


if __name__ == "__main__":
    main()
