"""The SNIC token bucket's accounting, on an injected clock (no timing asserts)."""

import pytest
from dualpath.kv.queue import TokenBucket


def test_bucket_paces_to_rate_after_burst(fake_clock):
    clock = fake_clock
    bucket = TokenBucket(rate_bytes_per_s=1000.0, burst_bytes=100.0, clock=clock)
    assert bucket.reserve(100) == 0.0  # the burst is free
    for _ in range(50):
        clock.sleep(bucket.reserve(200))
    # 10000 bytes after the burst at 1000 B/s: exactly 10 s of waiting
    assert clock.t == pytest.approx(10.0)
    assert bucket.granted_bytes == 10100


def test_bucket_refills_while_idle_but_only_up_to_burst(fake_clock):
    clock = fake_clock
    bucket = TokenBucket(rate_bytes_per_s=1000.0, burst_bytes=100.0, clock=clock)
    bucket.reserve(100)
    clock.sleep(60.0)  # idle for a minute: still only `burst` banked
    assert bucket.reserve(100) == 0.0
    assert bucket.reserve(500) == pytest.approx(0.5)


def test_for_gbps_uses_gigabits(fake_clock):
    bucket = TokenBucket.for_gbps(8.0, clock=fake_clock)
    assert bucket.rate == 1e9  # 8 Gbit/s = 1 GB/s


def test_bucket_refuses_zero_rate():
    with pytest.raises(ValueError):
        TokenBucket(0, 1)
