"""Session-wide checks: the suite leaves no temporary directories behind (issue 14), and no
test leaves process-wide state behind for the next (issue 29: ``isolation_guard.py``).

Everything the suite (and the processes it starts) creates through :mod:`tempfile` goes into
one private folder for the session (``TMPDIR`` and ``tempfile.tempdir`` point there;
pytest's own ``tmp_path`` folders stay where pytest keeps them).  At the end, anything left
in it is listed; a leftover named ``quire-*`` (what quire's tests, examples and benchmarks
call their temporary folders) fails the session.  The private folder is then removed, so a
run leaves nothing in the machine's temporary directory either way.

Runs in parallel (other checkouts, other sessions) do not disturb the check: each looks only
at its own private folder.  Under pytest-xdist each worker has its own (inside the
controller's) and hands what its tests left to the controller, which reports for the run.

Also the Hypothesis profiles of the generated tests (docs/reliability.md, "Generated round
trips"): ``ci``, the default, derandomized (the same examples every run) with bounded counts
and no deadline (a loaded 2-core machine makes single examples slow, not wrong); ``deep``,
fresh randomness and ``QUIRE_DEEP_EXAMPLES`` examples per test (default 1000), failures kept
in ``.hypothesis/`` so they are replayed first next time.  Pick one with
``--hypothesis-profile deep`` or ``QUIRE_HYPOTHESIS_PROFILE=deep``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

_SLOW_IS_FINE = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]
settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    max_examples=20,
    print_blob=True,
    suppress_health_check=_SLOW_IS_FINE,
)
settings.register_profile(
    "deep",
    derandomize=False,
    deadline=None,
    max_examples=int(os.environ.get("QUIRE_DEEP_EXAMPLES", "1000")),
    print_blob=True,
    suppress_health_check=_SLOW_IS_FINE,
)
settings.load_profile(os.environ.get("QUIRE_HYPOTHESIS_PROFILE", "ci"))

pytest_plugins = ["isolation_guard"]

# Process-wide settings the whole run shares, made before any test (or import) can see the
# defaults: gcsfs reads this one once, when first imported, to pick fsspec's gs:// class
# (its experimental variant probes each bucket over gRPC, ~60 s per call against the GCS
# emulator).  Set here, not by a fixture: a fixture that sets it after another test imported
# gcsfs makes the outcome depend on file order (isolation_guard.py reports such changes).
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

_PRIVATE = pytest.StashKey[Path]()
_SAVED = pytest.StashKey[tuple[str | None, str | None, str | None]]()
_LEFT = pytest.StashKey[list[str]]()
_WORKERS_LEFT = pytest.StashKey[list[str]]()


def pytest_configure(config: pytest.Config) -> None:
    real = tempfile.gettempdir()
    # pytest's basetemp (tmp_path) stays in the real temporary directory, managed by pytest.
    saved = (os.environ.get("TMPDIR"), os.environ.get("PYTEST_DEBUG_TEMPROOT"), tempfile.tempdir)
    os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", real)
    private = Path(tempfile.mkdtemp(prefix="quire-suite-tmp-", dir=real))
    os.environ["TMPDIR"] = str(private)
    tempfile.tempdir = str(private)
    config.stash[_PRIVATE] = private
    config.stash[_SAVED] = saved


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object) -> None:
    """Under pytest-xdist, in the controller: what a worker's tests left behind."""
    left = getattr(node, "workeroutput", {}).get("quire_left", [])
    node.config.stash.setdefault(_WORKERS_LEFT, []).extend(left)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    private = config.stash.get(_PRIVATE, None)
    if private is None:
        return
    left = sorted(p.name for p in private.iterdir()) if private.is_dir() else []
    # An xdist worker hands its list to the controller, which reports for the run (the
    # workers' private folders live inside the controller's and are gone by then).
    workeroutput = getattr(config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["quire_left"] = left
    left += config.stash.get(_WORKERS_LEFT, [])
    config.stash[_LEFT] = left
    tmpdir, temproot, tempdir = config.stash[_SAVED]
    for key, value in (("TMPDIR", tmpdir), ("PYTEST_DEBUG_TEMPROOT", temproot)):
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    tempfile.tempdir = tempdir
    shutil.rmtree(private, ignore_errors=True)
    if any(name.startswith("quire-") for name in left) and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    left = terminalreporter.config.stash.get(_LEFT, [])
    if not left:
        return
    quire_dirs = [n for n in left if n.startswith("quire-")]
    terminalreporter.section("temporary files left behind", red=bool(quire_dirs))
    for name in left:
        terminalreporter.line(f"  {name}")
    if quire_dirs:
        terminalreporter.line(
            f"FAILED: the suite left {len(quire_dirs)} quire-* temporary folder(s); use "
            "pytest's tmp_path (or remove what a test creates)"
        )
