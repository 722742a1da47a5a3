"""Issue 35: every ``quire`` command on every kind of checkpoint quire writes or reads.

The matrix is ``COMMANDS`` x ``KINDS``, both built here; one module fixture writes each kind
for real (``quire.save``, ``quire.save_checkpointables`` with a per-process unit, a
Checkpointer root with and without a local tier, a partial save, a safetensors file and an
HF directory written by safetensors itself, an Orbax step and root written by
orbax-checkpoint).  Each cell runs the command in this process (``main(argv)``) and checks
that it did its job (exit status, the units, arrays and bytes it names) or refused in one
line naming what to run instead (exit 2).  Two cells run the real ``quire`` program.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orbax.checkpoint as ocp
import pytest
from safetensors.numpy import load_file, save_file

import quire
from quire._cli.main import main as cli
from quire.checkpointables import UnitIO
from quire.policies import EveryNSteps

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

TREE = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.ones(5, np.int32), "step": 3}
OPT = {"mu": np.zeros(4)}  # one more unit: 32 B


class Position:
    """A data iterator's position, one per JAX process."""

    quire_per_process = True

    def __init__(self, pos: int) -> None:
        self.pos = pos

    def quire_save(self, io: UnitIO) -> Any:
        io.write("pos.bin", self.pos.to_bytes(8, "little"))
        return {"pos": self.pos}

    def quire_restore(self, io: UnitIO, record: Any) -> Position:
        self.pos = int.from_bytes(io.read("pos.bin"), "little")
        return self


def _tree() -> dict[str, Any]:
    return {"w": TREE["w"], "b": TREE["b"]}


def _write_tree(url: Path) -> None:
    quire.save(url, TREE)


def _write_units(url: Path) -> None:
    quire.save_checkpointables(url, {"state": TREE, "opt": OPT})


def _write_per_process(url: Path) -> None:
    quire.save_checkpointables(url, {"state": TREE, "it": Position(7)})


def _write_root(url: Path) -> None:
    with quire.Checkpointer(url) as c:
        c.save(1, TREE)
        c.save(2, TREE)


def _write_root_local(url: Path) -> None:
    local = quire.LocalTier(url.parent / "local", save_policy=EveryNSteps(1))
    with quire.Checkpointer(url, save_policy=EveryNSteps(2), local=local) as c:
        for step in (1, 2, 3):  # local: 1, 2, 3; persistent: 2
            c.save(step, TREE)


def _write_journal(url: Path) -> None:
    quire.partial.save(url, {"w": TREE["w"]})
    quire.partial.save(url, {"b": TREE["b"]})


def _write_safetensors(url: Path) -> None:
    save_file(_tree(), str(url), metadata={"format": "np"})


