"""Who the peers of a run are: each process's TLS identity and the certificates it pins.

The peer link (``link``) speaks TLS 1.3 only, with mutual authentication
(``docs/peers.md``):

* :class:`Identity`: this process's private key and certificate, loaded into its two TLS
  contexts (server and client).  By default an ephemeral key (ECDSA P-256) and a self-signed
  certificate naming the process, made at start with ``cryptography`` and never written
  anywhere but a private temporary file read back at once; or the certificate, key and CA of
  the user's own PKI (:class:`PeerTLS`).
* :class:`Credentials`: the identity plus every process's certificate, as published through
  the key-value store (``link.run_credentials``).  Both contexts demand a certificate of
  the other side (``CERT_REQUIRED``) and trust only the run's certificates
  (``load_verify_locations(cadata=...)``), or only the user's CA.
* :class:`Pinned`: what a client expects of the one process it means to reach; checked after
  the handshake (:meth:`Pinned.check`): the certificate the peer presented is the one that
  process published (its SHA-256), and an ephemeral one names that process.

No fallback: there is no other protocol version, no cipher choice below TLS 1.3, no mode
without certificates.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import os
import shutil
import ssl
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from quire.errors import PluginError

__all__ = [
    "Credentials",
    "Identity",
    "PeerTLS",
    "Pinned",
    "fingerprint",
    "require_cryptography",
]

_SAN = "urn:quire:peer:process:"  # + the process index, in an ephemeral certificate


@dataclasses.dataclass(frozen=True)
class PeerTLS:
    """Certificates of your own PKI for the peer link of a local tier
    (``quire.LocalTier(peer_tls=quire.tiers.PeerTLS(...))``), instead of the ephemeral ones.

    Every process passes its own certificate and key and the CA that signed every process's
    certificate.  A process still publishes its certificate through the key-value store, and
    a peer is accepted only when its certificate chains to ``ca`` *and* is the one the
    process it claims to be published (see ``docs/peers.md``).

    Parameters
    ----------
    cert : str or path
        This process's certificate (PEM; may be followed by its intermediate CAs).
    key : str or path
        Its private key (PEM, unencrypted).
    ca : str or path
        The CA certificate(s) (PEM) that every process's certificate chains to.

    Raises
    ------
    TypeError
        An argument is not a path.
    FileNotFoundError
        A file does not exist.
    ValueError
        The files do not load as a certificate, its key and a CA.
    """

    cert: str | os.PathLike[str]
    key: str | os.PathLike[str]
    ca: str | os.PathLike[str]

    def __post_init__(self) -> None:
        for field in ("cert", "key", "ca"):
            value = getattr(self, field)
            if not isinstance(value, str | os.PathLike) or not str(value):
                raise TypeError(f"PeerTLS({field}=...) must be a file path, got {value!r}")
            path = Path(value).expanduser().resolve()
            if not path.is_file():
                raise FileNotFoundError(
                    f"PeerTLS({field}={str(value)!r}): no such file; give the PEM file of "
                    f"this process's {'certificate' if field == 'cert' else field}"
                )
            object.__setattr__(self, field, str(path))
        try:  # load them now: a bad file fails here, not at the first restore
            _server(str(self.cert), str(self.key)).load_verify_locations(cafile=str(self.ca))
        except (ssl.SSLError, ValueError) as e:
            raise ValueError(
                f"PeerTLS(cert={self.cert!r}, key={self.key!r}, ca={self.ca!r}): {e}; give a "
                "PEM certificate, its unencrypted PEM private key and a PEM CA certificate"
            ) from e


def require_cryptography(what: str) -> None:
    """Raise :class:`~quire.errors.PluginError` when ``cryptography`` (the ``peers`` extra),
    which makes the ephemeral certificates, cannot be imported; ``what`` names the caller."""
    try:
        import cryptography.x509  # noqa: F401
    except ImportError as e:
        raise PluginError(
            f"{what}: the peer link makes a TLS certificate per process with the "
            f"'cryptography' package, which is not installed ({e}); install quire's peers "
            "extra (pip install 'quire[peers]'), or pass certificates of your own PKI: "
            "LocalTier(peer_tls=quire.tiers.PeerTLS(cert, key, ca))",
            name="quire[peers]",
        ) from e


def fingerprint(pem: bytes | str) -> bytes:
    """SHA-256 of the first certificate of ``pem`` (its DER form)."""
    text = pem.decode() if isinstance(pem, bytes) else pem
    end = "-----END CERTIFICATE-----"
    first = text[: text.index(end) + len(end)] if end in text else text
    return hashlib.sha256(ssl.PEM_cert_to_DER_cert(first)).digest()


def _context(protocol: int) -> ssl.SSLContext:
    ctx = ssl.SSLContext(protocol)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.maximum_version = ssl.TLSVersion.TLSv1_3
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def _server(cert: str, key: str) -> ssl.SSLContext:
    ctx = _context(ssl.PROTOCOL_TLS_SERVER)
    ctx.num_tickets = 0  # no resumption: every connection does a full handshake
    ctx.load_cert_chain(cert, key)
    return ctx


def _client(cert: str, key: str) -> ssl.SSLContext:
    ctx = _context(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False  # the peer's identity is its pinned certificate (Pinned.check)
    ctx.load_cert_chain(cert, key)
    return ctx


class Identity:
    """This process's key and certificate, loaded into its server and client TLS contexts
    (:meth:`ephemeral` or :meth:`from_files`); :meth:`trust` adds the run's certificates."""

    def __init__(
        self,
        index: int,
        cert_pem: bytes,
        server: ssl.SSLContext,
        client: ssl.SSLContext,
        ca: str | None,
    ) -> None:
        self.index = index
        self.cert_pem = cert_pem  # public: published through the key-value store
        self._server, self._client, self._ca = server, client, ca
        self._used = False

    @classmethod
    def ephemeral(cls, index: int) -> Identity:
        """A fresh ECDSA P-256 key and a self-signed certificate naming process ``index``
        (needs ``cryptography``: :func:`require_cryptography`)."""
        require_cryptography("the peer link")
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"quire peer process {index}")])
        now = datetime.datetime.now(datetime.UTC)
        usage = x509.KeyUsage(
            digital_signature=True,
            content_commitment=False,
            key_encipherment=False,
            data_encipherment=False,
            key_agreement=False,
            key_cert_sign=False,
            crl_sign=False,
            encipher_only=False,
            decipher_only=False,
        )
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            # the key lives as long as the process; the dates only need to hold meanwhile
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=3650))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(usage, critical=True)
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
            .add_extension(
                x509.SubjectAlternativeName([x509.UniformResourceIdentifier(f"{_SAN}{index}")]),
                critical=False,
            )
            .sign(key, hashes.SHA256())
        )
        cert_pem = cert.public_bytes(serialization.Encoding.PEM)
        key_pem = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        # ssl loads a key from a file only: a private directory, removed once it is read
        tmp = tempfile.mkdtemp(prefix="quire-peer-")
        try:
            cert_file, key_file = os.path.join(tmp, "cert.pem"), os.path.join(tmp, "key.pem")
            with open(cert_file, "wb") as f:
                f.write(cert_pem)
            fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(key_pem)
            server, client = _server(cert_file, key_file), _client(cert_file, key_file)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return cls(index, cert_pem, server, client, None)

    @classmethod
    def from_files(cls, index: int, tls: PeerTLS) -> Identity:
        """Process ``index``'s identity from the user's PKI (``tls``)."""
        cert, key, ca = str(tls.cert), str(tls.key), str(tls.ca)
        return cls(index, Path(cert).read_bytes(), _server(cert, key), _client(cert, key), ca)

    def trust(self, certs: Mapping[int, bytes]) -> Credentials:
        """The credentials of a run whose processes published ``certs`` (index -> PEM, this
        process's own among them); call it once."""
        if self._used:
            raise RuntimeError("Identity.trust: called twice")
        self._used = True
        pins = {int(j): fingerprint(pem) for j, pem in certs.items()}
        if pins.get(self.index) != fingerprint(self.cert_pem):
            raise ValueError(f"Identity.trust: process {self.index}'s own certificate is missing")
        for ctx in (self._server, self._client):
            if self._ca is not None:
                ctx.load_verify_locations(cafile=self._ca)
            else:  # the run's self-signed certificates are the only trust anchors, each
                # loaded as published (joined, one without its last newline spoils the next)
                for pem in certs.values():
                    ctx.load_verify_locations(cadata=pem.decode())
        return Credentials(self.index, pins, self._server, self._client, self._ca is None)


