"""Crash injection: a SIGKILL at any moment of a save never damages what is committed.

DESIGN.md, "Commit protocol": a crash at any point of a save leaves either the old or the
new checkpoint, whole; for a URL without a checkpoint, either none (``quire.load`` raises
``CheckpointNotFoundError``) or the new one, whole.

How: a *zygote* process (this file run as a script, with 8 host CPU devices) imports jax and
quire once, without initialising any jax backend, and then ``fork()``s one fresh child per
save. Each child builds a deterministic tree (numpy arrays, jax arrays sharded over the 8
devices, scalars, strings, bytes, None, a PRNG key) from a seed, prints ``ready`` and calls
``quire.save``. It is killed with SIGKILL

* by the test process, a measured delay after ``ready`` (delays spread over the whole save,
  calibrated by timing an uninterrupted save first), or
* by itself, in a wrapper around a ``LocalBackend`` method, just before (or just after) the
  N-th call, for every N of an uninterrupted run (counted first): every step of the protocol.

Each kill uses its own directory (a copy of the old checkpoint, or a fresh path). Another
forked child then loads every directory with ``quire.load`` and compares each leaf with the
old and the new tree (type, dtype, shape and bytes), and finally checks that a new save over
the debris succeeds. Forking keeps one kill at ~0.2 s instead of a jax import per process.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(sys.platform != "linux", reason="fork + SIGKILL"),
    pytest.mark.xdist_group("crash"),  # the module's zygote and templates: one worker
]

OLD_SEED, NEW_SEED = 1, 2
# LocalBackend methods the deterministic variant counts and kills at: the backend contract's
# write side, plus the private temp-file step of the commit when the backend has one.
HOOKED = (
    "put",
    "sync",
    "put_if_absent",
    "replace_if_match",
    "delete",
    "_write_tmp",
    "stream_writer",  # format v2: a pack created ...
)
STREAM_HOOKED = ("write", "close")  # ... written in place (pack_write) and fsynced (pack_close)
DATA_WRITES = ("put", "pack_write")
COMMITS = ("put_if_absent", "replace_if_match")


# ================================================================ trees (run in the children)
def build_tree(seed: int, kind: str) -> Any:
    """A deterministic tree; ``seed`` changes every value and one key name."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    devices = jax.devices()
    if len(devices) != 8:
        raise RuntimeError(f"expected 8 host devices, got {len(devices)} (XLA_FLAGS not applied?)")
    mesh = Mesh(np.array(devices).reshape(4, 2), ("a", "b"))
    rng = np.random.default_rng(seed)

    def normal(shape: tuple[int, ...], dtype: Any = np.float32) -> np.ndarray:
        return rng.standard_normal(shape).astype(dtype)

    def ints(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        info = np.iinfo(dtype)
        return rng.integers(max(info.min, -(2**20)), min(info.max, 2**20), shape, dtype=dtype)

    def put(x: Any, *spec: Any) -> Any:
        return jax.device_put(x, NamedSharding(mesh, P(*spec)))

    scalars = {
        "step": 1000 * seed + 7,
        "lr": 0.25 / seed,
        "name": f"run-{seed}-é",
        "done": bool(seed % 2),
        "blob": bytes(range(seed, seed + 16)),
        "nothing": None,
    }
    if kind == "small":
        return {
            "w": put(normal((64, 32)), "a", "b"),  # 8 distinct shards
            "v": put(ints((16, 8), np.int32), "a"),  # 4 shards, each held twice
            "host": {"x": normal((33, 7), np.float64), "mask": rng.random(50) < 0.5},
            f"only_{seed}": np.arange(seed + 3, dtype=np.int16),
            "meta": (scalars, [seed, f"s{seed}"]),
        }
    layers = [
        {
            "w": put(normal((256, 128)), "a", "b"),
            "b": put(normal((128,)), "b"),
            "scale": put(normal((64, 64), jnp.bfloat16), ("a", "b")),
        }
        for _ in range(4)
    ]
    opt = [normal((64, 100 + i)) for i in range(12)]
    opt += [
        ints((40, 33 + i), dtype) for i, dtype in enumerate((np.int32, np.uint8, np.int64, np.int8))
    ]
    opt += [normal((17, 19), dt) for dt in (np.float16, np.float64, jnp.bfloat16, np.complex64)]
    opt += [rng.random((31, 5)) < 0.5]
    return {
        "params": {
            "layers": layers,
            "embed": put(normal((1024, 256), jnp.bfloat16), ("a", "b"), None),
        },
        "replicated": put(normal((32, 16)), None),
        "opt": opt,
        "big_host": normal((384, 512), np.float64),
        # Built from host data: jax.random.key() would compile (0.1 s) in every child.
        "rng": jax.random.wrap_key_data(jax.device_put(np.array([0, seed], np.uint32))),
        "rng_raw": jax.device_put(np.array([0, seed], np.uint32)),
        f"only_{seed}": {"x": np.full((5,), seed, np.int32)},
        "scalar_arrays": [np.float32(seed / 3), np.array(seed * 11), put(np.float32(seed / 7))],
        "meta": (scalars, [seed, f"s{seed}", (None, 2.5 * seed)]),
    }


def first_difference(got: Any, exp: Any, path: str = "") -> str | None:
    """None when ``got`` is ``exp`` bit for bit (containers, leaf types, dtypes, bytes)."""
    import jax

    where = path or "<root>"
    if isinstance(exp, dict):
        if type(got) is not dict or list(got) != list(exp):
            return f"{where}: expected dict with keys {list(exp)}, got {_short(got)}"
        for k in exp:
            d = first_difference(got[k], exp[k], f"{path}/{k}")
            if d:
                return d
        return None
    if isinstance(exp, list | tuple):
        if type(got) is not type(exp) or len(got) != len(exp):
            return f"{where}: expected {type(exp).__name__} of {len(exp)}, got {_short(got)}"
        for i, (g, e) in enumerate(zip(got, exp)):
            d = first_difference(g, e, f"{path}/{i}")
            if d:
                return d
        return None
    if isinstance(exp, jax.Array) and jax.dtypes.issubdtype(exp.dtype, jax.dtypes.prng_key):
        if not (
            isinstance(got, jax.Array) and jax.dtypes.issubdtype(got.dtype, jax.dtypes.prng_key)
        ):
            return f"{where}: expected a typed PRNG key, got {_short(got)}"
        if str(got.dtype) != str(exp.dtype) or not np.array_equal(
            np.asarray(jax.random.key_data(got)), np.asarray(jax.random.key_data(exp))
        ):
            return f"{where}: PRNG key differs"
        return None
    if isinstance(exp, jax.Array | np.ndarray | np.generic):
        if isinstance(exp, jax.Array) != isinstance(got, jax.Array) or not hasattr(got, "dtype"):
            return f"{where}: expected {type(exp).__name__}, got {_short(got)}"
        if isinstance(exp, np.generic) and type(got) is not type(exp):
            return f"{where}: expected {type(exp).__name__}, got {_short(got)}"
        g, e = np.asarray(got), np.asarray(exp)
        if g.dtype != e.dtype or g.shape != e.shape:
            return f"{where}: expected {e.dtype}{list(e.shape)}, got {g.dtype}{list(g.shape)}"
        if not (np.array_equal(g, e) and g.tobytes() == e.tobytes()):
            bad = int(np.sum(g != e)) if g.size else 0
            return f"{where}: values differ ({bad} of {g.size} elements)"
        return None
    if type(got) is not type(exp) or got != exp:
        return f"{where}: expected {exp!r}, got {_short(got)}"
    return None


def _short(x: Any) -> str:
    s = repr(x).replace("\n", " ")
    return f"{type(x).__name__} {s[:80]}"


# ================================================================ the zygote (a script)
def _emit(**event: Any) -> None:
    # One write(2) per line: lines from the zygote and its children never interleave.
    os.write(1, (json.dumps(event) + "\n").encode())


_T0 = [0.0]  # perf_counter() when the child called quire.save
_END_TIMES: dict[int, float] = {}  # call index -> seconds after _T0 when that call returned


def _install_hooks(kill_at: int | None, when: str, calls: list[str]) -> None:
    """Count calls of HOOKED LocalBackend methods; SIGKILL this process at call ``kill_at``."""
    import asyncio

    from quire._store.local import LocalBackend

    lock = threading.Lock()

    def enter(name: str) -> int:
        with lock:
            calls.append(name)
            return len(calls) - 1

    def maybe_die(i: int, moment: str) -> None:
        if moment == "after":
            _END_TIMES[i] = time.perf_counter() - _T0[0]
        if i == kill_at and when == moment:
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)  # never reached

    from quire._store.local import _StreamWriter

    targets = [(LocalBackend, n, n) for n in HOOKED]
    targets += [(_StreamWriter, n, f"pack_{n}") for n in STREAM_HOOKED]
    for cls, attr, name in targets:
        orig = getattr(cls, attr, None)
        if orig is None:
            continue
        if asyncio.iscoroutinefunction(orig):

            async def wrapper(
                self: Any, *a: Any, _orig: Any = orig, _name: str = name, **kw: Any
            ) -> Any:
                i = enter(_name)
                maybe_die(i, "before")
                r = await _orig(self, *a, **kw)
                maybe_die(i, "after")
                return r

        else:

            def wrapper(self: Any, *a: Any, _orig: Any = orig, _name: str = name, **kw: Any) -> Any:  # type: ignore[misc]
                i = enter(_name)
                maybe_die(i, "before")
                r = _orig(self, *a, **kw)
                maybe_die(i, "after")
                return r

        setattr(cls, attr, wrapper)


