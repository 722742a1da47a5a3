"""The peer link's certificates: a user's own PKI (``quire.tiers.PeerTLS``), its checks at
configuration, and the ``cryptography`` requirement of ``LocalTier(peers>0)``.

With a CA of the test's making (``cryptography``), real servers on 127.0.0.1: processes of
the run fetch from each other; a certificate the CA signed but no process published is
closed unanswered by the server; a server that is another process of the run is refused by
the client; a certificate of no CA fails the handshake.  Bad files fail when ``PeerTLS`` is
made, not at the first copy; without ``cryptography`` (import blocked), ``LocalTier(peers=1)``
raises ``PluginError`` at once, unless certificates are given.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import sys
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from peer_helpers import run_of

import quire
from quire._peers import link
from quire._peers.tls import Identity
from quire.errors import PeerError, PluginError

pytestmark = pytest.mark.quick  # the quick tier (CONTRIBUTING.md)


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _pem(key: Any) -> bytes:
    return bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )


def make_pki(top: Path, n: int) -> list[quire.tiers.PeerTLS]:
    """A CA and ``n`` certificates it signed (one per "host"), as PEM files under ``top``."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(_name("test CA"))
        .issuer_name(_name("test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=30))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    top.mkdir(parents=True)
    (top / "ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    out = []
    for i in range(n):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(f"host-{i}"))
            .issuer_name(ca.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=30))
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                critical=False,
            )
            .sign(ca_key, hashes.SHA256())
        )
        (top / f"{i}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (top / f"{i}.key").write_bytes(_pem(key))
        out.append(quire.tiers.PeerTLS(top / f"{i}.pem", top / f"{i}.key", top / "ca.pem"))
    return out


def test_a_users_pki_pins_the_published_certificates(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="quire")
    tls = make_pki(tmp_path / "pki", 3)
    pem = [Path(t.cert).read_bytes() for t in tls]
    published = {0: pem[0], 1: pem[1]}  # process 2's certificate was never published
    p0 = Identity.from_files(0, tls[0]).trust(published)
    p1 = Identity.from_files(1, tls[1]).trust(published)
    p2 = Identity.from_files(2, tls[2]).trust({0: pem[0], 2: pem[2]})
    root = tmp_path / "tier"
    root.mkdir()
    (root / "f").write_bytes(b"pack bytes")
    with link.PeerServer(root, p0) as s0, link.PeerServer(root, p1) as s1:
        assert link.fetch(s0.address, "f", p1.peer(0), 5, 100) == b"pack bytes"
        # signed by the CA, but no process published it: closed unanswered
        with pytest.raises(PeerError, match="closed the connection unanswered"):
            link.fetch(s0.address, "f", p2.peer(0), 5, 100)
        assert "none that a process of this run published" in caplog.text
        # signed by the CA, published, but another process than the one meant
        with pytest.raises(PeerError, match="not the one process 0 published"):
            link.fetch(s1.address, "f", p0.peer(0), 5, 100)
        # a self-signed certificate, of no CA of ours: the server ends the handshake
        ident = Identity.ephemeral(5)
        stranger = ident.trust({5: ident.cert_pem, 0: pem[0]})
        stranger.client_context.load_verify_locations(cafile=str(tls[0].ca))
        pinned = dataclasses.replace(stranger.peer(0), named=False)  # a CA's: no SAN to check
        with pytest.raises(PeerError, match="did not accept this process's certificate"):
            link.fetch(s0.address, "f", pinned, 5, 100)
        # and a server of no CA of ours is refused by the client
        (outsider,), _ = run_of(1)
        with (
            link.PeerServer(root, outsider) as s3,
            pytest.raises(PeerError, match="not one of this run's"),
        ):
            link.fetch(s3.address, "f", p1.peer(0), 5, 100)
        assert s0.requests == 1 and s1.requests == 0


def test_run_credentials_with_a_users_pki(tmp_path: Path) -> None:
    (tls,) = make_pki(tmp_path / "pki", 1)
    creds = link.run_credentials("test/pki", 1.0, tls)  # one JAX process
    assert creds.processes == [0]
    root = tmp_path / "tier"
    root.mkdir()
    (root / "f").write_bytes(b"x")
    with link.PeerServer(root, creds) as s:
        assert link.fetch(s.address, "f", creds.peer(0), 5, 10) == b"x"


def test_bad_certificate_files_fail_when_configured(tmp_path: Path) -> None:
    a, b = make_pki(tmp_path / "pki", 2)
    with pytest.raises(FileNotFoundError, match=r"PeerTLS\(key='nope.key'\): no such file"):
        quire.tiers.PeerTLS(a.cert, "nope.key", a.ca)
    with pytest.raises(TypeError, match="must be a file path"):
        quire.tiers.PeerTLS(a.cert, a.key, 3)  # type: ignore[arg-type]
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate")
    with pytest.raises(ValueError, match="give a PEM certificate"):
        quire.tiers.PeerTLS(junk, a.key, a.ca)
    with pytest.raises(ValueError, match="give a PEM certificate"):
        quire.tiers.PeerTLS(a.cert, b.key, a.ca)  # another certificate's key
    with pytest.raises(ValueError, match="give a PEM certificate"):
        quire.tiers.PeerTLS(a.cert, a.key, junk)
    with pytest.raises(TypeError, match=r"peer_tls must be a quire\.tiers\.PeerTLS"):
        quire.LocalTier(tmp_path / "local", peers=1, peer_tls=str(a.cert))  # type: ignore[arg-type]


def test_peers_without_cryptography_fail_at_configuration(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tls,) = make_pki(tmp_path / "pki", 1)
    for name in [m for m in sys.modules if m == "cryptography" or m.startswith("cryptography.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "cryptography", None)  # blocks every import of it
    with pytest.raises(PluginError, match=r"pip install 'quire\[peers\]'") as e:
        quire.LocalTier(tmp_path / "local", peers=1)
    assert str(tmp_path / "local") in str(e.value) and "peer_tls" in str(e.value)
    assert e.value.name == "quire[peers]"
    assert quire.LocalTier(tmp_path / "local").peers == 0  # no peers: nothing needed
    assert quire.LocalTier(tmp_path / "local", peers=1, peer_tls=tls).peer_tls == tls
    with pytest.raises(PluginError):
        link.run_credentials("test/nocrypto", 1.0)
