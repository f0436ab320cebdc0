"""A deterministic byte-level tokenizer that fits any model vocab of >= 260 ids.

Ids 0..3 are specials (pad, bos, eos, unk); byte b is id 4 + b. Decoding maps any id >= 4 back
to a byte with (id - 4) % 256, so a seeded model's arbitrary outputs always render as text.
No downloads, no merges: the same text gives the same ids on every process. `save_hf_tokenizer`
writes it as a Hugging Face tokenizer directory (same ids) for clients that count tokens; a
checkpoint's own `tokenizer.json` is served by `HfTokenizer` instead (`load_tokenizer`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path

from dualpath.config import ModelSpec

log = logging.getLogger(__name__)

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
        return render_chat(messages)

    def stream(self) -> StreamDecoder:
        return StreamDecoder(self)


def render_chat(messages: Sequence[dict[str, str]]) -> str:
    """The chat template: one `<|role|>content\\n` line per message, then the assistant cue
    (`CHAT_TEMPLATE` says the same in Jinja, for clients)."""
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


# ---- Hugging Face format ---------------------------------------------------------------------
# Benchmark clients and agents load a tokenizer by path (`AutoTokenizer.from_pretrained(dir)`)
# to count tokens. `save_hf_tokenizer` writes the byte tokenizer in that format with the very
# same ids; a real checkpoint keeps its own `tokenizer.json`, which `load_tokenizer` serves.

SPECIALS = ("<pad>", "<s>", "</s>", "<unk>")  # ids PAD, BOS, EOS, UNK
# Ids past the 256 bytes (vocabSize > 260) decode as byte (id - 4) % 256, as `decode_bytes`
# does: their token is the byte's character plus this marker, stripped by the decoder.
_EXTRA = "⟨{}⟩"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}<|assistant|>"
)


def _byte_chars() -> list[str]:
    """GPT-2's byte -> printable character map (what the ByteLevel pre-tokenizer emits)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    chars = {b: chr(b) for b in bs}
    n = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + n)
            n += 1
    return [chars[b] for b in range(256)]


def hf_byte_tokenizer(vocab_size: int):  # -> tokenizers.Tokenizer
    """The byte tokenizer as a `tokenizers.Tokenizer`: a BPE over the 256 byte characters with
    no merges, so every byte is one token of id 4 + byte, as `ByteTokenizer.encode` gives."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    ByteTokenizer(vocab_size)  # refuses a vocab too small, naming the field
    chars = _byte_chars()
    vocab = {s: i for i, s in enumerate(SPECIALS)}
    vocab.update({c: _OFFSET + b for b, c in enumerate(chars)})
    for i in range(MIN_VOCAB, vocab_size):
        k, b = divmod(i - _OFFSET, 256)
        vocab[chars[b] + _EXTRA.format(k)] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=SPECIALS[UNK]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.Sequence(
        [decoders.Replace(Regex(_EXTRA.format("[0-9]+")), ""), decoders.ByteLevel()]
    )
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    return tok


def save_hf_tokenizer(model: ModelSpec, out: str | Path) -> Path:
    """Write the served model's tokenizer as a Hugging Face directory (`tokenizer.json`,
    `tokenizer_config.json`, `special_tokens_map.json`) that `--tokenizer <dir>` of a client
    loads; a checkpoint with its own `tokenizer.json` is returned as is (nothing written)."""
    if model.checkpoint_path and (Path(model.checkpoint_path) / "tokenizer.json").is_file():
        return Path(model.checkpoint_path)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    hf_byte_tokenizer(model.vocab_size).save(str(out / "tokenizer.json"))
    names = dict(zip(("pad_token", "bos_token", "eos_token", "unk_token"), SPECIALS, strict=True))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **names,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1 << 30,
        "chat_template": CHAT_TEMPLATE,
        "name_or_path": model.name,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(names, indent=2) + "\n")
    log.info("tokenizer of %s written to %s", model.name, out)
    return out


class HfTokenizer:
    """A checkpoint's own `tokenizer.json` (and chat template from `tokenizer_config.json`)."""

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer

        path = Path(path)
        self._tok = Tokenizer.from_file(str(path / "tokenizer.json"))
        cfg_file = path / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        eos = cfg.get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        eos_id = self._tok.token_to_id(eos) if eos else None
        if eos_id is None:
            raise ValueError(f"{cfg_file}: eos_token {eos!r} is not a token of tokenizer.json")
        self.eos_id = eos_id
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        self._template = None
        if template:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            self._template = env.from_string(template)
        self._specials = {k: cfg.get(k) for k in ("bos_token", "eos_token")}
        self.path = path

    def encode(self, text: str, bos: bool = False) -> list[int]:
        return self._tok.encode(text, add_special_tokens=bos).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def chat(self, messages: Sequence[dict[str, str]]) -> str:
        if self._template is None:
            return render_chat(messages)
        specials = {
            k: (v.get("content") if isinstance(v, dict) else v) or ""
            for k, v in self._specials.items()
        }
        return self._template.render(
            messages=list(messages), add_generation_prompt=True, **specials
        )

    def stream(self) -> _HfStream:
        return _HfStream(self._tok)


class _HfStream:
    def __init__(self, tok) -> None:  # noqa: ANN001
        from tokenizers.decoders import DecodeStream

        self._tok = tok
        self._stream = DecodeStream(skip_special_tokens=True)

    def push(self, ids: Sequence[int]) -> str:
        return "".join(self._stream.step(self._tok, i) or "" for i in ids)

    def flush(self) -> str:
        return ""


def load_tokenizer(model: ModelSpec) -> ByteTokenizer | HfTokenizer:
    """The served model's tokenizer: its checkpoint's `tokenizer.json` when it has one, else
    the byte tokenizer (whose Hugging Face twin `save_hf_tokenizer` writes)."""
    if model.checkpoint_path and (Path(model.checkpoint_path) / "tokenizer.json").is_file():
        tok = HfTokenizer(model.checkpoint_path)
        if tok.vocab_size > model.vocab_size:
            raise ValueError(
                f"{model.checkpoint_path}/tokenizer.json has {tok.vocab_size} tokens; "
                f"the model's vocabSize is {model.vocab_size}"
            )
        log.info("tokenizer: %s/tokenizer.json", model.checkpoint_path)
        return tok
    return ByteTokenizer(model.vocab_size)
