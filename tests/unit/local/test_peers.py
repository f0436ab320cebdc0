"""`dualpath bench local --engine vllm --peers`: the router's request shapes (vLLM's P/D proxy
protocol), the bench's replay through it, the error rows captured from a peer's own logs and
the table, with fake vLLM instances (no vLLM needed)."""

from __future__ import annotations

import argparse
import asyncio
import json
import stat
from pathlib import Path

import httpx
import pytest
from dualpath.config import local_default
from dualpath.local import bench, bench_cli, peers
from dualpath.local.cluster import with_overrides
from dualpath.local.peer_router import REMOTE_DECODE, PeerRouter, decode_body, prefill_body
from dualpath.trace import Trajectory, Turn

BODY = {
    "model": "m",
    "prompt": [5, 6, 7],
    "max_tokens": 4,
    "temperature": 0,
    "stream": True,
    "stream_options": {"include_usage": True},
    "session_id": "bench-0-a",
}


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_cli.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_prefill_request_is_the_toy_proxys_and_the_decode_gets_its_kv_params() -> None:
    pre = prefill_body(BODY)
    assert pre["max_tokens"] == 1 and pre["stream"] is False
    assert pre["kv_transfer_params"] == REMOTE_DECODE and REMOTE_DECODE["do_remote_decode"]
    assert "stream_options" not in pre and "session_id" not in pre
    assert pre["prompt"] == BODY["prompt"] and BODY["max_tokens"] == 4  # the caller's is intact
    params = {"do_remote_prefill": True, "remote_engine_id": "e1", "remote_block_ids": [3]}
    dec = decode_body(BODY, params)
    assert dec["kv_transfer_params"] == params and dec["max_tokens"] == 4 and dec["stream"]
    assert dec["return_token_ids"] is True and "session_id" not in dec


class FakeVllm:
    """vLLM instances behind one fake transport: a prefill answers its KV params, a streamed
    request answers `ids` one token a chunk with `token_ids` deltas, then usage."""

    def __init__(self, ids: list[int]) -> None:
        self.ids, self.seen = ids, []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.seen.append((request.url.host + ":" + str(request.url.port), body))
        if not body.get("stream"):
            return httpx.Response(200, json={"kv_transfer_params": {"remote_engine_id": "p0"}})
        lines = []
        for i, tok in enumerate(self.ids):
            last = i == len(self.ids) - 1
            choice = {"text": "x", "token_ids": [tok], "finish_reason": "length" if last else None}
            lines.append("data: " + json.dumps({"choices": [choice]}))
        usage = {
            "prompt_tokens": len(body["prompt"]),
            "prompt_tokens_details": {"cached_tokens": 0},
        }
        lines += ["data: " + json.dumps({"choices": [], "usage": usage}), "data: [DONE]"]
        return httpx.Response(200, content=("\n\n".join(lines) + "\n\n").encode())


def _replay(router: PeerRouter, trajectories: list[Trajectory]) -> list[bench.TurnResult]:
    async def go() -> list[bench.TurnResult]:
        async with httpx.AsyncClient(base_url="http://peer", transport=router) as client:
            return await bench.replay(client, trajectories, "m", 4096, warmup_turns=1)

    return asyncio.run(go())


def test_the_benchs_replay_runs_through_the_pd_router_and_reads_its_answers() -> None:
    fake = FakeVllm([11, 12, 13])
    router = PeerRouter(
        ["http://d0:1", "http://d1:1"],
        ["http://p0:1"],
        path="nixl-pd",
        upstream=httpx.MockTransport(fake),
    )
    trs = [Trajectory(a, [Turn(8, 3)] * 3, first_tokens=16) for a in ("a", "b")]
    results = _replay(router, trs)
    assert len(results) == 6 and all(r.ok for r in results)
    assert all(r.generated == [11, 12, 13] and r.read_path == "nixl-pd" for r in results)
    hosts = [h for h, _ in fake.seen]
    # every turn: the prefill first (not streamed), then its decode (streamed)
    assert hosts.count("p0:1") == 6 and len(hosts) == 12
    decodes = [(h, b) for h, b in fake.seen if b.get("stream")]
    assert all(b["kv_transfer_params"] == {"remote_engine_id": "p0"} for _, b in decodes)
    # sticky: each agent's turns (its prompts share their first tokens) on one decode
    # instance, the two agents on two
    by_agent: dict[tuple[int, ...], set[str]] = {}
    for h, b in decodes:
        by_agent.setdefault(tuple(b["prompt"][:16]), set()).add(h)
    assert sorted(by_agent.values(), key=sorted) == [{"d0:1"}, {"d1:1"}]


