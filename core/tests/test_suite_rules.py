"""The test suite's own rules (see CONTRIBUTING.md, "Where tests go"): tests leave no
temporary folders behind."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_tests_use_tmp_path_not_tempfile() -> None:
    """The suite must not leave temporary directories behind: tests use ``tmp_path``."""
    offenders = []
    for d in ("core/tests", "tests", "plugins", "backends"):
        for f in (REPO / d).rglob("test*.py"):
            text = f.read_text()
            if re.search(r"tempfile\.(mkdtemp|mkstemp|TemporaryDirectory)\(", text):
                offenders.append(str(f.relative_to(REPO)))
    assert offenders == [], offenders
    assert not (REPO / "core/tests/test_partial.py").read_text().count("quire-model-")
