"""Per-process identity: mutual TLS certificates for every gRPC channel between DualPath processes.

Each process holds its own key and a certificate signed by the cluster's CA, in one directory
(`--tls-dir`, default `$DUALPATH_TLS_DIR`) with cert-manager's Secret layout: `ca.crt` (the CA
bundle peers are checked against), `tls.crt` (this process's chain), `tls.key`. The certificate
names the process by a SAN URI, `spiffe://dualpath/<cluster>/<role>/<node-id>` (`Identity`):
`dualpath.grpc_identity` reads the peer's from each call and checks what it may do. A node
segment `*` is a role-wide certificate (every pod of the role shares it: the operator's
fallback without cert-manager), which proves the role but not the node.

Every certificate also carries two DNS names, `<cluster>.dualpath` and `<role>.<cluster>.dualpath`:
a client checks the server against one of them (`target_name`) instead of the address it
dialled, since pod IPs are not in any certificate.

Rotation: a server re-reads its files when they change (`grpc.dynamic_ssl_server_credentials`
asks on each new handshake) and a new channel reads them afresh; connections already up keep
the certificate they were made with (TLS checks only at the handshake). `ca.crt` may hold two
CAs during a CA rotation (old and new), as a cert-manager CA bundle does.

`dualpath up` makes a CA in its run directory and a directory per process (`write_local`); the
operator keeps the CA in a Secret (`dualpath_operator.builders.certs`). Key generation uses the
`cryptography` package, imported only where certificates are made.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

log = logging.getLogger(__name__)

TLS_ENV = "DUALPATH_TLS_DIR"  # the default of every process's --tls-dir
CA_FILE, CERT_FILE, KEY_FILE = "ca.crt", "tls.crt", "tls.key"  # cert-manager's Secret keys
SPIFFE_PREFIX = "spiffe://dualpath/"
ANY_NODE = "*"  # the node segment of a role-wide certificate
# Roles a certificate may name: the processes, plus `admin` for operators' tools (the fault
# suite, `dualpath` clients) that read the cluster view or drain nodes.
ROLES = ("scheduler", "prefill", "decode", "frontend", "admin")
CA_DAYS = 365
LEAF_DAYS = 30


class TlsError(ValueError):
    """A TLS directory or certificate that cannot be used; the message names the path."""


@dataclass(frozen=True, slots=True)
class Identity:
    """Who a certificate names."""

    cluster: str
    role: str
    node: str = ANY_NODE

    @property
    def uri(self) -> str:
        return f"{SPIFFE_PREFIX}{self.cluster}/{self.role}/{self.node}"

    @property
    def names_node(self) -> bool:
        return self.node != ANY_NODE

    def __str__(self) -> str:
        return self.uri


def parse_uri(uri: str) -> Identity | None:
    """The identity a SAN URI names; None for any other URI."""
    if not uri.startswith(SPIFFE_PREFIX):
        return None
    parts = uri[len(SPIFFE_PREFIX) :].split("/")
    if len(parts) != 3 or not all(parts) or parts[1] not in ROLES:
        return None
    return Identity(*parts)


def target_name(cluster: str, role: str | None = None) -> str:
    """The DNS name a client checks a server's certificate against: any process of the cluster,
    or one of `role`."""
    return f"{role}.{cluster}.dualpath" if role else f"{cluster}.dualpath"


# ---- making certificates (cryptography) ---------------------------------------------------


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def make_ca(cluster: str, days: int = CA_DAYS) -> tuple[bytes, bytes]:
    """A fresh CA for `cluster`: (certificate PEM, key PEM)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"dualpath {cluster} CA")])
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM), _key_pem(key)


def _key_pem(key) -> bytes:  # noqa: ANN001
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def issue(
    ca_cert_pem: bytes, ca_key_pem: bytes, who: Identity, days: int = LEAF_DAYS
) -> tuple[bytes, bytes]:
    """A leaf certificate for `who` signed by the CA: (certificate PEM, key PEM). It is both a
    server and a client certificate (every process is both)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    ca_cert = x509.load_pem_x509_certificate(ca_cert_pem)
    ca_key = serialization.load_pem_private_key(ca_key_pem, password=None)
    key = ec.generate_private_key(ec.SECP256R1())
    now = _now()
    not_after = min(now + dt.timedelta(days=days), ca_cert.not_valid_after_utc)
    cn = f"{who.role}/{who.node}"
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .add_extension(
            x509.SubjectAlternativeName(
                [
                    x509.UniformResourceIdentifier(who.uri),
                    x509.DNSName(target_name(who.cluster)),
                    x509.DNSName(target_name(who.cluster, who.role)),
                ]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM), _key_pem(key)


def identity_of_pem(cert_pem: bytes) -> Identity | None:
    """The identity a PEM certificate's SAN URIs name (the first that parses)."""
    from cryptography import x509

    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (ValueError, x509.ExtensionNotFound):
        return None
    for uri in san.get_values_for_type(x509.UniformResourceIdentifier):
        who = parse_uri(uri)
        if who is not None:
            return who
    return None


def _write(path: Path, data: bytes, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, mode)