def test_a_sticky_router_sends_an_agents_turns_to_one_instance() -> None:
    fake = FakeVllm([9])
    router = PeerRouter(
        ["http://v0:1", "http://v1:1", "http://v2:1"],
        path="vllm",
        upstream=httpx.MockTransport(fake),
    )
    trs = [Trajectory(a, [Turn(8, 1)] * 3, first_tokens=16) for a in ("a", "b", "c")]
    results = _replay(router, trs)
    assert all(r.ok for r in results)
    # an agent's prompt grows turn by turn: its three requests share their first 16 tokens
    by_prefix: dict[tuple[int, ...], set[str]] = {}
    for host, body in fake.seen:
        assert "kv_transfer_params" not in body and body["return_token_ids"]
        by_prefix.setdefault(tuple(body["prompt"][:16]), set()).add(host)
    assert len(by_prefix) == 3 and all(len(h) == 1 for h in by_prefix.values())
    assert set().union(*by_prefix.values()) == {"v0:1", "v1:1", "v2:1"}


def test_an_instance_refusal_reaches_the_replay_as_a_failed_turn() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        return httpx.Response(500, json={"error": {"message": "boom"}})

    router = PeerRouter(["http://v0:1"], path="vllm", upstream=httpx.MockTransport(refuse))
    results = _replay(router, [Trajectory("a", [Turn(8, 1)] * 2, first_tokens=16)])
    assert len(results) == 1 and not results[0].ok and "HTTP 500" in results[0].error


LMCACHE_LOG = """\
(APIServer pid=1) INFO 12-06 21:00:00 [api_server.py:1] vLLM API server version 0.32.0
[2026-12-06 21:00:05,000] LMCache ERROR: Failed to initialize LMCacheManager components
Traceback (most recent call last):
  File "lmcache/v1/gpu_connector/__init__.py", line 247, in CreateGPUConnector
RuntimeError: No supported cpu connector found.
(APIServer pid=1) INFO 12-06 21:00:09 [launcher.py:1] Route: /v1/completions
[2026-12-06 21:00:05,000] LMCache ERROR: Failed to initialize LMCacheManager components
"""


def test_error_lines_are_captured_verbatim_once_each_with_the_final_exception() -> None:
    got = peers.captured_errors(LMCACHE_LOG)
    assert got == [
        "[2026-12-06 21:00:05,000] LMCache ERROR: Failed to initialize LMCacheManager components",
        "RuntimeError: No supported cpu connector found.",
    ]
    assert peers.captured_errors("INFO all good\n") == []
    many = "\n".join(f"x ERROR e{i}" for i in range(9)) + "\nValueError: last\n"
    assert peers.captured_errors(many, limit=3)[-1] == "ValueError: last"


