"""The command line (issue 14): version, storage options, ls/info/gc on any prefix, diff, exit
codes, progress bars in a real terminal.  The library's progress reports are in
``test_progress.py``, install hints in ``test_plugins.py``."""

from __future__ import annotations

import json
import os
import re
import select
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import numpy as np
import pytest

import quire
from quire._cli.main import main as cli

REPO = Path(__file__).resolve().parents[2]
QUIRE = [sys.executable, "-m", "quire._cli.main"]


def _tree(scale: float = 1.0) -> dict:
    return {
        "w": np.full((64, 32), scale, np.float32),
        "b": np.arange(8, dtype=np.int32),
        "step": 3,
        "rng": jax.random.key(0),
    }


# ----------------------------------------------------------------------------- basics
def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"quire {quire.__version__}"


def test_broken_pipe_is_quiet(tmp_path: Path) -> None:
    url = tmp_path / "big"
    quire.save(url, {f"k{i:05d}": i for i in range(4000)})  # a record larger than a pipe
    p = subprocess.run(
        f"{' '.join(QUIRE)} info --json {url} | head -n 2",
        shell=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.stdout.splitlines()[0] == "{"
    assert "Traceback" not in p.stderr and "BrokenPipe" not in p.stderr, p.stderr


def test_storage_options_forms(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from quire._cli.common import storage_options
    from quire._cli.main import parser

    args = parser().parse_args(
        [
            "info",
            "x",
            "-o",
            "anon=true",
            "-o",
            "endpoint_url=http://h:1",
            "--storage-options",
            '{"retries": 3, "anon": false}',
        ]
    )
    assert storage_options(args) == {"retries": 3, "anon": True, "endpoint_url": "http://h:1"}
    for cmd in ("info", "verify", "ls", "gc", "cp", "diff", "export"):
        extra = ["y"] if cmd in ("cp", "diff", "export") else []
        assert cli([cmd, str(tmp_path), *extra, "-o", "novalue"]) == 2
        assert "KEY=VALUE" in capsys.readouterr().err
    assert cli(["info", str(tmp_path), "--storage-options", "[1]"]) == 2
    assert "JSON object" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["info", "M"],
        ["verify", "M"],
        ["ls", "M"],
        ["gc", "M"],
        ["gc", "M", "--yes"],
        ["cp", "M", "D"],
        ["diff", "M", "M"],
        ["export", "M", "D"],
    ],
    ids=lambda a: " ".join(a),
)
@pytest.mark.parametrize("at_url", ["nothing", "a regular file"])
def test_every_command_exits_2_when_nothing_is_at_the_url(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], at_url: str
) -> None:
    missing = str(tmp_path / "missing")
    if at_url == "a regular file":  # not a checkpoint either (exit 1 would say "damaged")
        (tmp_path / "missing").write_text("notes")
    args = [missing if a == "M" else str(tmp_path / "dst") if a == "D" else a for a in argv]
    assert cli(args) == 2
    assert missing in capsys.readouterr().err
    assert not (tmp_path / "dst").exists()


def test_a_regular_file_is_no_checkpoint(tmp_path: Path) -> None:
    f = tmp_path / "notes.txt"
    f.write_text("notes")
    for fn in (quire.load, quire.verify, quire.metadata, quire.partial.load):
        with pytest.raises(quire.CheckpointNotFoundError, match=r"notes\.txt"):
            fn(str(f))


