"""Prometheus metrics of the vLLM connector, per read path (`path`: prefill, decode)."""

from __future__ import annotations

from prometheus_client import Counter

LOADS = Counter(
    "dualpath_vllm_loads_total", "hits loaded into vLLM's KV cache, by read path", ["path"]
)
HIT_BYTES = Counter(
    "dualpath_vllm_hit_bytes_total",
    "hit KV bytes loaded into vLLM's KV cache, by read path",
    ["path"],
)
HIT_TOKENS = Counter(
    "dualpath_vllm_hit_tokens_total",
    "hit tokens loaded into vLLM's KV cache, by read path",
    ["path"],
)
LOAD_FAILURES = Counter(
    "dualpath_vllm_load_failures_total",
    "hits that ended early (a bad or missing block): vLLM recomputed the rest",
    ["path"],
)
SAVED_BLOCKS = Counter("dualpath_vllm_saved_blocks_total", "store blocks written from vLLM's cache")
SAVE_FAILURES = Counter(
    "dualpath_vllm_save_failures_total", "saves that failed (full or read-only store)"
)
TURNS = Counter(
    "dualpath_vllm_turns_total",
    "turns a vLLM decode node served, by the route's read path (prefill, decode, none)",
    ["path"],
)
TRANSFER_BYTES = Counter(
    "dualpath_vllm_transfer_bytes_total",
    "KV bytes moved over NIXL between vLLM instances, counted by the prefill instance that "
    "moves them, by read path and direction (decode_to_prefill: path D's hit stream; "
    "prefill_to_decode: the blocks the decode lacks)",
    ["path", "direction"],
)
TRANSFERS_RECEIVED = Counter(
    "dualpath_vllm_transfers_received_total",
    "prompts a decode instance received over NIXL (the notification came in time), by path",
    ["path"],
)
TRANSFER_FAILURES = Counter(
    "dualpath_vllm_transfer_failures_total",
    "NIXL transfers between vLLM instances that failed, by path and stage (read: the "
    "prefill recomputed the hit; send: the prefill stopped sending; receive: no notification "
    "by the deadline, the decode recomputed)",
    ["path", "stage"],
)
# where a vLLM instance's time goes (the bench's per-phase breakdown): its forwards' wall time
# (the step's plan bound, before the forward, to the end of wait_for_save), of it the time blocked on hit KV and on saves
# and sends; and the time spent reading hits off the forward thread (a decode's receivers on
# path D; any instance's parked store loads, `hit_load` async)
FORWARD_SECONDS = Counter(
    "dualpath_vllm_forward_seconds_total",
    "wall time of vLLM's forwards (the connector's metadata bound, before the forward, to the "
    "end of wait_for_save)",
)
LOAD_WAIT_SECONDS = Counter(
    "dualpath_vllm_load_wait_seconds_total",
    "forward time blocked in wait_for_layer_load on hit KV, by read path",
    ["path"],
)
SAVE_WAIT_SECONDS = Counter(
    "dualpath_vllm_save_wait_seconds_total",
    "forward time in wait_for_save (NIXL sends to the decode, store writes)",
)
HIT_READ_SECONDS = Counter(
    "dualpath_vllm_hit_read_seconds_total",
    "time spent reading hits from the store off the forward thread, summed over the reads "
    "(a decode instance's receivers on path D, streamed to the prefill layer by layer; the "
    "parked requests of hit_load async)",
)
