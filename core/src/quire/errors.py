"""quire's error hierarchy.

Every error derives from :class:`QuireError` and mixes in the builtin a caller would
naturally catch (``FileNotFoundError``, ``FileExistsError``, ``ValueError``,
``TypeError``).  Messages name the URL, the key path and the fix.
"""

from __future__ import annotations

__all__ = [
    "BucketNotFoundError",
    "CheckpointChangedError",
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "CodecError",
    "CorruptCheckpointError",
    "EndpointUnreachableError",
    "IncompleteCheckpointError",
    "LossyCastError",
    "MultiProcessError",
    "ObjectStoreError",
    "ObjectStorePermissionError",
    "PeerError",
    "PluginError",
    "QuireError",
    "SnapshotError",
    "TreeMismatchError",
    "UnreadableRecordError",
    "UnsupportedLeafError",
]


class QuireError(Exception):
    """Base class of every error quire raises on purpose."""


class CheckpointNotFoundError(QuireError, FileNotFoundError):
    """No committed checkpoint (no ``quire.json``) exists at the URL."""


class CheckpointExistsError(QuireError, FileExistsError):
    """A checkpoint already exists at the URL (or a concurrent writer committed first)."""


class CorruptCheckpointError(QuireError, ValueError):
    """Checksum mismatch, truncated data, or a malformed / unknown-version record."""


class UnreadableRecordError(CorruptCheckpointError):
    """quire built a record (``quire.json``, a partial-save journal version, a
    Checkpointer's root record) that its own load would refuse, and did not publish it.

    Before every commit the record goes through the very check a load runs on it; this is
    raised when it fails, before anything is published: the previous checkpoint (or
    journal version) is untouched and loads as before, and the data written for the
    refused record is removed (or left for ``quire gc``).  It is a defect of quire or of
    the plugin that wrote the named leaf: the message names the URL, the key path of the
    value the check refused and why; please report it.
    """


class IncompleteCheckpointError(UnreadableRecordError):
    """quire was about to publish a record (``quire.json``, a partial-save journal version)
    one of whose arrays misses an object a load needs - a chunk (or zarr shard), or its
    ``zarr.json`` - that no chunk index of the record holds and no object stores; it did
    not publish it.

    Raised before the commit point, as :class:`UnreadableRecordError` is: the previous
    checkpoint (or journal version) is untouched and loads as before.  A writer lost the
    chunk: a defect of quire or of the plugin that wrote the leaf (please report it);
    saving again writes every chunk anew.

    Parameters
    ----------
    message : str
        The URL, the leaf's key path, the chunk and the fix.
    url : str, optional
        Where the record was to be published.
    path : str, optional
        The key path of the first leaf found incomplete (``keystr`` form); None when every
        chunk was found but a chunk index the record names is missing or damaged.
    key : str, optional
        The missing object's zarr key (``d/<txid>/<location>/c/<i>/<j>``, or
        ``.../zarr.json``), relative to ``url``.
    chunk : tuple of int, optional
        Its index in the array's chunk grid (None for a ``zarr.json``).
    missing : int
        How many objects are missing in all (every leaf).
    """

    def __init__(
        self,
        message: str,
        *,
        url: str | None = None,
        path: str | None = None,
        key: str | None = None,
        chunk: tuple[int, ...] | None = None,
        missing: int = 0,
    ) -> None:
        super().__init__(message)
        self.url = url
        self.path = path
        self.key = key
        self.chunk = chunk
        self.missing = missing


class CheckpointChangedError(QuireError, RuntimeError):
    """The checkpoint was overwritten (or deleted) while it was being loaded, again and
    again: the load re-read ``quire.json`` and retried a few times, then gave up.  Nothing
    is damaged; load again once the writer is done."""