def test_a_peer_that_cannot_start_is_a_row_with_the_error_its_own_process_printed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # a caller's own would win
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    vllm = venv / "bin" / "vllm"
    vllm.write_text(
        "#!/bin/sh\necho 'INFO starting'\necho \"threads=$OMP_NUM_THREADS\"\n"
        "echo 'RuntimeError: No supported cpu connector found.' >&2\nexit 3\n"
    )
    vllm.chmod(vllm.stat().st_mode | stat.S_IEXEC)
    peer = peers.Peer("lmcache", "fake", venv=venv, known_limit="no CPU connector")
    cfg = with_overrides(
        local_default(), **{"model.checkpointPath": str(tmp_path), "decode.replicas": 1}
    )
    args = _args("--out", str(tmp_path / "out"))
    row = peers.run_peer(peer, cfg, [], args, {}, "1/1 peer lmcache")
    assert not row.ran and row.result is None
    assert row.errors[0].endswith("exited with status 3 before it was ready")
    assert "RuntimeError: No supported cpu connector found." in row.errors
    assert row.why == "no CPU connector" and row.loadavg
    # the environment the DualPath instances get: one torch thread each (the cores are shared)
    (log,) = (tmp_path / "out").rglob("vllm-0.log")
    assert "threads=1" in log.read_text()
    table = peers.peers_table([row])
    assert "did not run" in table and "No supported cpu connector found." in table


def test_answers_are_counted_equal_on_the_turns_both_answered() -> None:
    ref = {("a", 0): [1, 2], ("a", 1): [3], ("b", 0): [4]}
    assert peers.answers_equal(ref, {("a", 0): [1, 2], ("a", 1): [9], ("c", 0): [1]}) == (1, 2)


def test_the_table_has_a_row_a_peer_with_its_ratio_to_dualpath() -> None:
    ran = peers.PeerRow(
        "vllm",
        "plain vLLM",
        True,
        {"tokens_per_s": 500.0, "turns": 96, "ttft_p50_s": 0.5, "ttft_p99_s": 1.5, "failed": 0},
        {"prefix_cache": 2 * 10**9, "connector": 0, "nixl": 0},
        90,
        96,
        loadavg=[10.0, 12.0],
    )
    ref = peers.PeerRow(
        "dualpath",
        "DualPath",
        True,
        {"tokens_per_s": 250.0, "turns": 96, "ttft_p50_s": 1.0, "ttft_p99_s": 2.0, "failed": 1},
        {"store_prefill": 10**9},
        96,
        96,
    )
    text = peers.peers_table([ref, ran])
    line = next(ln for ln in text.splitlines() if ln.startswith("vllm "))
    assert "2.00" in line and "90/96" in line and "prefix_cache 2000" in line and "10-12" in line


def test_peers_flag_takes_all_or_known_names() -> None:
    assert _args("--peers").peers == list(peers.PEERS)
    assert _args("--peers", "vllm,nixl-pd").peers == ["vllm", "nixl-pd"]
    assert _args().peers is None
    with pytest.raises(SystemExit):
        _args("--peers", "sglang")


def test_bytes_per_path_come_from_vllms_counters() -> None:
    got = peers.bytes_by_path(
        {peers.PREFIX_HITS: 100.0, peers.EXTERNAL_HITS: 10.0, peers.NIXL_BYTES: 5e6}, 16384
    )
    assert got == {"prefix_cache": 1638400, "connector": 163840, "nixl": 5000000}


def test_generated_text_with_unicode_line_separators_does_not_split_a_chunk() -> None:
    # vLLM writes text unescaped: U+2028 / U+0085 inside a JSON string are not line ends
    def answer(request: httpx.Request) -> httpx.Response:
        chunk = {"choices": [{"text": "a\u2028b\x85c", "token_ids": [7], "finish_reason": "stop"}]}
        usage = {"prompt_tokens": 3, "prompt_tokens_details": {"cached_tokens": 0}}
        body = "data: " + json.dumps(chunk, ensure_ascii=False) + "\n\n"
        body += "data: " + json.dumps({"choices": [], "usage": usage}) + "\n\ndata: [DONE]\n\n"
        return httpx.Response(200, content=body.encode())

    router = PeerRouter(["http://v0:1"], path="vllm", upstream=httpx.MockTransport(answer))
    results = _replay(router, [Trajectory("a", [Turn(8, 1)] * 2, first_tokens=16)])
    assert [r.generated for r in results] == [[7], [7]] and all(r.ok for r in results)


