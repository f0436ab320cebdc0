"""Certificates of the pods under `spec.security.tls.mode: mtls` (`dualpath.tls`): what each
pod mounts at TLS_MOUNT, and the objects that issue it. Pure: whether cert-manager is there is
found by the shell (`reconcile.resolve_cert_manager`), which sets an unset
`spec.security.tls.certManager` to what it found before rendering.

With cert-manager (`certManager: true`):
- a self-signed Issuer makes the cluster's CA (a Certificate, `isCA`, in Secret `<c>-ca`,
  renewed by cert-manager), and a CA Issuer `<c>-ca` signs with it;
- the scheduler and the frontend get a Certificate each (Secret `<c>-<role>-tls`, renewed
  before expiry; the kubelet swaps the mounted files, the process re-reads them);
- each worker pod gets its own key and certificate from cert-manager's csi-driver
  (`csi.cert-manager.io`), whose SAN URI names the pod (`${POD_NAME}`): a per-pod identity,
  renewed by the driver. The csi-driver must be installed besides cert-manager.

Without it (the operator's own CA): the operator creates, once, Secret `<c>-ca` (the CA key)
and a Secret `<c>-<role>-tls` per role with a role-wide certificate (node `*`): it proves the
role (a decode pod cannot register as a prefill node, call Route or have KV sent to it as a
prefill), not the pod (decode pods share one certificate). Not built: re-issuing before
expiry (the certificates last CA_DAYS; deleting the `<c>-ca` Secret and the role Secrets makes
the operator issue a fresh set, which restarts trust at once, not overlapping).
"""

from __future__ import annotations

from typing import Any

from dualpath.config import ClusterConfig, TlsMode
from dualpath.process import Component
from dualpath.tls import ANY_NODE, CA_DAYS, CA_FILE, CERT_FILE, KEY_FILE, Identity, target_name

from .common import TLS_MOUNT, child_name, metadata

CERT_MANAGER = "cert-manager.io/v1"
CSI_DRIVER = "csi.cert-manager.io"
# cert-manager's renewal: the leaf certificates of the control plane last 30 days, renewed 10
# days before; the CA a year, renewed a month before.
LEAF_DURATION, LEAF_RENEW_BEFORE = "720h", "240h"
CA_DURATION, CA_RENEW_BEFORE = "8760h", "720h"
VOLUME = "tls"


def mtls(cfg: ClusterConfig) -> bool:
    return cfg.spec.security.tls.mode is TlsMode.MTLS


def needs_cert_manager_answer(cfg: ClusterConfig) -> bool:
    """Whether the rendering depends on an unset `certManager` (mTLS without a choice)."""
    return mtls(cfg) and cfg.spec.security.tls.cert_manager is None


def with_cert_manager(cfg: ClusterConfig, found: bool) -> ClusterConfig:
    """`cfg` with an unset `spec.security.tls.certManager` set to `found` (whether the cluster
    serves cert-manager): the operator asks its API server, `dualpath render` its flag. Both
    go through here, so their config hashes agree."""
    if not needs_cert_manager_answer(cfg):
        return cfg
    tls = cfg.spec.security.tls
    security = cfg.spec.security.model_copy(
        update={"tls": tls.model_copy(update={"cert_manager": found})}
    )
    return cfg.model_copy(update={"spec": cfg.spec.model_copy(update={"security": security})})


def use_cert_manager(cfg: ClusterConfig) -> bool:
    """cert-manager issues the certificates (unset: no; the operator resolves it first)."""
    return mtls(cfg) and bool(cfg.spec.security.tls.cert_manager)


def ca_secret_name(cfg: ClusterConfig) -> str:
    return child_name(cfg, "ca")


def tls_secret_name(cfg: ClusterConfig, component: Component | str) -> str:
    return child_name(cfg, f"{Component(component).value}-tls")


def _issuer_name(cfg: ClusterConfig) -> str:
    return child_name(cfg, "ca")


def _dns_names(cfg: ClusterConfig, role: str) -> list[str]:
    return [target_name(cfg.name), target_name(cfg.name, role)]


def tls_mount() -> dict[str, Any]:
    # a directory mount (not subPath): the kubelet swaps the files in place on renewal
    return {"name": VOLUME, "mountPath": TLS_MOUNT, "readOnly": True}


