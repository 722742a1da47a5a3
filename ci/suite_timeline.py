"""Where the test suite's time goes: a pytest plugin that writes a timeline, and its report.

Record (each xdist worker writes ``DIR/<worker>.txt``; the folder must exist and be empty)::

    mkdir -p /tmp/timeline
    QUIRE_TIMELINE=/tmp/timeline PYTHONPATH=ci .venv/bin/python -m pytest -n 2 \\
        --dist loadgroup -p suite_timeline

Report (per module: the sum of its tests' wall time, the CPU seconds of the test process
and of the child processes it reaped while they ran)::

    .venv/bin/python ci/suite_timeline.py /tmp/timeline [--top 40]

Each line of a timeline is ``S|E <unix time> <own CPU s> <children's CPU s> <test id>``:
a test's start and end.  Children forked by the tests' fork server
(``core/tests/forkserver.py``) are the server's to reap, so their CPU is not counted.
"""

from __future__ import annotations

import argparse
import collections
import os
import resource
import time
from pathlib import Path
from typing import IO, Any

_out: IO[str] | None = None
_controller = False  # pytest-xdist's controlling process: its workers write the timeline


def pytest_configure(config: Any) -> None:
    global _controller
    worker = "PYTEST_XDIST_WORKER" in os.environ
    _controller = not worker and bool(getattr(config.option, "numprocesses", None))


def _cpu() -> tuple[float, float]:
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, kids.ru_utime + kids.ru_stime


def _write(kind: str, nodeid: str) -> None:
    global _out
    if _controller:
        return
    if _out is None:
        folder = Path(os.environ.get("QUIRE_TIMELINE", "timeline"))
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        _out = open(folder / f"{worker}.txt", "a", buffering=1)  # noqa: SIM115
    own, kids = _cpu()
    _out.write(f"{kind} {time.time():.3f} {own:.3f} {kids:.3f} {nodeid}\n")


def pytest_runtest_logstart(nodeid: str, location: Any) -> None:
    _write("S", nodeid)


def pytest_runtest_logfinish(nodeid: str, location: Any) -> None:
    _write("E", nodeid)


def report(folder: Path, top: int) -> str:
    """The timeline's summary: the span, the totals, and the ``top`` modules by wall time."""
    wall: dict[str, float] = collections.defaultdict(float)
    own: dict[str, float] = collections.defaultdict(float)
    kids: dict[str, float] = collections.defaultdict(float)
    count: collections.Counter[str] = collections.Counter()
    times: list[float] = []
    ends: dict[str, float] = {}
    for path in sorted(folder.glob("*.txt")):
        started: dict[str, tuple[float, float, float]] = {}
        for line in path.read_text().splitlines():
            kind, t, a, b, node = line.split(" ", 4)
            now = (float(t), float(a), float(b))
            times.append(now[0])
            if kind == "S":
                started[node] = now
                continue
            t0, a0, b0 = started.pop(node)
            module = node.split("::")[0]
            wall[module] += now[0] - t0
            own[module] += now[1] - a0
            kids[module] += now[2] - b0
            count[module] += 1
            ends[path.stem] = now[0]
    if not times:
        return f"no timeline in {folder}"
    t0 = min(times)
    lines = [
        f"span {max(times) - t0:.0f} s; workers end at "
        + ", ".join(f"{w} {t - t0:.0f} s" for w, t in sorted(ends.items())),
        f"tests' wall time {sum(wall.values()):.0f} s, own CPU {sum(own.values()):.0f} s, "
        f"children's CPU {sum(kids.values()):.0f} s",
        f"{'wall':>7} {'own':>6} {'kids':>6} {'tests':>5}  module",
    ]
    for module, w in sorted(wall.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(
            f"{w:7.1f} {own[module]:6.1f} {kids[module]:6.1f} {count[module]:5d}  {module}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Summarize a test-suite timeline.")
    ap.add_argument("folder", type=Path)
    ap.add_argument("--top", type=int, default=40)
    args = ap.parse_args(argv)
    print(report(args.folder, args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