def _write_hf(url: Path) -> None:
    url.mkdir()
    shards = {"w": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    for name, fname in shards.items():
        save_file({name: TREE[name]}, str(url / fname))
    index = {"metadata": {"total_size": 68}, "weight_map": shards}
    (url / "model.safetensors.index.json").write_text(json.dumps(index))


def _write_orbax(url: Path) -> None:
    with ocp.CheckpointManager(url) as m:
        for step in (1, 2):
            m.save(step, args=ocp.args.StandardSave(_tree()))
        m.wait_until_finished()


@dataclass(frozen=True)
class Kind:
    name: str
    folder: str  # what the writer writes, under the module's directory
    write: Callable[[Path], None]
    at: str = ""  # the URL the commands get, relative to the folder ("" the folder itself)


KINDS = [
    Kind("tree", "tree", _write_tree),
    Kind("units", "units", _write_units),
    Kind("per_process", "per_process", _write_per_process),
    Kind("root", "root", _write_root),
    Kind("root_local", "root_local/persistent", _write_root_local),
    Kind("journal", "journal", _write_journal),
    Kind("safetensors", "model.safetensors", _write_safetensors),
    Kind("hf", "hf", _write_hf),
    Kind("orbax_step", "orbax", _write_orbax, at="2"),
    Kind("orbax_root", "orbax", _write_orbax),
]
COMMANDS = ["info", "verify", "ls", "gc", "cp", "diff", "export"]


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Every kind, written once for the module: kind name -> the URL commands get."""
    base = tmp_path_factory.mktemp("kinds")
    urls = {}
    for k in KINDS:
        folder = base / k.folder
        if not folder.exists():
            folder.parent.mkdir(parents=True, exist_ok=True)
            k.write(folder)
        urls[k.name] = str(folder / k.at) if k.at else str(folder)
    return urls


def argv(command: str, url: str, dst: str, kind: str) -> list[str]:
    """The command line of one cell; ``dst`` is a fresh URL where one is written."""
    if command in ("cp", "export"):
        return [command, url, dst]
    if command == "diff":
        return ["diff", url, url]
    if command == "gc":
        return ["gc", url, "--grace", "0"]  # a dry run: the fixtures are shared
    if command == "ls" and kind == "root_local":
        return ["ls", url, "--local", str(Path(url).parent / "local")]
    return [command, url]


@dataclass(frozen=True)
class Expect:
    """A cell's outcome: the exit status, lines (regular expressions, ``{url}`` and
    ``{dst}`` filled in) that stdout must hold, or the one line stderr must be."""

    rc: int = 0
    out: tuple[str, ...] = ()
    err: str = ""


def refused(*patterns: str) -> Expect:
    return Expect(2, err=".*".join(patterns))


ROOT = refused(r"{url} is a quire\.Checkpointer root \(committed steps 1, 2\), not one ",
               r"run quire {cmd} {url}/step_00000002", r"quire ls {url} lists its steps")  # fmt: skip
ROOT_LOCAL = refused(r"Checkpointer root \(committed steps 2\)",
                     r"run quire {cmd} {url}/step_00000002")  # fmt: skip
PARTIAL = refused(r"{url} is a partial save, not finalized \(journal at version 2\)",
                  r"quire\.partial\.finalize", r"quire info and quire verify read it")  # fmt: skip
ORBAX_ROOT = refused(r"{url}: this is an Orbax CheckpointManager directory holding steps 1, 2",
                     r"open one step, e\.g\. {url}/2")  # fmt: skip
NOT_QUIRE = refused(r"{url} is an? \w+ checkpoint, not a quire one",
                    r"quire info {url} describes it, quire cp {url} DST converts it")  # fmt: skip
NO_CHECKSUMS = refused(r"{url} is an? \w+ checkpoint, which stores no checksums",
                       r"quire cp {url} DST converts it")  # fmt: skip
CLEAN = Expect(0, (r"^{url}: no garbage to remove$",))

TREE_LINES = (r"^  w: float32\[3, 4\] 48 B  \(1 chunk", r"^  b: int32\[5\] 20 B", r"^  step: int$")
SOURCE_LINES = (r"^  2 arrays, 68 B, 0 inline leaves$", r"^  w: float32\[3, 4\] 48 B$",
                r"^  b: int32\[5\] 20 B$")  # fmt: skip

EXPECT: dict[tuple[str, str], Expect] = {
    # info: what any checkpoint holds, every unit
    ("info", "tree"): Expect(
        0,
        (r"^checkpoint {url}$", r"^  2 arrays, 2 chunks, 68 B, 1 inline", r"^tree:$", *TREE_LINES),
    ),
    ("info", "units"): Expect(
        0,
        (
            r"^  3 arrays, 3 chunks, 100 B, 1 inline",
            r"^  units: state \(pytree\), opt \(pytree\)$",
            r"^unit state:$",
            *TREE_LINES,
            r"^unit opt:$",
            r"^  mu: float64\[4\] 32 B",
        ),
    ),
    ("info", "per_process"): Expect(
        0,
        (
            r"^  2 arrays, 2 chunks, 68 B, 1 inline",
            r"^  units: state \(pytree\), it \(self, per process: 1\)$",
            r"^unit state:$",
            *TREE_LINES,
        ),
    ),
    ("info", "root"): ROOT,
    ("info", "root_local"): ROOT_LOCAL,
    ("info", "journal"): Expect(
        0,
        (
            r"^partial save {url} \(not finalized: journal at version 2\)$",
            r"^  2 arrays, 2 chunks, 68 B, 0 inline",
            *TREE_LINES[:2],
        ),
    ),
    ("info", "safetensors"): Expect(
        0, (r"^safetensors checkpoint {url}$", *SOURCE_LINES, r'"format": "np"')
    ),
    ("info", "hf"): Expect(
        0, (r"^safetensors checkpoint {url}$", *SOURCE_LINES, r"model-00002-of-00002\.safetensors")
    ),
    ("info", "orbax_step"): Expect(0, (r"^orbax checkpoint {url}$", *SOURCE_LINES)),
    ("info", "orbax_root"): ORBAX_ROOT,
    # verify: every chunk of every unit against its checksum
    ("verify", "tree"): Expect(0, (r"^{url}: OK, 2 arrays, 2 chunks, 68 B verified$",)),
    ("verify", "units"): Expect(0, (r"^{url}: OK, 3 arrays, 3 chunks, 100 B verified$",)),
    ("verify", "per_process"): Expect(0, (r"^{url}: OK, 2 arrays, 2 chunks, 68 B verified$",)),
    ("verify", "root"): ROOT,
    ("verify", "root_local"): ROOT_LOCAL,
    ("verify", "journal"): Expect(
        0,
        (
            r"^{url} \(partial save, journal at version 2\): OK, "
            r"2 arrays, 2 chunks, 68 B verified$",
        ),
    ),
    ("verify", "safetensors"): NO_CHECKSUMS,
    ("verify", "hf"): NO_CHECKSUMS,
    ("verify", "orbax_step"): NO_CHECKSUMS,
    ("verify", "orbax_root"): ORBAX_ROOT,
    # ls: the checkpoints under a prefix, sized by every unit; a root's steps
    ("ls", "tree"): Expect(0, (r"^\.\s+committed\s+68 B\s", r"^1 checkpoint\(s\): 1 committed$")),
    ("ls", "units"): Expect(0, (r"^\.\s+committed\s+100 B\s",)),
    ("ls", "per_process"): Expect(0, (r"^\.\s+committed\s+68 B\s",)),
    ("ls", "root"): Expect(
        0,
        (
            r"^{url}: a quire\.Checkpointer root",
            r"^2 step\(s\): 2 committed; latest committed step 2$",
        ),
    ),
    ("ls", "root_local"): Expect(
        0,
        (
            r"^{url}: a quire\.Checkpointer root with a local tier",
            r"^1\s+committed\s+local:0\s+-",
            r"^2\s+committed\s+local:0 persistent\s",
            r"^3\s+committed\s+local:0\s+-",
        ),
    ),
    ("ls", "journal"): Expect(0, (r"^\.\s+partial\s", r"^1 checkpoint\(s\): 1 partial$")),
    ("ls", "safetensors"): NOT_QUIRE,
    ("ls", "hf"): NOT_QUIRE,
    ("ls", "orbax_step"): NOT_QUIRE,
    ("ls", "orbax_root"): ORBAX_ROOT,
    # gc: nothing to collect in whole checkpoints; other formats hold no quire garbage
    **{("gc", k): CLEAN for k in ("tree", "units", "per_process", "root", "journal")},
    ("gc", "root_local"): CLEAN,
    ("gc", "safetensors"): NOT_QUIRE,
    ("gc", "hf"): NOT_QUIRE,
    ("gc", "orbax_step"): NOT_QUIRE,
    ("gc", "orbax_root"): ORBAX_ROOT,
    # cp: copied object by object, or converted; counts of every unit
    ("cp", "tree"): Expect(0, (r"^copied {url} -> {dst}: 2 arrays, 2 chunks, 68 B verified",)),
    ("cp", "units"): Expect(0, (r"^copied {url} -> {dst}: 3 arrays, 3 chunks, 100 B verified",)),
    ("cp", "per_process"): Expect(
        0, (r"^copied {url} -> {dst}: 2 arrays, 2 chunks, 68 B verified",)
    ),
    ("cp", "root"): ROOT,
    ("cp", "root_local"): ROOT_LOCAL,
    ("cp", "journal"): PARTIAL,
    **{
        ("cp", k): Expect(
            0, (rf"^converted {f} {{url}} -> {{dst}}: 2 arrays, 2 chunks, 68 B verified",)
        )
        for k, f in (("safetensors", "safetensors"), ("hf", "safetensors"), ("orbax_step", "orbax"))
    },
    ("cp", "orbax_root"): ORBAX_ROOT,
    # diff: a checkpoint against itself
    ("diff", "tree"): Expect(0, (r"^same structure, shapes, dtypes and metadata \(3 leaves\)$",)),
    ("diff", "units"): Expect(0, (r"^same structure, shapes, dtypes and metadata \(4 leaves\)$",)),
    ("diff", "per_process"): Expect(
        0,
        (
            r"^same structure, shapes, dtypes and metadata \(3 leaves\)$",
            r"^# not compared \(not arrays\): unit it \(self\)$",
        ),
    ),
    ("diff", "root"): ROOT,
    ("diff", "root_local"): ROOT_LOCAL,
    ("diff", "journal"): PARTIAL,
    **{
        ("diff", k): Expect(0, (r"^same structure, shapes, dtypes and metadata \(2 leaves\)$",))
        for k in ("safetensors", "hf", "orbax_step")
    },
    ("diff", "orbax_root"): ORBAX_ROOT,
    # export: safetensors out of anything that has arrays
    **{
        ("export", k): Expect(0, (rf"^exported {f} {{url}} -> {{dst}}: 1 file\(s\)",))
        for k, f in (
            ("tree", "quire"),
            ("units", "quire"),
            ("per_process", "quire"),
            ("safetensors", "safetensors"),
            ("hf", "safetensors"),
            ("orbax_step", "orbax"),
        )
    },
    ("export", "root"): ROOT,
    ("export", "root_local"): ROOT_LOCAL,
    ("export", "journal"): PARTIAL,
    ("export", "orbax_root"): ORBAX_ROOT,
}

#: What ``quire export`` writes of each kind (the tensors' names).
EXPORTED = {
    "tree": ["b", "step", "w"],
    "units": ["opt.mu", "state.b", "state.step", "state.w"],
    "per_process": ["state.b", "state.step", "state.w"],
    "safetensors": ["b", "w"],
    "hf": ["b", "w"],
    "orbax_step": ["b", "w"],
}


def test_the_matrix_is_whole() -> None:
    assert set(EXPECT) == {(c, k.name) for c in COMMANDS for k in KINDS}


@pytest.mark.parametrize("kind", [k.name for k in KINDS])
@pytest.mark.parametrize("command", COMMANDS)
def test_command_on_kind(
    command: str,
    kind: str,
    written: dict[str, str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    url, dst = written[kind], str(tmp_path / "dst")
    want = EXPECT[(command, kind)]
    rc = cli(argv(command, url, dst, kind))
    out, err = capsys.readouterr()

    def fill(pattern: str) -> str:
        return (
            pattern.replace("{url}", re.escape(url))
            .replace("{dst}", re.escape(dst))
            .replace("{cmd}", command)
        )

    assert rc == want.rc, (out, err)
    for pattern in want.out:
        assert re.search(fill(pattern), out, re.M), (pattern, out)
    if want.rc == 2:
        assert not out and len(err.strip().splitlines()) == 1, (out, err)  # one line
        assert re.match(rf"quire {command}: .*{fill(want.err)}", err), err
        assert not Path(dst).exists()
    else:
        assert not err, err
    if command == "cp" and rc == 0:  # the copy is a whole, checked quire checkpoint
        copied = quire.verify(dst)
        want_counts = (3, 100) if kind == "units" else (2, 68)
        assert copied.ok and (copied.arrays, copied.nbytes) == want_counts
        if kind in ("tree", "units", "per_process"):
            assert copied.units == quire.verify(url).units
    if command == "export" and rc == 0:
        assert sorted(load_file(str(Path(dst) / "model.safetensors"))) == EXPORTED[kind]


def test_plugins_lists_every_format_the_kinds_need(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["plugins"]) == 0
    out = capsys.readouterr().out
    sources = out.split("quire.sources:")[1].split("\n\n")[0]
    for fmt in ("quire", "safetensors", "orbax"):
        assert re.search(rf"^  {fmt}\s.*\sok$", sources, re.M), sources


def test_verify_names_the_unit_of_a_damaged_leaf(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 35: after a flipped byte in a unit's leaf, ``VerifyProblem.unit`` is the unit,
    ``quire verify`` counts the unit's chunks and prints the path with its unit."""
    url = tmp_path / "u1"
    quire.save_checkpointables(url, {"state": {"w": np.arange(1000.0)}})
    (pack,) = (p for p in (url / "d").rglob("%packs/*") if not p.name.endswith(".json"))
    data = bytearray(pack.read_bytes())
    data[10] ^= 0xFF
    pack.write_bytes(bytes(data))
    report = quire.verify(url)
    assert (report.arrays, report.chunks, report.nbytes) == (1, 1, 8000)
    ((problem,),) = [report.problems]
    assert (problem.unit, problem.path) == ("state", "w")
    assert cli(["verify", str(url)]) == 1
    out, err = capsys.readouterr()
    assert re.match(r"BAD  state/w: \S+: ", out), out
    assert f"{url}: DAMAGED, 1 of 1 chunks failed (1 arrays, 1 chunks, 7.8 KiB)" in err


@pytest.mark.parametrize(
    ("kind", "command", "says"),
    [("units", "info", "unit state:"), ("journal", "verify", "OK, 2 arrays, 2 chunks, 68 B")],
)
def test_the_real_program(written: dict[str, str], kind: str, command: str, says: str) -> None:
    """Two cells through the installed ``quire`` program, in a process of its own."""
    exe = Path(sys.executable).with_name("quire")
    p = subprocess.run([str(exe), command, written[kind]], capture_output=True, text=True,
                       timeout=120, env={**os.environ, "COLUMNS": "200"})  # fmt: skip
    assert p.returncode == 0 and says in p.stdout, p.stdout + p.stderr
