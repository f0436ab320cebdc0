"""API keys and per-key rate limits of the HTTP frontend.

Keys come from a file (one key a line; blank lines and `#` comments ignored) or a directory of
such files: a Kubernetes Secret mounted as a volume, one file per data entry. The kubelet
updates a mounted Secret in place (it swaps the `..data` link), so the keys are re-read when a
file's (or the directory's) modification time, size or inode changes, checked at most every
`recheck_s`: a rotated key works without a restart, a removed one stops working. A presented
key's SHA-256 is compared with every key's in constant time (`hmac.compare_digest` over equal
lengths, no early exit).
Requests are counted per key by the SHA-256 prefix of the key, never the key itself.

Tenants (the cache salt, docs/kv.md): a key's tenant is the name of the file it is in when the
keys come from a directory (a Secret's data entry: the keys of one entry are one tenant, so a
key rotated within its entry keeps the tenant's cached KV), and the key's own id when they come
from one file (each key its own tenant). `cache_salt` turns a tenant and a request's
`cache_salt` into the bytes that seed the request's block-id chain.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import os
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

API_KEYS_ENV = "DUALPATH_API_KEYS_FILE"  # `dualpath frontend`'s default for --api-keys


class ApiKeysError(ValueError):
    """The key file cannot be used; the message names the path."""


def key_id(key: str) -> str:
    """What logs, metrics and rate limits call a key: a SHA-256 prefix, not the key."""
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


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


def parse_keys(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]


class ApiKeys:
    """The current set of keys of a file or directory, re-read when it changes."""

    def __init__(
        self,
        path: str | Path,
        recheck_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        flag: str = "--api-keys",
    ) -> None:
        self.path = Path(path)
        self.flag = flag  # what error messages call the path
        self.recheck_s = recheck_s
        self._clock = clock
        self._signature: tuple = ()
        self._keys: list[tuple[bytes, str, str]] = []  # (digest, key id, tenant)
        self._first = ""  # the file's first key: what a client holding the file presents
        self._checked = -math.inf
        if not self.path.exists():
            raise ApiKeysError(f"{flag} {self.path}: no such file or directory")
        self._refresh(force=True)
        if not self._keys:
            raise ApiKeysError(f"{flag} {self.path}: holds no key")

    def _files(self) -> list[Path]:
        if self.path.is_dir():
            # a mounted Secret's entries are links into `..data`; the dot entries are its
            # machinery
            return sorted(
                p for p in self.path.iterdir() if not p.name.startswith(".") and p.is_file()
            )
        return [self.path]

    def _stat_signature(self) -> tuple:
        sig: list[tuple] = []
        for p in [self.path, *self._files()]:
            st = p.stat()  # follows the Secret's links: a swapped `..data` changes the inode
            sig.append((p.name, st.st_ino, st.st_mtime_ns, st.st_size))
        return tuple(sig)

    def _refresh(self, force: bool = False) -> None:
        now = self._clock()
        if not force and now - self._checked < self.recheck_s:
            return
        self._checked = now
        try:
            sig = self._stat_signature()
            if sig == self._signature:
                return
            from_dir = self.path.is_dir()
            keys = {}
            for p in self._files():
                for k in parse_keys(p.read_text()):
                    keys.setdefault(k, p.name if from_dir else f"key-{key_id(k)}")
        except OSError as err:
            # mid-rotation or removed: keep serving with the keys we have
            log.warning("keys at %s unreadable (%s); keeping the previous keys", self.path, err)
            return
        if not keys and self._keys:
            log.warning("keys at %s hold no key; keeping the previous keys", self.path)
            return
        if self._signature:
            log.info(
                "keys at %s changed: %d keys of %d tenants now",
                self.path,
                len(keys),
                len(set(keys.values())),
            )
        self._signature = sig
        self._first = next(iter(keys), "")  # (a dict keeps the file's order)
        # kept as digests: every comparison is of 32 bytes, so not even a key's length leaks
        self._keys = [(_digest(k), key_id(k), tenant) for k, tenant in keys.items()]

    def __len__(self) -> int:
        return len(self._keys)

    @property
    def first(self) -> str:
        """The first current key (re-read when the file changed): what a client presents."""
        self._refresh()
        return self._first

    def match(self, presented: str) -> str | None:
        """The key id of `presented` if it is a current key, else None (constant time per key,
        every key compared)."""
        found = self.identify(presented)
        return found[0] if found else None

    def identify(self, presented: str) -> tuple[str, str] | None:
        """(key id, tenant) of `presented` if it is a current key, else None."""
        self._refresh()
        given = _digest(presented)
        found: tuple[str, str] | None = None
        for digest, kid, tenant in self._keys:
            if hmac.compare_digest(digest, given):
                found = (kid, tenant)
        return found


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
