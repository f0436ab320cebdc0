"""Pure: each StatefulSet's count comes from its pool (the one owner after creation)."""

from dualpath_operator.scaling import plan, pool_count

INITIAL = {"prefill": 4, "decode": 8}


def pool(n):
    return {"spec": {"cluster": "agents", "role": "x", "replicas": n}}


def test_a_pool_not_created_yet_counts_the_cluster_spec_initial_count():
    assert pool_count(None, 8) == 8
    assert pool_count(pool(0), 8) == 0  # zero is a count, not a missing one
    assert pool_count({"spec": {}}, 8) == 8


def test_the_statefulsets_get_the_pools_counts_whatever_the_cluster_spec_says():
    p = plan(INITIAL, {"prefill": pool(1), "decode": pool(12)}, {"prefill": 4, "decode": 8})
    assert (p.target("prefill"), p.target("decode")) == (1, 12)
    assert p.refused is None and p.pools_asking() == ["prefill", "decode"]


def test_an_unsafe_ask_is_refused_and_the_statefulsets_keep_what_they_have():
    p = plan(INITIAL, {"prefill": pool(4), "decode": pool(0)}, {"prefill": 4, "decode": 3})
    assert p.refused and "DualPathPool decode" in p.refused and "prefill" not in p.pools_asking()
    assert (p.target("prefill"), p.target("decode")) == (4, 3)
    # Without a StatefulSet (deleted meanwhile) the cluster spec's count, which parsed as safe.
    p = plan(INITIAL, {"prefill": pool(4), "decode": pool(0)}, {"prefill": 4, "decode": None})
    assert p.target("decode") == 8


def test_scaling_both_to_zero_is_safe():
    p = plan(INITIAL, {"prefill": pool(0), "decode": pool(0)}, {"prefill": 4, "decode": 8})
    assert p.refused is None and (p.target("prefill"), p.target("decode")) == (0, 0)
