"""What a peer server (``server``) serves: regular files under one root, read-only.

:class:`LocalFiles` is a directory on disk or tmpfs, :class:`FsspecFiles` a directory of an
fsspec filesystem (e.g. the process's ``memory://`` store).  The server checks a request's
path (relative, no ``..``, ``.``, empty or NUL components, no backslashes) before asking
either; each then keeps the answer under its root and to regular files (anything else is
:class:`Refused`), and neither writes anything."""

from __future__ import annotations

import errno
import os
import stat
import threading
from pathlib import Path
from typing import Any

__all__ = ["MAX_LINKS", "Files", "FsspecFiles", "LocalFiles", "Refused"]


#: The most symbolic links one request's path may pass through (Linux's own bound).
MAX_LINKS = 40
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: opening a FIFO must not wait for a writer
_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


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
        the reader has ``seek``, ``readinto`` and ``close``.  Raises :class:`Refused`."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what it holds (the server calls it when it closes)."""


class LocalFiles(Files):
    """A directory on disk (or tmpfs), opened once (its descriptor kept until :meth:`close`).

    A request's path is walked one component at a time from that descriptor, each opened
    with ``O_NOFOLLOW`` relative to the directory opened before it, so the kernel never
    follows a link for the server.  A symbolic link met on the way is read
    (``readlink``) and followed by the walk itself, at most :data:`MAX_LINKS` of them:
    a relative target from the directory holding the link, ``..`` back up the directories
    walked (never above the root), an absolute one only when it names a path under the
    root; any other link leads out of the root and is refused.  A directory swapped for a
    link while a request walks through it is therefore met as the link, never followed
    blindly.  Only regular files are opened (non-blocking, so a FIFO never stalls the
    server).

    ``openat2(RESOLVE_BENEATH)`` would do the same in one system call, but it refuses every
    absolute link, and links to inside the root with their absolute path are served.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).resolve(strict=True)
        if not self.root.is_dir():
            raise NotADirectoryError(f"peer server root {self.root} is not a directory")
        self.label = str(self.root)
        given = os.path.abspath(root)
        self._prefixes = [
            [c for c in p.split("/") if c not in ("", os.curdir)]
            for p in dict.fromkeys([str(self.root), given])
        ]
        self._fd: int | None = os.open(self.root, _DIR)
        self._lock = threading.Lock()  # a request's walk starts from its own copy of _fd

    def close(self) -> None:
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def open(self, parts: list[str]) -> tuple[Any, int]:
        with self._lock:
            if self._fd is None:
                raise Refused("the server is closing")
            root = os.dup(self._fd)
        fd = self._walk(root, parts)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise Refused("not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb", buffering=0), st.st_size

    def _beneath(self, target: str) -> list[str]:
        """The components of the absolute link target ``target`` below the root (named by
        its resolved path, or by the path the server was given)."""
        comps = [c for c in target.split("/") if c not in ("", os.curdir)]
        for prefix in self._prefixes:
            if comps[: len(prefix)] == prefix:
                return comps[len(prefix) :]
        raise Refused("path leaves the served directory (through a symlink)")

    def _walk(self, root: int, parts: list[str]) -> int:
        """A descriptor of what ``parts`` names under the directory ``root`` (a descriptor
        the walk closes; its caller checks what the answer is)."""
        dirs = [root]  # the directories walked, the root first
        todo = list(reversed(parts))  # what is left, the next component last
        links = 0
        try:
            while todo:
                name = todo.pop()
                if name in ("", os.curdir):
                    continue
                if name == os.pardir:  # only from a link's target: the walk's own parent
                    if len(dirs) == 1:
                        raise Refused("path leaves the served directory (through a symlink)")
                    os.close(dirs.pop())
                    continue
                try:
                    fd = os.open(name, _DIR if todo else _FILE, dir_fd=dirs[-1])
                except OSError as e:
                    try:
                        target = os.readlink(name, dir_fd=dirs[-1])
                    except OSError:
                        raise _refusal(e) from None
                    links += 1
                    if links > MAX_LINKS:
                        raise Refused(f"more than {MAX_LINKS} symbolic links") from None
                    if os.path.isabs(target):
                        for d in dirs[1:]:
                            os.close(d)
                        del dirs[1:]
                        todo += reversed(self._beneath(target))
                    else:
                        todo += reversed(target.split("/"))
                    continue
                if not todo:
                    return fd
                dirs.append(fd)
            return os.dup(dirs[-1])  # the path names a directory (the root, through links)
        finally:
            for d in dirs:
                os.close(d)


def _refusal(e: OSError) -> Refused:
    if e.errno in (errno.ENOENT, errno.ENOTDIR):
        return Refused("no such file")
    return Refused(f"cannot open: {e.strerror}")


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
