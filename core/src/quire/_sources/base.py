"""The source contract: :class:`Source`, a checkpoint of any format opened read-only as a
lazy tree.  Published, with the call order a plugin implements, by :mod:`quire.sources`."""

from __future__ import annotations

import abc
from typing import Any, ClassVar

from quire._format.tree import keystr, walk
from quire._sources.lazy import LazyValue


class Source(abc.ABC):
    """A checkpoint opened read-only as a lazy tree.

    Attributes
    ----------
    format : str (class attribute)
        The format id (the entry-point name), e.g. ``"safetensors"``.
    url : str
        What was opened.
    tree : pytree
        Nested dicts / lists / tuples; array leaves are :class:`LazyArray`, inline leaves
        plain values.
    metadata : dict
        Format-specific metadata (JSON-like), e.g. safetensors' ``__metadata__``.
    """

    format: ClassVar[str]
    url: str
    tree: Any
    metadata: dict[str, Any]

    @classmethod
    @abc.abstractmethod
    def detect(cls, url: str, storage_options: dict[str, Any]) -> bool:
        """Whether ``url`` is in this format (cheap; may read one small object).

        Parameters
        ----------
        url : str
            A normalised URL (a local path or any fsspec URL).
        storage_options : dict
            fsspec options for the backend.

        Returns
        -------
        bool
        """

    @classmethod
    @abc.abstractmethod
    def open(cls, url: str, storage_options: dict[str, Any]) -> Source:
        """Open ``url`` (reads headers / metadata only).

        Parameters
        ----------
        url : str
            A URL that :meth:`detect` accepted.
        storage_options : dict
            fsspec options for the backend.

        Returns
        -------
        Source
            With :attr:`tree` of :class:`LazyArray` leaves and :attr:`metadata`.
        """

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release clients or files (optional)."""

    def __enter__(self) -> Source:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def leaves(self) -> list[tuple[str, Any]]:
        """``("/"-joined key path, leaf)`` for every leaf of :attr:`tree`, in tree order."""
        root = walk(self.tree, _is_source_leaf, what=f"source {self.url}")
        return [(keystr(n.path), n.value) for n in root.leaves()]

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.format} {self.url}>"


def _is_source_leaf(x: Any) -> bool:
    return isinstance(x, LazyValue) or not isinstance(x, dict | list | tuple)
