"""Export any source to safetensors (one file, or HF-style shards + index), streaming.

Tensors are read in file order through a sliding window bounded by the byte budget and
written sequentially with one streaming upload per file (``fsspec`` ``open("wb")``: file
writes, S3 multipart, GCS resumable), so host memory stays within ``Config.byte_budget``
plus one tensor.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from quire._format.dtypes import dtype_from_name
from quire._format.tree import KeyPath, keystr, walk
from quire._handlers.casting import check_casting, kind, lossy, refusal
from quire._runtime.config import current
from quire._runtime.ioloop import run_blocking, submit
from quire._runtime.progress import _current, advance, reporting
from quire._sources.base import Source, _is_source_leaf
from quire._sources.lazy import LazyValue, as_lazy, full_region
from quire._sources.opening import opened
from quire._sources.safetensors import INDEX, SINGLE, dtype_code
from quire._sources.surgery import astype
from quire._store.base import QUIRE_STORAGE_OPTIONS
from quire._store.local import local_path
from quire._store.url import normalize, protocol_of
from quire.errors import CheckpointExistsError, LossyCastError, TreeMismatchError

__all__ = ["cast_dtype", "export", "selector"]

DEFAULT_SHARD = 5 * 1024**3


@dataclass
class _Tensor:
    name: str
    value: LazyValue
    dtype: np.dtype[Any]
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def selector(select: Any) -> Callable[[str], bool]:
    """Whether to write the tensor of a dotted name; ``ValueError`` for a bad regex."""
    if select is None:
        return lambda _n: True
    if callable(select):
        return lambda n: bool(select(n))
    if isinstance(select, str):
        try:
            pat = re.compile(select)
        except re.error as e:
            raise ValueError(f"export: select={select!r} is not a regular expression: {e}") from e
        return lambda n: bool(pat.search(n))
    names = set(select)
    return lambda n: n in names


def _renamer(rename: Any) -> Callable[[str], str | None]:
    if rename is None:
        return lambda n: n
    if callable(rename):
        return rename  # type: ignore[no-any-return]
    if isinstance(rename, Mapping):
        return lambda n: rename.get(n, n)

    rules = [(re.compile(p), r) for p, r in rename]

    def by_rules(n: str) -> str:
        for pat, rep in rules:
            if pat.fullmatch(n):
                return pat.sub(rep, n)
        return n

    return by_rules


def cast_dtype(want: Any) -> np.dtype[Any]:
    """The dtype ``want`` (a name such as ``"bfloat16"``, or a dtype) names; ``ValueError``
    when it names none."""
    if isinstance(want, str):
        try:
            return dtype_from_name(want)
        except KeyError:
            pass
    try:
        return np.dtype(want)
    except TypeError as e:
        raise ValueError(
            f"export: dtype={want!r} is no dtype quire knows (e.g. 'bfloat16', 'float16')"
        ) from e


def _cast(v: LazyValue, want: Any, casting: str, url: str, path: str, name: str) -> LazyValue:
    """``v`` cast to ``want`` when it is a floating-point tensor (others stay as they are),
    by the rule of a load's ``casting=``: a lossy cast is a LossyCastError."""
    if want is None or kind(v.dtype) not in ("f", "c"):
        return v
    dt = cast_dtype(want)
    if dt == v.dtype:
        return v
    if lossy(v.dtype, dt, casting):
        why = refusal(v.dtype, dt, casting).replace("saved", "source", 1)
        raise LossyCastError(
            f"export {url}: tensor {name!r} (key path {path!r}): {why}. To fix: give a float "
            f"dtype (dtype='bfloat16'), a callable dtype=(name, dtype) -> dtype | None that "
            "casts only some tensors, or allow the cast: casting='unsafe' (quire export "
            "--casting unsafe)",
            mismatched=[f"{name!r}: {why}"],
        )
    return astype(v, dt)


