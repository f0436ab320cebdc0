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


def test_who_applies_the_count_is_read_from_managed_fields_as_the_api_server_writes_them():
    from dualpath_operator.scaling import applies_count

    entry = {
        "apiVersion": "dualpath.io/v1alpha1",
        "fieldsType": "FieldsV1",
        "fieldsV1": {
            "f:metadata": {"f:labels": {"f:dualpath.io/cluster": {}}},
            "f:spec": {"f:cluster": {}, "f:replicas": {}, "f:role": {}},
        },
        "manager": "dualpath-operator",
        "operation": "Apply",
        "time": "2026-12-04T10:00:00Z",
    }
    scaled = {  # kubectl scale: an Update through the scale subresource
        **entry,
        "manager": "kubectl",
        "operation": "Update",
        "subresource": "scale",
        "fieldsV1": {"f:spec": {"f:replicas": {}}},
    }
    assert applies_count({"metadata": {"managedFields": [entry]}}, "dualpath-operator")
    assert not applies_count({"metadata": {"managedFields": [entry]}}, "someone-else")
    without = {**entry, "fieldsV1": {"f:spec": {"f:cluster": {}, "f:role": {}}}}
    assert not applies_count(
        {"metadata": {"managedFields": [without, scaled]}}, "dualpath-operator"
    )
    assert not applies_count({"metadata": {"managedFields": [scaled]}}, "kubectl")  # an update
    assert not applies_count(None, "dualpath-operator")
