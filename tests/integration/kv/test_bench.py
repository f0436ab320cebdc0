"""`dualpath bench store` runs end to end on a tiny data set and reports its fields."""

import argparse
import json

import pytest
from dualpath.kv import bench


def test_bench_store_reports_ratios_and_cleans_up(tmp_path, capsys):
    ns = argparse.Namespace(
        **{
            **vars(bench.default_args()),
            "preset": "tiny",
            "blocks": 4,
            "rounds": 1,
            "backend": "preadv",
            "snic_gbps": 0.05,
            "capped_seconds": 0.2,
            "out": str(tmp_path),
            "json": True,
        }
    )
    assert bench.run(ns) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["backend"] == "preadv"
    for key in ("read_gbps", "raw_read_gbps", "read_ratio", "capped_gbps", "cap_error"):
        assert result[key] >= 0, key
    # read_ratio is rounded from the unrounded figures: equal to the rounded ones' ratio
    # within their rounding (3 decimals each), not digit for digit
    ratio = result["read_gbps"] / result["raw_read_gbps"]
    assert result["read_ratio"] == pytest.approx(ratio, rel=2e-3, abs=1e-3)
    assert [p.name for p in tmp_path.iterdir()] == ["bench_store.json"]  # data set removed


def test_default_args_are_the_llama3_shape():
    ns = bench.default_args()
    assert ns.preset == "llama3-8b" and ns.snic_gbps == 0 and ns.out is None


def test_bench_stdout_is_pure_json_with_nixl(capsys):
    import pytest

    pytest.importorskip("nixl_cu12")
    ns = argparse.Namespace(
        **{**vars(bench.default_args()), "preset": "tiny", "blocks": 2, "rounds": 1, "json": True}
    )
    ns.backend = "nixl"
    assert bench.run(ns) == 0
    assert json.loads(capsys.readouterr().out)["backend"] == "nixl"  # NIXL's logs kept off stdout
