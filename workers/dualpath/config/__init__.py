"""The typed model of a DualPath cluster: the one config every process shares.

A `DualPathCluster` custom resource's `spec` is parsed here (camelCase on the wire,
snake_case in Python). The operator renders it into a ConfigMap, the local cluster and the
simulator build the same object without Kubernetes. Nothing else parses this YAML.

Units: `_gbps` fields are gigabits per second (network convention: a "400 Gbps SNIC");
`_bytes` bytes, `_s` / `Seconds` seconds, `_ms` / `Ms` milliseconds.

One module per section of the spec: `model`, `workers` (the pools, the storage, the worker
processes), `network`, `scheduler`, `frontend`, `security`; what they share in `common`; the
whole cluster, its hash and its parser in `cluster`. `dualpath.config` names them all.
"""

from dualpath.config.cluster import (
    NAME_MESSAGE,
    VLLM_DTYPE_MESSAGE,
    VLLM_MODEL_MESSAGE,
    ClusterConfig,
    ClusterSpec,
    from_resource,
    load,
    load_or_default,
    local_default,
    parse_spec,
)
from dualpath.config.common import (
    API_GROUP,
    API_VERSION,
    API_VERSION_FULL,
    DNS1035_LABEL,
    KIND,
    MAX_NAME_LENGTH,
    METRICS_PORT,
    QUANTITY_PATTERN,
    VOLUME_SOURCES,
    ConfigError,
    Quantity,
    Role,
    check_volume_source,
    volume_message,
)
from dualpath.config.frontend import (
    FrontendAuthSpec,
    FrontendSpec,
)
from dualpath.config.model import (
    DTYPE_BYTES,
    MODEL_PRESETS,
    MODEL_VOLUME_MESSAGE,
    PRESET_FIELDS,
    ModelSpec,
    RopeScaling,
)
from dualpath.config.network import (
    NetworkPoliciesSpec,
    NetworkSpec,
    PolicyPeerSpec,
    QosSpec,
    RdmaSpec,
    TrafficClassSpec,
)
from dualpath.config.scheduler import (
    PolicyName,
    SchedulerSpec,
)
from dualpath.config.security import (
    SecuritySpec,
    TlsMode,
    TlsSpec,
)
from dualpath.config.workers import (
    STORAGE_PATH_MESSAGE,
    VLLM_DTYPES,
    VOLUME_MESSAGE,
    PoolSpec,
    Resources,
    StorageSpec,
    Toleration,
    VllmSpec,
    WorkersSpec,
)

__all__ = [
    "API_GROUP",
    "API_VERSION",
    "API_VERSION_FULL",
    "ClusterConfig",
    "ClusterSpec",
    "ConfigError",
    "DNS1035_LABEL",
    "DTYPE_BYTES",
    "FrontendAuthSpec",
    "FrontendSpec",
    "KIND",
    "MAX_NAME_LENGTH",
    "METRICS_PORT",
    "MODEL_PRESETS",
    "MODEL_VOLUME_MESSAGE",
    "ModelSpec",
    "NAME_MESSAGE",
    "NetworkPoliciesSpec",
    "NetworkSpec",
    "PRESET_FIELDS",
    "PolicyName",
    "PolicyPeerSpec",
    "PoolSpec",
    "QUANTITY_PATTERN",
    "QosSpec",
    "Quantity",
    "RdmaSpec",
    "Resources",
    "Role",
    "RopeScaling",
    "STORAGE_PATH_MESSAGE",
    "SchedulerSpec",
    "SecuritySpec",
    "StorageSpec",
    "TlsMode",
    "TlsSpec",
    "Toleration",
    "TrafficClassSpec",
    "VLLM_DTYPES",
    "VLLM_DTYPE_MESSAGE",
    "VLLM_MODEL_MESSAGE",
    "VOLUME_MESSAGE",
    "VOLUME_SOURCES",
    "VllmSpec",
    "WorkersSpec",
    "check_volume_source",
    "from_resource",
    "load",
    "load_or_default",
    "local_default",
    "parse_spec",
    "volume_message",
]