def test_coloured_log_levels_are_captured_without_their_colour_codes() -> None:
    line = "\x1b[31;20m[2026-12-07 00:07:27,463] LMCache ERROR:\x1b[0m Failed to initialize"
    assert peers.captured_errors(line) == [
        "[2026-12-07 00:07:27,463] LMCache ERROR: Failed to initialize"
    ]


def _agents(n: int, first: int = 1000, turns: int = 3) -> list[Trajectory]:
    return [
        Trajectory(f"a{i}", [Turn(append_tokens=100, gen_tokens=50)] * turns, first_tokens=first)
        for i in range(n)
    ]


def test_the_peers_kv_cache_is_below_an_instances_agents_contexts_and_holds_the_largest_turn() -> (
    None
):
    # 4 agents on 2 instances: each keeps 2 contexts of 1450 tokens (12 blocks of 128)
    cap = peers.kv_cap(_agents(4), 2, 128, 1000)
    assert (cap.largest_turn_blocks, cap.working_set_blocks) == (12, 24)
    assert cap.blocks == 12 and cap.below_working_set  # half of 24, and the largest turn fits
    assert cap.bytes == 12 * 128 * 1000
    # 8 agents on 2 instances: half the 48 blocks they keep
    assert peers.kv_cap(_agents(8), 2, 128, 1000).blocks == 24
    # one agent an instance: the largest turn must fit, and then its context stays in DRAM
    alone = peers.kv_cap(_agents(2), 2, 128, 1000)
    assert alone.blocks == 12 and not alone.below_working_set
    assert "12 blocks of 128 tokens" in cap.describe() and "auto" in cap.describe()


def test_peer_kv_blocks_off_keeps_vllms_default_and_a_number_must_hold_the_largest_turn() -> None:
    off = peers.kv_cap(_agents(4), 2, 128, 1000, "off")
    assert off.blocks is None and not off.below_working_set and "1 GiB" in off.describe()
    assert peers.kv_cap(_agents(4), 2, 128, 1000, "20").blocks == 20
    assert peers.kv_cap([], 2, 128, 1000).blocks is None  # no turn to size it from
    with pytest.raises(ValueError, match="largest turn needs 12 blocks"):
        peers.kv_cap(_agents(4), 2, 128, 1000, "11")
    assert _args("--peer-kv-blocks", "7").peer_kv_blocks == "7"
    assert _args().peer_kv_blocks == "auto"
    with pytest.raises(SystemExit):
        _args("--peer-kv-blocks", "0")


def test_a_capped_vllm_gets_the_blocks_and_a_context_they_hold(tmp_path: Path) -> None:
    from dualpath.integrations.vllm.server import vllm_serve

    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "vllm").write_text("")
    cfg = with_overrides(local_default(), **{"model.checkpointPath": str(tmp_path)})
    argv = vllm_serve(cfg, port=1, kv_transfer=None, venv=venv, kv_blocks=12).argv
    # vLLM holds one block back and refuses a context its cache cannot hold
    assert argv[argv.index("--num-gpu-blocks-override") + 1] == "13"
    assert argv[argv.index("--max-model-len") + 1] == str(12 * 128)
    plain = vllm_serve(cfg, port=1, kv_transfer=None, venv=venv).argv
    assert "--num-gpu-blocks-override" not in plain
    assert plain[plain.index("--max-model-len") + 1] == "16384"


def test_only_the_disk_peer_reads_storage_through_the_snic_cap(tmp_path: Path) -> None:
    disk = peers.PEERS["disk"].kv_transfer(0, tmp_path, 0.5)
    assert disk["kv_connector_module_path"] == "dualpath.integrations.vllm.disk_connector"
    assert disk["kv_connector_extra_config"]["snic_gbps"] == 0.5
    assert "not SNIC-capped" in peers.PEERS["lmcache"].what
    assert peers.PEERS["vllm"].kv_transfer(0, tmp_path, 0.5) is None
