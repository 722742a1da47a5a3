"""Issue 35: the command line starts at once.  ``quire --help``, ``quire ls`` and
``quire info`` on a local checkpoint import neither JAX nor zarr (nor fsspec, nor numpy:
what keeps them under a third of ``import jax``); ``import quire`` imports nothing heavy
either and still offers every public name; the tables that stand in for JAX and numpy on
those paths match them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import quire

HEAVY = ("jax", "zarr", "fsspec", "numpy")

PROBE = """
import json, sys
from quire._cli.main import main
try:
    code = main(sys.argv[1:])
except SystemExit as e:
    code = e.code
print(json.dumps([code, sorted(m for m in {heavy} if m in sys.modules)]), file=sys.stderr)
"""


def run_cli(*argv: str) -> tuple[int, list[str], str]:
    """``quire ARGV`` in a fresh process: its exit status, the heavy modules it imported,
    its output."""
    code = PROBE.format(heavy=repr(HEAVY))
    p = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                       timeout=120)  # fmt: skip
    rc, loaded = json.loads(p.stderr.strip().splitlines()[-1])
    return rc, loaded, p.stdout


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Checkpointer root of steps holding every built-in kind of leaf, and a checkpoint of
    several units."""
    base = tmp_path_factory.mktemp("startup")
    tree = {
        "params": {"w": jnp.ones((4, 8), jnp.bfloat16), "b": np.arange(8, dtype=np.float32)},
        "rng": jax.random.key(0),
        "step": 3,
        "lr": 0.5,
        "name": "run",
        "blob": b"\x00\x01",
        "nothing": None,
    }
    with quire.Checkpointer(base / "run") as c:
        c.save(1, tree)
        c.save(2, tree)
    quire.save_checkpointables(base / "units", {"state": tree, "extra": {"mu": np.zeros(3)}})
    return base


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--help"], "usage: quire"),
        (["ls", "{base}/run"], "2 step(s): 2 committed"),
        (["ls", "{base}"], "3 checkpoint(s): 3 committed"),
        (["info", "{base}/run/step_00000002"], "rng: prng_key[] 8 B"),
        (["info", "{base}/units"], "unit extra:"),
    ],
    ids=["help", "ls-root", "ls-prefix", "info", "info-units"],
)
def test_light_commands_import_no_heavy_module(
    checkpoints: Path, argv: list[str], says: str
) -> None:
    rc, loaded, out = run_cli(*(a.format(base=checkpoints) for a in argv))
    assert rc == 0 and says in out, out
    assert loaded == [], f"quire {' '.join(argv)} imported {loaded}"


def test_import_quire_is_light_and_whole() -> None:
    code = (
        "import sys, quire\n"
        "light = sorted(m for m in ('jax', 'zarr', 'fsspec', 'numpy') if m in sys.modules)\n"
        "from quire import *\n"
        "from quire.metadata import LeafMetadata\n"
        'print(light, callable(quire.metadata), LeafMetadata.__module__ == "quire.metadata")\n'
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.stdout.split() == ["[]", "True", "True"], p.stdout + p.stderr
    assert set(quire.__all__) == set(quire._WHERE) | quire._SUBMODULES  # type: ignore[attr-defined]
    assert set(quire.__all__) <= set(dir(quire))
    for name in quire.__all__:
        assert getattr(quire, name) is not None
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        quire.nope  # type: ignore[attr-defined]  # noqa: B018


def test_the_tables_standing_in_for_jax_and_numpy_match_them() -> None:
    import jax.extend.random as jr

    from quire._format.bounds import PRNG_IMPLS
    from quire._format.dtypes import ITEMSIZES, supported

    impls = (jr.threefry_prng_impl, jr.rbg_prng_impl, jr.unsafe_rbg_prng_impl)
    assert {str(i.name): tuple(i.key_shape) for i in impls} == PRNG_IMPLS
    assert set(supported()) == set(ITEMSIZES)
    for name, size in ITEMSIZES.items():
        assert supported()[name].itemsize == size, name
        want = getattr(ml_dtypes, name, None) or np.dtype(name)
        assert supported()[name] == np.dtype(want), name