def tls_volume(cfg: ClusterConfig, component: Component) -> dict[str, Any]:
    """The pod's TLS directory: its own csi-driver certificate (a worker under cert-manager)
    or its role's Secret."""
    if use_cert_manager(cfg) and component.role is not None:
        role = component.value
        attrs = {
            "csi.cert-manager.io/issuer-name": _issuer_name(cfg),
            "csi.cert-manager.io/issuer-kind": "Issuer",
            "csi.cert-manager.io/uri-sans": Identity(cfg.name, role, "${POD_NAME}").uri,
            "csi.cert-manager.io/dns-names": ",".join(_dns_names(cfg, role)),
            "csi.cert-manager.io/common-name": f"{role}/${{POD_NAME}}",
            "csi.cert-manager.io/key-usages": "server auth,client auth,digital signature",
            "csi.cert-manager.io/duration": LEAF_DURATION,
            "csi.cert-manager.io/renew-before": LEAF_RENEW_BEFORE,
            "csi.cert-manager.io/certificate-file": CERT_FILE,
            "csi.cert-manager.io/privatekey-file": KEY_FILE,
            "csi.cert-manager.io/ca-file": CA_FILE,
        }
        return {
            "name": VOLUME,
            "csi": {"driver": CSI_DRIVER, "readOnly": True, "volumeAttributes": attrs},
        }
    return {"name": VOLUME, "secret": {"secretName": tls_secret_name(cfg, component)}}


def cert_manager_objects(cfg: ClusterConfig, owner: dict | None) -> list[dict[str, Any]]:
    """The Issuers, the CA Certificate and the control plane's Certificates (the workers'
    come from the csi-driver, per pod)."""
    selfsigned = child_name(cfg, "selfsigned")
    out: list[dict[str, Any]] = [
        {
            "apiVersion": CERT_MANAGER,
            "kind": "Issuer",
            "metadata": metadata(cfg, selfsigned, "tls", owner),
            "spec": {"selfSigned": {}},
        },
        {
            "apiVersion": CERT_MANAGER,
            "kind": "Certificate",
            "metadata": metadata(cfg, ca_secret_name(cfg), "tls", owner),
            "spec": {
                "isCA": True,
                "commonName": f"dualpath {cfg.name} CA",
                "secretName": ca_secret_name(cfg),
                "duration": CA_DURATION,
                "renewBefore": CA_RENEW_BEFORE,
                "privateKey": {"algorithm": "ECDSA", "size": 256},
                "issuerRef": {"name": selfsigned, "kind": "Issuer", "group": "cert-manager.io"},
            },
        },
        {
            "apiVersion": CERT_MANAGER,
            "kind": "Issuer",
            "metadata": metadata(cfg, _issuer_name(cfg), "tls", owner),
            "spec": {"ca": {"secretName": ca_secret_name(cfg)}},
        },
    ]
    for comp in (Component.SCHEDULER, Component.FRONTEND):
        who = Identity(cfg.name, comp.value, comp.value)
        out.append(
            {
                "apiVersion": CERT_MANAGER,
                "kind": "Certificate",
                "metadata": metadata(cfg, tls_secret_name(cfg, comp), comp.value, owner),
                "spec": {
                    "secretName": tls_secret_name(cfg, comp),
                    "commonName": f"{comp.value}/{comp.value}",
                    "uris": [who.uri],
                    "dnsNames": _dns_names(cfg, comp.value),
                    "duration": LEAF_DURATION,
                    "renewBefore": LEAF_RENEW_BEFORE,
                    "usages": ["server auth", "client auth", "digital signature"],
                    "privateKey": {"algorithm": "ECDSA", "size": 256, "rotationPolicy": "Always"},
                    "issuerRef": {
                        "name": _issuer_name(cfg),
                        "kind": "Issuer",
                        "group": "cert-manager.io",
                    },
                },
            }
        )
    return out


def _tls_secret(
    cfg: ClusterConfig, owner: dict | None, name: str, component: str, files: dict[str, bytes]
) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": metadata(cfg, name, component, owner),
        "type": "Opaque",
        "stringData": {k: v.decode() for k, v in files.items()},
    }


def operator_ca_secrets(cfg: ClusterConfig, owner: dict | None) -> list[dict[str, Any]]:
    """A fresh CA Secret and, signed by it, a role-wide certificate Secret per component:
    what the operator creates once without cert-manager (random: never part of `render`)."""
    from dualpath.tls import issue, make_ca

    ca_pem, ca_key = make_ca(cfg.name, CA_DAYS)
    out = [_tls_secret(cfg, owner, ca_secret_name(cfg), "tls", {CA_FILE: ca_pem, "ca.key": ca_key})]
    for comp in Component:
        node = ANY_NODE if comp.role is not None else comp.value
        cert, key = issue(ca_pem, ca_key, Identity(cfg.name, comp.value, node), CA_DAYS)
        files = {CA_FILE: ca_pem, CERT_FILE: cert, KEY_FILE: key}
        out.append(_tls_secret(cfg, owner, tls_secret_name(cfg, comp), comp.value, files))
    return out
