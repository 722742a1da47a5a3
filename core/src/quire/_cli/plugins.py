"""``quire plugins``: the installed plugins of every entry-point group, with their status
(each imported, so a broken one shows its error)."""

from __future__ import annotations

import argparse

from quire._cli.common import EXIT_OK
from quire._runtime.registry import registries


def cmd_plugins(args: argparse.Namespace) -> int:
    reports = {group: reg.report(load=True) for group, reg in registries.items()}
    rows = [i for infos in reports.values() for i in infos]
    wn = max([len(i.name) for i in rows] + [12])
    wd = max([len(i.distribution) for i in rows] + [12])
    wv = max([len(i.version) for i in rows] + [7])
    for group, infos in reports.items():
        print(f"{group}:")
        if not infos:
            print("  (none)")
        for i in infos:
            print(f"  {i.name:<{wn}}  {i.distribution:<{wd}}  {i.version or '-':<{wv}}  {i.status}")
    return EXIT_OK
