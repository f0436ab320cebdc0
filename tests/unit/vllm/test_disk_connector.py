"""The `disk` peer's connector (`bench local --peers`): vLLM's ExampleConnector with prefix
hits, saves of computed KV only, and loads through the SNIC token bucket (no vLLM engine: the
connector's halves are driven with the scheduler's and the worker's inputs)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.example_connector")

import torch  # noqa: E402
from dualpath.integrations.vllm import disk_connector as dc  # noqa: E402
from dualpath.kv.queue import TokenBucket  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (  # noqa: E402
    ExampleConnector,
    ExampleConnectorMetadata,
)

B = 4  # tokens a block


def _connector(tmp_path: Path, bucket: TokenBucket | None = None) -> dc.CappedDiskConnector:
    """The connector's state without vLLM's config (what __init__ sets from it)."""
    c = dc.CappedDiskConnector.__new__(dc.CappedDiskConnector)
    c._block_size, c._storage_path = B, str(tmp_path)
    c._requests_need_load, c._load_tokens = {}, {}
    c.bucket, c.loaded_bytes, c.waited_s = bucket, 0, 0.0
    return c


def _save(c: dc.CappedDiskConnector, ids: list[int], nbytes: int) -> None:
    folder = Path(c._generate_foldername_debug(torch.tensor(ids), [], create_folder=True))
    (folder / "layer.0.safetensors").write_bytes(b"x" * nbytes)


def test_the_hit_is_the_longest_saved_block_prefix_never_the_last_token() -> None:
    saved = {8, 4}
    assert dc.saved_prefix(list(range(11)), B, lambda t: len(t) in saved) == 8
    assert dc.saved_prefix(list(range(9)), B, lambda t: len(t) in saved) == 8
    assert dc.saved_prefix(list(range(8)), B, lambda t: len(t) in saved) == 4  # one left to compute
    assert dc.saved_prefix(list(range(11)), B, lambda t: False) == 0


def test_a_save_covers_only_the_tokens_computed_by_the_end_of_the_step() -> None:
    assert dc.stored_tokens(prompt_len=11, computed_after_step=11, block=B) == 8
    assert dc.stored_tokens(prompt_len=11, computed_after_step=6, block=B) == 4  # chunked
    assert dc.stored_tokens(prompt_len=11, computed_after_step=3, block=B) == 0


def test_an_agents_next_turn_loads_its_saved_context_and_saves_its_own(tmp_path: Path) -> None:
    c = _connector(tmp_path)
    turn1 = list(range(9))
    _save(c, turn1[:8], 100)
    turn2 = [*turn1, 50, 51, 52, 53]  # the context, its answer and new tokens
    req = SimpleNamespace(request_id="r", prompt_token_ids=turn2, mm_features=[])
    assert c.get_num_new_matched_tokens(req, 4) == (4, False)  # 8 saved, 4 in DRAM
    c.update_state_after_alloc(req, None, 4)
    new = SimpleNamespace(
        req_id="r",
        prompt_token_ids=turn2,
        mm_features=[],
        block_ids=([3, 5, 7, 9],),
        num_computed_tokens=8,
    )
    out = SimpleNamespace(
        scheduled_new_reqs=[new],
        num_scheduled_tokens={"r": 5},
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], resumed_req_ids=set()),
    )
    meta = c.build_connector_meta(out)
    load, store = meta.requests
    assert not load.is_store and load.token_ids.tolist() == turn2[:8]
    assert load.slot_mapping.tolist() == [12, 13, 14, 15, 20, 21, 22, 23]
    assert store.is_store and store.token_ids.tolist() == turn2[:12]
    assert not c._requests_need_load and not c._load_tokens
    # nothing saved for this prompt: no hit
    other = SimpleNamespace(request_id="o", prompt_token_ids=[9] * 12, mm_features=[])
    assert c.get_num_new_matched_tokens(other, 0) == (0, False)


def test_a_load_waits_on_the_snic_bucket_for_the_bytes_it_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    now = [0.0]
    bucket = TokenBucket(1000.0, burst_bytes=0, clock=lambda: now[0])  # 1000 bytes/s
    c = _connector(tmp_path, bucket)
    _save(c, [1, 2, 3, 4], 500)
    meta = ExampleConnectorMetadata()
    meta.add_request([1, 2, 3, 4, 5], [0], B, False, [])
    meta.add_request([7, 7, 7, 7, 7], [1], B, True, [])  # a save: not a read
    c._get_connector_metadata = lambda: meta
    slept, loaded = [], []
    monkeypatch.setattr(dc.time, "sleep", slept.append)
    monkeypatch.setattr(ExampleConnector, "start_load_kv", lambda self, fc, **kw: loaded.append(fc))
    c.start_load_kv("fc")
    assert slept == [pytest.approx(0.5)] and loaded == ["fc"]  # the wait, then vLLM's read
    assert c.loaded_bytes == 500 and bucket.granted_bytes == 500
    free = _connector(tmp_path)
    free._get_connector_metadata = lambda: meta
    slept.clear()
    free.start_load_kv("fc")
    assert slept == [] and free.loaded_bytes == 500
