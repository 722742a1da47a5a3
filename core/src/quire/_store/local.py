"""Local file-system backend: O_EXCL-style create via link(2), rename-over replace, fsync."""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import ctypes
import errno
import fcntl
import os
import secrets
import stat
from collections.abc import Iterator, Sequence
from typing import Any
from urllib.parse import unquote, urlsplit

from quire._runtime.ioloop import run_to_end
from quire._store import nofollow
from quire._store.base import Backend, Buffer, Capabilities, PreconditionFailed
from quire._store.openfiles import OpenFiles, keepable

_libc: Any = nofollow.libc
if _libc is not None:
    try:
        _libc.syncfs.argtypes = [ctypes.c_int]
    except AttributeError:  # a C library without syncfs: fsync each file instead
        _libc = None


def local_path(url: str) -> str:
    """The absolute file-system path of a local path or ``file://`` URL."""
    if url.startswith("file://"):
        parts = urlsplit(url)
        path = unquote(parts.path)
        if parts.netloc not in ("", "localhost"):
            path = "//" + parts.netloc + path
        return os.path.abspath(path)
    if url.startswith("local://"):
        return os.path.abspath(url[len("local://") :])
    return os.path.abspath(os.path.expanduser(url))


def _write_all(fd: int, data: Sequence[Buffer]) -> None:
    for buf in data:
        mv = memoryview(buf).cast("B")
        while mv.nbytes:
            n = os.write(fd, mv)
            mv = mv[n:]


def _version(path: str, dir_fd: int | None = None, follow_symlinks: bool = True) -> str | None:
    """The version of the file at ``path`` (inode, mtime, size); None when it is missing."""
    try:
        st = os.stat(path, dir_fd=dir_fd, follow_symlinks=follow_symlinks)
    except FileNotFoundError:
        return None
    return f"{st.st_ino}-{st.st_mtime_ns}-{st.st_size}"


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _StreamWriter:
    def __init__(self, fd: int, fsync: bool) -> None:
        self.fd = fd
        self.fsync = fsync

    def _write(self, data: Sequence[Buffer], offset: int) -> None:
        for buf in data:
            mv = memoryview(buf).cast("B")
            while mv.nbytes:
                n = os.pwrite(self.fd, mv, offset)
                mv, offset = mv[n:], offset + n

    async def write(self, data: Sequence[Buffer], offset: int) -> None:
        await run_to_end(self._write, data, offset)

    def _close(self) -> None:
        try:
            if self.fsync:
                os.fsync(self.fd)
        finally:
            os.close(self.fd)

    async def close(self) -> None:
        await run_to_end(self._close)

    async def abort(self) -> None:
        await run_to_end(os.close, self.fd)


