"""`spec.security`: how the cluster's processes authenticate each other on gRPC (mutual TLS with
cert-manager or the operator's CA, the shared token, or off)."""

from __future__ import annotations

from enum import Enum

from dualpath.config.common import _Model


class TlsMode(str, Enum):
    MTLS = "mtls"
    TOKEN = "token"
    OFF = "off"


class TlsSpec(_Model):
    """How DualPath processes authenticate each other on gRPC."""

    mode: TlsMode = TlsMode.MTLS
    """mtls: every process has its own certificate (role and node id in its SAN URI) and every
    channel is mutual TLS; the scheduler binds a node id to the certificate that registered it.
    token: plaintext gRPC with the one shared cluster token. off: neither (trusted networks
    and tests only)."""
    cert_manager: bool | None = None
    """Issue the certificates with cert-manager (an Issuer over the cluster's CA and, per worker
    pod, its csi-driver); unset: when the operator finds cert-manager's CRDs. false: the
    operator's own CA in a Secret, with one certificate per role (proves the role, not the
    pod)."""


class SecuritySpec(_Model):
    """Trust between the cluster's pods."""

    tls: TlsSpec = TlsSpec()
    """Authentication of gRPC between processes."""
