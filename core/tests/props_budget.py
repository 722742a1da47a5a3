"""How many examples a generated test runs under the Hypothesis profile in effect.

The profiles are registered in the repository's ``conftest.py``: ``ci`` (the default: a fixed
seed, the example counts given here, no deadline) and ``deep`` (fresh randomness, many
examples).  A generated test says how many examples it runs in CI; under any other profile it
runs the profile's ``max_examples``.
"""

from __future__ import annotations

from typing import Any

from hypothesis import settings


def examples(ci: int, **more: Any) -> Any:
    """``@settings(...)`` for a generated test: ``ci`` examples under the ``ci`` profile, the
    profile's own count otherwise; ``more``: other settings (e.g. ``stateful_step_count``)."""
    if settings.get_current_profile_name() == "ci":
        return settings(max_examples=ci, **more)
    return settings(**more)
