"""``quire.verify`` and ``quire.copy``: the library side of ``quire verify`` and ``quire cp``."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, replace
from typing import Any

from quire._engine.copying import CopyResult, copy_checkpoint, same_checkpoint
from quire._engine.verify import VerifyProblem, stored
from quire._engine.verify import verify as verify_objects
from quire._format import describe as _describe
from quire._runtime import progress as _progress
from quire._runtime.ioloop import submit
from quire._sources.convert import convert
from quire._sources.native import QuireSource
from quire._sources.opening import open as open_source
from quire._store.url import normalize
from quire.errors import CheckpointExistsError, CorruptCheckpointError

__all__ = ["CopyResult", "VerifyProblem", "VerifyReport", "copy", "verify"]


@dataclass(frozen=True)
class VerifyReport:
    """What :func:`quire.verify` found.

    Attributes
    ----------
    url : str
        The checkpoint checked.
    arrays, chunks, nbytes : int
        Array leaves, their chunks (the unit ``quire info`` and ``quire cp`` count) and their
        bytes, as the record describes them: of every pytree unit (a checkpoint of
        :func:`quire.save_checkpointables` has several).
    problems : tuple of VerifyProblem
        One per damaged object: ``path`` (the leaf's key path), ``object`` (the stored
        object or pack range), ``error`` and ``unit``; empty when the checkpoint is whole.
    units : dict
        Every unit checked, by name, with its kind (``"pytree"``, ``"json"`` or a
        checkpointable handler id), as in ``quire.metadata(url).units``.
    versions : int
        For a partial save (``quire.partial``), its journal's versions; 0 for a committed
        checkpoint.
    """

    url: str
    arrays: int
    chunks: int
    nbytes: int
    problems: tuple[VerifyProblem, ...]
    units: dict[str, str] = field(default_factory=dict)
    versions: int = 0

    @property
    def ok(self) -> bool:
        """Whether every object checked out."""
        return not self.problems

    def raise_if_damaged(self) -> None:
        """Raise :class:`quire.CorruptCheckpointError` naming the damaged objects, if any."""
        if self.problems:
            shown = "; ".join(f"{p.path}: {p.object}: {p.error}" for p in self.problems[:5])
            more = f" (and {len(self.problems) - 5} more)" if len(self.problems) > 5 else ""
            raise CorruptCheckpointError(
                f"{self.url}: {len(self.problems)} object(s) failed verification: {shown}{more}"
            )


def verify(
    url: str | os.PathLike[str],
    *,
    storage_options: dict[str, Any] | None = None,
    progress: Any = None,
) -> VerifyReport:
    """Check every stored object of the checkpoint at ``url`` against its checksums.

    Each leaf's handler checks the objects it owns (chunks, packs' byte ranges, array
    headers, a third-party handler's own objects), in every unit, so a checkpoint whose
    data changed after the save, or whose chunks were swapped, is found without loading
    it.  A partial save (``quire.partial``, not finalized) is checked too: the data of its
    journal's current state.

    Parameters
    ----------
    url : str or os.PathLike
        The checkpoint (any backend).
    storage_options : dict, optional
        fsspec / backend options for ``url``.
    progress : bool, callable or quire.progress.Progress, optional
        As for :func:`quire.save` (the operation is ``"verify"``; objects are chunks).

    Returns
    -------
    VerifyReport
        Its ``ok`` says whether the checkpoint is whole; ``raise_if_damaged()`` raises.

    Raises
    ------
    CheckpointNotFoundError
        Nothing is committed (or partially saved) at ``url``.
    CorruptCheckpointError
        The commit record itself is damaged (damaged data is reported, not raised).
    """

    u = normalize(url)
    what = submit(stored(u, storage_options)).result()
    c = _describe.counts(list(what.trees.values()))
    with _progress.reporting(progress, "verify", u, bytes_total=c.nbytes,
                             objects_total=c.chunks, objects_name="chunks"):  # fmt: skip
        _, problems = submit(verify_objects(u, storage_options)).result()
    return VerifyReport(u, c.arrays, c.chunks, c.nbytes, tuple(problems), what.units, what.versions)


def _counts(url: str, storage_options: dict[str, Any] | None) -> _describe.Counts:
    """Arrays, chunks and bytes of every pytree unit of the checkpoint at ``url``."""
    return _describe.counts(list(submit(stored(url, storage_options)).result().trees.values()))


def copy(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    overwrite: bool = False,
    storage_options: dict[str, Any] | None = None,
    dst_options: dict[str, Any] | None = None,
    progress: Any = None,
) -> CopyResult:
    """Copy a checkpoint to ``dst``, or convert one in another format into a quire one.

    A quire checkpoint is copied object by object (packs as packs), each object checked
    against its checksums as it is read; the record is written last, so ``dst`` holds
    either nothing new or the whole copy.  Any other source that :func:`quire.open` reads
    (a safetensors file, an HF directory, an Orbax checkpoint with quire-orbax installed)
    is streamed into one ordinary save (host memory within the byte budget plus one
    tensor) and verified after.

    Parameters
    ----------
    src, dst : str or os.PathLike
        URLs on any backends.
    overwrite : bool, default False
        Replace a checkpoint at ``dst`` (atomically).
    storage_options : dict, optional
        Options for ``src`` (and for ``dst`` unless ``dst_options`` is given).
    dst_options : dict, optional
        Options for ``dst``.
    progress : bool, callable or quire.progress.Progress, optional
        As for :func:`quire.save` (the operation is ``"cp"``, then ``"verify"`` for a
        conversion).

    Returns
    -------
    CopyResult
        ``src``, ``dst``, ``objects`` and ``bytes`` written, ``verified`` objects, the
        array ``chunks``, ``arrays`` and ``nbytes``, ``seconds`` and the source's
        ``format``.

    Raises
    ------
    CheckpointExistsError
        ``dst`` holds a checkpoint and ``overwrite`` is False, or ``dst`` is ``src``
        (whatever ``overwrite``).
    CorruptCheckpointError
        An object of ``src`` failed its check (nothing is committed at ``dst``).
    """

    s, d = normalize(src), normalize(dst)
    if s == d:  # a quire checkpoint or a converted source alike; before anything is opened
        raise CheckpointExistsError(same_checkpoint(d))
    so = storage_options
    do = dst_options if dst_options is not None else storage_options
    t0 = time.perf_counter()
    if not QuireSource.detect(s, dict(so or {})):
        with open_source(s, **(so or {})) as source:
            nbytes, checked = convert(source, d, overwrite=overwrite, dst_options=do,
                                      progress=progress)  # fmt: skip
        c = _counts(d, do)
        return CopyResult(s, d, checked, nbytes, checked, time.perf_counter() - t0, c.chunks,
                          c.arrays, c.nbytes, source.format)  # fmt: skip
    c = _counts(s, so)
    with _progress.reporting(progress, "cp", s, objects_total=c.chunks,
                             objects_name="chunks") as rep:  # fmt: skip
        last = [0, 0]

        def step(chunks: int, total: int, nbytes: int, est: int) -> None:
            if rep is not None:  # chunks, as verify and info count them
                rep.set_total(est, total)
                rep.advance(nbytes - last[0], chunks - last[1])
                last[:] = [nbytes, chunks]

        res = submit(copy_checkpoint(s, d, overwrite=overwrite, src_options=so,
                                     dst_options=do, progress=step)).result()  # fmt: skip
    return replace(res, arrays=c.arrays, nbytes=c.nbytes)