def _child_save(cmd: dict[str, Any]) -> None:
    import jax

    import quire

    tree = build_tree(cmd["seed"], cmd["kind"])
    jax.block_until_ready(jax.tree.leaves(tree))
    calls: list[str] = []
    if cmd.get("hooks"):
        _install_hooks(cmd.get("kill_at"), cmd.get("when", "before"), calls)
    _emit(event="ready", pid=os.getpid())
    _T0[0] = t0 = time.perf_counter()
    quire.save(cmd["url"], tree, overwrite=cmd["overwrite"], metadata={"seed": cmd["seed"]})
    _emit(
        event="done",
        pid=os.getpid(),
        elapsed=time.perf_counter() - t0,
        calls=calls,
        ends=[_END_TIMES.get(i) for i in range(len(calls))],
    )


def _child_verify(cmd: dict[str, Any]) -> None:
    import quire

    old = build_tree(cmd["old_seed"], cmd["kind"]) if cmd["old_seed"] is not None else None
    new = build_tree(cmd["new_seed"], cmd["kind"])
    for i, url in enumerate(cmd["urls"]):
        try:
            got = quire.load(url)
        except quire.CheckpointNotFoundError as e:
            outcome, detail = "absent", str(e)
        except BaseException as e:
            outcome, detail = "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
        else:
            d_new = first_difference(got, new)
            d_old = first_difference(got, old) if old is not None else "no old checkpoint"
            if d_new is None:
                outcome, detail = "new", ""
            elif d_old is None:
                outcome, detail = "old", ""
            else:
                outcome, detail = "mixed", f"vs old: {d_old}\nvs new: {d_new}"
        recovered = ""
        if cmd["recover"][i]:
            # The debris of the crash must not get in the way of the next save.
            try:
                quire.save(url, new, overwrite=True)
                d = first_difference(quire.load(url), new)
                recovered = "ok" if d is None else f"reload after re-save differs: {d}"
            except BaseException as e:
                recovered = f"re-save failed: {type(e).__name__}: {e}\n{traceback.format_exc()}"
        _emit(
            event="verified",
            index=i,
            outcome=outcome,
            detail=detail[:1500],
            recovered=recovered[:1500],
        )


