"""Opening files and making directories below a root without following a symbolic link
in any component below it: a hostile checkpoint (a link where a directory or an object of
it should be) cannot make a read or a write reach a file outside the root.

Where Linux has ``openat2(2)`` an open is one call with ``RESOLVE_NO_SYMLINKS``; elsewhere
each directory is opened relative to its parent with ``O_NOFOLLOW``.  Either way a link is
``OSError`` (``ELOOP``, or ``ENOTDIR`` for a link to a directory).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import sys
from collections.abc import Sequence
from typing import Any

#: The C library (Linux; None elsewhere or where it does not load), for system calls the
#: ``os`` module lacks: ``openat2`` here, ``syncfs`` in the local backend.
libc: Any = None
if sys.platform.startswith("linux"):
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        libc = None


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_SYS_OPENAT2 = 437  # the same number on every Linux architecture (Linux >= 5.6)
_RESOLVE_NO_SYMLINKS = 0x04
# None: not tried yet; False: unavailable (old kernel, seccomp, not Linux), walk instead.
_openat2_ok: bool | None = None if libc is not None else False


def _openat2(dfd: int, path: str, flags: int, mode: int) -> int | None:
    """``openat2(dfd, path, flags, RESOLVE_NO_SYMLINKS)``: one system call that refuses a
    symbolic link in any component (``ELOOP``); None where the call is unavailable."""
    global _openat2_ok
    if _openat2_ok is False:
        return None
    how = _OpenHow(flags | os.O_CLOEXEC, mode if flags & os.O_CREAT else 0, _RESOLVE_NO_SYMLINKS)
    fd = int(
        libc.syscall(
            ctypes.c_long(_SYS_OPENAT2),
            ctypes.c_int(dfd),
            ctypes.c_char_p(os.fsencode(path)),
            ctypes.byref(how),
            ctypes.c_size_t(ctypes.sizeof(how)),
        )
    )
    if fd >= 0:
        _openat2_ok = True
        return fd
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EPERM) or (err == errno.EINVAL and not _openat2_ok):
        _openat2_ok = False  # no openat2 here (or a sandbox refuses it): walk instead
        return None
    raise OSError(err, os.strerror(err), path)


def _down(dfd: int, name: str) -> int:
    """The directory ``name`` in ``dfd``, opened without following a link, in place of
    ``dfd`` (closed once it is open; on ``OSError``, a link say, ``dfd`` stays the
    caller's to close)."""
    nfd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dfd)
    os.close(dfd)
    return nfd


def open_below(root: str, key: str, flags: int, mode: int = 0o644) -> int:
    """A descriptor of ``root/key`` opened with ``flags``; refused (``OSError``) where a
    component below ``root`` is a symbolic link (``root`` itself may be one)."""
    parts = [p for p in key.split("/") if p]
    if not parts:
        return os.open(root, flags, mode)
    dfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fd = _openat2(dfd, "/".join(parts), flags, mode)
        if fd is not None:
            return fd
        for p in parts[:-1]:
            dfd = _down(dfd, p)
        return os.open(parts[-1], flags | os.O_NOFOLLOW, mode, dir_fd=dfd)
    finally:
        os.close(dfd)


def makedirs_below(root: str, parts: Sequence[str]) -> list[str]:
    """Make ``root`` (and its parents) and the directories ``root/parts[0]/parts[1]/...``
    where missing, each made and opened relative to its parent with ``O_NOFOLLOW``: a link
    is ``OSError`` and nothing is created where it points.  Returns the paths made."""
    made = []
    if not os.path.isdir(root):
        os.makedirs(root, exist_ok=True)
        made.append(root)
    dfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        d = root
        for p in (p for p in parts if p):
            d = os.path.join(d, p)
            try:
                os.mkdir(p, 0o777, dir_fd=dfd)
                made.append(d)
            except FileExistsError:
                pass
            dfd = _down(dfd, p)
    finally:
        os.close(dfd)
    return made


def refuse_links(root: str, key: str) -> None:
    """Raise ``OSError(ELOOP)`` when a component of ``key`` below ``root`` is a symbolic
    link (for listings, which walk by path: what a link leads to is not the root's)."""
    path = root
    for p in (p for p in key.split("/") if p):
        path = os.path.join(path, p)
        if os.path.islink(path):
            raise OSError(errno.ELOOP, "a symbolic link in a checkpoint is not followed", path)
