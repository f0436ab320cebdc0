"""`dualpath render -f cluster.yaml`: exactly the manifests the operator applies (and, with
`--token-secret`, the random token Secret it creates once; with `--tls-secrets`, the CA and role
certificate Secrets it creates once without cert-manager)."""

from __future__ import annotations

import argparse
import sys

import yaml
from dualpath import config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-f", "--file", help="DualPathCluster YAML (default: embedded local)")
    parser.add_argument("--uid", help="owner uid to set ownerReferences (as the operator does)")
    parser.add_argument("--crds", action="store_true", help="print the CRDs first")
    parser.add_argument(
        "--token-secret",
        action="store_true",
        help="also print the cluster token Secret with a fresh random token, which the operator "
        "creates once when absent (without the operator: `kubectl create` it once; applying a "
        "new one rotates the token under running pods)",
    )
    parser.add_argument(
        "--tls-secrets",
        action="store_true",
        help="also print a fresh CA Secret and the role certificate Secrets it signs, which the "
        "operator creates once under security.tls.mode mtls without cert-manager (without the "
        "operator: `kubectl create` them once)",
    )
    parser.add_argument(
        "--cert-manager",
        choices=("yes", "no"),
        default="no",
        help="whether the target cluster serves cert-manager, for an mTLS spec that leaves "
        "security.tls.certManager unset (the operator asks its API server; default: no)",
    )


def run(args: argparse.Namespace) -> int:
    from dualpath.grpc_auth import new_token

    from .builders import operator_ca_secrets, render, token_secret, with_cert_manager
    from .crd import cluster_crd, pool_crd

    try:
        cfg = config.load_or_default(args.file)
    except config.ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    cfg = with_cert_manager(cfg, getattr(args, "cert_manager", "no") == "yes")
    owner = {"name": cfg.name, "uid": args.uid} if args.uid else None
    docs = ([cluster_crd(), pool_crd()] if args.crds else []) + render(cfg, owner)
    if getattr(args, "token_secret", False):  # callers may build the namespace themselves
        docs.insert(0, token_secret(cfg, owner, new_token()))
    if getattr(args, "tls_secrets", False):
        docs[:0] = operator_ca_secrets(cfg, owner)
    sys.stdout.write(yaml.safe_dump_all(docs, sort_keys=False))
    return 0
