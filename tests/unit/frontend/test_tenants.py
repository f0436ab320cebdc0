"""Tenant-isolated KV cache on the frontend (issue 21 item 4): a key's tenant and a request's
`cache_salt` salt the block ids, so one tenant's prompt never hits another's cached prefix.
In process over the ASGI transport with the in-memory backend (its prefix store is keyed by the
same `block_ids`); the real workers are in tests/integration/worker/test_paths.py."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest
from asgi_client import serving
from dualpath.config import ClusterConfig, local_default, parse_spec
from dualpath.frontend.app import create_app
from dualpath.frontend.auth import ApiKeys, cache_salt, key_id
from dualpath.frontend.backend import FakeBackend

CFG = local_default()
MODEL = CFG.spec.model.name
PROMPT = "You are the shared agent system prompt of the platform team. " * 6  # > 4 blocks


def _cfg(**auth) -> ClusterConfig:
    spec = CFG.to_resource()["spec"]
    spec["frontend"] = {**spec["frontend"], "auth": auth}
    return ClusterConfig(name=CFG.name, namespace=CFG.namespace, spec=parse_spec(spec))


def _secret(tmp: Path, data: dict[str, str]) -> Path:
    """A mounted Secret: one file per data entry (links into `..data`, as the kubelet does)."""
    d = tmp / "secret"
    (d / "..data").mkdir(parents=True)
    for k, v in data.items():
        (d / "..data" / k).write_text(v)
        os.symlink(f"..data/{k}", d / k)
    return d


def _app(cfg: ClusterConfig, keys: ApiKeys | None):
    backend = FakeBackend(cfg.spec.model)
    return create_app(cfg, backend, api_keys=keys)


async def _cached(c: httpx.AsyncClient, key: str | None, **extra) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, **extra}
    r = await c.post("/v1/completions", json=body, headers=headers)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_cache_salt_is_empty_only_without_tenant_and_request_salt():
    assert cache_salt("", None) == cache_salt("", "") == b""
    salts = {cache_salt(t, s) for t, s in [("a", None), ("", "a"), ("a", "b"), ("ab", None)]}
    assert len(salts) == 4 and all(len(s) == 32 for s in salts)
    assert cache_salt("a", "b") == cache_salt("a", "b")
    with pytest.raises(ValueError, match="NUL"):
        cache_salt("a\0b", None)


def test_a_keys_tenant_is_its_secret_entry_or_the_key_itself(tmp_path):
    keys = ApiKeys(_secret(tmp_path, {"team-a": "sk-a1\nsk-a2\n", "team-b": "sk-b"}), 0)
    assert keys.identify("sk-a1") == (key_id("sk-a1"), "team-a")
    assert keys.identify("sk-a2")[1] == "team-a" and keys.identify("sk-b")[1] == "team-b"
    assert keys.identify("sk-c") is None
    one_file = tmp_path / "keys"
    one_file.write_text("sk-x\nsk-y\n")
    keys = ApiKeys(one_file, 0)
    assert keys.identify("sk-x")[1] == f"key-{key_id('sk-x')}"
    assert keys.identify("sk-x")[1] != keys.identify("sk-y")[1]
    assert "sk-x" not in keys.identify("sk-x")[1]  # never the raw key


async def test_tenants_hit_their_own_prefix_and_never_anothers(tmp_path):
    keys = ApiKeys(_secret(tmp_path, {"team-a": "sk-a1\nsk-a2\n", "team-b": "sk-b"}), 0)
    app = _app(CFG, keys)
    async with serving(app) as c:
        assert await _cached(c, "sk-a1") == 0
        hit = await _cached(c, "sk-a1")
        assert hit >= 4 * CFG.spec.model.block_tokens
        assert await _cached(c, "sk-a2") == hit  # same tenant (Secret entry), another key
        assert await _cached(c, "sk-b") == 0  # same prompt, another tenant: no hit
        assert await _cached(c, "sk-b") == hit  # its own copy now
        # a request salt partitions the caller's own cache further...
        assert await _cached(c, "sk-a1", cache_salt="run-1") == 0
        assert await _cached(c, "sk-a1", cache_salt="run-1") == hit
        # ...and cannot reach another tenant's partition by naming its salt
        assert await _cached(c, "sk-b", cache_salt="run-1") == 0


async def test_opting_out_shares_one_cache_between_keys(tmp_path):
    keys = ApiKeys(_secret(tmp_path, {"team-a": "sk-a", "team-b": "sk-b"}), 0)
    app = _app(_cfg(secretName="keys", isolateTenants=False), keys)
    async with serving(app) as c:
        assert await _cached(c, "sk-a") == 0
        assert await _cached(c, "sk-b") > 0  # single-tenant cluster: one shared cache
        assert await _cached(c, "sk-b", cache_salt="mine") == 0  # a request salt still applies


async def test_without_keys_the_cache_is_shared_unless_the_request_salts_it():
    app = _app(CFG, None)
    async with serving(app) as c:
        assert await _cached(c, None) == 0
        hit = await _cached(c, None)
        assert hit > 0
        assert await _cached(c, None, cache_salt="s") == 0
        assert await _cached(c, None, cache_salt="s") == hit


@pytest.mark.parametrize("bad", ["", 7, ["a"], "x" * 257])
async def test_a_malformed_cache_salt_is_refused_naming_the_field(bad):
    app = _app(CFG, None)
    async with serving(app) as c:
        for path, body in (
            ("/v1/completions", {"prompt": PROMPT}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ):
            r = await c.post(path, json={"model": MODEL, "cache_salt": bad, **body})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == "cache_salt" and err["code"] == "invalid_parameter"
            assert err["message"].startswith("cache_salt:")


async def test_a_session_id_does_not_cross_tenants(tmp_path):
    """Tenant B naming tenant A's session id gets its own history, not A's token ids."""
    keys = ApiKeys(_secret(tmp_path, {"team-a": "sk-a", "team-b": "sk-b"}), 0)
    app = _app(CFG, keys)
    async with serving(app) as c:
        await _cached(c, "sk-a", session_id="s1")
        sessions = app.state.sessions
        assert len(sessions._s) == 1
        await _cached(c, "sk-b", session_id="s1")
        assert len(sessions._s) == 2  # one history per (tenant, session)
