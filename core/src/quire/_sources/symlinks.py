"""Which local file a read-only source may read when the name it was given is a symbolic link.

quire's own checkpoints never follow a link (the local backend opens every component with
``O_NOFOLLOW``).  Sources read files other tools wrote, and the most common place users'
safetensors live, a Hugging Face hub cache snapshot, is made of links::

    <cache>/models--org--name/blobs/<hash>
    <cache>/models--org--name/snapshots/<revision>/model.safetensors -> ../../blobs/<hash>

The rule: a link is followed when its target (every link resolved) stays inside the tree
the user named, or, for a directory inside a hub cache snapshot, inside that repository's
folder (``models--*``, ``datasets--*`` or ``spaces--*``, the parent of ``snapshots``) or the
cache's shared blob store (:func:`allowed_trees`);
anything else is refused with :class:`~quire.errors.CorruptCheckpointError`.  So is a
target that is not a regular file (a FIFO would block ``open(2)``; a device never ends).
The resolved file is then read through a local backend rooted at the allowed tree, whose
walk follows no further link: a link swapped after the check cannot lead elsewhere.
"""

from __future__ import annotations

import os
import stat

from quire._store.base import Backend
from quire._store.local import LocalBackend
from quire.errors import CorruptCheckpointError

__all__ = ["HUB_REPO_PREFIXES", "allowed_trees", "resolve_local"]

HUB_REPO_PREFIXES = ("models--", "datasets--", "spaces--")
SHARED_BLOBS_MARKER = ".huggingface-shared-blobs"


def allowed_trees(root: str) -> list[str]:
    """The real paths a link under ``root`` may lead into: ``root`` itself and, when
    ``root`` lies in ``<cache>/<repo>/snapshots/<revision>/``, the hub repository folder
    and the cache-wide shared blob store ``<cache>/blobs`` (huggingface_hub >= 1.x links a
    repository's blobs there; a directory marked by ``.huggingface-shared-blobs``)."""
    real = os.path.realpath(root)
    out = [real]
    parts = real.split(os.sep)
    for i in range(len(parts) - 2, 0, -1):
        if parts[i] == "snapshots" and parts[i - 1].startswith(HUB_REPO_PREFIXES):
            out.append(os.sep.join(parts[:i]))
            shared = os.sep.join([*parts[: i - 1], "blobs"])
            try:  # a real directory holding the store's marker, no link on the way
                ok = stat.S_ISDIR(os.lstat(shared).st_mode) and stat.S_ISREG(
                    os.lstat(os.path.join(shared, SHARED_BLOBS_MARKER)).st_mode
                )
            except OSError:
                ok = False
            if ok:
                out.append(shared)
            break
    return out


def _inside(path: str, tree: str) -> bool:
    return path == tree or path.startswith(tree.rstrip(os.sep) + os.sep)


def resolve_local(backend: Backend, key: str, where: str) -> tuple[Backend, str]:
    """The backend and key through which ``key`` of ``backend`` is read.

    ``(backend, key)`` unchanged for a non-local backend or a key with no link on its way;
    for a link whose target is allowed (see the module docstring), a local backend rooted
    at the allowed tree and the target's path in it.

    Raises
    ------
    CorruptCheckpointError
        The key leads outside the allowed trees, or to something that is not a regular
        file (a FIFO, socket, device or directory); ``where`` names it in the message.
    FileNotFoundError
        Nothing exists at ``key`` (a dangling link included).
    """
    if not isinstance(backend, LocalBackend):
        return backend, key
    path = os.path.join(backend.root, *key.split("/"))
    real = os.path.realpath(path)
    try:
        mode = os.stat(real).st_mode
    except FileNotFoundError:
        raise
    except OSError as e:  # a link loop, a name too long
        raise CorruptCheckpointError(
            f"{where}: cannot be resolved ({e.strerror}); replace it with the file itself"
        ) from None
    if not stat.S_ISREG(mode):
        raise CorruptCheckpointError(
            f"{where}: not a regular file (a FIFO, socket, device or directory); "
            "replace it with the file it should be"
        )
    if real == os.path.normpath(path):
        return backend, key  # no link on the way
    for tree in allowed_trees(backend.root):
        if _inside(real, tree) and real != tree:
            rel = os.path.relpath(real, tree).replace(os.sep, "/")
            return LocalBackend(tree, backend.storage_options), rel
    raise CorruptCheckpointError(
        f"{where}: a symbolic link to {real}, outside {os.path.realpath(backend.root)} (and not "
        "a hub cache snapshot's blob); quire follows links only within the directory it opens "
        "or a Hugging Face cache repository: copy the file into the directory instead"
    )
