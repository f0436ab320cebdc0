"""Token history per agent session, so a turn extending the previous one reuses its exact
token ids (and so its block ids)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from dualpath.frontend.tokenizer import ByteTokenizer, HfTokenizer


def session_key(sid: str | None, salt: bytes) -> str | None:
    """Sessions are per cache salt: one tenant's session id never reaches another's history."""
    return f"{salt.hex()}/{sid}" if sid and salt else sid


@dataclass(slots=True)
class _Session:
    text: str
    ids: list[int]


class Sessions:
    """Token history per session (LRU-bounded): a prompt extending the session's text reuses
    its exact token ids, so the prefix's block ids match what the store holds."""

    def __init__(self, capacity: int = 4096) -> None:
        self._s: OrderedDict[str, _Session] = OrderedDict()
        self.capacity = capacity

    def prompt_ids(self, sid: str | None, text: str, tok: ByteTokenizer | HfTokenizer) -> list[int]:
        s = self._s.get(sid) if sid else None
        if s is not None and text.startswith(s.text):
            self._s.move_to_end(sid)  # type: ignore[arg-type]
            return s.ids + tok.encode(text[len(s.text) :])
        return tok.encode(text)

    def remember(self, sid: str | None, text: str, ids: list[int]) -> None:
        if not sid:
            return
        self._s[sid] = _Session(text, ids)
        self._s.move_to_end(sid)
        while len(self._s) > self.capacity:
            self._s.popitem(last=False)