class TreeMismatchError(QuireError, ValueError):
    """The abstract tree does not match the checkpoint (missing, extra or mis-shaped keys).

    Attributes
    ----------
    missing, extra, mismatched : list of str
        Key paths in the checkpoint but not in the target, in the target but not in the
        checkpoint, and present in both with incompatible shapes.
    """

    def __init__(
        self,
        message: str,
        *,
        missing: list[str] | None = None,
        extra: list[str] | None = None,
        mismatched: list[str] | None = None,
    ) -> None:
        super().__init__(message)
        self.missing = list(missing or [])
        self.extra = list(extra or [])
        self.mismatched = list(mismatched or [])


class LossyCastError(TreeMismatchError):
    """The target asks for a dtype that the saved values do not fit without loss: a float
    loaded as an int, a complex as a real, a number as a bool, or an integer narrowed past
    the range of its values (``casting="same_kind"``, the default, refuses these).

    A :class:`TreeMismatchError`: the target and the checkpoint disagree, as with a shape,
    and the message lists each such leaf with both dtypes, the key path and the
    ``casting=`` value that allows the cast.

    Attributes
    ----------
    mismatched : list of str
        One entry per refused leaf: its key path, both dtypes and why.
    missing, extra : list of str
        Empty (as for :class:`TreeMismatchError`).
    """


class UnsupportedLeafError(QuireError, TypeError):
    """A leaf of the tree has a type no installed leaf handler can save."""


class CodecError(QuireError, ValueError):
    """A codec chain quire will not write: a codec with no place in a zarr v3 chain (an
    array-to-bytes codec other than ``bytes``, ``sharding_indexed``), one that decodes to
    Python objects (``numcodecs.pickle`` and the like), a configuration its codec refuses,
    or a lossy codec on a leaf that must stay exact (a PRNG key).  Raised before anything
    is written.  A record that names such a codec is a :class:`CorruptCheckpointError`."""


class SnapshotError(QuireError, TypeError):
    """An async save could not capture a checkpointable unit's state at the call: its
    snapshot step failed, or it has none and writing it at the call failed.  Raised before
    the call returns; nothing is saved."""


class PluginError(QuireError):
    """A plugin (or the optional package of an extra, such as ``quire[peers]``) is missing,
    failed to import, or two distributions claim the same name.

    Parameters
    ----------
    message : str
        What went wrong and the fix.
    group, name : str, optional
        The entry-point group (``quire.leaf_handlers``, ``quire.codecs``, ...) and the
        plugin name at fault, when there is one; kept as attributes of the same names.
    """

    def __init__(self, message: str, *, group: str | None = None, name: str | None = None) -> None:
        super().__init__(message)
        self.group = group
        self.name = name


class MultiProcessError(QuireError, RuntimeError):
    """Another JAX process failed, disagreed, or stopped responding during a collective
    operation (a save, a partial save, a finalize); nothing was committed unless the
    message says the commit started."""


class PeerError(MultiProcessError):
    """Fetching bytes from another process's local tier over TLS failed: the peer refused
    the request (a path outside its tier, not a regular file, larger than asked for), its
    certificate is not the pinned one of the process meant (or it did not accept this
    process's), the TLS connection failed its checks, the answer was short, the peer did
    not answer within the deadline, or what it published in the key-value store for the
    link (its address, its certificate) is malformed.  The message names the peer's
    address (or the process), the path and the fix; a caller treats that peer as lost and
    reads from another holder."""


class ObjectStoreError(QuireError, OSError):
    """An object-store request failed for good: a permanent error, or transient ones
    past the backend's retry deadline (base of each backend's own error, e.g. ``S3Error``)."""


class ObjectStorePermissionError(ObjectStoreError, PermissionError):
    """The store refused the request (401 / 403, unknown key id, no credentials)."""


class BucketNotFoundError(ObjectStoreError, FileNotFoundError):
    """The bucket of the URL does not exist."""


class EndpointUnreachableError(ObjectStoreError, ConnectionError):
    """The store's endpoint cannot be reached: its host name does not resolve."""
