"""How to install a quire distribution: its published name, and, when quire runs from a
source checkout, the checkout folder that installs it."""

from __future__ import annotations

import functools
import pathlib

#: Where each workspace member lives in a checkout of the quire repository.
MEMBERS = {
    "quire": "core",
    "quire-s3": "backends/s3",
    "quire-gcs": "backends/gcs",
    "quire-torch": "plugins/torch",
    "quire-orbax": "plugins/orbax",
    "quire-grain": "plugins/grain",
}


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
