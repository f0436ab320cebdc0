"""API keys and per-key rate limits of the HTTP frontend.

Keys come from a file (one key a line) or a directory of such files (a mounted Secret), read
and re-read on change by `dualpath/keyfile.py` (shared with the cluster token of gRPC).
Requests are counted per key by the SHA-256 prefix of the key, never the key itself.

Tenants (the cache salt, docs/kv.md): a key's tenant is the name of the file it is in when the
keys come from a directory (a Secret's data entry: the keys of one entry are one tenant, so a
key rotated within its entry keeps the tenant's cached KV), and the key's own id when they come
from one file (each key its own tenant). `cache_salt` turns a tenant and a request's
`cache_salt` into the bytes that seed the request's block-id chain.
"""

from __future__ import annotations

import hashlib
import math
import os
import time
from collections.abc import Callable
from pathlib import Path

# the key files are read by the module below both the HTTP keys and the cluster token
from dualpath.keyfile import KeyFile, KeyFileError, key_id, parse_keys

__all__ = ["ApiKeys", "ApiKeysError", "TokenBuckets", "cache_salt", "key_id", "parse_keys"]

API_KEYS_ENV = "DUALPATH_API_KEYS_FILE"  # `dualpath frontend`'s default for --api-keys


class ApiKeysError(KeyFileError):
    """The API key file cannot be used; the message names the path."""


class ApiKeys(KeyFile):
    """The HTTP API's keys (`--api-keys`): a key file whose tenants salt the block ids."""

    def __init__(self, path: str | Path, recheck_s: float = 1.0, **kw) -> None:
        try:
            super().__init__(path, recheck_s, **{"flag": "--api-keys", **kw})
        except KeyFileError as err:
            raise ApiKeysError(str(err)) from None


_SALT_DOMAIN = b"dualpath-cache-salt-v1\0"


def cache_salt(tenant: str, request_salt: str | None = None) -> bytes:
    """The salt of a request's block-id chain: empty (the shared chain) when there is neither
    a tenant nor a request salt, else SHA-256 over both. The tenant always enters: a caller's
    `cache_salt` only partitions its own tenant's cache further, it cannot name another's (a
    tenant has no NUL, so (tenant, salt) pairs never collide)."""
    if not tenant and not request_salt:
        return b""
    if "\0" in tenant:
        raise ValueError("a tenant name must not contain NUL")
    raw = _SALT_DOMAIN + tenant.encode() + b"\0" + (request_salt or "").encode()
    return hashlib.sha256(raw).digest()


class TokenBuckets:
    """One token bucket per key: `rate` requests per second, up to `burst` at once."""

    def __init__(
        self, rate: float, burst: int = 0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if rate <= 0:
            raise ValueError("rate must be > 0 (0 means no limit: use no buckets)")
        self.rate = rate
        self.burst = float(burst or max(1, math.ceil(rate)))
        self._clock = clock
        self._buckets: dict[str, tuple[float, float]] = {}  # key id -> (tokens, at)

    def take(self, kid: str) -> float:
        """0 if the request may go now (a token is taken), else the seconds until it may."""
        now = self._clock()
        tokens, at = self._buckets.get(kid, (self.burst, now))
        tokens = min(self.burst, tokens + (now - at) * self.rate)
        if tokens >= 1.0:
            self._buckets[kid] = (tokens - 1.0, now)
            return 0.0
        self._buckets[kid] = (tokens, now)
        return (1.0 - tokens) / self.rate


def default_keys_path() -> str | None:
    return os.environ.get(API_KEYS_ENV) or None
