"""`dualpath bench local --snic-gbps auto`: the SNIC cap keeps a read/compute balance."""

from __future__ import annotations

import argparse

import pytest
from dualpath.config import local_default
from dualpath.local import bench, bench_cli
from dualpath.local.cluster import with_overrides
from dualpath.trace import Trajectory, Turn
from tiny_configs import tiny_model


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    bench_cli.add_arguments(parser)
    return parser


def test_snic_flag_takes_auto_or_gbps_and_refuses_the_rest(capsys) -> None:
    assert _parser().parse_args([]).snic_gbps == "auto"
    assert _parser().parse_args(["--snic-gbps", "0.5"]).snic_gbps == 0.5
    for bad in ("fast", "-1", "nan"):
        with pytest.raises(SystemExit):
            _parser().parse_args(["--snic-gbps", bad])
        assert "--snic-gbps" in capsys.readouterr().err


def test_median_turn_is_the_measured_turns_median_in_whole_blocks() -> None:
    tr = Trajectory("a", [Turn(10, 2), Turn(20, 2), Turn(30, 2), Turn(40, 2)], first_tokens=100)
    # contexts before turns 1..3: 112, 134, 166 -> hit 96, 128, 160 tokens (blocks of 32)
    hit, new = bench.median_turn([tr], warmup_turns=1, block_tokens=32)
    assert (hit, new) == (128, 134 + 30 - 128)
    with pytest.raises(ValueError, match="no measured turns"):
        bench.median_turn([tr], warmup_turns=4, block_tokens=32)


def test_calibration_sets_the_cap_from_the_measured_prefill() -> None:
    cfg = with_overrides(local_default(), model=tiny_model(16))
    tr = Trajectory("a", [Turn(8, 2)] * 4, first_tokens=64)
    cal = bench.calibrate_snic(cfg, [tr], warmup_turns=1, read_to_compute=4.0, samples=3)
    assert cal.hit_tokens % 16 == 0 and cal.hit_tokens > 0 and cal.prefill_s > 0
    # reading the hit at the cap takes read_to_compute x the measured prefill
    read_s = cal.hit_bytes / (cal.snic_gbps * 1e9 / 8)
    assert read_s == pytest.approx(4.0 * cal.prefill_s, rel=0.01)
    assert bench.base_config(_parser().parse_args([]), cal.snic_gbps).spec.storage.snic_gbps == (
        cal.snic_gbps
    )
