"""What a peer server (``server``) serves: regular files under one root, read-only.

:class:`LocalFiles` is a directory on disk or tmpfs, :class:`FsspecFiles` a directory of an
fsspec filesystem (e.g. the process's ``memory://`` store).  The server checks a request's
path (relative, no ``..``, ``.``, empty or NUL components, no backslashes) before asking
either; each then keeps the answer under its root and to regular files (anything else is
:class:`Refused`), and neither writes anything."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

__all__ = ["Files", "FsspecFiles", "LocalFiles", "Refused"]


class Refused(Exception):
    """A request the server answers with a refusal (``hang_up``: then drops the connection)."""

    def __init__(self, reason: str, *, hang_up: bool = False) -> None:
        super().__init__(reason)
        self.hang_up = hang_up


class Files:
    """What a :class:`PeerServer` serves: regular files under one root, read-only."""

    label: str  # the root, for messages

    def open(self, parts: list[str]) -> tuple[Any, int]:
        """``(reader, size)`` of the file at ``parts`` (checked components) under the root;
        the reader has ``seek``, ``readinto`` and ``close``.  Raises ``_Refused``."""
        raise NotImplementedError


class LocalFiles(Files):
    """A directory on disk (or tmpfs), resolved once; symlinks are followed only while they
    stay inside it, and only regular files are opened (``O_NOFOLLOW``, non-blocking so a
    FIFO never stalls the server)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).resolve(strict=True)
        if not self.root.is_dir():
            raise NotADirectoryError(f"peer server root {self.root} is not a directory")
        self.label = str(self.root)

    def open(self, parts: list[str]) -> tuple[Any, int]:
        try:
            full = self.root.joinpath(*parts).resolve(strict=True)
        except (OSError, RuntimeError):
            raise Refused("no such file") from None
        if not full.is_relative_to(self.root):
            raise Refused("path leaves the served directory (through a symlink)")
        try:
            # O_NONBLOCK: opening a FIFO must not wait for a writer; O_NOFOLLOW: the
            # resolved path has no link left unless one was swapped in since.
            fd = os.open(full, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as e:
            raise Refused(f"cannot open: {e.strerror}") from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise Refused("not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb", buffering=0), st.st_size


class FsspecFiles(Files):
    """A directory of an fsspec filesystem (``root``: a path of ``fs``, e.g. the process's
    ``memory://`` store), read with ``info`` and ``cat_file`` only, a block at a time.

    The path asked for is the root joined with the checked components; a path the filesystem
    would read as another (its ``_strip_protocol`` changes it) is refused, so nothing outside
    the root is served.  fsspec filesystems have no symlinks to follow."""

    def __init__(self, fs: Any, root: str) -> None:
        self.fs = fs
        self.root = str(fs._strip_protocol(root)).rstrip("/")
        if not fs.isdir(self.root):
            raise NotADirectoryError(f"peer server root {self.root} is not a directory of {fs}")
        self.label = f"{type(fs).__name__}:{self.root}"

    def open(self, parts: list[str]) -> tuple[Any, int]:
        path = "/".join([self.root, *parts])
        if self.fs._strip_protocol(path) != path:
            raise Refused("path the filesystem would read as another")
        try:
            info = self.fs.info(path)
        except (OSError, ValueError):
            raise Refused("no such file") from None
        if info.get("type") != "file":
            raise Refused("not a regular file")
        return _FsspecReader(self.fs, path), int(info["size"])


class _FsspecReader:
    """``seek`` / ``readinto`` over ``fs.cat_file`` ranges (no shared file position)."""

    def __init__(self, fs: Any, path: str) -> None:
        self.fs, self.path, self.pos = fs, path, 0

    def seek(self, pos: int) -> None:
        self.pos = pos

    def readinto(self, view: memoryview) -> int:
        try:
            data = self.fs.cat_file(self.path, self.pos, self.pos + len(view))
        except (OSError, ValueError):
            return 0  # gone since: the server hangs up (a short answer)
        view[: len(data)] = data
        self.pos += len(data)
        return len(data)

    def close(self) -> None:
        pass

    def __enter__(self) -> _FsspecReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