def _collision(url: str, a: KeyPath, b: KeyPath, name: str, renamed: bool) -> Exception:
    """Two leaves that would be written under one tensor name (safetensors names are flat)."""
    if renamed:
        why = f"key paths {a!r} and {b!r} are both renamed to the tensor name {name!r}"
        fix = "give them different names with rename=, or leave one out with select="
    else:
        why = f"key paths {a!r} and {b!r} both join to the tensor name {name!r}"
        fix = (
            "rename one of the keys in the tree and save it again (quire.surgery.rename on the "
            "loaded tree, '/'-joined paths), then export; rename= and select= see only the "
            "joined name"
        )
    return TreeMismatchError(
        f"export {url}: {why}; a safetensors file holds one tensor per name. To fix: {fix}",
        mismatched=[why],
    )


def _plan(
    src: Source, select: Any, rename: Any, dtype: Any, casting: str = "same_kind"
) -> list[_Tensor]:
    keep, new_name = selector(select), _renamer(rename)
    out: list[_Tensor] = []
    seen_at: dict[str, tuple[KeyPath, str]] = {}
    for node in walk(src.tree, _is_source_leaf, what=f"source {src.url}").leaves():
        key, leaf = node.path, node.value
        path = keystr(key)
        # dotted, each key as it is: a safetensors name ("e/f", "g.h") comes back unchanged
        name = ".".join(map(str, key)) if key else path
        if not keep(name):
            continue
        if isinstance(leaf, LazyValue):
            v = leaf
        elif isinstance(leaf, bool | int | float | np.ndarray | np.generic):
            v = as_lazy(leaf)
        else:
            continue  # strings, None: not tensors
        target = new_name(name)
        if target is None:
            continue
        if target in seen_at:
            first, first_name = seen_at[target]
            raise _collision(src.url, first, key, target, renamed=first_name != name)
        seen_at[target] = key, name
        # a type (np.float16, ml_dtypes.bfloat16) is callable too, but names a dtype
        want = dtype(name, v.dtype) if callable(dtype) and not isinstance(dtype, type) else dtype
        v = _cast(v, want, casting, src.url, path, name)
        dtype_code(v.dtype)  # fail early on dtypes safetensors lacks
        out.append(_Tensor(target, v, v.dtype, v.shape))
    return out