class LocalBackend(Backend):
    """A checkpoint root on a local (POSIX) file system.

    Writes go to their final names (every save uses a fresh ``d/<txid>/`` prefix, so no
    reader ever sees them before the commit); ``sync`` makes them durable with one
    ``syncfs(2)`` where available, else one ``fsync`` per file, plus the directories.
    The commit record is written to a temporary name, fsynced, and then ``link(2)``-ed
    into place (fails if it exists: an atomic conditional create with complete content)
    or ``rename(2)``-d over the old one under an ``flock`` (compare-and-swap).
    """

    capabilities = Capabilities(
        atomic_create=True,
        atomic_replace=True,
        durable=True,
        rename=True,
        readinto=True,
        stream_writes=True,
        directories=True,
    )

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        super().__init__(url, storage_options)
        self.root = local_path(url)
        self._dirty_files: list[str] = []
        self._dirty_dirs: set[str] = set()
        self._fsync = bool(self.storage_options.get("fsync", True))
        self._kept: OpenFiles | None = None  # pack descriptors kept open by a load
        # "fsync" (default): each file is fsynced by the thread that wrote it, in parallel,
        # then its directories; "syncfs": one syncfs(2) of the whole file system at the end
        # (fewer calls, but it also waits for every other program's unwritten data).
        self._sync_mode = str(self.storage_options.get("sync", "fsync"))
        if self._sync_mode not in ("fsync", "syncfs"):
            raise ValueError(f"storage option sync={self._sync_mode!r}: use 'fsync' or 'syncfs'")

    def _p(self, key: str) -> str:
        return os.path.join(self.root, *key.split("/")) if key else self.root

    # -- reads -------------------------------------------------------------------
    async def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        return await run_to_end(self._get, key, start, end)

    def _open(self, key: str, flags: int, mode: int = 0o644) -> int:
        """Open ``key`` without following a symbolic link anywhere below the root (a
        hostile checkpoint cannot make a read or a write reach a file outside it; see
        :func:`quire._store.nofollow.open_below`)."""
        return nofollow.open_below(self.root, key, flags, mode)

    def _open_read(self, key: str) -> int:
        """A read-only descriptor of the regular file ``key``.  Opened with ``O_NONBLOCK``
        (a FIFO would block ``open(2)`` until a writer comes; it has no effect on a regular
        file) and refused unless ``fstat`` says regular: a FIFO, socket or device is
        ``OSError(ENXIO)``, the errno the kernel gives for opening such a file the wrong way."""
        fd = self._open(key, os.O_RDONLY | os.O_NONBLOCK)
        try:
            mode = os.fstat(fd).st_mode
        except BaseException:
            os.close(fd)
            raise
        if not stat.S_ISREG(mode):
            os.close(fd)
            if stat.S_ISDIR(mode):
                raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), self._p(key))
            raise OSError(
                errno.ENXIO, "not a regular file (a FIFO, socket or device)", self._p(key)
            )
        return fd

    @contextlib.contextmanager
    def keep_open(self) -> Iterator[None]:
        """For the block (one load), reads of pack objects share one descriptor per
        pack instead of opening the file for every range (see ``_openfiles``)."""
        if self._kept is not None:  # already in a load's scope
            yield
            return
        self._kept = files = OpenFiles()
        try:
            yield
        finally:
            self._kept = None
            files.close()

    @contextlib.contextmanager
    def _reading(self, key: str) -> Iterator[int]:
        """A read-only descriptor of ``key`` for the block (kept ones are shared)."""
        files = self._kept
        if files is None or not keepable(key):
            fd = self._open_read(key)
            try:
                yield fd
            finally:
                os.close(fd)
            return
        fd, shared = files.acquire(key, lambda: self._open_read(key))
        try:
            yield fd
        finally:
            if shared:
                files.release(key)
            else:
                os.close(fd)

    def _get(self, key: str, start: int | None, end: int | None) -> bytes:
        with self._reading(key) as fd:
            # Bounded by the file's real size: a range a (hostile) index states, 2^40 bytes
            # or at offset 2^64, allocates and asks the kernel for no more than exists.
            size = os.fstat(fd).st_size
            pos = start or 0
            left = (size if end is None else min(end, size)) - pos
            parts = []
            while left > 0:
                got = os.pread(fd, left, pos)
                if not got:
                    break
                parts.append(got)
                pos, left = pos + len(got), left - len(got)
            return parts[0] if len(parts) == 1 else b"".join(parts)

    async def get_into(self, key: str, buffers: Sequence[memoryview], offset: int = 0) -> int:
        return await run_to_end(self._get_into, key, buffers, offset)

    def _get_into(self, key: str, buffers: Sequence[memoryview], offset: int) -> int:
        with self._reading(key) as fd:
            total = 0
            if offset >= os.fstat(fd).st_size:  # past the end (2^64 overflows preadv)
                return 0
            bufs = [memoryview(b).cast("B") for b in buffers]
            while bufs:
                n = os.preadv(fd, bufs[:1024], offset + total)
                if n == 0:
                    break
                total += n
                while bufs and n >= bufs[0].nbytes:
                    n -= bufs[0].nbytes
                    bufs.pop(0)
                if bufs and n:
                    bufs[0] = bufs[0][n:]
            return total

    async def size(self, key: str) -> int:
        return (await run_to_end(os.stat, self._p(key))).st_size

    async def exists(self, key: str) -> bool:
        return await run_to_end(os.path.exists, self._p(key))

    async def modified(self, key: str) -> float | None:
        return (await run_to_end(os.stat, self._p(key))).st_mtime

    async def version(self, key: str) -> str | None:
        return await run_to_end(_version, self._p(key))

    async def list(self, prefix: str = "") -> builtins.list[str]:
        return await run_to_end(self._list, prefix)

    def _list(self, prefix: str) -> builtins.list[str]:
        """The keys under ``prefix``; a link below it is a key (never walked into), and a
        link on the way to it is refused (``OSError``)."""
        nofollow.refuse_links(self.root, prefix)
        base = self._p(prefix.rstrip("/"))
        if os.path.isfile(base):
            return [prefix.rstrip("/")]
        out = []
        for dirpath, dirs, files in os.walk(base):
            rel = os.path.relpath(dirpath, self.root)
            links = [d for d in dirs if os.path.islink(os.path.join(dirpath, d))]
            for f in files + links:
                out.append(f if rel == "." else f"{rel}/{f}".replace(os.sep, "/"))
        return sorted(out)

    async def list_dir(self, prefix: str = "") -> tuple[builtins.list[str], builtins.list[str]]:
        return await run_to_end(self._list_dir, prefix)

    def _list_dir(self, prefix: str) -> tuple[builtins.list[str], builtins.list[str]]:
        files: builtins.list[str] = []
        dirs: builtins.list[str] = []
        try:
            with os.scandir(self._p(prefix.rstrip("/"))) as it:
                for e in it:
                    (dirs if e.is_dir(follow_symlinks=False) else files).append(e.name)
        except (FileNotFoundError, NotADirectoryError):
            pass
        return sorted(files), sorted(dirs)

    # -- writes ------------------------------------------------------------------
    def _makedirs(self, key: str) -> None:
        """Create the directories above ``key``, none through a symbolic link; each new
        one and its parent are recorded, so :meth:`sync` makes the entries durable."""
        if os.path.isdir(os.path.dirname(self._p(key))):  # exists (opens refuse a link)
            return
        for d in nofollow.makedirs_below(self.root, key.split("/")[:-1]):
            self._dirty_dirs.update((d, os.path.dirname(d)))

    async def put(self, key: str, data: Sequence[Buffer]) -> None:
        await run_to_end(self._put, key, data)

    def _put(self, key: str, data: Sequence[Buffer]) -> None:
        path = self._p(key)
        self._makedirs(key)
        fd = self._open(key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            _write_all(fd, data)
            if self._fsync and not (self._sync_mode == "syncfs" and _libc is not None):
                os.fsync(fd)
        finally:
            os.close(fd)
        self._dirty_dirs.add(os.path.dirname(path))

    async def stream_writer(self, key: str) -> _StreamWriter:
        """An object written in place at given offsets (format-v2 packs): concurrent
        ``write(views, offset)`` calls, then ``close()`` (fsync, like ``put``)."""
        path = self._p(key)
        await run_to_end(self._makedirs, key)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        fd = await run_to_end(self._open, key, flags, 0o644, discard=os.close)
        self._dirty_dirs.add(os.path.dirname(path))
        fsync = self._fsync and not (self._sync_mode == "syncfs" and _libc is not None)
        return _StreamWriter(fd, fsync)

    async def sync(self) -> None:
        if not self._fsync:
            return
        if self._sync_mode == "syncfs" and _libc is not None:
            await run_to_end(self._syncfs)
        # Files were fsynced as they were written; now their directory entries.
        dirs = [d for d in sorted(self._dirty_dirs, key=len, reverse=True) if os.path.isdir(d)]
        self._dirty_dirs.clear()
        await asyncio.gather(*(run_to_end(_fsync_dir, d) for d in dirs))

    def _syncfs(self) -> None:
        if not os.path.isdir(self.root):
            return
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            if _libc.syncfs(fd) != 0:
                e = ctypes.get_errno()
                raise OSError(e, f"syncfs failed for {self.root}: {os.strerror(e)}")
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def _in_parent(self, key: str, data: bytes) -> Iterator[tuple[int, str, str]]:
        """``(dfd, name, tmp)``: the directory of ``key`` (opened without following a
        link), the key's name in it, and a new durable file ``tmp`` there holding
        ``data``, removed at the end unless it was renamed."""
        self._makedirs(key)
        parent, _, name = key.rpartition("/")
        dfd = self._open(parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            tmp = f"{name}.tmp-{secrets.token_hex(6)}"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644, dir_fd=dfd)
            try:
                _write_all(fd, [data])
                os.fsync(fd)
            finally:
                os.close(fd)
            try:
                yield dfd, name, tmp
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp, dir_fd=dfd)
        finally:
            os.close(dfd)

    async def put_if_absent(self, key: str, data: bytes) -> str:
        return await run_to_end(self._put_if_absent, key, data)

    def _put_if_absent(self, key: str, data: bytes) -> str:
        with self._in_parent(key, data) as (dfd, name, tmp):
            try:
                os.link(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
            except FileExistsError:
                raise PreconditionFailed(f"{self._p(key)} exists") from None
            os.fsync(dfd)
            v = _version(name, dfd, follow_symlinks=False)
        assert v is not None
        return v

    async def replace_if_match(self, key: str, data: bytes, version: str) -> str:
        return await run_to_end(self._replace_if_match, key, data, version)

    def _replace_if_match(self, key: str, data: bytes, version: str) -> str:
        with self._in_parent(key, data) as (dfd, name, tmp):
            fcntl.flock(dfd, fcntl.LOCK_EX)
            try:
                if _version(name, dfd, follow_symlinks=False) != version:
                    raise PreconditionFailed(f"{self._p(key)} changed or vanished")
                os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
                os.fsync(dfd)
                v = _version(name, dfd, follow_symlinks=False)
            finally:
                fcntl.flock(dfd, fcntl.LOCK_UN)
        assert v is not None
        return v

    async def delete(self, keys: Sequence[str]) -> None:
        keys = list(keys)
        # unlink(2) is metadata-bound: batches in parallel threads finish much sooner.
        batches = [keys[i : i + 32] for i in range(0, len(keys), 32)] or [[]]
        # Each batch prunes the directories it emptied; whichever finishes last succeeds.
        await asyncio.gather(*(run_to_end(self._delete, b) for b in batches))

    async def delete_prefix(self, prefix: str) -> None:
        await super().delete_prefix(prefix)
        await run_to_end(self._prune, prefix)

    def _prune(self, prefix: str) -> None:
        """Remove the directories left empty under ``prefix`` (a writer killed between
        ``mkdir`` and its first file leaves some), deepest first, then ``prefix`` and its
        parents while they are empty; never the root.  ``rmdir`` removes only an empty
        directory: a file a writer creates meanwhile keeps its folders."""
        base = self._p(prefix.rstrip("/"))
        nofollow.refuse_links(self.root, prefix)
        if not os.path.isdir(base):
            return
        for d, _, _ in os.walk(base, topdown=False):
            self._rmdir_up(d)

    def _rmdir_up(self, d: str) -> None:
        while d.startswith(self.root + os.sep):
            try:
                os.rmdir(d)
            except OSError as e:
                if e.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT, errno.ENOTDIR):
                    return
                raise
            d = os.path.dirname(d)

    def _delete(self, keys: builtins.list[str]) -> None:
        """Unlink ``keys``, each relative to its directory opened without following a link
        (a link on the way is ``OSError``; a link that is the key goes, not its target)."""
        by_dir: dict[str, builtins.list[str]] = {}
        for k in keys:
            parent, _, name = k.rpartition("/")
            by_dir.setdefault(parent, []).append(name)
        dirs = set()
        for parent, names in by_dir.items():
            try:
                dfd = self._open(parent, os.O_RDONLY | os.O_DIRECTORY)
            except FileNotFoundError:
                continue
            try:
                for name in names:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(name, dir_fd=dfd)
            finally:
                os.close(dfd)
            dirs.add(self._p(parent))
        # Prune directories left empty, deepest first, never above the root.
        for d in sorted(dirs, key=len, reverse=True):
            self._rmdir_up(d)