def _zygote_main() -> None:
    # Heavy imports once; no jax backend is initialised here, so fork() is safe.
    import jax  # noqa: F401

    import quire
    import quire._store.local  # noqa: F401

    assert threading.active_count() == 1, threading.enumerate()
    _emit(event="zygote-ready", pid=os.getpid())
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            return
        if cmd["op"] == "reap":
            _, status = os.waitpid(cmd["pid"], 0)
            _emit(event="exit", pid=cmd["pid"], code=os.waitstatus_to_exitcode(status))
            continue
        if os.fork() == 0:  # the child: run one command, never return into the loop
            code = 1
            try:
                _emit(event="forked", pid=os.getpid())  # first, so it precedes all its events
                {"save": _child_save, "verify": _child_verify}[cmd["op"]](cmd)
                code = 0
            except BaseException:
                _emit(event="error", pid=os.getpid(), tb=traceback.format_exc()[-3000:])
            finally:
                os._exit(code)


if __name__ == "__main__" and sys.argv[1:] == ["zygote"]:
    _zygote_main()
    sys.exit(0)


# ================================================================ the test side
class Zygote:
    def __init__(self, workdir: Path) -> None:
        env = dict(os.environ)
        env.update(
            XLA_FLAGS="--xla_force_host_platform_device_count=8",
            JAX_PLATFORMS="cpu",
            PYTHONUNBUFFERED="1",
        )
        self.stderr_path = workdir / "zygote.stderr"
        self._stderr = open(self.stderr_path, "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "zygote"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            env=env,
            cwd=workdir,
        )
        self.events: queue.Queue[dict[str, Any] | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.expect("zygote-ready", timeout=120)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            try:
                self.events.put(json.loads(raw))
            except ValueError:
                pass  # stray output, not ours
        self.events.put(None)

    def stderr_tail(self) -> str:
        return self.stderr_path.read_text(errors="replace")[-3000:]

    def next_event(self, timeout: float = 120) -> dict[str, Any]:
        try:
            ev = self.events.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(
                f"no answer from the zygote in {timeout}s\n{self.stderr_tail()}"
            ) from None
        if ev is None:
            raise AssertionError(f"the zygote died (rc={self.proc.poll()})\n{self.stderr_tail()}")
        if ev["event"] == "error":
            raise AssertionError(f"a child failed unexpectedly:\n{ev['tb']}\n{self.stderr_tail()}")
        return ev

    def expect(self, name: str, timeout: float = 120) -> dict[str, Any]:
        ev = self.next_event(timeout)
        assert ev["event"] == name, f"expected {name!r}, got {ev}"
        return ev

    def send(self, **cmd: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        self.proc.stdin.flush()

    def save(
        self,
        url: Path,
        seed: int,
        kind: str,
        *,
        overwrite: bool,
        delay: float | None = None,
        hooks: bool = False,
        kill_at: int | None = None,
        when: str = "before",
    ) -> dict[str, Any]:
        """Run one save in a fresh child; SIGKILL it ``delay`` s after its 'ready' line.

        Returns ``code`` (the exit code, -9 when killed), ``done`` (its 'done' event, None if
        it never finished) and ``ready`` (whether it got as far as calling quire.save).
        """
        self.send(
            op="save",
            url=str(url),
            seed=seed,
            kind=kind,
            overwrite=overwrite,
            hooks=hooks,
            kill_at=kill_at,
            when=when,
        )
        pid = self.expect("forked")["pid"]
        out: dict[str, Any] = {"done": None, "ready": False}
        if delay is not None:
            self.expect("ready")
            out["ready"] = True
            deadline = time.perf_counter() + delay
            # Wait for the deadline, or for 'done' (the save finished: nothing left to kill).
            while out["done"] is None and (left := deadline - time.perf_counter()) > 0:
                try:
                    ev = self.events.get(timeout=left)
                except queue.Empty:
                    break
                if ev is None or ev["event"] != "done":
                    raise AssertionError(
                        f"unexpected event {ev} while saving\n{self.stderr_tail()}"
                    )
                out["done"] = ev
            if out["done"] is None:
                # The pid is still ours: the zygote reaps the child only when told, below.
                os.kill(pid, signal.SIGKILL)
        self.send(op="reap", pid=pid)
        while True:
            ev = self.next_event()
            if ev["event"] == "ready":
                out["ready"] = True
            elif ev["event"] == "done":
                out["done"] = ev
            elif ev["event"] == "exit" and ev["pid"] == pid:
                out["code"] = ev["code"]
                return out
            else:
                raise AssertionError(f"unexpected event {ev}")

    def verify(
        self,
        urls: list[Path],
        kind: str,
        *,
        old_seed: int | None,
        recover: list[bool] | None = None,
    ) -> list[dict[str, Any]]:
        """Load each URL and classify it: 'old', 'new', 'absent', 'mixed' or 'error'. Where
        ``recover`` says so, then save the new tree over the debris and reload it."""
        self.send(
            op="verify",
            urls=[str(u) for u in urls],
            kind=kind,
            old_seed=old_seed,
            new_seed=NEW_SEED,
            recover=recover or [False] * len(urls),
        )
        pid = self.expect("forked")["pid"]
        results = [self.expect("verified", timeout=300) for _ in urls]
        self.send(op="reap", pid=pid)
        assert self.expect("exit")["code"] == 0
        return results

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send(op="quit")
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._stderr.close()


@pytest.fixture(scope="module")
def zygote(tmp_path_factory: pytest.TempPathFactory) -> Any:
    z = Zygote(tmp_path_factory.mktemp("zygote"))
    try:
        yield z
    finally:
        z.close()


@pytest.fixture(scope="module")
def templates(zygote: Zygote, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A complete checkpoint of the OLD tree, per tree kind, to copy before each kill."""
    root = tmp_path_factory.mktemp("templates")
    out = {}
    for kind in ("big", "small"):
        out[kind] = root / kind
        r = zygote.save(out[kind], OLD_SEED, kind, overwrite=False)
        assert r["code"] == 0 and r["done"], r
    for kind, url in out.items():  # sanity: the comparison recognises the old tree
        res = zygote.verify([url], kind, old_seed=OLD_SEED)
        assert res[0]["outcome"] == "old", res[0]
    return out


def _check(
    results: list[dict[str, Any]], labels: list[str], allowed: set[str], context: str = ""
) -> None:
    bad = []
    for label, r in zip(labels, results):
        if r["outcome"] not in allowed:
            bad.append(
                f"{label}: quire.load gave {r['outcome']!r} (allowed: {sorted(allowed)})\n{r['detail']}"
            )
        elif r["recovered"] not in ("", "ok"):
            bad.append(f"{label}: after the crash ({r['outcome']}), {r['recovered']}")
    head = f"{len(bad)} of {len(results)} crashes broke the checkpoint{context}:\n\n"
    assert not bad, head + "\n\n".join(bad)


def _prepare(workdir: Path, name: str, template: Path | None) -> Path:
    url = workdir / name
    if template is not None:
        shutil.copytree(template, url)
    return url


def _timed_kills(
    zygote: Zygote, workdir: Path, template: Path | None, n_commit: int, n_tail: int
) -> None:
    """Kill ``n_commit`` saves spread from just after 'ready' to a little past the commit
    point, and ``n_tail`` more spread from there to well past the calibrated end of the save
    (for an overwrite, the removal of the old data follows the commit)."""
    kind = "big"
    overwrite = template is not None
    # Calibrate on uninterrupted saves (timed from 'ready', i.e. without start-up): when the
    # commit call returns and when the save returns. The hooks here only take times.
    urls, labels, commits, durations = [], [], [], []
    for i in range(2):
        url = _prepare(workdir, f"calib{i}", template)
        r = zygote.save(url, NEW_SEED, kind, overwrite=overwrite, hooks=True)
        assert r["code"] == 0 and r["done"], r
        calls, ends = r["done"]["calls"], r["done"]["ends"]
        commits.append(max(t for name, t in zip(calls, ends) if name in COMMITS))
        durations.append(r["done"]["elapsed"])
        urls.append(url)
        labels.append(f"uninterrupted save {i}")
    commit, duration = min(commits), min(durations)
    head = commit * 1.15
    delays = [head * i / (n_commit - 1) for i in range(n_commit)]
    tail_end = max(duration * 2, head * 2)  # a save that finishes sooner is not killed
    delays += [head + (tail_end - head) * (i + 1) / n_tail for i in range(n_tail)]
    killed_mid_save = 0
    for i, delay in enumerate(delays):
        url = _prepare(workdir, f"kill{i:02d}", template)
        r = zygote.save(url, NEW_SEED, kind, overwrite=overwrite, delay=delay)
        killed_mid_save += r["done"] is None
        urls.append(url)
        labels.append(
            f"SIGKILL {delay * 1e3:.1f} ms into the save (calibrated: commit done at "
            f"{commit * 1e3:.0f} ms, save done at {duration * 1e3:.0f} ms; child exit "
            f"code {r['code']}, finished={r['done'] is not None})"
        )
    results = zygote.verify(urls, kind, old_seed=OLD_SEED if overwrite else None)
    _check(results, labels, {"old", "new"} if overwrite else {"absent", "new"})
    outcomes = [r["outcome"] for r in results]
    print("\n".join(f"{o:>6}  {label}" for o, label in zip(outcomes, labels)))
    assert outcomes[:2] == ["new", "new"], outcomes  # the uninterrupted saves
    # The kills must really have interrupted saves, some of them before the commit point.
    # (Slower saves than calibrated only move kills earlier; the deterministic test below
    # hits every moment after the commit too.)
    assert killed_mid_save >= len(delays) // 2, list(zip(labels, outcomes))
    assert outcomes[2] == ("old" if overwrite else "absent"), list(zip(labels, outcomes))


def test_sigkill_during_overwrite_at_timed_moments(
    zygote: Zygote, templates: dict[str, Path], tmp_path: Path
) -> None:
    """overwrite=True over a complete checkpoint, killed 0..115% of the way to the commit and
    during the removal of the old data that follows it."""
    _timed_kills(zygote, tmp_path, templates["big"], n_commit=13, n_tail=3)


def test_sigkill_during_new_save_at_timed_moments(zygote: Zygote, tmp_path: Path) -> None:
    """A save to a URL without a checkpoint: afterwards none, or the complete new one."""
    _timed_kills(zygote, tmp_path, None, n_commit=7, n_tail=1)


@pytest.mark.parametrize(
    "case",
    ["overwrite", "new-url", "new-url-overwrite"],
)
def test_sigkill_at_every_backend_call(
    zygote: Zygote, templates: dict[str, Path], tmp_path: Path, case: str
) -> None:
    """The child kills itself right before (and, for commit-side calls, right after) the
    N-th call of each write method of the local backend, for every N: every protocol step."""
    kind = "small"
    template = templates[kind] if case == "overwrite" else None
    overwrite = case != "new-url"
    # Count the calls of an uninterrupted save.
    r = zygote.save(
        _prepare(tmp_path, "count", template), NEW_SEED, kind, overwrite=overwrite, hooks=True
    )
    assert r["code"] == 0 and r["done"], r
    calls: list[str] = r["done"]["calls"]
    assert "put" in calls and "sync" in calls, calls
    assert ("replace_if_match" if case == "overwrite" else "put_if_absent") in calls, calls
    if case == "overwrite":
        assert "delete" in calls[calls.index("replace_if_match") :], calls  # old data removed
    puts = [i for i, name in enumerate(calls) if name in DATA_WRITES]
    # Every call; for the third case, whose data writes are those of the second, only the
    # first and last data write. After the call too for all but the data writes.
    points = [
        (i, "before")
        for i in range(len(calls))
        if case != "new-url-overwrite" or i not in puts[1:-1]
    ]
    points += [(i, "after") for i, name in enumerate(calls) if name not in DATA_WRITES]
    # Re-saving over the debris of every kill is slow (old-data removal); the data writes
    # all leave the same kind of debris, so re-save after the first and last only.
    recover = [i not in puts[1:-1] for i, _ in points]
    urls, labels = [], []
    for i, when in points:
        url = _prepare(tmp_path, f"k{i:03d}{when[0]}", template)
        r = zygote.save(url, NEW_SEED, kind, overwrite=overwrite, hooks=True, kill_at=i, when=when)
        assert r["code"] == -signal.SIGKILL, f"call {i} ({calls[i]}) was never reached: {r}"
        urls.append(url)
        labels.append(f"SIGKILL {when} call {i} ({calls[i]})")
    old_seed = OLD_SEED if case == "overwrite" else None
    results = zygote.verify(urls, kind, old_seed=old_seed, recover=recover)
    allowed = {"old", "new"} if case == "overwrite" else {"absent", "new"}
    _check(results, labels, allowed, f" (LocalBackend calls of the save: {calls})")
    outcomes = dict(zip(points, (r["outcome"] for r in results)))
    print(f"{case}: {len(points)} kills over {len(calls)} calls; outcome per call (before/after):")
    print(
        "\n".join(
            f"  {i:3d} {name:<16} {outcomes.get((i, 'before'), '-'):>6} {outcomes.get((i, 'after'), '')}"
            for i, name in enumerate(calls)
        )
    )
    # Sanity: the commit call is the switch from old (or nothing) to new.
    commit = max(i for i, name in enumerate(calls) if name in COMMITS)
    before = "old" if case == "overwrite" else "absent"
    assert outcomes[(commit, "before")] == before, outcomes
    assert outcomes[(commit, "after")] == "new", outcomes
    assert outcomes[(0, "before")] == before, outcomes
