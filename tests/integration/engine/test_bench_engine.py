"""`dualpath bench engine --quick` end to end: the figures it prints exist and are sane."""

import json

from dualpath.cli import main


def test_bench_engine_quick_prints_every_figure(capsys):
    assert main(["bench", "engine", "--preset", "tiny", "--quick", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in (
        "overlap_ratio",
        "overlap_ratio_best_of_each",
        "overlap_ratio_rounds_p10_p90",
        "compute_alone_s",
        "load_alone_s",
        "load_and_compute_s",
        "compute_idle_waiting_s",
        "ideal_whole_layer_ratio",
        "overlap_ratio_at_equal_load",
        "heldout_mean_rel_error",
    ):
        assert key in out, key
    # Shape and arithmetic only: how well load and compute overlap is a wall-clock ratio, the
    # benchmark's figure (`make bench`), never a test's verdict on a shared machine.
    assert out["compute_alone_s"] > 0 and out["load_alone_s"] > 0
    assert out["load_and_compute_s"] > 0 and out["overlap_ratio"] > 0
    lo, hi = out["overlap_ratio_rounds_p10_p90"]
    assert lo <= out["overlap_ratio"] <= hi  # the median lies between its own percentiles
    assert 1.0 <= out["serial_ratio"] <= 2.0  # (a + b) / max(a, b), by definition
    batched = out["batched_prefill"]
    assert batched["identical_outputs"] is True
    assert sum(batched["requests_per_batch"]) == batched["requests"]
    assert max(batched["requests_per_batch"]) > 1  # the quota holds several turns
    for key in ("batched_prefill_ratio", "one_at_a_time_tokens_per_s", "batched_tokens_per_s"):
        assert batched[key] > 0, key
    assert batched["batched_compute"]["jobs"] == batched["batches"]
