"""The tiny cluster the multi-process tests run: the tiny model and small KV buffers, written
once. Importable from every test (`pythonpath = ["tests"]` in pyproject.toml), as fake_clock."""

from __future__ import annotations

from pathlib import Path

import yaml
from dualpath.config import ClusterConfig, from_resource, local_default
from dualpath.local.cluster import with_overrides


def tiny_model(block_tokens: int = 16) -> dict:
    """The `spec.model` of the tiny preset (CPU-fast), `block_tokens` per KV block."""
    return {"name": "dualpath-tiny", "preset": "tiny", "blockTokens": block_tokens}


def pools(replicas: int, buffer_bytes: int) -> dict:
    """`spec.prefill` and `spec.decode` alike: `replicas` workers of `buffer_bytes` KV buffer."""
    pool = {"replicas": replicas, "kvBufferBytes": buffer_bytes}
    return {"prefill": pool, "decode": dict(pool)}


def tiny_cluster(name: str, block_tokens: int = 16, **spec: object) -> ClusterConfig:
    """A DualPathCluster of the tiny model and the given `spec` sections (camelCase, as in a
    CR: `prefill={"replicas": 1}`); every other field at its default."""
    return from_resource(
        {
            "apiVersion": "dualpath.io/v1alpha1",
            "kind": "DualPathCluster",
            "metadata": {"name": name},
            "spec": {"model": tiny_model(block_tokens), **spec},
        }
    )


def tiny_local(
    block_tokens: int = 16, buffer_bytes: int = 64 << 20, **spec_paths: object
) -> ClusterConfig:
    """`dualpath up`'s local default with the tiny model, `buffer_bytes` of KV buffer per
    prefill and decode worker, and `spec_paths` (dotted camelCase: `**{"storage.path": p}`)."""
    return with_overrides(
        local_default(),
        **{
            "model": tiny_model(block_tokens),
            "prefill.kvBufferBytes": buffer_bytes,
            "decode.kvBufferBytes": buffer_bytes,
            **spec_paths,
        },
    )


def write_config(cfg: ClusterConfig, path: Path) -> Path:
    """`cfg` as the DualPathCluster YAML file a process reads with `-f`."""
    path.write_text(yaml.safe_dump(cfg.to_resource()))
    return path
