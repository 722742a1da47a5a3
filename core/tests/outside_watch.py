"""Test helper: an inotify watch that reports every open of files outside a checkpoint.

Python's audit hook sees ``open`` and ``os.open`` but not what C++ (tensorstore) or a raw
system call (the local backend's ``openat2``) opens; the kernel's inotify sees them all.
Linux only (the suite runs there).
"""

from __future__ import annotations

import ctypes
import os
import struct
from pathlib import Path
from types import TracebackType

IN_ACCESS, IN_OPEN = 0x001, 0x020
_libc = ctypes.CDLL(None, use_errno=True)


class OutsideWatch:
    """``with OutsideWatch(dir_or_file, ...) as w: ...``; then ``w.opened`` lists the paths
    opened (or read) under the watched ones while the block ran."""

    def __init__(self, *paths: Path | str) -> None:
        self.paths = [Path(p) for p in paths]
        self.opened: list[str] = []
        self._wd: dict[int, Path] = {}
        self._fd = -1

    def __enter__(self) -> OutsideWatch:
        self._fd = _libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self._fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        for p in self.paths:
            wd = _libc.inotify_add_watch(self._fd, os.fsencode(p), IN_OPEN | IN_ACCESS)
            if wd < 0:
                raise OSError(ctypes.get_errno(), f"inotify_add_watch {p}")
            self._wd[wd] = p
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            while True:
                try:
                    buf = os.read(self._fd, 1 << 16)
                except BlockingIOError:
                    break
                at = 0
                while at < len(buf):
                    wd, _mask, _cookie, n = struct.unpack_from("iIII", buf, at)
                    name = buf[at + 16 : at + 16 + n].rstrip(b"\0").decode()
                    self.opened.append(str(self._wd[wd] / name) if name else str(self._wd[wd]))
                    at += 16 + n
        finally:
            os.close(self._fd)
