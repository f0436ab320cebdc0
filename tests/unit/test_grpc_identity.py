"""What each identity may call (`grpc_identity.IdentityInterceptor.problem`, pure), and the
TLS directory a process reads (`tls.TlsCredentials`): identities, rotation, bad files."""

import os

import pytest
from dualpath.grpc_identity import IdentityInterceptor, NodeBindings
from dualpath.tls import Identity, LocalCA, TlsCredentials, TlsError, parse_uri
from dualpath.v1 import scheduler_pb2 as pb
from dualpath.v1 import worker_pb2 as wpb

S = "/dualpath.v1.Scheduler/"
W = "/dualpath.v1.Worker/"


def ident(role, node="*", cluster="c1"):
    return Identity(cluster, role, node)


def test_identities_round_trip_through_their_uri():
    who = ident("decode", "decode-3")
    assert who.uri == "spiffe://dualpath/c1/decode/decode-3"
    assert parse_uri(who.uri) == who
    for bad in (
        "spiffe://dualpath/c1/decode",
        "spiffe://dualpath/c1/root/x",  # not a role
        "spiffe://other/c1/decode/d",
        "https://dualpath/c1/decode/d",
        "spiffe://dualpath/c1//d",
    ):
        assert parse_uri(bad) is None, bad


def test_register_binds_a_node_id_to_its_first_identity():
    sched = IdentityInterceptor("scheduler", "c1", NodeBindings())
    reg = pb.RegisterRequest(node_id="decode-5", role=pb.ROLE_DECODE)
    role_wide = ident("decode")  # the operator's fallback: proves the role only
    assert sched.problem(S + "Register", role_wide, reg) is None
    assert "may not register a prefill" in sched.problem(
        S + "Register", role_wide, pb.RegisterRequest(node_id="p", role=pb.ROLE_PREFILL)
    )
    # a per-pod certificate of the same id, later: the id is bound to the first identity
    assert "is bound to" in sched.problem(S + "Register", ident("decode", "decode-5"), reg)
    hb = pb.Heartbeat(node_id="decode-5")
    assert "is bound to" in sched.problem(S + "Heartbeats", ident("decode", "decode-5"), hb)
    assert sched.problem(S + "Heartbeats", role_wide, hb) is None
    # the stream's start (no message yet) is checked for the role only
    assert sched.problem(S + "Heartbeats", ident("frontend", "frontend"), None) is not None


def test_clients_workers_admins_and_other_clusters():
    sched = IdentityInterceptor("scheduler", "c1", NodeBindings())
    fe, admin = ident("frontend", "frontend"), ident("admin", "admin")
    route = pb.RouteRequest(prompt_tokens=8)
    assert sched.problem(S + "Route", fe, route) is None
    assert sched.problem(S + "Route", admin, route) is None
    assert "may not call Route" in sched.problem(S + "Route", ident("decode", "d0"), route)
    assert sched.problem(S + "Drain", admin, pb.DrainRequest(node_id="d7")) is None
    assert "may not act for" in sched.problem(
        S + "Drain", ident("decode", "d0"), pb.DrainRequest(node_id="d7")
    )
    assert sched.problem(S + "ClusterView", ident("prefill", "p0"), pb.ClusterViewRequest()) is None
    assert "another cluster" in sched.problem(S + "ClusterView", ident("admin", "a", "c2"), None)
    assert "no DualPath client certificate" in sched.problem(S + "ClusterView", None, None)
    worker = IdentityInterceptor("decode-worker", "c1")
    gen = wpb.GenerateRequest(request_id="r")
    assert worker.problem(W + "Generate", fe, gen) is None
    assert "may not call Generate" in worker.problem(W + "Generate", ident("decode", "d1"), gen)
    assert worker.problem(W + "GetTransferInfo", ident("prefill", "p0"), None) is None
    assert worker.problem(W + "GetTransferInfo", fe, None) is not None


def test_a_tls_directory_is_re_read_when_rotated_but_never_as_another_identity(tmp_path):
    ca = LocalCA(tmp_path / "tls", "c1")
    d = ca.issue_dir("decode-0", "decode", "decode-0")
    creds = TlsCredentials(d, recheck_s=0.0)
    assert creds.identity == ident("decode", "decode-0")
    first = creds.files().cert
    fresh = LocalCA(tmp_path / "tls2", "c1").issue_dir("x", "decode", "decode-0")
    for f in ("ca.crt", "tls.crt", "tls.key"):
        os.replace(fresh / f, d / f)  # as the kubelet swaps a renewed Secret
    assert creds.files().cert != first  # the renewal is used
    renewed = creds.files().cert
    other = LocalCA(tmp_path / "tls3", "c1").issue_dir("y", "decode", "decode-9")
    for f in ("ca.crt", "tls.crt", "tls.key"):
        os.replace(other / f, d / f)
    assert creds.files().cert == renewed  # another node's certificate: ignored
    (tmp_path / "empty").mkdir()
    with pytest.raises(TlsError, match="--tls-dir .*empty"):
        TlsCredentials(tmp_path / "empty")
    assert (d / "tls.key").stat().st_mode & 0o777 == 0o600


def test_a_nodes_vllm_connector_publishes_kv_events_for_its_node_only():
    """Engine vllm: the connector inside vLLM publishes under `<node>/vllm` with the node's
    own certificate; another node's certificate may not."""
    from dualpath.grpc_identity import node_publisher

    sched = IdentityInterceptor("scheduler", "c1", NodeBindings())
    d0 = ident("decode", "decode-0")
    assert sched.problem(S + "Register", d0, pb.RegisterRequest(node_id="decode-0")) is None
    batch = pb.KvEventBatch(node_id=node_publisher("decode-0", "vllm"), seq=1)
    assert batch.node_id == "decode-0/vllm"
    assert sched.problem(S + "KvEvents", d0, batch) is None
    snap = pb.KvSnapshotChunk(node_id=batch.node_id)
    assert sched.problem(S + "KvSnapshot", d0, snap) is None
    d1 = ident("decode", "decode-1")
    assert "may not act for" in sched.problem(S + "KvEvents", d1, batch)
    # a role-wide certificate proves the role only: the scheduler's binding still holds
    assert "is bound to" in sched.problem(S + "KvEvents", ident("decode"), batch)


def test_a_refusal_echoes_the_callers_values_clipped_with_their_size():
    ic = IdentityInterceptor("scheduler", "c1", NodeBindings())
    huge = "x" * 3_900_000
    problem = ic.problem(
        "/dualpath.v1.Scheduler/Register",
        ident("decode", "decode-0"),
        pb.RegisterRequest(node_id=huge),
    )
    assert problem is not None and len(problem) < 300
    assert "(3900000 characters)" in problem


def test_agent_names_are_matched_whole_not_by_prefix():
    from dualpath.grpc_identity import is_agent_of

    assert is_agent_of("decode-0", "decode-0")
    assert is_agent_of("decode-0-4242-a1b2c3", "decode-0")
    assert is_agent_of("decode-0-vllm-4242-a1b2c3", "decode-0")
    for other in ("decode-0-evil", "decode-0-1-4242-a1b2c3", "decode-00", "decode-0-4242-a1b2c3x"):
        assert not is_agent_of(other, "decode-0"), other


def test_clip_states_the_size_of_what_it_cuts():
    from dualpath.log import clip

    assert clip("short") == "'short'"
    cut = clip("y" * 10_000)
    assert len(cut) < 100 and cut.endswith("... (10000 characters)")
    assert clip(b"z" * 500).endswith("(500 bytes)")
