"""What quire's tools return: :func:`quire.verify` a :class:`VerifyReport` (with a
:class:`VerifyProblem` per damaged object), :func:`quire.copy` a :class:`CopyResult`,
:func:`quire.diff` a :class:`DiffReport`.  The types are here for annotations and
``isinstance``; the functions are at the top of the package.
"""

from __future__ import annotations

from quire._ops import CopyResult, VerifyProblem, VerifyReport
from quire._sources.diff import DiffReport

__all__ = ["CopyResult", "DiffReport", "VerifyProblem", "VerifyReport"]
