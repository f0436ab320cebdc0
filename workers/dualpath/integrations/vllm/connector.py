"""`DualPathConnector`: DualPath's data path inside an unmodified vLLM (KV connector API v1).

Loaded by module path, no vLLM change (docs/vllm.md):

    --kv-transfer-config '{"kv_connector": "DualPathConnector",
      "kv_connector_module_path": "dualpath.integrations.vllm.connector",
      "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
      "kv_connector_extra_config": {"config_file": "cluster.yaml", "storage": "/kv",
                                    "node_id": "decode-0", "scheduler": "host:port"}}'

vLLM builds one instance per role: the scheduler half (`scheduler_side.SchedulerSide`) in its
engine-core process, the worker half (`worker_side.WorkerSide`) in each worker process; this
class only hands vLLM's hooks to them. `kv_connector_extra_config` is
`connector_config.ConnectorConfig` (the adapter writes it with the same class).

A receiver's request (decode), and by default (`hit_load` async) any request with a hit, is
loaded asynchronously (`get_num_new_matched_tokens` answers `(n, True)`: vLLM parks it in
WAITING_FOR_REMOTE_KVS) and reported received by `get_transfer_results` (its NIXL
notification, or its deadline; a hit, its last layer in the cache), failed blocks by
`get_block_ids_with_load_errors` (docs/vllm.md, "The NIXL flow").
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)

from dualpath import config
from dualpath.integrations.vllm.connector_config import ConnectorConfig
from dualpath.integrations.vllm.plan import StepPlan
from dualpath.integrations.vllm.scheduler_side import SchedulerSide
from dualpath.integrations.vllm.worker_side import WorkerSide, layer_index

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.sched.output import SchedulerOutput

log = logging.getLogger(__name__)


def _log_through_vllm() -> None:
    """vLLM's processes configure only the `vllm` logger: send DualPath's lines there too."""
    ours, theirs = logging.getLogger("dualpath"), logging.getLogger("vllm")
    if not ours.handlers and theirs.handlers:
        for h in theirs.handlers:
            ours.addHandler(h)
        ours.setLevel(theirs.level or logging.INFO)
        ours.propagate = False


class DualPathMetadata(KVConnectorMetadata):
    """One step's plan, from the scheduler half to the worker half."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


def _cpu_reshape_and_cache(block_size: int, head_size: int, dtype: torch.dtype):  # noqa: ANN202
    """vLLM's own CPU kernel that writes K/V into the paged cache (the layout check's oracle)."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = _get_attn_isa(dtype, block_size, head_size)

    def write(key, value, key_cache, value_cache, slots):  # noqa: ANN001, ANN202
        ops.cpu_attn_reshape_and_cache(
            key, value, key_cache, value_cache, slots, isa,
            k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto",
        )  # fmt: skip

    return write


class DualPathConnector(KVConnectorBase_V1):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        _log_through_vllm()
        cc = ConnectorConfig.of(self._kv_transfer_config.kv_connector_extra_config)
        self.cfg = config.load_or_default(cc.config_file or None)
        model = self.cfg.spec.model
        self.vllm_block = vllm_config.cache_config.block_size
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            from dualpath.kv.ids import block_ids

            self._scheduler = SchedulerSide(
                self.vllm_block,
                model.block_tokens,
                lambda tokens, salt: block_ids(tokens, model, salt=salt),
                async_loads=cc.hit_load == "async",
            )
        else:
            self._worker = WorkerSide(self.cfg, cc)
        log.info(
            "DualPathConnector (%s): model %s, vLLM block %d = %d store blocks of %d",
            role.name,
            model.name,
            self.vllm_block,
            self.vllm_block // model.block_tokens,
            model.block_tokens,
        )

    # ---- worker side --------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        t = next(iter(kv_caches.values()))
        _, _, block, two_hd = t.shape
        self._worker.register_kv_caches(
            kv_caches, _cpu_reshape_and_cache(block, two_hd // 2, t.dtype)
        )

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            self._worker.step_started()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, DualPathMetadata)
        self._worker.start_load(meta.plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker.wait_for_layer(layer_index(layer_name))

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, DualPathMetadata)
        self._worker.save_layer(meta.plan, layer_index(layer_name), kv_layer)

    def wait_for_save(self) -> None:
        self._worker.finish_loads()
        self._worker.wait_for_save()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        # a receiver past its deadline is reported received, its failed blocks as load errors
        done = self._worker.finished_receiving()
        self._worker.pause_if_idle(done)
        return KVConnectorTransferResults(finished_recving=done)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors() if self._worker is not None else set()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()

    # ---- scheduler side -----------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        ids = blocks.get_block_ids() if num_external_tokens > 0 else ([],)
        self._scheduler.update_state_after_alloc(request, list(ids[0]), num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return DualPathMetadata(self._scheduler.build(scheduler_output))

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return False, self._scheduler.request_finished(request)