def write_dir(directory: str | Path, ca_pem: bytes, cert_pem: bytes, key_pem: bytes) -> Path:
    """A TLS directory in cert-manager's layout; the key readable by its owner only."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    _write(d / CA_FILE, ca_pem, 0o644)
    _write(d / CERT_FILE, cert_pem, 0o644)
    _write(d / KEY_FILE, key_pem, 0o600)
    return d


class LocalCA:
    """A CA in a directory (`dualpath up`'s run directory): it issues each process's
    directory. The CA key stays in `<dir>/ca/` (0600), which no process is given."""

    def __init__(self, directory: str | Path, cluster: str) -> None:
        self.dir = Path(directory)
        self.cluster = cluster
        ca_dir = self.dir / "ca"
        if (ca_dir / KEY_FILE).exists():
            self.cert_pem = (ca_dir / CERT_FILE).read_bytes()
            self.key_pem = (ca_dir / KEY_FILE).read_bytes()
        else:
            self.cert_pem, self.key_pem = make_ca(cluster)
            write_dir(ca_dir, self.cert_pem, self.cert_pem, self.key_pem)

    def issue_dir(self, name: str, role: str, node: str = ANY_NODE) -> Path:
        """`<dir>/<name>/`: a fresh key and certificate for (role, node)."""
        cert, key = issue(self.cert_pem, self.key_pem, Identity(self.cluster, role, node))
        return write_dir(self.dir / name, self.cert_pem, cert, key)


# ---- using them (grpc) --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Files:
    ca: bytes
    cert: bytes
    key: bytes
    stamp: tuple[float, ...]


class TlsCredentials:
    """A process's TLS directory, re-read (at most every `recheck_s`) when a file changes."""

    def __init__(self, directory: str | Path, recheck_s: float = 1.0) -> None:
        self.dir = Path(directory)
        self.recheck_s = recheck_s
        self._lock = threading.Lock()  # the server's fetcher runs on gRPC's threads
        self._checked = time.monotonic()
        self._files = self._read()
        who = identity_of_pem(self._files.cert)
        if who is None:
            raise TlsError(
                f"--tls-dir {self.dir}: {CERT_FILE} names no DualPath identity (a SAN URI "
                f"{SPIFFE_PREFIX}<cluster>/<role>/<node>)"
            )
        self.identity = who

    def _stamp(self) -> tuple[float, ...]:
        return tuple((self.dir / f).stat().st_mtime_ns for f in (CA_FILE, CERT_FILE, KEY_FILE))

    def _read(self) -> _Files:
        try:
            stamp = self._stamp()
            data = [(self.dir / f).read_bytes() for f in (CA_FILE, CERT_FILE, KEY_FILE)]
        except OSError as err:
            raise TlsError(f"--tls-dir {self.dir}: {err.strerror}: {err.filename}") from None
        if not all(data):
            raise TlsError(f"--tls-dir {self.dir}: an empty {CA_FILE}, {CERT_FILE} or {KEY_FILE}")
        return _Files(*data, stamp=stamp)

    def files(self) -> _Files:
        """The current files; a half-written rotation keeps the previous ones."""
        now = time.monotonic()
        with self._lock:
            if now - self._checked < self.recheck_s:
                return self._files
            self._checked = now
            try:
                if self._stamp() != self._files.stamp:
                    fresh = self._read()
                    if identity_of_pem(fresh.cert) == self.identity:
                        self._files = fresh
                        log.info("TLS: %s re-read (rotated)", self.dir)
                    else:
                        log.warning("TLS: %s names another identity now: ignored", self.dir)
            except (OSError, TlsError) as err:
                log.warning("TLS: %s unreadable (%s): keeping the previous files", self.dir, err)
            return self._files

    # server side
    def _server_config(self, files: _Files):  # noqa: ANN202
        return grpc.ssl_server_certificate_configuration([(files.key, files.cert)], files.ca)

    def server_credentials(self) -> grpc.ServerCredentials:
        """Mutual TLS, client certificates required and checked against `ca.crt`; re-read on
        rotation at the next handshake."""
        served = [self._files]

        def fetch():  # noqa: ANN202
            files = self.files()
            if files is served[0]:
                return None  # unchanged
            served[0] = files
            return self._server_config(files)

        return grpc.dynamic_ssl_server_credentials(
            self._server_config(self._files), fetch, require_client_authentication=True
        )

    # client side
    def channel_credentials(self) -> grpc.ChannelCredentials:
        files = self.files()
        return grpc.ssl_channel_credentials(files.ca, files.key, files.cert)

    def channel_options(self, server_role: str | None = None) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", target_name(self.identity.cluster, server_role))]


# ---- the peer of a call --------------------------------------------------------------------

_SAN_KEYS = ("peer_spiffe_id", "x509_subject_alternative_name")


def peer_identity_of(auth_context: Mapping[str, Sequence[bytes]] | None) -> Identity | None:
    """The DualPath identity in a call's auth context (its client certificate's SAN URI);
    None for a call without one (no TLS, or a certificate that names none)."""
    if not auth_context:
        return None
    for key in _SAN_KEYS:
        for value in auth_context.get(key, ()):
            who = parse_uri(value.decode() if isinstance(value, bytes) else value)
            if who is not None:
                return who
    for pem in auth_context.get("x509_pem_cert", ()):
        who = identity_of_pem(pem if isinstance(pem, bytes) else pem.encode())
        if who is not None:
            return who
    return None


def issue_all(ca: LocalCA, processes: Iterable[tuple[str, str, str]]) -> dict[str, Path]:
    """A directory per (name, role, node) process: what `dualpath up` gives each process."""
    return {name: ca.issue_dir(name, role, node) for name, role, node in processes}
