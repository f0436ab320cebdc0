"""`CappedDiskConnector`: the `disk` peer of `bench local --peers` (docs/benchmarks.md "Peers").

vLLM's `ExampleConnector` (its KV-to-disk reference connector, one safetensors file a layer
under a folder named by the hash of the prompt's tokens), loaded by module path like the
DualPath connector, with three changes and nothing else of vLLM touched:

- a hit is the longest saved block-aligned prefix of the prompt (vLLM's finds only a prompt
  saved whole, which an agent's next turn, its context plus new tokens, never is);
- every prompt's computed KV is saved, a loading one's too, and only tokens this step
  computed (vLLM's saves the whole prompt's slots at its first step, stale under chunked
  prefill);
- every load's bytes pass the same SNIC token bucket a DualPath node's read queue uses
  (`kv.queue.TokenBucket`, `snic_gbps` in `kv_connector_extra_config`; 0 = uncapped), so the
  peer reads its storage at the DualPath node's cap. Saves are not capped, as DualPath's
  writes are not.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
    ExampleConnector,
    ExampleConnectorMetadata,
)
from vllm.logger import init_logger

from dualpath.kv.queue import TokenBucket

if TYPE_CHECKING:
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

# under vLLM's logger: its process configures only that one (the lines go to the peer's log)
log = init_logger(f"vllm.{__name__}")


def saved_prefix(token_ids: list[int], block: int, exists) -> int:
    """The longest prefix of `token_ids` a multiple of `block` long, at most all but the last
    token (vLLM computes at least one), for which `exists(prefix_tensor)`; 0 if none."""
    ids = torch.tensor(token_ids, dtype=torch.int64)
    for n in range((len(token_ids) - 1) // block * block, 0, -block):
        if exists(ids[:n]):
            return n
    return 0


def stored_tokens(prompt_len: int, computed_after_step: int, block: int) -> int:
    """Tokens of a prompt whose KV this step's save can write whole: those computed by the end
    of the step, down to a block (as `ReqMeta.make_meta` aligns), never past the prompt."""
    return (min(prompt_len, computed_after_step) - 1) // block * block


class CappedDiskConnector(ExampleConnector):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        gbps = float(self._kv_transfer_config.get_from_extra_config("snic_gbps", 0) or 0)
        self.bucket = TokenBucket.for_gbps(gbps) if gbps > 0 else None
        self._load_tokens: dict[str, int] = {}  # request id -> the saved prefix it loads
        self.loaded_bytes = 0
        self.waited_s = 0.0
        log.info("disk connector: %s, loads capped at %s Gbit/s", self._storage_path, gbps or "no")

    # ---- scheduler side ----------------------------------------------------------------------

    def _exists(self, ids: torch.Tensor, mm_hashes: list[str]) -> bool:
        return os.path.exists(self._generate_foldername_debug(ids, mm_hashes))

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        mm = [f.identifier for f in request.mm_features]
        n = saved_prefix(
            list(request.prompt_token_ids or []), self._block_size, lambda t: self._exists(t, mm)
        )
        if n <= num_computed_tokens:
            self._load_tokens.pop(request.request_id, None)
            return 0, False
        self._load_tokens[request.request_id] = n
        return n - num_computed_tokens, False

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ExampleConnectorMetadata:
        meta = ExampleConnectorMetadata()
        for req in scheduler_output.scheduled_new_reqs:
            ids = list(req.prompt_token_ids or [])
            mm = [f.identifier for f in req.mm_features]
            blocks = req.block_ids[0]
            n = (
                self._load_tokens.get(req.req_id, 0)
                if req.req_id in self._requests_need_load
                else 0
            )
            if n:  # make_meta keeps (len - 1) // block * block tokens: n of n + 1
                meta.add_request(ids[: n + 1], blocks, self._block_size, False, mm)
            done = req.num_computed_tokens + scheduler_output.num_scheduled_tokens[req.req_id]
            upto = stored_tokens(len(ids), done, self._block_size)
            if upto > n and not self._exists(torch.tensor(ids[:upto]), mm):
                meta.add_request(ids[: upto + 1], blocks, self._block_size, True, mm)
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            # resumed after a preemption with a load: its blocks are all new (vLLM's own path)
            if rid not in cached.resumed_req_ids or rid not in self._requests_need_load:
                continue
            req, n = self._requests_need_load[rid], self._load_tokens.get(rid, 0)
            blocks = cached.new_block_ids[i]
            if n and blocks is not None:
                mm = [f.identifier for f in req.mm_features]
                meta.add_request(
                    list(req.all_token_ids[: n + 1]), blocks[0], self._block_size, False, mm
                )
        self._requests_need_load.clear()
        self._load_tokens.clear()
        return meta

    # ---- worker side -----------------------------------------------------------------------

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        metadata = self._get_connector_metadata()
        nbytes = 0
        for r in metadata.requests:
            if not r.is_store:
                folder = self._generate_foldername_debug(r.token_ids, r.mm_hashes)
                with os.scandir(folder) as it:
                    nbytes += sum(e.stat().st_size for e in it if e.is_file())
        if nbytes and self.bucket is not None:  # the SNIC first, then the read
            wait = self.bucket.reserve(nbytes)
            if wait > 0:
                time.sleep(wait)
            self.waited_s += wait
        self.loaded_bytes += nbytes
        super().start_load_kv(forward_context, **kwargs)
        if nbytes:
            log.info(
                "disk connector: loaded %d bytes (%d so far, %.2f s waited on the SNIC cap)",
                nbytes,
                self.loaded_bytes,
                self.waited_s,
            )
