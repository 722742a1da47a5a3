"""The TLS peer server serving a directory of an fsspec filesystem (``FsspecFiles``): the
process's ``memory://`` store, as a ``memory://`` local tier with peers serves it.

The same answers as from a directory on disk (whole files, ranges across the server's
blocks, several over one connection), and the same refusals, logged, with nothing changed in
the store: ``..``, absolute paths, a directory, a missing file, a sibling directory whose name
starts like the root, a file longer than asked for, a range past the end, a client with a
certificate that is not the run's.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

import pytest
from fsspec.implementations.memory import MemoryFileSystem
from peer_helpers import run_of

from quire._peers import link
from quire._peers.tls import Identity
from quire.errors import PeerError

(CREDS,), CERTS = run_of(1)
ME = CREDS.peer(0)
BIG = 3 * (1 << 20) + 12345  # several of the server's 1 MiB blocks, not a multiple
ROOT = "/peertest/tier"


def snapshot(fs: MemoryFileSystem) -> dict[str, bytes]:
    return {k: bytes(v.getbuffer()) for k, v in fs.store.items() if k.startswith("/peertest")}


@pytest.fixture
def fs() -> Iterator[MemoryFileSystem]:
    fs = MemoryFileSystem()
    fs.pipe_file(f"{ROOT}/d/tx/p00000", os.urandom(BIG))
    fs.pipe_file(f"{ROOT}/d/tx/idx.json", b'{"a": 1}')
    fs.pipe_file(f"{ROOT}/empty", b"")
    fs.pipe_file("/peertest/tierX/secret.txt", b"not for peers")  # a sibling, same prefix
    fs.pipe_file("/peertest/outside.txt", b"not for peers")
    yield fs
    for k in [k for k in fs.store if k.startswith("/peertest")]:
        del fs.store[k]
    fs.pseudo_dirs[:] = [d for d in fs.pseudo_dirs if not d.startswith("/peertest")]


@pytest.fixture
def server(fs: MemoryFileSystem) -> Iterator[link.PeerServer]:
    with link.PeerServer(link.FsspecFiles(fs, f"memory://{ROOT}"), CREDS) as s:
        yield s


def test_serves_whole_files_and_ranges_from_the_store(
    server: link.PeerServer, fs: MemoryFileSystem
) -> None:
    big = fs.cat_file(f"{ROOT}/d/tx/p00000")
    assert link.fetch(server.address, "d/tx/p00000", ME, 30, BIG) == big
    got = link.fetch_many(
        server.address, ["d/tx/idx.json", "empty", "d/tx/p00000"], ME, 30, 1 << 30
    )
    assert got == [b'{"a": 1}', b"", big]
    a, b = 1_000_000, 2_500_001  # across the server's 1 MiB blocks
    assert link.fetch(server.address, "d/tx/p00000", ME, 30, b - a, a, b) == big[a:b]
    buf = bytearray(b - a)
    n = link.fetch_into(server.address, "d/tx/p00000", ME, 30, [memoryview(buf)], a)
    assert n == b - a and bytes(buf) == big[a:b]
    assert server.requests == 6 and server.served == 2 * BIG + 8 + 2 * (b - a)
    assert "MemoryFileSystem:/peertest/tier" in repr(server)


@pytest.mark.parametrize(
    ("path", "reason"),
    [
        ("../outside.txt", "'..'"),
        ("../tierX/secret.txt", "'..'"),
        ("d/./tx/idx.json", "'..', '.'"),
        ("d//tx/idx.json", "empty"),
        ("d\\tx", "backslashes"),
        ("/peertest/outside.txt", "absolute path"),
        ("X/secret.txt", "no such file"),  # the root joined with '/': never the sibling
        ("d", "not a regular file"),
        ("d/tx", "not a regular file"),
        ("d/tx/missing", "no such file"),
        ("memory:", "no such file"),
    ],
)
def test_refuses_paths_outside_or_not_files(
    server: link.PeerServer,
    fs: MemoryFileSystem,
    caplog: pytest.LogCaptureFixture,
    path: str,
    reason: str,
) -> None:
    caplog.set_level(logging.WARNING, logger="quire")
    before = snapshot(fs)
    with pytest.raises(PeerError) as e:
        link.fetch(server.address, path, ME, 10, 1 << 30)
    msg = str(e.value)
    assert "refused" in msg and reason in msg, msg
    warned = [r for r in caplog.records if r.name == "quire" and r.levelno == logging.WARNING]
    assert len(warned) == 1 and reason in warned[0].getMessage()
    assert snapshot(fs) == before


def test_refuses_too_long_past_the_end_and_a_wrong_certificate(
    server: link.PeerServer, fs: MemoryFileSystem
) -> None:
    before = snapshot(fs)
    with pytest.raises(PeerError, match="more than the 100 asked for"):
        link.fetch(server.address, "d/tx/p00000", ME, 10, 100)
    with pytest.raises(PeerError, match=f"range ends at byte {BIG + 1}, past the end"):
        link.fetch(server.address, "d/tx/p00000", ME, 10, 100, BIG - 1, BIG + 1)
    stranger = Identity.ephemeral(5)  # not of the run; it pins process 0 all the same
    pinned = stranger.trust({5: stranger.cert_pem, 0: CERTS[0]}).peer(0)
    with pytest.raises(PeerError, match="did not accept this process's certificate"):
        link.fetch(server.address, "d/tx/idx.json", pinned, 10, 100)
    assert snapshot(fs) == before and server.served == 0


def test_the_root_must_be_a_directory_of_the_store(fs: MemoryFileSystem) -> None:
    with pytest.raises(NotADirectoryError, match="/peertest/nothing"):
        link.FsspecFiles(fs, "/peertest/nothing")
    with pytest.raises(NotADirectoryError):
        link.FsspecFiles(fs, f"{ROOT}/empty")  # a file
