"""quire's own distributions and how to install them.

:data:`FIRST_PARTY_PLUGINS` is the one table of the first-party plugins: each one's
distribution, its folder in a checkout of the quire repository and the entry points it
provides.  The plugin registries' install hints (:mod:`quire._runtime.registry`), the
distributions quire vouches for in a checkpoint's ``plugins`` map and the checkout folders of
:func:`install_hint` are read from it; ``tests/test_install_docs.py`` checks it against every
member's ``pyproject.toml``.  A new first-party plugin is a folder plus one row here.
"""

from __future__ import annotations

import functools
import pathlib
from dataclasses import dataclass


@dataclass(frozen=True)
class FirstPartyPlugin:
    """One first-party plugin distribution.

    Attributes
    ----------
    distribution : str
        Its published name (``"quire-s3"``): what ``pip install`` takes.
    folder : str
        Its folder in a checkout of the quire repository (``"backends/s3"``).
    provides : tuple of str
        The entry points it declares, as ``"group:name"`` (``"quire.backends:s3"``): a
        missing plugin of that name is answered with "install <distribution>".
    """

    distribution: str
    folder: str
    provides: tuple[str, ...]


#: The first-party plugins, one row each.
FIRST_PARTY_PLUGINS = (
    FirstPartyPlugin("quire-s3", "backends/s3", ("quire.backends:s3", "quire.backends:s3a")),
    FirstPartyPlugin("quire-gcs", "backends/gcs", ("quire.backends:gs", "quire.backends:gcs")),
    FirstPartyPlugin("quire-torch", "plugins/torch", ("quire.leaf_handlers:torch",)),
    FirstPartyPlugin("quire-orbax", "plugins/orbax", ("quire.sources:orbax",)),
    FirstPartyPlugin("quire-grain", "plugins/grain", ("quire.checkpointables:grain",)),
)

#: Where each workspace member lives in a checkout of the quire repository.
MEMBERS = {"quire": "core", **{p.distribution: p.folder for p in FIRST_PARTY_PLUGINS}}


def provider(group: str, name: str) -> str | None:
    """The first-party distribution that provides entry point ``name`` of ``group``, or None.

    Parameters
    ----------
    group, name : str
        An entry-point group (``"quire.backends"``) and a name in it (``"s3"``).
    """
    for p in FIRST_PARTY_PLUGINS:
        if f"{group}:{name}" in p.provides:
            return p.distribution
    return None


@functools.cache
def checkout_root() -> pathlib.Path | None:
    """The repository root when quire is imported from a source checkout, else None."""
    here = pathlib.Path(__file__).resolve()
    # <root>/core/src/quire/_runtime/install.py
    root = here.parents[4] if len(here.parents) > 4 else None
    if root is not None and (root / "core" / "pyproject.toml").is_file():
        return root
    return None


def install_hint(dist: str) -> str:
    """``"pip install quire-s3"``, plus the local path when running from a checkout."""
    root = checkout_root()
    rel = MEMBERS.get(dist)
    if root is not None and rel is not None and (root / rel / "pyproject.toml").is_file():
        return f"pip install {dist}; from this source checkout: pip install -e {root / rel}"
    return f"pip install {dist}"