def _header(tensors: Sequence[_Tensor], metadata: Mapping[str, str] | None) -> bytes:
    doc: dict[str, Any] = {}
    if metadata:
        doc["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    off = 0
    for t in tensors:
        doc[t.name] = {
            "dtype": dtype_code(t.dtype),
            "shape": list(t.shape),
            "data_offsets": [off, off + t.nbytes],
        }
        off += t.nbytes
    raw = json.dumps(doc, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as safetensors writes it
    return len(raw).to_bytes(8, "little") + raw


async def _write_file(
    fs: Any, path: str, tensors: Sequence[_Tensor], metadata: Mapping[str, str] | None
) -> None:
    budget = current().byte_budget
    window: deque[tuple[_Tensor, asyncio.Task[np.ndarray]]] = deque()
    held = 0
    todo = deque(tensors)
    f = await run_blocking(fs.open, path, "wb")
    try:
        await run_blocking(f.write, _header(tensors, metadata))
        while todo or window:
            while todo and (not window or held + todo[0].nbytes <= budget):
                t = todo.popleft()
                window.append((t, asyncio.ensure_future(_read(t))))
                held += t.nbytes
            t, task = window.popleft()
            arr = await task
            await run_blocking(f.write, np.ascontiguousarray(arr).reshape(-1).view(np.uint8).data)
            held -= t.nbytes
            del arr
            advance(t.nbytes)
        await run_blocking(f.close)
    except BaseException:
        for _, task in window:
            task.cancel()
        await run_blocking(_discard, fs, f, path)
        raise


async def _read(t: _Tensor) -> np.ndarray:
    # Runs as its own task: a quire source's reads are not this export's progress.
    _current.set(None)
    return await t.value.read_region(full_region(t.shape))


def _discard(fs: Any, f: Any, path: str) -> None:
    try:
        f.close()
    finally:
        try:
            fs.rm(path)
        except Exception:  # broad: cleanup of a failed export, whose error is raised
            pass


def _shards(tensors: list[_Tensor], limit: int) -> list[list[_Tensor]]:
    shards: list[list[_Tensor]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def _files(dst: str, shards: list[list[_Tensor]], limit: int) -> list[tuple[str, list[_Tensor]]]:
    """(URL, tensors) of every file to write."""
    if dst.endswith(".safetensors"):
        if len(shards) > 1:
            total = sum(t.nbytes for part in shards for t in part)
            raise ValueError(
                f"export to {dst}: {total} bytes need {len(shards)} shards of at most "
                f"{limit}; give a directory as the destination"
            )
        return [(dst, shards[0])]
    base = dst.rstrip("/")
    if len(shards) == 1:
        return [(f"{base}/model.safetensors", shards[0])]
    n = len(shards)
    return [(f"{base}/model-{i + 1:05d}-of-{n:05d}.safetensors", p) for i, p in enumerate(shards)]


async def _write_all(
    files: list[tuple[str, list[_Tensor]]],
    meta: Mapping[str, str],
    opts: dict[str, Any],
    index: str | None,
) -> None:
    import fsspec

    for url, part in files:
        fs, path = fsspec.core.url_to_fs(url, **opts)
        parent = path.rsplit("/", 1)[0]
        if parent:
            await run_blocking(fs.makedirs, parent, exist_ok=True)
        await _write_file(fs, path, part, meta)
    if index is not None:
        doc = {
            "metadata": {"total_size": sum(t.nbytes for _, part in files for t in part)},
            "weight_map": {t.name: u.rsplit("/", 1)[-1] for u, part in files for t in part},
        }
        fs, path = fsspec.core.url_to_fs(index, **opts)
        await run_blocking(fs.pipe_file, path, json.dumps(doc, indent=2).encode())


def _resolved(url: str) -> str:
    """``url`` with a local path's symlinks resolved (the file a write would reach)."""
    if protocol_of(url) == "file":
        return os.path.realpath(local_path(url))
    return url.rstrip("/")


def _within(url: str, root: str) -> bool:
    """Whether ``url`` is ``root`` or under it (both resolved)."""
    return url == root or url.startswith(root.rstrip("/") + "/")


_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def _check_destination(
    source: Source, d: str, written: list[str], opts: dict[str, Any], overwrite: bool
) -> list[str]:
    """Refuse, before anything is written, a destination that is the source or holds one
    of its files (whatever ``overwrite`` says), and an existing export at ``d`` unless
    ``overwrite``; the files of an old export at ``d`` to remove once the new one is
    written (a stale index or shard a reader of the directory would find)."""
    import fsspec

    src = _resolved(source.url)
    for url in [d, *written]:
        if _within(_resolved(url), src):
            raise CheckpointExistsError(
                f"export {source.url} -> {d}: the destination is the source or one of its "
                f"files ({url}); writing it would destroy the source. To fix: export to "
                "another destination"
            )
    fs, path = fsspec.core.url_to_fs(d, **opts)
    if d.endswith(".safetensors"):
        existing, stale = [d] if fs.exists(path) else [], []
    else:
        names = {u.rsplit("/", 1)[-1] for u in written}
        try:
            there = {str(p).rsplit("/", 1)[-1] for p in fs.ls(path, detail=False)}
        except (FileNotFoundError, NotADirectoryError):
            there = set()
        old = {n for n in there if n in (INDEX, SINGLE) or _SHARD.fullmatch(n)}
        existing = sorted(f"{d}/{n}" for n in old | (names & there))
        stale = [
            u for u in (f"{d}/{n}" for n in sorted(old - names))
            if not _within(_resolved(u), src)
        ]  # fmt: skip
    if existing and not overwrite:
        raise CheckpointExistsError(
            f"export to {d}: {existing[0]} already exists. To fix: pass overwrite=True "
            "(quire export --overwrite) to replace it, or export to another destination"
        )
    return stale


def _remove(urls: list[str], opts: dict[str, Any]) -> None:
    import fsspec

    for url in urls:
        fs, path = fsspec.core.url_to_fs(url, **opts)
        fs.rm(path)


def _source_meta(src: Source) -> dict[str, str]:
    m = src.metadata.get("__metadata__") if isinstance(src.metadata, dict) else None
    return {str(k): str(v) for k, v in (m or {}).items()}


def export(
    src: str | os.PathLike[str] | Source,
    dst: str | os.PathLike[str],
    *,
    format: str = "safetensors",
    select: Any = None,
    rename: Any = None,
    dtype: Any = None,
    max_shard_bytes: int | None = None,
    metadata: Mapping[str, str] | None = None,
    storage_options: dict[str, Any] | None = None,
    progress: Any = None,
    overwrite: bool = False,
    casting: str = "same_kind",
) -> list[str]:
    """Write any source (a quire checkpoint, safetensors, Orbax...) as safetensors.

    Parameters
    ----------
    src : URL or quire.sources.Source
    dst : URL
        A ``.safetensors`` object (one file), or a directory / prefix: ``model.safetensors``,
        or, beyond ``max_shard_bytes``, ``model-0000i-of-0000n.safetensors`` shards plus
        ``model.safetensors.index.json``.
    select : regex str, list of names, or callable(name) -> bool, optional
        Which tensors (dotted names, ``model.layers.0.w``) to write.
    rename : dict, list of (regex, replacement), or callable(name) -> str | None
        New dotted names (None drops the tensor).
    dtype : dtype, name or callable(name, dtype) -> dtype, optional
        Cast floating-point tensors (e.g. ``"bfloat16"``); other tensors stay as they are.
        The cast follows ``casting``, as a load's does (docs/jax-libraries.md, "Casts").
    max_shard_bytes : int, optional
        Largest shard (default 5 GiB, as HF writes).
    metadata : dict of str, optional
        The ``__metadata__`` (default: the source's, when it has one).
    progress : bool, callable or quire.progress.Progress, optional
        A progress bar (True), a callback taking a :class:`quire.progress.ProgressEvent`,
        or a :class:`quire.progress.Progress` (see :func:`quire.save`); the operation is
        ``"export"``, one object per tensor.
    casting : {"same_kind", "unsafe", "safe", "equiv", "no"}
        Which casts ``dtype`` may make (numpy's values): by default within a kind or up
        (float32 -> bfloat16, float -> complex); a cast that loses information (float -> int
        or bool, complex -> real) is a :class:`~quire.errors.LossyCastError` naming the
        tensor, both dtypes and the fix, raised before anything is written.
    overwrite : bool
        Replace an existing export at ``dst`` (the ``.safetensors`` file, or a directory's
        ``model.safetensors``, shards and index: those the new export does not write are
        removed once it is written; other files stay).  Without it an existing one is a
        :class:`~quire.CheckpointExistsError`, raised before anything is written.

    Returns
    -------
    list of str
        The URLs written (the index last).

    Raises
    ------
    quire.errors.LossyCastError
        ``dtype`` asks for a cast ``casting`` refuses.
    quire.TreeMismatchError
        Two tensors would be written under one name (key paths that join to it, or that
        ``rename`` gives it); the message names both key paths.
    quire.CheckpointExistsError
        ``dst`` is the source or holds one of its files (symlinks resolved; whatever
        ``overwrite`` says), or an export exists at ``dst`` and ``overwrite`` is False.
    """
    if format != "safetensors":
        raise ValueError(f"export: unknown format {format!r}; quire exports 'safetensors'")
    check_casting(casting)
    with opened(src, storage_options) as source:
        return _export(
            source, normalize(dst), select, rename, dtype, max_shard_bytes, metadata,
            storage_options, progress, overwrite, casting,
        )  # fmt: skip


def _export(
    source: Source,
    d: str,
    select: Any,
    rename: Any,
    dtype: Any,
    max_shard_bytes: int | None,
    metadata: Mapping[str, str] | None,
    storage_options: dict[str, Any] | None,
    progress: Any,
    overwrite: bool,
    casting: str,
) -> list[str]:
    tensors = _plan(source, select, rename, dtype, casting)
    limit = DEFAULT_SHARD if max_shard_bytes is None else int(max_shard_bytes)
    files = _files(d, _shards(tensors, limit), limit)
    index = f"{d.rstrip('/')}/{INDEX}" if len(files) > 1 else None
    opts = {k: v for k, v in (storage_options or {}).items() if k not in QUIRE_STORAGE_OPTIONS}
    written = [u for u, _ in files] + ([index] if index else [])
    stale = _check_destination(source, d, written, opts, overwrite)
    meta = dict(metadata if metadata is not None else _source_meta(source))
    total = sum(t.nbytes for t in tensors)
    with reporting(progress, "export", d, bytes_total=total, objects_total=len(tensors)):
        submit(_write_all(files, meta, opts, index)).result()
    _remove(stale, opts)
    return written
