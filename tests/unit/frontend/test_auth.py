"""API keys on the frontend (issue 21 item 3): `Authorization: Bearer` against a key file or a
mounted Secret, rotation without a restart, per-key rate limits; /health and /metrics open.
In process over the ASGI transport, and once against a real `dualpath frontend` process."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from asgi_client import serving
from dualpath.config import ClusterConfig, local_default, parse_spec
from dualpath.frontend.app import create_app
from dualpath.frontend.auth import ApiKeys, ApiKeysError, TokenBuckets, key_id
from dualpath.frontend.backend import FakeBackend
from dualpath.local.supervisor import free_port

ROOT = Path(__file__).resolve().parents[3]
CFG = local_default()
MODEL = CFG.spec.model.name
REQ = {"model": MODEL, "prompt": "hello", "max_tokens": 2}


def _cfg(**auth) -> ClusterConfig:
    spec = CFG.to_resource()["spec"]
    spec["frontend"] = {**spec["frontend"], "auth": auth}
    return ClusterConfig(name=CFG.name, namespace=CFG.namespace, spec=parse_spec(spec))


def _app(cfg: ClusterConfig, keys: ApiKeys | None):
    return create_app(cfg, FakeBackend(cfg.spec.model), api_keys=keys)


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_missing_wrong_and_right_keys_and_open_health_and_metrics(tmp_path):
    keys_file = tmp_path / "keys"
    keys_file.write_text("# team a\nsk-alpha\n\nsk-beta\n")
    async with serving(_app(CFG, ApiKeys(keys_file, recheck_s=0))) as c:
        r = await c.post("/v1/completions", json=REQ)
        assert r.status_code == 401
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["code"] == "missing_api_key"
        assert set(err) == {"message", "type", "param", "code"}
        assert r.headers["www-authenticate"].startswith("Bearer")

        r = await c.post("/v1/completions", json=REQ, headers=_bearer("sk-gamma"))
        assert r.status_code == 401
        err = r.json()["error"]
        assert err["type"] == "authentication_error" and err["code"] == "invalid_api_key"
        assert "sk-gamma" not in r.text  # never echoed
        # a prefix of a key, another scheme, an empty bearer: all refused
        for headers in (
            _bearer("sk-alph"),
            {"Authorization": "Basic sk-alpha"},
            {"Authorization": "Bearer "},
        ):
            assert (await c.post("/v1/completions", json=REQ, headers=headers)).status_code == 401

        for key in ("sk-alpha", "sk-beta"):
            r = await c.post("/v1/completions", json=REQ, headers=_bearer(key))
            assert r.status_code == 200, r.text
        r = await c.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
            headers=_bearer("sk-beta"),
        )
        assert r.status_code == 200
        assert (await c.get("/v1/models")).status_code == 401
        assert (await c.get("/v1/models", headers=_bearer("sk-alpha"))).status_code == 200

        assert (await c.get("/health")).status_code == 200
        metrics = await c.get("/metrics")
        assert metrics.status_code == 200
        assert 'dualpath_frontend_auth_refused_total{reason="missing"} 4.0' in metrics.text
        assert 'dualpath_frontend_auth_refused_total{reason="invalid"} 2.0' in metrics.text
        assert 'dualpath_frontend_requests_total{code="401",endpoint="completions"}' in (
            metrics.text
        )


async def test_a_rotated_key_file_takes_effect_without_a_restart(tmp_path):
    keys_file = tmp_path / "keys"
    keys_file.write_text("sk-old\n")
    async with serving(_app(CFG, ApiKeys(keys_file, recheck_s=0))) as c:
        assert (await c.post("/v1/completions", json=REQ, headers=_bearer("sk-old"))).is_success
        keys_file.write_text("sk-new-longer\n")  # rewritten in place
        r = await c.post("/v1/completions", json=REQ, headers=_bearer("sk-new-longer"))
        assert r.status_code == 200
        r = await c.post("/v1/completions", json=REQ, headers=_bearer("sk-old"))
        assert r.status_code == 401


def _kubelet_write(secret_dir: Path, data: dict[str, str], generation: int) -> None:
    """What the kubelet does to a mounted Secret: a new timestamped dir, `..data` swapped to it
    atomically, one link per data entry."""
    ts = secret_dir / f"..{generation}"
    ts.mkdir()
    for k, v in data.items():
        (ts / k).write_text(v)
    tmp = secret_dir / "..data_tmp"
    tmp.symlink_to(ts.name)
    os.replace(tmp, secret_dir / "..data")
    for k in data:
        link = secret_dir / k
        if not link.is_symlink():
            link.symlink_to(f"..data/{k}")


def test_a_mounted_secret_one_key_per_entry_rotates_in_place(tmp_path):
    secret = tmp_path / "secret"
    secret.mkdir()
    _kubelet_write(secret, {"team-a": "sk-a1", "team-b": "sk-b1\nsk-b2\n"}, 1)
    keys = ApiKeys(secret, recheck_s=0)
    assert len(keys) == 3
    assert keys.match("sk-b2") == key_id("sk-b2") and keys.match("sk-a1")
    assert keys.match("..data") is None and keys.match("") is None
    _kubelet_write(secret, {"team-a": "sk-a2", "team-b": "sk-b1\n"}, 2)
    assert keys.match("sk-a2") and keys.match("sk-b1")
    assert keys.match("sk-a1") is None and keys.match("sk-b2") is None


def test_keys_are_rechecked_at_most_every_interval_and_bad_files_refused(tmp_path):
    now = [0.0]
    f = tmp_path / "keys"
    f.write_text("sk-1\n")
    keys = ApiKeys(f, recheck_s=1.0, clock=lambda: now[0])
    f.write_text("sk-22\n")
    assert keys.match("sk-1")  # not re-read within the interval
    now[0] = 1.5
    assert keys.match("sk-22") and not keys.match("sk-1")
    # an emptied or vanished file keeps the last keys (a rotation half done)
    f.write_text("")
    now[0] = 3.0
    assert keys.match("sk-22")
    f.unlink()
    now[0] = 5.0
    assert keys.match("sk-22")
    with pytest.raises(ApiKeysError, match="no such file"):
        ApiKeys(tmp_path / "nope")
    (tmp_path / "empty").write_text("# nothing\n")
    with pytest.raises(ApiKeysError, match="holds no key"):
        ApiKeys(tmp_path / "empty")


def test_token_bucket_refills_at_the_rate():
    now = [0.0]
    b = TokenBuckets(2.0, burst=3, clock=lambda: now[0])
    assert [b.take("k") for _ in range(3)] == [0.0, 0.0, 0.0]
    assert b.take("k") == pytest.approx(0.5)
    assert b.take("other") == 0.0  # per key
    now[0] = 0.5
    assert b.take("k") == 0.0 and b.take("k") > 0
    assert TokenBuckets(0.5).burst == 1


async def test_a_key_over_its_rate_gets_429_with_retry_after(tmp_path):
    keys_file = tmp_path / "keys"
    keys_file.write_text("sk-a\nsk-b\n")
    cfg = _cfg(requestsPerSecond=0.1, burst=2)
    async with serving(_app(cfg, ApiKeys(keys_file, recheck_s=0))) as c:
        codes = [
            (await c.post("/v1/completions", json=REQ, headers=_bearer("sk-a"))).status_code
            for _ in range(2)
        ]
        assert codes == [200, 200]
        r = await c.post("/v1/completions", json=REQ, headers=_bearer("sk-a"))
        assert r.status_code == 429
        assert r.json()["error"]["code"] == "rate_limit_exceeded"
        assert "requestsPerSecond" in r.json()["error"]["message"]
        assert 1 <= int(r.headers["retry-after"]) <= 10
        # another key has its own bucket; health stays open
        assert (await c.post("/v1/completions", json=REQ, headers=_bearer("sk-b"))).is_success
        assert (await c.get("/health")).status_code == 200


def test_a_real_frontend_process_refuses_requests_without_its_key(tmp_path):
    """`dualpath frontend --api-keys FILE` as a process: 401 without the key, 200 with it, a
    rotated file's key accepted within the re-check interval, no restart."""
    keys_file = tmp_path / "keys"
    keys_file.write_text("sk-proc-1\n")
    port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "workers"), os.environ.get("PYTHONPATH", "")]),
    }
    env.pop("DUALPATH_API_KEYS_FILE", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "dualpath.cli", "frontend", "--fake"]
        + ["--host", "127.0.0.1", "--port", str(port), "--api-keys", str(keys_file)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "frontend did not come up"
            time.sleep(0.2)
        with httpx.Client(base_url=url, timeout=10) as c:
            assert c.post("/v1/completions", json=REQ).status_code == 401
            r = c.post("/v1/completions", json=REQ, headers=_bearer("sk-wrong"))
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
            assert c.post("/v1/completions", json=REQ, headers=_bearer("sk-proc-1")).is_success
            assert c.get("/metrics").status_code == 200
            keys_file.write_text("sk-proc-2\n")
            deadline = time.monotonic() + 10
            new, old = _bearer("sk-proc-2"), _bearer("sk-proc-1")
            while c.post("/v1/completions", json=REQ, headers=new).status_code != 200:
                assert time.monotonic() < deadline, "rotated key never accepted"
                time.sleep(0.2)
            assert c.post("/v1/completions", json=REQ, headers=old).status_code == 401
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
