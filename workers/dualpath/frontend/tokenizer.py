"""A deterministic byte-level tokenizer that fits any model vocab of >= 260 ids.

Ids 0..3 are specials (pad, bos, eos, unk); byte b is id 4 + b. Decoding maps any id >= 4 back
to a byte with (id - 4) % 256, so a seeded model's arbitrary outputs always render as text.
No downloads, no merges: the same text gives the same ids on every process.
"""

from __future__ import annotations

from collections.abc import Sequence

PAD, BOS, EOS, UNK = 0, 1, 2, 3
_OFFSET = 4
MIN_VOCAB = _OFFSET + 256


class ByteTokenizer:
    def __init__(self, vocab_size: int) -> None:
        if vocab_size < MIN_VOCAB:
            raise ValueError(
                f"vocabSize {vocab_size} is too small for the byte tokenizer; need >= {MIN_VOCAB}"
            )
        self.vocab_size = vocab_size
        self.eos_id = EOS

    def encode(self, text: str, bos: bool = False) -> list[int]:
        ids = [b + _OFFSET for b in text.encode("utf-8")]
        return [BOS, *ids] if bos else ids

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        return bytes((i - _OFFSET) % 256 for i in ids if i >= _OFFSET)

    def decode(self, ids: Sequence[int]) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def chat(self, messages: Sequence[dict[str, str]]) -> str:
        """The chat template: one `<|role|>content\\n` line per message, then the assistant cue."""
        parts = [f"<|{m['role']}|>{m['content']}\n" for m in messages]
        return "".join(parts) + "<|assistant|>"


class StreamDecoder:
    """Incremental decode: emits text only for complete UTF-8 sequences."""

    def __init__(self, tok: ByteTokenizer) -> None:
        self._tok = tok
        self._pending = b""

    def push(self, ids: Sequence[int]) -> str:
        data = self._pending + self._tok.decode_bytes(ids)
        # Keep an incomplete trailing multi-byte sequence for the next push.
        cut = len(data)
        for back in range(1, min(4, len(data)) + 1):
            b = data[-back]
            if b & 0xC0 == 0x80:
                continue
            need = (
                2 if b & 0xE0 == 0xC0 else 3 if b & 0xF0 == 0xE0 else 4 if b & 0xF8 == 0xF0 else 1
            )
            if need > back:
                cut = len(data) - back
            break
        self._pending = data[cut:]
        return data[:cut].decode("utf-8", errors="replace")

    def flush(self) -> str:
        out, self._pending = self._pending.decode("utf-8", errors="replace"), b""
        return out
