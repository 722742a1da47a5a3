"""Test isolation guard (issue 29): a test must leave the process as it found it.

A training process lives for days; state one call leaves behind (an environment variable, a
global option, fsspec's registry or configuration, a logger's level, work still running on
quire's event loop, a pooled connection still checked out) changes how every later call
behaves.  The suite met exactly that: a fixture set ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT``
after another test had imported gcsfs, so which gs:// file-system class later tests got
depended on the order the files ran in.

For every test this plugin fingerprints that process-wide state before its set-up (module
fixtures it starts included) and after its tear-down, and turns any difference into an error
of that test naming what changed.  State set up once for the whole run belongs in
``pytest_configure`` (root ``conftest.py``), before any test runs.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

_BEFORE = pytest.StashKey[dict[str, Any]]()
# Environment variables that are not a test's doing: pytest's own, and those libraries set
# for themselves once per process on first use (jax: TPU_SKIP_MDS_QUERY; torch's compiler:
# TORCHINDUCTOR_CACHE_DIR).
_ENV_NOT_A_TESTS_DOING = frozenset(
    {
        "PYTEST_CURRENT_TEST",
        "KMP_INIT_AT_FORK",
        "TF_CPP_MIN_LOG_LEVEL",
        "GRPC_ENABLE_FORK_SUPPORT",
        "TPU_SKIP_MDS_QUERY",
        "TORCHINDUCTOR_CACHE_DIR",
    }
)


def _quire_loop_tasks() -> list[str]:
    io = sys.modules.get("quire._runtime.ioloop")
    loop = getattr(io, "_loop", None) if io is not None else None
    if loop is None or loop.is_closed():
        return []
    # Work submitted from another thread becomes a task only when the loop next runs its
    # callbacks: let it run them once, so nothing submitted is missed.
    if loop.is_running():
        asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop).result(timeout=30)
    try:
        tasks = asyncio.all_tasks(loop)
    except RuntimeError:  # the set changed while it was copied: look again
        tasks = asyncio.all_tasks(loop)
    return sorted(repr(t.get_coro()) for t in tasks if not t.done())


def _checked_out_connections() -> list[str]:
    # Asked through the public hook: each object-store backend class says how many of its
    # shared clients' pooled connections are checked out.
    backends = sys.modules.get("quire.backends")
    return [] if backends is None else backends.ObjectStoreBackend.checked_out_connections()


def _fingerprint() -> dict[str, Any]:
    state: dict[str, Any] = {
        "os.environ": {k: v for k, v in os.environ.items() if k not in _ENV_NOT_A_TESTS_DOING},
        "loggers": {
            name: lg.level
            for name, lg in [("", logging.getLogger()), *logging.root.manager.loggerDict.items()]
            if isinstance(lg, logging.Logger)
        },
    }
    cfg = sys.modules.get("quire._runtime.config")
    if cfg is not None:
        state["quire.configure()"] = repr(cfg._global)
    fsspec_config = sys.modules.get("fsspec.config")
    if fsspec_config is not None:
        state["fsspec.config.conf"] = repr(fsspec_config.conf)
    fsspec_registry = sys.modules.get("fsspec.registry")
    if fsspec_registry is not None:
        state["fsspec registry"] = {k: repr(v) for k, v in fsspec_registry._registry.items()}
    return state


def _settled(check: Any, timeout: float = 5.0) -> list[str]:
    """``check()`` until it finds nothing or ``timeout`` passes (work that is finishing)."""
    deadline = time.monotonic() + timeout
    found = check()
    while found and time.monotonic() < deadline:
        time.sleep(0.05)
        found = check()
    return list(found)


def _diff(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    out = []
    for what in sorted(set(before) | set(after)):
        a, b = before.get(what), after.get(what)
        if what == "fsspec registry" and a is None:
            continue  # fsspec imported by this test: registering on import is its own doing
        if what == "loggers" and isinstance(a, dict) and isinstance(b, dict):
            # Loggers that existed before: a library that makes its own logger on first use
            # (werkzeug, flask_cors under moto) may set its level; nobody else's changes.
            changed = {k: (a[k], b[k]) for k in a if k in b and a[k] != b[k]}
            out += [f"logger {k or 'root'!r} level {x} -> {y}" for k, (x, y) in changed.items()]
            continue
        if isinstance(a, dict) and isinstance(b, dict):
            for k in sorted(set(a) | set(b)):
                if what == "fsspec registry" and k not in a:
                    continue  # an implementation imported on first use (fsspec's cache)
                if a.get(k) != b.get(k):
                    out.append(f"{what}[{k!r}]: {a.get(k)!r} -> {b.get(k)!r}")
        elif a is not None and a != b:
            out.append(f"{what}: {a} -> {b}")
    return out


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    item.stash[_BEFORE] = _fingerprint()
    return (yield)


@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    result = yield
    before = item.stash.get(_BEFORE, None)
    if before is None:  # set-up failed before the fingerprint: nothing to compare
        return result
    problems = _diff(before, _fingerprint())
    problems += [f"still running on quire's event loop: {t}" for t in _settled(_quire_loop_tasks)]
    problems += _settled(_checked_out_connections)
    if problems:
        raise AssertionError(
            f"{item.nodeid} left process-wide state behind (later tests would run in it; "
            "restore it in the test, or set it once in pytest_configure):\n  "
            + "\n  ".join(problems)
        )
    return result