# ----------------------------------------------------------------------------- ls / info
def test_ls_lists_any_checkpoint_and_marks_checkpointer_steps(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    quire.save(tmp_path / "ckpt" / "step_100", _tree())
    with quire.Checkpointer(tmp_path / "ckpt" / "run") as c:
        c.save(7, _tree())
    assert cli(["ls", str(tmp_path / "ckpt")]) == 0
    out = capsys.readouterr().out
    rows = {ln.split()[0]: ln for ln in out.splitlines()[2:] if ln.strip()}
    assert "committed" in rows["step_100"] and "Checkpointer" not in rows["step_100"]
    assert "Checkpointer run (step 7)" in rows["run/step_00000007"]
    assert cli(["ls", str(tmp_path / "ckpt"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {(r["path"], r["checkpointer_root"]) for r in doc} == {
        ("step_100", None),
        ("run/step_00000007", "run"),
    }

    assert cli(["ls", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert "not found" in err and "missing" in err


def test_info_and_load_of_a_checkpointer_root_name_the_steps(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "run"
    with quire.Checkpointer(root) as c:
        c.save(1, _tree())
        c.save(2, _tree())
    with pytest.raises(quire.CheckpointNotFoundError, match=r"Checkpointer root.*steps are 1, 2"):
        quire.load(root)
    assert cli(["info", str(root)]) == 2
    assert f"steps 1, 2), not one checkpoint: run quire info {root}/step_00000002" in (
        capsys.readouterr().err
    )
    # the commands taking any source (diff, cp, export) and quire.open say the same
    with pytest.raises(quire.CheckpointNotFoundError, match=r"Checkpointer root.*steps are 1, 2"):
        quire.open(root)
    for argv in (["diff", str(root), str(root)], ["cp", str(root), str(tmp_path / "x")],
                 ["export", str(root), str(tmp_path / "y")]):  # fmt: skip
        assert cli(argv) == 2
        assert f"steps 1, 2), not one checkpoint: run quire {argv[0]} {root}/step_00000002" in (
            capsys.readouterr().err
        )


def test_info_shows_chunk_grid_codecs_and_layout(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("d",))
    sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
    x = jax.device_put(np.zeros((64, 8), np.float32), sh)
    quire.save(tmp_path / "c", {"x": x, "y": np.ones(4)},
               storage=quire.StorageOptions(codecs=["zstd"]))  # fmt: skip
    assert cli(["info", str(tmp_path / "c")]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.strip().startswith("x:"))
    assert "chunks=[16, 8] grid=[4, 1]" in line and "mesh=" in line
    assert "codecs=[bytes{endian=little}, zstd{level=3, checksum=false}, crc32c]" in line
    assert "1 chunk" in next(ln for ln in out.splitlines() if ln.strip().startswith("y:"))


# ----------------------------------------------------------------------------- verify / cp
@pytest.mark.parametrize("layout", ["packed", "chunks"])
def test_verify_and_cp_count_alike_and_exit_codes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], layout: str
) -> None:
    src = tmp_path / "src"
    quire.save(src, _tree(), layout=layout)
    assert cli(["verify", str(src)]) == 0
    v = capsys.readouterr().out
    assert cli(["cp", str(src), str(tmp_path / "dst")]) == 0
    c = capsys.readouterr().out
    counted = re.compile(r"(\d+ arrays, \d+ chunks, [\d.]+ \w+) verified")
    assert counted.search(v)[1] == counted.search(c)[1] == "3 arrays, 3 chunks, 8.0 KiB"
    assert cli(["info", str(src)]) == 0
    assert "  3 arrays, 3 chunks, 8.0 KiB, 1 inline leaves" in capsys.readouterr().out

    # damage one chunk: verify prints its path once and exits 1; cp refuses with 1
    if layout == "chunks":
        chunks = [p for p in (src / "d").rglob("c/*") if p.is_file()]
    else:
        chunks = [p for p in (src / "d").rglob("%packs/*") if not p.name.endswith(".json")]
    chunk = max(chunks, key=lambda p: p.stat().st_size)
    data = bytearray(chunk.read_bytes())
    data[10] ^= 0xFF
    chunk.write_bytes(bytes(data))
    assert cli(["verify", str(src)]) == 1
    out, err = capsys.readouterr()
    bad = [ln for ln in out.splitlines() if ln.startswith("BAD")]
    assert len(bad) == 1, bad
    key = bad[0].split()[2].rstrip(":")  # BAD  LEAF: OBJECT: why
    assert "/c/" in key and bad[0].count(key) == 1, bad
    if layout == "chunks":
        assert key == str(chunk.relative_to(src)), bad
    assert "DAMAGED, 1 of 3 chunks failed (3 arrays" in err
    assert cli(["cp", str(src), str(tmp_path / "dst2")]) == 1
    assert "CorruptCheckpointError" in capsys.readouterr().err
    assert cli(["verify", str(tmp_path / "nothing")]) == 2


def test_cp_onto_its_own_source_is_a_one_line_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # hunt 2 finding 6: a builtin ValueError (a traceback, exit 1) for a quire checkpoint and
    # an unclear "[Errno 17] File exists" for a converted source
    from safetensors.numpy import save_file

    q, f = tmp_path / "q", tmp_path / "a.safetensors"
    quire.save(q, {"x": np.arange(4.0)})
    save_file({"x": np.arange(4.0)}, str(f))
    for src, dst in (
        (q, q),
        (q, f"{q}/"),
        (q, f"{q}/../q"),
        (f, f),
        (f, f"{tmp_path}/./a.safetensors"),
    ):
        for extra in ([], ["--overwrite"]):
            assert cli(["cp", str(src), str(dst), *extra]) == 2
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and "CheckpointExistsError" in err, err
            assert "is the source" in err and "copy to another URL" in err, err
        with pytest.raises(quire.CheckpointExistsError, match="is the source"):
            quire.copy(src, dst, overwrite=True)
    np.testing.assert_array_equal(quire.load(q)["x"], np.arange(4.0))  # both left intact
    np.testing.assert_array_equal(quire.load(f)["x"], np.arange(4.0))


@pytest.mark.parametrize("layout", ["packed", "chunks"])
def test_info_verify_and_cp_progress_count_the_same_chunks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], layout: str
) -> None:
    """Sharded arrays, zarr shards (chunk_bytes), a PRNG key, an empty array: info, verify's
    and cp's summaries and their progress bars all count the same chunks, in both layouts;
    a damaged zarr.json is named as a header, not counted as a chunk."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("d",))
    sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
    tree = {"s": jax.device_put(np.ones((64, 8), np.float32), sh), "k": jax.random.key(1),
            "big": np.ones((256, 64), np.float32), "e": np.zeros((0, 3)), "n": 1}  # fmt: skip
    src = tmp_path / "src"
    quire.save(src, tree, layout=layout,
               storage=lambda path, leaf: quire.StorageOptions(chunk_bytes=4096)
               if "big" in str(path) else None)  # fmt: skip
    want = "4 arrays, 6 chunks"  # s: 4 device shards; k: 1; big: 1 zarr shard; e: none
    assert cli(["info", str(src)]) == 0
    assert f"  {want}, " in capsys.readouterr().out
    assert cli(["verify", str(src), "--progress"]) == 0
    out, err = capsys.readouterr()
    assert f"OK, {want}, " in out and "6/6 chunks" in err
    assert cli(["cp", str(src), str(tmp_path / "dst"), "--progress"]) == 0
    out, err = capsys.readouterr()
    assert f": {want}, " in out and "6/6 chunks" in err, (out, err)
    if layout == "chunks":
        header = next(p for p in (src / "d").rglob("zarr.json") if "big" in str(p))
        header.write_bytes(header.read_bytes()[:-3] + b"!!}")
        assert cli(["verify", str(src)]) == 1
        err = capsys.readouterr().err
        assert "DAMAGED, 0 of 6 chunks failed, and 1 array header(s) (zarr.json)" in err


# ----------------------------------------------------------------------------- diff
def test_diff(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b, c, d = (str(tmp_path / n) for n in "abcd")
    quire.save(a, _tree(), metadata={"loss": 1.0})
    quire.save(b, _tree(), metadata={"loss": 1.0})
    quire.save(c, _tree(1.0 + 1e-6), metadata={"loss": 1.0})
    other = _tree()
    other["w"] = np.zeros((64, 16), np.float32)
    other["extra"] = np.zeros(2, np.float16)
    del other["b"]
    quire.save(d, other, metadata={"loss": 0.5})

    assert cli(["diff", a, b, "--values"]) == 0
    assert "same structure, shapes, dtypes and metadata (4 leaves" in capsys.readouterr().out
    assert cli(["diff", a, c]) == 0  # structure only: same
    capsys.readouterr()
    assert cli(["diff", a, c, "--values"]) == 1
    assert "~ w: 2048 of 2048 values differ" in capsys.readouterr().out
    assert cli(["diff", a, c, "--atol", "1e-5"]) == 0
    capsys.readouterr()
    assert cli(["diff", a, d]) == 1
    out = capsys.readouterr().out
    assert "- b  (only in A)" in out and "+ extra  (only in B)" in out
    assert "~ w: float32[64, 32] vs float32[64, 16]" in out
    assert "~ metadata loss: 1.0 vs 0.5" in out


# ----------------------------------------------------------------------------- gc
KILLED_SAVE = textwrap.dedent(
    """
    import os, sys, numpy as np, quire, quire._engine.commit as c

    async def die(*a, **k):
        os._exit(9)  # killed after the data, before the commit record

    c.publish = die
    quire.save(sys.argv[1], {"w": np.full(1000, 7.0)}, overwrite=sys.argv[2] == "1")
    """
)


def _killed_save(url: Path, overwrite: bool) -> None:
    p = subprocess.run([sys.executable, "-c", KILLED_SAVE, str(url), str(int(overwrite))],
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert p.returncode == 9, p.stderr


def test_gc_reclaims_killed_saves_under_plain_urls(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    live = tmp_path / "ckpt" / "step_100"
    quire.save(live, _tree())
    referenced = {p for p in live.rglob("*") if p.is_file()}
    _killed_save(live, overwrite=True)  # an overwrite killed: unreferenced d/<txid>/
    fresh = tmp_path / "ckpt" / "step_200"
    _killed_save(fresh, overwrite=False)  # a first save killed: no quire.json at all
    debris = [p for p in (live / "d").iterdir() if p not in {q.parent for q in referenced}]
    txids = set(quire.metadata(live).txids)
    stale = [p for p in (live / "d").iterdir() if p.name not in txids]
    assert len(stale) == 1 and list((fresh / "d").iterdir()), debris

    # young: kept, by the single-URL form and by the prefix form
    for url in (live, tmp_path / "ckpt"):
        assert cli(["gc", str(url), "--yes"]) == 0
        assert "kept" in capsys.readouterr().out and stale[0].exists()
    old = time.time() - 7200
    for p in [*stale[0].rglob("*"), *(fresh / "d").rglob("*")]:
        os.utime(p, (old, old))
    assert cli(["gc", str(live)]) == 0  # dry run
    assert f"would remove d/{stale[0].name}/" in capsys.readouterr().out
    assert cli(["gc", str(live), "--yes"]) == 0
    assert "removed 1 item" in capsys.readouterr().out and not stale[0].exists()
    assert cli(["gc", str(tmp_path / "ckpt"), "--yes", "--progress"]) == 0
    out, err = capsys.readouterr()
    assert "step_200/d/" in out and "never committed" in out
    assert re.search(r"gc: 100%.* (\S+)/\1 .*1/1 objects", err), err  # bytes and items removed
    assert not any(p.is_file() for p in fresh.rglob("*"))
    assert {p for p in live.rglob("*") if p.is_file()} == referenced
    np.testing.assert_array_equal(quire.load(live)["w"], _tree()["w"])


def test_gc_of_a_checkpointer_root_shows_progress(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "run"
    with quire.Checkpointer(root) as c:
        c.save(1, _tree())
    crashed = root / "step_00000002"
    _killed_save(crashed, overwrite=False)  # an uncommitted step
    old = time.time() - 7200
    for p in [crashed, *crashed.rglob("*")]:
        os.utime(p, (old, old))
    assert cli(["gc", str(root), "--yes", "--progress"]) == 0
    out, err = capsys.readouterr()
    assert "removed step_00000002/" in out and not crashed.exists()
    assert re.search(r"gc: 100%.* (\S+)/\1 .*1/1 objects", err), err


# ----------------------------------------------------------------------------- progress
def test_cli_progress_bar_in_a_real_terminal(tmp_path: Path) -> None:
    import pty

    src = tmp_path / "src"
    quire.save(src, {"x": np.ones((512, 512), np.float32)})
    for args, label, unit in ((["verify", str(src)], "verify", "1/1 chunks"),
                              (["cp", str(src), str(tmp_path / "dst")], "cp", "1/1 chunks"),
                              (["diff", str(src), str(src), "--values"], "diff", "1/1 leaves")):  # fmt: skip
        master, slave = pty.openpty()
        p = subprocess.Popen([*QUIRE, *args], stdin=slave, stdout=slave, stderr=slave)
        os.close(slave)
        buf = b""
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            r, _, _ = select.select([master], [], [], 1.0)
            if r:
                try:
                    chunk = os.read(master, 4096)
                except OSError:
                    break
                if not chunk:
                    break
                buf += chunk
            elif p.poll() is not None:
                break
        p.wait(timeout=60)
        os.close(master)
        text = buf.decode(errors="replace")
        assert p.returncode == 0, text
        assert f"{label}: 100%" in text and "1.00M/1.00M" in text and "B/s" in text, text
        assert unit in text  # chunks: the unit verify's and cp's summaries count

    # not a terminal: no bar
    out = subprocess.run([*QUIRE, "verify", str(src)], capture_output=True, text=True)
    assert out.returncode == 0 and "%|" not in out.stderr
