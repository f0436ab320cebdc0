"""Item 4's bar against the in-memory API: a storm of 50 `kubectl scale dpp/...` interleaved at
random points with the operator's own API calls (stale reads included), the operator killed
mid-pass and restarted twice, ends at the last value asked, for every seed, and rolls no pod.

The pool owns its count after creation (`scaling.py`): the StatefulSet follows it, and an edit
of the cluster spec's count is not a scale."""

import os
import random

import pytest
import yaml
from dualpath_operator.reconcile import Reconciler
from fakeapi import FakeApi, Killed
from test_reconcile import DPC, DPP, ROOT

SCALES = 50
SEEDS = range(int(os.environ.get("DUALPATH_STORM_SEEDS", "20")))


INITIAL_DECODE = 8  # examples/dualpathcluster.yaml


def fresh_api(rng):
    api = FakeApi()
    body = yaml.safe_load((ROOT / "examples" / "dualpathcluster.yaml").read_text())
    api.create(body)
    Reconciler(api).run("default", "agents")
    api.rng, api.stale_reads = rng, 0.25
    api.templates_before = templates(api)
    return api


def values(api):
    """(pool, StatefulSet) replicas of decode: the count and the workload that follows it."""
    return (
        api.obj(*DPP, "agents-decode")["spec"]["replicas"],
        api.obj("apps/v1", "StatefulSet", "agents-decode")["spec"]["replicas"],
    )


def templates(api):
    return {
        role: api.obj("apps/v1", "StatefulSet", f"agents-{role}")["spec"]["template"]
        for role in ("prefill", "decode")
    }


def settle(api):
    """The operator, left alone, converges within two passes and then writes nothing."""
    api.hook, api.stale_reads = None, 0.0
    rec = Reconciler(api)
    for _ in range(2):
        assert rec.run("default", "agents").result == "ok"
    writes = api.writes
    rec.run("default", "agents")
    assert api.writes == writes
    assert templates(api) == api.templates_before  # nothing rolled


@pytest.mark.parametrize("seed", SEEDS)
def test_a_storm_of_pool_scales_with_two_operator_kills_ends_at_the_last_value(seed):
    rng = random.Random(seed)
    api = fresh_api(rng)
    asked = []
    kills = sorted(rng.sample(range(1, SCALES), 2))  # the operator dies during these scales

    def scale():
        n = rng.randint(1, 24)
        asked.append(n)
        api.user_patch_spec(*DPP, "agents-decode", {"replicas": n})

    rec = Reconciler(api)
    i = 0
    while len(asked) < SCALES:
        scale()
        i += 1
        kill_at = rng.randint(1, 40) if i in kills else None
        calls = [0]

        def hook(op, kill_at=kill_at, calls=calls):
            calls[0] += 1
            if kill_at is not None and calls[0] == kill_at:
                raise Killed(op)
            if len(asked) < SCALES and rng.random() < 0.05:
                scale()  # a scale landing between two of the operator's calls

        api.hook = hook
        for _ in range(rng.randint(0, 3)):
            try:
                rec.run("default", "agents")
            except Killed:
                rec = Reconciler(api)  # a new process: no memory of the old one
                break
    settle(api)
    assert values(api) == (asked[-1],) * 2, f"seed {seed}: asked {asked}"
    # The operator never changed a pool's count in a storm of pool scales: any such write
    # would have been a scale undone.
    assert [c for c in api.applied_spec_changes if c[0] == "DualPathPool"] == []


@pytest.mark.parametrize("seed", range(len(SEEDS) // 2))
def test_pool_scales_and_cluster_edits_in_turn_end_at_the_last_scale(seed):
    """Both objects written by people, one write per sync: the last pool scale wins, kills and
    stale reads included; an edit of the cluster spec's count moves nothing (it is the initial
    count only) and stays as the person wrote it (the operator never writes it)."""
    rng = random.Random(1000 + seed)
    api = fresh_api(rng)
    rec, last, edited = Reconciler(api), INITIAL_DECODE, INITIAL_DECODE
    for step in range(30):
        n = rng.randint(1, 24)
        if rng.random() < 0.5:
            api.user_patch_spec(*DPP, "agents-decode", {"replicas": n})
            last = n
        else:
            api.user_patch_spec(*DPC, "agents", {"decode": {"replicas": n}})
            edited = n
        kill_at = rng.randint(1, 30) if step in (7, 19) else None
        calls = [0]

        def hook(op, kill_at=kill_at, calls=calls):
            calls[0] += 1
            if calls[0] == kill_at:
                raise Killed(op)

        api.hook = hook
        try:
            rec.run("default", "agents")
        except Killed:
            rec = Reconciler(api)
            api.hook = None
            api.stale_reads = 0.0
            rec.run("default", "agents")  # the restarted operator's resume pass
            api.stale_reads = 0.25
        # Stale reads may leave a pass undone (it redoes, up to its conflict budget): the next
        # trigger finishes it, as the pool/cluster watch event would.
        api.hook, stale = None, api.stale_reads
        api.stale_reads = 0.0
        rec.run("default", "agents")
        api.stale_reads = stale
        assert values(api) == (last,) * 2, f"seed {seed} step {step}"
        assert api.obj(*DPC, "agents")["spec"]["decode"]["replicas"] == edited
    settle(api)
    assert [c for c in api.applied_spec_changes if c[0] == "DualPathPool"] == []
