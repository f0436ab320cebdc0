"""Secret key files: the keys of a file (one a line; blank lines and `#` comments ignored) or
of a directory of such files (a Kubernetes Secret mounted as a volume, one file per data
entry), re-read when they change. Below both of their users: the HTTP API keys
(`frontend/auth.py`) and the cluster token of gRPC (`grpc_auth.py`).

The kubelet updates a mounted Secret in place (it swaps the `..data` link), so the keys are
re-read when a file's (or the directory's) modification time, size or inode changes, checked at
most every `recheck_s`: a rotated key works without a restart, a removed one stops working. A
presented key's SHA-256 is compared with every key's in constant time (`hmac.compare_digest`
over equal lengths, no early exit). A key's tenant is the name of the file it is in when the
keys come from a directory, and the key's own id when they come from one file.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)


class KeyFileError(ValueError):
    """The key file cannot be used; the message names the flag and the path."""


def key_id(key: str) -> str:
    """What logs, metrics and rate limits call a key: a SHA-256 prefix, not the key."""
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def parse_keys(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]


class KeyFile:
    """The current set of keys of a file or directory, re-read when it changes."""

    def __init__(
        self,
        path: str | Path,
        recheck_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        flag: str = "--keys",
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
            raise KeyFileError(f"{flag} {self.path}: no such file or directory")
        self._refresh(force=True)
        if not self._keys:
            raise KeyFileError(f"{flag} {self.path}: holds no key")

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