@dataclasses.dataclass(frozen=True)
class Pinned:
    """What a client expects of process :attr:`index`: its published certificate."""

    index: int
    fingerprint: bytes
    context: ssl.SSLContext = dataclasses.field(repr=False, compare=False)
    named: bool = True  # an ephemeral certificate: its SAN names the process too

    def check(self, sock: Any) -> str | None:
        """Why the peer on ``sock`` (after the handshake: an ``ssl.SSLSocket`` or
        ``SSLObject``, anything with ``getpeercert``) is not process :attr:`index`; None
        when it is."""
        der = sock.getpeercert(binary_form=True)
        if der is None or hashlib.sha256(der).digest() != self.fingerprint:
            return (
                f"its certificate is not the one process {self.index} published "
                "(another process, or a man in the middle)"
            )
        if self.named and ("URI", f"{_SAN}{self.index}") not in _san(sock.getpeercert()):
            return f"its certificate does not name process {self.index}"
        return None


def _san(cert: Any) -> tuple[tuple[str, str], ...]:
    return tuple(cert.get("subjectAltName", ())) if isinstance(cert, dict) else ()


class Credentials:
    """This process's TLS contexts and the run's pinned certificates (:meth:`Identity.trust`).

    Attributes
    ----------
    index : int
        This process.
    server_context, client_context : ssl.SSLContext
        TLS 1.3 only, a certificate demanded of the other side, the run's certificates (or the
        user's CA) the only trust anchors.
    """

    def __init__(
        self,
        index: int,
        pins: Mapping[int, bytes],
        server: ssl.SSLContext,
        client: ssl.SSLContext,
        named: bool,
    ) -> None:
        self.index = index
        self._pins = dict(pins)
        self.server_context, self.client_context = server, client
        self._named = named

    @property
    def processes(self) -> list[int]:
        """The processes whose certificates are pinned."""
        return sorted(self._pins)

    def peer(self, index: int) -> Pinned:
        """What to expect of process ``index`` (a client's side of the check)."""
        if index not in self._pins:
            raise KeyError(f"process {index} published no peer certificate")
        return Pinned(index, self._pins[index], self.client_context, self._named)

    def who(self, der: bytes | None) -> int | None:
        """The process whose published certificate is ``der`` (a server's side of the
        check); None when it is none of the run's."""
        if der is None:
            return None
        got = hashlib.sha256(der).digest()
        return next((j for j, fp in sorted(self._pins.items()) if fp == got), None)
